"""NVIDIA DCGM's settings.

Each field is one variable's record (:mod:`gpufleet.config.settings`); ``roles/dcgm/defaults.yml`` is written
from them.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from gpufleet.config.settings import RoleSettings, setting


class DcgmSettings(RoleSettings):
    """NVIDIA DCGM (datacenter-gpu-manager) and its host engine, nvidia-dcgm.service. The package is
    datacenter-gpu-manager-<major>-cuda<CUDA major of cuda_version>, from NVIDIA's CUDA repository (role
    nvidia_driver).
    """

    dcgm_version: Annotated[str, Field(pattern=r"^\d+$")] = setting(
        "4",
        "DCGM major version.",
    )
