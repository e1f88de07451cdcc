"""A fleet is its own directory: the README's commands copy the example into one outside the checkout, and gpufleet
reads that directory's group_vars (not the checkout's) with the roles' defaults from the checkout."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT

SECTION = "## Your fleet, in a directory of its own"


def _commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    start = text.index(SECTION)
    (block,) = re.findall(r"^```sh\n(.*?)^```$", text[start:text.index("\n## ", start + 1)], re.S | re.M)
    return [line for line in block.splitlines() if line.strip()]


def _run(line: str, home: Path, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """``line`` as a shell runs it from ``cwd`` (the checkout), with ``home`` as $HOME and the project's programs
    first."""
    env = {**os.environ, "HOME": str(home), "PATH": f"{ROOT / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_the_readmes_fleet_directory_is_checked_from_its_own_group_vars(tmp_path: Path) -> None:
    commands = _commands()
    assert commands[-1].startswith("gpufleet check ")
    for line in commands:
        done = _run(line, tmp_path)
        assert done.returncode == 0, (line, done.stdout, done.stderr)
    assert "6 hosts in 2 pools: configuration valid" in done.stdout, done.stdout
    fleet = tmp_path / "fleets" / "prod"
    with (fleet / "group_vars" / "all.yml").open("a") as copy:  # the copy's values are the ones read
        copy.write("vllm_port: 80\n")
    refused = _run(commands[-1], tmp_path)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert refused.stderr.startswith(f"{fleet}/group_vars/all.yml: vllm_port: "), refused.stderr


def test_a_fleet_directory_inside_the_checkout_is_ignored_by_git() -> None:
    ignored = subprocess.run(["git", "check-ignore", "-q", "fleets/prod/inventory.py"], cwd=ROOT)
    assert ignored.returncode == 0, "fleets/ is not in .gitignore"


def _example_fleet(directory: Path) -> Path:
    """The production example copied into ``directory``; its inventory."""
    directory.mkdir(parents=True)
    shutil.copy(ROOT / "inventories" / "prod.py", directory / "inventory.py")
    shutil.copytree(ROOT / "group_vars", directory / "group_vars")
    return directory / "inventory.py"


@pytest.mark.parametrize(("make", "found"), [
    (lambda path: path.write_text("vllm_port: 8001\n"), "a regular file"),
    (lambda path: path.symlink_to("nowhere"), "a link to nothing"),
    (lambda path: path.symlink_to("/dev/zero"), "a device"),
])
def test_a_group_vars_that_is_no_directory_is_named_not_skipped(tmp_path: Path, make: Any, found: str) -> None:
    inventory = _example_fleet(tmp_path / "fleet")
    shutil.rmtree(inventory.parent / "group_vars")
    make(inventory.parent / "group_vars")
    done = _run(f"gpufleet check {inventory}", tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.splitlines()[0] == f"{inventory.parent}/group_vars: expected a directory of <group>.yml files," \
                                          f" found {found}", done.stderr


@pytest.mark.parametrize(("argument", "found"), [("''", "an empty path"), ("pipe", "a named pipe"),
                                                 ("/dev/null", "a device"), ("missing.py", "no such file")])
def test_an_inventory_that_is_no_file_is_named_by_what_it_is(tmp_path: Path, argument: str, found: str) -> None:
    os.mkfifo(tmp_path / "pipe")
    done = _run(f"gpufleet check {argument}", tmp_path, cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().endswith(f"expected an inventory file, found {found}"), done.stderr
