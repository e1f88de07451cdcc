"""The plan's figures as Prometheus recording rules (``gpufleet-plan.yml``): what gpufleet's alert rules compare with.

- ``gpufleet:node_gpus_expected{node}``: the GPUs each host should report (its facts' GPUs; 0 for a host that
  serves nothing, such as a dedicated router);
- ``gpufleet:model_replicas_min{model}``: the fewest ready replicas each served model may have,
  ``ceil(alert_model_replicas_min_ratio x its planned replicas)``;
- ``gpufleet:replica_ranks_expected{model, replica}``: the ranks (nodes) each replica runs on;
- ``gpufleet:replica_shape{model, replica, layout, gpu_profile}``: 1 for each replica, with its shape (its layout and
  its nodes' GPU profile, :func:`gpufleet.measure.capacity.replica_shape`): the capacity rule counts each replica in
  service at its shape's ceiling per replica (``gpufleet:replica_ceiling_rps``, from ``gpufleet bench``:
  :mod:`gpufleet.monitoring.ceiling_rules`);
- ``gpufleet:model_prefix_routed{model}``: 1 for each served model whose pools route by prefix
  (``router_policy: prefix``), none for the others: only those alert when their prefix cache hit ratio collapses;
- ``gpufleet:replica_gpu_hour_cost{model, replica}``: what each replica's GPUs cost an hour (``gpu_hour_cost`` of
  its nodes' profile times its GPUs), for replicas whose profile has a cost: the cost of a million tokens is
  computed from it (``model:gpu_cost_per_million_tokens:5m``);
- ``gpufleet:model_slo_ttft_p99_seconds{model}`` and ``gpufleet:model_slo_itl_p99_seconds{model}``: each served
  model's objective (its pools' ``vllm_slo_ttft_p99_s`` and ``vllm_slo_itl_p99_s``, which the plan makes agree):
  the latency alerts compare its p99 with them.

Each is a constant, ``vector(N)`` with its labels; the file is written from the plan on every deploy. A replica
whose ``vllm_start`` is false is not meant to serve: it counts for no model and has no ranks expected.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from fractions import Fraction
from typing import Any

import yaml

from gpufleet.measure.capacity import replica_shape
from gpufleet.plan.planner import FleetPlan, Replica

GROUP = "gpufleet-plan"


def replicas_min(planned: int, ratio: float) -> int:
    """``ceil(ratio x planned)``, computed on the ratio as written (0.7 x 10 is 7, not 8)."""
    return math.ceil(Fraction(repr(ratio)) * planned)


def model_replicas(replicas: Iterable[Replica]) -> dict[str, int]:
    """Planned replicas per served model name (pools serving one name count together)."""
    return dict(Counter(replica.served for replica in replicas))


def _fact(record: str, value: float, labels: dict[str, str]) -> dict[str, Any]:
    return {"record": record, "expr": f"vector({value!r})", "labels": labels}


def _shape_fact(replica: Replica) -> dict[str, Any]:
    layout, profile = replica_shape(replica)
    return _fact("gpufleet:replica_shape", 1, {"model": replica.served, "replica": replica.name, "layout": layout,
                                               "gpu_profile": profile})


def hour_cost(replica: Replica, gpu_hour_cost: Mapping[str, float]) -> float | None:
    """What ``replica``'s GPUs cost an hour: its GPUs times its profile's cost of one (None: its profile has none,
    or its nodes have several)."""
    cost = gpu_hour_cost.get(replica.gpu_profile)
    return None if cost is None else cost * replica.tp * replica.pp * replica.dp


def plan_rules(node_gpus: Mapping[str, int], plan: FleetPlan, ratio: float, header: str,
               gpu_hour_cost: Mapping[str, float] | None = None) -> str:
    """The rule file's text: ``header`` (comment lines), then one rule per node, model and replica, sorted;
    ``gpu_hour_cost``: one GPU's cost an hour, by GPU profile."""
    replicas = sorted((r for r in plan.replicas if r.starts), key=lambda r: r.name)
    models = [plan.models[name] for name in sorted({r.served for r in replicas})]
    rules = [_fact("gpufleet:node_gpus_expected", count, {"node": node}) for node, count in sorted(node_gpus.items())]
    rules += [_fact("gpufleet:model_replicas_min", replicas_min(planned, ratio), {"model": model})
              for model, planned in sorted(model_replicas(replicas).items())]
    rules += [_fact("gpufleet:replica_ranks_expected", len(replica.roles),
                    {"model": replica.served, "replica": replica.name}) for replica in replicas]
    rules += [_shape_fact(replica) for replica in replicas]
    rules += [_fact("gpufleet:replica_gpu_hour_cost", cost, {"model": replica.served, "replica": replica.name})
              for replica in replicas if (cost := hour_cost(replica, gpu_hour_cost or {})) is not None]
    rules += [_fact("gpufleet:model_prefix_routed", 1, {"model": m.name}) for m in models if m.policy == "prefix"]
    rules += [_fact("gpufleet:model_slo_ttft_p99_seconds", m.ttft_p99_s, {"model": m.name}) for m in models]
    rules += [_fact("gpufleet:model_slo_itl_p99_seconds", m.itl_p99_s, {"model": m.name}) for m in models]
    return header + yaml.safe_dump({"groups": [{"name": GROUP, "rules": rules}]}, sort_keys=False, width=1000)
