"""Each model's measured ceiling per replica of each of its shapes as Prometheus recording rules
(``gpufleet:replica_ceiling_rps{model, release, layout, gpu_profile}``), from which the recording rules
(``templates/monitoring/rules/recording.yml.j2``) make the model's capacity now, ``gpufleet:model_ceiling_rps{model,
release}``: each of its replicas in service (ready, and UP on the routers: not drained, not down) counts its
shape's ceiling per replica. The capacity alert compares the model's request rate with it, so that a replica added
(of a shape benched), drained or lost moves it without a new bench.

The file is written by ``gpufleet bench`` on every monitoring host once its record is kept, from every record there
and the plan of the time (:func:`gpufleet.measure.capacity.model_capacities`), checked with promtool, then put in
place and Prometheus reloaded. It lives beside gpufleet's configuration, not in it (:data:`CEILINGS_DIR`): the
monitoring role names it by a pattern (:data:`RULE_PATTERN`) that may match nothing, and never removes it. Which
shape each replica has comes from the plan's figures, written on every deploy
(``gpufleet:replica_shape{model, replica, layout, gpu_profile}``, :mod:`gpufleet.monitoring.plan_rules`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml

from gpufleet.measure.capacity import ModelCapacity

CEILINGS_DIR = "/etc/prometheus/gpufleet-bench"
CEILINGS_FILE = "ceilings.yml"
RULE_PATTERN = f"{CEILINGS_DIR}/*.yml"
"""How prometheus.yml names the file: a pattern, so that a fleet never benched has no file and no error."""

RECORD = "gpufleet:model_ceiling_rps"
"""The model's capacity now (recording.yml), what the capacity alert and the dashboards read."""

PER_REPLICA = "gpufleet:replica_ceiling_rps"
"""What this file records: one replica's ceiling, per model and shape."""

GROUP = "gpufleet-ceilings"


def ceiling_rules(capacities: Mapping[str, ModelCapacity], header: str) -> str:
    """The rule file's text: ``header`` (comment lines), then one constant per measured model and shape, sorted."""
    rules: list[dict[str, Any]] = [
        {"record": PER_REPLICA, "expr": f"vector({shape.per_replica_rps!r})",
         "labels": {"model": model, "release": cap.release, "layout": shape.layout, "gpu_profile": shape.gpu_profile}}
        for model, cap in sorted(capacities.items()) for shape in cap.shapes]
    return header + yaml.safe_dump({"groups": [{"name": GROUP, "rules": rules}]}, sort_keys=False, width=1000)
