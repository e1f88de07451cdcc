"""What a running deploy knows about the fleet: configs, probed GPU facts, gate verdicts, the plan, and what its
operations tell each other across hosts.

Every role reads its variables through :func:`host_config` and every node's part in the serving plan through
:func:`assignments`. :func:`fleet` validates the whole fleet (exit 2 on bad input, before any operation runs);
:func:`context` probes every host's GPUs once, all hosts at the same time, judges each with its ``gpu_health``
policy and plans the fleet from the hosts that pass (router admission from the monitoring hosts' bench records where
they measured it); all of it is kept for the rest of the deploy, in the one
:class:`DeployState` of its pyinfra state (:func:`deploy_state`), with what its operations know of each node.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from weakref import WeakKeyDictionary

import gevent
from pyinfra.api.host import Host
from pyinfra.api.operation import OperationMeta
from pyinfra.api.state import State
from pyinfra.context import host as current_host

from gpufleet.config.fleet import Fleet
from gpufleet.config.inventory_shape import MONITORING_GROUP
from gpufleet.config.schema import HostConfig
from gpufleet.facts.bench import BenchRecords
from gpufleet.facts.gpu import NvmlGpuFacts
from gpufleet.facts.lifecycle import FleetNodeRecords, NodeRecord
from gpufleet.facts.node import NodeStateValue, empty_node_state
from gpufleet.gpu.profiles import profile_facts
from gpufleet.gpu.report import FactsError, NodeFacts, parse_facts
from gpufleet.inventory.load import fleet_from_state
from gpufleet.measure.capacity import measured_admission
from gpufleet.measure.records import Record
from gpufleet.node import health_rules, node_state
from gpufleet.plan.commands import NodeRole
from gpufleet.plan.layout import NodeShape, node_shape
from gpufleet.plan.planner import FleetPlan, Replica, plan_fleet
from gpufleet.pyinfra_seam import current_host as current_host_object
from gpufleet.pyinfra_seam import current_state
from gpufleet.run import lost_nodes, op_order


@dataclass
class DeployContext:
    """One deploy's view of the fleet (one per pyinfra state)."""

    fleet: Fleet
    facts: dict[str, NodeFacts] = field(default_factory=dict)
    # host -> lines saying why its GPUs fail the gate (or could not be probed); absent: passed
    gate_failures: dict[str, list[str]] = field(default_factory=dict)
    plan: FleetPlan = field(default_factory=FleetPlan)
    # replica -> the operations on any of its nodes whose change means "restart it"
    replica_changes: dict[str, list[OperationMeta]] = field(default_factory=dict)
    # replica -> the operations on its first node whose change means "restart its watchdog" (not the replica)
    watchdog_changes: dict[str, list[OperationMeta]] = field(default_factory=dict)
    # replica -> the start of its unit on each of its nodes (one that started a rank means: wait until it serves)
    replica_starts: dict[str, list[OperationMeta]] = field(default_factory=dict)
    # multi-node replica -> node -> the vLLM, torch, Python and Ray versions and the model it runs the replica with
    replica_stacks: dict[str, dict[str, dict[str, str | None]]] = field(default_factory=dict)
    # a secret several nodes share (gpufleet.operations.shared_secrets: a multi-node mp replica's rank secret, the
    # routers' peer certificate), by its file -> node -> the file's digest (None: none); the secret drawn in this run,
    # by what it is, where its holders hold none or different ones (in memory only, never in a repr)
    shared_secrets_seen: dict[str, dict[str, str | None]] = field(default_factory=dict)
    shared_secrets: dict[str, str] = field(default_factory=dict, repr=False)
    # replicas with a restart record left by an earlier, interrupted run on any of their nodes
    pending_restarts: set[str] = field(default_factory=set)
    # replicas one of whose LoRA adapters gets new weights in this run, on any of their nodes (they restart)
    adapters_replaced: set[str] = field(default_factory=set)
    # replica -> the readiness wait on its first node
    readiness: dict[str, OperationMeta] = field(default_factory=dict)
    # replica -> its last start as its readiness wait timed it (gpufleet.measure.starts.Start's JSON), read on its first
    # node: what the monitoring hosts keep each release's start record from
    starts: dict[str, dict[str, Any]] = field(default_factory=dict)
    # host -> the facts of its declared gpu_profile, planned with because its NVML could not answer yet (no
    # driver): its gate probes it again after the driver role and requires the profile's GPUs
    provisional: dict[str, NodeFacts] = field(default_factory=dict)
    # host -> the driver role's operations whose change means: probe the node again before its gate
    driver_changes: dict[str, list[OperationMeta]] = field(default_factory=dict)
    # host -> its lifecycle record when the deploy started (role node_lifecycle; absent: none): its own, or the
    # monitoring hosts' copy where that holds more (a node that lost its disk is what the fleet knew of it)
    records: dict[str, dict[str, Any]] = field(default_factory=dict)
    # monitoring host -> its copies of the nodes' records (host -> record), read before the plan
    fleet_copies: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    # host -> the monitoring hosts' copy of its record where the node has none of its own (its admission restores it)
    lost_records: dict[str, dict[str, Any]] = field(default_factory=dict)
    # host -> its record as this run left it, read after its admission: what the monitoring hosts keep
    records_seen: dict[str, dict[str, Any]] = field(default_factory=dict)
    # host -> why it is left out of the plan: it left the fleet (quarantined, retired) or is being readmitted
    out_of_service: dict[str, str] = field(default_factory=dict)

    def served(self, replica: str) -> bool:
        """Whether the replica's readiness wait ran in this deploy and succeeded."""
        wait = self.readiness.get(replica)
        return wait is not None and wait.is_complete() and wait.executed and wait.did_succeed()


@dataclass
class NodeMemory:
    """What one deploy's operations know of one node (gpufleet.operations.node), and what they did there."""

    reading: NodeStateValue = field(default_factory=empty_node_state)  # items read, and not changed since
    absent: set[tuple[str, str]] = field(default_factory=set)  # (kind, name): packages, users, groups found absent
    observed: dict[str, set[str]] = field(default_factory=dict)  # kind -> every role's observed items
    first_read: bool = False  # the first reading (everything observed) is done
    ran_commands: bool = False  # an operation of this deploy ran a command on the node
    drift: dict[str, str] = field(default_factory=dict)  # read-only: operation hash -> name, of those that would change


@dataclass
class DeployState:
    """Everything one deploy keeps (one per pyinfra state): its fleet, its context once built, whether it only
    reads (deploys/check.py), and what its operations know of each node."""

    fleet: Fleet | None = None
    context: DeployContext | None = None
    read_only: bool = False
    nodes: dict[str, NodeMemory] = field(default_factory=dict)  # host name -> what is known of it

    def node(self, name: str) -> NodeMemory:
        """What is known of host ``name``, empty at first."""
        found = self.nodes.get(name)
        if found is None:
            found = self.nodes[name] = NodeMemory()
        return found


_states: WeakKeyDictionary[State, DeployState] = WeakKeyDictionary()  # pyinfra state -> its deploy's state
_LOCK = threading.Lock()  # a gevent lock once pyinfra has patched threading


def deploy_state(st: State | None = None) -> DeployState:
    """The state of the deploy ``st`` (by default the running one), made empty on first use."""
    key = current_state() if st is None else st
    found = _states.get(key)
    if found is None:
        found = _states[key] = DeployState()
    return found


def fleet() -> Fleet:
    """The fleet's validated configuration (``--data`` included); exits 2 on bad input."""
    state = deploy_state()
    if state.fleet is None:
        state.fleet = fleet_from_state(current_state())
    return state.fleet


def host_config(host: Host | None = None) -> HostConfig:
    """The validated config of ``host`` (the current host by default)."""
    name = (host or current_host).name
    return fleet().configs[name]


def _record(target: Host) -> dict[str, Any] | None:
    """The host's lifecycle record, or None (none yet, or one that could not be read: its watch has the node)."""
    try:
        return target.get_fact(NodeRecord)
    except Exception:  # noqa: BLE001 - an unreadable record leaves the node to its probe and its admission
        return None


def _monitors(st: State) -> list[Host]:
    """The inventory group ``monitoring``'s hosts (none where it defines no such group)."""
    try:
        return list(st.inventory.get_group(MONITORING_GROUP))
    except Exception:  # noqa: BLE001 - pyinfra raises NoGroupError for a group the inventory does not define
        return []


def _bench_records(st: State) -> list[Record]:
    """The bench records of the first monitoring host that answers (none without one): what admission is sized
    from (gpufleet.measure.capacity.measured_admission)."""
    for monitor in _monitors(st):
        try:
            return [Record.from_json(doc) for doc in monitor.get_fact(BenchRecords)]
        except Exception:  # noqa: BLE001 - a monitoring host that cannot be read leaves admission to the plan
            continue
    return []


def _fleet_copies(st: State) -> dict[str, dict[str, dict[str, Any]]]:
    """Each monitoring host's copies of the nodes' records (the inventory group ``monitoring``'s hosts that answer);
    none without one."""
    found: dict[str, dict[str, dict[str, Any]]] = {}
    for monitor in _monitors(st):
        try:
            copies: dict[str, dict[str, Any]] = monitor.get_fact(FleetNodeRecords)
            found[monitor.name] = copies or {}
        except Exception:  # noqa: BLE001 - a monitoring host that cannot be read leaves each node to its own record
            continue
    return found


def newest_copy(fleet_copies: dict[str, dict[str, dict[str, Any]]], host: str) -> dict[str, Any] | None:
    """Of every monitoring host's copy of ``host``'s record, the one with the longer history; None without one."""
    found: dict[str, Any] | None = None
    for copies in fleet_copies.values():
        found = node_state.newer(found, copies.get(host))
    return found


def _probe(target: Host) -> tuple[dict[str, Any] | None, NodeFacts | None, str | None]:
    """The host's facts document as the probe printed it, the same parsed, or why there is none."""
    try:
        doc = target.get_fact(NvmlGpuFacts)
    except Exception as exc:  # noqa: BLE001 - a host that cannot be probed fails its gate; the others go on
        return None, None, f"the NVML probe failed: {exc}"
    if doc is None:
        return None, None, "the NVML probe gave no facts"
    try:
        return doc, parse_facts(doc, f"{target.name}: probe output"), None
    except FactsError as exc:
        return None, None, str(exc)


def context(read_only: bool = False) -> DeployContext:
    """Probe and gate every host once per deploy, and plan the fleet from the hosts that pass; ``read_only``
    (deploys/check.py) makes every gpufleet operation of this deploy run nothing and record drift instead.

    Problems the plan finds with the probed hardware do not stop the deploy: the hosts of that pool are still
    provisioned, then stop at the gate with the problem as the reason (:func:`serve_blockers`).
    """
    st = current_state()
    op_order.install()  # before the deploy file adds its first operation
    with _LOCK:  # pyinfra loads the deploy file for every host at once: the first builds, the others wait
        state = deploy_state(st)
        if state.context is None:
            state.context = _build(st, read_only)
        return state.context


def _build(st: State, read_only: bool) -> DeployContext:
    ctx = DeployContext(fleet())
    if read_only:
        deploy_state(st).read_only = True
    lost_nodes.watch(st)  # a node lost during the deploy fails its operation within a bound, and is named
    targets = [target for target in st.inventory if ctx.fleet.serves(target.name)]  # routers: no GPUs to probe
    # every host at once, one command at a time on each host's connection: its probe, then its lifecycle record
    probes = [gevent.spawn(_probe, target) for target in targets]
    gevent.joinall(probes)
    records = [gevent.spawn(_record, target) for target in targets]
    gevent.joinall(records)
    ctx.fleet_copies = _fleet_copies(st)
    for target, read in zip(targets, records, strict=True):
        own = read.value if read.successful() else None
        copy = newest_copy(ctx.fleet_copies, target.name)
        if own is None and copy is not None and read.successful():
            ctx.lost_records[target.name] = copy
        record = node_state.newer(own, copy)
        if record is not None:
            ctx.records[target.name] = record
            if (why := node_state.out_of_service(record)) is not None:
                ctx.out_of_service[target.name] = why
                print(f"gpufleet: {target.name}: no replica: {why}", file=sys.stderr)
    for target, probe in zip(targets, probes, strict=True):
        result = probe.value if probe.successful() else None
        doc, facts, error = result or (None, None, f"the NVML probe failed: {probe.exception}")
        if doc is None or facts is None:
            ctx.gate_failures[target.name] = [f"probe: {error}"]
            continue
        ctx.facts[target.name] = facts
        profile = ctx.fleet.configs[target.name].gpu_profile
        if not facts.nvml.available and profile and not read_only:
            ctx.provisional[target.name] = profile_facts(profile, facts.hostname)  # judged after the driver role
            continue
        failures = health_rules.evaluate(doc, ctx.fleet.configs[target.name].gpu_health)
        if failures:
            ctx.gate_failures[target.name] = [f.line() for f in failures]
    passing = {h: ctx.provisional.get(h, f) for h, f in ctx.facts.items()
               if h not in ctx.gate_failures and h not in ctx.out_of_service}
    ctx.plan = measured_admission(plan_fleet(ctx.fleet.only(passing), passing), _bench_records(st))
    for problem in ctx.plan.problems:
        print(f"gpufleet: plan: {problem.line()}", file=sys.stderr)
    return ctx


def _pool_problems(ctx: DeployContext, name: str) -> list[str]:
    pool = next((p for p, hosts in ctx.fleet.pools.items() if name in hosts), None)
    return [problem.line() for problem in ctx.plan.problems_of(name, pool)]


def serve_blockers(host: Host | None = None) -> list[str]:
    """Why ``host`` must not serve: its gate failures, or the plan's problems with its pool or its processes."""
    ctx = context()
    name = (host or current_host).name
    return ctx.gate_failures.get(name, []) + [f"plan: {p}" for p in _pool_problems(ctx, name)]


def gpu_facts(host: Host | None = None) -> NodeFacts | None:
    """The facts ``host`` is planned with: its probed ones, or its declared profile's while its NVML cannot answer
    (None when it could not be probed)."""
    ctx = context()
    name = (host or current_host).name
    return ctx.provisional.get(name) or ctx.facts.get(name)


def probed_facts(host: Host | None = None) -> NodeFacts | None:
    """What the probe of ``host`` reported when the deploy started (None when it could not be probed)."""
    return context().facts.get((host or current_host).name)


def driver_changed(meta: OperationMeta, host: Host | None = None) -> None:
    """Count an operation of the driver role: when it changes the node, the gate probes the node again."""
    context().driver_changes.setdefault((host or current_host).name, []).append(meta)


def gate_verdict(host: Host | None = None) -> Callable[[], list[str]]:
    """The gate's verdict on ``host``, taken when the gate runs: :func:`serve_blockers`, with the GPU part judged
    again from a fresh probe when the node was planned from its declared profile or the driver role changed it
    in this run (a node planned from its profile must report that profile's GPUs)."""
    ctx, target = context(), host if host is not None else current_host_object()
    blockers = serve_blockers(target)

    def verdict() -> list[str]:
        changed = any(m.is_complete() and m.did_change() for m in ctx.driver_changes.get(target.name, []))
        if target.name not in ctx.provisional and not changed:
            return blockers
        plan_part = [line for line in blockers if line.startswith("plan: ")]
        now = _judge_again(ctx, target)
        if not now and target.name in ctx.gate_failures:  # passes now, but was left out of this deploy's plan
            return [f"not planned in this deploy ({'; '.join(ctx.gate_failures[target.name])}); it passes its gate"
                    " now: the next deploy plans it (a declared gpu_profile lets one deploy converge a node"
                    " without a driver)"]
        return now + plan_part

    return verdict


def _judge_again(ctx: DeployContext, target: Host) -> list[str]:
    """The node's gate failures from probing it now; its facts are kept when it passes."""
    doc, facts, error = _probe(target)
    if doc is None or facts is None:
        return [f"probe: {error}"]
    failures = [f.line() for f in health_rules.evaluate(doc, ctx.fleet.configs[target.name].gpu_health)]
    planned = ctx.provisional.get(target.name)
    if planned is not None and not failures:
        failures = profile_mismatch(ctx.fleet.configs[target.name].gpu_profile or "", planned, facts)
    if not failures:
        ctx.facts[target.name] = facts
    return failures


def profile_mismatch(profile: str, planned: NodeFacts, probed: NodeFacts) -> list[str]:
    """Why the probed GPUs are not the ones the node was planned with from its declared ``gpu_profile`` (GPU
    names, NVLink islands and NUMA nodes as placement reads them; at least the planned memory); empty when
    they are."""
    want, found = node_shape("", planned), node_shape("", probed)
    if (want.gpu_names, want.islands, want.numa) == (found.gpu_names, found.islands, found.numa) \
            and found.memory_bytes >= want.memory_bytes:
        return []
    return [f"gpu_profile: planned as {profile} ({_shape_line(want)}), NVML reports {_shape_line(found)};"
            " the next deploy plans from the probed GPUs"]


def _shape_line(shape: NodeShape) -> str:
    names = sorted(set(shape.gpu_names)) or ["no GPU"]
    islands = "/".join(str(len(i)) for i in shape.islands) or "none"
    return (f"{shape.count} x {', '.join(names)}, {shape.nvml_memory_bytes // 2**20} MiB each,"
            f" NVLink islands {islands}, NUMA {','.join(map(str, shape.numa)) or '-'}")


def assignments(host: Host | None = None) -> list[tuple[Replica, NodeRole]]:
    """Every replica ``host`` takes part in, with its role there, in plan order."""
    name = (host or current_host).name
    return [(replica, role) for replica in context().plan.replicas for role in replica.roles if role.host == name]
