"""What the records say of the fleet as planned now: each served model's measured ceiling per replica of each of its
shapes, its ceiling over the replicas it has, and how many replicas a target rate needs.

A model's replicas are matched to records of their own release, layout and GPU profile (their shape,
:func:`replica_shape`): a record through the routers of exactly the model's replicas' shapes gives a rate per
replica (its ceiling over the replicas it was measured with), shared among the shapes in proportion to their
one-replica records where each has one, else the same for each; failing that, each shape's record of one replica.
A model whose current release has none is given the newest record of an earlier release, named as such
(``gpufleet bench`` again after an upgrade: ``deploys/check.py`` names the release that lacks one).

A replica's router admission is sized from the record of its own release and shape where that record measured how
many requests one replica ran at once at its ceiling (:func:`measured_admission`): the plan's figure otherwise.

The rate per replica of each shape is what Prometheus multiplies by the replicas of that shape in service
(:mod:`gpufleet.monitoring.ceiling_rules`): the model's capacity follows a replica added, drained or lost.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, replace

from gpufleet.measure.records import Record, RecordKey, latest, layout_name
from gpufleet.plan.admission import measured
from gpufleet.plan.planner import FleetPlan, Replica

Shape = tuple[str, str]
"""A replica's layout (``tp1-pp2``) and GPU profile: what a record's rate per replica is a rate of."""


@dataclass(frozen=True)
class ShapeCeiling:
    """One shape of a model's replicas: the requests/s one replica of it serves within the objective, and how many
    of the model's planned replicas have it."""

    layout: str
    gpu_profile: str
    per_replica_rps: float
    replicas: int


@dataclass(frozen=True)
class ModelCapacity:
    """A served model's ceiling over its planned replicas (requests/s), each of its shapes' rate per replica, from
    which records, and whether those are of the release it runs (``current``)."""

    model: str
    release: str
    replicas: int
    ceiling_rps: float
    sources: tuple[Record, ...]
    current: bool
    shapes: tuple[ShapeCeiling, ...] = ()

    def replicas_for(self, target_rps: float) -> int:
        """Replicas of the model's average measured rate that ``target_rps`` needs."""
        per = self.ceiling_rps / self.replicas
        return math.ceil(target_rps / per) if per > 0 else 0


def replica_shape(replica: Replica) -> Shape:
    """The replica's layout and the GPU profile of its nodes (``probed`` where none is declared; nodes of several
    profiles joined by ``+``): the key its records and its ceiling in Prometheus share."""
    return layout_name(replica.tp, replica.pp, replica.dp), replica.gpu_profile


def _for_release(model: str, release: str, replicas: list[Replica],
                 newest: dict[RecordKey, Record]) -> tuple[tuple[ShapeCeiling, ...], tuple[Record, ...]] | None:
    counts = Counter(replica_shape(r) for r in replicas)
    singles = {shape: one for shape in counts
               if (one := newest.get(RecordKey(model, release, *shape, "replica"))) is not None
               and one.ceiling.rate}
    whole = RecordKey(model, release, "+".join(sorted({s[0] for s in counts})),
                      "+".join(sorted({p for s in counts for p in s[1].split("+")})), "routers")
    record = newest.get(whole)
    if record is not None and (per := record.per_replica_rps()) is not None:
        if len(counts) == 1 or len(singles) < len(counts):
            return tuple(ShapeCeiling(*shape, per, n) for shape, n in sorted(counts.items())), (record,)
        rates = {shape: float(one.ceiling.rate or 0.0) for shape, one in singles.items()}
        scale = per * len(replicas) / sum(rates[shape] * n for shape, n in counts.items())
        return (tuple(ShapeCeiling(*shape, rates[shape] * scale, n) for shape, n in sorted(counts.items())),
                (record, *(singles[shape] for shape in sorted(singles))))
    if len(singles) < len(counts):
        return None
    return (tuple(ShapeCeiling(*shape, float(singles[shape].ceiling.rate or 0.0), n)
                  for shape, n in sorted(counts.items())),
            tuple(singles[shape] for shape in sorted(singles)))


def _version_key(version: str) -> list[int]:
    return [int(part) if part.isdigit() else 0 for part in version.split(".")]


def model_capacities(replicas: list[Replica], records: list[Record]) -> dict[str, ModelCapacity]:
    """Each served model's capacity over ``replicas`` (those that start count), for the models some record covers."""
    newest = latest(records)
    by_model: dict[str, list[Replica]] = {}
    for replica in replicas:
        if replica.starts:
            by_model.setdefault(replica.served, []).append(replica)
    found: dict[str, ModelCapacity] = {}
    for model, served in sorted(by_model.items()):
        release = served[0].release
        if (now := _for_release(model, release, served, newest)) is not None:
            found[model] = _capacity(model, release, now, True)
            continue
        older = {k.release for k in newest if k.model == model and k.release != release}
        for earlier in sorted(older, key=_version_key, reverse=True):
            if (then := _for_release(model, earlier, served, newest)) is not None:
                found[model] = _capacity(model, earlier, then, False)
                break
    return found


def _capacity(model: str, release: str, measured: tuple[tuple[ShapeCeiling, ...], tuple[Record, ...]],
              current: bool) -> ModelCapacity:
    shapes, sources = measured
    return ModelCapacity(model, release, sum(s.replicas for s in shapes),
                         sum(s.per_replica_rps * s.replicas for s in shapes), sources, current, shapes)


def releases_without_bench(replicas: list[Replica], records: list[Record]) -> list[str]:
    """A line for each served model whose planned release has no record while an earlier release has one."""
    lines = []
    for model, cap in model_capacities(replicas, records).items():
        if not cap.current:
            running = next(r.release for r in replicas if r.served == model)
            lines.append(f"{json.dumps(model)}: vLLM {cap.release} has a measured ceiling ({cap.ceiling_rps:g}"
                         f" req/s), its successor {running} none: run gpufleet bench")
    return lines


def measured_admission(plan: FleetPlan, records: list[Record]) -> FleetPlan:
    """``plan`` with each replica's router admission from the newest record of its model and shape that measured
    its concurrency at the ceiling (:meth:`Record.concurrency_at_ceiling`): one replica benched alone first, else
    through the routers; of its own release, else of the newest other release, named as such (an upgrade keeps the
    figure the fleet was measured at until the new release is benched, rather than move every router's maxconn as
    the replicas change release); a replica without one keeps the plan's."""
    newest = latest(records)
    replicas = []
    for replica in plan.replicas:
        others = sorted({k.release for k in newest if k.model == replica.served and k.release != replica.release},
                        key=_version_key, reverse=True)
        found = next(((record, running, scope) for release in (replica.release, *others)
                      for scope in ("replica", "routers")
                      if (record := newest.get(RecordKey(replica.served, release, *replica_shape(replica), scope)))
                      is not None and (running := record.concurrency_at_ceiling()) is not None), None)
        if found is not None:
            record, running, scope = found
            source = (f"bench of {record.date[:10]}" + (" through the routers" if scope == "routers" else "")
                      + ("" if record.key.release == replica.release else
                         f" on vLLM {record.key.release}, not the release planned: bench again"))
            replica = replace(replica, admission=measured(replica.admission, running, source))
        replicas.append(replica)
    return replace(plan, replicas=replicas)
