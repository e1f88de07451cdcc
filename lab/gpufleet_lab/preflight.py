"""Can this machine run the lab? Each problem is one sentence saying what to do about it."""

from __future__ import annotations

import os
import shutil

from gpufleet_lab.errors import LabError

# Host commands the lab runs, and the Debian package that brings each.
HOST_COMMANDS: dict[str, str] = {
    "debootstrap": "debootstrap",
    "systemd-nspawn": "systemd-container",
    "ip": "iproute2",
    "mount": "mount",
    "ssh-keygen": "openssh-client",
    "systemctl": "systemd",
}


def problems() -> list[str]:
    """Why the lab cannot run here; empty when it can."""
    found = []
    if os.geteuid() != 0:
        found.append("the lab needs root (it mounts, creates a bridge and boots containers); run it as root")
    missing = [f"{cmd} (package {pkg})" for cmd, pkg in HOST_COMMANDS.items() if shutil.which(cmd) is None]
    if missing:
        found.append(f"missing on this host: {', '.join(missing)}; run scripts/install-lab-deps.sh as root")
    if not os.path.isdir("/sys/fs/cgroup"):
        found.append("no cgroup filesystem at /sys/fs/cgroup; systemd-nspawn cannot boot a node here")
    return found


def require() -> None:
    """Raise :class:`LabError` naming the first problem, if any."""
    found = problems()
    if found:
        raise LabError(found[0])
