"""A stand-in for the connections to the nodes (gpufleet.remote.commands's Remote): files on the nodes, read with one
``head`` per node, as on a node; each node's lifecycle record, as its node watch shows it (none: the tool answers 2,
as on a node without a node lifecycle); the monitoring hosts' copies of the records (none)."""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from typing import Any

from gpufleet.remote.commands import RemoteResult, command_line


class NodeFiles:
    """Files on the nodes, by node and path; a node in ``unreachable`` cannot be connected to."""

    def __init__(self, files: dict[str, dict[str, str]], unreachable: Collection[str] = (),
                 records: dict[str, dict[str, Any]] | None = None) -> None:
        self.files, self.unreachable, self.records = files, set(unreachable), records or {}
        self.commands: list[tuple[str, list[str]]] = []
        self.closed = False

    def run(self, host: str, words: Sequence[str], *, timeout_s: float,
            ok_status: Collection[int] = (0,)) -> RemoteResult:
        command_line(words)  # every word plain
        self.commands.append((host, list(words)))
        if host in self.unreachable:
            return RemoteResult(False, "", f"{host}: cannot connect: timed out")
        if len(words) > 2 and words[1].endswith("/node_watch.py") and words[2] == "show":
            record = self.records.get(host)
            return RemoteResult((0 if record else 2) in ok_status, json.dumps(record) if record else "",
                                "" if record else "node watch: /etc/gpufleet/lifecycle.json: FileNotFoundError")
        if words[0] == "grep":  # the monitoring hosts' copies of the records: none
            return RemoteResult(2 in ok_status, "", "grep: /var/lib/gpufleet/nodes: No such file or directory")
        assert list(words[:3]) == ["env", "LC_ALL=C", "head"], words
        out, err = [], []
        for path in words[words.index("--") + 1:]:
            if path in self.files.get(host, {}):
                out += [f"==> {path} <==", self.files[host][path], ""]
            else:
                err.append(f"head: cannot open '{path}' for reading: No such file or directory")
        return RemoteResult((1 if err else 0) in ok_status, "\n".join(out), "\n".join(err))

    def close(self) -> None:
        self.closed = True

