"""One node's container: ``systemd-nspawn -b`` under a small supervisor, and how to stop it.

The host's PID 1 is not systemd, so nothing else supervises the containers. The lab starts
:mod:`gpufleet_lab.supervise` in its own session (``setsid``); it runs nspawn and starts it again when
the node reboots. The lab records the supervisor's PID with its start time (a PID alone may be reused)
and finds the rest when it needs them: the node's nspawn by its ``--directory=<node root>`` argument,
the node's PID 1 (systemd) as nspawn's child in another PID namespace.

Stopping: SIGTERM to the supervisor, which passes it to nspawn, which has the node's systemd shut down
cleanly. Whatever still runs after the grace period gets SIGKILL, the node's PID 1 first (that ends its
whole PID namespace). Cutting the power: SIGKILL to the node's PID 1 at once; nspawn, which then cleans up
after its container (its veth), and the supervisor end by themselves within the grace period.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from gpufleet.node_paths import MODELS_DIR
from gpufleet_lab.state import ProcessRecord

log = logging.getLogger(__name__)

# Popen objects of the supervisors this Python process started (reaped when they exit).
_children: dict[int, subprocess.Popen[bytes]] = {}


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, start ticks) from /proc/PID/stat, or None if there is no such process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    return fields[0], int(fields[1]), int(fields[19])


def _pids() -> list[int]:
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]


def record(pid: int) -> ProcessRecord | None:
    found = _stat(pid)
    return ProcessRecord(pid, found[2]) if found else None


def alive(proc: ProcessRecord | None) -> bool:
    """True while the recorded process runs (same PID and start time, not a zombie)."""
    if proc is None:
        return False
    child = _children.get(proc.pid)
    if child is not None and child.poll() is not None:
        del _children[proc.pid]
    found = _stat(proc.pid)
    return found is not None and found[2] == proc.start_ticks and found[0] != "Z"


def nspawn_argv(root: Path, machine: str, hostname: str, bridge: str, model_disk: Path) -> list[str]:
    """How a node boots: systemd as PID 1 in its own namespaces, one veth on the lab bridge, and ``model_disk`` (a
    directory of this machine) mounted at the node's model directory, as GPU servers keep their models on a disk of
    their own (its filesystem is then reported apart from the root's overlay, which node_exporter leaves out)."""
    return [
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
        # nspawn's seccomp filter refuses bpf(2) by default, and without it the node's systemd silently
        # ignores IPAddressAllow=/IPAddressDeny= (cgroup BPF): allowed, the units' IP filters are enforced.
        "--system-call-filter=bpf",
        f"--bind={model_disk}:{MODELS_DIR}",
    ]


def start(root: Path, machine: str, hostname: str, bridge: str, console_log: Path, model_disk: Path) -> ProcessRecord:
    """Boot ``root`` under the supervisor, with ``model_disk`` (created when missing) as its model directory; the
    node's console goes to ``console_log``."""
    model_disk.mkdir(mode=0o755, exist_ok=True)
    argv = [sys.executable, "-m", "gpufleet_lab.supervise", "--",
            *nspawn_argv(root, machine, hostname, bridge, model_disk)]
    with open(console_log, "ab") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    _children[proc.pid] = proc
    return record(proc.pid) or ProcessRecord(proc.pid, -1)  # -1: exited at once; the console log says why


def nspawns_for(root: Path) -> list[ProcessRecord]:
    """Running systemd-nspawn processes booting ``root`` (found by their ``--directory=`` argument)."""
    wanted = f"--directory={root}".encode()
    found = []
    for pid in _pids():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"systemd-nspawn") and wanted in argv:
            proc = record(pid)
            if proc is not None and alive(proc):
                found.append(proc)
    return found


def leaders_of(nspawn: ProcessRecord) -> list[ProcessRecord]:
    """The node's PID 1 as the host sees it: nspawn's child in another PID namespace."""
    own_ns = os.readlink("/proc/self/ns/pid")
    found = []
    for pid in _pids():
        stat = _stat(pid)
        if stat is None or stat[1] != nspawn.pid:
            continue
        try:
            if os.readlink(f"/proc/{pid}/ns/pid") != own_ns:
                found.append(ProcessRecord(pid, stat[2]))
        except OSError:
            continue
    return found


def _signal(proc: ProcessRecord, sig: signal.Signals) -> None:
    if alive(proc):
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)


def _running(supervisor: ProcessRecord | None, root: Path) -> list[ProcessRecord]:
    return ([supervisor] if supervisor is not None and alive(supervisor) else []) + nspawns_for(root)


def _kill_leaders(root: Path) -> list[ProcessRecord]:
    """SIGKILL to the PID 1 of each nspawn booting ``root`` (its whole PID namespace ends); those nspawns."""
    found = nspawns_for(root)
    for nspawn in found:
        for leader in leaders_of(nspawn):
            _signal(leader, signal.SIGKILL)
    return found


def stop(nodes: list[tuple[ProcessRecord | None, Path]], grace: float, kill_wait: float = 10.0,
         cut_power: bool = False) -> list[int]:
    """Stop every node (its supervisor and the nspawn booting its root), cleanly or (``cut_power``) at once; PIDs
    that outlived SIGKILL."""
    for supervisor, root in nodes:
        if cut_power:
            _kill_leaders(root)
        elif supervisor is not None and alive(supervisor):
            _signal(supervisor, signal.SIGTERM)  # passed on to nspawn
        else:
            for nspawn in nspawns_for(root):  # a node whose supervisor is gone
                _signal(nspawn, signal.SIGTERM)
    deadline = time.monotonic() + grace
    left = [n for n in nodes if _running(*n)]
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [n for n in left if _running(*n)]
    if left:
        log.warning("%d node(s) did not shut down in %.0f s; killing them", len(left), grace)
    for supervisor, root in left:
        for nspawn in _kill_leaders(root):
            _signal(nspawn, signal.SIGKILL)
        if supervisor is not None:
            _signal(supervisor, signal.SIGKILL)
    deadline = time.monotonic() + kill_wait
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [n for n in left if _running(*n)]
    return [p.pid for n in left for p in _running(*n)]
