"""NVIDIA's DCGM exporter's settings.

Each field is one variable's record (:mod:`gpufleet.config.settings`); ``roles/dcgm_exporter/defaults.yml`` is written
from them.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from gpufleet.config.settings import RoleSettings, setting
from gpufleet.values import grammar
from gpufleet.values.types import Port, text


def _version(value: str) -> str | None:
    """A package version (e.g. ``4.4.1-1``): a digit, then letters, digits and ``.+~-``."""
    if value[:1].isdigit() and all(c.isalnum() or c in ".+~-" for c in value):
        return None
    return f"expected a version (e.g. 4.4.1-1), found {grammar.show(value)}"

class DcgmExporterSettings(RoleSettings):
    """NVIDIA's DCGM exporter (Prometheus metrics from DCGM), run as its own hardened service.
    """

    dcgm_exporter_version: text(_version) | None = setting(  # type: ignore[valid-type]
        None,
        "Package version of datacenter-gpu-manager-exporter, e.g. 4.4.1-4.6.0-1; null: the newest in the "
        "repository at the first install, then kept.",
    )

    dcgm_exporter_port: Port = setting(
        9400,
        "Port the exporter listens on (/metrics), on the node's fleet address; reachable from the node itself and "
        "the monitoring hosts only (monitoring_addresses, the `monitoring` group).",
    )

    dcgm_exporter_xid_window_s: Annotated[int, Field(ge=10, le=86400)] = setting(
        300,
        "How long the exporter counts each GPU's XIDs (DCGM_EXP_XID_ERRORS_COUNT, its -x window): an XID pages "
        "(GpuCriticalXid) for this long after it happened.",
    )
