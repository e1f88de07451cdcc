"""The replicas a rollout moves, and the units it moves them in, from the plan, the routers and the nodes.

A unit is what one limited deploy restarts together: the replicas that share a node (``--limit NODE`` converges
every replica of the node that changed), with every node of a multi-node replica. A unit holds one pool's
replicas, so one model's; it counts once in batch sizes and limits. It is ready (serving) when the routers show
any of its replicas UP on all of them.

Refused before anything runs, one line each: a replica a router does not route to (the routers were not deployed
since the plan changed) or routes in another backend than the inventory gives it, a rollout that would change a
replica's served model name (the routers route by it: the plain deploy changes both together), and a unit whose
replicas would need different ``--data`` (one deploy gives them one).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from gpufleet.config.schema import HostConfig
from gpufleet.measure.records import layout_name
from gpufleet.plan.planner import Replica
from gpufleet.rollout.batches import Unit
from gpufleet.rollout.node_releases import NodeRecords
from gpufleet.rollout.release import Release, overrides, release_of
from gpufleet.rollout.router_control import DRAIN_GRACE_S, RouterView

UPGRADE, ROLLBACK = "upgrade", "rollback"


@dataclass(frozen=True)
class Member:
    """One replica as the rollout moves it."""

    name: str
    backend: str  # its router backend (one per served model)
    nodes: tuple[str, ...]  # every node: what a deploy of it is limited to
    recorded_on: tuple[str, ...]  # the nodes that run its vLLM and hold its release records, first node first
    ready_timeout_s: int  # vllm_ready_timeout: how long it has to be UP in the routers again
    drain_timeout_s: int  # vllm_shutdown_timeout_s + DRAIN_GRACE_S: how long a drain is waited for
    inventory: Release  # what a deploy given no release gives it (the inventory with the operator's --data)
    before: Release | None  # its first node's release.json when the rollout started (None: not recorded)
    target: Release | None  # what the rollout gives it; None: left untouched
    recorded: frozenset[str] = frozenset()  # the nodes where its release.json exists
    model: str = ""  # its served model name
    layout: str = ""  # tp<T>-pp<P>[-dp<D>] (gpufleet.measure.records.layout_name), and its nodes' GPU profile:
    profile: str = ""  # what its latency is compared across (a canary's peers, its bench record)

    def data(self, release: Release) -> Release:
        """The ``--data`` a deploy needs to give it ``release``."""
        return overrides(release, self.inventory)

    @property
    def changes_release(self) -> bool:
        """Whether the rollout gives it another release than it runs (or one it did not record)."""
        return self.target is not None and (self.before is None or bool(overrides(self.target, self.before)))


@dataclass(frozen=True)
class Rollable:
    """What the batch planner and the rollout need: the units, each unit's replicas, the units serving now."""

    units: list[Unit]
    members: dict[str, list[Member]]  # unit name -> its replicas, in plan order
    ready: set[str]  # unit names


class Placed(Protocol):
    """What grouping reads of a replica: its name and its nodes."""

    @property
    def name(self) -> str: ...

    @property
    def nodes(self) -> list[str]: ...


P = TypeVar("P", bound=Placed)


def units_of(replicas: Sequence[P]) -> list[list[P]]:
    """The replicas grouped by shared nodes (transitively), in plan order."""
    groups: list[tuple[set[str], list[P]]] = []
    for replica in replicas:
        joined = [g for g in groups if g[0] & set(replica.nodes)]
        nodes, members = set(replica.nodes), [replica]
        for group in joined:
            nodes |= group[0]
            members = group[1] + members
            groups.remove(group)
        groups.append((nodes, members))
    order = {replica.name: i for i, replica in enumerate(replicas)}
    found = [sorted(members, key=lambda r: order[r.name]) for _, members in groups]
    return sorted(found, key=lambda members: order[members[0].name])


def _served(release: Release) -> object:
    """The model name a release answers to: its served name, else its model."""
    return release.get("vllm_served_model_name") or release.get("vllm_model")


def rollable(replicas: Sequence[Replica], configs: Mapping[str, HostConfig], backends: Mapping[str, str],
             view: RouterView, records: Mapping[str, Mapping[str, NodeRecords]], mode: str) -> tuple[Rollable,
                                                                                                      list[str]]:
    """The units to roll for ``mode`` (:data:`UPGRADE`: to what the inventory gives; :data:`ROLLBACK`: to each
    replica's previous release, untouched without one), and the problems that refuse the rollout.

    ``backends``: each replica's backend as the inventory gives it; ``view``: what each router shows now;
    ``records``: node -> replica -> its release records there."""
    problems: list[str] = []
    units: list[Unit] = []
    members: dict[str, list[Member]] = {}
    ready: set[str] = set()
    for group in units_of(replicas):
        found = [_member(replica, configs, backends, records, mode) for replica in group]
        name = "+".join(member.name for member in found)
        for member in found:
            problems += _router_problems(member, view)
            if member.target is not None and member.before is not None and \
                    _served(member.before) != _served(member.target):
                problems.append(f"replica {member.name}: vllm_served_model_name would change from"
                                f" {_served(member.before)!r} to {_served(member.target)!r}: the routers route by it;"
                                " change it with the plain deploy (routers and replicas together)")
        wanted = {repr(sorted(m.data(m.target).items())) for m in found if m.target is not None}
        if len(wanted) > 1 or (wanted and any(m.target is None for m in found)):
            problems.append(f"unit {name}: its replicas share a node but their {mode} targets differ; one deploy"
                            " gives them one --data")
        units.append(Unit(name, found[0].backend, tuple(dict.fromkeys(n for m in found for n in m.nodes))))
        members[name] = found
        if any(all(member.name in shown and shown[member.name].up for shown in view.values()) for member in found):
            ready.add(name)
    if mode == ROLLBACK and not any(m.target is not None for found in members.values() for m in found):
        problems.append("no replica has a previous release (release.previous.json): nothing to roll back")
    return Rollable(units, members, ready), problems


def _member(replica: Replica, configs: Mapping[str, HostConfig], backends: Mapping[str, str],
            records: Mapping[str, Mapping[str, NodeRecords]], mode: str) -> Member:
    cfg = configs[replica.nodes[0]]
    recorded_on = tuple(role.host for role in replica.roles if any(p.unit == "vllm" for p in role.processes))
    first = records.get(recorded_on[0], {}).get(replica.name) if recorded_on else None
    inventory = release_of(cfg)
    before = first.current if first else None
    target = inventory if mode == UPGRADE else (first.previous if first else None)
    recorded = frozenset(node for node in recorded_on
                         if (found := records.get(node, {}).get(replica.name)) and found.current is not None)
    return Member(replica.name, backends[replica.name], tuple(replica.nodes), recorded_on, cfg.vllm_ready_timeout,
                  cfg.vllm_shutdown_timeout_s + DRAIN_GRACE_S, inventory, before, target, recorded,
                  replica.served, layout_name(replica.tp, replica.pp, replica.dp), replica.gpu_profile)


def _router_problems(member: Member, view: RouterView) -> list[str]:
    problems = []
    for router, shown in view.items():
        found = shown.get(member.name)
        if found is None:
            problems.append(f"replica {member.name}: router {router} does not route to it: deploy the routers first"
                            " (pyinfra INVENTORY deploys/vllm.py --limit routers)")
        elif found.backend != member.backend:
            problems.append(f"replica {member.name}: router {router} has it in backend {found.backend}, the inventory"
                            f" in {member.backend} (another served model name): change that with the plain deploy")
    return problems
