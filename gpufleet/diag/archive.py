"""The one archive ``gpufleet diag`` writes: each node's members, redacted (:mod:`gpufleet.diag.redact`), under
``nodes/<host>/``, and its series in Prometheus (:mod:`gpufleet.diag.series`) as ``series/<host>.json``; what the
failure-signature scan found in them (``findings.txt``); the plan; and ``index.json``,
which lists every member, what could not be read on each node and why, and how many secrets were replaced.

A node's archive is read as untrusted: regular files only, plain relative names, within its byte cap; a compressed
member is stored decompressed (so that its text is searched for secrets too) or left out.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import tarfile
import time
import zlib
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gpufleet.diag.collect import NodeRun
from gpufleet.diag.options import OutFile
from gpufleet.diag.redact import Secrets, redact
from gpufleet.diag.series import Snapshot
from gpufleet.diag.signatures import BOOTS, KERNEL, Finding, scan

SCHEMA = "gpufleet.diag/1"
MAX_MEMBERS = 20000
_NAME = re.compile(r"[A-Za-z0-9_.@:+-]+(?:/[A-Za-z0-9_.@:+-]+)*")
_JOURNAL = re.compile(r"journal/(?P<unit>[^/]+)\.log")
LOGS = {"kernel.log": KERNEL, "boots.log": BOOTS}  # a node's members read as a log of their own, not a unit's
_GZIP_MAGIC = b"\x1f\x8b"


@dataclass
class NodeEntry:
    """What the index says of one node."""

    seconds: float
    archive_bytes: int
    members: list[dict[str, Any]] = field(default_factory=list)
    unread: list[dict[str, str]] = field(default_factory=list)
    problem: str | None = None
    node_index: dict[str, Any] = field(default_factory=dict)


@dataclass
class Written:
    """The archive written: where, its size, the findings, the index."""

    path: Path
    bytes: int
    findings: list[Finding]
    index: dict[str, Any]


def _plain_name(name: str) -> bool:
    return bool(_NAME.fullmatch(name)) and ".." not in name.split("/")


def node_members(run: NodeRun, max_bytes: int) -> tuple[list[tuple[str, bytes]], list[dict[str, str]]]:
    """The members of a node's archive, decompressed where compressed, and what was left out and why."""
    members: list[tuple[str, bytes]] = []
    left_out: list[dict[str, str]] = []
    total = 0
    try:
        with tarfile.open(fileobj=io.BytesIO(run.archive), mode="r:gz") as tar:
            for n, info in enumerate(tar):
                if n >= MAX_MEMBERS:
                    left_out.append({"what": "the rest of its archive", "why": f"over {MAX_MEMBERS} members"})
                    break
                if not info.isfile() or not _plain_name(info.name):
                    left_out.append({"what": f"member {info.name[:100]!r}", "why": "not a plain file name"})
                    continue
                extracted = tar.extractfile(info)
                data = extracted.read(max_bytes - total + 1) if extracted is not None else b""
                name = info.name
                if data.startswith(_GZIP_MAGIC):
                    name = name.removesuffix(".gz")
                    try:
                        data = _gunzip(data, max_bytes - total + 1)
                    except (OSError, EOFError, zlib.error) as exc:
                        left_out.append({"what": info.name, "why": f"compressed and unreadable: {exc}"})
                        continue
                total += len(data)
                if total > max_bytes:
                    left_out.append({"what": info.name, "why": f"over the node's cap of {max_bytes:,} bytes"})
                    break
                members.append((name, data))
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
        left_out.append({"what": "its archive", "why": f"not a tar.gz: {' '.join(str(exc).split())}"})
    return members, left_out


def _gunzip(data: bytes, limit: int) -> bytes:
    with gzip.GzipFile(fileobj=io.BytesIO(data)) as opened:
        return opened.read(limit)


def _findings(host: str, members: list[tuple[str, bytes]]) -> list[Finding]:
    found: list[Finding] = []
    for name, data in members:
        unit = LOGS.get(name) or (m["unit"] if (m := _JOURNAL.fullmatch(name)) else None)
        if unit is not None:
            found += scan(host, unit, data.decode("utf-8", "replace").splitlines())
    return found


def _tar_add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o600, int(time.time())
    tar.addfile(info, io.BytesIO(data))


def write_archive(out: OutFile, runs: dict[str, NodeRun], secrets: Secrets, header: dict[str, Any],
                  max_bytes: int, plan: dict[str, Any] | None = None,
                  series: dict[str, Snapshot] | None = None) -> Written:
    """Write into ``out`` (made empty, 0600, by :func:`gpufleet.diag.options.out_path`; :class:`OutReplaced` when
    another file took its place since): every node's members and series redacted, the findings, the plan and the
    index."""
    counts: Counter[str] = Counter()
    findings: list[Finding] = []
    nodes: dict[str, NodeEntry] = {}
    kept: list[tuple[str, bytes]] = []
    for host, run in runs.items():
        entry = nodes[host] = NodeEntry(round(run.seconds, 3), len(run.archive), problem=run.problem)
        members, entry.unread = node_members(run, max_bytes) if run.archive else ([], [])
        clean: list[tuple[str, bytes]] = []
        for name, data in members:
            redacted, found = redact(data, secrets)
            counts.update(found)
            if redacted is None:
                entry.unread.append({"what": name, "why": "left out: a secret remained after redaction"})
                continue
            clean.append((name, redacted))
        for name, data in clean:
            if name == "index.json":
                entry.node_index = _json(data)
                entry.unread = [*entry.node_index.get("unread", []), *entry.unread]
            entry.members.append({"name": f"nodes/{host}/{name}", "bytes": len(data)})
        kept += [(f"nodes/{host}/{name}", data) for name, data in clean]
        findings += _findings(host, clean)
    for host, snap in (series or {}).items():
        entry = nodes.setdefault(host, NodeEntry(0.0, 0))
        redacted, found = redact(snap.data, secrets) if snap.data is not None else (None, Counter())
        counts.update(found)
        if redacted is None:
            why = snap.problem or "left out: a secret remained after redaction"
            entry.unread.append({"what": "its series in Prometheus", "why": why})
            continue
        entry.members.append({"name": f"series/{host}.json", "bytes": len(redacted)})
        kept.append((f"series/{host}.json", redacted))
    index = {"schema": SCHEMA, "created": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), **header,
             "findings": [asdict(f) for f in findings], "redacted": dict(sorted(counts.items())),
             "secrets_not_read": secrets.unread,
             "nodes": {host: {k: v for k, v in asdict(e).items() if k != "node_index"} | {
                 "node": {k: e.node_index.get(k) for k in ("since", "budget_s", "seconds", "bytes", "redacted")}}
                 for host, e in nodes.items()}}
    extra = [("findings.txt", "".join(f"{f.line()}\n" for f in findings).encode())]
    if plan is not None:
        extra.append(("plan.json", (json.dumps(plan, indent=1) + "\n").encode()))
    fd = out.open()
    try:
        with os.fdopen(fd, "wb") as raw, tarfile.open(fileobj=raw, mode="w:gz") as tar:
            for name, data in [("index.json", (json.dumps(index, indent=1) + "\n").encode()), *extra]:
                _tar_add(tar, name, redact(data, secrets)[0] or b"")  # what the controller wrote, searched too
            for name, data in kept:
                _tar_add(tar, name, data)
    except BaseException:
        out.remove()
        raise
    return Written(out.path, out.path.stat().st_size, findings, index)


def _json(data: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}
