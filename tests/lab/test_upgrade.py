"""Rolling upgrades on the lab: ``gpufleet upgrade`` and ``gpufleet rollback`` behind the routers on lab1 and lab2,
while a bounded load generator sends completions and streamed chats through their virtual address (HTTPS, the lab
client's key) the whole time.

Scenario ``faults``: the lab's default deployment, both replicas of the tiny model (lab1's, and
lab2+lab3's pipeline replica) serve vLLM 0.31.0 behind the routers, benched (tests/lab/test_bench.py). The tests
first roll a release slower per token to lab1's replica (caught at the canary on its bench record, and rolled back),
then the mirror's other vLLM release, 0.32.0, with a KV cache no node has room for (it never starts: rolled back at
the canary). The README's upgrade then brings the fleet to 0.32.0 as it should run: its canary, lab1's replica, is a
good release judged on the same record, and passes, right after a rolled-back upgrade to the same release. The
README's rollback returns both replicas to the lab's inventory as deployed, each one's previous release: the fleet
ends as the scenario found it (no deploy after these tests restarts a replica).
Each rollout's figures go to the session's lab-fault-figures.jsonl.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from gpufleet_lab.request_load import RequestLoad
from gpufleet_lab.wheelhouse import LAB_VLLM_VERSIONS

from tests.lab.benching import ensure_records
from tests.lab.fleet import (
    INVENTORY,
    PIPELINE,
    client_key,
    http,
    lab_ca,
    lab_copy,
    record_figure,
    router_retries,
    router_url,
    served_name,
    single,
    tls,
)
from tests.lab.harness import LAB_VLLM_VERSION, ROOT, Completed, Lab
from tests.lab.prometheus import Prometheus, router_rate, wait_for
from tests.lab.readme_tour import starting

pytestmark = pytest.mark.filterwarnings("ignore:Unknown ssh-ed25519 host key:UserWarning")

GPUFLEET = [sys.executable, "-m", "gpufleet.cli.main"]
START_VERSION = LAB_VLLM_VERSION
OTHER_VERSION = max(set(LAB_VLLM_VERSIONS) - {START_VERSION})  # the release the fleet is upgraded to
ROLLOUT_TIMEOUT_S = 2400
# The README's upgrade and rollback (tests/lab/readme_tour.py), as the lab runs them under _traffic:
# - --max-latency-ratio 3: the lab's canaries are judged on their release's bench record (lab1's replica benched
#   alone) while the lab's two cores also carry the other replica's traffic and a replica just started answers its
#   first requests slowly: a good release measured 1.1 to 1.3 times the record's inter-token latency (p95, mean)
#   under one stream and twice its mean under four; a release slower per token, 15 to 33 times. The default 1.5
#   could stop a good release here. The slower release is judged with the same ratio (LATENCY_WATCH); the bounds
#   that judge finer are tests/data/rollout_runs' (canary_latency_*, canary_p95_*, canary_bench_*).
# - --canary-min-requests 5 --canary-max-s 60: a canary is judged once it served that many, its watch extended until
#   it has, and fails when it has not by then. Under _traffic each replica gets about 0.3 requests a second: 5 take
#   about 17 s, well within 60; the default 20 would add about a minute to each of these rollouts.
# The README's upgrade rolls lab1's replica first (a canary that changes its release, on the fewest nodes), judged
# on its bench record; the pipeline replica after it, unwatched (the first batch is the canary). The pipeline is
# never the judged canary on purpose: on the lab's two shared cores its inter-token latency depends on what the
# other replica serves at the time (vLLM's p95: 16 ms benched alone, 76 to 89 ms beside this traffic), while lab1's
# holds (10 ms both ways).
# The slower release (a copy of the lab's inventory where lab_single's group_vars differ): eight OpenMP threads per
# engine where the lab gives one (three engines on two cores: their threads spin against each other). Measured:
# vLLM's inter-token p95 on lab1's replica, tests/lab/test_bench.py's workload at 2 req/s, 10 ms with one thread.
SLOW = ('  OMP_NUM_THREADS: "1"\n', '  OMP_NUM_THREADS: "8"\n')
# A watch that judges latency as the README's does: lab1's replica serves --canary-min-requests within it under
# _busy_traffic (extended until it has); four streams, as a slow canary answers few.
LATENCY_WATCH = ("--canary-s", "20", "--canary-min-requests", "10", "--max-latency-ratio", "3")


def _busy_traffic(lab: Lab, streams: int = 4) -> RequestLoad:
    """``streams`` streams, 1 s apart: four bring about 1.5 requests a second to each replica, enough for a canary's
    percentiles even when it answers slowly; two, about 0.75."""
    return RequestLoad(router_url(lab), served_name("lab"), client_key(lab), streams=streams, pause_s=1.0, chat=True,
                       limit_s=ROLLOUT_TIMEOUT_S, limit=6000, ca_file=lab_ca(lab))


def _single_changed(tmp_path: Path, change: tuple[str, str]) -> str:
    """A copy of the lab's inventory whose lab_single pool runs ``change`` (old, new text of its group_vars)."""
    inventory = lab_copy(tmp_path / "copy", {})
    pool = Path(inventory).parent / "group_vars" / "lab_single.yml"
    text = pool.read_text()
    assert change[0] in text, text
    pool.write_text(text.replace(change[0], change[1]))
    return inventory


def _traffic(lab: Lab) -> RequestLoad:
    """Two streams through the routers' virtual address (HTTPS, the client's key), each a completion and a
    streamed chat in turn, 3 s apart, for at most as long as a rollout may take. Spaced as requests_to's: a CPU
    vLLM's workers spin for a second after each step, so two streams one second apart kept both cores busy (lab:
    99% against 55% at 3 s apart) and a replica restarting beside them took 67 s to serve instead of 51 s."""
    return RequestLoad(router_url(lab), served_name("lab"), client_key(lab), streams=2, pause_s=3.0, chat=True,
                       limit_s=ROLLOUT_TIMEOUT_S, limit=3000, ca_file=lab_ca(lab))


def _rollout(lab: Lab, *args: str, timeout: float = ROLLOUT_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*GPUFLEET, *args], cwd=ROOT, env=lab.env, capture_output=True, text=True, timeout=timeout)


def _releases(lab: Lab) -> dict[str, str]:
    """Each replica's vLLM version as its first node's release.json records it."""
    found = {}
    for node, replica in ((lab.nodes[0], single(lab)), (lab.nodes[1], PIPELINE)):
        text = lab.host(node).check_output(f"cat /etc/gpufleet/vllm/{replica}/release.json")
        found[replica] = json.loads(text)["vllm_version"]
    return found


def _running(lab: Lab) -> dict[str, str]:
    """The vLLM version each replica's unit runs (its venv link), on every node of it."""
    found = {}
    for node, replica in ((lab.nodes[0], single(lab)), (lab.nodes[1], PIPELINE), (lab.nodes[2], PIPELINE)):
        target = lab.host(node).check_output(f"readlink /etc/gpufleet/vllm/{replica}/venv")
        found[f"{node.name}:{replica}"] = Path(target).name
    return found


def _served_versions(lab: Lab, count: int = 6) -> set[str]:
    """The vLLM releases that answer completions through the router (each answer's ``system_fingerprint`` names
    it), over ``count`` requests: leastconn spreads them over both replicas."""
    url = f"{router_url(lab)}/v1/completions"
    body = {"model": served_name("lab"), "prompt": "The fleet is", "max_tokens": 2}
    found = set()
    for _ in range(count):
        status, text = http(url, body, client_key(lab), context=tls(lab))
        assert status == 200, text
        found.add(json.loads(text)["system_fingerprint"].split("-")[1])
    return found


def _rolled(lab: Lab, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, name: str,
            *args: str, busy: int = 0) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], RequestLoad]:
    """Run ``gpufleet ARGS --report ...`` under load (``busy``: :func:`_busy_traffic` of that many streams): its
    exit, its JSON report and the load's outcome."""
    report = tmp_path / "report.json"
    report.unlink(missing_ok=True)  # a second rollout of the test writes its own
    retried = router_retries(lab)
    traffic = (_busy_traffic(lab, busy) if busy else _traffic(lab)).start()
    started = time.monotonic()
    try:
        time.sleep(3)
        done = _rollout(lab, *args, "--report", str(report))
    finally:
        traffic.stop()
    took = time.monotonic() - started
    record_figure(tmp_path_factory, {"rollout": name, "exit": done.returncode, "duration_s": round(took, 1),
                                      "retried": router_retries(lab) - retried, **traffic.figures()})
    assert report.exists(), done.stdout[-4000:] + done.stderr[-4000:]
    return done, json.loads(report.read_text()), traffic


def _states(report: dict[str, Any]) -> dict[str, str]:
    return {entry["replica"]: entry["state"] for entry in report["replicas"]}


def _judged(report: dict[str, Any], replica: str) -> str:
    notes = [n for e in report["replicas"] if e["replica"] == replica for n in e["notes"]
             if n.startswith("canary latency: ")]
    assert notes and "not judged" not in notes[0] and f"vLLM {START_VERSION}'s bench at" in notes[0], notes
    return str(notes[0])


def test_a_release_slower_per_token_is_rolled_back_at_the_canary(
        lab: Lab, faults: Completed | None, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """lab1's replica has no other replica of its shape: vLLM's inter-token p95 over the watch is compared with its
    release's bench record, and the slower release fails the watch; it is rolled back, no request fails."""
    ensure_records(lab, tmp_path, START_VERSION)
    assert _releases(lab) == {single(lab): START_VERSION, PIPELINE: START_VERSION}
    before = _running(lab)
    done, report, traffic = _rolled(lab, tmp_path, tmp_path_factory, "a release slower per token",
                                    "upgrade", _single_changed(tmp_path, SLOW), "--batches", "1,100%",
                                    *LATENCY_WATCH, busy=4)
    assert done.returncode == 1, done.stdout[-4000:] + done.stderr[-4000:]
    assert _states(report).get(single(lab)) == "rolled back", done.stdout[-4000:]
    assert "canary: inter-token latency p95" in report["failure"], report["failure"]
    assert "times the stored baseline" in report["failure"], report["failure"]
    print(json.dumps({"slow_release_canary": _judged(report, single(lab)), "failure": report["failure"]}))
    assert traffic.figures()["requests"] > 0 and traffic.failures == [], traffic.failures[:5]
    assert _running(lab) == before
    # the failed canary's evidence is kept on the monitoring host (lab1), and gpufleet diag --list shows it
    captured = re.search(r"^gpufleet diag: captured (.+?) \(upgrade rolled back (\S+)\) as \S+/(\S+) on ",
                         done.stdout, re.M)
    assert captured and captured[1] == lab.nodes[0].address and captured[2] == single(lab), done.stdout[-3000:]
    kept = _rollout(lab, "diag", INVENTORY, "--list", timeout=120)
    assert kept.returncode == 0 and f"{lab.nodes[0].address}: " in kept.stdout and captured[3] in kept.stdout, (
        kept.stdout + kept.stderr)


def test_a_release_that_does_not_start_is_rolled_back_at_the_canary(
        lab: Lab, faults: Completed | None, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """vLLM refuses to start with a KV cache larger than the node's memory: the canary never serves, the rollout
    puts it back on the release it ran, stops, and says so; no request fails, and no other replica is touched."""
    before = _running(lab)
    done, report, traffic = _rolled(lab, tmp_path, tmp_path_factory, "a release that does not start",
                                    "upgrade", INVENTORY, "--batches", "1,100%", "--canary-s", "10",
                                    "--data", f"vllm_version={OTHER_VERSION}",
                                    "--data", 'vllm_env={"VLLM_CPU_KVCACHE_SPACE": "4096"}')
    assert done.returncode == 1, done.stdout[-4000:] + done.stderr[-4000:]
    assert sorted(_states(report).values()) == ["rolled back", "untouched"], done.stdout[-4000:]
    assert "gpufleet upgrade: stopped: " in done.stdout, done.stdout[-4000:]
    assert traffic.figures()["requests"] > 0 and traffic.failures == [], traffic.failures[:5]
    assert _running(lab) == before
    assert _releases(lab) == {single(lab): START_VERSION, PIPELINE: START_VERSION}
    assert _served_versions(lab) == {START_VERSION}


def test_the_readmes_upgrade_passes_a_good_release_judged_on_its_baseline_and_loses_no_request(
        lab: Lab, faults: Completed | None, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The README's upgrade, as written (its report also written, to read each replica's state): lab1's replica, the
    canary, runs the mirror's other vLLM release, judged on the bench record of the release it replaces, and passes;
    the pipeline replica over lab2 and lab3 follows, both its nodes at once. The traffic stays below 80% of the
    model's capacity all along, also while the canary is drained and the capacity is the pipeline's ceiling alone
    (about 4 req/s): the capacity alert never goes pending (tests/lab/test_capacity.py saw it fire above)."""
    ensure_records(lab, tmp_path, START_VERSION)
    assert _releases(lab) == {single(lab): START_VERSION, PIPELINE: START_VERSION}
    assert _served_versions(lab) == {START_VERSION}
    readme = starting("gpufleet upgrade").argv
    assert f"vllm_version={OTHER_VERSION}" in readme, readme
    prometheus = Prometheus(lab.nodes[0])
    alone = {r["metric"]["layout"]: float(r["value"][1])
             for r in prometheus.query("gpufleet:replica_ceiling_rps")}["tp1-pp2"]  # the pipeline's, per replica
    # the slower release's four streams leave the routers' one-minute rate first (while the broken release is rolled
    # out and back): with this test's traffic on top (under 1 req/s), the rate then stays below 80% of the pipeline's
    # ceiling alone, the model's capacity while the canary is drained
    wait_for("the last rollout's load out of the routers' one-minute rate",
             lambda: True if router_rate(prometheus) < 0.8 * alone - 1.0 else None, timeout=90, every=2)
    started = time.monotonic()
    name = f"upgrade {START_VERSION} -> {OTHER_VERSION}"
    done, report, traffic = _rolled(lab, tmp_path, tmp_path_factory, name, *readme[1:])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert _states(report) == {single(lab): "rolled", PIPELINE: "rolled"}, done.stdout[-4000:]
    assert traffic.figures()["requests"] > 0 and traffic.failures == [], traffic.failures[:5]
    judged = {name: _judged(report, single(lab))}
    span = f"{round(time.monotonic() - started)}s"
    peak = float(prometheus.query(f"max_over_time(model:router_requests:rate1m[{span}])")[0]["value"][1])
    assert 0 < peak < 0.8 * alone, (peak, alone)
    assert prometheus.query(f'max_over_time(ALERTS{{alertname="ModelNearItsCeiling"}}[{span}])') == []
    print(json.dumps({"good_release_canaries": judged, "load_peak_rps": peak, "pipeline_ceiling_rps": alone}))
    assert _releases(lab) == {single(lab): OTHER_VERSION, PIPELINE: OTHER_VERSION}
    assert set(_running(lab).values()) == {OTHER_VERSION}, _running(lab)
    assert _served_versions(lab) == {OTHER_VERSION}


def test_rollback_returns_the_fleet_to_the_previous_release(
        lab: Lab, faults: Completed | None, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The README's rollback, as written: each replica's release before the README's upgrade (the broken one, rolled
    back, did not become "previous"), the lab's inventory as deployed for both. The canary's 5 s watch sees about 1.5 of
    the 5 requests it needs under _traffic: it is watched on until it has them, and judged then, never passed
    unjudged. The fleet is then what the inventory deploys: the check finds no drift on any node, and the scenarios
    after these deploy no change to the replicas."""
    done, report, traffic = _rolled(lab, tmp_path, tmp_path_factory, f"rollback {OTHER_VERSION} -> {START_VERSION}",
                                    *starting("gpufleet rollback").argv[1:])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert _states(report) == {single(lab): "rolled", PIPELINE: "rolled"}, done.stdout[-4000:]
    evidence = [n for e in report["replicas"] for n in e["notes"] if n.startswith(("canary: judged", "canary: not"))]
    assert evidence and all("judged after extending the watch to" in n for n in evidence), evidence
    print(json.dumps({"rollback_canary_evidence": evidence}))
    assert traffic.figures()["requests"] > 0 and traffic.failures == [], traffic.failures[:5]
    assert _releases(lab) == {single(lab): START_VERSION, PIPELINE: START_VERSION}
    assert set(_running(lab).values()) == {START_VERSION}, _running(lab)
    assert _served_versions(lab) == {START_VERSION}
    # the replicas are as the inventory deploys them: the check finds no drift in what vLLM runs on any node (the
    # monitoring hosts' records of the releases served may have moved on: bookkeeping the next deploy writes)
    checked = lab.pyinfra(INVENTORY, "deploys/check.py", timeout=600)
    drift = [name for name in re.findall(r"drift: (.+)$", checked.output, re.M)
             if not re.fullmatch(r"\d+ operation\(s\)", name)]
    assert all(f"[{node.address}] gate: pass" in checked.output for node in lab.nodes), checked.output[-4000:]
    assert (checked.rc == 0) == (drift == []) and not [name for name in drift if name.startswith("vLLM")], (
        drift, checked.output[-4000:])
    print(json.dumps({"drift_after_the_rollback": drift}))
