"""Findings about a node and what each one does (a node tool, standard library only; the controller checks the
catalog with the same rules).

The catalog (``gpufleet/data/findings.yml``, rendered to JSON on each node) maps every Xid code and every check of
gpufleet's own to an action: ``quarantine``, ``suspect`` or ``record``. Xids are read from the kernel log as the
driver writes them::

    NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus.

and grouped into bursts: the lines of one code on one GPU count once until ``quiet_s`` seconds pass without another,
as NVIDIA's fleet tooling groups them. A burst acts on its first line (a quarantine must not wait for the silence);
its later lines only add to its count.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

ACTIONS = ("quarantine", "suspect", "record")
SEVERITY = {"record": 0, "suspect": 1, "quarantine": 2}
XID_LINE = re.compile(r"NVRM: Xid \(PCI:(?P<pci>[0-9A-Fa-f]{4}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.[0-7])?)\): "
                      r"(?P<code>\d{1,4}),\s*(?P<text>.*)$")
BURST_QUIET_S = 180.0
# Repeated watchdog stalls (decided: NVIDIA names no figure): a replica watchdog that restarts a wedged engine on the
# node 3 times within an hour makes the node suspect; one stall is the process's, three point at the GPU or the host.
STALL_LIMIT = 3
STALL_WINDOW_S = 3600.0


# Trends over the GPU watch's samples (decided: NVIDIA names no figure): a condition a GPU shows in at least half of
# the samples of the last 10 minutes, and at least 5 samples (the watch samples every 30 s), is one finding, once,
# until it no longer holds. Power capping (sw_power_cap) is a GPU at its power limit, as it is under full load: not a
# fault; the slowdowns below are.
TREND_WINDOW_S = 600.0
TREND_SHARE = 0.5
TREND_MIN_SAMPLES = 5
THROTTLE_EVENTS = frozenset({"hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"})


_BUCKET = re.compile(r"[A-Z][A-Z0-9_]{1,39}")  # NVIDIA's resolution buckets: RESET_GPU, RESTART_BM, ...
_CHECK = re.compile(r"[a-z][a-z0-9_]{0,39}")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _entry_problems(name: str, entry: Any) -> list[str]:
    """The problems of one entry: an action of :data:`ACTIONS`, an optional name (printable text) and bucket."""
    if not isinstance(entry, dict) or "action" not in entry:
        return [f"{name}: expected a mapping with an action, found {_shown(entry)}"]
    problems = []
    if entry["action"] not in ACTIONS:
        problems.append(f"{name}.action: expected one of {', '.join(ACTIONS)}, found {_shown(entry['action'])}")
    if "name" in entry and not (isinstance(entry["name"], str) and 0 < len(entry["name"]) <= 200
                                and entry["name"].isprintable() and entry["name"].strip()):
        problems.append(f"{name}.name: expected 1 to 200 printable characters, not all blank, found"
                        f" {_shown(entry['name'])}")
    if "bucket" in entry and not (isinstance(entry["bucket"], str) and _BUCKET.fullmatch(entry["bucket"])):
        problems.append(f"{name}.bucket: expected a resolution bucket of NVIDIA's Xid catalog (RESET_GPU,"
                        f" RESTART_APP, ...), found {_shown(entry['bucket'])}")
    extra = sorted(set(entry) - {"name", "bucket", "action"}, key=str)
    if extra:
        problems.append(f"{name}: expected the keys name, bucket, action, found {_shown(extra[0])}")
    return problems


def catalog_problems(doc: Any, where: str = "findings", checks: frozenset[str] | None = None) -> list[str]:
    """Every problem of a catalog, one line each, naming the entry. With ``checks`` (the repository catalog's check
    names) ``doc`` is an override (``node_findings``): no ``source``, and only checks gpufleet makes."""
    keys = ("xid", "checks") if checks is not None else ("source", "xid", "checks")
    if not isinstance(doc, dict):
        return [f"{where}: expected a mapping with {' and '.join(keys[-2:])}, found {_shown(doc)}"]
    problems = [f"{where}: expected the keys {', '.join(keys)}, found {_shown(key)}" for key in doc if key not in keys]
    if "source" in doc and not (isinstance(doc["source"], str) and doc["source"].isprintable()):
        problems.append(f"{where}.source: expected printable text, found {_shown(doc['source'])}")
    for part in ("xid", "checks"):
        entries = doc.get(part, {})
        if not isinstance(entries, dict):
            problems.append(f"{where}.{part}: expected a mapping, found {_shown(entries)}")
            continue
        codes: dict[int, Any] = {}
        for key, entry in entries.items():
            name = f"{where}.{part}.{key}"
            if part == "xid":
                code = str(key) if isinstance(key, int) and not isinstance(key, bool) else key
                # one spelling per code: 79, not "079" beside 79
                if not (isinstance(code, str) and code.isascii() and code.isdigit() and code == str(int(code))
                        and 0 < int(code) < 10000):
                    problems.append(f"{where}.{part}: expected Xid codes (1 to 9999), found {_shown(key)}")
                    continue
                if int(code) in codes:
                    problems.append(f"{where}.{part}: expected each Xid code once, found {code} twice"
                                    f" ({_shown(codes[int(code)])} and {_shown(key)})")
                    continue
                codes[int(code)] = key
            elif not (isinstance(key, str) and _CHECK.fullmatch(key)) or (checks is not None and key not in checks):
                known = f" ({', '.join(sorted(checks))})" if checks is not None else ""
                problems.append(f"{where}.{part}: expected a check gpufleet makes{known}, found {_shown(key)}")
                continue
            problems += _entry_problems(name, entry)
    return problems


def merged(catalog: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """The catalog with an override's entries in place of its own (an override entry replaces one whole)."""
    out = {"source": catalog.get("source", ""), "xid": {int(k): v for k, v in catalog.get("xid", {}).items()},
           "checks": dict(catalog.get("checks", {}))}
    out["xid"].update({int(k): v for k, v in override.get("xid", {}).items()})  # 79 and "79" are one code
    out["checks"].update(override.get("checks", {}))
    return out


@dataclass(frozen=True)
class Xid:
    """One Xid line: the GPU's PCI address, the code and the driver's words."""

    pci: str
    code: int
    text: str


def parse_xid(line: str) -> Xid | None:
    match = XID_LINE.search(line)
    if match is None:
        return None
    return Xid(match["pci"].lower(), int(match["code"]), match["text"].strip()[:300])


@dataclass(frozen=True)
class Finding:
    """What was found, on which GPU, what the catalog says to do, and the evidence."""

    kind: str  # "xid" or a check's name
    action: str
    gpu: str | None  # the PCI address, where the finding names one GPU
    code: int | None = None
    evidence: dict[str, Any] = field(default_factory=dict)


def action_of(catalog: dict[str, Any], kind: str, code: int | None = None) -> str:
    """The catalog's action for a finding; an Xid the catalog does not list is recorded."""
    if kind == "xid":
        entry = catalog.get("xid", {}).get(code) or catalog.get("xid", {}).get(str(code))
    else:
        entry = catalog.get("checks", {}).get(kind)
    return str(entry["action"]) if entry else "record"


@dataclass
class Bursts:
    """Xid lines grouped into bursts, per GPU and code: each burst yields one finding, on its first line."""

    catalog: dict[str, Any]
    quiet_s: float = BURST_QUIET_S
    open: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)

    def see(self, xid: Xid, at: float) -> Finding | None:
        """The finding this line starts, or None when it continues a burst (whose count it raises)."""
        key = (xid.pci, xid.code)
        burst = self.open.get(key)
        if burst is not None and at - burst["last"] < self.quiet_s:
            burst["last"] = at
            burst["lines"] += 1
            return None
        self.open[key] = {"first": at, "last": at, "lines": 1}
        entry = self.catalog.get("xid", {}).get(xid.code) or self.catalog.get("xid", {}).get(str(xid.code)) or {}
        evidence = {"line": xid.text, "name": entry.get("name", "not in the catalog"), "bucket": entry.get("bucket")}
        return Finding("xid", action_of(self.catalog, "xid", xid.code), xid.pci, xid.code, evidence)

    def lines_in(self, xid: Xid) -> int:
        burst = self.open.get((xid.pci, xid.code))
        return int(burst["lines"]) if burst else 0


@dataclass
class Stalls:
    """The replica watchdogs' restarts on the node: ``limit`` of them within ``window_s`` are one finding,
    ``watchdog_stalls``; restarts before a finding do not count towards the next."""

    catalog: dict[str, Any]
    limit: int = STALL_LIMIT
    window_s: float = STALL_WINDOW_S
    last: float | None = None

    def see(self, restarts: list[tuple[float, str]], now: float) -> Finding | None:
        """The finding the restarts seen so far make (each: when, Unix time, and the watchdog's line), or None."""
        recent = [(at, line) for at, line in restarts
                  if now - at <= self.window_s and (self.last is None or at > self.last)]
        if len(recent) < self.limit:
            return None
        self.last = max(at for at, _ in recent)
        return Finding("watchdog_stalls", action_of(self.catalog, "watchdog_stalls"), None, None,
                       {"restarts": [line for _, line in recent[-self.limit:]], "window_s": self.window_s})


def _count(value: Any) -> int | None:
    """A whole number as NVML gives it (not a bool, not a float), or None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and -1 < value < 2**31 else None


def sample_conditions(gpu: dict[str, Any]) -> set[str]:
    """The trend findings one GPU's sample shows (health_rules.link_sample): ``throttle_trend`` (busy, its clocks
    held down by a thermal or power slowdown), ``pcie_downgrade`` (its link below its maximum width, or below its
    maximum generation while busy: an idle GPU lowers it to save power), ``nvlink_down`` (an NVLink inactive). What
    is not as NVML gives it shows nothing."""
    raw = gpu.get("events")
    events: list[str] | None = raw if isinstance(raw, list) and all(isinstance(e, str) for e in raw) else None
    busy = events is not None and "gpu_idle" not in events
    found = set()
    if events is not None and busy and THROTTLE_EVENTS & set(events):
        found.add("throttle_trend")
    link = gpu.get("pcie")
    pcie: dict[str, Any] = link if isinstance(link, dict) else {}
    width, width_max, gen, gen_max = (_count(pcie.get(k)) for k in ("width_current", "width_max", "gen_current",
                                                                      "gen_max"))
    if (width is not None and width_max is not None and width < width_max) or (
            busy and gen is not None and gen_max is not None and gen < gen_max):
        found.add("pcie_downgrade")
    down = _count(gpu.get("nvlinks_down"))
    if down is not None and down > 0:
        found.add("nvlink_down")
    return found


@dataclass
class Trends:
    """The GPU watch's samples on the node: a condition of :func:`sample_conditions` that a GPU shows in ``share``
    of the samples within ``window_s`` (``min_samples`` at least) is one finding, until it no longer holds."""

    catalog: dict[str, Any]
    window_s: float = TREND_WINDOW_S
    share: float = TREND_SHARE
    min_samples: int = TREND_MIN_SAMPLES
    holding: set[tuple[str, str]] = field(default_factory=set)  # (kind, GPU) found and holding since

    def see(self, samples: list[Any], now: float) -> list[Finding]:
        """The new findings the samples make (each: ``{"at": Unix time, "gpus": [...]}``)."""
        taken: dict[str, int] = {}
        shown: dict[tuple[str, str], int] = {}
        seen: set[tuple[float, str]] = set()  # a GPU counts once per sample time: a repeated reading is one
        for sample in samples if isinstance(samples, list) else []:
            at = sample.get("at") if isinstance(sample, dict) else None
            if not isinstance(at, (int, float)) or isinstance(at, bool) or not -1e12 < at < 1e12 \
                    or not 0 <= now - at <= self.window_s or not isinstance(sample.get("gpus"), list):
                continue
            for gpu in sample["gpus"]:
                name = gpu.get("pci") if isinstance(gpu, dict) else None
                if not isinstance(name, str) or not 0 < len(name) <= 40 or (at, name) in seen:
                    continue
                seen.add((at, name))
                taken[name] = taken.get(name, 0) + 1
                for kind in sample_conditions(gpu):
                    shown[(kind, name)] = shown.get((kind, name), 0) + 1
        holding = {key for key, count in shown.items()
                   if taken[key[1]] >= self.min_samples and count >= self.share * taken[key[1]]}
        found = [Finding(kind, action_of(self.catalog, kind), gpu, None,
                         {"samples": taken[gpu], "showing": shown[(kind, gpu)], "window_s": self.window_s})
                 for kind, gpu in sorted(holding - self.holding)]
        self.holding = holding
        return found


def worst(findings: list[Finding]) -> str:
    """The strongest action among findings (``record`` when there are none)."""
    return max((f.action for f in findings), key=SEVERITY.__getitem__, default="record")
