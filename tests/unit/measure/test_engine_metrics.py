"""The bench's read of vLLM's KV cache usage and preemptions from Prometheus (gpufleet/measure/engine_metrics.py): when
it asks, and at what time and over what window each step is read, with Prometheus's API replaced by its answers."""

from __future__ import annotations

import pytest

from gpufleet.measure import engine_metrics
from gpufleet.measure.ramp import Step
from gpufleet.prometheus_api import SCRAPE_WAIT_S


def _step(started: float, ended: float) -> Step:
    return Step(rate=1.0, achieved_rps=1.0, ttft_p50_s=None, ttft_p99_s=None, itl_p50_s=None, itl_p99_s=None,
                e2e_p50_s=None, e2e_p99_s=None, output_tokens_per_s=1.0, succeeded=1, failed=0, seconds=1.0,
                offered=1, started_at=started, ended_at=ended)


class _Prometheus:
    """Answers the oldest last scrape of the targets from ``scrapes`` (one per question; the last one stays), and
    each step's query with the time it was evaluated at; keeps the questions."""

    def __init__(self, scrapes: list[float | None]) -> None:
        self.scrapes, self.asked = scrapes, []
        self.now = 1000.0

    def query_value(self, base_url: str, expr: str, at: float | None = None) -> float | None:
        self.asked.append((expr, at))
        if expr.startswith("min(timestamp(up{"):
            return self.scrapes.pop(0) if len(self.scrapes) > 1 else self.scrapes[0]
        return at

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.mark.parametrize(("scrapes", "waited", "last_at"), [
    ([990.0, 995.0, 1003.0], 2.0, 1003.0),  # scraped 3 s after the end: read at that scrape, 2 polls in
    ([1001.0], 0.0, 1001.0),  # already scraped after the end: no wait
    ([None, 990.0], SCRAPE_WAIT_S, 1000.0 + SCRAPE_WAIT_S),  # never scraped after it: the whole wait, as before
])
def test_the_last_step_is_read_at_the_first_scrape_of_every_target_after_it(
        scrapes: list[float | None], waited: float, last_at: float, monkeypatch: pytest.MonkeyPatch) -> None:
    prometheus = _Prometheus(scrapes)
    monkeypatch.setattr(engine_metrics, "query_value", prometheus.query_value)
    steps = [_step(900.0, 960.0), _step(970.0, 1000.0)]
    found = engine_metrics.with_engine_metrics(steps, "http://p", "m", "r-0", clock=lambda: prometheus.now,
                                               sleep=prometheus.sleep)
    assert prometheus.now - 1000.0 == pytest.approx(waited)
    assert [s.kv_usage_max for s in found] == [960.0 + SCRAPE_WAIT_S, last_at]  # the time each was read at
    assert [(s.preemptions, s.running_max) for s in found] == [(s.kv_usage_max, s.kv_usage_max) for s in found]
    windows = [expr for expr, _ in prometheus.asked if expr.startswith("max(max_over_time(vllm:kv_cache")]
    assert windows[0].endswith(f"[{76}s]))") and windows[1].endswith(f"[{int(last_at - 970.0)}s]))"), windows
    assert all('replica="r-0"' in expr for expr, _ in prometheus.asked)
