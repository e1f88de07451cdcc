"""Role ``dcgm``: NVIDIA DCGM and its host engine.

After it, the node has ``datacenter-gpu-manager-<dcgm_version>-cuda<CUDA major>`` (the DCGM build for the
CUDA major of ``cuda_version``, e.g. ``datacenter-gpu-manager-4-cuda13``) and its host engine,
``nvidia-dcgm.service`` (``nv-hostengine`` on 127.0.0.1:5555), enabled and running. The host engine
restarts only when its package changed. The package comes from NVIDIA's CUDA repository, which role
``nvidia_driver`` sets up (run that first, as deploys/provision.py does).

Variables: ``dcgm_version`` (roles/dcgm/defaults.yml), ``cuda_version`` (roles/nvidia_driver).
"""

from __future__ import annotations

from pyinfra.api.deploy import deploy

from gpufleet.node_paths import DCGM_HOSTENGINE as HOSTENGINE
from gpufleet.operations import apt, node, systemd
from gpufleet.run.context import host_config


def dcgm_package(dcgm_version: str, cuda_version: str) -> str:
    """``datacenter-gpu-manager-4-cuda13`` for DCGM 4 and CUDA 13.x."""
    return f"datacenter-gpu-manager-{dcgm_version}-cuda{cuda_version.split('.', 1)[0]}"


@deploy("DCGM")
def dcgm() -> None:
    """Converge DCGM for the fleet's CUDA major and its running host engine."""
    cfg = host_config()
    package = dcgm_package(cfg.dcgm_version, cfg.cuda_version)
    node.observe(name="Read DCGM's package and host engine", packages=[package], units=[HOSTENGINE])
    installed = apt.packages(name=f"Install {package}", packages=[package])
    systemd.restart(name=f"Restart {HOSTENGINE}: its package changed", unit=HOSTENGINE, _if=installed.did_change)
    systemd.service(name=f"Enable and start the DCGM host engine {HOSTENGINE}", unit=HOSTENGINE,
                    running=True, enabled=True)
