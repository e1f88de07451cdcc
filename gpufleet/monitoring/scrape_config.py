"""Prometheus's scrape configuration, from the inventory and the plan: the jobs and labels gpufleet's rules expect.

The jobs and the labels on their targets are those ``templates/monitoring/rules/_header.j2`` promises
(:data:`JOB_LABELS`):

- ``node``: every inventory host's node_exporter;
- ``dcgm``: every serving (GPU) host's dcgm-exporter;
- ``vllm``: every replica's API on its first node: a single-node replica's process, rank 0 of a multi-node mp
  replica (the other ranks run headless: no HTTP, no ``/metrics``), the head of a Ray replica; role ``rank0``, or
  ``head`` for Ray;
- ``ray``: every node of a Ray replica, on Ray's metrics export port (``ray_port + 3``), role ``head`` or ``worker``;
- ``router``: every router's HAProxy endpoint (``router_metrics_port``). Its series get a ``model`` label from their
  ``proxy`` label, one exact match per backend, with the routers' own backend names (each served model's,
  :class:`gpufleet.plan.planner.ServedModel`), so that a backend's series join its model's.

Every target is static (``static_configs``): nothing is discovered outside the inventory. A host is reached at its
``fleet_address``, else its inventory name, as every role reaches it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from gpufleet.config.schema import HostConfig
from gpufleet.netaddr import host_port
from gpufleet.plan.planner import FleetPlan, Replica

JOB_LABELS: dict[str, tuple[str, ...]] = {
    "node": ("node", "pool"),
    "dcgm": ("node", "pool"),
    "vllm": ("node", "pool", "model", "replica", "role", "gpus"),
    "ray": ("node", "pool", "model", "replica", "role", "gpus"),
    "router": ("node", "pool"),
}
"""Every job, in the order Prometheus lists them, and the labels each of its targets carries."""

RAY_METRICS_OFFSET = 3
"""Ray's metrics export port is ``ray_port + 3`` on every node of a Ray replica (gpufleet.plan.commands)."""

_ROLES = {"single": "rank0", "mp-rank-0": "rank0", "ray-head": "head", "ray-worker": "worker"}


@dataclass(frozen=True)
class Target:
    """One scrape target: its job, where it answers, and the labels its series get."""

    job: str
    host: str  # an address, or a host name
    port: int
    labels: dict[str, str]

    @property
    def address(self) -> str:
        """``HOST:PORT``, as Prometheus's ``targets`` take it."""
        return host_port(self.host, self.port)


def host_address(cfg: HostConfig, host: str) -> str:
    """Where a host is reached: its ``fleet_address``, else its inventory name."""
    return cfg.fleet_address or host


def _node_exporter_address(cfg: HostConfig, host: str) -> str:
    listen = cfg.node_exporter_listen_address
    return listen if listen and listen not in ("0.0.0.0", "::") else host_address(cfg, host)


def host_targets(configs: Mapping[str, HostConfig], pools: Mapping[str, str], gpu_hosts: Iterable[str],
                 routers: Iterable[str]) -> list[Target]:
    """The ``node``, ``dcgm`` and ``router`` targets: every host's node_exporter, the GPU hosts' dcgm-exporter, the
    routers' HAProxy. ``pools``: each host's ``pool`` label (its serving pool, else its role group)."""
    found = [Target("node", _node_exporter_address(cfg, host), cfg.node_exporter_port,
                    {"node": host, "pool": pools[host]}) for host, cfg in configs.items()]
    found += [Target("dcgm", host_address(configs[host], host), configs[host].dcgm_exporter_port,
                     {"node": host, "pool": pools[host]}) for host in gpu_hosts]
    found += [Target("router", host_address(configs[host], host), configs[host].router_metrics_port,
                     {"node": host, "pool": pools[host]}) for host in routers]
    return found


def replica_targets(replicas: Iterable[Replica], configs: Mapping[str, HostConfig]) -> list[Target]:
    """The ``vllm`` target of every replica meant to serve (its API on its first node; none where ``vllm_start`` is
    false) and the ``ray`` targets of every node of a Ray replica (its Ray units run either way)."""
    found: list[Target] = []
    for replica in replicas:
        for rank, role in enumerate(replica.roles):
            labels = {"node": role.host, "pool": replica.pool, "model": replica.served, "replica": replica.name,
                      "role": _ROLES.get(role.role, f"rank{rank}"), "gpus": ",".join(str(g) for g in role.gpus)}
            if rank == 0 and replica.starts:
                found.append(Target("vllm", role.address, replica.port, labels))
            if role.role in ("ray-head", "ray-worker"):
                found.append(Target("ray", role.address, configs[role.host].ray_port + RAY_METRICS_OFFSET, labels))
    return found


def router_models(plan: FleetPlan) -> list[tuple[str, str]]:
    """(backend name, served model) of every backend the routers have: the name their series carry as ``proxy``."""
    return [(model.backend, model.name) for model in plan.models.values()]


def _model_relabelling(models: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """One exact match per backend: ``proxy`` is the backend's name, ``model`` becomes its model (a ``$`` in a
    model name is doubled: Prometheus expands ``$`` in a replacement)."""
    return [{"source_labels": ["proxy"], "regex": re.escape(name), "target_label": "model",
             "replacement": model.replace("$", "$$")} for name, model in models]


def scrape_configs(targets: Iterable[Target], models: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """Prometheus's ``scrape_configs``: one job per :data:`JOB_LABELS` entry that has targets, one static group per
    target (each with its own labels), in a stable order."""
    by_job: dict[str, list[Target]] = {}
    for target in targets:
        by_job.setdefault(target.job, []).append(target)
    jobs: list[dict[str, Any]] = []
    for job in JOB_LABELS:
        mine = sorted(by_job.get(job, []), key=lambda t: (t.labels.get("replica", ""), t.labels["node"], t.port))
        if not mine:
            continue
        config: dict[str, Any] = {"job_name": job, "static_configs": [
            {"targets": [t.address], "labels": dict(sorted(t.labels.items()))} for t in mine]}
        if job == "router" and models:
            config["metric_relabel_configs"] = _model_relabelling(models)
        jobs.append(config)
    return jobs


def prometheus_config(jobs: list[dict[str, Any]], alertmanager: str, rule_files: list[str], header: str,
                      interval_s: int) -> str:
    """The whole ``prometheus.yml``: ``header`` (comment lines), the scrape and evaluation interval ``interval_s``
    (a scrape gives up after that or 10 s, whichever is sooner), the Alertmanager at ``alertmanager``
    (``HOST:PORT``), ``rule_files`` (relative to the file) and ``jobs``."""
    config = {
        "global": {"scrape_interval": f"{interval_s}s", "scrape_timeout": f"{min(interval_s, 10)}s",
                   "evaluation_interval": f"{interval_s}s"},
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]},
        "rule_files": rule_files,
        "scrape_configs": jobs,
    }
    return header + yaml.safe_dump(config, sort_keys=False, width=1000)
