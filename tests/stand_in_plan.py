"""A plan of stand-in replicas, made without the planner: each replica on a host of its own named after it, at the
address and port given, serving what that host's configuration says (scheduled by priority and its tokens
metered as the planner decides); its served models as the planner makes them."""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

from gpufleet.config.schema import HostConfig
from gpufleet.netaddr import host_port
from gpufleet.plan.planner import FleetPlan, served_models
from gpufleet.plan.priority import schedules_by_priority
from gpufleet.plan.token_budgets import meters_tokens


def stand_in_plan(replicas: Mapping[str, tuple[str, int]], configs: Mapping[str, HostConfig]) -> FleetPlan:
    """``replicas``: each replica's (address, port) by its name (its host's too); ``configs``: by host."""
    found: list[Any] = []
    for name, (address, port) in replicas.items():
        cfg = configs[name]
        found.append(SimpleNamespace(
            name=name, pool=name, port=port, nodes=[name], roles=[SimpleNamespace(host=name, address=address)],
            served=cfg.served_model_name(), release=cfg.vllm_version, starts=cfg.vllm_start,
            gpu_profile=str(cfg.gpu_profile or "probed"), api_key=cfg.vllm_api_key,
            api_address=host_port(address, port), api_url=f"http://{host_port(address, port)}",
            max_model_len=cfg.vllm_max_model_len or 4096,
            admission=SimpleNamespace(priority=schedules_by_priority(cfg.served_model_name(), configs.values()),
                                      usage=meters_tokens(cfg.served_model_name(), configs.values()))))
    return FleetPlan(replicas=found, models=served_models(found, configs))
