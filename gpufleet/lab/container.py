"""One node's container: a ``systemd-nspawn -b`` process started in its own session, and how to stop it.

The host's PID 1 is not systemd, so nothing supervises the containers: the lab starts nspawn with
``setsid`` semantics, records its PID and the PID of the container's systemd (nspawn's child in a new
PID namespace), each with its start time, and stops them by those records only. SIGTERM to nspawn makes
the container's systemd shut down cleanly; if that takes too long, SIGKILL to the container's PID 1 ends
its whole PID namespace.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from gpufleet.lab.state import ProcessRecord

# Popen objects of the nspawn processes this Python process started (reaped when they exit).
_children: dict[int, subprocess.Popen[bytes]] = {}


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, start ticks) from /proc/PID/stat, or None if there is no such process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    return fields[0], int(fields[1]), int(fields[19])


def record(pid: int) -> ProcessRecord | None:
    found = _stat(pid)
    return ProcessRecord(pid, found[2]) if found else None


def _reap(pid: int) -> None:
    child = _children.get(pid)
    if child is not None and child.poll() is not None:
        del _children[pid]


def alive(proc: ProcessRecord | None) -> bool:
    """True while the recorded process runs (same PID and start time, not a zombie)."""
    if proc is None:
        return False
    _reap(proc.pid)
    found = _stat(proc.pid)
    return found is not None and found[2] == proc.start_ticks and found[0] != "Z"


def start(root: Path, machine: str, hostname: str, bridge: str, console_log: Path) -> ProcessRecord:
    """Boot ``root`` with systemd as PID 1 on ``bridge``; the console goes to ``console_log``."""
    argv = [
        "systemd-nspawn",
        f"--directory={root}",
        f"--machine={machine}",
        f"--hostname={hostname}",
        "--boot",
        "--register=no",  # no machined on this host
        "--keep-unit",  # and no systemd to create a scope in
        f"--network-bridge={bridge}",
        "--link-journal=no",
        "--resolv-conf=off",  # the node's own /etc/resolv.conf: no DNS in the lab
        "--timezone=off",
        "--console=read-only",
    ]
    with open(console_log, "ab") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    _children[proc.pid] = proc
    found = record(proc.pid)
    if found is None:  # exited at once: the caller reads the console log
        return ProcessRecord(proc.pid, -1)
    return found


def find_leader(nspawn: ProcessRecord, timeout: float = 10.0) -> ProcessRecord | None:
    """The container's PID 1 as the host sees it: nspawn's child in another PID namespace."""
    own_ns = os.readlink("/proc/self/ns/pid")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and alive(nspawn):
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            found = _stat(int(entry.name))
            if found is None or found[1] != nspawn.pid:
                continue
            try:
                if os.readlink(entry / "ns" / "pid") != own_ns:
                    return ProcessRecord(int(entry.name), found[2])
            except OSError:
                continue
        time.sleep(0.05)
    return None


def signal_process(proc: ProcessRecord | None, sig: signal.Signals) -> bool:
    """Send ``sig`` if the recorded process still runs; False when it does not."""
    if proc is None or not alive(proc):
        return False
    try:
        os.kill(proc.pid, sig)
    except ProcessLookupError:
        return False
    return True


def wait_gone(procs: list[ProcessRecord], timeout: float) -> list[ProcessRecord]:
    """Wait until every process has exited; those still running at the deadline."""
    deadline = time.monotonic() + timeout
    remaining = [p for p in procs if alive(p)]
    while remaining and time.monotonic() < deadline:
        time.sleep(0.1)
        remaining = [p for p in remaining if alive(p)]
    return remaining
