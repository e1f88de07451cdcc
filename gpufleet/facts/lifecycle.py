"""A node's lifecycle record as its watch keeps it (role node_lifecycle; the format: gpufleet/node/node_state.py)."""

from __future__ import annotations

from typing import Any

from pyinfra.api.command import QuoteString, StringCommand
from pyinfra.api.facts import FactBase

from gpufleet.node.node_state import newer, parse_record
from gpufleet.node_paths import NODE_STATE_FILE, NODES_DIR


class NodeRecord(FactBase[dict[str, Any] | None]):
    """
    The node's record, or None where it has none (a node gpufleet has never admitted) or one that is not a record:

    .. code:: python

        {"schema": "gpufleet.node-state/1", "host": "gpu-a01", "state": "quarantined",
         "since": "2026-11-27T15:02:11Z", "quarantines": ["2026-11-27T15:02:11Z"], "history": [...], ...}
    """

    def command(self) -> StringCommand:
        return StringCommand("cat", QuoteString(NODE_STATE_FILE), "2>/dev/null", "||", "true")

    def process(self, output: list[str]) -> dict[str, Any] | None:
        return parse_record("\n".join(output))


class FleetNodeRecords(FactBase[dict[str, dict[str, Any]]]):
    """
    On a monitoring host, the fleet's copy of every node's record (one line of JSON per file in ``NODES_DIR``,
    written by ``gpufleet nodes`` and by each deploy), by host; the longer history where a host has two:

    .. code:: python

        {"gpu-a01": {"schema": "gpufleet.node-state/1", "host": "gpu-a01", "state": "retired", ...}}
    """

    @staticmethod
    def default() -> dict[str, dict[str, Any]]:
        return {}

    def command(self) -> StringCommand:
        return StringCommand("grep", "-r", "-h", "-e", ".", QuoteString(NODES_DIR), "2>/dev/null", "||", "true")

    def process(self, output: list[str]) -> dict[str, dict[str, Any]]:
        found: dict[str, dict[str, Any]] = {}
        for line in output:
            record = parse_record(line)
            if record is not None and isinstance(record.get("host"), str):
                kept = newer(found.get(record["host"]), record)
                if kept is not None:
                    found[record["host"]] = kept
        return found
