"""The burn-in (``gpufleet/node/burn_in.py``) judged from results, not exit codes, without a GPU.

``tests/data/burn_in/dcgm/<case>.json``: what ``dcgmi diag -r LEVEL --json`` printed and its exit status, and the checks
the burn-in must make of it (check, status, GPU, test). ``tests/data/burn_in/floors.yml``: floors files it refuses.
The kernels themselves run on the lab's nodes with the release's torch (the lab tier) and ran on a real H200
(tests/data/gpu_captures/h200-burn-in-quick.json, held to the H200's floors in tests/unit/gpu/test_gpu_captures.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpufleet.node import burn_in
from tests.conftest import DATA

CASES = sorted((DATA / "burn_in" / "dcgm").glob("*.json"))
FLOORS = yaml.safe_load((DATA / "burn_in" / "floors.yml").read_text())


def _floors(tmp_path: Path, patch: dict[str, Any] | None = None) -> Path:
    doc = {**FLOORS["good"], **(patch or {})}
    path = tmp_path / "floors.json"
    path.write_text(json.dumps({k: v for k, v in doc.items() if v is not None}))
    return path


def _runner(status: int, out: str, err: str = "") -> burn_in.Runner:
    calls: list[list[str]] = []

    def run(argv: list[str], timeout: float) -> tuple[int, str, str]:
        calls.append(argv)
        assert timeout > 0
        return status, out, err

    run.calls = calls  # type: ignore[attr-defined]
    return run


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.stem)
def test_dcgm_is_read_test_by_test_and_gpu_by_gpu(path: Path, tmp_path: Path) -> None:
    case = json.loads(path.read_text())
    floors = burn_in.load_floors(_floors(tmp_path))
    runner = _runner(case["exit_status"], case["stdout"], case.get("stderr", ""))
    checks = burn_in.run_dcgm(case["level"], floors, runner, "dcgmi")
    assert runner.calls == [["dcgmi", "diag", "-r", str(case["level"]), "--json"]]  # type: ignore[attr-defined]
    assert [[c.check, c.status, c.gpu, c.evidence.get("test")] for c in checks] == case["expect"]
    for gpu, codes in case.get("codes", {}).items():
        failed = next(c for c in checks if c.gpu == int(gpu) and c.status == "fail")
        assert [w["code"] for w in failed.evidence["warnings"]] == codes
        assert failed.evidence["serial"] == case["serials"][gpu]
    if case["exit_status"] == 127:  # the line a person reads says why
        assert "not found" in checks[0].evidence["stderr"]


@pytest.mark.parametrize("case", FLOORS["cases"], ids=lambda c: next(iter(c["patch"])))
def test_a_bad_floors_file_is_refused_with_one_line(case: dict[str, Any], tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    path = _floors(tmp_path, case["patch"])
    with pytest.raises(burn_in.FloorsError) as caught:
        burn_in.load_floors(path)
    assert str(caught.value) == f"{path}: {case['error']}"
    assert burn_in.main(["--tier", "quick", "--floors", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == f"burn-in: {path}: {case['error']}\n"


def test_a_good_floors_file_loads(tmp_path: Path) -> None:
    floors = burn_in.load_floors(_floors(tmp_path))
    assert (floors.device, floors.matmul_tflops, floors.gate_policy) == ("cuda", 410, "")
    assert all(getattr(floors, key) > 0 and math.isfinite(getattr(floors, key)) for key in burn_in.Floors.POSITIVE)


def test_a_run_fails_on_a_failed_dcgm_test_whose_exit_status_is_0(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole quick tier: the gate passes, dcgmi exits 0 with a failed test, the kernels pass; the verdict fails,
    and names the GPU and the test."""
    case = json.loads((DATA / "burn_in" / "dcgm" / "a_failed_test_with_exit_status_0_fails.json").read_text())
    policy = tmp_path / "policy.json"
    policy.write_text("{}")
    floors = burn_in.load_floors(_floors(tmp_path, {"gate_policy": str(policy)}))

    def run(argv: list[str], timeout: float) -> tuple[int, str, str]:
        if argv[1].endswith("nvml_probe.py"):
            return 0, json.dumps({"passed": True, "failures": []}), ""
        return 0, case["stdout"], ""

    kernels = [burn_in.Check("matmul", "pass", 0, 700.0, 410.0, "TFLOP/s"), burn_in.Check("copy", "pass", 0)]
    monkeypatch.setattr(burn_in, "kernel_checks", lambda *_: kernels)
    verdict = burn_in.burn_in("quick", floors, run)
    assert (verdict["schema"], verdict["tier"], verdict["passed"], verdict["failed"]) == (
        burn_in.SCHEMA, "quick", False, 2)  # r1 and r2 read the same document here: one failure each
    failed = [(c["check"], c["gpu"], c["evidence"]["test"]) for c in verdict["checks"] if c["status"] == "fail"]
    assert failed == [("dcgm-r1", 1, "pcie"), ("dcgm-r2", 1, "pcie")]
    assert verdict["checks"][0] == {"check": "nvml-gate", "status": "pass", "gpu": None, "value": None,
                                    "floor": None, "unit": "", "evidence": {"failures": []}}


def test_without_torch_the_kernels_fail_rather_than_pass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "torch", None)
    checks = burn_in.kernel_checks(burn_in.load_floors(_floors(tmp_path)))
    assert [(c.check, c.status) for c in checks] == [("torch", "fail")]
    assert "no torch" in checks[0].evidence["error"]


# fabric_check.py's stand-in: each rank records its argv; the leader prints a verdict at the floor it was given
FAKE_FABRIC = """import json, os, sys
args = sys.argv[1:]
rank = args[args.index("--rank") + 1]
open(os.environ["FABRIC_LOG"] + rank, "w").write(" ".join(args))
if rank == "0":
    print(json.dumps({"passed": True, "busbw_gbps": 0.4, "world": int(args[args.index("--world") + 1])}))
"""


def test_the_full_tiers_all_reduce_runs_a_rank_per_gpu_and_two_gloo_ranks_on_the_cpu(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    check = burn_in.allreduce_check(burn_in.load_floors(_floors(tmp_path)), _runner(0, ""), 1)
    assert (check.status, check.evidence) == ("skip", {"why": "fewer than two GPUs"})
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "fabric_check.py").write_text(FAKE_FABRIC)
    monkeypatch.setattr(burn_in, "HERE", tools)
    monkeypatch.setenv("FABRIC_LOG", str(tmp_path / "rank-"))
    for device, gpus, ranks, backend in (("cpu", 0, 2, "gloo"), ("cuda", 4, 4, "nccl")):
        floors = burn_in.load_floors(_floors(tmp_path, {"device": device}))
        check = burn_in.allreduce_check(floors, _runner(0, ""), gpus)
        assert (check.status, check.value, check.evidence["world"]) == ("pass", 0.4, ranks)
        argv = [(tmp_path / f"rank-{r}").read_text().split() for r in range(ranks)]
        assert {(a[a.index("--backend") + 1], a[a.index("--iface") + 1]) for a in argv} == {(backend, "lo")}
        assert [("--local-gpu" in a) for a in argv] == [device == "cuda"] * ranks
