"""Nodes for ``gpufleet diag`` in this process: a fake node (a folder standing for its root, and stand-in
``systemctl`` and ``journalctl`` that print the case's units and journals) on which the real node tool
``diag_collect.py`` runs, and a :class:`gpufleet.diag.collect.NodeRemote` over such nodes (the tool's own words
run here, its archive in /var/tmp as on a node)."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Collection, Sequence
from pathlib import Path

from gpufleet.diag.collect import TOOL
from gpufleet.remote.commands import RemoteResult

ROOT = Path(__file__).resolve().parents[2]
NODE_TOOL = ROOT / "gpufleet" / "node" / "diag_collect.py"

_JOURNALCTL = """#!/bin/sh
# the case's journals: --dmesg prints kernel.log, --unit U prints U.log, --list-boots boots.json, --boot=ID
# boot-ID.log; HANG makes it never end
[ -e {journals}/HANG ] && exec sleep 300
case " $* " in
  *" --dmesg "*) exec cat {journals}/kernel.log 2>/dev/null ;;
  *" --list-boots "*) exec cat {journals}/boots.json 2>/dev/null ;;
  *" --boot="*) for a in "$@"; do case "$a" in --boot=*) exec cat "{journals}/boot-${{a#--boot=}}.log" ;; esac; done ;;
esac
while [ $# -gt 0 ]; do [ "$1" = --unit ] && exec cat "{journals}/$2.log" 2>/dev/null; shift; done
"""
_SYSTEMCTL = """#!/bin/sh
# list-units: the case's units; show: each one's properties, a block each
case "$1" in
  list-units) for u in {units}; do echo "$u loaded active running stand-in"; done ;;
  show) shift; for u in "$@"; do [ "$u" = "--" ] || [ "${{u#--}}" != "$u" ] && continue
          printf 'Id=%s\\nActiveState=active\\nSubState=running\\nResult=success\\nNRestarts=2\\n' "$u"
          printf 'ExecStart={{ path=/x ; argv[]=/x serve ; }}\\n\\n'; done ;;
esac
"""


class FakeNode:
    """A node's root below ``folder/root``, its stand-in commands in ``folder/bin`` and journals in
    ``folder/journals`` (``<unit>.log``, ``kernel.log``)."""

    def __init__(self, folder: Path, units: Sequence[str] = ()) -> None:
        self.root, self.bin, self.journals = folder / "root", folder / "bin", folder / "journals"
        for made in (self.root, self.bin, self.journals):
            made.mkdir(parents=True)
        (self.bin / "journalctl").write_text(_JOURNALCTL.format(journals=self.journals))
        (self.bin / "systemctl").write_text(_SYSTEMCTL.format(units=" ".join(units)))
        for tool in ("journalctl", "systemctl"):
            (self.bin / tool).chmod(0o755)

    def file(self, node_path: str, text: str) -> Path:
        """Write a file of the node (``/etc/...``) below its root."""
        path = self.root / node_path.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path

    def journal(self, unit: str, text: str) -> None:
        (self.journals / f"{unit}.log").write_text(text)

    def hang(self) -> None:
        """Its journalctl never ends from now on."""
        (self.journals / "HANG").touch()

    def run(self, args: Sequence[str], timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        """The node tool with ``args`` (after ``collect``: the root below the folder), its stand-ins first on PATH."""
        extra = ["--root", str(self.root)] if args and args[0] in ("collect", "captures", "capture") else []
        return subprocess.run([sys.executable, "-I", str(NODE_TOOL), *args, *extra], capture_output=True, text=True,
                              timeout=timeout_s, env={"PATH": f"{self.bin}:/usr/bin:/bin"}, check=False)


class LocalNodes:
    """A :class:`gpufleet.diag.collect.NodeRemote` over fake nodes by host: the words of the node tool run the real
    tool on the host's fake node; a host in ``silent`` never answers; every call is recorded."""

    def __init__(self, nodes: dict[str, FakeNode], silent: Collection[str] = ()) -> None:
        self.nodes, self.silent = nodes, set(silent)
        self.calls: list[tuple[str, list[str]]] = []
        self.closed = 0
        self.release = threading.Event()  # set: the silent hosts give up at once (the test's end)

    def run(self, host: str, words: Sequence[str], *, timeout_s: float,
            ok_status: Collection[int] = (0,)) -> RemoteResult:
        self.calls.append((host, list(words)))
        if host in self.silent:
            self.release.wait(timeout_s)
            return RemoteResult(False, "", f"{host}: the command did not end within {timeout_s:g} s")
        if list(words[:len(TOOL)]) != list(TOOL):
            return RemoteResult(False, "", f"{host}: not the node tool: {words[0]}")
        try:
            done = self.nodes[host].run(list(words[len(TOOL):]), timeout_s)
        except subprocess.TimeoutExpired:
            return RemoteResult(False, "", f"{host}: the command did not end within {timeout_s:g} s")
        return RemoteResult(done.returncode in ok_status, done.stdout, done.stderr)

    def get_bytes(self, host: str, path: str, max_bytes: int) -> tuple[RemoteResult, bytes]:
        self.calls.append((host, ["get", path]))
        data = Path(path).read_bytes()
        return (RemoteResult(True, "", ""), data) if len(data) <= max_bytes else (RemoteResult(False, "", "big"), b"")

    def close(self) -> None:
        self.closed += 1
