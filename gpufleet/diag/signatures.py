"""The failure-signature catalog (``gpufleet/data/failure_signatures.yml``) and what it finds in a node's collected
text: each signature's patterns, read in the journals of the units it names (or in the kernel log), give one finding
per signature, node and unit, with its first line, when it was first seen, how many lines matched, and the runbook
section to read (``docs/guide/when-things-fail.md``, the heading named by the signature's id).

Xid lines of the kernel log are read with the node tools' own pattern (:data:`gpufleet.node.findings.XID_LINE`) and
named from the Xid catalog (``gpufleet/data/findings.yml``): one finding per code and GPU, with NVIDIA's resolution
bucket and what gpufleet does with it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from importlib.resources import files
from typing import Any

import yaml

from gpufleet.config.settings.node_lifecycle import repository_catalog
from gpufleet.monitoring.alert_rules import RUNBOOK
from gpufleet.node.findings import XID_LINE

CATALOG = "data/failure_signatures.yml"
KERNEL = "kernel"
"""The name a signature's ``units`` gives the kernel log."""
BOOTS = "boots"
"""The name a signature's ``units`` gives the node's boots (each boot of the window, and how the one before ended)."""
XID_RUNBOOK = "xid"
"""The runbook section of every Xid finding."""
_KEYS = {"finding", "units", "patterns", "source"}
_ID = re.compile(r"[a-z][a-z0-9_]{0,47}")
_STAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:[.,]\d+)?(?:[+-]\d\d:?\d\d|Z)?")


class CatalogError(ValueError):
    """The catalog breaks its own rules (a bug in the repository's file): one line naming the entry."""


@dataclass(frozen=True)
class Signature:
    """One entry of the catalog: its id (also its runbook section), finding, where it is read and its patterns."""

    id: str
    finding: str
    units: tuple[str, ...]
    patterns: tuple[re.Pattern[str], ...]
    source: str

    def reads(self, unit: str) -> bool:
        """Whether this signature is read in ``unit``'s journal (a unit name, or :data:`KERNEL`)."""
        return any(unit == prefix if prefix in (KERNEL, BOOTS) else unit.startswith(prefix) for prefix in self.units)


@dataclass(frozen=True)
class Finding:
    """What a signature (or an Xid code) found on a node, in one unit's journal or the kernel log."""

    signature: str
    node: str
    unit: str
    finding: str
    runbook: str
    first_line: str
    first_seen: str | None
    count: int

    def line(self) -> str:
        since = f" since {self.first_seen}" if self.first_seen else ""
        times = f", {self.count} lines" if self.count > 1 else ""
        return f"{self.node}: {self.finding} ({self.unit}{since}{times}); read {RUNBOOK}#{self.runbook}"


def parse_catalog(doc: Any) -> tuple[Signature, ...]:
    """The catalog's signatures; :class:`CatalogError` on an unknown or missing key, a bad id or a bad pattern."""
    entries = doc.get("signatures") if isinstance(doc, dict) and set(doc) == {"signatures"} else None
    if not isinstance(entries, dict) or not entries:
        raise CatalogError(f"{CATALOG}: expected one key, signatures, mapping ids to entries")
    found = []
    for name, entry in entries.items():
        where = f"{CATALOG}: signatures.{name}"
        if not isinstance(name, str) or not _ID.fullmatch(name):
            raise CatalogError(f"{where}: expected an id of lower-case letters, digits and _")
        if not isinstance(entry, dict) or set(entry) != _KEYS:
            shown = ", ".join(sorted(map(str, entry))) if isinstance(entry, dict) else type(entry).__name__
            raise CatalogError(f"{where}: expected the keys {', '.join(sorted(_KEYS))}, found {shown}")
        lists = {key: entry[key] for key in ("units", "patterns")}
        for key, values in lists.items():
            if not isinstance(values, list) or not values or not all(isinstance(v, str) and v for v in values):
                raise CatalogError(f"{where}.{key}: expected a list of non-empty strings")
        if not all(isinstance(entry[key], str) and entry[key].strip() for key in ("finding", "source")):
            raise CatalogError(f"{where}: expected finding and source to be non-empty strings")
        try:
            patterns = tuple(re.compile(p) for p in entry["patterns"])
        except re.error as exc:
            raise CatalogError(f"{where}.patterns: {exc}") from None
        found.append(Signature(name, entry["finding"], tuple(entry["units"]), patterns, entry["source"]))
    return tuple(found)


@cache
def catalog() -> tuple[Signature, ...]:
    """The repository's catalog."""
    return parse_catalog(yaml.safe_load(files("gpufleet").joinpath(CATALOG).read_text()))


def _stamp(line: str) -> str | None:
    """The time a journal line (``journalctl -o short-iso``) or kernel log line (``dmesg --time-format iso``)
    starts with, as written; None when it starts with none."""
    match = _STAMP.match(line)
    return match.group(0) if match else None


def scan(node: str, unit: str, lines: Iterable[str]) -> list[Finding]:
    """The findings in ``unit``'s journal (or the kernel log, :data:`KERNEL`) of ``node``, in catalog order; Xid
    findings after them, in the order their codes first appeared."""
    chosen = [s for s in catalog() if s.reads(unit)]
    first: dict[str, str] = {}
    counts: dict[str, int] = {}
    xids: dict[tuple[int, str], list[str]] = {}
    for raw in lines:
        line = raw.rstrip("\n")
        for signature in chosen:
            if any(p.search(line) for p in signature.patterns):
                first.setdefault(signature.id, line)
                counts[signature.id] = counts.get(signature.id, 0) + 1
        if unit == KERNEL and (xid := XID_LINE.search(line)) is not None:
            xids.setdefault((int(xid["code"]), xid["pci"]), []).append(line)
    found = [Finding(s.id, node, unit, s.finding, s.id, first[s.id], _stamp(first[s.id]), counts[s.id])
             for s in chosen if s.id in first]
    codes = repository_catalog()["xid"]
    for (code, pci), seen in xids.items():
        entry = codes.get(code)
        named = (f"Xid {code} on the GPU at PCI {pci}: {entry['name']} (NVIDIA's bucket {entry['bucket']};"
                 f" gpufleet: {entry['action']})" if entry else
                 f"Xid {code} on the GPU at PCI {pci}: not in the Xid catalog (gpufleet: record)")
        found.append(Finding(f"xid_{code}", node, unit, named, XID_RUNBOOK, seen[0], _stamp(seen[0]), len(seen)))
    return found
