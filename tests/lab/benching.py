"""``gpufleet bench`` as the lab tests run it: the client on the controller (guidellm, installed once a session by
``gpufleet bench-client`` from its lock, torch's CPU build found in the lab's wheelhouse), a short ramp of each
replica shape on a workload of long answers, and the records it keeps (the stored baseline of the upgrades'
canaries)."""

from __future__ import annotations

import functools
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

from gpufleet_lab.mirror import bench_client_find_links

from gpufleet.bench.records import RECORDS_DIR
from tests.lab.fleet import PIPELINE, single
from tests.lab.harness import ROOT, Lab

GPUFLEET = [sys.executable, "-m", "gpufleet.cli.main"]
SLO = "ttft_p99_s=2,itl_p99_s=0.5"
# A rate every shape meets (the lab's TTFT p99 jumps to most of a second now and then on its two shared cores: the
# objective leaves room for it), and one far past what two cores answer (about 50 of these requests a second: at 96
# req/s the queue grows by over 40 requests a second, 20 s of TTFT by the step's end): the ceiling is what each
# shape answered at 4 req/s. Steps of 20 s: the shortest a 2 s TTFT objective allows (gpufleet.bench.ramp).
RATES = "4,96"
OFFERED_RPS = 4.0
STEP_S = "20"


def dataset(path: Path, rows: int, words: tuple[int, int], output_tokens: tuple[int, int]) -> Path:
    """Prompts of random words and the output tokens each asks for, in gpufleet bench's --dataset form."""
    pick = random.Random(29)
    vocabulary = ["the", "fleet", "serves", "many", "routers", "while", "replicas", "answer", "across", "a", "model"]
    with path.open("w") as out:
        for _ in range(rows):
            prompt = " ".join(pick.choice(vocabulary) for _ in range(pick.randint(*words)))
            out.write(json.dumps({"prompt": prompt, "output_tokens": pick.randint(*output_tokens)}) + "\n")
    return path


@functools.cache
def install_client() -> None:
    """``gpufleet bench-client``, once a session (a client installed from the current lock is left as it is)."""
    done = subprocess.run([*GPUFLEET, "bench-client", "--find-links", bench_client_find_links()], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def bench_argv(lab: Lab, *args: str) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of ``gpufleet bench inventories/lab.py ARGS`` against the lab (the routers'
    CA from the inventory's router_tls_ca, as the README runs it)."""
    install_client()
    return [*GPUFLEET, "bench", "inventories/lab.py", *args], lab.env


def ramp(lab: Lab, folder: Path, replica: str, store: bool = True) -> tuple[dict[str, Any], str]:
    """The lab's ramp of one replica, its record kept on the monitoring host unless ``store`` is false: the record
    (``--report``) and what the bench printed; the plot is ``folder/<replica>.svg``."""
    folder.mkdir(parents=True, exist_ok=True)
    report = folder / f"{replica}.json"
    rows = dataset(folder / "long-outputs.jsonl", 1000, (6, 16), (96, 112))
    argv, env = bench_argv(lab, "--replica", replica, "--slo", SLO, "--rates", RATES, "--step-s", STEP_S,
                           "--dataset", str(rows), "--report", str(report), "--plot", str(folder / f"{replica}.svg"),
                           *(() if store else ("--no-store",)))
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(report.read_text()), done.stdout


def kept_records(lab: Lab) -> list[dict[str, Any]]:
    """The records on the monitoring host (lab1)."""
    text = lab.host(lab.nodes[0]).run(f"cat {RECORDS_DIR}/*.json").stdout
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def ensure_records(lab: Lab, folder: Path, release: str) -> None:
    """Each replica shape has a record of ``release`` on the monitoring host (tests/lab/test_bench.py keeps them;
    a test run on its own benches here what is missing)."""
    kept = {(doc["release"], doc["layout"], doc["scope"]) for doc in kept_records(lab)}
    for layout, replica in (("tp1-pp1", single(lab)), ("tp1-pp2", PIPELINE)):
        if (release, layout, "replica") not in kept:
            ramp(lab, folder, replica)
