"""The measurement kept: one record per model x release x layout x GPU profile (and whether it went through the
routers or to one replica), a JSON file each on every monitoring host, under :data:`RECORDS_DIR`.

A record holds the ramp (every step), the ceiling and what stopped it, the objective it was judged by, the
workload, the client and the date. A new bench of the same key replaces the record (the file is named by the key).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

from gpufleet.measure.ramp import Ceiling, Slo, Step, ceiling, ceiling_steps

RECORDS_DIR = "/var/lib/gpufleet/bench"
"""Where each monitoring host keeps the records (one line of JSON each, mode 0644: no secret is in one)."""

SCHEMA = 2
"""2: steps judged on vLLM's own p99s and on the requests answered (a record of 1 was judged on the client's figures:
bench again)."""


@dataclass(frozen=True)
class RecordKey:
    """What a ceiling is a ceiling of: the served model, the vLLM release, the replicas' layout (``tp2-pp1``:
    tensor and pipeline parallel sizes; data parallel ranks add ``-dpN``), the GPU profile of its nodes, and the
    scope: ``routers`` (every ready replica behind the routers) or ``replica`` (one replica reached directly)."""

    model: str
    release: str
    layout: str
    gpu_profile: str
    scope: str

    def file_name(self) -> str:
        """The record's file name: a digest of the key (model names may hold any character)."""
        digest = hashlib.sha256(json.dumps(self.__dict__, sort_keys=True).encode()).hexdigest()[:20]
        return f"{digest}.json"

    def line(self) -> str:
        """The key as people read it."""
        return f"{json.dumps(self.model)} vLLM {self.release} {self.layout} on {self.gpu_profile} ({self.scope})"


def layout_name(tp: int, pp: int, dp: int = 1) -> str:
    """``tp<T>-pp<P>`` (``-dp<D>`` with data parallel ranks)."""
    return f"tp{tp}-pp{pp}" + (f"-dp{dp}" if dp > 1 else "")


@dataclass(frozen=True)
class Record:
    """One bench: its key, how many replicas served it, the objective, each step, the workload and client, and
    when (ISO 8601, UTC)."""

    key: RecordKey
    replicas: int
    slo: Slo
    steps: list[Step]
    workload: dict[str, Any]
    client: str
    date: str
    step_s: float
    notes: list[str] = field(default_factory=list)

    @property
    def ceiling(self) -> Ceiling:
        return ceiling(self.steps, self.slo)

    def concurrency_at_ceiling(self) -> int | None:
        """The most requests one replica ran at once (vLLM's count) in the ceiling's step, where a failing step above
        it bounds the ceiling; None where no step failed (the load offered, not the replicas, bounded the count) or the
        count was not read."""
        best, lowest_fail = ceiling_steps(self.steps, self.slo)
        if best is None or lowest_fail is None or best.running_max is None or best.running_max < 1:
            return None
        return math.floor(best.running_max)

    def per_replica_rps(self) -> float | None:
        """The ceiling divided among the replicas that served it."""
        rate = self.ceiling.rate
        return None if rate is None else rate / max(1, self.replicas)

    def to_json(self) -> dict[str, Any]:
        found = self.ceiling
        return {"schema": SCHEMA, **self.key.__dict__, "replicas": self.replicas,
                "slo": {"ttft_p99_s": self.slo.ttft_p99_s, "itl_p99_s": self.slo.itl_p99_s},
                "ceiling_rps": found.rate, "ceiling_offered_rps": found.offered, "stopped_by": found.stopped_by,
                "steps": [step.to_json() for step in self.steps], "workload": self.workload,
                "client": self.client, "date": self.date, "step_s": self.step_s, "notes": self.notes}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Record:
        """A record from its JSON; ValueError (or KeyError, TypeError) for one that is not."""
        if doc.get("schema") == 1:
            raise ValueError("a record of schema 1 judged the client's latencies and the offered rate: bench again")
        if doc.get("schema") != SCHEMA:
            raise ValueError(f"expected a bench record of schema {SCHEMA}, found {doc.get('schema')!r}")
        key = RecordKey(*(str(doc[name]) for name in ("model", "release", "layout", "gpu_profile", "scope")))
        slo = Slo(float(doc["slo"]["ttft_p99_s"]), float(doc["slo"]["itl_p99_s"]))
        return cls(key, int(doc["replicas"]), slo, [Step.from_json(s) for s in doc["steps"]], dict(doc["workload"]),
                   str(doc["client"]), str(doc["date"]), float(doc["step_s"]), list(doc.get("notes", [])))


def parse_records(text: str) -> tuple[list[Record], list[str]]:
    """Records from lines of JSON (one record a line; blank lines skipped), and a line for each that is not one."""
    found: list[Record] = []
    bad: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            found.append(Record.from_json(json.loads(line)))
        except (ValueError, KeyError, TypeError) as exc:
            bad.append(f"line {number}: not a bench record ({type(exc).__name__}: {exc})")
    return found, bad


def latest(records: list[Record]) -> dict[RecordKey, Record]:
    """The newest record of each key."""
    found: dict[RecordKey, Record] = {}
    for record in sorted(records, key=lambda r: r.date):
        found[record.key] = record
    return found
