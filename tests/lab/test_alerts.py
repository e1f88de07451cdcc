"""Alerts on the lab: faults injected on running nodes fire their alert in the monitoring group's Prometheus (lab1)
within the rule's wait plus two scrape intervals, seen in its ``/api/v1/alerts``, and resolve once cleared.

Scenario ``faults``: the lab's default deployment (both replicas of the tiny model serving,
the router and Prometheus on lab1), with the lab's short waits (its group_vars/lab.yml). One round of faults that do
not hide one another, so that their waits overlap:

- a GPU lost and a critical XID on lab1's simulated GPUs (its GPU watch stops its replica, and starts it again once
  the GPU is back);
- NVLink errors on lab2's simulated GPUs, and the pipeline replica's engine on lab2 stalled (SIGSTOP, with a request
  in flight and its watchdog stopped, as when the watchdog itself is what failed);
- lab3's dcgm-exporter stopped.

Every alert that fired must also reach the alert log's journal on lab1 while its fault holds (the lab sets no
webhook: log only). Each fault's time to fire and to resolve goes to the session's lab-fault-figures.jsonl.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from gpufleet_lab.sim_profile import write_sim_profile
from gpufleet_lab.state import NodeRecord

from tests.lab.alerting import Expected, logged, wait_resolved, watch_fired
from tests.lab.checks import main_pid
from tests.lab.fleet import (
    INVENTORY,
    PIPELINE,
    PORT,
    api_key,
    model_of,
    record_figure,
    single,
    wait_serving,
)
from tests.lab.harness import LAB_VARS, PYINFRA, Completed, Lab, run
from tests.lab.prometheus import SCRAPE_INTERVAL_S, Prometheus, wait_for

pytestmark = pytest.mark.filterwarnings("ignore:Unknown ssh-ed25519 host key:UserWarning")

PROFILE = "/etc/gpufleet/nvml-sim-profile"
GATE_FAILED = "/run/gpufleet/gpu-gate-failed"
LOST_GPU, XID_GPU, XID, NVLINK_GPU = 7, 1, 79, 2


def _figures(expected: list[Expected], resolved_s: float) -> dict[str, Any]:
    return {"fired_after_s": {e.alert: round(e.fired_s or -1, 1) for e in expected},
            "waits_s": {e.alert: e.wait_s for e in expected}, "all_resolved_after_s": round(resolved_s, 1)}


def _stream(lab: Lab, node: NodeRecord, started: threading.Event, done: list[str]) -> None:
    """A long streamed completion on ``node``'s replica: ``started`` once its first token came."""
    body = {"model": model_of(lab, node), "prompt": "The fleet is", "max_tokens": 200, "ignore_eos": True,
            "stream": True, "temperature": 0}
    request = urllib.request.Request(f"http://{node.address}:{PORT}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {api_key(lab)}"})
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            for line in response:
                if line.startswith(b"data: {"):
                    started.set()
            done.append("complete")
    except OSError as exc:
        done.append(f"error: {exc}")
        started.set()


def _running_requests(lab: Lab, node: NodeRecord) -> float:
    """vllm:num_requests_running on ``node``'s replica as its API server last heard it from the engine."""
    text = lab.host(node).check_output(f"curl -s http://{node.address}:{PORT}/metrics")
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:num_requests_running{"))


def _inject(lab: Lab, node: NodeRecord, faults: list[tuple[str, int] | tuple[str, int, int]], tmp_path: Path) -> None:
    """Replace ``node``'s simulated GPUs by its profile with ``faults`` (the old profile kept beside it)."""
    faulty = tmp_path / f"profile-{node.name}"
    write_sim_profile(faulty, node.profile, faults, hostname=node.name)
    lab.host(node).check_output(f"cp {PROFILE} {PROFILE}.saved && cat > {PROFILE}.new <<'EOF'\n"
                                f"{faulty.read_text()}EOF\nmv {PROFILE}.new {PROFILE}")


def _restore(lab: Lab, node: NodeRecord) -> None:
    lab.host(node).run(f"test -e {PROFILE}.saved && mv {PROFILE}.saved {PROFILE}")


def _stall(lab: Lab, node: NodeRecord, outcomes: list[str], streams: list[threading.Thread]) -> str:
    """SIGSTOP the engine process of the replica whose API is on ``node`` while a streamed request is running on it;
    its PID."""
    host = lab.host(node)
    engine = host.check_output("pgrep -f 'VLLM::EngineCore'").split()
    assert len(engine) == 1, engine
    for _attempt in range(5):  # the engine must stop with a request in flight
        started = threading.Event()
        stream = threading.Thread(target=_stream, args=(lab, node, started, outcomes), daemon=True)
        stream.start()
        streams.append(stream)
        assert started.wait(120), "no token came"
        host.check_output(f"kill -STOP {engine[0]}")
        if _running_requests(lab, node) > 0:
            return str(engine[0])
        host.check_output(f"kill -CONT {engine[0]}")
    pytest.fail("every request ended before the engine stopped")


def test_gpu_faults_a_stalled_engine_and_a_silent_exporter_fire_and_resolve(
        lab: Lab, faults: Completed | None, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """One round of faults that do not hide one another, on all three nodes:

    - lab1 (PCIe, no NVLink) loses a GPU and reports a critical XID at run time: its GPU watch stops its replica and
      says why; gpufleet gate and deploys/check.py name the node and the rule; the GPU and replica alerts fire.
      Once the GPU is back the watch starts the replica again, without a deploy;
    - lab2 (NVSwitch) counts NVLink errors on one GPU: an alert, and nothing more (NVLink error counters are
      monitoring's, not the gate's: the pipeline replica's units are never stopped or restarted);
    - the pipeline replica's engine (lab2) stalls (SIGSTOP, with a request in flight and its watchdog stopped, as
      when the watchdog itself is what failed): VllmEngineStalled; once it runs again, the stalled request finishes;
    - lab3's dcgm-exporter stops: DcgmExporterDown.

    Every alert fires within its wait plus two scrape intervals, reaches the alert log, and resolves once its
    fault is cleared."""
    first, second, third = lab.nodes
    replica, host = single(lab), lab.host(first)
    unit = f"vllm@{replica}"
    prometheus = Prometheus(first)
    gpu_faults = [  # timed from the injection
        Expected("GpuMissing", {"node": first.address}, LAB_VARS["alert_gpu_missing_for_s"]),
        Expected("GpuCriticalXid", {"node": first.address, "gpu": str(XID_GPU), "xid": str(XID)}, 0),
        Expected("GpuNvlinkErrors", {"node": second.address, "gpu": str(NVLINK_GPU)}, 0),
    ]
    replica_down = [  # timed from the moment the watch (its timer: gpu_watch_interval_s) had stopped the replica
        Expected("VllmReplicaDown", {"replica": replica}, LAB_VARS["alert_replica_down_for_s"]),
        # read through two recording rules (replica:ranks_up:count, model:replicas_ready:count): an evaluation each
        Expected("ModelReplicasBelowMinimum", {"model": model_of(lab, first)},
                 LAB_VARS["alert_replica_down_for_s"] + 2 * SCRAPE_INTERVAL_S),
    ]
    stalled = [Expected("VllmEngineStalled", {"replica": PIPELINE},  # timed from the SIGSTOP
                        LAB_VARS["alert_engine_stall_s"] + LAB_VARS["alert_engine_stall_for_s"])]
    silent = [Expected("DcgmExporterDown", {"node": third.address}, LAB_VARS["alert_exporter_down_for_s"])]
    expected = replica_down + gpu_faults + stalled + silent
    wait_resolved(prometheus, expected, time.monotonic())  # none of them active yet (the earlier tests' faults)
    # increase() sees errors only on a counter sampled before them: lab2's must be scraped before the fault (a fresh
    # Prometheus may not have it yet)
    counter = (f'DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL{{job="dcgm", node="{second.address}", '
               f'gpu="{NVLINK_GPU}"}}')
    wait_for("lab2's NVLink counters sampled twice", lambda: True if prometheus.query(
        f"count_over_time({counter}[5m]) >= 2") else None, timeout=120)
    wait_serving(lab, first)
    wait_serving(lab, second)
    pipeline_pids = {n.name: main_pid(lab, n, f"vllm@{PIPELINE}") for n in (second, third)}
    since = host.check_output("date +%s").strip()
    began = time.time()
    leader = lab.host(second)
    streams: list[threading.Thread] = []
    outcomes: list[str] = []
    engine = ""
    try:
        leader.check_output(f"systemctl stop vllm-watchdog@{PIPELINE}")
        engine = _stall(lab, second, outcomes, streams)
        stopped_engine = time.time()
        lab.host(third).check_output("systemctl stop dcgm-exporter")
        silenced = time.time()
        _inject(lab, first, [("gpu_lost", LOST_GPU), ("xid", XID_GPU, XID)], tmp_path)
        _inject(lab, second, [("nvlink_errors", NVLINK_GPU)], tmp_path)
        injected = time.time()
        # stopped, not stopping: vLLM answers through its shutdown (vllm_shutdown_timeout_s), and VllmReplicaDown is
        # timed from its API's silence (seen: timed from `deactivating`, the alert came 0.5 s past its bound)
        _, stopped = wait_for(f"{unit} stopped by the GPU watch", lambda: True if host.run(
            f"systemctl show -P ActiveState {unit}").stdout.strip() in ("inactive", "failed") else None,
                              timeout=180, every=2)
        said = host.check_output(f"journalctl -q -o cat --since=@{since} -u gpufleet-gpu-watch.service"
                                 " | grep 'GPU is lost' | tail -1")
        assert "nvml_errors" in said, said
        gate = run([str(PYINFRA.parent / "gpufleet"), "gate", INVENTORY], lab.env, 300)
        assert gate.rc != 0 and f"{first.address}: FAIL" in gate.out, gate.output
        assert re.search(r"nvml_errors \(gpu \d\): .*GPU is lost", gate.out), gate.output
        check = lab.pyinfra(INVENTORY, "deploys/check.py")
        assert check.rc != 0 and f"[{first.address}] gate: fail" in check.output, check.output[-4000:]
        assert "GPU is lost" in check.output, check.output[-4000:]
        watch_fired(prometheus, gpu_faults, injected)
        watch_fired(prometheus, replica_down, injected + stopped)
        logged(lab, gpu_faults + replica_down, began)
        # the GPUs are back as soon as their alerts are in the log: lab1's watch starts its replica while the stall
        # and the silent exporter are still waited for
        _restore(lab, first)
        _restore(lab, second)
        gpus_back = time.monotonic()
        watch_fired(prometheus, silent, silenced)
        watch_fired(prometheus, stalled, stopped_engine)
        logged(lab, silent + stalled, began)
        # the NVLink errors stopped nothing: the pipeline's ranks run the processes they ran before the round
        assert {n.name: main_pid(lab, n, f"vllm@{PIPELINE}") for n in (second, third)} == pipeline_pids
    finally:
        if engine:
            leader.run(f"kill -CONT {engine}")
        lab.host(third).run("systemctl start dcgm-exporter")
        leader.run(f"systemctl start vllm-watchdog@{PIPELINE}")
        _restore(lab, first)
        _restore(lab, second)
    cleared = time.monotonic()
    wait_serving(lab, first)  # the watch started it again: no deploy
    back = time.monotonic() - gpus_back
    assert host.run(f"test -e {GATE_FAILED}").rc != 0
    for stream in streams:
        stream.join(120)
    assert outcomes and all(o == "complete" for o in outcomes), outcomes  # the stalled requests finish
    wait_serving(lab, second)
    assert {n.name: main_pid(lab, n, f"vllm@{PIPELINE}") for n in (second, third)} == pipeline_pids
    resolved = wait_resolved(prometheus, expected, cleared)
    record_figure(tmp_path_factory, {"alerts": "GPU lost, XID 79 (lab1, its replica stopped by the watch); NVLink"
                                               " errors (lab2); stalled engine (SIGSTOP, lab2's pipeline replica);"
                                               " stopped dcgm-exporter (lab3)", **_figures(expected, resolved)})
    record_figure(tmp_path_factory, {
        "fault": "gpu_lost injected on a serving node", "node": first.name,
        "replica_stopped_after_s": round(stopped, 1), "serving_again_after_the_gpu_came_back_s": round(back, 1),
        "watch_said": said.strip()[:300]})
