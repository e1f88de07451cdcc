"""How long a replica takes to start, and the start record of each release on each shape.

The deploy's readiness wait times every start it waits for (``gpufleet/node/vllm_ready.py``: seconds from the unit's
main process start to each of :data:`START_PHASES`) and keeps the last one on the replica's first node, in its
``observed.json`` and for node_exporter (``gpufleet_replica_start_seconds``). A start is keyed as a bench record is,
less the scope: the served model, the vLLM release, the layout and the GPU profile of its nodes (:class:`StartKey`).

The record of a key is the fastest start of it the deploys have measured, from its process start to its first
completion: each monitoring host keeps it in :data:`START_RECORDS_DIR` (a JSON file per key, named by the key, beside
the bench records), and serves the records of the keys the plan serves to node_exporter's textfile collector
(``gpufleet_replica_start_record_seconds``), what the alert ReplicaStartSlow compares each replica's start with.
A faster start replaces its key's record; no other does, so a rerun that restarted nothing writes nothing.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from gpufleet.measure.records import layout_name
from gpufleet.node.vllm_ready import START_PHASES, prometheus_labels
from gpufleet.plan.planner import Replica

START_RECORDS_DIR = "/var/lib/gpufleet/starts"
"""Where each monitoring host keeps the start records (one line of JSON each, mode 0644: no secret is in one)."""

SCHEMA = 1
TOTAL = "first_completion"
"""The phase a start is judged by: its first completion, when it serves."""
RECORD_METRIC = "gpufleet_replica_start_record_seconds"
_SHOWN = {"weights_loaded": "weights", "kv_cache_sized": "KV cache", "ready": "/health"}


@dataclass(frozen=True, order=True)
class StartKey:
    """What a start record is a record of: the served model, the vLLM release, the replicas' layout (``tp2-pp1``)
    and the GPU profile of their nodes (``probed`` where none is declared; ``+`` between several)."""

    model: str
    release: str
    layout: str
    gpu_profile: str

    def labels(self) -> dict[str, str]:
        return {"model": self.model, "release": self.release, "layout": self.layout, "gpu_profile": self.gpu_profile}

    def file_name(self) -> str:
        """The record's file name: a digest of the key (model names may hold any character)."""
        return hashlib.sha256(json.dumps(self.labels(), sort_keys=True).encode()).hexdigest()[:20] + ".json"


def start_key(replica: Replica) -> StartKey:
    """The key of ``replica``'s starts: its model, release, layout and GPU profile."""
    return StartKey(replica.served, replica.release, layout_name(replica.tp, replica.pp, replica.dp),
                    replica.gpu_profile)


def _seconds(value: Any) -> float | None:
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) and value >= 0 else None


@dataclass(frozen=True)
class Start:
    """One start of a replica on its first node (``node``): when its process started (Unix time) and the seconds from
    then to each phase (None: not seen)."""

    key: StartKey
    replica: str
    node: str
    started: float
    phases: dict[str, float | None]

    @property
    def total(self) -> float | None:
        """Seconds from its process start to its first completion."""
        return self.phases.get(TOTAL)

    def line(self) -> str:
        """``first completion 61.2 s after its process started (weights 20.1 s, KV cache 40.3 s, /health 60.5 s)``."""
        shown = ", ".join(f"{_SHOWN[phase]} {'-' if value is None else f'{value:.1f} s'}"
                          for phase in START_PHASES if phase != TOTAL for value in [self.phases.get(phase)])
        return f"first completion {self.total:.1f} s after its process started ({shown})"

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, **self.key.labels(), "replica": self.replica, "node": self.node,
                "started": self.started,
                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started)),
                "phases": {phase: self.phases.get(phase) for phase in START_PHASES}}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Start:
        """A start from its JSON (:meth:`to_json`); ValueError (or KeyError, TypeError) for one that is not one, or
        one without a first completion."""
        if doc.get("schema") != SCHEMA:
            raise ValueError(f"expected a start record of schema {SCHEMA}, found {doc.get('schema')!r}")
        key = StartKey(*(str(doc[name]) for name in ("model", "release", "layout", "gpu_profile")))
        started = _seconds(doc["started"])
        phases = {phase: _seconds(doc["phases"].get(phase)) for phase in START_PHASES}
        if started is None or phases[TOTAL] is None:
            raise ValueError("expected a start with its process start and first completion")
        return cls(key, str(doc["replica"]), str(doc["node"]), started, phases)


def measured_start(observed: str | None, node: str) -> Start | None:
    """The start the readiness wait measured on ``node``, from the text of its ``observed.json`` (its ``start``:
    ``labels``, ``started``, ``phases``); None without one, or without its process start or first completion."""
    try:
        doc = json.loads(observed or "")
        start = doc["start"]
        labels = start["labels"]
        return Start.from_json({"schema": SCHEMA, **{name: labels[name] for name in (
            "model", "release", "layout", "gpu_profile", "replica")}, "node": node, "started": start["started"],
            "phases": dict(start["phases"])})
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def read_record(text: str | None) -> Start | None:
    """A start record from its file's text; None for a missing file or one that is not a record."""
    try:
        return Start.from_json(json.loads(text or ""))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def record_text(record: Start) -> str:
    """A record's file: one line of JSON."""
    return json.dumps(record.to_json(), sort_keys=True) + "\n"


def fastest(record: Start | None, seen: Iterable[Start]) -> Start | None:
    """The record a key keeps: the fastest of its ``record`` and the starts ``seen`` of it (the record on a tie)."""
    found = record
    for start in seen:
        if start.total is not None and (found is None or found.total is None or start.total < found.total):
            found = start
    return found


def records_textfile(records: Iterable[Start]) -> str:
    """The records (each phase known) for node_exporter's textfile collector, by key."""
    lines = [f"# HELP {RECORD_METRIC} The fastest start the deploys measured of each release on each shape: seconds"
             " from its process start to each phase (gpufleet.measure.starts).", f"# TYPE {RECORD_METRIC} gauge"]
    for record in sorted(records, key=lambda r: r.key):
        lines += [f"{RECORD_METRIC}{{{prometheus_labels({**record.key.labels(), 'phase': phase})}}} {value!r}"
                  for phase in START_PHASES if (value := record.phases.get(phase)) is not None]
    return "\n".join(lines) + "\n"
