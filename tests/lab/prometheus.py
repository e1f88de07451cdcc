"""The lab's Prometheus (inventories/lab/inventory.py: the monitoring group, lab1), read through its HTTP API from the
bridge."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar

from gpufleet_lab.state import NodeRecord

from gpufleet.monitoring import ceiling_rules
from gpufleet.monitoring.dashboards import Query
from tests.lab.harness import LAB_VARS

PORT = 9090  # prometheus_port's default
SCRAPE_INTERVAL_S: int = LAB_VARS["prometheus_scrape_interval_s"]  # how often the lab scrapes and evaluates
T = TypeVar("T")


def unix_time(text: str) -> float:
    """A time as Prometheus's API writes it (RFC 3339, UTC, ``Z``), in Unix seconds."""
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


class Prometheus:
    """The HTTP API of the Prometheus on ``node``."""

    def __init__(self, node: NodeRecord) -> None:
        self.base = f"http://{node.address}:{PORT}/api/v1"

    def _get(self, path: str, **params: str) -> Any:
        url = f"{self.base}/{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        with urllib.request.urlopen(url, timeout=30) as response:
            answer = json.loads(response.read().decode())
        assert answer["status"] == "success", answer
        return answer["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result: ``[{"metric": labels, "value": [time, text]}]`` (or ``values`` for a range
        selector)."""
        data = self._get("query", query=expr)
        assert data["resultType"] in ("vector", "matrix"), data
        return list(data["result"])

    def targets(self) -> list[dict[str, Any]]:
        """Every active target: ``labels`` (after relabelling), ``health``, ``lastError``, ``scrapeUrl``."""
        return list(self._get("targets", state="active")["activeTargets"])

    def alerts(self) -> list[dict[str, Any]]:
        """The alerts now pending or firing: ``labels``, ``state``, ``activeAt``."""
        return list(self._get("alerts")["alerts"])

    def rules_evaluated_since(self, moment: float) -> bool:
        """Whether every rule group has been evaluated at or after ``moment`` (wall clock)."""
        groups = self._get("rules")["groups"]
        return bool(groups) and all(unix_time(g["lastEvaluation"]) >= moment for g in groups)

    def alert_waits(self) -> dict[str, float]:
        """Each alerting rule's ``for`` in seconds, by alert name."""
        return {rule["name"]: float(rule["duration"]) for group in self._get("rules", type="alert")["groups"]
                for rule in group["rules"]}

    def firing(self) -> dict[str, list[dict[str, str]]]:
        """Labels of each firing alert, by alert name."""
        found: dict[str, list[dict[str, str]]] = {}
        for alert in self.alerts():
            if alert["state"] == "firing":
                found.setdefault(alert["labels"]["alertname"], []).append(alert["labels"])
        return found


def wait_for(what: str, probe: Callable[[], T | None], timeout: float, every: float = 3.0) -> tuple[T, float]:
    """Call ``probe`` until it returns something other than None (or ``timeout`` runs out: AssertionError naming
    ``what``); what it returned and the seconds it took."""
    start = time.monotonic()
    while True:
        found = probe()
        if found is not None:
            return found, time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what}: not within {timeout:.0f} s")
        time.sleep(every)


def needs_a_bench(query: Query) -> bool:
    """A query that reads a model's measured ceiling: data only once gpufleet bench ran (tests/lab/test_bench.py
    asks these after it)."""
    return ceiling_rules.RECORD in query.expr


def queries_without_data(prometheus: Prometheus, queries: list[Query], values: dict[str, str]) -> dict[str, str]:
    """The queries that return nothing, or NaN only, on the lab's Prometheus now: name -> the query as run. A
    query Prometheus cannot parse fails the test at once."""
    empty = {}
    for query in queries:
        expr = query.resolve(values)
        try:
            result = prometheus.query(expr)
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{query.name}: Prometheus refused {expr!r}: {exc.read().decode()[:300]}") from None
        numbers = [float((r.get("value") or r["values"][-1])[1]) for r in result]
        if not any(n == n for n in numbers):  # NaN != NaN
            empty[query.name] = expr
    return empty


# What a serving alert reads, over a window: where it went wrong (each series' lowest, or highest, value).
HEALTH_SERIES = {
    "node_exporter up (lowest)": 'min_over_time(up{{job="node"}}[{s}s])',
    "systemd collector succeeded (lowest)": 'min_over_time(node_scrape_collector_success{{collector="systemd"}}[{s}s])',
    "node scrape seconds (highest)": 'max_over_time(scrape_duration_seconds{{job="node"}}[{s}s])',
    "vLLM up (lowest)": 'min_over_time(up{{job="vllm"}}[{s}s])',
    "ranks up (lowest)": "min_over_time(replica:ranks_up:count[{s}s])",
    "ready replicas (lowest)": "min_over_time(model:replicas_ready:count[{s}s])",
    "vLLM units active (lowest)":
        'min_over_time(node_systemd_unit_state{{job="node", state="active", name=~"vllm@.+"}}[{s}s])',
}


def health_story(prometheus: Prometheus, seconds: int) -> dict[str, dict[str, str]]:
    """For an alert that went pending on a lab that should be healthy: what each series it reads did over the last
    ``seconds`` (by its instance, node or replica)."""
    story: dict[str, dict[str, str]] = {}
    for name, expr in HEALTH_SERIES.items():
        found = prometheus.query(expr.format(s=max(1, seconds)))
        story[name] = {",".join(str(r["metric"][k]) for k in ("instance", "name", "replica", "model")
                                if r["metric"].get(k)): r["value"][1] for r in found}
    return story


def router_rate(prometheus: Prometheus) -> float:
    """The model's requests a second through the routers, over the last minute (0 before any)."""
    found = prometheus.query("model:router_requests:rate1m")
    return float(found[0]["value"][1]) if found else 0.0
