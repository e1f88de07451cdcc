"""What real GPUs reported, kept as data (tests/data/gpu_captures/): the NVML probe (gpufleet/node/nvml_probe.py) run
on one NVIDIA H100 80GB HBM3 (driver 580.159.04, one GPU of a virtual machine, no NVLink), and a 30 s burn-in on
it (bf16 matrix products and a device copy, NVML readings before, during and after). The declared profiles and
the gate are held to them."""

from __future__ import annotations

import json

from gpufleet.gpu.profiles import parse_profile, profile_facts
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
