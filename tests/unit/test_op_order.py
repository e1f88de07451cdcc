"""gpufleet's operation-order reader gives pyinfra exactly the list pyinfra's own reader computes."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyinfra
import pytest
from pyinfra.api import util as pyinfra_util

from gpufleet.deploy import op_order

# A deploy file as pyinfra's CLI runs it: compiled under its relative name, operations called from nested
# functions, some calls spanning lines, one from a loop.
DEPLOY = '''\
def role(n):
    for i in range(n):
        record(
            i,
        )
    record(n)


def site():
    role(2)
    record(
        "last",
    )


site()
'''


def _both(state: Any) -> tuple[list[int], list[int]]:
    return op_order._PYINFRA_READER(state), op_order.operation_order(state)  # one line: the same caller frame


_SOURCE = Path(__file__).read_text().splitlines()
_BOTH_LINE = next(i for i, line in enumerate(_SOURCE, 1) if "one line: the same caller frame" in line)
_RECORD_LINE = next(i for i, line in enumerate(_SOURCE, 1) if line.endswith("# _RECORD_LINE"))


def _run_deploy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, deploy_name: str | None) -> list[tuple[Any, ...]]:
    monkeypatch.chdir(tmp_path)
    Path("deploys").mkdir()
    Path("deploys/site.py").write_text(DEPLOY)
    state = SimpleNamespace(current_deploy_filename=deploy_name, current_op_file_number=3)
    seen: list[tuple[Any, ...]] = []

    def record(*_: object) -> None:
        seen.append(_both(state))  # _RECORD_LINE

    exec(compile(DEPLOY, "deploys/site.py", "exec"), {"record": record})  # the test's own text
    return seen


@pytest.mark.parametrize("is_cli", [True, False])
@pytest.mark.parametrize("deploy_name", ["deploys/site.py", None, "deploys/elsewhere.py"])
def test_the_same_order_as_pyinfras_reader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, is_cli: bool,
                                          deploy_name: str | None) -> None:
    monkeypatch.setattr(pyinfra, "is_cli", is_cli)
    seen = _run_deploy(tmp_path, monkeypatch, deploy_name)
    assert len(seen) == 4
    for theirs, ours in seen:
        assert ours == theirs
    deploy_file_number = [3] if is_cli else []
    if deploy_name == "deploys/site.py":  # the lines from the deploy file in: site(), role(2), the loop's call
        assert seen[0][1] == [*deploy_file_number, 16, 10, 3, _RECORD_LINE, _BOTH_LINE]
        assert len({tuple(ours) for _, ours in seen}) == 3  # the loop's two calls share one call site
    elif deploy_name == "deploys/elsewhere.py":  # not on the stack: the deploy file's number only
        assert {tuple(ours) for _, ours in seen} == {tuple(deploy_file_number)}


def test_install_gives_pyinfra_the_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    module = sys.modules["pyinfra.api.operation"]
    monkeypatch.setattr(module, "get_operation_order_from_stack", pyinfra_util.get_operation_order_from_stack)
    assert op_order.install() is True
    assert module.get_operation_order_from_stack is op_order.operation_order  # type: ignore[attr-defined]
    assert op_order.install() is True  # again: nothing changes


def test_install_leaves_a_pyinfra_it_does_not_know_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    module = sys.modules["pyinfra.api.operation"]

    def other_reader(state: Any) -> list[int]:
        return []

    monkeypatch.setattr(module, "get_operation_order_from_stack", other_reader)
    assert op_order.install() is False
    assert module.get_operation_order_from_stack is other_reader  # type: ignore[attr-defined]
