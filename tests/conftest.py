"""Shared fixtures: throwaway projects with an inventory and group_vars, and the real CLI."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPUFLEET = [sys.executable, "-m", "gpufleet.cli"]


@dataclass
class Result:
    rc: int
    out: str
    err: str


def run_cli(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> Result:
    """Run the real ``gpufleet`` command in a subprocess."""
    proc = subprocess.run([*GPUFLEET, *args], cwd=cwd or ROOT, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=120)
    return Result(proc.returncode, proc.stdout, proc.stderr)


class Project:
    """A temporary project: inventories/<name>.py and group_vars/*.yml beside it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "inventories").mkdir()
        (root / "group_vars").mkdir()

    def inventory(self, body: str, name: str = "fleet") -> Path:
        path = self.root / "inventories" / f"{name}.py"
        path.write_text("from gpufleet.config.inventory import apply_group_vars\n"
                        + textwrap.dedent(body) + "\napply_group_vars(globals())\n")
        return path

    def group_vars(self, group: str, text: str) -> Path:
        path = self.root / "group_vars" / f"{group}.yml"
        path.write_text(textwrap.dedent(text))
        return path


@pytest.fixture
def project(tmp_path: Path) -> Project:
    return Project(tmp_path)
