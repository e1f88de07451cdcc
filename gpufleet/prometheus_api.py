"""One instant query to a Prometheus's HTTP API, from the controller (``gpufleet bench`` reads vLLM's KV cache and
preemptions there, a rollout's canary watch its latency percentiles)."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request

SCRAPE_WAIT_S = 16.0
"""How long after a moment its samples are in Prometheus (prometheus_scrape_interval_s is at most 15 s)."""


class PrometheusError(RuntimeError):
    """Prometheus could not be asked, or refused the query (message: one line)."""


def query_value(base_url: str, expr: str, at: float | None = None) -> float | None:
    """The single value ``expr`` gives at Unix time ``at`` (now: None); None when it gives no series."""
    params = {"query": expr, **({"time": f"{at:.3f}"} if at is not None else {})}
    url = f"{base_url}/api/v1/query?" + urllib.parse.urlencode(params)
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            doc = json.loads(response.read().decode())
    except (OSError, urllib.error.URLError, ValueError) as exc:
        raise PrometheusError(f"Prometheus at {base_url} did not answer ({type(exc).__name__}: {exc})") from None
    result = doc.get("data", {}).get("result") if doc.get("status") == "success" else None
    if not isinstance(result, list):
        raise PrometheusError(f"Prometheus at {base_url} refused the query: {doc.get('error', 'no error given')}")
    if not result:
        return None
    value = float(result[0]["value"][1])
    return None if value != value else value  # NaN (a quantile of no observation): no figure
