"""Files where gpufleet expects a file: a named pipe, device or directory is refused from its type without
reading it (no hang), and JSON nested too deep is refused from its text (no RecursionError)."""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from gpufleet.gpu.report import FactsError, load_facts

DEEP = "[" * 5000 + "]" * 5000


def _named_pipe(path: Path) -> None:
    os.mkfifo(path)


def _directory(path: Path) -> None:
    path.mkdir()


def _device(path: Path) -> None:
    path.symlink_to("/dev/zero")


def _deep_json(path: Path) -> None:
    path.write_text('{"schema": ' + DEEP + "}")


def _dangling(path: Path) -> None:
    path.symlink_to(path.parent / "nowhere.json")


@pytest.mark.parametrize(("make", "expected"), [
    (_named_pipe, "expected a facts file, found a named pipe"),
    (_directory, "expected a facts file, found a directory"),
    (_device, "expected a facts file, found a device"),
    (_deep_json, "expected JSON nested at most 64 levels deep, found deeper"),
    (_dangling, "expected a readable file, found No such file or directory"),
])
def test_a_facts_file_that_is_no_file_is_one_line_without_reading_it(
        make: Callable[[Path], None], expected: str, tmp_path: Path) -> None:
    path = tmp_path / "gpu-a01.json"
    make(path)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # a read that blocks shows as a timeout, not a hang
        future = pool.submit(load_facts, path)
        with pytest.raises(FactsError) as caught:
            future.result(timeout=10)
    assert str(caught.value) == f"{path}: {expected}"


def test_gpufleet_plan_facts_fifo_exits_2(tmp_path: Path) -> None:
    """``gpufleet plan --facts DIR`` with a FIFO as a host's facts: one line, exit 2."""
    from click.testing import CliRunner

    from gpufleet.cli.main import main
    from tests.conftest import DATA

    facts = tmp_path / "facts"
    facts.mkdir()
    inventory = DATA / "plans" / "a_single_node_70b" / "inventory.py"
    hosts = [line.split('"')[1] for line in inventory.read_text().splitlines() if line.strip().startswith('("')]
    for host in hosts:
        os.mkfifo(facts / f"{host}.json")
    done = CliRunner().invoke(main, ["plan", "--facts", str(facts), str(inventory)])
    assert done.exit_code == 2, done.output
    assert done.stderr.splitlines()[0] == f"{facts / hosts[0]}.json: expected a facts file, found a named pipe"
