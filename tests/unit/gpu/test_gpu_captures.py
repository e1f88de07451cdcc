"""What real GPUs reported, kept as data (tests/data/gpu_captures/): the NVML probe (gpufleet/node/nvml_probe.py) run
on one NVIDIA H100 80GB HBM3 (driver 580.159.04, one GPU of a virtual machine, no NVLink), and a 30 s burn-in on
it (bf16 matrix products and a device copy, NVML readings before, during and after). The declared profiles and
the gate are held to them."""

from __future__ import annotations

import json
from typing import Any

from gpufleet.gpu.burn_in_floors import HEALTHY, burn_in_floors
from gpufleet.gpu.profiles import GPU_MODELS, parse_profile, profile_facts
from gpufleet.gpu.report import parse_facts
from gpufleet.node.health_rules import HealthPolicy, evaluate
from tests.conftest import DATA

CAPTURES = DATA / "gpu_captures"
PROBE = json.loads((CAPTURES / "h100-80gb-hbm3-probe.json").read_text())
BURN_IN = json.loads((CAPTURES / "h100-80gb-hbm3-burn-in-30s.json").read_text())


def test_a_real_h100s_probe_parses_and_passes_the_gate() -> None:
    facts = parse_facts(PROBE, "h100-80gb-hbm3-probe.json")
    gpu = facts.gpus[0]
    assert (len(facts.gpus), gpu.compute_capability, facts.errors) == (1, "9.0", [])
    assert gpu.unsupported == ["nvlinks"]  # a PCIe-attached GPU of a virtual machine: no NVLink to report
    assert evaluate(PROBE, HealthPolicy(expected_gpu_count=1, expected_gpu_model="H100")) == []
    assert evaluate(PROBE, HealthPolicy(expected_gpu_count=8, expected_gpu_model="H100")) != []


def test_the_declared_h100_reports_the_memory_a_real_one_does() -> None:
    """The planner plans an 8xH100-SXM node from the memory its profile declares: what NVML reports on a real one."""
    declared = profile_facts("8xH100-SXM", "gpu-a01")
    assert declared.gpus[0].name == PROBE["gpus"][0]["name"]
    assert declared.gpus[0].memory_total_bytes == PROBE["gpus"][0]["memory_total_bytes"]
    assert parse_profile("8xH100-SXM").count == len(declared.gpus) == 8


def test_the_burn_in_capture_is_a_healthy_gpu_under_load() -> None:
    """A healthy H100 under 30 s of bf16 products: no ECC error, no remapped row, clocks up and power drawn while
    busy; the rate a burn-in of this GPU can expect (median 683 TFLOP/s, 3.0 TB/s copy counting both ways)."""
    before, during, after = BURN_IN["before"], BURN_IN["during"], BURN_IN["after"]
    for reading in (before, during, after):
        assert (reading["ecc_volatile_uncorrected"], reading["retired_or_remapped_rows"]) == (0, "(0, 0, 0, 0)")
    assert during["power_w"] > 5 * before["power_w"] and during["sm_clock_mhz"] > before["sm_clock_mhz"]
    flops = BURN_IN["matmul_bf16_tflops"]
    assert flops["n"] > 100 and 400 < flops["median"] < 990  # below the H100 SXM's dense bf16 peak
    assert 2000 < BURN_IN["d2d_copy_gbps_read_plus_write"] < 2 * 3350


H200_PROBE = json.loads((CAPTURES / "h200-probe.json").read_text())
H200_BURN_IN = json.loads((CAPTURES / "h200-burn-in-quick.json").read_text())


def test_a_real_h200s_probe_parses_passes_the_gate_and_matches_its_profile() -> None:
    """The NVML probe on one NVIDIA H200 (driver 580.159.04, one GPU of a virtual machine): the gate passes, and the
    declared H200 reports the memory the real one does (143771 MiB)."""
    facts = parse_facts(H200_PROBE, "h200-probe.json")
    assert (len(facts.gpus), facts.gpus[0].name, facts.errors) == (1, "NVIDIA H200", [])
    assert evaluate(H200_PROBE, HealthPolicy(expected_gpu_count=1, expected_gpu_model="H200")) == []
    declared = profile_facts("8xH200-SXM", "gpu-h01")
    assert declared.gpus[0].memory_total_bytes == H200_PROBE["gpus"][0]["memory_total_bytes"]


def _check(verdict: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in verdict["checks"] if c["check"] == name)


def test_the_h200_burn_in_clears_the_floors_its_model_declares() -> None:
    """The quick tier's kernels as gpufleet/node/burn_in.py ran them on a real H200 (30 s of 8192^3 bf16 products, 10 s
    of 2 GiB copies; dcgmi is not installed there, so its two levels failed as they must). The declared floors sit
    below what it reached, and an H200 at half its rate would fail them."""
    matmul, copy = _check(H200_BURN_IN, "matmul"), _check(H200_BURN_IN, "copy")
    assert (matmul["status"], copy["status"], matmul["evidence"]["mismatched_products"]) == ("pass", "pass", 0)
    assert matmul["evidence"]["slice_error"] < 0.03  # bf16 against float64
    floors = burn_in_floors("H200")
    assert floors.matmul_tflops < matmul["value"] and floors.copy_gbps < copy["value"]
    assert matmul["value"] / 2 < floors.matmul_tflops and copy["value"] / 2 < floors.copy_gbps
    assert [c["check"] for c in H200_BURN_IN["checks"] if c["status"] == "fail"] == ["dcgm-r1", "dcgm-r2"]
    nvml = matmul["evidence"]["nvml"]
    assert nvml["during"]["power_w"] > 3 * nvml["before"]["power_w"]  # busy: it drew power
    assert nvml["after"]["ecc_volatile_uncorrected"] == nvml["before"]["ecc_volatile_uncorrected"] == 0


def test_the_h100_burn_in_clears_the_floors_its_model_declares() -> None:
    floors = burn_in_floors("H100")
    assert floors.matmul_tflops < BURN_IN["matmul_bf16_tflops"]["median"] < 2 * floors.matmul_tflops
    assert floors.copy_gbps < BURN_IN["d2d_copy_gbps_read_plus_write"] < 2 * floors.copy_gbps


def test_every_gpu_model_has_burn_in_floors() -> None:
    assert set(HEALTHY) == set(GPU_MODELS)
    for key in GPU_MODELS:
        floors = burn_in_floors(key)
        assert 0 < floors.matmul_tflops < HEALTHY[key].matmul_tflops and floors.copy_gbps > 0
