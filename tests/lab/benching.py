"""``gpufleet bench`` as the lab tests run it: the client on the controller (guidellm, installed once a session by
``gpufleet bench-client`` from its lock, torch's CPU build found in the lab's wheelhouse), a short ramp of each
replica shape on a workload of long answers, and the records it keeps (the stored baseline of the upgrades'
canaries)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from gpufleet_lab.mirror import bench_client_find_links

from gpufleet.measure.records import RECORDS_DIR
from tests.lab.fleet import PIPELINE, single
from tests.lab.harness import ROOT, Lab

GPUFLEET = [sys.executable, "-m", "gpufleet.cli.main"]
# Objectives on bounds of vLLM's histogram buckets (TTFT ... 1.0, 2.5, 5.0 ...; ITL ... 0.4, 0.5, 0.75 ...): a step
# is judged on vLLM's histograms, whose p99 within a bucket is interpolated, so an objective inside one is met or
# missed by where a single slow request falls in it (seen: 80 requests at 4 req/s, the client's TTFT p99 1.36 s, one
# request over 1 s, vLLM's p99 interpolated to 2.1 s in the 1-2.5 s bucket: a 2 s objective missed). On a bound,
# p99 <= objective holds exactly when 99% of the requests met it.
SLO = "ttft_p99_s=2.5,itl_p99_s=0.5"
# A rate every shape meets (the lab's TTFT p99 jumps to most of a second now and then on its two shared cores: the
# objective leaves room for it), and one far past what two cores answer: the ceiling is what each shape answered at
# 4 req/s. Outputs of 160 to 192 tokens: with 96 to 112, the single replica answered 57 to 64 of them a second, about
# what the client on the same two cores sends, and the step at 96 req/s missed its TTFT objective by 19% in one run
# (p99 2.38 s) and met it in the next. With longer answers the replica answers fewer (47.5 a second, TTFT p99 2.46 s,
# its queue full: errors and unanswered too) while the client sends as many.
# Steps of 25 s: the shortest a 2.5 s TTFT objective allows (gpufleet.measure.ramp). The
# README's bench ramps the pipeline replica on the bench's own workload (outputs of about 32 tokens): 4 req/s, then
# 192 (at 96 it answered all 1,920 requests within 2.7 s of the step, 85 a second, TTFT p99 0.9 s: no knee).
RATES = "4,96"
OFFERED_RPS = 4.0
STEP_S = "25"
ROWS = 2500  # the step at 96 req/s sends 2,400: each request its own prompt (gpufleet bench refuses fewer)


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
    """The command line and environment of ``gpufleet bench inventories/lab/inventory.py ARGS`` against the lab (the
    routers'
    CA from the inventory's router_tls_ca, as the README runs it)."""
    install_client()
    return [*GPUFLEET, "bench", "inventories/lab/inventory.py", *args], lab.env


def run_bench(lab: Lab, folder: Path, name: str, args: list[str]) -> tuple[dict[str, Any], str]:
    """``gpufleet bench inventories/lab/inventory.py ARGS --report folder/NAME.json --plot folder/NAME.svg``: the record
    and
    what the bench printed."""
    folder.mkdir(parents=True, exist_ok=True)
    report = folder / f"{name}.json"
    argv, env = bench_argv(lab, *args, "--report", str(report), "--plot", str(folder / f"{name}.svg"))
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(report.read_text()), done.stdout


def ramp(lab: Lab, folder: Path, replica: str, store: bool = True) -> tuple[dict[str, Any], str]:
    """The lab's ramp of one replica on long answers, its record kept on the monitoring host unless ``store`` is
    false: the record and what the bench printed; the plot is ``folder/<replica>.svg``."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = dataset(folder / "long-outputs.jsonl", ROWS, (6, 16), (160, 192))
    return run_bench(lab, folder, replica, ["--replica", replica, "--slo", SLO, "--rates", RATES, "--step-s", STEP_S,
                                            "--dataset", str(rows), *(() if store else ("--no-store",))])


@contextlib.contextmanager
def steady_load(lab: Lab, folder: Path, rps: float, seconds: int) -> Iterator[Callable[[], None]]:
    """One-token completions through the routers at ``rps`` for at most ``seconds``, from the bench's client (one
    step of ``gpufleet bench``, not stored: bounded, and it stops by itself), stopped when the block ends. Yields a
    check that fails, with what the bench printed, once the sender has ended before the block."""
    rows = dataset(folder / "one-token.jsonl", int(rps * seconds) + 10, (2, 4), (1, 1))
    argv, env = bench_argv(lab, "--rates", f"{rps:g}", "--step-s", str(seconds), "--slo",
                           f"ttft_p99_s={seconds / 10:g},itl_p99_s=60", "--dataset", str(rows), "--no-store")
    sender = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)

    printed: list[str] = []

    def sending() -> None:
        if sender.poll() is not None:
            printed.append(sender.communicate()[0])
            raise AssertionError(f"the load ended early (exit {sender.returncode}): {printed[0][-3000:]}")

    try:
        yield sending
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(sender.pid, signal.SIGTERM)  # the bench and the client it runs
        if not printed:
            printed.append(sender.communicate(timeout=120)[0])
    assert "Traceback" not in printed[0], printed[0][-2000:]


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
