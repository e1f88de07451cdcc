"""gpufleet's Prometheus rules: the rule files (``templates/monitoring/rules/``) and the values they are rendered with.

The thresholds are the ``alert_*`` variables (``roles/monitoring/defaults.yml``), passed under their own names.
The rest comes from gpufleet's own names, so the rules follow them: the mounts that may hold the model
directory, the systemd units gpufleet runs, the critical XIDs as a PromQL regex, the windows of a prefix cache
collapse, and how long a slow start is judged.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

from gpufleet import node_paths
from gpufleet.config.schema import HostConfig, keys
from gpufleet.templates import render

RULES_DIR = "monitoring/rules"
RULE_FILES = ("recording.yml", "gpu.yml", "serving.yml", "node.yml")
"""The rule files, each rendered from ``templates/monitoring/rules/<name>.j2``."""

THRESHOLDS = tuple(name for name in keys(role="monitoring") if name.startswith("alert_"))
"""The variables the rules take, each under its own name."""

GPUFLEET_UNITS = (
    node_paths.VLLM_UNIT_TEMPLATE, node_paths.watchdog_unit(""), f"{node_paths.RAY_UNIT_PREFIX}.service",
    node_paths.GPU_WATCH_SERVICE, node_paths.NODE_WATCH_SERVICE, node_paths.DCGM_EXPORTER_SERVICE,
    node_paths.NODE_EXPORTER_UNIT, node_paths.NODE_EXPORTER_PACKAGE_UNIT, node_paths.ROUTER_SERVICE,
)
"""Units gpufleet runs; a template unit (``vllm@.service``) or a prefix stands for every instance."""

RANK_UNIT_PREFIXES = (node_paths.VLLM_UNIT_TEMPLATE.removesuffix(".service"), node_paths.RAY_UNIT_PREFIX)
"""What a replica's rank unit on a node is named before ``<replica>.service``: its vLLM (mp) or its Ray node."""

PREFIX_COLLAPSE_FOR = "15m"
"""How long a prefix-routed model's cache hit ratio stays collapsed before it alerts; its baseline ends there."""

PREFIX_BASELINE = "6h"
"""The window whose average hit ratio a collapse is measured against, before the collapse's own."""

START_ALERT_WINDOW_S = 3600
"""How long after a replica's start ReplicaStartSlow judges it (seconds): a slow start is news for an hour."""

RUNBOOK = "docs/guide/when-things-fail.md"
"""The guide's page of runbooks: a section per alert (its ``runbook`` annotation: this page, ``#`` the alert's name in
lower case) and per failure signature (``gpufleet diag``'s findings)."""

GPU_SERVICES = (node_paths.DCGM_HOSTENGINE, f"{node_paths.FABRICMANAGER}.service")
"""Services the GPUs need: DCGM's host engine and, on NVSwitch systems, the fabric manager."""


def unit_regex(units: tuple[str, ...]) -> str:
    """A PromQL regex (backslashes doubled for a double-quoted string) matching ``units`` and their instances."""
    patterns = []
    for unit in units:
        stem, _, kind = unit.rpartition(".")
        instances = ".+" if stem.endswith(("@", "-")) else ""
        patterns.append(stem.replace(".", "\\\\.") + instances + "\\\\." + kind)
    return "|".join(patterns)


def model_dir_mounts() -> list[str]:
    """Every mount point that may hold the model directory, deepest first (the deepest present holds it)."""
    path = PurePosixPath(node_paths.MODELS_DIR)
    return [str(path), *(str(parent) for parent in path.parents)]


def rule_values(cfg: HostConfig) -> dict[str, Any]:
    """What the rule templates are rendered with: the thresholds of ``cfg`` and gpufleet's names."""
    return {
        **{name: getattr(cfg, name) for name in THRESHOLDS},
        "critical_xids": "|".join(str(xid) for xid in cfg.alert_gpu_critical_xids),
        "gpufleet_units": unit_regex(GPUFLEET_UNITS),
        "gpu_services": unit_regex(GPU_SERVICES),
        "rank_unit_prefixes": "|".join(RANK_UNIT_PREFIXES),
        "model_mounts": model_dir_mounts(),
        "prefix_collapse_for": PREFIX_COLLAPSE_FOR,
        "prefix_baseline": PREFIX_BASELINE,
        "start_alert_window_s": START_ALERT_WINDOW_S,
        "runbook": RUNBOOK,
    }


def render_rules(cfg: HostConfig) -> dict[str, str]:
    """Every rule file's text, by file name."""
    values = rule_values(cfg)
    return {name: render(f"{RULES_DIR}/{name}.j2", **values) for name in RULE_FILES}
