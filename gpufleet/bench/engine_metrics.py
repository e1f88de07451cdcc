"""vLLM's own view of each step, from the fleet's Prometheus: the replicas' highest KV cache usage and their
preemptions over the step's window (``vllm:kv_cache_usage_perc``, ``vllm:num_preemptions_total``).

Read over Prometheus's HTTP API from the controller, once the ramp is over and one more scrape has come in
(:data:`gpufleet.prometheus_api.SCRAPE_WAIT_S`): the controller must be let in (``prometheus_allowed_from``).
Where it is not, the steps keep None and the bench says why in one line.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import replace

from gpufleet.bench.ramp import Step
from gpufleet.prometheus_api import SCRAPE_WAIT_S, query_value


def _selector(model: str, replica: str | None) -> str:
    labels = f'job="vllm", model={json.dumps(model)}'
    return labels + (f", replica={json.dumps(replica)}" if replica is not None else "")


def queries(model: str, replica: str | None, window_s: int) -> dict[str, str]:
    """The two PromQL queries of a step ``window_s`` long, evaluated at its end."""
    labels = _selector(model, replica)
    return {"kv_usage_max": f"max(max_over_time(vllm:kv_cache_usage_perc{{{labels}}}[{window_s}s]))",
            "preemptions": f"sum(increase(vllm:num_preemptions_total{{{labels}}}[{window_s}s]))"}


def with_engine_metrics(steps: list[Step], base_url: str, model: str, replica: str | None) -> list[Step]:
    """``steps`` with their KV cache usage and preemptions from Prometheus (each step's window is its own)."""
    if not steps:
        return steps
    wait = max(s.ended_at for s in steps) + SCRAPE_WAIT_S - time.time()
    if wait > 0:
        time.sleep(wait)
    found = []
    for step in steps:
        window = max(1, math.ceil(step.ended_at - step.started_at + SCRAPE_WAIT_S))
        asked = queries(model, replica, window)
        at = step.ended_at + SCRAPE_WAIT_S
        found.append(replace(step, kv_usage_max=query_value(base_url, asked["kv_usage_max"], at),
                             preemptions=query_value(base_url, asked["preemptions"], at)))
    return found
