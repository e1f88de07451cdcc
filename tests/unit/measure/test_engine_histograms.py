"""vLLM's own p95 over a bench step: the latency histograms of a real lab replica's ``/metrics`` page
(tests/data/engine_histograms), and what a step observed between two readings of it."""

from __future__ import annotations

import math

import pytest

from gpufleet.measure.engine_histograms import (
    HISTOGRAMS,
    Reading,
    above_between,
    mean_between,
    parse,
    quantile,
    quantile_between,
    read,
)
from tests.conftest import DATA
from tests.loopback_http import QuietHandler, loopback_server

PAGE = (DATA / "engine_histograms" / "lab-single-before.txt").read_text()


def _counts(name: str, text: str = PAGE) -> dict[float, float]:
    """The page's cumulative buckets of ``name``, read independently of the module."""
    found: dict[float, float] = {}
    for line in text.splitlines():
        if line.startswith(f"{name}_bucket{{"):
            le = line.split('le="')[1].split('"')[0]
            found[float(le)] = found.get(float(le), 0.0) + float(line.rsplit(" ", 1)[1])
    return found


def test_a_real_page_gives_both_histograms_and_nothing_else() -> None:
    buckets = parse(PAGE).buckets
    assert set(buckets) == set(HISTOGRAMS)
    for key, name in HISTOGRAMS.items():
        assert buckets[key] == _counts(name) and math.inf in buckets[key]
        count = [line for line in PAGE.splitlines() if line.startswith(f"{name}_count{{")]
        assert buckets[key][math.inf] == float(count[0].rsplit(" ", 1)[1])


@pytest.mark.parametrize(("cumulative", "expected"), [
    ({0.01: 0, 0.025: 50, 0.05: 100, math.inf: 100}, 0.025 + 0.025 * 45 / 50),  # within a bucket
    ({0.01: 100, math.inf: 100}, 0.0095),  # the first bucket starts at 0
    ({0.01: 0, 0.05: 90, math.inf: 100}, 0.05),  # in +Inf: the highest finite bound
    ({0.01: 0, math.inf: 0}, None),  # nothing observed
])
def test_the_quantile_interpolates_within_its_bucket_as_prometheus_does(cumulative: dict[float, float],
                                                                          expected: float | None) -> None:
    found = quantile(0.95, cumulative)
    assert found == (pytest.approx(expected) if expected is not None else None)


def test_a_step_is_what_it_added_to_the_histograms() -> None:
    before = parse(PAGE).buckets
    after = {key: dict(counts) for key, counts in before.items()}
    for bound in after["itl"]:  # 100 tokens: 90 within 25 ms, 10 between 50 and 75 ms
        after["itl"][bound] += 100 if bound >= 0.075 else 90 if bound >= 0.025 else 0
    for bound in after["ttft"]:  # 20 first tokens, all between 20 and 40 ms
        after["ttft"][bound] += 20 if bound >= 0.04 else 0
    p95 = quantile_between(0.95, before, after)
    assert p95["itl"] == pytest.approx(0.05 + 0.025 * 5 / 10)
    assert p95["ttft"] == pytest.approx(0.02 + 0.02 * 19 / 20)
    p99 = quantile_between(0.99, before, after)  # what a bench step is judged on, as the alerts judge a model
    assert p99["itl"] == pytest.approx(0.05 + 0.025 * 9 / 10)
    assert p99["ttft"] == pytest.approx(0.02 + 0.02 * 19.8 / 20)
    assert quantile_between(0.95, before, before) == {"ttft": None, "itl": None}


def test_the_page_sums_and_a_steps_mean() -> None:
    sums = parse(PAGE).sums
    for key, name in HISTOGRAMS.items():
        line = [line for line in PAGE.splitlines() if line.startswith(f"{name}_sum{{")]
        assert sums[key] == float(line[0].rsplit(" ", 1)[1]) and sums[key] > 0
    before = Reading(parse(PAGE).buckets, sums)
    after = Reading({key: {le: n + (50 if key == "itl" else 0) for le, n in counts.items()}
                     for key, counts in before.buckets.items()}, {**sums, "itl": sums["itl"] + 0.75})
    assert mean_between(before, after) == {"ttft": None, "itl": pytest.approx(0.015)}  # 50 tokens, 0.75 s


def test_the_counters_leave_out_the_requests_ended_unanswered_and_add_the_waiting_to_the_running() -> None:
    page = "\n".join([
        'vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 7.0',
        'vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 5.0',
        'vllm:request_success_total{engine="0",finished_reason="abort",model_name="m"} 30.0',
        'vllm:request_success_total{engine="0",finished_reason="error",model_name="m"} 2.0',
        'vllm:generation_tokens_total{engine="0",model_name="m"} 640.0',
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
        'vllm:num_requests_waiting{engine="0",model_name="m"} 40.0',
        'vllm:num_preemptions_total{engine="0",model_name="m"} 4.0',
        "# a comment names vllm:request_success_total 99",
    ])
    reading = parse(PAGE + "\n" + page)
    assert (reading.answered, reading.output_tokens, reading.in_flight) == (12.0, 640.0, 43.0)
    assert (reading.waiting, reading.preemptions) == (40.0, 4.0)
    assert reading.buckets == parse(PAGE).buckets


@pytest.mark.parametrize(("bound", "expected"), [
    (2.0, 25.0),  # above 2.5 s, the smallest bound at or over 2 s: 25 of the step's 40
    (2.5, 25.0),  # a bound that is a bucket's
    (0.1, 35.0),  # those within the 1 s bucket may be under 0.1 s: the 35 above it
    (20.0, 0.0),  # over the last finite bound: none is certainly above it
])
def test_the_observations_certainly_above_a_bound(bound: float, expected: float) -> None:
    before = {"ttft": {1.0: 5.0, 2.5: 10.0, 10.0: 10.0, math.inf: 10.0}, "itl": {}}
    after = {"ttft": {1.0: 10.0, 2.5: 25.0, 10.0: 45.0, math.inf: 50.0}, "itl": {}}
    assert above_between("ttft", bound, before, after) == expected


class _Page(QuietHandler):
    """A replica's ``/metrics``: the lab's page with its engines' queue and preemptions."""

    def do_GET(self) -> None:
        self.answer(200, (PAGE + "\nvllm:num_requests_running 2.0\nvllm:num_requests_waiting 5.0\n"
                          "vllm:num_preemptions_total 1.0\n").encode())


def test_read_sums_the_pages_of_every_replica() -> None:
    one = parse(PAGE)
    with loopback_server(_Page) as first, loopback_server(_Page) as second:
        both = read([f"{first}/metrics", f"{second}/metrics"])
    assert (both.answered, both.output_tokens) == (2 * one.answered, 2 * one.output_tokens)
    assert (both.in_flight, both.waiting, both.preemptions) == (14.0, 10.0, 2.0)
    assert both.buckets["ttft"] == {le: 2 * count for le, count in one.buckets["ttft"].items()}
