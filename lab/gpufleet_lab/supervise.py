"""Keep one lab node running across its own reboots: ``python -m gpufleet_lab.supervise -- systemd-nspawn ...``.

systemd-nspawn exits with status 133 when the node's systemd reboots (``systemctl reboot``, a role that
reboots after a driver change); with no systemd on the host to restart it, this small parent starts it
again. SIGTERM is passed on to nspawn (a clean shutdown of the node) and ends the loop; the exit status
is nspawn's.

Each node gets cgroups of its own: nspawn puts a node's systemd under the cgroup it was started in, and without
a systemd on this machine every node would start in the root one and share its tree (two nodes' units of one name
in one cgroup: one systemd's stop kills the other node's processes, its IP filter drops the other's packets). The
supervisor moves itself into ``gpufleet-lab/<machine>`` of each hierarchy systemd uses (cgroup2, and v1's
``name=systemd``) before it starts nspawn, and removes that tree when it ends, with any IP filter a node that lost
its power left attached there (a new node of the same name then starts clean).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

REBOOT_STATUS = 133
MAX_REBOOTS_PER_MINUTE = 5
CGROUP_PARENT = "gpufleet-lab"
EMPTY_WAIT_S = 10.0  # for a powered-off node's last processes to leave its cgroups


def systemd_hierarchies(mountinfo: str) -> list[Path]:
    """Where the cgroup hierarchies a node's systemd uses are mounted: cgroup2, and v1's ``name=systemd``."""
    found = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        dash = fields.index("-")
        fstype, options = fields[dash + 1], fields[dash + 3].split(",") if len(fields) > dash + 3 else []
        if fstype == "cgroup2" or (fstype == "cgroup" and "name=systemd" in options):
            found.append(Path(fields[4]))
    return found


def machine_of(argv: list[str]) -> str | None:
    """nspawn's ``--machine=`` name."""
    return next((arg.split("=", 1)[1] for arg in argv if arg.startswith("--machine=")), None)


def remove_tree(top: Path, wait_s: float = 0.0) -> bool:
    """Remove a cgroup and its children, deepest first, waiting up to ``wait_s`` for them to empty; whether it
    is gone."""
    deadline = time.monotonic() + wait_s
    while True:
        if not top.exists():
            return True
        for path in [*sorted((d for d in top.rglob("*") if d.is_dir()), key=lambda d: -len(d.parts)), top]:
            with contextlib.suppress(OSError):
                path.rmdir()
        if not top.exists() or time.monotonic() > deadline:
            return not top.exists()
        time.sleep(0.2)


def own_cgroups(machine: str, hierarchies: list[Path]) -> list[Path]:
    """Move this process into ``CGROUP_PARENT/<machine>`` of each hierarchy (what a stale one holds below it is
    removed at each boot: :func:`clear_children`); the cgroups it is in now. A hierarchy it cannot write is left as
    it is."""
    moved = []
    for mount in hierarchies:
        place = mount / CGROUP_PARENT / machine
        try:
            place.mkdir(parents=True, exist_ok=True)
            (place / "cgroup.procs").write_text(f"{os.getpid()}\n")
        except OSError as exc:
            print(f"supervise: {machine} stays in its cgroup of {mount}: {exc}", flush=True)
            continue
        moved.append(place)
    return moved


def leave_cgroups(places: list[Path]) -> None:
    """Back to each hierarchy's root, then remove the node's cgroups."""
    for place in places:
        mount = place.parent.parent
        try:
            (mount / "cgroup.procs").write_text(f"{os.getpid()}\n")
        except OSError:
            continue
        if not remove_tree(place, EMPTY_WAIT_S):
            print(f"supervise: {place} is not empty; left as it is", flush=True)


def clear_children(places: list[Path]) -> None:
    """Remove what a node's previous boot left below its cgroups (nspawn's, its systemd's: their IP filters)."""
    for place in places:
        for child in [d for d in place.iterdir() if d.is_dir()] if place.exists() else []:
            remove_tree(child, EMPTY_WAIT_S)


def supervise(argv: list[str], places: list[Path] | None = None) -> int:
    """Run ``argv`` until it exits for a reason other than a reboot, or until SIGTERM; each boot starts from
    empty ``places`` (the node's cgroups)."""
    child: subprocess.Popen[bytes] | None = None
    stopping = False

    def pass_on(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, pass_on)
    signal.signal(signal.SIGINT, pass_on)
    reboots: list[float] = []
    while True:
        clear_children(places or [])
        child = subprocess.Popen(argv)
        status = child.wait()
        if stopping or status != REBOOT_STATUS:
            return status
        now = time.monotonic()
        reboots = [t for t in reboots if now - t < 60] + [now]
        if len(reboots) > MAX_REBOOTS_PER_MINUTE:
            print(f"supervise: {len(reboots)} reboots in a minute; leaving the node down", flush=True)
            return status
        print("supervise: the node rebooted; starting it again", flush=True)


def main() -> int:
    args = sys.argv[1:]
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        print("usage: python -m gpufleet_lab.supervise -- systemd-nspawn ...", file=sys.stderr)
        return 2
    machine = machine_of(args)
    places = own_cgroups(machine, systemd_hierarchies(Path("/proc/self/mountinfo").read_text())) if machine else []
    try:
        return supervise(args, places)
    finally:
        leave_cgroups(places)


if __name__ == "__main__":
    sys.exit(main())
