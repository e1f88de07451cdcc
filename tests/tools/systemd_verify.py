"""``systemd-analyze verify`` (Debian's ``systemd``) of units as gpufleet writes them, from a throwaway root with
stub programs at the paths the units run (systemd checks that they are executable) and stub units for their
dependencies."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from tests.conftest import host_tool
from tests.unit.unit_files import Unit


def stub_root(root: Path, units: list[Unit]) -> None:
    """A root where systemd-analyze finds our units, stub programs, and stub units for their dependencies."""
    system = root / "etc" / "systemd" / "system"
    system.mkdir(parents=True)
    for stub in ("sysinit.target", "basic.target", "shutdown.target", "multi-user.target", "network-online.target",
                 "sockets.target", "paths.target", "timers.target", "system.slice", "-.slice",
                 "nvidia-dcgm.service", "vllm@.service"):  # vllm@ for its watchdog (a unit overwrites it)
        (system / stub).write_text("[Unit]\nDescription=stub\n" +
                                   ("[Service]\nExecStart=/bin/true\n" if stub.endswith(".service") else ""))
    (root / "bin").mkdir()
    shutil.copy("/bin/true", root / "bin" / "true")
    for unit in units:
        for program in unit.programs:
            path = root / program.lstrip("/")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("#!/bin/sh\n")
            path.chmod(0o755)
        if unit.drop_in_for:
            (system / unit.drop_in_for).write_text(
                f"[Unit]\nDescription=Debian's unit\n[Service]\nExecStart={unit.programs[0]}\n")
        (system / unit.name).parent.mkdir(parents=True, exist_ok=True)
        (system / unit.name).write_text(unit.text)
        for name, text in unit.extra.items():
            (system / name).write_text(text)


def verify_unit(root: Path, name: str) -> None:
    """``systemd-analyze verify`` of unit ``name`` in ``root``: it passes, with no complaint in its output."""
    systemd_analyze = host_tool("systemd-analyze", "systemd")
    done = subprocess.run([systemd_analyze, "verify", "--man=no", f"--root={root}", name],
                          capture_output=True, text=True, timeout=120)
    complaints = [line for line in (done.stdout + done.stderr).splitlines()
                  if re.search(r"Unknown|ignoring|Unbalanced|Invalid|Failed|not executable|bad", line, re.I)]
    assert done.returncode == 0 and not complaints, done.stdout + done.stderr
