"""The node gate (``nvml_probe.py --gate``) on the NVML simulator, which gcc builds (tests/tools/conftest.py).

The rules themselves, over facts dicts, and the gate without NVML: tests/unit/node/test_health_rules.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import pytest
from gpufleet_lab.nvml_sim import sim_environ
from gpufleet_lab.sim_profile import write_sim_profile

from gpufleet.gpu.profiles import profile_facts
from gpufleet.node.health_rules import HealthPolicy, policy_json
from tests.nvml_probe_run import PROBE


def gate(sim_lib: Path, tmp_path: Path, name: str, faults: Sequence[tuple[str, int]] = (), *args: str,
         policy: HealthPolicy | None = None) -> subprocess.CompletedProcess[str]:
    profile = tmp_path / "nvml-sim-profile"
    declared = write_sim_profile(profile, name, faults)
    policy_file = tmp_path / "gpu-health.json"
    count = len(profile_facts(name, "x").gpus)
    policy_file.write_text(policy_json(policy or HealthPolicy(expected_gpu_count=count,
                                                              expected_gpu_model=declared.gpus[0].name)))
    return subprocess.run([sys.executable, str(PROBE), "--gate", str(policy_file), *args],
                          env=sim_environ(sim_lib, profile), capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("name", ["8xH100-SXM", "8xA100-SXM", "8xL40S-PCIe", "4xA100-PCIe-pairs", "2xRTX4090"])
def test_gate_passes_every_healthy_profile(sim_lib: Path, tmp_path: Path, name: str) -> None:
    result = gate(sim_lib, tmp_path, name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert ": PASS (" in result.stdout.splitlines()[0]


FAULT_VERDICTS = {
    "link_down": ("nvlinks_active", 1, "1 of 18 NVLinks inactive (links 17); 17 active"),
    "fabric_in_progress": ("fabric_completed", 1,
                           "fabric state in_progress, status None; expected completed with success"),
    "pending_row_remap": ("row_remap", 1,
                          "row remap pending (1 correctable, 0 uncorrectable rows remapped): reset the GPU"),
    "pcie_x8": ("pcie_width", 1, "PCIe link x8, max x16"),
    "persistence_off": ("persistence_mode", 1, "persistence mode is off"),
    "gpu_missing": ("gpu_count", None, "found 7 GPUs (indices 0, 1, 2, 3, 4, 5, 6), expected 8"),
    "gpu_lost": ("nvml_errors", 1, "nvmlDeviceGetHandleByIndex failed: GPU is lost"),
}


@pytest.mark.parametrize("fault", sorted(FAULT_VERDICTS))
def test_gate_names_the_failed_rule_with_evidence(sim_lib: Path, tmp_path: Path, fault: str) -> None:
    rule, gpu, evidence = FAULT_VERDICTS[fault]
    result = gate(sim_lib, tmp_path, "8xH100-SXM", [(fault, 1)], "--json")
    assert result.returncode == 1, result.stdout + result.stderr
    verdict = json.loads(result.stdout)
    assert verdict["passed"] is False
    assert {"rule": rule, "gpu": gpu, "evidence": evidence} in verdict["failures"]
    text = gate(sim_lib, tmp_path, "8xH100-SXM", [(fault, 1)])
    where = f"gpu {gpu}" if gpu is not None else "node"
    assert text.returncode == 1 and f"  {rule} ({where}): {evidence}" in text.stdout.splitlines()


def test_gate_with_a_bad_policy_exits_2(sim_lib: Path, tmp_path: Path) -> None:
    policy = tmp_path / "gpu-health.json"
    policy.write_text(json.dumps({**asdict(HealthPolicy()), "max_ecc": 3}))
    result = subprocess.run([sys.executable, str(PROBE), "--gate", str(policy)], capture_output=True, text=True,
                            env=sim_environ(sim_lib, tmp_path / "none"), timeout=60)
    assert result.returncode == 2
    assert f"gpu gate: {policy}: max_ecc: expected one of expected_gpu_count" in result.stderr
