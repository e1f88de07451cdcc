"""The node lifecycle's operations: a node's admission, and its record kept on the monitoring hosts."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from pyinfra.api.command import QuoteString, StringCommand
from pyinfra.context import host, state

from gpufleet.node.node_state import IN_SERVICE, newer, parse_record
from gpufleet.node_paths import NODE_PYTHON, NODE_STATE_DIR, node_tool
from gpufleet.operations import files, node
from gpufleet.operations.node import Commands, gpufleet_operation


def needs_admission(summary_text: str | None) -> bool:
    """Whether a node must pass the quick burn-in before a replica lands on it, from its record's summary
    (``{"state": ..., "quarantines": N, "requested": bool}``): it has none, or its record has never let it serve (new,
    or in its first burn-in). A node that left (quarantined, retired), is being readmitted or runs a full burn-in a
    person requested is its watch's to bring back; one that serves has passed. A summary that cannot be read admits
    nothing: the watch rewrites it with the record."""
    if summary_text is None:
        return True
    try:
        summary = json.loads(summary_text)
    except ValueError:
        return False
    state = summary.get("state") if isinstance(summary, dict) else None
    return state == "new" or (state == "burn-in" and not summary.get("quarantines") and not summary.get("requested"))


RESTORE_FILE = f"{NODE_STATE_DIR}/restore.json"  # the fleet's copy of a lost record, until the node tool takes it


@gpufleet_operation()
def admission(config: str, state_file: str, lost: dict[str, Any] | None = None) -> Commands:
    """
    Run the quick burn-in on a node that has not passed its admission, and fail the host unless it passed (its
    record then says why, and the node is quarantined); no change on a node that has. A node with no record of its
    own that the monitoring hosts know (``lost``: it lost its disk, or was reinstalled) gets that record back first;
    then one that left stays its watch's, and one in service runs the quick burn-in again (new disks, new checks).

    + config: the node lifecycle's configuration (``/etc/gpufleet/lifecycle.json``)
    + state_file: the node's record's summary (``node_paths.NODE_STATE_SUMMARY``)
    + lost: the monitoring hosts' copy of the record of a node that has none
    """
    found = node.text(state_file)
    if found is None and lost is not None:
        node.forget("texts", state_file)
        yield from files.file_commands(RESTORE_FILE, json.dumps(lost, sort_keys=True) + "\n", mode="0600")
        yield StringCommand(QuoteString(NODE_PYTHON), QuoteString(node_tool("node_watch.py")), "restore", "--config",
                            QuoteString(config), "--record-file", QuoteString(RESTORE_FILE), ">", "/dev/null")
        if lost.get("state") not in IN_SERVICE:
            return
    elif not needs_admission(found):
        try:
            state = str(json.loads(found or "{}").get("state"))
        except (ValueError, AttributeError):
            state = "of unknown state"
        host.noop(f"the node is {state}: {'it passed its admission' if state in IN_SERVICE else 'its watch has it'}")
        return
    node.forget("texts", state_file)
    yield StringCommand(QuoteString(NODE_PYTHON), QuoteString(node_tool("node_watch.py")), "burn-in", "--config",
                        QuoteString(config), "--tier", "quick", ">", "/dev/null")


@gpufleet_operation()
def record_seen(state_file: str, seen: dict[str, dict[str, Any]], fresh: Callable[[], bool]) -> Commands:
    """
    Keep in ``seen`` the node's record as it is when the run gets here (after its admission), for the monitoring
    hosts' copy (:func:`keep_records`). Changes nothing, and is never drift.

    + state_file: the node's record (``node_paths.NODE_STATE_FILE``)
    + seen: host -> its record, shared by the run's hosts
    + fresh: whether the admission ran in this run (then the record is read again)
    """
    if not state.is_executing:  # pyinfra's look ahead when ops are added: the admission has not run yet
        host.noop("read when the run gets here")
        return
    if fresh():
        node.forget("texts", state_file)
    record = parse_record(node.text(state_file))
    if record is not None:
        seen[host.name] = record
    host.noop(f"the node is {record.get('state') if record is not None else 'without a record'}")
    yield from ()


@gpufleet_operation()
def keep_records(directory: str, seen: dict[str, dict[str, Any]], kept: dict[str, dict[str, Any]]) -> Commands:
    """
    On a monitoring host, keep the fleet's copy of each node's record this run read (``<directory>/<host>.json``,
    one line of JSON, root 0644), where it holds more than the copy there: what ``gpufleet nodes`` and the next
    deploys read, which outlives a node that loses its disk.

    + directory: :data:`~gpufleet.node_paths.NODES_DIR`
    + seen: host -> its record (:func:`record_seen`)
    + kept: host -> this monitoring host's copy, as the run read it before it planned (none where it has none)
    """
    if not state.is_executing:  # pyinfra's look ahead when ops are added: no record has been read yet
        host.noop("kept when the run gets here, once every node's record has been read")
        return
    changes: list[Any] = []
    for name, record in sorted(seen.items()):
        path = f"{directory}/{name}.json"
        if newer(record, kept.get(name)) is record and record != kept.get(name):
            changes += files.file_commands(path, json.dumps(record, sort_keys=True) + "\n")
    if not changes:
        host.noop(f"{len(seen)} node record(s) kept as read")
        return
    yield from changes
