"""Where the lab's nodes meet its doubles: the simulated NVML library and hardware profile, and the mirror.

- ``gpufleet.lab.nvml_sim``: the simulated ``libnvidia-ml.so.1``;
- ``gpufleet.lab.sim_profile``: the node's simulated hardware;
- ``gpufleet.lab.mirror``: the apt and wheel mirror on the bridge.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

from gpufleet.lab import mirror, nvml_sim
from gpufleet.lab.errors import LabError
from gpufleet.lab.sim_profile import write_sim_profile

NVML_LIBRARY = nvml_sim.LIBRARY_NAME
SIM_PROFILE_PATH = str(nvml_sim.DEFAULT_PROFILE_PATH.relative_to("/"))  # in the node's rootfs


def multiarch_libdir() -> str:
    """Debian's library directory for this machine, e.g. ``usr/lib/x86_64-linux-gnu``."""
    machine = platform.machine()
    triplet = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu"}.get(machine, f"{machine}-linux-gnu")
    return f"usr/lib/{triplet}"


def build_nvml_library(out_dir: Path) -> Path:
    """Build the simulated NVML library for all nodes (the builder skips an up-to-date one)."""
    try:
        return nvml_sim.build_library(out_dir)
    except Exception as exc:  # the simulator's own errors carry the compiler's message
        first = str(exc).strip().splitlines()[:1] or [type(exc).__name__]
        raise LabError(f"cannot build the simulated NVML library: {first[0]}") from exc


def install_nvml(root: Path, library: Path, profile: str, hostname: str) -> None:
    """Put the node's hardware profile and the simulated ``libnvidia-ml.so.1`` into its rootfs."""
    path = root / SIM_PROFILE_PATH
    path.parent.mkdir(parents=True, exist_ok=True)
    write_sim_profile(path, profile, hostname=hostname)
    dest = root / multiarch_libdir() / NVML_LIBRARY
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(library, dest)
    dest.chmod(0o755)
    subprocess.run(["ldconfig", "-r", str(root)], capture_output=True, check=False)


MIRROR_PORT = 8080


def mirror_base_url(bridge_address: str) -> str:
    """Where the lab's nodes find its mirror (apt/, wheels/, keys/ below it)."""
    return f"http://{bridge_address}:{MIRROR_PORT}/"


def start_mirror(bridge_address: str) -> None:
    """Build what the mirror serves (up-to-date parts are kept), then serve it on the bridge address."""
    mirror.prepare()
    mirror.start(bridge_address, MIRROR_PORT)


def stop_mirror(bridge_address: str) -> None:
    """Stop this lab's mirror only: other labs on the same cache keep theirs."""
    mirror.stop(bind_address=bridge_address, port=MIRROR_PORT)
