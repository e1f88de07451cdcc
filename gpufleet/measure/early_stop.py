"""A step of the ramp stopped once its verdict is certain, rather than at its bound.

A step offers ``rate x step`` requests. When more than 1% of them have already waited longer than the TTFT objective
for their first token (by vLLM's histogram: above the smallest bucket bound at or over the objective, the *edge*),
the step's TTFT p99 misses the objective whatever the rest do: the requests answered can only be fewer than those
offered, and no observation leaves a histogram. An overloaded step then stops there, its client ended and its
backlog dropped, instead of holding the replicas at full load until its bound (the step and the client's grace, 80 s
for a 20 s step).

Two kinds of requests count as late. Those whose first token came above the edge (vLLM's histogram). And those still
without one that have waited past it: a request in an engine's waiting queue at one reading that has no first token
an edge later has waited over it. Of ``W`` requests waiting at a reading, at most as many as the first tokens counted
since can have had theirs, so at least ``W`` less those first tokens are still waiting (less the preemptions since the
step began: a preempted request waits again after its first token). vLLM counts a wait only once its first token
comes: on the lab, the pipeline replica's step at 192 req/s was decided 22 s after it began by the first kind alone,
1,707 first tokens in and 200 of them late, its backlog then thousands of requests that took a further 20 s to drop.

The stopped step is recorded from vLLM's own counters over its span (requests answered, output tokens), the client's
figures left empty, and the reason among its failure reasons; it misses ``ttft`` (and, as a rule, ``unanswered``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gpufleet.measure.engine_histograms import Reading, above_between, bound_over
from gpufleet.measure.ramp import Step

QUANTILE = 0.99
"""The quantile the TTFT objective is a bound of (``vllm_slo_ttft_p99_s``)."""

EVERY_S = 2.0
"""Seconds between two readings of the replicas' ``/metrics`` while a step runs."""

DRAINED_WITHIN_S = 30.0
"""How long a stopped step (and a run, before its first step) waits for the replicas to settle."""

SETTLED_READ_S = 0.5
"""A settled replica's ``/metrics`` answers within this. Its API server serves it on the loop that takes requests: one
still busy with a stopped load (on the lab, writing the tracebacks of thousands of requests its full queue refused)
answers it late, and would answer the next step's first requests late too (seen: 5% of a 4 req/s step's requests
waited over 1 s for a first token, 11 s after the engines were empty)."""


def settled(read: Callable[[], Reading | None], within_s: float = DRAINED_WITHIN_S, every_s: float = 0.5,
            clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> bool:
    """Whether the replicas settled within ``within_s``: two reads in a row (``read``: their ``/metrics``, summed)
    each came within :data:`SETTLED_READ_S` and found no request in their engines."""
    deadline, quiet = clock() + within_s, 0
    while True:
        began = clock()
        now = read()
        quiet = quiet + 1 if now is not None and now.in_flight == 0 and clock() - began <= SETTLED_READ_S else 0
        if quiet >= 2:
            return True
        if clock() >= deadline:
            return False
        sleep(every_s)


@dataclass
class MissWatch:
    """Watches one step from vLLM's ``/metrics`` (``read`` gives the sum of the replicas' pages, None when one could
    not be read): called every :data:`EVERY_S` while the client runs, it returns why the step has certainly missed
    its TTFT objective, or None. It keeps when it first saw the step's requests answered."""

    read: Callable[[], Reading | None]
    before: Reading
    ttft_objective_s: float
    offered: int
    clock: Callable[[], float] = time.time
    first_seen: float | None = None
    last: Reading | None = None
    queued: list[tuple[float, float, float]] = field(default_factory=list)
    """Per reading: when, the requests waiting less the step's preemptions so far, and the step's first tokens."""

    def __call__(self) -> str | None:
        began = self.clock()  # the pages were read between these two: a wait is counted from the last to the first
        now = self.read()
        if now is None:
            return None
        at = self.clock()
        self.last = now
        arrived = now.buckets["ttft"].get(math.inf, 0.0) - self.before.buckets["ttft"].get(math.inf, 0.0)
        if arrived > 0 and self.first_seen is None:
            self.first_seen = at
        seen = above_between("ttft", self.ttft_objective_s, self.before.buckets, now.buckets)
        edge = bound_over(now.buckets["ttft"], self.ttft_objective_s)
        self.queued.append((at, now.waiting - (now.preemptions - self.before.preemptions), arrived))
        waiting = max([0.0, *(queued - (arrived - then_arrived) for when, queued, then_arrived in self.queued
                              if began - when >= edge)])
        late = seen + waiting
        if late <= (1 - QUANTILE) * self.offered:
            return None
        return (f"stopped early: {late:,.0f} of its {self.offered:,} requests had waited over"
                f" {self.ttft_objective_s:g} s for a first token ({seen:,.0f} answered late, {waiting:,.0f}"
                f" still waiting), more than {1 - QUANTILE:.0%}: its TTFT p99 missed whatever the rest did")


def stopped_step(rate: float, watch: MissWatch, reason: str, ended_at: float) -> Step:
    """The record of a step stopped at ``ended_at`` (Unix time) for ``reason``: what vLLM counted from the reading
    before the step to the watch's last (the one that decided), over the span from the first answer seen to the
    stop."""
    last = watch.last or watch.before
    started_at = watch.first_seen if watch.first_seen is not None else ended_at
    seconds = max(ended_at - started_at, 0.0)
    answered = int(last.answered - watch.before.answered)
    tokens = last.output_tokens - watch.before.output_tokens
    return Step(rate=rate, achieved_rps=answered / seconds if seconds > 0 else 0.0, ttft_p50_s=None, ttft_p99_s=None,
                itl_p50_s=None, itl_p99_s=None, e2e_p50_s=None, e2e_p99_s=None,
                output_tokens_per_s=tokens / seconds if seconds > 0 else 0.0, succeeded=answered, failed=0,
                seconds=seconds, offered=watch.offered, started_at=started_at, ended_at=ended_at,
                failure_reasons=[reason])
