"""The nodes' lifecycle records (gpufleet/node/node_state.py), read and moved over pyinfra's connections.

Each node's watch keeps its own record (it acts on it within seconds, with no controller); the monitoring hosts keep
the fleet's copy of every record (:data:`NODES_DIR`), which outlives a node that dies or is reinstalled. Reading a
node's record takes the node's own and the monitoring hosts' copies and keeps the one with the longer history (the
node's, unless it lost its disk); every read and every move writes it back to the monitoring hosts, and a move goes
through the node's own tool, so that the node's watch acts on it (a quarantine drains first).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from gpufleet.node.node_state import newer, parse_record
from gpufleet.node_paths import LIFECYCLE_CONFIG, NODE_PYTHON, NODES_DIR, node_tool
from gpufleet.remote.commands import Remote, RemoteResult

TIMEOUT_S = 60
MOVE_TIMEOUT_S = 120
Record = dict[str, Any]


@dataclass
class Records:
    """Every node's record (None: the node has none yet, or it could not be read: ``unread``), and a line for each
    copy that could not be read or written."""

    found: dict[str, Record | None] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    unread: set[str] = field(default_factory=set)


def watch_words(verb: str, *extra: str) -> list[str]:
    return [NODE_PYTHON, node_tool("node_watch.py"), verb, "--config", LIFECYCLE_CONFIG, *extra]


def read(remote: Remote, nodes: list[str], monitoring: list[str]) -> Records:
    """Each node's record: its own, or the monitoring hosts' copy when that holds more."""
    out = Records()
    kept: dict[str, Record | None] = {}
    for host in monitoring:
        listed = remote.run(host, ["grep", "-r", "-h", "-e", ".", NODES_DIR], timeout_s=TIMEOUT_S,
                            ok_status=(0, 1, 2))  # 1: no record yet; 2: no folder yet
        if not listed.ok:
            out.problems.append(f"{host}: the fleet's node records could not be read: {listed.line()}")
            continue
        for line in listed.stdout.splitlines():
            record = parse_record(line)
            if record is not None and record.get("host") in nodes:
                kept[record["host"]] = newer(kept.get(record["host"]), record)
    for node in nodes:
        # exit 2: the node has no node lifecycle (no tool, no configuration: node_lifecycle_enabled false, or never
        # deployed), so no record of its own
        shown = remote.run(node, watch_words("show"), timeout_s=TIMEOUT_S, ok_status=(0, 2))
        own = parse_record(shown.stdout) if shown.ok else None
        if not shown.ok:
            out.problems.append(f"{node}: its record could not be read: {shown.line()}")
            out.unread.add(node)
        out.found[node] = newer(own, kept.get(node))
    return out


def keep(remote: Any, monitoring: list[str], record: Record) -> list[str]:
    """Write ``record`` as the fleet's copy on every monitoring host (one line of JSON, 0644); a line for each host
    where it could not be."""
    path = f"{NODES_DIR}/{record['host']}.json"
    problems = []
    for host in monitoring:
        made: RemoteResult = remote.run(host, ["install", "-d", "-m", "0755", NODES_DIR], timeout_s=TIMEOUT_S)
        written = remote.put_text(host, f"{path}.new", json.dumps(record, sort_keys=True) + "\n") if made.ok else made
        moved = remote.run(host, ["mv", "-f", f"{path}.new", path], timeout_s=TIMEOUT_S) if written.ok else written
        if not moved.ok:
            problems.append(f"{host}: the record of {record['host']} was not kept: {moved.line()}")
    return problems


def move(remote: Remote, node: str, to: str, why: str, by: str, force: bool = False) -> tuple[Record | None, str]:
    """Move ``node`` to ``to`` through its own tool; its record after, and the tool's last error line ("" when it
    moved)."""
    words = watch_words("move", "--to", to, "--why-hex", why.encode().hex(), "--by-hex", by.encode().hex())
    done = remote.run(node, [*words, *(["--force"] if force else [])], timeout_s=MOVE_TIMEOUT_S)
    return (parse_record(done.stdout), "") if done.ok else (None, done.line())
