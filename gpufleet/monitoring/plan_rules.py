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
- ``gpufleet:model_slo_ttft_p99_seconds{model}`` and ``gpufleet:model_slo_itl_p99_seconds{model}``: each served
  model's objective (its pools' ``vllm_slo_ttft_p99_s`` and ``vllm_slo_itl_p99_s``, which the plan makes agree):
  the latency alerts compare its p99 with them.

Each is a constant, ``vector(N)`` with its labels; the file is written from the plan on every deploy. A replica
whose ``vllm_start`` is false is not meant to serve: it counts for no model and has no ranks expected.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from fractions import Fraction
from typing import Any

import yaml

from gpufleet.config.schema import HostConfig
from gpufleet.measure.capacity import replica_shape
from gpufleet.plan.planner import Replica

GROUP = "gpufleet-plan"


def replicas_min(planned: int, ratio: float) -> int:
    """``ceil(ratio x planned)``, computed on the ratio as written (0.7 x 10 is 7, not 8)."""
    return math.ceil(Fraction(repr(ratio)) * planned)


def replica_config(replica: Replica, configs: Mapping[str, HostConfig]) -> HostConfig:
    """The configuration of the pool that serves ``replica`` (its first node's)."""
    return configs[replica.roles[0].host]


def model_replicas(replicas: Iterable[Replica], configs: Mapping[str, HostConfig]) -> dict[str, int]:
    """Planned replicas per served model name (pools serving one name count together)."""
    found: dict[str, int] = {}
    for replica in replicas:
        model = replica_config(replica, configs).served_model_name()
        found[model] = found.get(model, 0) + 1
    return found


def prefix_routed_models(replicas: Iterable[Replica], configs: Mapping[str, HostConfig]) -> list[str]:
    """The served model names of the replicas whose pool routes by prefix (``router_policy: prefix``), sorted."""
    return sorted({cfg.served_model_name() for cfg in (replica_config(r, configs) for r in replicas)
                   if cfg.router_policy == "prefix"})


def model_objectives(replicas: Iterable[Replica], configs: Mapping[str, HostConfig]) -> dict[str, HostConfig]:
    """The configuration of each served model's first replica's pool, by model name: its objectives (pools serving
    one name have the same, see ``gpufleet.plan.planner.MODEL_WIDE``)."""
    found: dict[str, HostConfig] = {}
    for replica in replicas:
        cfg = replica_config(replica, configs)
        found.setdefault(cfg.served_model_name(), cfg)
    return found


def _fact(record: str, value: float, labels: dict[str, str]) -> dict[str, Any]:
    return {"record": record, "expr": f"vector({value!r})", "labels": labels}


def _shape_fact(replica: Replica, configs: Mapping[str, HostConfig]) -> dict[str, Any]:
    layout, profile = replica_shape(replica, configs)
    return _fact("gpufleet:replica_shape", 1, {"model": replica_config(replica, configs).served_model_name(),
                                               "replica": replica.name, "layout": layout, "gpu_profile": profile})


def plan_rules(node_gpus: Mapping[str, int], replicas: list[Replica], configs: Mapping[str, HostConfig],
               ratio: float, header: str) -> str:
    """The rule file's text: ``header`` (comment lines), then one rule per node, model and replica, sorted."""
    replicas = [r for r in replicas if replica_config(r, configs).vllm_start]
    rules = [_fact("gpufleet:node_gpus_expected", count, {"node": node}) for node, count in sorted(node_gpus.items())]
    rules += [_fact("gpufleet:model_replicas_min", replicas_min(planned, ratio), {"model": model})
              for model, planned in sorted(model_replicas(replicas, configs).items())]
    rules += [_fact("gpufleet:replica_ranks_expected", len(replica.roles),
                    {"model": replica_config(replica, configs).served_model_name(), "replica": replica.name})
              for replica in sorted(replicas, key=lambda r: r.name)]
    rules += [_shape_fact(replica, configs) for replica in sorted(replicas, key=lambda r: r.name)]
    rules += [_fact("gpufleet:model_prefix_routed", 1, {"model": model})
              for model in prefix_routed_models(replicas, configs)]
    objectives = sorted(model_objectives(replicas, configs).items())
    rules += [_fact("gpufleet:model_slo_ttft_p99_seconds", cfg.vllm_slo_ttft_p99_s, {"model": model})
              for model, cfg in objectives]
    rules += [_fact("gpufleet:model_slo_itl_p99_seconds", cfg.vllm_slo_itl_p99_s, {"model": model})
              for model, cfg in objectives]
    return header + yaml.safe_dump({"groups": [{"name": GROUP, "rules": rules}]}, sort_keys=False, width=1000)
