"""A node's series over ``gpufleet diag``'s window, from the monitoring hosts' Prometheus: ``series/<host>.json`` in
the archive, beside the node's own members. The controller asks Prometheus's HTTP API (one range query a node, as
gpufleet bench and a rollout's canary watch ask it), the first monitoring host that answers.

What is kept: every series Prometheus has with the node's ``node`` label whose name is one of :data:`NAMES`
(scrape health, alerts, DCGM's GPU fields, vLLM's gauges and counters, gpufleet's own, the node's load, memory and
disks, HAProxy's and Ray's; the units' states are the node's own archive's), histogram buckets left out; at most
:data:`POINTS` points a series (a step of the window over that, :data:`MIN_STEP_S` at the least), and at most the
node's byte cap.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass

NAMES = ("up", "ALERTS", "DCGM_FI_.+", "vllm:.+", "gpufleet_.+", "node_load1", "node_memory_MemAvailable_bytes",
         "node_filesystem_avail_bytes", "haproxy_.+", "ray_.+")
POINTS = 240
MIN_STEP_S = 15
QUERY_S = 20.0

Fetch = Callable[[str, float, int], bytes]
"""GET a URL within a timeout, reading at most the given bytes (more: the body cut there)."""


@dataclass(frozen=True)
class Snapshot:
    """One node's series (the JSON of ``series/<host>.json``), or why there are none."""

    data: bytes | None
    problem: str | None = None


def selector(node: str) -> str:
    """The node's series of :data:`NAMES`, buckets left out (a PromQL string is a JSON string)."""
    names = "|".join(NAMES)
    return f'{{node={json.dumps(node)}, __name__=~"{names}", __name__!~".+_bucket"}}'


def step_s(since_s: int) -> int:
    """The step of a window of ``since_s``: at most :data:`POINTS` points, :data:`MIN_STEP_S` at the least."""
    return max(MIN_STEP_S, math.ceil(since_s / POINTS))


def _get(url: str, timeout_s: float, max_bytes: int) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return bytes(response.read(max_bytes))


def snapshots(prometheus: Sequence[str], nodes: Sequence[str], since_s: int, end: float, max_bytes: int,
              fetch: Fetch = _get) -> dict[str, Snapshot]:
    """Each of ``nodes``' series over the ``since_s`` before ``end`` (Unix time), from the first of ``prometheus``
    (base URLs) that answers, or why not; a Prometheus that did not answer is not asked again for the next node."""
    silent: dict[str, str] = {}  # base URL -> why it did not answer
    found = {}
    for node in nodes:
        found[node] = _snapshot(prometheus, node, since_s, end, max_bytes, fetch, silent)
    return found


def _snapshot(prometheus: Sequence[str], node: str, since_s: int, end: float, max_bytes: int, fetch: Fetch,
              silent: dict[str, str]) -> Snapshot:
    if not prometheus:
        return Snapshot(None, "no monitoring host: no Prometheus to read the node's series from")
    step = step_s(since_s)
    query = selector(node)
    params = urllib.parse.urlencode({"query": query, "start": f"{end - since_s:.3f}", "end": f"{end:.3f}",
                                     "step": str(step)})
    failed = []
    for base in prometheus:
        if base in silent:
            failed.append(silent[base])
            continue
        try:
            body = fetch(f"{base}/api/v1/query_range?{params}", QUERY_S, max_bytes + 1)
        except (OSError, urllib.error.URLError, ValueError) as exc:
            silent[base] = f"{base} did not answer ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})"
            failed.append(silent[base])
            continue
        if len(body) > max_bytes:
            return Snapshot(None, f"{base}: the node's series are more than the cap of {max_bytes:,} bytes")
        try:
            doc = json.loads(body)
            result = doc["data"]["result"] if doc.get("status") == "success" else None
        except (ValueError, KeyError, TypeError, AttributeError):
            result = None
        if not isinstance(result, list):
            failed.append(f"{base} refused the query")
            continue
        kept = {"prometheus": base, "query": query, "start": round(end - since_s, 3), "end": round(end, 3),
                "step_s": step, "series": result}
        return Snapshot((json.dumps(kept, separators=(",", ":")) + "\n").encode())
    return Snapshot(None, "; ".join(failed))
