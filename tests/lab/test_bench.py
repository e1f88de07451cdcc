"""``gpufleet bench`` on the lab (scenario ``faults``, before the upgrades: the records it keeps are the stored
baseline their canaries are compared with): each replica shape's ceiling (lab1's one-node replica, and the pipeline
over lab2 and lab3; the ramp: tests/lab/benching.py), the records on the monitoring host, the plot, the ceiling
Prometheus reads and ``gpufleet plan --observed``; then the capacity alert under a load through the routers above
80% of the measured ceiling, and the dashboard's load-against-ceiling queries.

The client runs on the controller, the bridge side of the lab, on no lab node; each step is bounded (rate x step
requests, a hard stop) and ends by itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from gpufleet.monitoring import dashboards
from tests.lab.benching import GPUFLEET, OFFERED_RPS, STEP_S, bench_argv, dataset, ensure_records, kept_records, ramp
from tests.lab.fleet import PIPELINE, served_name, single
from tests.lab.harness import LAB_VLLM_VERSION, ROOT, Completed, Lab
from tests.lab.prometheus import Prometheus, needs_a_bench, queries_without_data, wait_for

pytestmark = pytest.mark.filterwarnings("ignore:Unknown ssh-ed25519 host key:UserWarning")

CAPACITY_LOAD = 1.25  # the load the capacity alert must see, as a share of the model's ceiling
CAPACITY_FIRE_S = 150  # rate over 1 min past 80% (about 40 s), the lab's 15 s wait, scrapes and evaluations


def test_bench_finds_each_shapes_ceiling_and_keeps_it(
        lab: Lab, faults: Completed | None, tmp_path: Path) -> None:
    records, shown = {}, {}
    for replica in (single(lab), PIPELINE):
        records[replica], shown[replica] = ramp(lab, tmp_path, replica)
    for replica, record in records.items():
        steps = record["steps"]
        assert (record["ceiling_offered_rps"], record["scope"]) == (OFFERED_RPS, "replica"), steps
        # what it answered over the step's span, first request to last answer (lab: 80 answered in 19.9 s, 4.02 a
        # second, at 4 offered)
        assert 0.95 * OFFERED_RPS <= record["ceiling_rps"] <= 1.05 * OFFERED_RPS, steps
        assert record["stopped_by"] != "none" and steps[-1]["rate"] == 96.0, steps
        assert all(s["offered"] == s["rate"] * float(STEP_S) for s in steps), steps
        assert all(s["kv_usage_max"] is not None and s["engine_itl_p99_s"] is not None for s in steps), steps
        assert sum(line.startswith("step ") for line in shown[replica].splitlines()) == len(steps)
        assert f"req/s answered at {OFFERED_RPS:g} offered" in shown[replica]
        assert (tmp_path / f"{replica}.svg").read_text().startswith("<svg")
    assert (records[single(lab)]["layout"], records[PIPELINE]["layout"]) == ("tp1-pp1", "tp1-pp2")
    again = {replica: ramp(lab, tmp_path / "again", replica, store=False)[0] for replica in records}
    agree = {replica: (records[replica]["ceiling_rps"], again[replica]["ceiling_rps"]) for replica in records}
    print(json.dumps({"two_runs_ceiling_rps": agree}))
    assert all(abs(a - b) <= 0.15 * max(a, b) for a, b in agree.values()), agree
    scopes = {(doc["layout"], doc["scope"]) for doc in kept_records(lab)}
    assert {("tp1-pp1", "replica"), ("tp1-pp2", "replica")} <= scopes

    ceiling = sum(record["ceiling_rps"] for record in records.values())  # the model: one replica of each shape
    prometheus = Prometheus(lab.nodes[0])
    found, _ = wait_for("the model's ceiling in Prometheus",
                        lambda: prometheus.query("gpufleet:model_ceiling_rps") or None, timeout=60)
    assert found[0]["metric"]["model"] == served_name("lab")
    assert float(found[0]["value"][1]) == pytest.approx(ceiling)
    target = 1.99 * ceiling  # four replicas' worth, whatever the last digit of the sums
    planned = subprocess.run([*GPUFLEET, "plan", "inventories/lab.py", "--observed", "--target-rps",
                              repr(target)], cwd=ROOT, env=lab.env, capture_output=True, text=True, timeout=300)
    assert planned.returncode == 0, planned.stderr[-2000:]
    said = re.search(rf'ceiling of "{re.escape(served_name("lab"))}": ([0-9.]+) req/s over 2 replicas', planned.stdout)
    assert said and float(said[1]) == pytest.approx(ceiling, rel=1e-3), planned.stdout
    assert f"; {target:g} req/s needs 4 replicas" in planned.stdout, planned.stdout


def test_the_capacity_alert_fires_under_a_load_above_80_percent_of_the_measured_ceiling(
        lab: Lab, faults: Completed | None, tmp_path: Path) -> None:
    """One-token completions through the routers (the alert counts requests, whatever their size) at 1.25 times
    the model's measured ceiling, from the bench's client, bounded and stopping by itself: the alert fires, and
    the dashboard's load-against-ceiling queries have data. (Below 80% it stays quiet:
    tests/lab/test_upgrade.py's good release, under about 40% of it.)"""
    ensure_records(lab, tmp_path, LAB_VLLM_VERSION)
    prometheus = Prometheus(lab.nodes[0])
    found, _ = wait_for("the model's ceiling in Prometheus",
                        lambda: prometheus.query("gpufleet:model_ceiling_rps") or None, timeout=60)
    ceiling = float(found[0]["value"][1])
    load = CAPACITY_LOAD * ceiling
    tiny = dataset(tmp_path / "one-token.jsonl", int(load * CAPACITY_FIRE_S) + 10, (2, 4), (1, 1))
    argv, env = bench_argv(lab, "--rates", f"{load:g}", "--step-s", str(CAPACITY_FIRE_S), "--slo",
                           f"ttft_p99_s={CAPACITY_FIRE_S / 10:g},itl_p99_s=60", "--dataset", str(tiny), "--no-store")
    sender = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    started = time.monotonic()
    try:
        fired, took = wait_for("ModelNearItsCeiling firing",
                               lambda: prometheus.firing().get("ModelNearItsCeiling"), timeout=CAPACITY_FIRE_S,
                               every=5)
        assert fired[0]["model"] == served_name("lab"), fired
        benched = [q for q in dashboards.panel_queries() if needs_a_bench(q)]
        assert benched and queries_without_data(prometheus, benched, {"model": served_name("lab")}) == {}
        rate = float(prometheus.query("model:router_requests:rate1m")[0]["value"][1])
        assert rate > 0.8 * ceiling, rate
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(sender.pid, signal.SIGTERM)  # the bench and the client it runs
        output, _ = sender.communicate(timeout=120)
    print(json.dumps({"capacity_alert_fired_after_s": round(took, 1), "load_rps": load, "ceiling_rps": ceiling,
                      "router_rate1m": rate, "load_ran_s": round(time.monotonic() - started, 1)}))
    assert "Traceback" not in output, output[-2000:]
