"""The GPU health watch (``gpufleet/node/gpu_watch.py``) with the real gate on the NVML simulator, which gcc builds
(tests/tools/conftest.py): the judge probes afresh each run, and the script runs once as the timer runs it, with a
fake ``systemctl`` on its PATH (tests/unit/gpu_watch_run.py's).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from gpufleet_lab.nvml_sim import sim_environ
from gpufleet_lab.sim_profile import write_sim_profile

from gpufleet.node import gpu_watch
from gpufleet.node.health_rules import HealthPolicy, policy_json
from tests.conftest import ROOT
from tests.unit.gpu_watch_run import WATCH


@pytest.fixture
def sim_node(sim_lib: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """A simulated healthy 8xH100 node (its profile file, to rewrite) and its gate policy."""
    profile, policy = tmp_path / "nvml-sim-profile", tmp_path / "gpu-health.json"
    write_sim_profile(profile, "8xH100-SXM", hostname="gpu-a01")
    policy.write_text(policy_json(HealthPolicy(expected_gpu_count=8, expected_gpu_model="H100")))
    for name, value in sim_environ(sim_lib, profile, base={}).items():
        monkeypatch.setenv(name, value)
    return profile, policy


def test_judge_sees_a_gpu_lost_at_run_time_and_its_return(sim_node: tuple[Path, Path]) -> None:
    profile, policy = sim_node
    hostname, failures, sample = gpu_watch.judge(str(policy))
    assert (hostname, failures) == (socket.gethostname(), [])  # the probe reports the machine's name
    assert len(sample) == 8 and all(s["events"] is not None and s["pcie"] for s in sample)  # the trends' sample
    write_sim_profile(profile, "8xH100-SXM", [("gpu_lost", 3)], hostname="gpu-a01")  # each run probes afresh
    assert gpu_watch.judge(str(policy))[1] == [
        {"rule": "nvml_errors", "gpu": 3, "evidence": "nvmlDeviceGetHandleByIndex failed: GPU is lost"},
        {"rule": "gpu_count", "gpu": None, "evidence": "found 7 GPUs (indices 0, 1, 2, 4, 5, 6, 7), expected 8"},
    ]
    write_sim_profile(profile, "8xH100-SXM", [("pending_row_remap", 5)], hostname="gpu-a01")
    assert [(f["rule"], f["gpu"]) for f in gpu_watch.judge(str(policy))[1]] == [("row_remap", 5)]
    write_sim_profile(profile, "8xH100-SXM", hostname="gpu-a01")
    assert gpu_watch.judge(str(policy))[1] == []


def test_the_script_as_the_timer_runs_it(sim_node: tuple[Path, Path], tmp_path: Path) -> None:
    """Standalone (no gpufleet import): fail -> stop and marker; pass -> start and no marker; with a fake systemctl."""
    profile, policy = sim_node
    bin_dir, state = tmp_path / "bin", tmp_path / "systemctl.json"
    bin_dir.mkdir()
    (bin_dir / "systemctl").write_text(
        f"#!{sys.executable}\nimport json, sys\nsys.path.insert(0, {str(ROOT)!r})\n"
        "from tests.unit.gpu_watch_run import FakeSystemctl\n"
        f"state = json.load(open({str(state)!r}))\nfake = FakeSystemctl(state['units'])\n"
        "status, out, err = fake.run(['systemctl', *sys.argv[1:]])\nstate['calls'] += fake.calls\n"
        f"json.dump(state, open({str(state)!r}, 'w'))\nprint(out, end='')\nprint(err, end='', file=sys.stderr)\n"
        "sys.exit(status)\n")
    (bin_dir / "systemctl").chmod(0o755)
    state.write_text(json.dumps({"units": {"vllm@pool-0.service": ["active", "enabled"]}, "calls": []}))
    marker = tmp_path / "run" / "gpu-gate-failed"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "GPUFLEET_NODE": "gpu-a01"}
    argv = [sys.executable, str(WATCH), "--policy", str(policy), "--marker", str(marker)]

    write_sim_profile(profile, "8xH100-SXM", [("link_down", 2)], hostname="gpu-a01")
    failing = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert failing.returncode == 0, failing.stdout + failing.stderr
    assert failing.stdout.splitlines() == [
        "gpu-a01: GPU health gate failed: nvlinks_active on gpu 2: 1 of 18 NVLinks inactive (links 17); 17 active",
        "gpu-a01: stopping vllm@pool-0.service until the node passes its GPU health gate again"]
    assert json.loads(marker.read_text())["stopped"] == ["vllm@pool-0.service"]

    write_sim_profile(profile, "8xH100-SXM", hostname="gpu-a01")
    passing = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert passing.returncode == 0, passing.stdout + passing.stderr
    assert passing.stdout == "gpu-a01: passes its GPU health gate again; starting vllm@pool-0.service\n"
    assert not marker.exists()
    assert json.loads(state.read_text()) == {
        "units": {"vllm@pool-0.service": ["active", "enabled"]},
        "calls": [["stop", "--no-block", "--", "vllm@pool-0.service"],
                  ["start", "--no-block", "--", "vllm@pool-0.service"]]}
