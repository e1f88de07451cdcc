"""The nodes' Debian rootfs: built once with debootstrap, cached, and layered per node.

The cached base lives in ``<cache dir>/bookworm-<key>/`` where the key hashes everything that shapes
it (suite, variant, package list, the lab's own changes to it): change the list and the next ``up``
builds a new base beside the old one. A build goes to a temporary directory renamed into place at the
end, so a half-built base is never used.

Each node boots from an overlayfs mount whose lower layer is the read-only base and whose upper layer
is the node's own directory: creating a node costs a mount, where a full copy costs about 300 MB and
seconds of I/O (measured with bench/lab_boot.py on 2 cores: 8 nodes SSH-ready in 2.7 s with overlays,
22 s with copies), and ``down`` just drops the upper layer. Where overlayfs cannot be mounted (a lab
dir on a filesystem that cannot hold an upper layer), the node gets a full copy instead.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gpufleet_lab.errors import LabError

log = logging.getLogger(__name__)

SUITE = "bookworm"
VARIANT = "minbase"
DEBIAN_MIRROR_ENV = "GPUFLEET_LAB_DEBIAN_MIRROR"
DEFAULT_DEBIAN_MIRROR = "http://deb.debian.org/debian"

# What every node has before any role runs. Roles install the rest from the lab's mirror.
BASE_PACKAGES: tuple[str, ...] = (
    "systemd",
    "systemd-sysv",
    "dbus",
    "openssh-server",
    "sudo",
    "python3",
    "python3-venv",
    "libnuma1",  # the CPU build of vLLM links it (vllm._C)
    "iproute2",
    "iputils-ping",
    "procps",
    "netbase",
    "ca-certificates",
    "curl",
    "gnupg",
)

# Bump when _customize_base changes what it writes, so cached bases are rebuilt.
BASE_LAYOUT = 1

SSHD_DROP_IN = """\
# gpufleet lab node: root logs in with the lab's key only.
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
HostKey /etc/ssh/ssh_host_ed25519_key
UseDNS no
"""

RESOLV_CONF = "# Lab nodes have no DNS: lab names are in /etc/hosts.\n"

RootMode = Literal["overlay", "copy"]


def cache_key(packages: tuple[str, ...] = BASE_PACKAGES) -> str:
    """A short hash of everything that decides the base's content."""
    spec = {"suite": SUITE, "variant": VARIANT, "packages": sorted(set(packages)), "layout": BASE_LAYOUT}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


def base_path(cache: Path, packages: tuple[str, ...] = BASE_PACKAGES) -> Path:
    return cache / f"{SUITE}-{cache_key(packages)}"


def ensure_base(cache: Path, packages: tuple[str, ...] = BASE_PACKAGES) -> Path:
    """The cached base rootfs for ``packages``, built with debootstrap first when absent.

    Concurrent callers wait on a lock and then use the base the first one built.
    """
    target = base_path(cache, packages)
    if (target / "etc" / "os-release").exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "etc" / "os-release").exists():
            _build(target, packages)
    return target


def _build(target: Path, packages: tuple[str, ...]) -> None:
    if shutil.which("debootstrap") is None:
        raise LabError("debootstrap is not installed; run scripts/install-lab-deps.sh as root")
    mirror = os.environ.get(DEBIAN_MIRROR_ENV) or DEFAULT_DEBIAN_MIRROR
    tmp = target.with_name(f"{target.name}.build-{os.getpid()}")
    logfile = target.with_name(f"{target.name}.log")
    shutil.rmtree(tmp, ignore_errors=True)
    include = ",".join(sorted(set(packages)))
    argv = ["debootstrap", f"--variant={VARIANT}", f"--include={include}", SUITE, str(tmp), mirror]
    log.info("building the lab rootfs %s with debootstrap from %s (about a minute)", target.name, mirror)
    started = time.monotonic()
    with open(logfile, "w") as out:
        done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, check=False)
    if done.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tail = logfile.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise LabError(f"debootstrap failed (exit {done.returncode}): {tail[0]} (full log: {logfile})")
    _customize_base(tmp)
    os.replace(tmp, target)
    log.info("built %s in %.0f s", target, time.monotonic() - started)


def _customize_base(root: Path) -> None:
    """What every node shares: no baked-in identity, key-only root SSH, networkd for addresses."""
    for key in (root / "etc" / "ssh").glob("ssh_host_*"):
        key.unlink()  # each node gets its own host key
    (root / "etc" / "machine-id").write_text("")  # each node gets its own machine id
    (root / "var" / "lib" / "dbus" / "machine-id").unlink(missing_ok=True)
    (root / "etc" / "ssh" / "sshd_config.d" / "gpufleet-lab.conf").write_text(SSHD_DROP_IN)
    resolv = root / "etc" / "resolv.conf"
    resolv.unlink(missing_ok=True)
    resolv.write_text(RESOLV_CONF)
    subprocess.run(
        ["systemctl", f"--root={root}", "enable", "systemd-networkd.service"],
        check=True, capture_output=True,
    )
    shutil.rmtree(root / "var" / "cache" / "apt" / "archives", ignore_errors=True)
    (root / "var" / "cache" / "apt" / "archives" / "partial").mkdir(parents=True)


@dataclass(frozen=True)
class NodeRoot:
    """Where a node boots from and whether the lab mounted it."""

    root: Path
    mounted: bool


def prepare_node_root(base: Path, node_dir: Path, mode: RootMode = "overlay") -> NodeRoot:
    """Give one node its own writable view of the base: an overlay mount, or a copy as fallback."""
    node_dir.mkdir(parents=True, exist_ok=True)
    root = node_dir / "root"
    root.mkdir(exist_ok=True)
    if mode == "overlay":
        upper, work = node_dir / "upper", node_dir / "work"
        upper.mkdir(exist_ok=True)
        work.mkdir(exist_ok=True)
        options = f"lowerdir={base},upperdir={upper},workdir={work}"
        done = subprocess.run(["mount", "-t", "overlay", "overlay", "-o", options, str(root)],
                              capture_output=True, text=True, check=False)
        if done.returncode == 0:
            return NodeRoot(root, mounted=True)
        log.warning("overlayfs mount failed (%s); copying the base instead", done.stderr.strip())
        shutil.rmtree(upper, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    root.rmdir()
    subprocess.run(["cp", "-a", "--reflink=auto", str(base), str(root)], check=True)
    return NodeRoot(root, mounted=False)


def release_node_root(node_dir: Path, root: Path) -> None:
    """Unmount the node's overlay (if it is mounted) and delete everything the node wrote."""
    if is_mountpoint(root):
        done = subprocess.run(["umount", str(root)], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            # Busy (a shell still inside?): detach it so it goes away when the last user leaves.
            subprocess.run(["umount", "--lazy", str(root)], capture_output=True, check=False)
    if is_mountpoint(root):
        raise LabError(f"cannot unmount {root}; something still uses it")
    # rm, not shutil.rmtree: a node's hundred thousand files go in C, without Python's per-file cost and its lock
    # (nodes are released side by side); never into another filesystem mounted below.
    subprocess.run(["rm", "-rf", "--one-file-system", "--", str(node_dir)], capture_output=True, check=False)


def is_mountpoint(path: Path) -> bool:
    """True when ``path`` is listed in the host's mount table."""
    target = str(path.resolve())
    with open("/proc/self/mountinfo") as table:
        return any(line.split()[4] == target for line in table)


def mounts_under(directory: Path) -> list[str]:
    """Mount points at or below ``directory`` (what ``down`` must have removed)."""
    prefix = str(directory.resolve()).rstrip("/") + "/"
    with open("/proc/self/mountinfo") as table:
        points = [line.split()[4] for line in table]
    return [p for p in points if p.startswith(prefix) or p == prefix.rstrip("/")]
