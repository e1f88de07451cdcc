"""gpufleet's facts and operations as data, the way pyinfra tests its own.

``tests/data/facts/<Fact>/<case>.json``: ``arguments``, the ``command`` the fact runs (optional), the node's
``output`` lines and the parsed ``fact`` (for no output at all: the fact's ``default()``, as pyinfra gives it),
or ``error``, a part of the message of the ``FactProcessError`` it raises.

``tests/data/operations/<module>.<operation>/<case>.json``: ``arguments``, the ``facts`` the node reports (by fact class
name; ``NodeState`` partial), and the ``commands`` the operation yields — or ``noop``, the reason it gives for
yielding none — and ``log``, the lines it logs for the run's output (``[level, line]``), when it logs any. A command
is its text, or ``{"command": text, "_sudo": ...}`` when it sets connector arguments; an upload ``{"upload": dest,
"content": text}`` (plus the ``remote_temp_filename`` it asks for, if any); a Python callback ``{"function": name,
"parameters": [...]}`` (pyinfra hands state and host only to a callback whose parameters are named exactly so).
``"read_only": true`` runs it as deploys/check.py does (it must yield nothing and ``drift`` says whether it was
recorded as drift). Operations run in the case's folder: a controller path among the arguments (``src``) is relative
to it.

Arguments that are not JSON: ``{"$returns": X}`` is a callable returning X (``calls``, when the case has it, says how
many times each such argument was called); ``{"$meta": {"changed": B}}`` an earlier operation's outcome;
``{"$loaded": {"version": V, "why_unknown": W}}`` a loaded kernel module.
"""

from __future__ import annotations

import functools
import importlib
import json
import re
from inspect import getfullargspec
from pathlib import Path
from typing import Any

import pytest
from pyinfra.api import FileUploadCommand, FunctionCommand, StringCommand
from pyinfra.api.exceptions import FactProcessError
from pyinfra.context import ctx_host, ctx_state

from gpufleet.operations import node
from gpufleet.operations.nvidia import LoadedModule
from gpufleet.run.context import deploy_state
from tests.conftest import DATA, ROOT
from tests.unit.fake_hosts import FakeHost, FakeState

FACT_CASES = sorted((DATA / "facts").glob("*/*.json"))


@functools.cache
def _fact_classes() -> dict[str, type]:
    """Every fact class of gpufleet's facts package (``gpufleet/facts/<domain>.py``), by name."""
    from pyinfra.api.facts import FactBase

    found: dict[str, type] = {}
    for module_path in sorted((ROOT / "gpufleet" / "facts").glob("[!_]*.py")):
        module = importlib.import_module(f"gpufleet.facts.{module_path.stem}")
        found |= {name: value for name, value in vars(module).items()
                  if isinstance(value, type) and issubclass(value, FactBase) and value is not FactBase
                  and value.__module__ == module.__name__}
    return found
OPERATION_CASES = sorted((DATA / "operations").glob("*/*.json"))


def _case_id(path: Path) -> str:
    return f"{path.parent.name}/{path.stem}"


def _raw(command: object) -> object:
    return command.get_raw_value() if isinstance(command, StringCommand) else command


@pytest.mark.parametrize("path", FACT_CASES, ids=_case_id)
def test_fact(path: Path) -> None:
    case = json.loads(path.read_text())
    fact = _fact_classes()[path.parent.name]()
    if "command" in case:
        assert _raw(fact.command(**case.get("arguments", {}))) == case["command"]
    if "error" in case:
        with pytest.raises(FactProcessError, match=re.escape(case["error"])):
            fact.process(case["output"])
        return
    # pyinfra calls process() only with some output; without any the fact is its default()
    assert (fact.process(case["output"]) if case["output"] else fact.default()) == case["fact"]


class _Meta:
    def __init__(self, changed: bool = False) -> None:
        self.changed = changed

    def is_complete(self) -> bool:
        return True

    def did_change(self) -> bool:
        return self.changed


class _Returns:
    """A callable argument: returns its value, and counts its calls."""

    def __init__(self, value: Any) -> None:
        self.value, self.calls = value, 0

    def __call__(self) -> Any:
        self.calls += 1
        return self.value


def _argument(value: Any) -> Any:
    if isinstance(value, dict) and len(value) == 1:
        (key, inner), = value.items()
        if key == "$returns":
            return _Returns(inner)
        if key == "$meta":
            return _Meta(**inner)
        if key == "$loaded":
            return LoadedModule(**inner)
    return value


def _shown(command: object) -> object:
    if isinstance(command, StringCommand):
        raw = command.get_raw_value()
        return {"command": raw, **command.connector_arguments} if command.connector_arguments else raw
    if isinstance(command, FileUploadCommand):
        data = command.src.read()
        shown = {"upload": command.dest, "content": data.decode() if isinstance(data, bytes) else data}
        return {**shown, "remote_temp_filename": command.remote_temp_filename} if command.remote_temp_filename \
            else shown
    if isinstance(command, FunctionCommand):
        return {"function": command.function.__name__, "parameters": getfullargspec(command.function).args}
    raise TypeError(f"unexpected command {command!r}")


@pytest.mark.parametrize("path", OPERATION_CASES, ids=_case_id)
def test_operation(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    case = json.loads(path.read_text())
    monkeypatch.chdir(path.parent)
    module_name, op_name = path.parent.name.split(".")
    operation = getattr(importlib.import_module(f"gpufleet.operations.{module_name}"), op_name)
    fake, fake_state = FakeHost(case.get("facts", {})), FakeState()
    if case.get("read_only"):
        deploy_state(fake_state).read_only = True  # type: ignore[arg-type]
    arguments = {key: _argument(value) for key, value in case.get("arguments", {}).items()}
    with ctx_host.use(fake), ctx_state.use(fake_state):
        commands = [_shown(c) for c in operation._inner(**arguments)]
    if case.get("read_only"):
        assert commands == []
        with ctx_state.use(fake_state):
            assert bool(node.drift(fake)) is case["drift"]  # type: ignore[arg-type]
        return
    if "calls" in case:
        assert {key: arguments[key].calls for key in case["calls"]} == case["calls"]
    assert commands == case.get("commands", [])
    assert fake.logged == case.get("log", [])
    if "noop" in case:
        assert fake.noops == [case["noop"]]
    else:
        assert commands, "a case without commands must say why nothing changed (noop)"


def test_every_fact_and_operation_has_cases() -> None:
    """Each fact class of gpufleet.facts and each operation of gpufleet.operations has at least one case."""
    facts = set(_fact_classes())
    assert len(facts) >= 8, facts  # the package's modules were found
    assert facts <= {path.parent.name for path in FACT_CASES}, facts - {path.parent.name for path in FACT_CASES}
    operations = set()
    for module_path in sorted((ROOT / "gpufleet" / "operations").glob("*.py")):
        module = importlib.import_module(f"gpufleet.operations.{module_path.stem}")
        operations |= {f"{module_path.stem}.{name}" for name, value in vars(module).items()
                       if callable(value) and hasattr(value, "_inner") and value.__module__ == module.__name__}
    have = {path.parent.name for path in OPERATION_CASES}
    assert operations <= have, sorted(operations - have)
