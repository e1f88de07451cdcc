"""What the records say of the fleet as planned now: each served model's measured ceiling for the replicas it has,
and how many replicas a target rate needs.

A model's replicas are matched to records of their own release, layout and GPU profile: a record through the
routers of exactly the model's replicas' shapes gives a rate per replica (its ceiling over the replicas it was
measured with); failing that, each shape's record of one replica. A model whose current release has none is given
the newest record of an earlier release, named as such (``gpufleet bench`` again after an upgrade: ``deploys/check.py``
names the release that lacks one).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass

from gpufleet.bench.records import Record, RecordKey, latest, layout_name
from gpufleet.config.schema import HostConfig
from gpufleet.plan.planner import Replica


@dataclass(frozen=True)
class ModelCapacity:
    """A served model's ceiling over its planned replicas (requests/s), from which records, and whether those are of
    the release it runs (``current``)."""

    model: str
    release: str
    replicas: int
    ceiling_rps: float
    sources: tuple[Record, ...]
    current: bool

    def replicas_for(self, target_rps: float) -> int:
        """Replicas of the model's average measured rate that ``target_rps`` needs."""
        per = self.ceiling_rps / self.replicas
        return math.ceil(target_rps / per) if per > 0 else 0


def _shape(replica: Replica, configs: Mapping[str, HostConfig]) -> tuple[str, str]:
    return layout_name(replica.tp, replica.pp, replica.dp), "+".join(
        sorted({str(configs[n].gpu_profile or "probed") for n in replica.nodes}))


def _for_release(model: str, release: str, replicas: list[Replica], configs: Mapping[str, HostConfig],
                 newest: dict[RecordKey, Record]) -> tuple[float, tuple[Record, ...]] | None:
    shapes = [_shape(r, configs) for r in replicas]
    whole = RecordKey(model, release, "+".join(sorted({s[0] for s in shapes})),
                      "+".join(sorted({p for s in shapes for p in s[1].split("+")})), "routers")
    record = newest.get(whole)
    if record is not None and (per := record.per_replica_rps()) is not None:
        return per * len(replicas), (record,)
    total, used = 0.0, []
    for layout, profile in shapes:
        one = newest.get(RecordKey(model, release, layout, profile, "replica"))
        if one is None or one.ceiling.rate is None:
            return None
        total += one.ceiling.rate
        used.append(one)
    return total, tuple({record.key: record for record in used}.values())


def _version_key(version: str) -> list[int]:
    return [int(part) if part.isdigit() else 0 for part in version.split(".")]


def model_capacities(replicas: list[Replica], configs: Mapping[str, HostConfig],
                     records: list[Record]) -> dict[str, ModelCapacity]:
    """Each served model's capacity, for the models some record covers."""
    newest = latest(records)
    by_model: dict[str, list[Replica]] = {}
    for replica in replicas:
        cfg = configs[replica.nodes[0]]
        if cfg.vllm_start:
            by_model.setdefault(cfg.served_model_name(), []).append(replica)
    found: dict[str, ModelCapacity] = {}
    for model, served in sorted(by_model.items()):
        release = configs[served[0].nodes[0]].vllm_version
        if (now := _for_release(model, release, served, configs, newest)) is not None:
            found[model] = ModelCapacity(model, release, len(served), now[0], now[1], True)
            continue
        older = {k.release for k in newest if k.model == model and k.release != release}
        for earlier in sorted(older, key=_version_key, reverse=True):
            if (then := _for_release(model, earlier, served, configs, newest)) is not None:
                found[model] = ModelCapacity(model, earlier, len(served), then[0], then[1], False)
                break
    return found


def releases_without_bench(replicas: list[Replica], configs: Mapping[str, HostConfig],
                           records: list[Record]) -> list[str]:
    """A line for each served model whose planned release has no record while an earlier release has one."""
    lines = []
    for model, cap in model_capacities(replicas, configs, records).items():
        if not cap.current:
            running = next(configs[r.nodes[0]].vllm_version for r in replicas
                           if configs[r.nodes[0]].served_model_name() == model)
            lines.append(f"{json.dumps(model)}: vLLM {cap.release} has a measured ceiling ({cap.ceiling_rps:g}"
                         f" req/s), its successor {running} none: run gpufleet bench")
    return lines
