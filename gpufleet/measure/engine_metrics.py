"""vLLM's own view of each step, from the fleet's Prometheus: the replicas' highest KV cache usage, their
preemptions and the most requests one replica ran at once over the step's window (``vllm:kv_cache_usage_perc``,
``vllm:num_preemptions_total``, ``vllm:num_requests_running`` summed over a replica's ranks).

Read over Prometheus's HTTP API from the controller, once the ramp is over and every benched target has been scraped
after it (at most :data:`gpufleet.prometheus_api.SCRAPE_WAIT_S`): the controller must be let in
(``prometheus_allowed_from``).
Where it is not, the steps keep None and the bench says why in one line.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import replace

from gpufleet.measure.ramp import Step
from gpufleet.prometheus_api import SCRAPE_WAIT_S, query_value


def _selector(model: str, replica: str | None) -> str:
    labels = f'job="vllm", model={json.dumps(model)}'
    return labels + (f", replica={json.dumps(replica)}" if replica is not None else "")


def queries(model: str, replica: str | None, window_s: int) -> dict[str, str]:
    """The PromQL queries of a step ``window_s`` long, evaluated at its end, by the Step field each fills."""
    labels = _selector(model, replica)
    return {"kv_usage_max": f"max(max_over_time(vllm:kv_cache_usage_perc{{{labels}}}[{window_s}s]))",
            "preemptions": f"sum(increase(vllm:num_preemptions_total{{{labels}}}[{window_s}s]))",
            "running_max": f"max(max_over_time((sum by (replica) (vllm:num_requests_running{{{labels}}}))"
                           f"[{window_s}s:]))"}


def scraped_query(model: str, replica: str | None) -> str:
    """PromQL of the oldest last scrape (Unix time) of the benched vLLM targets."""
    return f"min(timestamp(up{{{_selector(model, replica)}}}))"


POLL_S = 1.0
"""Seconds between two questions to Prometheus while waiting for the last step's scrape."""


def with_engine_metrics(steps: list[Step], base_url: str, model: str, replica: str | None,
                        clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep,
                        ) -> list[Step]:
    """``steps`` with their KV cache usage, preemptions and requests running at once from Prometheus (each step's
    window is its own, up to :data:`SCRAPE_WAIT_S` past its end). The last step is read once every benched target was
    scraped after it ended (each keeps its own offset in the scrape interval: about half an interval for one target,
    rather than a whole one), at that scrape, and at most :data:`SCRAPE_WAIT_S` after its end."""
    if not steps:
        return steps
    last_end = max(s.ended_at for s in steps)
    scraped = None
    while (scraped := query_value(base_url, scraped_query(model, replica))) is None or scraped < last_end:
        if clock() >= last_end + SCRAPE_WAIT_S:
            scraped = None
            break
        sleep(POLL_S)
    if scraped is None and (wait := last_end + SCRAPE_WAIT_S - clock()) > 0:
        sleep(wait)
    found = []
    for step in steps:
        at = scraped if scraped is not None and step.ended_at == last_end else step.ended_at + SCRAPE_WAIT_S
        window = max(1, math.ceil(at - step.started_at))
        asked = queries(model, replica, window)
        read = {field: query_value(base_url, query, at) for field, query in asked.items()}
        found.append(replace(step, kv_usage_max=read["kv_usage_max"], preemptions=read["preemptions"],
                             running_max=read["running_max"]))
    return found
