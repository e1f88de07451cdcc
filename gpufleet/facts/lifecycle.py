"""A node's lifecycle record as its watch keeps it (role node_lifecycle; the format: gpufleet/node/node_state.py)."""

from __future__ import annotations

import json
from typing import Any

from pyinfra.api.command import QuoteString, StringCommand
from pyinfra.api.facts import FactBase

from gpufleet.node.node_state import SCHEMA
from gpufleet.node_paths import NODE_STATE_FILE


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
        try:
            found = json.loads("\n".join(output))
        except ValueError:
            return None
        return found if isinstance(found, dict) and found.get("schema") == SCHEMA else None
