"""Where the lab's nodes meet its doubles: the simulated hardware profile, and the mirror.

- ``gpufleet_lab.sim_profile``: the node's simulated hardware (NVML, the simulated ``libnvidia-ml.so.1``, comes
  with the driver package of the mirror's lab doubles);
- ``gpufleet_lab.mirror``: the apt and wheel mirror on the bridge.
"""

from __future__ import annotations

from pathlib import Path

from gpufleet_lab import mirror, nvml_sim
from gpufleet_lab.sim_profile import write_sim_profile

SIM_PROFILE_PATH = str(nvml_sim.DEFAULT_PROFILE_PATH.relative_to("/"))  # in the node's rootfs


def install_sim_profile(root: Path, profile: str, hostname: str) -> None:
    """Put the node's hardware profile into its rootfs: the GPUs are there from the start, NVML (the simulated
    ``libnvidia-ml.so.1``) comes with the lab's driver package."""
    path = root / SIM_PROFILE_PATH
    path.parent.mkdir(parents=True, exist_ok=True)
    write_sim_profile(path, profile, hostname=hostname)


DEBIAN_SOURCES = "etc/apt/sources.list"  # in the node's rootfs
DEBIAN_KEYRING = f"usr/share/keyrings/{mirror.KEYRING_NAME}"


def install_debian_source(root: Path, bridge_address: str) -> None:
    """Point the node's apt at the mirror's repository of Debian's packages, as a site's nodes point at its Debian
    mirror (the lab's nodes reach no other): the roles' distribution packages (HAProxy) come from there."""
    urls = mirror.MirrorUrls(mirror_base_url(bridge_address))
    (root / DEBIAN_SOURCES).write_text(urls.debian_source(f"/{DEBIAN_KEYRING}") + "\n")
    keyring = root / DEBIAN_KEYRING
    keyring.parent.mkdir(parents=True, exist_ok=True)
    keyring.write_bytes(mirror.keyring_file().read_bytes())


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
