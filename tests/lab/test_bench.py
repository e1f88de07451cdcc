"""``gpufleet bench`` on the lab (scenario ``faults``, before the upgrades: the records it keeps are the stored
baseline their canaries are compared with): each replica shape's ceiling (lab1's one-node replica, measured twice,
and the pipeline over lab2 and lab3), the record on the monitoring host and the plot, the ceiling Prometheus
reads, ``gpufleet plan --observed``; and the capacity alert under a load above 80% of the measured ceiling, quiet
under one below it.

The client (guidellm, installed once under ~/.cache/gpufleet with torch's CPU build from the lab's wheelhouse)
runs on the controller: the bridge side of the lab, no lab node. Each step is bounded (rate x step requests, a
hard stop) and ends by itself.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from gpufleet_lab.mirror import bench_client_pip_args

from gpufleet.bench.guidellm_client import PIP_ARGS_ENV
from gpufleet.bench.records import RECORDS_DIR
from gpufleet.monitoring import dashboards
from tests.lab.fleet import PIPELINE, lab_ca, served_name, single
from tests.lab.harness import ROOT, Completed, Lab
from tests.lab.prometheus import Prometheus, needs_a_bench, queries_without_data, wait_for

pytestmark = pytest.mark.filterwarnings("ignore:Unknown ssh-ed25519 host key:UserWarning")

GPUFLEET = [sys.executable, "-m", "gpufleet.cli.main"]
SLO = "ttft_p99_s=1,itl_p99_s=0.25"
RATES = {"single": "4,8,16,32", "pipeline": "2,4,8,16"}  # each shape's ramp: the last step is past its knee
STEP_S = "5"
AGREE = 0.15  # two runs' ceilings differ by at most this share of the larger


def _bench(lab: Lab, tmp_path: Path, name: str, *args: str) -> tuple[dict[str, Any], str]:
    report = tmp_path / f"{name}.json"
    env = {**lab.env, PIP_ARGS_ENV: bench_client_pip_args()}
    done = subprocess.run([*GPUFLEET, "bench", "inventories/lab.py", "--slo", SLO, "--step-s", STEP_S,
                           "--ca-file", lab_ca(lab), "--report", str(report), "--plot", str(tmp_path / f"{name}.svg"),
                           *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(report.read_text()), done.stdout


def test_bench_finds_each_shapes_ceiling_alike_twice_and_keeps_it(lab: Lab, faults: Completed | None,
                                                                  tmp_path: Path) -> None:
    first, shown = _bench(lab, tmp_path, "single-1", "--replica", single(lab), "--rates", RATES["single"])
    again, _ = _bench(lab, tmp_path, "single-2", "--replica", single(lab), "--rates", RATES["single"])
    pipeline, _ = _bench(lab, tmp_path, "pipeline", "--replica", PIPELINE, "--rates", RATES["pipeline"])
    for record in (first, again, pipeline):
        assert record["ceiling_rps"] is not None and record["stopped_by"] != "none", record["steps"]
        assert all(step["kv_usage_max"] is not None for step in record["steps"]), record["steps"]
    assert (first["layout"], pipeline["layout"]) == ("tp1-pp1", "tp1-pp2")
    assert abs(first["ceiling_rps"] - again["ceiling_rps"]) <= AGREE * max(first["ceiling_rps"], again["ceiling_rps"])
    assert sum(line.startswith("step ") for line in shown.splitlines()) == len(first["steps"])
    assert "ceiling: " in shown and (tmp_path / "single-1.svg").read_text().startswith("<svg")
    kept = lab.host(lab.nodes[0]).check_output(f"cat {RECORDS_DIR}/*.json")
    scopes = {(doc["layout"], doc["scope"]) for doc in map(json.loads, kept.splitlines())}
    assert {("tp1-pp1", "replica"), ("tp1-pp2", "replica")} <= scopes
    ceiling = again["ceiling_rps"] + pipeline["ceiling_rps"]  # the model: one replica of each shape
    prometheus = Prometheus(lab.nodes[0])
    found, _ = wait_for("the model's ceiling in Prometheus",
                        lambda: prometheus.query("gpufleet:model_ceiling_rps") or None, timeout=60)
    assert found[0]["metric"]["model"] == served_name("lab")
    assert float(found[0]["value"][1]) == pytest.approx(ceiling)
    benched = [q for q in dashboards.panel_queries() if needs_a_bench(q)]
    assert benched
    _, router_load = wait_for("the routers' request rate", lambda: prometheus.query("model:router_requests:rate1m")
                              or None, timeout=90)
    assert queries_without_data(prometheus, benched, {"model": served_name("lab")}) == {}, router_load
    planned = subprocess.run([*GPUFLEET, "plan", "inventories/lab.py", "--observed", "--target-rps",
                              str(2 * ceiling)], cwd=ROOT, env=lab.env, capture_output=True, text=True, timeout=300)
    assert planned.returncode == 0, planned.stderr[-2000:]
    assert f'ceiling of "{served_name("lab")}": {ceiling:g} req/s over 2 replicas' in planned.stdout
    assert f"; {2 * ceiling:g} req/s needs 4 replicas" in planned.stdout
