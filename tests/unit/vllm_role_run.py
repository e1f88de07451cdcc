"""The vllm role run on one host of a planned shape (tests/data/plans/<shape>), every operation recorded instead of
run."""

from __future__ import annotations

import pytest

import roles.vllm as vllm_role
from gpufleet.cli.inputs import fleet_facts
from gpufleet.config.fleet import Fleet
from gpufleet.inventory.load import load_fleet
from gpufleet.plan import access
from gpufleet.plan.planner import Replica, plan_fleet
from gpufleet.run.context import DeployContext
from roles.vllm import replica_files as vf
from tests.conftest import DATA
from tests.recorded_ops import Recorder


def planned_shape(shape: str) -> tuple[Fleet, list[Replica]]:
    """A shape's fleet and its replicas, planned from the profiles its inventory declares (no problem allowed)."""
    fleet = load_fleet(str(DATA / "plans" / shape / "inventory.py"))
    plan = plan_fleet(fleet, fleet_facts(fleet, None))
    assert plan.problems == []
    return fleet, plan.replicas


def run_vllm_role(monkeypatch: pytest.MonkeyPatch, shape: str, host: str, ctx: DeployContext | None = None,
                  read_secrets: bool = False, **values: object) -> tuple[Recorder, DeployContext]:
    """``vllm_install`` then ``vllm_serve`` of one host of a shape (its config updated with ``values``), every
    operation recorded instead of run; each secret a fixed text unless ``read_secrets`` (then read as a deploy
    reads it)."""
    fleet, replicas = planned_shape(shape)
    ctx = ctx or DeployContext(fleet=fleet)
    recorder = Recorder()
    for name in ("apt", "files", "node", "server", "shared_secrets", "systemd", "vllm"):
        monkeypatch.setattr(vllm_role, name, recorder.module(name))
    cfg = fleet.configs[host].model_copy(update=values)
    monkeypatch.setattr(vllm_role, "host_config", lambda *_: cfg)
    monkeypatch.setattr(vllm_role, "context", lambda *_: ctx)
    monkeypatch.setattr(vllm_role, "assignments",
                        lambda *_: [(r, role) for r in replicas for role in r.roles if role.host == host])
    monkeypatch.setattr(access, "deploy_group", lambda group="monitoring": [])
    if not read_secrets:
        monkeypatch.setattr(vf, "_read_secret", lambda ref, key: f"{key} value")
    vllm_role.vllm_install.__wrapped__()  # type: ignore[attr-defined]
    vllm_role.vllm_serve.__wrapped__()  # type: ignore[attr-defined]
    return recorder, ctx


def first_node(shape: str) -> tuple[Replica, str]:
    """A shape's first replica and its first node."""
    _, replicas = planned_shape(shape)
    return replicas[0], replicas[0].nodes[0]
