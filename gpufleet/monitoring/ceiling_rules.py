"""Each model's measured ceiling as a Prometheus recording rule (``gpufleet:model_ceiling_rps{model, release}``),
what the capacity alert compares the model's request rate with.

The file is written by ``gpufleet bench`` on every monitoring host once its record is kept, from every record there
and the plan of the time (:func:`gpufleet.bench.capacity.model_capacities`), checked with promtool, then put in
place and Prometheus reloaded. It lives beside gpufleet's configuration, not in it (:data:`CEILINGS_DIR`): the
monitoring role names it by a pattern (:data:`RULE_PATTERN`) that may match nothing, and never removes it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml

from gpufleet.bench.capacity import ModelCapacity

CEILINGS_DIR = "/etc/prometheus/gpufleet-bench"
CEILINGS_FILE = "ceilings.yml"
RULE_PATTERN = f"{CEILINGS_DIR}/*.yml"
"""How prometheus.yml names the file: a pattern, so that a fleet never benched has no file and no error."""

RECORD = "gpufleet:model_ceiling_rps"
GROUP = "gpufleet-ceilings"


def ceiling_rules(capacities: Mapping[str, ModelCapacity], header: str) -> str:
    """The rule file's text: ``header`` (comment lines), then one constant per measured model, sorted."""
    rules: list[dict[str, Any]] = [
        {"record": RECORD, "expr": f"vector({cap.ceiling_rps!r})", "labels": {"model": model, "release": cap.release}}
        for model, cap in sorted(capacities.items())]
    return header + yaml.safe_dump({"groups": [{"name": GROUP, "rules": rules}]}, sort_keys=False, width=1000)
