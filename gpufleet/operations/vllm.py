"""vLLM replicas: the restart record that makes an interrupted restart happen on the next run, the LoRA adapters a
deploy gives new weights (the replica restarts for them), the check that
the nodes of a multi-node replica run the same vLLM, torch, Python, Ray and model before any of them starts it, the
report of the KV cache vLLM reports beside the plan's, and each replica's start as
the readiness wait timed it, kept on the monitoring hosts as each release's start record."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

from pyinfra import logger
from pyinfra.api.command import QuoteString, StringCommand
from pyinfra.context import host, state

from gpufleet.facts.vllm import STACK_KEYS, ReplicaStack
from gpufleet.measure.starts import Start, StartKey, fastest, measured_start, read_record, record_text, records_textfile
from gpufleet.operations import files, node
from gpufleet.operations.node import Commands, fail, gpufleet_operation, read_only
from gpufleet.plan.kv_observed import observed_line
from gpufleet.pyinfra_seam import current_host
from gpufleet.run.lost_nodes import connection_lost

NodeStack = dict[str, str | None]  # vllm, torch, python, ray, model -> its value on one node (None: none there)
AGREE_KEYS = (*STACK_KEYS, "model")


@gpufleet_operation()
def restart_record(marker: str, changed: Callable[[], bool], pending: Callable[[], None]) -> Commands:
    """
    Record on the node that its replica must restart: when its files changed in this run (``changed``), or
    when a record left by an interrupted run is still there (then ``pending`` is told, and check reports it).

    + marker: the replica's ``restart-pending`` file
    + changed: whether any of the replica's files changed, on any of its nodes
    + pending: called when the record was already there
    """
    if node.path(marker)["type"] != "missing":
        pending()
        yield StringCommand("touch", QuoteString(marker))  # still due: a restart an earlier run did not finish
        return
    if not changed():
        host.noop("no restart due")
        return
    node.forget("paths", marker)
    yield StringCommand("touch", QuoteString(marker))


@gpufleet_operation(counts_as_drift=False, runs_when_read_only=True)
def adapters_replaced(release: str, adapters: dict[str, str], replaced: Callable[[], None]) -> Commands:
    """
    Tell ``replaced`` when a LoRA adapter the replica's recorded release serves is declared again with other weights:
    vLLM keeps an adapter it has loaded under its name, and keys its prefix cache by that name, so only an engine
    started after the change serves the new revision. An adapter added or removed replaces nothing; changes nothing.

    + release: the replica's ``release.json`` on this node (what its last deploy recorded)
    + adapters: the adapters it serves from now on, name -> its weights' SHA-256
    + replaced: called when one of them had other weights in the recorded release
    """
    if not state.is_executing:  # pyinfra's look ahead when ops are added: the record is read when the run gets here
        host.noop("read when the run gets here")
        return
    before = recorded_adapters(node.text(release))
    names = sorted(name for name, sha256 in adapters.items() if before.get(name, sha256) != sha256)
    if names:
        replaced()
    host.noop(f"new weights for {', '.join(names)}: the replica restarts" if names else "no adapter's weights replaced")
    yield from ()


def recorded_adapters(text: str | None) -> dict[str, str]:
    """Each LoRA adapter a ``release.json`` records, name -> its weights' SHA-256; none when there is no readable
    record (a replica deployed for the first time starts anyway)."""
    try:
        recorded = json.loads(text or "{}").get("vllm_lora_adapters") or {}
        return {str(name): str(adapter["sha256"]) for name, adapter in recorded.items()}
    except (ValueError, AttributeError, KeyError, TypeError):
        return {}


@gpufleet_operation(counts_as_drift=False, runs_when_read_only=True)
def node_stack(python: str, package: str, model: str | None, model_dir: str, stacks: dict[str, NodeStack]) -> Commands:
    """
    Read what this node runs its replica with (:class:`~gpufleet.facts.vllm.ReplicaStack`) and record it in ``stacks``
    under the host's name, for :func:`nodes_agree`; changes nothing.

    + python: the replica's virtualenv Python on this node
    + package: the distribution that is vLLM (``vllm_package``)
    + model: the model's identity known on the controller (``vllm_files.model_identity``); None: the node digests
      the file names and sizes of ``model_dir``
    + model_dir: the model's directory on the node
    + stacks: the replica's record, node -> values
    """
    if not state.is_executing:  # pyinfra's look ahead when ops are added: the virtualenv may not be there yet
        host.noop("read when the run gets here")
        return
    found = host.get_fact(ReplicaStack, python=python, package=package, model_dir=None if model else model_dir)
    if found is None and connection_lost(current_host()):  # nothing read: the node is gone, not without a venv
        yield fail("the connection was lost while reading its vLLM, torch, Python and Ray versions")
        return
    values: NodeStack = {key: (found or {}).get(key) for key in STACK_KEYS}
    if values["vllm"] is not None and package != "vllm":
        values["vllm"] = f"{values['vllm']} ({package})"
    listed = (found or {}).get("model_files")
    values["model"] = model or (f"files (names, sizes) sha256:{listed[:16]}" if listed else None)
    stacks[host.name] = values
    host.noop(f"no virtualenv Python at {python}" if found is None else _shown(values))
    yield from ()


@gpufleet_operation()
def nodes_agree(replica: str, nodes: list[str], stacks: dict[str, NodeStack]) -> Commands:
    """
    Fail this node when the nodes of its replica disagree on vLLM, torch, Python, Ray or the model, naming each
    node's value of every key they differ in; no change when they agree. Every node of the replica runs it, so
    all of them stop before any starts it. Read-only (deploys/check.py): a node without its virtualenv yet is
    left out (its install is drift already), and a disagreement is drift, printed with its values.

    + replica: the replica's name
    + nodes: its nodes, in the plan's order
    + stacks: what :func:`node_stack` recorded on each (a node that stopped earlier in the run has nothing)
    """
    if not state.is_executing:  # pyinfra's look ahead when ops are added: nothing is recorded yet
        host.noop("checked when the run gets here, once every node of the replica has been read")
        return
    found = {name: stacks[name] for name in nodes if name in stacks
             and not (read_only() and stacks[name].get("python") is None)}
    message = disagreement(replica, found)
    if message is None:
        host.noop(f"{', '.join(found) or 'no node'} agree on vLLM, torch, Python, Ray and the model")
        return
    if read_only():
        print(f"[{host.name}] {message}", file=sys.stderr)
    yield fail(message)


@gpufleet_operation(counts_as_drift=False, runs_when_read_only=True)
def kv_report(replica: str, observed: str, planned: int, tolerance: float, router_policy: str,
              fresh: Callable[[], bool]) -> Commands:
    """
    Log one line: the replica's KV cache tokens as planned beside what vLLM reported at its last start (its
    ``observed.json``, which the readiness wait writes), and what vLLM reported of its prefix caching; a warning
    when the tokens differ by more than ``tolerance``, or when the pool routes by prefix and vLLM caches none.
    Changes nothing, and is never drift.

    + replica: the replica's name
    + observed: its observed.json on this node (its first)
    + planned: the plan's KV cache tokens
    + tolerance: ``vllm_plan_tolerance``
    + router_policy: its pool's ``router_policy`` (``leastconn`` or ``prefix``)
    + fresh: whether the readiness wait ran in this run (then the file is read again)
    """
    if not state.is_executing:  # pyinfra's look ahead when ops are added: the wait has not run yet
        host.noop("reported when the run gets here")
        return
    if fresh():
        node.forget("texts", observed)
    off, line = observed_line(planned, node.text(observed), tolerance, prefix_routed=router_policy == "prefix")
    host.log(f"{replica}: {line}", logger.warning if off else logger.info)
    host.noop(line)
    yield from ()


@gpufleet_operation(counts_as_drift=False, runs_when_read_only=True)
def start_seen(replica: str, observed: str, starts: dict[str, dict[str, Any]], fresh: Callable[[], bool]) -> Commands:
    """
    Record in ``starts`` the replica's last start as the readiness wait timed it (the ``start`` of its
    ``observed.json``: seconds from its process start to each phase), for :func:`start_records` on the monitoring
    hosts; log it when the wait ran in this run. Changes nothing, and is never drift.

    + replica: the replica's name
    + observed: its observed.json on this node (its first)
    + starts: replica -> its start (:class:`~gpufleet.measure.starts.Start`'s JSON), shared by the run's hosts
    + fresh: whether the readiness wait ran in this run (then the file is read again)
    """
    if not state.is_executing:  # pyinfra's look ahead when ops are added: the wait has not run yet
        host.noop("read when the run gets here")
        return
    if fresh():
        node.forget("texts", observed)
    found = measured_start(node.text(observed), host.name)
    if found is None:
        host.noop(f"{replica}: no start timed yet (the readiness wait times the next one)")
        return
    starts[replica] = found.to_json()
    line = f"{replica}: {found.line()}"
    if fresh():
        host.log(line, logger.info)
    host.noop(line)
    yield from ()


@gpufleet_operation()
def start_records(directory: str, textfile: str, planned: list[dict[str, str]],
                  starts: dict[str, dict[str, Any]]) -> Commands:
    """
    On a monitoring host, keep each release's start record on each shape: for each key (model, release, layout,
    GPU profile), the fastest start the deploys have timed, from its process start to its first completion (one
    file per key in ``directory``, replaced only by a faster start), and the records of the keys the plan serves in
    ``textfile``, for node_exporter's textfile collector: what ReplicaStartSlow compares each start with. Nothing is
    written while no start beats its record.

    + directory: where the records are kept (:data:`~gpufleet.measure.starts.START_RECORDS_DIR`)
    + textfile: the records for node_exporter
    + planned: the keys the plan serves (:meth:`~gpufleet.measure.starts.StartKey.labels`)
    + starts: each replica's last start, from :func:`start_seen` on its first node earlier in the run
    """
    if not state.is_executing:  # pyinfra's look ahead when ops are added: no start has been read yet
        host.noop("kept when the run gets here, once every replica's start has been read")
        return
    seen = [Start.from_json(doc) for doc in starts.values()]
    served = {StartKey(**labels) for labels in planned}
    kept: list[Start] = []
    changes: list[Any] = []
    for key in sorted(served | {start.key for start in seen}):
        path = f"{directory}/{key.file_name()}"
        record = read_record(node.text(path))
        best = fastest(record, [start for start in seen if start.key == key])
        if best is None:
            continue
        if best is not record:
            changes += files.file_commands(path, record_text(best))
        if key in served:
            kept.append(best)
    changes += files.file_commands(textfile, records_textfile(kept))
    if not changes:
        host.noop(f"{len(kept)} start record(s) kept, none beaten in this run")
        return
    yield from changes


def disagreement(replica: str, stacks: dict[str, NodeStack]) -> str | None:
    """``replica r1: nodes disagree: torch: lab2 2.9.0, lab3 2.8.0`` (every key that differs, each node's value), or
    None when the nodes agree."""
    differing = [key for key in AGREE_KEYS if len({values.get(key) for values in stacks.values()}) > 1]
    if not differing:
        return None
    return f"replica {replica}: nodes disagree: " + "; ".join(
        f"{key}: " + ", ".join(f"{name} {values.get(key) or 'none'}" for name, values in stacks.items())
        for key in differing)


def _shown(values: NodeStack) -> str:
    return ", ".join(f"{key} {values.get(key) or 'none'}" for key in AGREE_KEYS)
