"""The ramp: the request rates a bench steps through, what each step measured, and the ceiling they give.

A step is judged as the alerts and the canary judge a replica: on vLLM's own histograms over the step (p99 time to
first token per request, p99 inter-token latency per token; :mod:`gpufleet.measure.engine_histograms`), not on the
client's figures (its inter-token latency is each request's mean, another quantity). A step passes when no request
failed, the replicas answered at least :data:`ANSWERED_MIN` of the requests it offered within the step and its
grace, and both p99s are within the objective; the ramp stops at the first step that does not. The **ceiling** is
the answered rate (requests answered a second) of the highest offered rate whose step passed: what the replicas
sustained, not what was sent. The limit that stopped the ramp is named (``ttft``, ``itl``, ``errors``,
``unanswered``, or ``none`` when every rate passed). A step certain to miss its TTFT objective before its end is
stopped there (:mod:`gpufleet.measure.early_stop`). Without ``--rates`` the ramp doubles from :data:`FIRST_RATE`
and, once a step fails, tries rates between the highest that passed and the lowest that failed (halving the gap each
time) until that gap is within :data:`REFINE_GAP` of the former (at most :data:`REFINE_STEPS` of them), so that the
ceiling is known to within 5% rather than a factor of two, and two ramps of the same replicas agree as closely as
the replicas do.

A step must be long enough for a queue to show: offered a fraction *f* above what the replicas sustain, the queue
grows by *f* x the rate each second, so the last requests of a step of *T* seconds wait about *f* x *T* seconds
before their first token. :data:`STEP_PER_TTFT` objectives per step let an overload of a tenth reach the TTFT
objective within the step.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from gpufleet.values.grammar import decimal

FIRST_RATE = 0.5
"""Requests per second of the first step of a ramp without ``--rates``."""

MAX_DOUBLINGS = 12
"""Steps of a ramp without ``--rates`` before it gives up finding a limit (0.5 to 1024 requests/s)."""

RAMP_TOP_RPS = FIRST_RATE * 2 ** (MAX_DOUBLINGS - 1)
"""The highest rate a ramp without ``--rates`` may offer."""

REFINE_STEPS = 5
"""Most rates tried between the highest passing and the lowest failing step of a doubling ramp."""

REFINE_GAP = 0.05
"""A doubling ramp's refinement stops once the lowest failing rate is within this share of the ceiling (a gap of a
quarter of the last doubling, what two halvings leave, let two runs of one replica differ by a third)."""

ANSWERED_MIN = 0.95
"""The share of a step's offered requests the replicas must answer within the step and its grace for it to pass."""

STEP_PER_TTFT = 10.0
"""The shortest step, in TTFT objectives (see the module's docstring): 10 x a 2 s objective is 20 s."""

SLO_MAX_S = {"ttft_p99_s": 360.0, "itl_p99_s": 60.0}
"""The largest objectives (vllm_slo_ttft_p99_s and vllm_slo_itl_p99_s's bounds): 10 TTFT objectives of 360 s are
the longest step, an hour."""

MAX_RATE = 100_000.0
"""The highest rate a step may offer (requests a second): a step holds rate x step requests."""

LIMITS = ("ttft", "itl", "errors", "unanswered")
"""What can stop a ramp, in the order a failing step names them."""


class RampError(ValueError):
    """A rate list or objective that cannot be used (its message is the one-line refusal, without a prefix)."""


@dataclass(frozen=True)
class Slo:
    """A model's objective: p99 time to first token and p99 inter-token latency, in seconds."""

    ttft_p99_s: float
    itl_p99_s: float


@dataclass(frozen=True)
class Step:
    """What one step of the ramp measured: the rate offered (requests a second the client sent at) and answered
    (requests answered a second over the step's duration, its tail included), the client's latency percentiles in
    seconds (TTFT per request; ITL as each request's mean time between tokens), output tokens a second, requests
    that succeeded, that failed (errored) and that were offered (rate x step: those never answered within the step's
    time bound are the difference), and the replicas' KV cache usage (highest, 0 to 1), preemptions, requests
    running at once (the busiest replica's highest count) and TTFT and
    ITL by vLLM's own histograms over the step (None where the metrics could not be read: then the step misses),
    the first reasons requests failed, and when the step began and ended (Unix time)."""

    rate: float
    achieved_rps: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    e2e_p50_s: float | None
    e2e_p99_s: float | None
    output_tokens_per_s: float
    succeeded: int
    failed: int
    seconds: float
    offered: int = 0
    ttft_p95_s: float | None = None  # the client's: what --canary-bench's canary is compared with
    itl_p95_s: float | None = None
    started_at: float = 0.0  # Unix time of the step's first request and of its end
    ended_at: float = 0.0
    kv_usage_max: float | None = None
    preemptions: float | None = None
    running_max: float | None = None  # vLLM's requests running at once on the busiest replica (its ranks summed)
    engine_ttft_p99_s: float | None = None  # vLLM's: what the step is judged on (the alerts' quantities)
    engine_itl_p99_s: float | None = None
    engine_ttft_p95_s: float | None = None  # vLLM's: what a canary's watch is compared with
    engine_itl_p95_s: float | None = None
    engine_ttft_mean_s: float | None = None  # vLLM's means (exact, where a p95 is estimated within a bucket)
    engine_itl_mean_s: float | None = None
    unparsed: int = 0  # answers the client could not read (gpufleet.measure.guidellm_client.UNPARSED): not failed
    failure_reasons: list[str] = field(default_factory=list)  # the first distinct ones, no secret in them

    @property
    def answered(self) -> int:
        """Requests the replicas answered within the step's bound (the client read them or not)."""
        return self.succeeded + self.unparsed

    def missed(self, slo: Slo) -> list[str]:
        """The limits this step missed (of :data:`LIMITS`); none: it passed."""
        found = []
        if self.engine_ttft_p99_s is None or self.engine_ttft_p99_s > slo.ttft_p99_s:
            found.append("ttft")
        if self.engine_itl_p99_s is None or self.engine_itl_p99_s > slo.itl_p99_s:
            found.append("itl")
        if self.failed or not self.succeeded:
            found.append("errors")
        if self.answered < ANSWERED_MIN * self.offered:
            found.append("unanswered")
        return found

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Step:
        return cls(**doc)


@dataclass(frozen=True)
class Ceiling:
    """What the replicas sustained: the answered rate of the highest offered rate that met the objective and that
    offered rate (None: not even the first), and what stopped the ramp: the first failing step's missed limits
    joined with ``+`` (``none``: no step failed)."""

    rate: float | None
    offered: float | None
    stopped_by: str


def ceiling_steps(steps: list[Step], slo: Slo) -> tuple[Step | None, Step | None]:
    """The highest passing step below the lowest failing one, and that failing one (None where there is none)."""
    failing = [step for step in steps if step.missed(slo)]
    lowest_fail = min(failing, key=lambda s: s.rate) if failing else None
    below = [s for s in steps if not s.missed(slo) and (lowest_fail is None or s.rate < lowest_fail.rate)]
    return (max(below, key=lambda s: s.rate) if below else None), lowest_fail


def ceiling(steps: list[Step], slo: Slo) -> Ceiling:
    """The ceiling of ``steps`` (in the order they ran): the highest passing step below the lowest failing one."""
    best, lowest_fail = ceiling_steps(steps, slo)
    return Ceiling(best.achieved_rps if best is not None else None, best.rate if best is not None else None,
                   "+".join(lowest_fail.missed(slo)) if lowest_fail is not None else "none")


def parse_slo(text: str, default: Slo) -> Slo:
    """``ttft_p99_s=..,itl_p99_s=..`` (either or both) over ``default``; RampError unless each is a positive
    number."""
    values = {"ttft_p99_s": default.ttft_p99_s, "itl_p99_s": default.itl_p99_s}
    given: set[str] = set()
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in values:
            raise RampError(f"expected ttft_p99_s=SECONDS and/or itl_p99_s=SECONDS, found {part.strip()!r}")
        if key in given:
            raise RampError(f"{key}: expected it once, found it twice")
        given.add(key)
        number = decimal(value.strip())
        if number is None or not 0 < number <= SLO_MAX_S[key]:
            raise RampError(f"{key}: expected a number of seconds above 0, at most {SLO_MAX_S[key]:g},"
                            f" found {value.strip()!r}")
        values[key] = number
    return Slo(**values)


def parse_rates(text: str) -> list[float]:
    """Comma-separated requests per second, each above 0, each above the one before; RampError otherwise."""
    rates: list[float] = []
    for part in text.split(","):
        rate = decimal(part.strip())
        if rate is None or not 0 < rate <= MAX_RATE:
            raise RampError(f"expected requests per second above 0, at most {MAX_RATE:g}, found {part.strip()!r}")
        if rates and rate <= rates[-1]:
            raise RampError(f"expected rates that increase, found {rate:g} after {rates[-1]:g}")
        rates.append(rate)
    return rates


def step_problem(step_s: float, slo: Slo) -> str | None:
    """Why a step of ``step_s`` seconds cannot judge ``slo`` (shorter than :data:`STEP_PER_TTFT` TTFT objectives: a
    growing queue would not reach the objective within it), or None."""
    if not math.isfinite(step_s):
        return f"expected a number of seconds, found {step_s!r}"
    shortest = STEP_PER_TTFT * slo.ttft_p99_s
    if step_s < shortest:
        return (f"expected at least {shortest:g} seconds for a TTFT objective of {slo.ttft_p99_s:g} s"
                f" ({STEP_PER_TTFT:g} objectives: a queue must be able to show within a step), found {step_s:g}")
    return None


def next_rate(done: list[Step], slo: Slo, given: list[float] | None) -> float | None:
    """The rate of the next step after ``done``, or None when the ramp is over: with ``given`` rates, the next one
    until a step fails; else doubling from :data:`FIRST_RATE` until one fails, then rates halving the gap between
    the highest that passed and the lowest that failed until it is within :data:`REFINE_GAP` of the former (at most
    :data:`REFINE_STEPS`)."""
    failed = [s for s in done if s.missed(slo)]
    if given is not None:
        return None if failed or len(done) >= len(given) else given[len(done)]
    if not done:
        return FIRST_RATE
    if not failed:
        return None if len(done) >= MAX_DOUBLINGS else done[-1].rate * 2
    refined = len(done) - (done.index(failed[0]) + 1)
    if refined >= REFINE_STEPS:
        return None
    top = ceiling(done, slo).offered
    low = min(s.rate for s in failed)
    if top is None or low - top <= REFINE_GAP * top:
        return None
    return round((top + low) / 2, 6)
