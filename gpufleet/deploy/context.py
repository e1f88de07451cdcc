"""What a running deploy knows about the fleet: configs, probed GPU facts, gate verdicts and the plan.

Every role reads its variables through :func:`host_config` and every node's part in the serving plan
through :func:`assignments`. :func:`fleet` validates the whole fleet (exit 2 on bad input, before any
operation runs); :func:`context` probes every host's GPUs once, judges each with its ``gpu_health``
policy and plans the fleet from the hosts that pass; both are kept for the rest of the deploy.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from pyinfra.api.host import Host
from pyinfra.context import host as current_host
from pyinfra.context import state as current_state

from gpufleet.config.schema import HostConfig
from gpufleet.fleet import Fleet, fleet_from_state
from gpufleet.gpu_facts import FactsError, NodeFacts, parse_facts
from gpufleet.gpu_probe import NvmlGpuFacts
from gpufleet.node import health_rules
from gpufleet.plan.commands import NodeRole
from gpufleet.plan.planner import FleetPlan, Replica, plan_fleet


@dataclass
class DeployContext:
    """One deploy's view of the fleet (kept on pyinfra's state object)."""

    fleet: Fleet
    facts: dict[str, NodeFacts] = field(default_factory=dict)
    # host -> lines saying why its GPUs fail the gate (or could not be probed); absent: passed
    gate_failures: dict[str, list[str]] = field(default_factory=dict)
    plan: FleetPlan = field(default_factory=FleetPlan)


_KEY = "_gpufleet_deploy_context"
_LOCK = threading.Lock()  # a gevent lock once pyinfra has patched threading


def _state() -> Any:
    return current_state._get_module() if hasattr(current_state, "_get_module") else current_state


def fleet() -> Fleet:
    """The fleet's validated configuration (``--data`` included); exits 2 on bad input."""
    st = _state()
    cached: Fleet | None = getattr(st, "_gpufleet_fleet", None)
    if cached is None:
        cached = fleet_from_state(st)
        setattr(st, "_gpufleet_fleet", cached)
    return cached


def host_config(host: Host | None = None) -> HostConfig:
    """The validated config of ``host`` (the current host by default)."""
    name = (host or current_host).name
    return fleet().configs[name]


def _probe(target: Host) -> tuple[NodeFacts | None, str | None]:
    try:
        doc = target.get_fact(NvmlGpuFacts)
    except Exception as exc:  # a host that cannot be probed fails its gate; the others go on
        return None, f"the NVML probe failed: {exc}"
    if doc is None:
        return None, "the NVML probe gave no facts"
    try:
        return parse_facts(doc, f"{target.name}: probe output"), None
    except FactsError as exc:
        return None, str(exc)


def context() -> DeployContext:
    """Probe and gate every host once per deploy, and plan the fleet from the hosts that pass.

    Problems the plan finds with the probed hardware do not stop the deploy: the hosts of that pool
    are still provisioned, then stop at the gate with the problem as the reason (:func:`serve_blockers`).
    """
    st = _state()
    with _LOCK:  # pyinfra loads the deploy file for every host at once (gevent): probe once for all
        found: DeployContext | None = getattr(st, _KEY, None)
        if found is None:
            found = _build(st)
            setattr(st, _KEY, found)
    return found


def _build(st: Any) -> DeployContext:
    ctx = DeployContext(fleet())
    for target in st.inventory:
        facts, error = _probe(target)
        if facts is None:
            ctx.gate_failures[target.name] = [f"probe: {error}"]
            continue
        ctx.facts[target.name] = facts
        doc = facts.model_dump(mode="json", by_alias=True)
        failures = health_rules.evaluate(doc, ctx.fleet.configs[target.name].gpu_health)
        if failures:
            ctx.gate_failures[target.name] = [f.line() for f in failures]
    passing = {h: f for h, f in ctx.facts.items() if h not in ctx.gate_failures}
    serving = Fleet(
        ctx.fleet.inventory,
        [h for h in ctx.fleet.hosts if h in passing],
        {h: c for h, c in ctx.fleet.configs.items() if h in passing},
        {pool: kept for pool, hosts in ctx.fleet.pools.items() if (kept := [h for h in hosts if h in passing])},
    )
    ctx.plan = plan_fleet(serving, passing)
    for line in ctx.plan.problems:
        print(f"gpufleet: plan: {line}", file=sys.stderr)
    return ctx


def _pool_problems(ctx: DeployContext, name: str) -> list[str]:
    pool = next((p for p, hosts in ctx.fleet.pools.items() if name in hosts), None)
    return [line for line in ctx.plan.problems
            if line.startswith(f"pool {pool}:") or f" on {name}:" in line]


def serve_blockers(host: Host | None = None) -> list[str]:
    """Why ``host`` must not serve: its gate failures, or the plan's problems with its pool."""
    ctx = context()
    name = (host or current_host).name
    return ctx.gate_failures.get(name, []) + [f"plan: {p}" for p in _pool_problems(ctx, name)]


def gpu_facts(host: Host | None = None) -> NodeFacts | None:
    """The probed facts of ``host`` (None when it could not be probed)."""
    return context().facts.get((host or current_host).name)


def gate_failures(host: Host | None = None) -> list[str]:
    """Why ``host`` fails the GPU health gate; empty when it passes."""
    return context().gate_failures.get((host or current_host).name, [])


def assignments(host: Host | None = None) -> list[tuple[Replica, NodeRole]]:
    """Every replica ``host`` takes part in, with its role there, in plan order."""
    name = (host or current_host).name
    return [(replica, role) for replica in context().plan.replicas for role in replica.roles if role.host == name]
