"""Role ``dcgm_exporter``: NVIDIA's DCGM exporter as a hardened service, with counters tuned for serving.

After it, the node has:

- the package ``datacenter-gpu-manager-exporter`` (at ``dcgm_exporter_version`` when set);
- the system user and group ``dcgm-exporter`` (no login, no home);
- ``/etc/dcgm-exporter/gpufleet-counters.csv`` (root, 0644): the fields it exports. Beyond NVIDIA's
  defaults it turns on ECC, remapped rows, XID, clock-event reasons and throttle time, and NVLink error
  counters on nodes whose GPUs have NVLink (from the probed facts);
- ``/etc/systemd/system/dcgm-exporter.service`` (the package ships no unit): ``dcgm-exporter -f COUNTERS
  -a FLEET_ADDRESS:dcgm_exporter_port -r localhost:5555`` as ``dcgm-exporter``, reading through the running
  host engine (role ``dcgm``), sandboxed by systemd; enabled and running, serving ``/metrics`` on the node's
  fleet address to the node itself and the monitoring hosts only (``IPAddressAllow=``,
  :mod:`gpufleet.plan.access`).

A change of the counters file, the unit or the package restarts the exporter and nothing else.
Variables (roles/dcgm_exporter/defaults.yml): ``dcgm_exporter_version``, ``dcgm_exporter_port``.
"""

from __future__ import annotations

from typing import Any

from pyinfra.api.deploy import deploy
from pyinfra.context import host
from pyinfra.operations.util import any_changed

from gpufleet.gpu.report import NodeFacts
from gpufleet.netaddr import bracketed
from gpufleet.node_paths import DCGM_EXPORTER_COUNTERS, unit_path
from gpufleet.node_paths import DCGM_EXPORTER_SERVICE as SERVICE
from gpufleet.node_paths import DCGM_HOSTENGINE as HOSTENGINE
from gpufleet.operations import apt, files, node, server, systemd
from gpufleet.plan import access
from gpufleet.run.context import gpu_facts, host_config
from gpufleet.templates import render
from gpufleet.values.problems import ConfigError, exit_with

PACKAGE = "datacenter-gpu-manager-exporter"
USER = "dcgm-exporter"
UNIT_FILE = unit_path(SERVICE)
COUNTERS_FILE = DCGM_EXPORTER_COUNTERS
HOSTENGINE_ADDRESS = "localhost:5555"


def has_nvlink(facts: NodeFacts | None) -> bool:
    """Whether any GPU reports NVLinks (True when the node could not be probed: the fields cost nothing)."""
    if facts is None or not facts.nvml.available:
        return True
    return any(gpu.nvlinks for gpu in facts.gpus)


def unit_values(port: int, address: str, allowed: list[str] | None, xid_window_s: int) -> dict[str, Any]:
    """What templates/dcgm_exporter/dcgm-exporter.service.j2 is rendered with: it listens on ``address``
    (the fleet address), accepts connections from ``allowed`` and localhost only, and counts XIDs over
    ``xid_window_s``."""
    return {
        "port": port,
        "xid_window_ms": xid_window_s * 1000,
        "address": bracketed(address),
        "ip_access": access.unit_lines(allowed),
        "run_as": USER,
        "counters": COUNTERS_FILE,
        "hostengine": HOSTENGINE,
        "hostengine_address": HOSTENGINE_ADDRESS,
    }


@deploy("DCGM exporter")
def dcgm_exporter() -> None:
    """Converge the exporter's package, user, counters and hardened unit; restart it only on a change."""
    cfg = host_config()
    address = cfg.fleet_address or host.name
    try:
        allowed = access.exporter_sources(cfg, address, access.deploy_group())
    except ConfigError as error:
        exit_with(error)
    version = cfg.dcgm_exporter_version
    node.observe(name="Read the DCGM exporter's package, account, files and unit", packages=[PACKAGE],
                 users=[USER], groups=[USER], paths=[COUNTERS_FILE, UNIT_FILE], units=[SERVICE])
    package = apt.packages(
        name=f"Install {PACKAGE}" + (f" {version}" if version else ""),
        packages=[f"{PACKAGE}={version}" if version else PACKAGE], allow_downgrades=bool(version),
    )
    server.system_account(name=f"Create the system user and group {USER} the exporter runs as", user=USER,
                          comment="NVIDIA DCGM exporter")
    counters = files.file(
        name=f"Write the counters the exporter serves to {COUNTERS_FILE}", dest=COUNTERS_FILE,
        content=render("dcgm_exporter/counters.csv.j2", nvlink=has_nvlink(gpu_facts())),
    )
    unit = files.file(
        name=f"Write the exporter's unit {UNIT_FILE}", dest=UNIT_FILE,
        content=render("dcgm_exporter/dcgm-exporter.service.j2",
                       **unit_values(cfg.dcgm_exporter_port, address, allowed, cfg.dcgm_exporter_xid_window_s)),
    )
    systemd.daemon_reload(name="Reload systemd: the exporter's unit changed", _if=unit.did_change)
    systemd.restart(name="Restart the exporter: its package, counters or unit changed", unit=SERVICE,
                    _if=any_changed(package, counters, unit))
    systemd.service(name="Enable and start the exporter", unit=SERVICE, running=True, enabled=True)
