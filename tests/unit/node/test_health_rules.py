"""GPU health rules: pure evaluation over facts dicts, the policy, and the node gate (``nvml_probe.py --gate``) without
NVML; the gate on the NVML simulator: tests/tools/test_health_gate_on_the_simulator.py."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from gpufleet_lab.nvml_sim import sim_environ
from pydantic import BaseModel, Field, ValidationError

from gpufleet.gpu.profiles import profile_facts
from gpufleet.node.health_rules import (
    Failure,
    HealthPolicy,
    PolicyError,
    evaluate,
    link_sample,
    load_policy,
    policy_from_dict,
    policy_json,
)
from tests.nvml_probe_run import PROBE


def facts(name: str = "8xH100-SXM") -> dict[str, Any]:
    return profile_facts(name, "gpu-a01").model_dump(mode="json", by_alias=True)


def rules(failures: list[Failure]) -> list[tuple[str, int | None]]:
    return [(f.rule, f.gpu) for f in failures]


# ---- pure rules ------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "count", "model"), [
    ("8xH100-SXM", 8, "H100"), ("8xA100-SXM", 8, "A100"), ("8xL40S-PCIe", 8, "L40S"),
    ("4xA100-PCIe-pairs", 4, "A100"), ("2xRTX4090", 2, "RTX 4090"),
])
def test_healthy_profiles_pass_the_strictest_policy(name: str, count: int, model: str) -> None:
    assert evaluate(facts(name), HealthPolicy(expected_gpu_count=count, expected_gpu_model=model)) == []


def test_the_sample_the_node_watch_follows_reads_every_gpu_whatever_the_policy() -> None:
    found = facts()
    found["gpus"][3]["nvlinks"][5]["active"] = False
    found["gpus"][3]["clock_event_reasons"] = {"mask": 0x24, "active": ["sw_power_cap", "sw_thermal_slowdown"]}
    sample = link_sample(found)
    assert [s["gpu"] for s in sample] == list(range(8))
    assert [s["pci"] for s in sample] == [g["pci_bus_id"] for g in found["gpus"]]
    assert sample[3]["events"] == ["sw_power_cap", "sw_thermal_slowdown"] and sample[3]["nvlinks_down"] == 1
    assert sample[3]["nvlinks"] == len(found["gpus"][3]["nvlinks"]) > 1 and sample[0]["nvlinks_down"] == 0
    assert sample[0]["pcie"] == found["gpus"][0]["pcie"]


def test_no_nvml_fails_with_its_reason() -> None:
    doc = {"schema": "gpufleet.gpu-facts/1", "hostname": "x",
           "nvml": {"available": False, "error": "no NVML on this node: nvmlInit: Driver Not Loaded"}}
    assert evaluate(doc, HealthPolicy()) == [Failure("nvml", None, "no NVML on this node: nvmlInit: Driver Not Loaded")]


def test_gpu_count_and_model() -> None:
    doc = facts()
    del doc["gpus"][5]
    failures = evaluate(doc, HealthPolicy(expected_gpu_count=8, expected_gpu_model="A100"))
    assert rules(failures)[0] == ("gpu_count", None)
    assert failures[0].evidence == "found 7 GPUs (indices 0, 1, 2, 3, 4, 6, 7), expected 8"
    assert rules(failures)[1:] == [("gpu_model", i) for i in (0, 1, 2, 3, 4, 6, 7)]
    assert failures[1].evidence == "'NVIDIA H100 80GB HBM3' does not contain 'A100'"


@pytest.mark.parametrize(("driver", "failed"), [("580.95.05", False), ("590.10", False), ("570.172.08", True),
                                                 ("garbage", True)])
def test_driver_branch(driver: str, failed: bool) -> None:
    doc = facts()
    doc["driver_version"] = driver
    failures = evaluate(doc, HealthPolicy())
    assert rules(failures) == ([("driver_branch", None)] if failed else [])
    if driver == "570.172.08":
        assert failures[0].evidence == "driver 570.172.08 is branch 570, need >= 580"


def test_pcie_gen_is_judged_only_while_busy() -> None:
    doc = facts()
    doc["gpus"][1]["pcie"]["gen_current"] = 1  # idle GPUs drop to gen 1 to save power
    assert evaluate(doc, HealthPolicy()) == []
    doc["gpus"][1]["clock_event_reasons"] = {"mask": 4, "active": ["sw_power_cap"]}
    failures = evaluate(doc, HealthPolicy())
    assert failures == [Failure("pcie_gen", 1, "PCIe gen 1 while busy (clock events: sw_power_cap), max gen 5")]
    assert evaluate(doc, HealthPolicy(require_pcie_max_gen=False)) == []
    doc["gpus"][1]["clock_event_reasons"] = None  # unknown: not judged
    assert evaluate(doc, HealthPolicy()) == []


def test_uncorrected_ecc_judges_volatile_counts() -> None:
    doc = facts()
    doc["gpus"][3]["ecc"]["uncorrected_aggregate"] = 4  # lifetime errors, rows since remapped: not judged
    assert evaluate(doc, HealthPolicy()) == []
    doc["gpus"][3]["ecc"]["uncorrected_volatile"] = 2
    assert evaluate(doc, HealthPolicy()) == [
        Failure("uncorrected_ecc", 3, "2 uncorrected ECC errors since driver load, max 0 (4 lifetime)")]
    assert evaluate(doc, HealthPolicy(max_uncorrected_ecc=2)) == []


def test_row_remap_pending_and_failure() -> None:
    doc = facts("8xA100-SXM")
    doc["gpus"][0]["remapped_rows"].update(pending=True, uncorrectable=1)
    assert rules(evaluate(doc, HealthPolicy())) == [("row_remap", 0)]
    assert evaluate(doc, HealthPolicy(allow_pending_row_remap=True)) == []
    doc["gpus"][0]["remapped_rows"]["failure"] = True
    assert rules(evaluate(doc, HealthPolicy(allow_pending_row_remap=True))) == [("row_remap_failure", 0)]


def test_persistence_unreported_fails_when_required() -> None:
    doc = facts("2xRTX4090")
    doc["gpus"][1]["persistence_mode"] = None
    assert evaluate(doc, HealthPolicy()) == [Failure("persistence_mode", 1, "persistence mode not reported")]
    assert evaluate(doc, HealthPolicy(require_persistence_mode=False)) == []


def test_fabric_states() -> None:
    doc = facts()
    doc["gpus"][4]["fabric"] = {"state": "not_supported", "status": None, "clique_id": None, "cluster_uuid": None}
    assert evaluate(doc, HealthPolicy()) == []
    doc["gpus"][4]["fabric"] = {"state": "completed", "status": "Unknown Error", "clique_id": 0, "cluster_uuid": None}
    assert evaluate(doc, HealthPolicy()) == [
        Failure("fabric_completed", 4, "fabric state completed, status Unknown Error; expected completed with success")]
    assert evaluate(doc, HealthPolicy(require_fabric_completed=False)) == []


def test_nvml_errors_fail_with_the_query() -> None:
    doc = facts()
    doc["errors"] = [{"gpu": 6, "query": "nvmlDeviceGetEccMode", "error": "Unknown Error"}]
    assert evaluate(doc, HealthPolicy()) == [Failure("nvml_errors", 6, "nvmlDeviceGetEccMode failed: Unknown Error")]


def test_switches_turn_rules_off() -> None:
    doc = facts()
    g = doc["gpus"][0]
    g["nvlinks"][0]["active"] = False
    g["pcie"]["width_current"] = 4
    relaxed = HealthPolicy(require_all_nvlinks_active=False, require_pcie_max_width=False)
    assert rules(evaluate(doc, HealthPolicy())) == [("nvlinks_active", 0), ("pcie_width", 0)]
    assert evaluate(copy.deepcopy(doc), relaxed) == []


# ---- the policy ------------------------------------------------------------------------------


def test_policy_file_round_trip(tmp_path: Path) -> None:
    policy = HealthPolicy(expected_gpu_count=4, expected_gpu_model="A100", max_uncorrected_ecc=1)
    path = tmp_path / "gpu-health.json"
    path.write_text(policy_json(policy))
    assert load_policy(path) == policy


@pytest.mark.parametrize(("data", "message"), [
    ({"expected_gpu_cnt": 8}, "expected_gpu_cnt: expected one of expected_gpu_count, .*, found an unknown key"),
    ({"expected_gpu_count": 0}, "expected_gpu_count: expected an integer >= 1 or null, found 0"),
    ({"expected_gpu_count": -1}, "expected_gpu_count: expected an integer >= 1 or null, found -1"),
    ({"require_fabric_completed": "yes"}, "require_fabric_completed: expected true or false, found 'yes'"),
    ({"min_driver_branch": True}, "min_driver_branch: expected an integer >= 0, found True"),
    ([], "expected a mapping, found a list"),
])
def test_bad_policies_are_refused(data: Any, message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        policy_from_dict(data)


def test_policy_embeds_in_a_pydantic_config() -> None:
    class Config(BaseModel):
        gpu_health: HealthPolicy = Field(default_factory=HealthPolicy)

    assert Config(gpu_health={"expected_gpu_count": 8}).gpu_health == HealthPolicy(expected_gpu_count=8)
    assert Config().gpu_health == HealthPolicy()
    with pytest.raises(ValidationError, match="bogus"):
        Config(gpu_health={"bogus": 1})
    with pytest.raises(ValidationError, match="max_uncorrected_ecc"):
        Config(gpu_health={"max_uncorrected_ecc": "many"})


# ---- the node gate without NVML --------------------------------------------------------------


def test_gate_fails_clearly_without_nvml(tmp_path: Path) -> None:
    (tmp_path / "libnvidia-ml.so.1").write_bytes(b"")
    policy = tmp_path / "gpu-health.json"
    policy.write_text(policy_json(HealthPolicy()))
    result = subprocess.run([sys.executable, str(PROBE), "--gate", str(policy)], capture_output=True, text=True,
                            env=sim_environ(tmp_path / "libnvidia-ml.so.1", tmp_path / "none"), timeout=60)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert ": FAIL (no GPUs, driver None)" in result.stdout
    assert "  nvml (node): no NVML on this node: nvmlInit: NVML Shared Library Not Found" in result.stdout
