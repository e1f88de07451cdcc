"""Alerts as the lab tests watch them on the monitoring group's Prometheus (lab1): an expected alert, its firing
timed by Prometheus's own timestamps, its resolution, and its line in the alert log."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

from gpufleet.node.alert_log import shown
from tests.lab.harness import LAB_VARS, Lab
from tests.lab.prometheus import SCRAPE_INTERVAL_S, Prometheus, unix_time, wait_for

RESOLVE_S = 240


@dataclass
class Expected:
    """An alert the fault must fire: its name, labels it must carry, and the rule's wait (its ``for``, or the
    window its expression needs) in seconds."""

    alert: str
    labels: dict[str, str]
    wait_s: int
    fired_s: float | None = field(default=None)

    def matches(self, labels: dict[str, str]) -> bool:
        return labels.get("alertname") == self.alert and all(labels.get(k) == v for k, v in self.labels.items())


def _fired_at(alert: dict[str, Any], waits: dict[str, float]) -> float:
    """When a firing alert fired (wall clock), as Prometheus timed it: the evaluation that found it true first
    (``activeAt``) plus its rule's ``for`` (the lab's are whole evaluation intervals)."""
    active = unix_time(alert["activeAt"])
    return active + waits[alert["labels"]["alertname"]]


def watch_fired(prometheus: Prometheus, expected: list[Expected], injected: float) -> None:
    """Wait until every expected alert fires, each within its wait plus two scrape intervals of ``injected`` (wall
    clock), as Prometheus's own timestamps say (not when this loop happened to look)."""
    limit = max(e.wait_s for e in expected) + 2 * SCRAPE_INTERVAL_S
    waits = prometheus.alert_waits()

    def all_fired() -> bool | None:
        firing = [a for a in prometheus.alerts() if a["state"] == "firing"]
        for e in expected:
            fired = [_fired_at(a, waits) for a in firing if e.matches(a["labels"])]
            if e.fired_s is None and fired:
                e.fired_s = min(fired) - injected
        return True if all(e.fired_s is not None for e in expected) else None

    with contextlib.suppress(AssertionError):  # judged below, alert by alert
        wait_for("the faults' alerts", all_fired, timeout=limit + 60, every=2)
    late = {e.alert: e.fired_s for e in expected if e.fired_s is None or e.fired_s > e.wait_s + 2 * SCRAPE_INTERVAL_S}
    assert not late, f"fired late or not at all (s): {late}; firing now: {prometheus.firing()}"


def wait_resolved(prometheus: Prometheus, expected: list[Expected], cleared: float) -> float:
    """Wait until none of the expected alerts is pending or firing; the seconds since ``cleared``."""
    def gone() -> bool | None:
        active = [a["labels"] for a in prometheus.alerts()]
        return True if not any(e.matches(labels) for e in expected for labels in active) else None

    wait_for(f"{[e.alert for e in expected]} resolved", gone, timeout=RESOLVE_S, every=2)
    return time.monotonic() - cleared


def logged(lab: Lab, expected: list[Expected], since: float) -> None:
    """Every expected alert has a FIRING line with its labels in the alert log of the monitoring host (lab1) since
    ``since`` (wall clock), within the lab's group wait and group interval and two evaluations. The fault holds
    until then: Alertmanager never sends an alert that resolved within its group's wait."""
    host = lab.host(lab.nodes[0])

    def missing() -> list[str]:
        lines = host.check_output(f"journalctl -u gpufleet-alert-log -o cat --no-pager --since @{int(since)}")
        firing = [line for line in lines.splitlines() if line.startswith("FIRING ")]
        return [e.alert for e in expected  # a value as the log writes it (the lab's model name is a JSON string)
                if not any(line.startswith(f"FIRING {e.alert} ")
                           and all(f" {k}={shown(v)} " in line for k, v in e.labels.items()) for line in firing)]

    limit = LAB_VARS["alertmanager_group_wait_s"] + LAB_VARS["alertmanager_group_interval_s"] + 2 * SCRAPE_INTERVAL_S
    with contextlib.suppress(AssertionError):  # judged below, naming what is missing
        wait_for("the fired alerts in the alert log", lambda: True if not missing() else None, timeout=limit, every=5)
    assert not missing(), f"not in the alert log after {limit} s: {missing()}"
