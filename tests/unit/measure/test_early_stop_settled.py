"""A replica settles when two reads in a row of its ``/metrics`` come promptly and find its engines empty
(gpufleet/measure/early_stop.settled): the next step, or the next run, must not inherit a stopped load."""

from __future__ import annotations

from gpufleet.measure.early_stop import SETTLED_READ_S, settled
from gpufleet.measure.engine_histograms import Reading


class Replica:
    """Reads of a replica's ``/metrics`` on a fake clock: each (requests in its engines, seconds the read took)."""

    def __init__(self, reads: list[tuple[float, float]]) -> None:
        self.reads, self.now, self.count = reads, 0.0, 0

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def read(self) -> Reading | None:
        in_flight, took = self.reads[min(self.count, len(self.reads) - 1)]
        self.count += 1
        self.now += took
        return Reading({}, {}, in_flight=in_flight)


def _settled(reads: list[tuple[float, float]], within_s: float = 30.0) -> tuple[bool, int]:
    replica = Replica(reads)
    return settled(replica.read, within_s, 0.5, replica.clock, replica.sleep), replica.count


def test_two_prompt_empty_reads_in_a_row_settle() -> None:
    assert _settled([(0, 0.01), (0, 0.01)]) == (True, 2)


def test_engines_that_are_empty_behind_a_late_api_are_not_settled_until_it_answers_promptly() -> None:
    late = SETTLED_READ_S * 4  # the API server still busy with the stopped load
    assert _settled([(0, late), (0, late), (0, late), (0, 0.01), (0, 0.01)]) == (True, 5)


def test_a_request_in_the_engines_starts_the_count_again() -> None:
    assert _settled([(0, 0.01), (3, 0.01), (0, 0.01), (0, 0.01)]) == (True, 4)


def test_replicas_that_never_settle_are_said_so_at_the_bound() -> None:
    found, reads = _settled([(5, 0.01)], within_s=10.0)
    assert not found and 15 <= reads <= 25
