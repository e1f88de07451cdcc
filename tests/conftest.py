"""What every tier shares: the tiers' markers, the policy for a missing tool or lab, throwaway projects, the CLI.

The suite has three tiers, one folder each, and each test carries its folder's marker:

- ``tests/unit/``: pure; no root, no lab, no network (loopback at most), the project's own CLI as a subprocess at most;
- ``tests/tools/``: needs a host tool that ``make deps`` installs (promtool, amtool, haproxy, gcc, systemd-analyze);
- ``tests/lab/``: runs against the local lab fleet (root, systemd-nspawn, debootstrap).

A tool or a lab that this machine lacks skips the test with the reason, except where every tier is required (CI, or
``GPUFLEET_TESTS_REQUIRED=1`` as ``.ci/run`` sets): there it is a failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpufleet.config import secrets

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"  # the tests' inputs and expected outputs, by subject
GPUFLEET = [sys.executable, "-m", "gpufleet.cli.main"]
TIERS = ("unit", "tools", "lab")
REQUIRED_ENV = "GPUFLEET_TESTS_REQUIRED"


@pytest.fixture(autouse=True)
def _secrets_read_afresh() -> None:
    """Each test reads its secrets afresh: gpufleet reads each once per process, as one run."""
    secrets.forget()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each test gets the marker of its tier's folder (``pytest -m tools`` selects one tier)."""
    tests = ROOT / "tests"
    for item in items:
        parts = item.path.relative_to(tests).parts if item.path.is_relative_to(tests) else ()
        if parts and parts[0] in TIERS:
            item.add_marker(parts[0])


def every_tier_required() -> bool:
    """Whether a missing tool or lab fails the run (CI, or ``GPUFLEET_TESTS_REQUIRED=1``) instead of skipping."""
    return os.environ.get(REQUIRED_ENV) == "1" or os.environ.get("CI", "").lower() == "true"


def skip_or_fail(reason: str) -> None:
    """Skip with ``reason``, or fail where every tier is required."""
    if every_tier_required():
        pytest.fail(f"every tier is required here, but {reason}", pytrace=False)
    pytest.skip(reason)


def host_tool(name: str, package: str) -> str:
    """The path of a host tool a ``tools`` test runs (from Debian's ``package``, which ``make deps`` installs)."""
    found = shutil.which(name)
    if found is None:
        skip_or_fail(f"{name} is not installed (Debian's {package}: `make deps` installs it as root)")
        raise AssertionError("unreachable")  # skip_or_fail raised
    return found


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
        path.write_text("from gpufleet.inventory.load import apply_group_vars\n"
                        + textwrap.dedent(body) + "\napply_group_vars(globals())\n")
        return path

    def group_vars(self, group: str, text: str) -> Path:
        path = self.root / "group_vars" / f"{group}.yml"
        path.write_text(textwrap.dedent(text))
        return path


@pytest.fixture
def project(tmp_path: Path) -> Project:
    return Project(tmp_path)
