"""The monitoring role's files for a planned fleet: tests/data/monitoring/fleet (every kind of target, a monitoring
host), or a shape's inventory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import roles.monitoring as role
from gpufleet.cli.inputs import fleet_facts
from gpufleet.config.fleet import Fleet
from gpufleet.inventory.load import load_fleet, loaded_inventory
from gpufleet.plan.planner import plan_fleet
from tests.conftest import ROOT
from tests.unit.configs import host_config

FLEET = ROOT / "tests" / "data" / "monitoring" / "fleet"
MONITORING_HOST = "mon-1.example.net"


def group_hosts(fleet: Fleet, group: str) -> list[str]:
    """The hosts an inventory group lists, as the inventory file defined it."""
    return [h for h in fleet.hosts if any(name == group and h in members
                                          for name, members in loaded_inventory(h).groups)]  # type: ignore[union-attr]


def planned_view(inventory: Path, override: dict[str, Any] | None = None) -> tuple[Fleet, role.FleetView]:
    """A fleet planned offline from its declared profiles, as the monitoring hosts see it."""
    fleet = load_fleet(str(inventory), override)
    facts = fleet_facts(fleet, None)
    plan = plan_fleet(fleet, {h: f for h, f in facts.items() if fleet.serves(h)})
    assert plan.problems == []
    return fleet, role.fleet_view(fleet, plan, facts, group_hosts(fleet, "routers"))


def monitoring_host_files(inventory: Path = FLEET / "inventory.py",
                          **values: Any) -> tuple[role.FleetView, role.MonitoringFiles]:
    """The fleet's view and the monitoring files of its monitoring host, that host's config updated with ``values``
    (a fleet without one: :func:`host_config` with ``values``)."""
    fleet, view = planned_view(inventory)
    cfg = (fleet.configs[MONITORING_HOST].model_copy(update=values) if MONITORING_HOST in fleet.configs
           else host_config(**values))
    return view, role.monitoring_files(cfg, cfg.fleet_address or "10.40.9.1", view, ["10.40.9.1"])
