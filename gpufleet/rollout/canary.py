"""The canary watch's verdict: is a freshly rolled replica worse than its model's replicas not rolled yet? Pure.

The routers count, per server, the requests it was sent (``req_tot``), the 5xx answers among them (``hrsp_5xx``)
and its average response time over its last requests (``rtime``, ms). The watch reads them on every router when it
starts and when it ends. A replica's traffic over the watch is the difference, summed over the routers (a counter
that went down means the router restarted and counted again from 0: its new value is the traffic); its response
time is the routers' ``rtime``, at the start and at the end, weighed by the requests each sent it. The baseline is
the same over the model's replicas that are not rolled yet and were up during the watch.

A canary is judged bad when:

- its 5xx share exceeds the baseline's by more than ``max_error_ratio`` (no baseline: a share of 0), judged from
  its first request;
- its response time grew over the watch more than ``max_latency_ratio`` times as much as the baseline's did (no
  baseline, or a baseline that got faster: more than ``max_latency_ratio`` times), judged once it, and the
  baseline when there is one, had at least :data:`MIN_LATENCY_REQUESTS` requests. Each replica is measured
  against its own figure from before: replicas of one model may differ in shape (a pipeline over two nodes
  answers slower than one node), so their absolute times are not compared. HAProxy's average moves slowly (the
  start's figure is still mostly the release before): it catches a replica much slower than before, not a little.

A canary that got no request is not judged on traffic (the rollout still requires it UP on every router).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

DEFAULT_MAX_ERROR_RATIO = 0.05
DEFAULT_MAX_LATENCY_RATIO = 1.5
MIN_LATENCY_REQUESTS = 10


@dataclass(frozen=True)
class Counters:
    """One server's counters on one router at one moment."""

    requests: int
    errors: int  # 5xx answers
    rtime_ms: int


@dataclass(frozen=True)
class Traffic:
    """Requests and 5xx answers over the watch, and the mean response time (ms) at its end."""

    requests: int = 0
    errors: int = 0
    rtime_ms: float = 0.0
    rtime_before_ms: float = 0.0  # the routers' figure when the watch started

    @property
    def latency_growth(self) -> float | None:
        """How many times its response time grew over the watch (None: no figure from before)."""
        return self.rtime_ms / self.rtime_before_ms if self.rtime_before_ms > 0 else None

    @property
    def error_ratio(self) -> float:
        return self.errors / self.requests if self.requests else 0.0


@dataclass(frozen=True)
class Thresholds:
    max_error_ratio: float = DEFAULT_MAX_ERROR_RATIO
    max_latency_ratio: float = DEFAULT_MAX_LATENCY_RATIO


def _grown(before: int, after: int) -> int:
    """How much a counter grew; one that went down was reset (the router restarted) and counts from 0."""
    return after - before if after >= before else after


def traffic(pairs: Iterable[tuple[Counters, Counters]]) -> Traffic:
    """One replica's (or several's) traffic from (before, after) counters, one pair per router and replica."""
    requests = errors = 0
    weighed = weighed_before = 0.0
    for before, after in pairs:
        sent = _grown(before.requests, after.requests)
        requests += sent
        errors += _grown(before.errors, after.errors)
        weighed += sent * after.rtime_ms
        weighed_before += sent * before.rtime_ms
    if not requests:
        return Traffic()
    return Traffic(requests, min(errors, requests), weighed / requests, weighed_before / requests)


def verdict(canary: Traffic, baseline: Traffic | None, limits: Thresholds, judge_rtime: bool = True) -> str | None:
    """Why the canary is worse than the baseline, or None when it is not; without ``judge_rtime`` on its 5xx only
    (its latency is judged on vLLM's percentiles instead: :mod:`gpufleet.rollout.latency`)."""
    if canary.requests == 0:
        return None
    base = baseline or Traffic()
    if canary.error_ratio > base.error_ratio + limits.max_error_ratio:
        return (f"5xx on {canary.errors} of {canary.requests} requests ({canary.error_ratio:.1%}), the replicas not"
                f" rolled {base.errors} of {base.requests} ({base.error_ratio:.1%}); at most"
                f" {limits.max_error_ratio:.1%} more is allowed (--max-error-ratio)")
    grown = canary.latency_growth
    if not judge_rtime or grown is None or canary.requests < MIN_LATENCY_REQUESTS:
        return None
    if baseline is None:
        if grown > limits.max_latency_ratio:
            return (f"mean response time {canary.rtime_before_ms:.0f} -> {canary.rtime_ms:.0f} ms over the watch"
                    f" ({grown:.2f} times); at most {limits.max_latency_ratio:g} times is allowed"
                    " (--max-latency-ratio)")
        return None
    base_grown = base.latency_growth
    if base.requests < MIN_LATENCY_REQUESTS or base_grown is None:
        return None
    if grown > limits.max_latency_ratio * max(1.0, base_grown):
        return (f"mean response time {canary.rtime_before_ms:.0f} -> {canary.rtime_ms:.0f} ms over the watch"
                f" ({grown:.2f} times), the replicas not rolled {base.rtime_before_ms:.0f} ->"
                f" {base.rtime_ms:.0f} ms ({base_grown:.2f} times); at most {limits.max_latency_ratio:g} times"
                " their growth is allowed (--max-latency-ratio)")
    return None
