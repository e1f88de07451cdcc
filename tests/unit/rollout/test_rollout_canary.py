"""The canary watch's verdict (gpufleet/rollout/canary.py): cases as data (tests/data/rollout_canary/cases.yml)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from gpufleet.rollout.canary import Counters, Thresholds, traffic, verdict
from tests.conftest import DATA

CASES = yaml.safe_load((DATA / "rollout_canary" / "cases.yml").read_text())


def _pairs(side: list[Any]) -> list[tuple[Counters, Counters]]:
    return [(Counters(*before), Counters(*after)) for before, after in side]


CASE_LATENCY_RATIO = 2.0  # the cases' --max-latency-ratio unless they give one (the option's default is 1.5)


def test_there_are_enough_cases_of_both_verdicts() -> None:
    assert len(CASES) >= 12
    assert {case["verdict"] is None for case in CASES} == {True, False}


@pytest.mark.parametrize("case", CASES, ids=[case["name"] for case in CASES])
def test_case(case: dict[str, Any]) -> None:
    assert set(case) <= {"name", "canary", "baseline", "limits", "traffic", "verdict", "judge_rtime"}
    canary = traffic(_pairs(case["canary"]))
    baseline = traffic(_pairs(case["baseline"])) if case["baseline"] is not None else None
    if "traffic" in case:
        assert [canary.requests, canary.errors, round(canary.rtime_ms)] == case["traffic"]
    found = verdict(canary, baseline, Thresholds(**{"max_latency_ratio": CASE_LATENCY_RATIO, **case.get("limits", {})}),
                    judge_rtime=case.get("judge_rtime", True))
    if case["verdict"] is None:
        assert found is None
    else:
        assert found is not None and case["verdict"] in found
