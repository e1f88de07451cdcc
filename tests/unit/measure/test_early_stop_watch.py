"""A step is stopped once it has certainly missed its TTFT objective (gpufleet/measure/early_stop.MissWatch): by the
first tokens vLLM counted above the objective's bucket, and by the requests in the engines' waiting queue that have
had none for longer than that bucket's bound. Each case is a replica's readings on a fake clock: (seconds since the
step began, seconds the read took, first tokens so far, of them above 2.5 s, requests waiting, preemptions)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from gpufleet.measure.early_stop import MissWatch
from gpufleet.measure.engine_histograms import Reading

OBJECTIVE_S = 2.0  # its bucket's bound: 2.5 s (vLLM's TTFT buckets ... 1.0, 2.5, 5.0 ...)
OFFERED = 1000  # more than 10 late decide (1%)


def _reading(first_tokens: float, late: float, waiting: float, preemptions: float) -> Reading:
    ttft = {1.0: first_tokens - late, 2.5: first_tokens - late, 5.0: first_tokens, math.inf: first_tokens}
    return Reading({"ttft": ttft, "itl": {}}, {"ttft": 0.0, "itl": 0.0}, waiting=waiting, preemptions=preemptions)


@dataclass
class Replica:
    """Readings on a fake clock: each read starts at its time and takes its own seconds."""

    readings: list[tuple[float, float, float, float, float, float]]
    now: float = 0.0
    count: int = 0

    def clock(self) -> float:
        return self.now

    def read(self) -> Reading:
        at, took, first_tokens, late, waiting, preemptions = self.readings[self.count]
        self.count += 1
        self.now = at + took
        return _reading(first_tokens, late, waiting, preemptions)

    def watch(self) -> tuple[int, str] | None:
        """The reading that decided the step (1-based) and why, or None when none did."""
        watch = MissWatch(self.read, _reading(0, 0, 0, 0), OBJECTIVE_S, OFFERED, clock=self.clock)
        for index, (at, *_) in enumerate(self.readings, 1):
            self.now = at
            if (reason := watch()) is not None:
                return index, reason
        return None


CASES = {
    # 40 waiting at 2 s (the read ended at 2.1 s); 20 first tokens by 4.7 s, over the 2.5 s bound later: 20 still wait
    "a queue that outlasts the objective's bucket decides before any late first token": (
        [(0, 0.1, 0, 0, 0, 0), (2, 0.1, 50, 0, 40, 0), (4.7, 0.1, 70, 0, 45, 0)],
        (3, "20 of its 1,000 requests had waited over 2 s for a first token (0 answered late, 20 still waiting)")),
    "a queue whose requests all had a first token within the bound decides nothing": (
        [(0, 0.1, 0, 0, 0, 0), (2, 0.1, 50, 0, 40, 0), (4.7, 0.1, 95, 0, 30, 0), (7.4, 0.1, 140, 0, 20, 0)],
        None),
    "requests preempted after their first token wait again, and are not counted": (
        [(0, 0.1, 0, 0, 0, 0), (2, 0.1, 50, 0, 40, 25), (4.7, 0.1, 70, 0, 45, 25)],
        None),
    # the same queue read 2.4 s apart from the end of one read to the start of the next: not yet past the bound
    "a wait counts from the end of one read to the start of the next": (
        [(0, 0.1, 0, 0, 0, 0), (2, 0.5, 50, 0, 40, 0), (4.9, 0.1, 70, 0, 45, 0)],
        None),
    "late first tokens and a queue past the bound add up": (
        [(0, 0.1, 0, 0, 0, 0), (2, 0.1, 50, 0, 10, 0), (4.7, 0.1, 55, 6, 20, 0)],
        (3, "11 of its 1,000 requests had waited over 2 s for a first token (6 answered late, 5 still waiting)")),
    "late first tokens alone decide as they did": (
        [(0, 0.1, 0, 0, 0, 0), (2, 0.1, 50, 11, 0, 0)],
        (2, "11 of its 1,000 requests had waited over 2 s for a first token (11 answered late, 0 still waiting)")),
}


@pytest.mark.parametrize("case", CASES)
def test_the_watch(case: str) -> None:
    readings, expected = CASES[case]
    decided = Replica(readings).watch()
    if expected is None:
        assert decided is None
    else:
        assert decided is not None and decided[0] == expected[0], decided
        assert expected[1] in decided[1] and "its TTFT p99 missed whatever the rest did" in decided[1], decided
