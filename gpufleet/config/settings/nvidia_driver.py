"""The NVIDIA driver's and CUDA's settings.

Each field is one variable's record (:mod:`gpufleet.config.settings`); ``roles/nvidia_driver/defaults.yml`` is written
from them.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from gpufleet.config.settings import RoleSettings, setting
from gpufleet.values import grammar
from gpufleet.values.types import text


class NvidiaDriverSettings(RoleSettings):
    """NVIDIA driver from NVIDIA's CUDA apt repository.
    """

    nvidia_driver_branch: Annotated[int, Field(ge=450, le=999)] = setting(
        580,
        "Driver branch, pinned so unattended upgrades cannot move it. CUDA 13 needs 580 or newer.",
    )

    nvidia_driver_kernel_modules: Literal["open", "proprietary"] = setting(
        "open",
        "Kernel modules: open (nvidia-driver-<branch>-open; Turing and newer) or proprietary "
        "(nvidia-driver-<branch>).",
    )

    nvidia_driver_version: text(grammar.deb_version) | None = setting(  # type: ignore[valid-type]
        None,
        "Exact driver package version, e.g. 580.95.05-1 (moving it upgrades or downgrades the driver, and the "
        "fabric manager and persistence daemon with it); null: the newest of the branch at the first install, then "
        "kept.",
    )

    nvidia_driver_reboot: Literal["never", "if-bare", "if-needed", "allowed"] = setting(
        "if-bare",
        "What to do when the installed driver package differs from the kernel module NVML reports loaded:\n"
        "  never     stop the node with \"reboot required: ...\" (pyinfra runs nothing more there); reboot by hand\n"
        "  if-bare   reboot, then probe again, a node this deploy gave its first driver (no module loaded, even\n"
        "            after the install: nothing served there); anything else stops the node as with never\n"
        "  if-needed reboot, then probe again, when this deploy installed or upgraded the driver package;\n"
        "            a difference this deploy did not cause stops the node as with never\n"
        "  allowed   reboot, then probe again, whenever they differ\n"
        "if-bare stops a serving node whose driver an upgrade changed, for a drained reboot.",
    )

    # ASCII digits: the version is part of a package name and a path
    cuda_version: Annotated[str, Field(pattern=r"^[0-9]+\.[0-9]+$")] = setting(
        "13.0",
        "CUDA version the fleet targets (the pinned vLLM 0.33 is built for CUDA 13).",
    )

    cuda_toolkit: bool = setting(
        False,
        "Install NVIDIA's CUDA toolkit cuda-toolkit-<major>-<minor> of cuda_version (cuda-toolkit-13-0, several "
        "GB) from the repository below into /usr/local/cuda-<major>.<minor>, and give vLLM's and Ray's processes "
        "CUDA_HOME and PATH (its bin/, then the virtualenv's, then systemd's default). Only kernels compiled with "
        "nvcc at run time need it: FlashInfer's just-in-time kernels on first use (without flashinfer-cubin), "
        "DeepGEMM's; vLLM's wheels ship precompiled kernels for the common cases.",
    )

    nvidia_repo_url: str = setting(
        "https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64/",
        "NVIDIA's flat CUDA repository of the driver, fabric manager and DCGM packages (the apt source line is "
        "`deb [signed-by=KEYRING] URL /`). An air-gapped fleet points this at its own mirror.",
    )

    nvidia_repo_keyring_url: str = setting(
        "https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64/3bf863cc.pub",
        "The key the repository is signed with; each node fetches it once into /etc/apt/keyrings/ and apt trusts "
        "it for this repository only. A URL ending in .gpg is a binary keyring, anything else (.pub, .asc) an "
        "ASCII-armored key. It is installed only when its fingerprint is nvidia_repo_key_fingerprint, checked on "
        "the node whenever the deploy runs.",
    )

    nvidia_repo_key_fingerprint: Annotated[str, Field(pattern=r"^[0-9A-F]{40}$")] = setting(
        "EB693B3035CD5710E231E123A4B469963BF863CC",
        "Fingerprint (40 hex digits, upper case) the fetched key must have; a key with another one stops the node "
        "before apt trusts it. This is NVIDIA's published CUDA repository key (3bf863cc).",
    )
