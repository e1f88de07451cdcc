"""gpufleet's seam to pyinfra's private surfaces (gpufleet/pyinfra_seam.py) agrees with the installed pyinfra, and
no other module of gpufleet, roles or deploys reaches past it.

For each surface: it is there with the shape gpufleet expects, and what gpufleet does with it is what pyinfra
itself does (gpufleet's operation-order reader gives pyinfra exactly the list pyinfra's own reader computes, the
connector arguments are those pyinfra resolves, the wrapped inventory reader is the one pyinfra's CLI calls...).
"""

from __future__ import annotations

import ast
import os
import socket
import sys
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import gevent
import paramiko
import pyinfra
import pytest
from pyinfra.api import Config, Inventory, State
from pyinfra.api.command import StringCommand
from pyinfra.api.state import StateStage
from pyinfra.context import ctx_config, ctx_host, ctx_state, host, state
from pyinfra.operations import server

from gpufleet import pyinfra_seam as seam
from gpufleet.run import op_order
from tests.unit.pyinfra_cli_modules import pyinfra_cli_modules

ROOT = Path(os.environ.get("GPUFLEET_SEAM_ROOT", Path(__file__).resolve().parents[2]))


# -- the version range ------------------------------------------------------------------------------------------

def test_the_checked_range_is_the_dependency_of_the_package() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert f"pyinfra{seam.CHECKED_PYINFRA}" in project["dependencies"]


def test_the_installed_pyinfra_is_in_the_checked_range() -> None:
    assert seam.checked()
    assert seam.release(seam.pyinfra_version())[0] == 3


@pytest.mark.parametrize("version", ["2.9", "3.5.9", "3.6", "3.6.0", "3.10.0", "3.10.0.post1", "3.99.1", "4",
                                     "4.0.0", "4.0.1", "10.0"])
def test_the_range_is_read_as_packaging_reads_it(version: str) -> None:
    specifiers = pytest.importorskip("packaging.specifiers")
    expected = specifiers.SpecifierSet(seam.CHECKED_PYINFRA).contains(version)
    assert seam.version_in(version, seam.CHECKED_PYINFRA) is expected


def test_a_pre_release_counts_as_its_release() -> None:
    assert seam.release("3.6.dev1") == (3, 6) and seam.release("4.0.0rc1") == (4, 0, 0)
    assert seam.version_in("3.6.dev1", ">=3.6") and not seam.version_in("4.0.0rc1", "<4")


def test_a_range_it_cannot_read_is_refused() -> None:
    with pytest.raises(ValueError, match="expected a clause like"):
        seam.version_in("3.6", "~=3.6")


# -- the context: the host and the state pyinfra works on now ---------------------------------------------------

def test_the_current_host_and_state_are_the_objects_behind_pyinfras_proxies() -> None:
    inventory = Inventory((["@local"], {}))
    deploy = State(inventory, Config())
    target = inventory.get_host("@local")
    with ctx_state.use(deploy), ctx_host.use(target):
        assert seam.current_host() is target and seam.current_state() is deploy
        assert host.name == seam.current_host().name and state.inventory is seam.current_state().inventory
        assert host == seam.current_host()  # the proxy compares as the object it stands for


def test_each_greenlet_has_its_own_current_host() -> None:
    inventory = Inventory((["a.example", "b.example"], {}))
    found: dict[str, Any] = {}

    def work(name: str) -> None:
        target = inventory.get_host(name)
        with ctx_host.use(target):
            gevent.sleep(0)  # the other greenlet sets its host meanwhile
            found[name] = seam.current_host()

    gevent.joinall([gevent.spawn(work, name) for name in ("a.example", "b.example")])
    assert {name: target.name for name, target in found.items()} == {"a.example": "a.example",
                                                                     "b.example": "b.example"}


def test_outside_a_deploy_there_is_no_current_host_or_state() -> None:
    with ctx_host.use(None), ctx_state.use(None):  # whatever an earlier test left set
        assert seam.current_host() is None and seam.current_state() is None


# -- the operation order --------------------------------------------------------------------------------------

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
    return seam.pyinfra_order_reader()(state), op_order.operation_order(state)  # one line: the same caller frame


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


def test_pyinfras_own_frames_are_those_under_its_install_dir() -> None:
    operation_file = sys.modules["pyinfra.api.operation"].__file__
    assert operation_file is not None and operation_file.startswith(seam.pyinfra_install_dir())
    assert not __file__.startswith(seam.pyinfra_install_dir())
    assert Path(seam.pyinfra_install_dir()) == Path(pyinfra.__file__).parent


def test_install_gives_pyinfra_the_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    module = sys.modules["pyinfra.api.operation"]
    monkeypatch.setattr(module, "get_operation_order_from_stack", seam.pyinfra_order_reader())
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


def test_install_leaves_a_pyinfra_outside_the_checked_range_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    module = sys.modules["pyinfra.api.operation"]
    monkeypatch.setattr(module, "get_operation_order_from_stack", seam.pyinfra_order_reader())
    monkeypatch.setattr(seam, "pyinfra_version", lambda: "4.0.0")
    assert op_order.install() is False
    assert module.get_operation_order_from_stack is seam.pyinfra_order_reader()  # type: ignore[attr-defined]


def test_pyinfra_orders_an_operation_it_adds_with_the_installed_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    module = sys.modules["pyinfra.api.operation"]
    monkeypatch.setattr(module, "get_operation_order_from_stack", seam.pyinfra_order_reader())
    monkeypatch.setattr(pyinfra, "is_cli", True)
    asked: list[str] = []

    def reader(state: Any) -> list[int]:
        asked.append(state.inventory.get_host("@local").name)
        return [1, 2, 3]

    assert seam.install_operation_order(reader)
    inventory = Inventory((["@local"], {}))
    deploy = State(inventory, Config())
    deploy.set_stage(StateStage.Prepare)  # the CLI adds operations from the deploy file in this stage
    with ctx_state.use(deploy), ctx_host.use(inventory.get_host("@local")), ctx_config.use(deploy.config.copy()):
        server.shell(commands=["true"])
    assert asked == ["@local"]
    assert [meta.op_order for meta in deploy.op_meta.values()] == [(1, 2, 3)]  # pyinfra ordered it by the reader


# -- pyinfra's CLI: whether it runs, and its reading of the inventory file --------------------------------------

@pytest.fixture
def pyinfra_cli(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, ModuleType]]:
    """pyinfra's CLI modules in ``sys.modules`` (imported without gevent's monkey-patching) for one test, with its
    ``exec_file`` restored after it."""
    modules = pyinfra_cli_modules()
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    inventory = modules["pyinfra_cli.inventory"]
    monkeypatch.setattr(inventory, "exec_file", modules["pyinfra_cli.util"].exec_file)
    yield modules


def test_under_pyinfras_cli_is_whether_its_package_is_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "pyinfra_cli", raising=False)
    assert not seam.under_pyinfra_cli()
    monkeypatch.setitem(sys.modules, "pyinfra_cli", ModuleType("pyinfra_cli"))
    assert seam.under_pyinfra_cli()


def _cli_state(tmp_path: Path) -> State:
    deploy = State(check_for_changes=False)
    deploy.cwd = str(tmp_path)
    return deploy


def test_the_cli_reads_the_inventory_through_the_wrapped_exec_file(
        pyinfra_cli: dict[str, ModuleType], tmp_path: Path) -> None:
    read: list[str] = []

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def reading(filename: str, *args: Any, **kwargs: Any) -> Any:
            read.append(filename)
            return original(filename, *args, **kwargs)

        return reading

    assert seam.wrap_inventory_exec(wrap)
    assert not seam.wrap_inventory_exec(wrap)  # once only
    inventory_file = tmp_path / "fleet.py"
    inventory_file.write_text('hosts = ["@local"]\n')
    with ctx_state.use(_cli_state(tmp_path)), ctx_config.use(Config()):
        made = pyinfra_cli["pyinfra_cli.inventory"].make_inventory(str(inventory_file), cwd=str(tmp_path))
    assert read == [str(inventory_file)] and [h.name for h in made] == ["@local"]


def test_an_exec_file_that_is_not_pyinfras_own_is_left_alone(pyinfra_cli: dict[str, ModuleType],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    def someone_elses(*args: Any, **kwargs: Any) -> Any:
        return {}

    monkeypatch.setattr(pyinfra_cli["pyinfra_cli.inventory"], "exec_file", someone_elses)
    assert not seam.wrap_inventory_exec(lambda original: original)
    assert pyinfra_cli["pyinfra_cli.inventory"].exec_file is someone_elses


def test_the_file_error_is_the_one_pyinfras_cli_wrapped(pyinfra_cli: dict[str, ModuleType], tmp_path: Path) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("raise LookupError('no such pool')\n")
    with ctx_state.use(_cli_state(tmp_path)), pytest.raises(Exception) as raised:  # pyinfra wraps it in its own
        pyinfra_cli["pyinfra_cli.util"].exec_file(str(broken), return_locals=True)
    assert not isinstance(raised.value, LookupError)  # pyinfra wraps it
    found = seam.cli_file_error(raised.value)
    assert isinstance(found, LookupError) and str(found) == "no such pool"
    plain = ValueError("as it is")
    assert seam.cli_file_error(plain) is plain


# -- host data and global arguments pyinfra reads -----------------------------------------------------------------

def test_the_global_arguments_are_those_pyinfra_resolves_for_an_operation() -> None:
    from pyinfra.api.arguments import pop_global_arguments

    names = seam.global_argument_names()
    assert {"_sudo", "_env", "_timeout", "_success_exit_codes", "_if", "_serial"} <= set(names)
    inventory = Inventory((["@local"], {}))
    given = {"_sudo": True, "path": "/etc"}
    resolved, _ = pop_global_arguments(State(inventory, Config()), inventory.get_host("@local"), given)
    assert sorted(resolved) == sorted(names)
    assert given == {"path": "/etc"}  # taken out of the operation's own arguments


def test_every_connector_data_key_is_one_its_connector_declares() -> None:
    from pyinfra.connectors.local import LocalConnector
    from pyinfra.connectors.ssh import SSHConnector

    keys = seam.connector_data_keys()
    assert {"ssh_user", "ssh_port", "ssh_key", "ssh_known_hosts_file"} <= keys
    assert set(SSHConnector.data_meta) <= keys and set(LocalConnector.data_meta) <= keys
    assert not any(key.startswith("_") for key in keys)  # those are global arguments


def test_connector_arguments_are_pyinfras_for_a_command(tmp_path: Path) -> None:
    inventory = Inventory(([("@local", {"_chdir": str(tmp_path), "_serial": True})], {}))
    deploy = State(inventory, Config())
    target = inventory.get_host("@local")
    found = seam.connector_arguments(deploy, target, {"_timeout": 7, "_success_exit_codes": [0, 3]})
    assert found["_timeout"] == 7 and found["_success_exit_codes"] == [0, 3]  # given
    assert found["_chdir"] == str(tmp_path)  # from the host's data
    assert "_serial" not in found and "_if" not in found  # how to run the operation, not the command
    target.connect(raise_exceptions=True)
    try:
        ok, output = target.run_shell_command(StringCommand("pwd; exit 3"), **found)
    finally:
        target.disconnect()
    assert ok and output.stdout.strip() == str(tmp_path)


# -- an SSH connection ---------------------------------------------------------------------------------------------

def test_an_ssh_hosts_client_is_none_until_it_connects_and_another_connector_has_none() -> None:
    inventory = Inventory((["10.0.0.5", "@local"], {}))
    State(inventory, Config())  # gives each host its connector
    remote, local = inventory.get_host("10.0.0.5"), inventory.get_host("@local")
    assert hasattr(type(remote.connector), "client") and seam.ssh_client(remote) is None
    assert seam.ssh_transport(remote) is None
    assert seam.ssh_client(local) is None and seam.ssh_transport(local) is None


def test_the_transport_of_a_client_and_its_socket_are_paramikos() -> None:
    left, right = socket.socketpair()
    try:
        transport = paramiko.Transport(left)
        client = paramiko.SSHClient()
        client._transport = transport  # a connected client's transport (the test's stand-in for connect())
        target = SimpleNamespace(connector=SimpleNamespace(client=client))
        assert seam.ssh_client(target) is client  # type: ignore[arg-type]
        assert seam.ssh_transport(target) is transport  # type: ignore[arg-type]
        assert seam.transport_socket(transport) is left
        assert seam.transport_socket(SimpleNamespace(sock=object())) is None  # type: ignore[arg-type]
    finally:
        left.close()
        right.close()


def test_an_ssh_connectors_commands_are_wrapped_once() -> None:
    inventory = Inventory((["10.0.0.5"], {}))
    State(inventory, Config())
    target = inventory.get_host("10.0.0.5")
    originals = {name: getattr(target.connector, name) for name in seam.CONNECTOR_COMMANDS}
    assert all(callable(method) for method in originals.values())  # pyinfra's SSH connector has each
    wrapped: list[Callable[..., Any]] = []

    def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
        wrapped.append(method)
        return lambda *args, **kwargs: ("wrapped", method)

    assert seam.wrap_connector_commands(target, wrap)
    assert not seam.wrap_connector_commands(target, wrap)  # a reconnect: wrapped once
    assert wrapped == list(originals.values())
    assert target.connector.run_shell_command(StringCommand("true")) == ("wrapped", originals["run_shell_command"])


# -- no module but the seam reaches past it -----------------------------------------------------------------------

SEAM = "gpufleet/pyinfra_seam.py"
PRIVATE_MODULES = ("pyinfra_cli", "pyinfra.api.util", "pyinfra.api.arguments", "pyinfra.api.connectors")
# Names of those modules the rest may import, each with why: the types operations are written with.
ALLOWED_NAMES = {("pyinfra.api.arguments", "ConnectorArguments"): "the type of an operation's connector arguments"}
PYINFRA_OBJECTS = {"host", "state", "inventory", "config", "connector", "client", "transport"}  # pyinfra's, by name


def _sources() -> Iterator[Path]:
    for folder in ("gpufleet", "roles", "deploys"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if relative != SEAM and not relative.startswith("gpufleet/node/"):  # the node tools: no pyinfra
                yield path


def _private(module: str) -> bool:
    return any(module == name or module.startswith(f"{name}.") for name in PRIVATE_MODULES)


def _reaches(node: ast.AST) -> str | None:
    """What ``node`` reaches of pyinfra's private surfaces, or None."""
    if isinstance(node, ast.Import):
        found = [alias.name for alias in node.names if _private(alias.name)]
        return f"imports {found[0]}" if found else None
    if isinstance(node, ast.ImportFrom) and node.module and not node.level:
        if _private(node.module):
            names = [a.name for a in node.names if (node.module, a.name) not in ALLOWED_NAMES]
            return f"imports {', '.join(names)} from {node.module}" if names else None
        found = [a.name for a in node.names if _private(f"{node.module}.{a.name}")]
        return f"imports {found[0]} from {node.module}" if found else None
    if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
        owner = node.value
        name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
        if name in PYINFRA_OBJECTS or name.startswith("pyinfra"):
            return f"reads {name}.{node.attr}"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr",
                                                                                             "hasattr"):
        literal = node.args[1] if len(node.args) > 1 else None
        if isinstance(literal, ast.Constant) and isinstance(literal.value, str) and literal.value.startswith("_"):
            return f"{node.func.id}(..., {literal.value!r})"
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and _private(node.value.strip()):
        return f"names {node.value.strip()}"
    return None


def violations() -> list[str]:
    found = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (what := _reaches(node)) is not None:
                found.append(f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}: {what}")
    return found


def test_only_the_seam_reaches_pyinfras_private_surfaces() -> None:
    found = violations()
    assert not found, ("only gpufleet/pyinfra_seam.py may touch pyinfra's CLI, pyinfra.api.util/arguments/"
                       "connectors or underscore attributes of pyinfra's objects; route these through it:\n"
                       + "\n".join(found))


def test_the_rule_sees_each_kind_of_reach(tmp_path: Path) -> None:
    sample = ("import pyinfra_cli.inventory\nfrom pyinfra.api.util import PYINFRA_INSTALL_DIR\n"
              "from pyinfra.api import connectors\nfrom pyinfra.api.arguments import ConnectorArguments\n"
              "x = host._get_module()\ny = getattr(connector, '_gpufleet_watched', False)\n"
              "z = sys.modules.get('pyinfra_cli')\nw = self._cache\n")
    found = [what for node in ast.walk(ast.parse(sample)) if (what := _reaches(node)) is not None]
    assert sorted(found) == sorted([
        "imports pyinfra_cli.inventory", "imports PYINFRA_INSTALL_DIR from pyinfra.api.util",
        "imports connectors from pyinfra.api", "reads host._get_module", "getattr(..., '_gpufleet_watched')",
        "names pyinfra_cli"])
