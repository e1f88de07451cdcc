"""The deploy's reading of the monitoring hosts' copies of the nodes' records (gpufleet/run/context.py): the longer
history of each node over every monitoring host that answers; none without a monitoring group. Restoring a record a
node lost: tests/data/operations/lifecycle.admission/; the copies written by a deploy: tests/lab/test_lifecycle.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from gpufleet.facts.lifecycle import FleetNodeRecords
from gpufleet.run import context


def _record(host: str, moves: int) -> dict[str, Any]:
    return {"schema": "gpufleet.node-state/1", "host": host, "state": "retired" if moves > 2 else "serving",
            "history": [{"at": f"2026-11-2{i}T10:00:00Z"} for i in range(moves)]}


class _Monitor:
    def __init__(self, copies: dict[str, Any] | None) -> None:
        self.copies = copies

    def get_fact(self, fact: type) -> dict[str, Any]:
        assert fact is FleetNodeRecords
        if self.copies is None:
            raise OSError("no route to host")
        return self.copies


class _Inventory:
    def __init__(self, monitors: list[_Monitor] | None) -> None:
        self.monitors = monitors

    def get_group(self, name: str) -> list[_Monitor]:
        assert name == "monitoring"
        if self.monitors is None:
            raise KeyError(name)
        return self.monitors


def test_the_longer_history_of_each_node_over_the_monitoring_hosts_that_answer() -> None:
    a_long, a_short, b = _record("gpu-a01", 3), _record("gpu-a01", 1), _record("gpu-a02", 2)
    monitors = [_Monitor({"gpu-a01": a_short}), _Monitor(None), _Monitor({"gpu-a01": a_long, "gpu-a02": b})]
    for i, monitor in enumerate(monitors):
        monitor.name = f"monitor{i}"  # type: ignore[attr-defined]
    st = SimpleNamespace(inventory=_Inventory(monitors))
    copies = context._fleet_copies(st)  # type: ignore[arg-type]
    assert copies == {"monitor0": {"gpu-a01": a_short}, "monitor2": {"gpu-a01": a_long, "gpu-a02": b}}
    assert [context.newest_copy(copies, h) for h in ("gpu-a01", "gpu-a02", "gpu-a03")] == [a_long, b, None]
    assert context._fleet_copies(SimpleNamespace(inventory=_Inventory(None))) == {}  # type: ignore[arg-type]
