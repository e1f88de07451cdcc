"""The node lifecycle's operations: a node's admission (role node_lifecycle)."""

from __future__ import annotations

import json

from pyinfra.api.command import QuoteString, StringCommand
from pyinfra.context import host

from gpufleet.node.node_state import IN_SERVICE
from gpufleet.node_paths import NODE_PYTHON, node_tool
from gpufleet.operations import node
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


@gpufleet_operation()
def admission(config: str, state_file: str) -> Commands:
    """
    Run the quick burn-in on a node that has not passed its admission, and fail the host unless it passed (its
    record then says why, and the node is quarantined); no change on a node that has.

    + config: the node lifecycle's configuration (``/etc/gpufleet/lifecycle.json``)
    + state_file: the node's record's summary (``node_paths.NODE_STATE_SUMMARY``)
    """
    found = node.text(state_file)
    if not needs_admission(found):
        try:
            state = str(json.loads(found or "{}").get("state"))
        except (ValueError, AttributeError):
            state = "of unknown state"
        host.noop(f"the node is {state}: {'it passed its admission' if state in IN_SERVICE else 'its watch has it'}")
        return
    node.forget("texts", state_file)
    yield StringCommand(QuoteString(NODE_PYTHON), QuoteString(node_tool("node_watch.py")), "burn-in", "--config",
                        QuoteString(config), "--tier", "quick", ">", "/dev/null")
