"""Waiting for a condition in tests that run real processes: polled, bounded, and failing with what was awaited."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest


def until(condition: Callable[[], bool], what: str, timeout_s: float = 10, every: float = 0.05) -> float:
    """Poll ``condition`` every ``every`` seconds until it holds; the seconds it took. Fails the test naming
    ``what`` after ``timeout_s``."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout_s:
            pytest.fail(f"not within {timeout_s} s: {what}")
        time.sleep(every)
    return time.monotonic() - started
