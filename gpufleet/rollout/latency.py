"""The canary's latency, judged on vLLM's own percentiles: its p95 time to first token and inter-token latency over
the watch, from the fleet's Prometheus (vLLM's histograms, per replica), against

- its model's replicas of the same shape not rolled yet, over the same window (a pipeline replica answers slower
  than a one-node one: shapes are not compared with each other): the same load at the same time, both figures;
- the stored baseline of the release being replaced: the bench record of its model, that release, its shape and
  GPU profile (``gpufleet bench``), vLLM's own p95 at the lowest measured rate per replica at or above the canary's
  rate over the watch, where no peer is a reference (a canary as slow as its peers met a load, not a slower
  release): inter-token latency only (the time to first token of live traffic depends on the prompts
  clients happen to send, which a bench's workload does not know; a token's time does not).

``--canary-bench`` (:mod:`gpufleet.rollout.canary_bench`) compares both figures of its own client with the
record's, the same client on the same workload. The canary fails when a figure's p95 is more than
``--max-latency-ratio`` times a reference's, judged once it served at least ``--canary-min-requests`` requests over
the watch (a peer group with fewer is not a reference). Against a record, the figure's mean must be over that ratio
too where both means are known: the record was measured alone, under the bench's load, and a p95 is interpolated
within a bucket (vLLM's inter-token buckets start at 10 and 25 ms: a few tokens slowed by the live load move a p95
near 10 ms by half a bucket), while the mean is exact (the histogram's sum) and moves with the time of every
token; against peers, at the same time under the same load, a tail that grew is the release's, and the p95
alone judges. Pure but for :class:`PrometheusLatency`.

A canary is never passed on no evidence (:func:`evidence`): one the routers sent fewer than
``--canary-min-requests`` requests over its watch is watched on, up to ``--canary-max-s`` (three times the watch
unless given), until it has; one its ``--canary-bench`` judged needs no more; one still short at the bound fails,
and is rolled back, saying so (``--canary-bench`` gives it a load of its own).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from gpufleet.measure.engine_histograms import HISTOGRAMS
from gpufleet.measure.records import Record, RecordKey, latest
from gpufleet.prometheus_api import SCRAPE_WAIT_S, query_value

DEFAULT_MIN_REQUESTS = 20
MAX_WATCH_FACTOR = 3.0
"""``--canary-max-s`` unless given: this many times the watch (``--canary-s``), at most :data:`MAX_WATCH_S`."""
MAX_WATCH_S = 86400.0
"""The longest a watch may be (``--canary-s``) or go on (``--canary-max-s``, given or not): a day."""
WHAT = {"ttft": "time to first token", "itl": "inter-token latency"}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


@dataclass(frozen=True)
class Percentiles:
    """Requests served over a window (or, of a record, requests a second per replica), p95 TTFT and ITL, and their
    means where known."""

    requests: float
    ttft: float | None
    itl: float | None
    ttft_mean: float | None = None
    itl_mean: float | None = None

    def line(self) -> str:
        means = (f" (means {_ms(self.ttft_mean)}, {_ms(self.itl_mean)})"
                 if self.ttft_mean is not None or self.itl_mean is not None else "")
        return f"TTFT p95 {_ms(self.ttft)}, ITL p95 {_ms(self.itl)}{means}"

    def mean(self, key: str) -> float | None:
        return self.ttft_mean if key == "ttft" else self.itl_mean


class LatencySource(Protocol):
    """Where the replicas' percentiles come from, and when what they served until now is there."""

    def settle(self, replicas: Sequence[str]) -> float:
        """Wait until what ``replicas`` served until now can be read; the seconds waited."""
        ...

    def percentiles(self, replicas: Sequence[str], window_s: float) -> Percentiles: ...


class PrometheusLatency:
    """:class:`LatencySource` over Prometheus's HTTP API at ``base_url``."""

    POLL_S = 1.0

    def __init__(self, base_url: str, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.base_url, self.clock, self.sleep = base_url, clock, sleep

    @staticmethod
    def _labels(replicas: Sequence[str]) -> str:
        names = "|".join(re.escape(name) for name in replicas)
        return f'job="vllm", replica=~{json.dumps(f"^(?:{names})$")}'

    @staticmethod
    def scraped_query(replicas: Sequence[str]) -> str:
        """PromQL of the oldest last scrape (Unix time) of the replicas' vLLM targets."""
        return f"min(timestamp(up{{{PrometheusLatency._labels(replicas)}}}))"

    def settle(self, replicas: Sequence[str]) -> float:
        """Wait until every vLLM target of ``replicas`` was scraped after now, as Prometheus's clock has it (a
        scrape's samples carry the time it began), at most :data:`SCRAPE_WAIT_S`: until the latest of their next
        scrapes (each target keeps its own offset in the interval), about half an interval for one target and
        two thirds for two, rather than a whole interval."""
        since = query_value(self.base_url, "vector(time())")  # a vector: query_value reads those
        started = self.clock()
        while True:
            waited = self.clock() - started
            scraped = query_value(self.base_url, self.scraped_query(replicas))
            if (since is not None and scraped is not None and scraped >= since) or waited >= SCRAPE_WAIT_S:
                return waited
            self.sleep(min(self.POLL_S, SCRAPE_WAIT_S - waited))

    @staticmethod
    def queries(replicas: Sequence[str], window_s: float) -> dict[str, str]:
        """PromQL of the replicas' request count, p95s and means over the last ``window_s`` seconds."""
        labels = PrometheusLatency._labels(replicas)
        window = f"{max(1, round(window_s))}s"
        found = {"requests": f"sum(increase({HISTOGRAMS['ttft']}_count{{{labels}}}[{window}]))"}
        for key, name in HISTOGRAMS.items():
            found[key] = f"histogram_quantile(0.95, sum by (le) (increase({name}_bucket{{{labels}}}[{window}])))"
            found[f"{key}_mean"] = (f"sum(increase({name}_sum{{{labels}}}[{window}]))"
                                    f" / sum(increase({name}_count{{{labels}}}[{window}]))")
        return found

    def percentiles(self, replicas: Sequence[str], window_s: float) -> Percentiles:
        asked = self.queries(replicas, window_s)
        values = {key: query_value(self.base_url, expr) for key, expr in asked.items()}
        return Percentiles(values["requests"] or 0.0, values["ttft"], values["itl"], values["ttft_mean"],
                           values["itl_mean"])


def baseline_record(records: Sequence[Record], model: str, release: str, layout: str,
                    profile: str) -> Record | None:
    """The newest record of ``model`` on ``release`` for one replica of ``layout`` on ``profile``, else through the
    routers over replicas all of that layout and profile."""
    newest = latest(list(records))
    return (newest.get(RecordKey(model, release, layout, profile, "replica"))
            or newest.get(RecordKey(model, release, layout, profile, "routers")))


def stored_percentiles(record: Record | None, rps_per_replica: float, *, engine: bool) -> Percentiles | None:
    """The record's p95s at the lowest measured rate per replica at or above ``rps_per_replica`` (``engine``:
    vLLM's histograms, with their means where the record has them, else the bench client's); None without a
    record or those figures, or when the canary served more than every step (its latency is not comparable then)."""
    if record is None:
        return None
    each = max(1, record.replicas)
    fit = [s for s in sorted(record.steps, key=lambda s: s.rate) if s.rate / each >= rps_per_replica]
    if not fit:
        return None
    step = fit[0]
    if not engine:
        return (Percentiles(step.rate / each, step.ttft_p95_s, step.itl_p95_s)
                if step.ttft_p95_s is not None or step.itl_p95_s is not None else None)
    if step.engine_ttft_p95_s is None and step.engine_itl_p95_s is None:
        return None
    return Percentiles(step.rate / each, step.engine_ttft_p95_s, step.engine_itl_p95_s, step.engine_ttft_mean_s,
                       step.engine_itl_mean_s)


def latency_verdict(canary: Percentiles, peers: Percentiles | None, stored: Percentiles | None,
                    max_ratio: float, min_requests: int, stored_keys: Sequence[str] = ("ttft", "itl")) -> str | None:
    """Why the canary's latency is too high against its peers (both figures), or, without a peer reference, the
    stored baseline (the figures of ``stored_keys``): a canary as slow as its peers met a load, not a slower
    release; or None. A figure fails on its p95; against the stored baseline, confirmed by its mean where both
    means are known."""
    if canary.requests < min_requests:
        return None
    keys: Sequence[str]
    if peers is not None and peers.requests >= min_requests:
        label, reference, keys = "the replicas of its shape not rolled", peers, ("ttft", "itl")
    elif stored is not None:
        label, reference, keys = f"the stored baseline at {stored.requests:.3g} req/s per replica", stored, stored_keys
    else:
        return None
    for key in keys:
        mine, theirs = getattr(canary, key), getattr(reference, key)
        if mine is None or not theirs or mine <= max_ratio * theirs:
            continue
        mean, their_mean = canary.mean(key), reference.mean(key)
        means = ""
        if reference is stored and mean is not None and their_mean:
            if mean <= max_ratio * their_mean:
                continue  # the p95 moved within its buckets, the time of a token did not
            means = f"; its mean {mean / their_mean:.2f} times"
        return (f"{WHAT[key]} p95 {mine * 1000:.0f} ms over {canary.requests:.0f} requests, {mine / theirs:.2f}"
                f" times {label} ({theirs * 1000:.0f} ms){means}; at most {max_ratio:g} times is allowed"
                " (--max-latency-ratio)")
    return None


@dataclass(frozen=True)
class Evidence:
    """Whether a canary served enough to be judged, and the report's words for how (None: over its watch as asked),
    or, not judged, why (the rollout's failure)."""

    judged: bool
    line: str | None = None


def evidence(served: int, watched_s: float, min_requests: int, *, extended: bool = False, benched: int | None = None,
             hint: str = "--canary-bench gives it a load of its own") -> Evidence:
    """What a canary that the routers sent ``served`` requests over a watch of ``watched_s`` seconds (``extended``:
    past the watch asked, because it had served too few then) was judged on: those requests when at least
    ``min_requests``; else its canary bench's, when that served ``benched`` of at least as many and judged them;
    else nothing, and ``hint`` says what would give it a load."""
    if served >= min_requests:
        return Evidence(True, f"judged after extending the watch to {watched_s:.0f} s ({served} requests)"
                              if extended else None)
    if benched is not None and benched >= min_requests:
        return Evidence(True, f"judged on the canary bench ({benched} requests); the watch saw {served} in"
                              f" {watched_s:.0f} s")
    return Evidence(False, f"not judged: only {served} requests after {watched_s:.0f} s (fewer than {min_requests},"
                           f" --canary-min-requests); {hint}")
