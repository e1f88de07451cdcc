"""The options of ``gpufleet upgrade`` and ``gpufleet rollback``, checked before anything is read from a host.

Numbers are finite and in range (``nan`` compares false with every bound, so a range check alone lets it
through), ``--canary-max-s`` is at least ``--canary-s``, no option of a canary watch comes with ``--canary-s 0``
(which rolls without one: nothing is judged, so ``--canary-max-s``, ``--canary-bench`` and the like would be
ignored), batches and limits parse (:mod:`gpufleet.rollout.batches`), and ``--report`` names a file in a directory
that exists. Each problem is one line; the command exits 2 on any of them without connecting to a host.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gpufleet.input_files import output_file_problem
from gpufleet.rollout.batches import Limit, RolloutError, parse_batches, parse_limit
from gpufleet.rollout.latency import DEFAULT_MIN_REQUESTS, MAX_WATCH_S
from gpufleet.values.grammar import decimal

CANARY_S = (0.0, MAX_WATCH_S)
MAX_ERROR_RATIO = (0.0, 1.0)
MAX_LATENCY_RATIO = (1.0, 1000.0)
MIN_REQUESTS = (1, 1_000_000)
_NOT_FINITE = {"nan", "inf", "-inf", "+inf", "infinity", "-infinity", "+infinity"}


@dataclass(frozen=True)
class Checked:
    """The options as numbers, once every one has passed."""

    canary_s: float
    max_error_ratio: float
    max_latency_ratio: float
    max_unavailable: Limit
    min_available: Limit
    min_requests: int = DEFAULT_MIN_REQUESTS
    canary_max_s: float | None = None  # None: not given


def _number(option: str, text: str, bounds: tuple[float, float], problems: list[str]) -> float:
    low, high = bounds
    value = decimal(text)
    if value is None or not low <= value <= high:
        shown = text if value is not None or text.strip().lower() in _NOT_FINITE else repr(text)
        problems.append(f"{option}: expected a number from {low:g} to {high:g}, found {shown}")
        return math.nan
    return value


def _limit(option: str, text: str, problems: list[str]) -> Limit:
    value: Limit = int(text) if text.isascii() and text.isdigit() and len(text) <= 9 else text
    try:
        count, _ = parse_limit(value)
    except ValueError:
        problems.append(f"{option}: expected a count >= 0 or a percentage from 0% to 100%, found {text!r}")
        return value
    if option == "--max-unavailable" and count == 0:
        problems.append(f"{option}: expected at least 1 (0 never takes a replica out), found {text!r}")
    return value


def _report(path: Path | None, problems: list[str]) -> None:
    if path is not None and (problem := output_file_problem(path)):
        problems.append(f"--report: {problem}")


def _count(option: str, text: str, bounds: tuple[int, int], problems: list[str]) -> int:
    low, high = bounds
    if not (text.isascii() and text.isdigit() and len(text) <= 9 and low <= int(text) <= high):
        problems.append(f"{option}: expected a whole number from {low:,} to {high:,}, found {text!r}")
        return low
    return int(text)


def _canary_max(text: str | None, canary_s: float, problems: list[str]) -> float | None:
    """``--canary-max-s``: from ``--canary-s`` to the longest watch; None when not given (the rollout watches up to
    :data:`~gpufleet.rollout.latency.MAX_WATCH_FACTOR` times each watch, at most
    :data:`~gpufleet.rollout.latency.MAX_WATCH_S`)."""
    if text is None:
        return None
    before = len(problems)
    value = _number("--canary-max-s", text, CANARY_S, problems)
    if len(problems) == before and CANARY_S[0] <= canary_s <= CANARY_S[1] and value < canary_s:
        problems.append(f"--canary-max-s: expected at least --canary-s ({canary_s:g}), found {text}")
    return value


def check_options(batches: str, max_unavailable: str, min_available: str, canary_s: str, max_error_ratio: str,
                  max_latency_ratio: str, report: Path | None, min_requests: str = str(DEFAULT_MIN_REQUESTS),
                  canary_max_s: str | None = None, watch_options: Sequence[str] = ()) -> Checked:
    """Every option checked; raises :class:`RolloutError` with one line per problem. ``watch_options``: the other
    options of a canary watch the operator gave (``--canary-bench``, ``--canary-every-batch``,
    ``--canary-min-requests``), refused with ``--canary-s 0`` as ``--canary-max-s`` is."""
    problems: list[str] = []
    try:
        parse_batches(batches)
    except RolloutError as exc:
        problems += exc.problems
    unavailable = _limit("--max-unavailable", max_unavailable, problems)
    available = _limit("--min-available", min_available, problems)
    watch = _number("--canary-s", canary_s, CANARY_S, problems)
    checked = Checked(watch, _number("--max-error-ratio", max_error_ratio, MAX_ERROR_RATIO, problems),
                      _number("--max-latency-ratio", max_latency_ratio, MAX_LATENCY_RATIO, problems),
                      unavailable, available, _count("--canary-min-requests", min_requests, MIN_REQUESTS, problems),
                      _canary_max(canary_max_s, watch, problems))
    if watch == 0:
        given = [*watch_options, *(["--canary-max-s"] if canary_max_s is not None else [])]
        problems += [f"{option}: expected a canary watch (--canary-s above 0), found --canary-s 0 (no canary watch:"
                     " nothing is judged)" for option in given]
    _report(report, problems)
    if problems:
        raise RolloutError(problems)
    return checked
