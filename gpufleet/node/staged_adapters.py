"""Whether each LoRA adapter of this node's replicas is staged as declared (a node tool, standard library only).

The node watch reads the declared set from its configuration (``adapters``: each replica's adapter, the weights
file vLLM's filesystem resolver reads for it, and the weights' declared SHA-256), looks again every
``CHECK_EVERY_S``, and exports one verdict per replica and adapter for Prometheus: 1 when the file is a regular file
whose SHA-256 is the declared one, 0 when it is missing, not a regular file, unreadable or different. A file is
hashed again only when it changed (its device, inode, size or modification time), so a look costs a ``stat`` each.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from dataclasses import dataclass
from typing import Any

CHECK_EVERY_S = 10.0
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")  # a replica's and an adapter's names, as the controller checks them
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
CHUNK = 1 << 20


@dataclass(frozen=True)
class Declared:
    """One adapter as a replica on this node serves it: its weights file, and their SHA-256 as declared."""

    replica: str
    name: str
    path: str
    sha256: str


def declared(doc: Any) -> list[Declared]:
    """The configuration's ``adapters`` (a list of mappings); ``ValueError`` naming the first entry that is not one."""
    if not isinstance(doc, list):
        raise ValueError(f"adapters: expected a list, found {type(doc).__name__}")
    found = []
    for index, entry in enumerate(doc):
        if not (isinstance(entry, dict) and set(entry) == {"replica", "name", "path", "sha256"}
                and all(isinstance(entry[key], str) for key in entry)
                and _NAME.match(entry["replica"]) and _NAME.match(entry["name"])
                and entry["path"].startswith("/") and _SHA256.match(entry["sha256"])):
            raise ValueError(f"adapters[{index}]: expected replica, name, an absolute path and a SHA-256")
        found.append(Declared(entry["replica"], entry["name"], entry["path"], entry["sha256"]))
    return found


class Digests:
    """The SHA-256 of files, computed again only when a file changed."""

    def __init__(self) -> None:
        self._known: dict[str, tuple[tuple[int, int, int, int], str]] = {}

    def of(self, path: str) -> str | None:
        """``path``'s SHA-256 (through a link), or None when it is missing, not a regular file or unreadable. A FIFO
        or a device is never opened for reading."""
        try:
            found = os.stat(path)
        except OSError:
            return None
        if not stat.S_ISREG(found.st_mode):
            return None
        key = (found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns)
        known = self._known.get(path)
        if known is not None and known[0] == key:
            return known[1]
        digest = hashlib.sha256()
        try:
            descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            return None
        with os.fdopen(descriptor, "rb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):  # replaced between the stat and the open
                return None
            for chunk in iter(lambda: handle.read(CHUNK), b""):
                digest.update(chunk)
        self._known[path] = (key, digest.hexdigest())
        return digest.hexdigest()


def verdicts(adapters: list[Declared], digests: Digests) -> list[tuple[Declared, bool]]:
    """Each adapter, and whether its weights are staged as declared."""
    return [(adapter, digests.of(adapter.path) == adapter.sha256) for adapter in adapters]


def textfile_lines(found: list[tuple[Declared, bool]]) -> list[str]:
    """The verdicts in Prometheus' text format (nothing without adapters)."""
    if not found:
        return []
    lines = ["# HELP gpufleet_replica_adapter_staged Whether a LoRA adapter of a replica on this node is staged as"
             " declared (its weights' SHA-256).",
             "# TYPE gpufleet_replica_adapter_staged gauge"]
    lines += [f'gpufleet_replica_adapter_staged{{replica="{adapter.replica}",adapter="{adapter.name}"}} {int(ok)}'
              for adapter, ok in found]
    return lines
