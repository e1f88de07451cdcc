"""A throwaway project's fleet planned: by the ``gpufleet plan`` command, or in this process."""

from __future__ import annotations

import json
from typing import Any

from gpufleet.gpu.profiles import profile_facts
from gpufleet.inventory.load import load_fleet
from gpufleet.plan.planner import FleetPlan, plan_fleet
from tests.conftest import Project, run_cli


def cli_plan(project: Project, all_yml: str, inventory: str, *extra: str) -> tuple[int, list[dict[str, Any]], str]:
    """``gpufleet plan --json`` (with ``extra``) of ``project``, ``all_yml`` its group_vars/all.yml and ``inventory``
    its inventory: the exit status, the planned replicas and stderr."""
    project.group_vars("all", all_yml)
    project.inventory(inventory)
    result = run_cli("plan", "inventories/fleet.py", "--json", *extra, cwd=project.root)
    replicas = json.loads(result.out) if result.rc == 0 else []
    return result.rc, replicas, result.err


def fleet_plan(project: Project, all_yml: str, inventory: str) -> FleetPlan:
    """The plan of ``project`` (``all_yml`` its group_vars/all.yml, ``inventory`` its inventory) in this process,
    every host an 8xH100-SXM as its profile declares."""
    project.group_vars("all", all_yml)
    fleet = load_fleet(str(project.inventory(inventory)))
    return plan_fleet(fleet, {h: profile_facts("8xH100-SXM", h) for h in fleet.hosts})
