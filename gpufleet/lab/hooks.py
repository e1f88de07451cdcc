"""Call points for the lab's doubles built in their own modules, each imported only when used.

- ``gpufleet.lab.nvml_sim.build_library(out_dir) -> Path``: the simulated ``libnvidia-ml.so.1``;
- ``gpufleet.lab.sim_profile.write_sim_profile(path, profile_name, faults=(), hostname=None)``: the node's
  simulated hardware;
- ``gpufleet.lab.mirror.prepare()``, ``start(bridge_address, port)`` / ``stop(...)``: the apt and wheel mirror on the bridge.

When a module is missing, its step is skipped with a warning and the lab still comes up.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import platform
import shutil
import subprocess
from pathlib import Path
from types import ModuleType

from gpufleet.lab.errors import LabError

log = logging.getLogger(__name__)

NVML_LIBRARY = "libnvidia-ml.so.1"
SIM_PROFILE_PATH = "etc/gpufleet/nvml-sim-profile"


def _optional(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        log.warning("%s is not available; skipping that lab step", name)
        return None


def multiarch_libdir() -> str:
    """Debian's library directory for this machine, e.g. ``usr/lib/x86_64-linux-gnu``."""
    machine = platform.machine()
    triplet = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu"}.get(machine, f"{machine}-linux-gnu")
    return f"usr/lib/{triplet}"


def build_nvml_library(out_dir: Path) -> Path | None:
    """Build the simulated NVML library for all nodes (the builder skips an up-to-date one); None if absent."""
    sim = _optional("gpufleet.lab.nvml_sim")
    if sim is None:
        return None
    try:
        return Path(sim.build_library(out_dir))
    except Exception as exc:  # the simulator's own errors carry the compiler's message
        first = str(exc).strip().splitlines()[:1] or [type(exc).__name__]
        raise LabError(f"cannot build the simulated NVML library: {first[0]}") from exc


def install_nvml(root: Path, library: Path | None, profile: str, hostname: str) -> None:
    """Put the node's hardware profile and the simulated ``libnvidia-ml.so.1`` into its rootfs."""
    profiles = _optional("gpufleet.lab.sim_profile")
    if profiles is not None:
        path = root / SIM_PROFILE_PATH
        path.parent.mkdir(parents=True, exist_ok=True)
        if "hostname" in inspect.signature(profiles.write_sim_profile).parameters:
            profiles.write_sim_profile(path, profile, hostname=hostname)
        else:
            profiles.write_sim_profile(path, profile)
    if library is not None:
        dest = root / multiarch_libdir() / NVML_LIBRARY
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(library, dest)
        dest.chmod(0o755)
        subprocess.run(["ldconfig", "-r", str(root)], capture_output=True, check=False)


MIRROR_PORT = 8080


def mirror_base_url(bridge_address: str) -> str:
    """Where the lab's nodes find its mirror (apt/, wheels/, keys/ below it)."""
    return f"http://{bridge_address}:{MIRROR_PORT}/"


def start_mirror(bridge_address: str) -> bool:
    """Build what the mirror serves (up-to-date parts are kept), then serve it on the bridge address;
    False when there is no mirror module."""
    mirror = _optional("gpufleet.lab.mirror")
    if mirror is None:
        return False
    mirror.prepare()
    mirror.start(bridge_address, MIRROR_PORT)
    return True


def stop_mirror(bridge_address: str) -> None:
    """Stop this lab's mirror only: other labs on the same cache keep theirs."""
    mirror = _optional("gpufleet.lab.mirror")
    if mirror is not None:
        mirror.stop(bind_address=bridge_address, port=MIRROR_PORT)
