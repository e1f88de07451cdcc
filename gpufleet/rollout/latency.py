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
record's, the same client on the same workload. The canary fails when a figure is more than
``--max-latency-ratio`` times a reference, judged once it served at least ``--canary-min-requests`` requests over
the watch (a peer group with fewer is not a reference). Pure but for :class:`PrometheusLatency`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from gpufleet.bench.engine_histograms import HISTOGRAMS
from gpufleet.bench.records import Record, RecordKey, latest
from gpufleet.prometheus_api import SCRAPE_WAIT_S, query_value

DEFAULT_MIN_REQUESTS = 20
WHAT = {"ttft": "time to first token", "itl": "inter-token latency"}


@dataclass(frozen=True)
class Percentiles:
    """Requests served over a window (or, of a record, requests a second per replica), and p95 TTFT and ITL."""

    requests: float
    ttft: float | None
    itl: float | None

    def line(self) -> str:
        def ms(value: float | None) -> str:
            return "-" if value is None else f"{value * 1000:.0f} ms"
        return f"TTFT p95 {ms(self.ttft)}, ITL p95 {ms(self.itl)}"


class LatencySource(Protocol):
    """Where the replicas' percentiles come from, and how long after a moment they are there."""

    wait_s: float

    def percentiles(self, replicas: Sequence[str], window_s: float) -> Percentiles: ...


class PrometheusLatency:
    """:class:`LatencySource` over Prometheus's HTTP API at ``base_url``."""

    wait_s = SCRAPE_WAIT_S

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url

    @staticmethod
    def queries(replicas: Sequence[str], window_s: float) -> dict[str, str]:
        """PromQL of the replicas' request count and p95s over the last ``window_s`` seconds."""
        names = "|".join(re.escape(name) for name in replicas)
        labels = f'job="vllm", replica=~{json.dumps(f"^(?:{names})$")}'
        window = f"{max(1, round(window_s))}s"
        found = {"requests": f"sum(increase({HISTOGRAMS['ttft']}_count{{{labels}}}[{window}]))"}
        for key, name in HISTOGRAMS.items():
            found[key] = f"histogram_quantile(0.95, sum by (le) (increase({name}_bucket{{{labels}}}[{window}])))"
        return found

    def percentiles(self, replicas: Sequence[str], window_s: float) -> Percentiles:
        asked = self.queries(replicas, window_s)
        values = {key: query_value(self.base_url, expr) for key, expr in asked.items()}
        return Percentiles(values["requests"] or 0.0, values["ttft"], values["itl"])


def baseline_record(records: Sequence[Record], model: str, release: str, layout: str,
                    profile: str) -> Record | None:
    """The newest record of ``model`` on ``release`` for one replica of ``layout`` on ``profile``, else through the
    routers over replicas all of that layout and profile."""
    newest = latest(list(records))
    return (newest.get(RecordKey(model, release, layout, profile, "replica"))
            or newest.get(RecordKey(model, release, layout, profile, "routers")))


def stored_percentiles(record: Record | None, rps_per_replica: float, *, engine: bool) -> Percentiles | None:
    """The record's p95s at the lowest measured rate per replica at or above ``rps_per_replica`` (``engine``:
    vLLM's histograms, else the bench client's); None without a record or those figures, or when the canary served
    more than every step (its latency is not comparable then)."""
    if record is None:
        return None
    each = max(1, record.replicas)
    fit = [s for s in sorted(record.steps, key=lambda s: s.rate) if s.rate / each >= rps_per_replica]
    if not fit:
        return None
    step = fit[0]
    ttft, itl = (step.engine_ttft_p95_s, step.engine_itl_p95_s) if engine else (step.ttft_p95_s, step.itl_p95_s)
    if ttft is None and itl is None:
        return None
    return Percentiles(step.rate / each, ttft, itl)


def latency_verdict(canary: Percentiles, peers: Percentiles | None, stored: Percentiles | None,
                    max_ratio: float, min_requests: int, stored_keys: Sequence[str] = ("ttft", "itl")) -> str | None:
    """Why the canary's latency is too high against its peers (both figures), or, without a peer reference, the
    stored baseline (the figures of ``stored_keys``): a canary as slow as its peers met a load, not a slower
    release; or None."""
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
        if mine is not None and theirs and mine > max_ratio * theirs:
            return (f"{WHAT[key]} p95 {mine * 1000:.0f} ms over {canary.requests:.0f} requests, {mine / theirs:.2f}"
                    f" times {label} ({theirs * 1000:.0f} ms); at most {max_ratio:g} times is allowed"
                    " (--max-latency-ratio)")
    return None
