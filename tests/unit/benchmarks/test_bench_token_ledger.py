"""bench/token_ledger.py without a lab: its figures from given times, and its bounds on what it sends."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location("bench_token_ledger",
                                               Path(__file__).parents[3] / "bench" / "token_ledger.py")
assert _SPEC is not None and _SPEC.loader is not None
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)


def test_the_summary_takes_each_quantile_from_the_times_sorted() -> None:
    times = [0.5, *(0.01 * n for n in range(1, 100))]
    assert bench.summary(times) == {"p50_s": 0.5, "p90_s": 0.9, "p99_s": 0.99, "mean_s": 0.5}


@pytest.mark.parametrize("argv", [["--requests", "0"], ["--concurrency", "17"], ["--max-tokens", "257"]])
def test_load_beyond_its_bounds_is_refused_before_any_request(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        bench.main(argv)
    assert exited.value.code == 2
