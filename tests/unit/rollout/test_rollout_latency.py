"""The canary's latency verdict as data (tests/data/rollout_latency/cases.yml), the stored baseline a bench record
gives at the canary's rate, the record a canary is compared with, whether a canary served enough to be judged
at all (tests/data/rollout_latency/evidence.yml), and how long its figures are waited for."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import yaml

from gpufleet.measure.ramp import Slo, Step
from gpufleet.measure.records import Record, RecordKey
from gpufleet.prometheus_api import SCRAPE_WAIT_S
from gpufleet.rollout import latency as latency_module
from gpufleet.rollout.canary_bench import bench_plan, stored_at
from gpufleet.rollout.latency import (
    DEFAULT_MIN_REQUESTS,
    Evidence,
    Percentiles,
    PrometheusLatency,
    baseline_record,
    evidence,
    latency_verdict,
    stored_percentiles,
)
from tests.conftest import DATA

CASES = yaml.safe_load((DATA / "rollout_latency" / "cases.yml").read_text())


def _percentiles(row: list[Any] | None) -> Percentiles | None:
    return None if row is None else Percentiles(*row)


def test_there_are_cases_of_both_verdicts() -> None:
    assert {case["verdict"] is None for case in CASES} == {True, False}


@pytest.mark.parametrize("case", CASES, ids=[case["name"] for case in CASES])
def test_case(case: dict[str, Any]) -> None:
    canary = _percentiles(case["canary"])
    assert canary is not None
    found = latency_verdict(canary, _percentiles(case.get("peers")), _percentiles(case.get("stored")),
                            case.get("ratio", 1.5), case.get("min_requests", 20),
                            tuple(case.get("stored_keys", ("ttft", "itl"))))
    if case["verdict"] is None:
        assert found is None
    else:
        assert found is not None and case["verdict"] in found, found


def _step(rate: float, ttft_p95: float) -> Step:
    return Step(rate, rate, ttft_p95, ttft_p95, 0.02, 0.03, 1.0, 2.0, 30.0, 20, 0, 60.0, offered=20,
                ttft_p95_s=ttft_p95, itl_p95_s=0.025, engine_ttft_p99_s=ttft_p95, engine_itl_p99_s=0.03,
                engine_ttft_p95_s=ttft_p95 / 2, engine_itl_p95_s=0.02 * rate)


def _record(release: str, scope: str, replicas: int, date: str = "2026-11-20T00:00:00+00:00") -> Record:
    key = RecordKey("m", release, "tp1-pp1", "8xH100-SXM", scope)
    return Record(key, replicas, Slo(1, 0.1), [_step(1, 0.1), _step(2, 0.2), _step(4, 0.5)], {}, "guidellm 0.8.1",
                  date, 60.0)


def test_the_stored_baseline_is_the_lowest_step_at_or_above_the_canarys_rate_per_replica() -> None:
    one = _record("0.31.0", "replica", 1)
    assert stored_percentiles(one, 0.3, engine=False) == Percentiles(1.0, 0.1, 0.025)
    assert stored_percentiles(one, 1.5, engine=False) == Percentiles(2.0, 0.2, 0.025)
    assert stored_percentiles(one, 1.5, engine=True) == Percentiles(2.0, 0.1, 0.04)  # vLLM's own histograms
    assert stored_percentiles(one, 4.5, engine=False) is None  # busier than any step measured: not comparable
    assert stored_percentiles(None, 1.0, engine=True) is None
    two = _record("0.31.0", "routers", 2)  # 0.5, 1 and 2 req/s per replica
    assert stored_percentiles(two, 0.75, engine=False) == Percentiles(1.0, 0.2, 0.025)
    unread = Record(one.key, 1, one.slo, [replace(s, engine_ttft_p95_s=None, engine_itl_p95_s=None) for s in one.steps],
                    {}, "guidellm 0.8.1", one.date, 60.0)  # Prometheus could not be read during its bench
    assert stored_percentiles(unread, 0.3, engine=True) is None


def test_a_canary_is_compared_with_its_release_shape_and_profile() -> None:
    routers, replica = _record("0.31.0", "routers", 2), _record("0.31.0", "replica", 1)
    assert baseline_record([routers, replica], "m", "0.31.0", "tp1-pp1", "8xH100-SXM") == replica
    assert baseline_record([routers], "m", "0.31.0", "tp1-pp1", "8xH100-SXM") == routers
    assert baseline_record([routers, replica], "m", "0.32.0", "tp1-pp1", "8xH100-SXM") is None
    assert baseline_record([routers, replica], "m", "0.31.0", "tp1-pp2", "8xH100-SXM") is None
    newer = _record("0.31.0", "replica", 1, date="2026-11-25T00:00:00+00:00")
    assert baseline_record([replica, newer], "m", "0.31.0", "tp1-pp1", "8xH100-SXM") is newer


def test_a_canary_is_benched_at_half_its_releases_ceiling_per_replica_or_not_at_all() -> None:
    two = _record("0.31.0", "routers", 2)  # passes at 1, 2 and 4 req/s over 2 replicas: 2 each
    planned = bench_plan([two], "m", "0.31.0", "tp1-pp1", "8xH100-SXM")
    assert planned.rate == 1.0 and planned.record is two
    assert stored_at(planned) == Percentiles(1.0, 0.2, 0.025)
    missing = bench_plan([two], "m", "0.32.0", "tp1-pp1", "8xH100-SXM")
    assert (missing.rate, missing.why_not) == (None, "no bench record of vLLM 0.32.0 tp1-pp1 on 8xH100-SXM")
    assert stored_at(missing) is None


EVIDENCE = yaml.safe_load((DATA / "rollout_latency" / "evidence.yml").read_text())


@pytest.mark.parametrize("case", EVIDENCE, ids=[case["name"] for case in EVIDENCE])
def test_a_canary_is_judged_on_enough_requests_or_says_why_not(case: dict[str, Any]) -> None:
    assert set(case) <= {"name", "served", "watched_s", "extended", "min_requests", "benched", "hint", "judged",
                         "line"}
    hint = {"hint": case["hint"]} if "hint" in case else {}
    found = evidence(case["served"], case["watched_s"], case.get("min_requests", DEFAULT_MIN_REQUESTS),
                     extended=case.get("extended", False), benched=case.get("benched"), **hint)
    assert found == Evidence(case["judged"], case["line"])


def test_the_evidence_cases_cover_each_way() -> None:
    lines = [case["line"] or "" for case in EVIDENCE]
    assert {case["judged"] for case in EVIDENCE} == {True, False}
    for words in ("judged after extending the watch", "judged on the canary bench", "not judged: only"):
        assert any(words in line for line in lines), words


@pytest.mark.parametrize(("scraped", "waited"), [
    ([-10.0, -5.0, 1.5], 2.0),  # the third poll finds a scrape begun after the watch
    ([0.0], 0.0),  # scraped as the watch ended: at once
    ([None], SCRAPE_WAIT_S),  # no target of theirs: an interval's wait, as before
    ([-1.0], SCRAPE_WAIT_S),  # never scraped again: no longer than an interval
], ids=["after-two-polls", "at-once", "no-target", "bounded"])
def test_the_canary_is_read_once_its_targets_were_scraped_after_its_watch(
        monkeypatch: pytest.MonkeyPatch, scraped: list[float | None], waited: float) -> None:
    now, asked = [1000.0], []

    def oldest_scrape(base_url: str, expr: str, at: float | None = None) -> float | None:
        if expr == "vector(time())":  # Prometheus's clock, 500 s ahead of this one: the scrapes are judged on its own
            return 1500.0
        asked.append(expr)
        found = scraped[min(len(asked), len(scraped)) - 1]
        return None if found is None else 1500.0 + found

    monkeypatch.setattr(latency_module, "query_value", oldest_scrape)
    source = PrometheusLatency("http://127.0.0.1:9", clock=lambda: now[0],
                               sleep=lambda s: now.__setitem__(0, now[0] + s))
    assert source.settle(["r1", "r.2"]) == waited
    assert set(asked) == {'min(timestamp(up{job="vllm", replica=~"^(?:r1|r\\\\.2)$"}))'}
