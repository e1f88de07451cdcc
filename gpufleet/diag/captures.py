"""Captures: ``gpufleet diag``'s archive taken when something failed (a canary rolled back), without an operator,
and kept on every monitoring host in :data:`gpufleet.node_paths.DIAG_CAPTURES_DIR` (root's alone), the newest
:data:`KEEP` of them. A node keeps its own in the same folder (``diag_collect.py capture``: a restart loop, a
quarantine); ``gpufleet diag --list`` lists every host's.

A capture is named by when it was taken and why (``20261128T101500Z-canary-llama-70b-0.tar.gz``). The node tool
``diag_collect.py captures`` lists a host's captures, and removes those past the newest :data:`KEEP` once a new one
is stored.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Protocol

from gpufleet.diag.archive import write_archive
from gpufleet.diag.collect import TOOL, NodeRemote, collect
from gpufleet.diag.options import out_path
from gpufleet.diag.redact import Secrets
from gpufleet.diag.series import snapshots
from gpufleet.node.diag_collect import capture_name
from gpufleet.node_paths import DIAG_CAPTURES_DIR
from gpufleet.remote.commands import Remote, RemoteResult

KEEP = 20
"""Captures kept on each monitoring host: the newest; a new one removes the oldest past them."""
SINCE_S = 3600
"""The window a capture collects: the hour before the failure."""
MAX_BYTES = 16 << 20
"""What each node gives a capture, at most."""
COMMAND_S = 60.0


class StoreRemote(Remote, Protocol):
    """A :class:`Remote` that also writes a file's bytes (the monitoring hosts')."""

    def put_bytes(self, host: str, path: str, data: bytes) -> RemoteResult: ...


@dataclass(frozen=True)
class Capture:
    """One capture kept on a monitoring host."""

    host: str
    name: str
    bytes: int
    time: str

    def line(self) -> str:
        return f"{self.host}: {DIAG_CAPTURES_DIR}/{self.name} ({self.bytes:,} bytes, {self.time})"


def take(nodes: Sequence[str], remote_for: Callable[[str], NodeRemote], store: StoreRemote,
         monitoring: Sequence[str], prometheus: Sequence[str], secrets: Secrets, reason: str, when: datetime,
         work_dir: Path) -> tuple[str, list[str]]:
    """Collect ``nodes`` (the last :data:`SINCE_S`, :data:`MAX_BYTES` each, and their series from ``prometheus``,
    base URLs) into one archive and keep it on each of ``monitoring``, removing their captures past the newest
    :data:`KEEP`; its name, and a line for each node or host where something failed."""
    runs = collect(list(nodes), remote_for, SINCE_S, MAX_BYTES)
    series = snapshots(prometheus, list(nodes), SINCE_S, time.time(), MAX_BYTES)
    name = capture_name(when, reason)
    local = out_path(str(work_dir / name))
    header = {"capture": reason, "hosts": list(nodes), "since_s": SINCE_S, "max_bytes_per_node": MAX_BYTES}
    try:
        write_archive(local, runs, secrets, header, MAX_BYTES, {}, series)
        data = local.path.read_bytes()
    finally:
        local.remove()
    problems = [f"{host}: {run.problem}" for host, run in runs.items() if run.problem]
    path = f"{DIAG_CAPTURES_DIR}/{name}"
    for host in monitoring:
        done = _keep(store, host, path, data)
        if not done.ok:
            problems.append(f"{host}: the capture was not kept, or older ones not removed: {done.line()}")
    return name, problems


def _keep(store: StoreRemote, host: str, path: str, data: bytes) -> RemoteResult:
    """``data`` written to ``path`` (0600, in the captures' 0700 folder), then the captures past :data:`KEEP`
    removed: the first step that failed, or the last."""
    done = store.run(host, ["install", "-d", "-m", "0700", DIAG_CAPTURES_DIR], timeout_s=COMMAND_S)
    if done.ok:
        done = store.put_bytes(host, path, data)
    if done.ok:
        done = store.run(host, ["chmod", "0600", path], timeout_s=COMMAND_S)
    if done.ok:
        done = store.run(host, [*TOOL, "captures", "--keep", str(KEEP)], timeout_s=COMMAND_S)
    return done


def listed(store: Remote, hosts: Sequence[str]) -> tuple[list[Capture], list[str]]:
    """Every capture kept on ``hosts``, newest first on each; a line for each host that could not say."""
    found, problems = [], []
    for host in hosts:
        done = store.run(host, [*TOOL, "captures"], timeout_s=COMMAND_S)
        try:
            entries = json.loads(done.stdout) if done.ok else None
            found += [Capture(host, str(e["name"]), int(e["bytes"]), str(e["time"])) for e in entries or ()]
        except (ValueError, KeyError, TypeError):
            entries = None
        if entries is None:
            problems.append(f"{host}: its captures could not be listed: {done.line()}")
    return found, problems
