"""The planner's memory figures against what vLLM reported at start-up (tests/data/plan_accuracy/reference.yml).

Every case is planned by bench/plan_accuracy.py as `gpufleet plan` plans a pool, and each planned figure must lie
within the file's bounds of vLLM's: KV tokens 0.90-1.02 (conservative: never more than 2% above), weights within
3%, the reserve at or above vLLM's.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

_SPEC = importlib.util.spec_from_file_location("bench_plan_accuracy",
                                               Path(__file__).parents[3] / "bench" / "plan_accuracy.py")
assert _SPEC is not None and _SPEC.loader is not None
accuracy = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(accuracy)

BOUNDS, CASES = accuracy.load_cases()
FIGURES = {"weights_gib": "weights", "kv_tokens": "kv_tokens", "reserve_gib": "reserve"}


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_planned_figures_are_within_bounds_of_vllms(case: dict[str, object]) -> None:
    planned = accuracy.planned(case)
    reported = case["vllm"]
    assert isinstance(reported, dict) and reported
    for key, figure in FIGURES.items():
        if key in reported:
            low, high = BOUNDS[figure]
            ratio = planned[key] / reported[key]
            assert low <= ratio <= high, f"{case['name']}: {figure} {planned[key]} / {reported[key]} = {ratio:.4f}"


def test_every_figure_of_the_reference_notes_is_a_case() -> None:
    names = {c["name"] for c in CASES}
    assert len(names) == len(CASES) == 14
    assert sum("kv_tokens" in c["vllm"] for c in CASES) == 13  # the table of vLLM 0.19.0's start-up figures
    assert any("reserve_gib" in c["vllm"] for c in CASES)  # DeepSeek-R1 on vLLM 0.7.3


def test_the_bounds_catch_an_optimistic_plan(tmp_path: Path) -> None:
    """A reported figure 5% below the plan (the plan 5% optimistic) fails, and the bench says so."""
    doc = yaml.safe_load(accuracy.REFERENCE.read_text())
    case = doc["cases"][0]
    case["vllm"]["kv_tokens"] = int(accuracy.planned({**doc["defaults"], **case})["kv_tokens"] / 1.05)
    doc["cases"] = [case]
    path = tmp_path / "reference.yml"
    path.write_text(yaml.safe_dump(doc))
    result = accuracy.measure(path)
    assert result["all_within"] is False
    assert result["cases"][0]["within"] == {"weights": True, "kv_tokens": False}
    assert result["summary"]["kv_tokens"]["max"] == pytest.approx(1.05, abs=0.001)


def test_the_bench_summarises_every_figure() -> None:
    result = accuracy.measure()
    assert result["all_within"] is True
    assert set(result["summary"]) == {"weights", "kv_tokens", "reserve"}
    assert result["summary"]["kv_tokens"]["cases"] == 13
    for row in result["cases"]:
        assert set(row["ratio"]) == set(row["within"]) and row["ratio"]
