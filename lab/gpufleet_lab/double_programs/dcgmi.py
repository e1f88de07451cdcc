#!/usr/bin/python3
"""dcgmi, gpufleet LAB DOUBLE: ``dcgmi diag -r 1|2|3|4 --json`` answered as DCGM 4 writes its results, for the GPUs
of the node's NVML simulator profile (``/etc/gpufleet/nvml-sim-profile``, or ``$GPUFLEET_NVML_SIM_PROFILE``).

Every test of the level passes, on every GPU, unless the profile holds a ``dcgm`` fault for a GPU (the lab's
``dcgm_fail``, ``dcgm_skip`` and ``dcgm_warn`` faults, ``gpufleet_lab.sim_profile``):

- ``dcgm fail CODE``: the level's memory test (level 1: its software test) fails on that GPU with the ``DCGM_FR``
  error CODE, and dcgmi still exits 0, as a tool that trusts the exit status would not notice;
- ``dcgm skip``: the memory test is skipped on that GPU;
- ``dcgm warn CODE``: the memory test warns on that GPU with CODE.

The JSON has DCGM 4's shape (``DCGM Diagnostic`` with ``test_categories``, ``entity_groups`` with each GPU's serial,
``metadata``); no real DCGM recorded it. Any other command says the double does not have it and exits 1.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

PROFILE = Path(os.environ.get("GPUFLEET_NVML_SIM_PROFILE", "/etc/gpufleet/nvml-sim-profile"))
TESTS = {
    1: [("Deployment", "software")],
    2: [("Deployment", "software"), ("Hardware", "pcie"), ("Hardware", "memory")],
    3: [("Deployment", "software"), ("Hardware", "pcie"), ("Hardware", "memory"), ("Integration", "diagnostic"),
        ("Stress", "targeted_stress"), ("Stress", "targeted_power"), ("Stress", "memory_bandwidth")],
}
TESTS[4] = TESTS[3] + [("Hardware", "memtest"), ("Hardware", "pulse_test")]


def gpus(profile: Path) -> tuple[list[tuple[int, str]], dict[int, list[str]]]:
    """The profile's GPUs (index, serial made from the UUID) and each GPU's dcgm fault words."""
    found: list[tuple[int, str]] = []
    faults: dict[int, list[str]] = {}
    index = -1
    for line in profile.read_text().splitlines():
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if words[0] == "gpu":
            index = int(words[1])
        elif words[0] == "uuid" and index >= 0:
            found.append((index, str(int(words[1].replace("GPU-", "").replace("-", "")[-12:], 16) % 10**13)))
        elif words[0] == "dcgm" and index >= 0:
            faults[index] = words[1:]
    return found, faults


def result(index: int, test: str, level: int, fault: list[str]) -> dict[str, object]:
    target = "software" if level == 1 else "memory"
    entry: dict[str, object] = {"entity_group": "GPU", "entity_group_id": 1, "entity_id": index, "status": "Pass"}
    if test != target or not fault:
        return entry
    kind, code = fault[0], int(fault[1]) if len(fault) > 1 else 0
    entry["status"] = {"fail": "Fail", "skip": "Skip", "warn": "Warn"}[kind]
    if kind in ("fail", "warn"):
        entry["warnings"] = [{"error_category": 10, "error_id": code, "error_severity": 2 if kind == "fail" else 1,
                              "warning": f"DCGM_FR error {code} on GPU {index} (gpufleet lab double)"}]
    return entry


def diag(level: int) -> dict[str, object]:
    found, faults = gpus(PROFILE)
    categories: dict[str, list[dict[str, object]]] = {}
    for category, test in TESTS[level]:
        results = [result(i, test, level, faults.get(i, [])) for i, _ in found]
        statuses = {r["status"] for r in results}
        summary = "Fail" if "Fail" in statuses else "Warn" if "Warn" in statuses else "Pass"
        categories.setdefault(category, []).append({"name": test, "results": results,
                                                    "test_summary": {"status": summary}})
    return {"DCGM Diagnostic": {"test_categories": [{"category": c, "tests": t} for c, t in categories.items()]},
            "entity_groups": [{"entity_group": "GPU", "entity_group_id": 1,
                               "entities": [{"entity_id": i, "device_id": "2330", "serial_num": s}
                                            for i, s in found]}],
            "metadata": {"version": "4.2.3 (gpufleet lab double)", "Driver Version Detected": "lab"}}


def main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[0] == "diag" and argv[1] in ("-r", "--run") and argv[2] in ("1", "2", "3", "4"):
        print(json.dumps(diag(int(argv[2])), indent=4) if "--json" in argv else f"level {argv[2]}: see --json")
        return 0
    print(f"dcgmi (gpufleet lab double): not available here: {' '.join(argv)}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
