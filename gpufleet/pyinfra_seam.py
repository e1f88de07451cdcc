"""Every private surface of pyinfra, pyinfra's CLI and paramiko that gpufleet reads or patches, in one place.

Private means: pyinfra's CLI package (``pyinfra_cli``), attributes pyinfra does not document (its context
objects' current value, an SSH connector's paramiko client), helpers of ``pyinfra.api.util``,
``pyinfra.api.arguments`` and ``pyinfra.api.connectors``, and any replacement of a pyinfra function. Each is one
small function here; the rest of gpufleet calls these and touches none of it (tests/unit/test_pyinfra_seam.py
proves each agrees with the installed pyinfra, and that no other module reaches past this one).

Each surface is checked before use: a patch is made only where pyinfra is within :data:`CHECKED_PYINFRA` and
the patched name is pyinfra's own (else it returns False and pyinfra is left as it is); a read whose surface is
missing raises :class:`SeamError`. pyinfra is imported on use: ``gpufleet check`` does not load it.
"""

from __future__ import annotations

import functools
import importlib.metadata
import operator
import re
import socket
import sys
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from paramiko import SSHClient, Transport
    from pyinfra.api.host import Host
    from pyinfra.api.state import State

CHECKED_PYINFRA = ">=3.6,<4"  # the pyinfra releases this module was written against (pyproject's dependency)

Wrap = Callable[[Callable[..., Any]], Callable[..., Any]]
CONNECTOR_COMMANDS = ("run_shell_command", "put_file", "get_file")  # an SSH connector's methods that talk to the node
_WRAPPED = "_gpufleet_wrapped"  # set on what gpufleet put in pyinfra's place: wrapped once only
_COMPARE = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt, "==": operator.eq,
            "!=": operator.ne}
_CLAUSE = re.compile(r"\s*(>=|<=|==|!=|>|<)\s*(\d+(?:\.\d+)*)\s*")


class SeamError(RuntimeError):
    """The installed pyinfra lacks a surface gpufleet reads, or has it in another shape."""


def release(version: str) -> tuple[int, ...]:
    """The release numbers a version starts with: ``3.10.0`` -> (3, 10, 0), ``3.6.dev1`` -> (3, 6)."""
    numbers: list[int] = []
    for part in version.split("."):
        digits = re.match(r"\d+", part)
        if digits is None:
            break
        numbers.append(int(digits.group()))
        if digits.end() != len(part):
            break
    return tuple(numbers)


def version_in(version: str, spec: str) -> bool:
    """Whether ``version`` meets every clause of ``spec`` (``>=3.6,<4``: comparisons of release numbers)."""
    for clause in spec.split(","):
        match = _CLAUSE.fullmatch(clause)
        if match is None:
            raise ValueError(f"expected a clause like '>=3.6', found {clause!r} in {spec!r}")
        found, wanted = release(version), release(match.group(2))
        width = max(len(found), len(wanted))
        if not _COMPARE[match.group(1)](found + (0,) * (width - len(found)), wanted + (0,) * (width - len(wanted))):
            return False
    return True


@functools.cache
def pyinfra_version() -> str:
    """The installed pyinfra's version."""
    return importlib.metadata.version("pyinfra")


def checked() -> bool:
    """Whether the installed pyinfra is one this module was written against (:data:`CHECKED_PYINFRA`)."""
    return version_in(pyinfra_version(), CHECKED_PYINFRA)


def _surface(module: ModuleType, name: str) -> Any:
    """``module.name``; SeamError, naming the installed and the checked pyinfra, when it is not there."""
    found = getattr(module, name, None)
    if found is None:
        raise SeamError(f"expected {module.__name__}.{name} in pyinfra {pyinfra_version()}, found none"
                        f" (gpufleet was checked against pyinfra {CHECKED_PYINFRA})")
    return found


# -- the context: the host and state pyinfra works on now --------------------------------------------------------

@functools.cache
def _context_manager(name: str) -> Any:
    """pyinfra's context manager of ``host`` or ``state`` (``pyinfra.context.ctx_host``), checked for ``get``."""
    from pyinfra import context

    found = _surface(context, f"ctx_{name}")
    if not callable(getattr(found, "get", None)) or getattr(found, "context", None) is not getattr(context, name):
        raise SeamError(f"expected pyinfra.context.ctx_{name} to hold pyinfra.context.{name} and answer get(), in"
                        f" pyinfra {pyinfra_version()} (gpufleet was checked against pyinfra {CHECKED_PYINFRA})")
    return found


def current_host() -> Host:
    """The host pyinfra works on now: the object behind its ``host`` context proxy, the same key for the whole
    deploy (the proxy itself stands for a different host in each greenlet); None outside a deploy."""
    found: Host = _context_manager("host").get()
    return found


def current_state() -> State:
    """The state of the running deploy: the object behind pyinfra's ``state`` context proxy; None outside one."""
    found: State = _context_manager("state").get()
    return found


# -- the operation order: pyinfra's reader of the call stack, and gpufleet's in its place -----------------------

def pyinfra_order_reader() -> Callable[[Any], list[int]]:
    """pyinfra's own operation-order reader (``pyinfra.api.util.get_operation_order_from_stack``)."""
    from pyinfra.api import util

    reader: Callable[[Any], list[int]] = _surface(util, "get_operation_order_from_stack")
    return reader


def pyinfra_install_dir() -> str:
    """The directory pyinfra is installed in: frames of files under it are pyinfra's own."""
    from pyinfra.api import util

    found: str = _surface(util, "PYINFRA_INSTALL_DIR")
    return found


def install_operation_order(reader: Callable[[Any], list[int]]) -> bool:
    """Make pyinfra order operations with ``reader``; False (pyinfra left as it is) when pyinfra is not one this
    was checked against or does not call its own reader from ``pyinfra.api.operation``."""
    operation = sys.modules.get("pyinfra.api.operation")
    if not checked() or operation is None:
        return False
    if getattr(operation, "get_operation_order_from_stack", None) not in (pyinfra_order_reader(), reader):
        return False
    operation.get_operation_order_from_stack = reader  # type: ignore[attr-defined]
    return True


# -- pyinfra's CLI: whether it runs, and its reading of the inventory file ---------------------------------------

def under_pyinfra_cli() -> bool:
    """Whether pyinfra's CLI is loaded in this process (it imports ``pyinfra_cli`` before it reads any file)."""
    return "pyinfra_cli" in sys.modules


def wrap_inventory_exec(wrap: Wrap) -> bool:
    """Make pyinfra's CLI execute the inventory file through ``wrap(its own exec_file)``, once; False (pyinfra
    left as it is) when wrapped already, or pyinfra is not one this was checked against, or its CLI reads the
    inventory with a function other than its own ``exec_file``."""
    import pyinfra_cli.inventory as cli_inventory
    import pyinfra_cli.util as cli_util

    original = getattr(cli_inventory, "exec_file", None)
    if not checked() or original is None or getattr(original, _WRAPPED, False):
        return False
    if original is not getattr(cli_util, "exec_file", None) or not callable(original):
        return False
    wrapped = wrap(original)
    setattr(wrapped, _WRAPPED, True)
    cli_inventory.exec_file = wrapped
    return True


def cli_file_error(exc: BaseException) -> BaseException:
    """The file's own error that pyinfra's CLI wrapped while executing it (its ``exception``), else ``exc``."""
    found: BaseException = getattr(exc, "exception", None) or exc
    return found


# -- host data and global arguments pyinfra reads ----------------------------------------------------------------

def global_argument_names() -> list[str]:
    """The names of pyinfra's global operation arguments (``_sudo``, ``_env``…)."""
    from pyinfra.api import arguments

    return [name for name, _ in _surface(arguments, "all_global_arguments")()]


def connector_data_keys() -> set[str]:
    """Every host data key an installed pyinfra connector declares (``ssh_user``, ``docker_identifier``…)."""
    from pyinfra.api import connectors

    keys: set[str] = set()
    for connector in _surface(connectors, "get_all_connectors")().values():
        keys.update(getattr(connector, "data_meta", None) or {})
    return keys


def connector_arguments(state: State, host: Host, given: dict[str, Any]) -> dict[str, Any]:
    """The connector arguments a command on ``host`` gets, as pyinfra resolves them for an operation: ``given``,
    then the host's data, then the config (``_sudo``, ``_timeout``…); operation-only arguments left out."""
    from pyinfra.api import arguments

    resolved, _ = _surface(arguments, "pop_global_arguments")(state, host, given)
    keys = _surface(arguments, "CONNECTOR_ARGUMENT_KEYS")
    return {key: value for key, value in resolved.items() if key in keys}


# -- an SSH connection: its paramiko client, transport and socket ------------------------------------------------

def ssh_client(host: Host) -> SSHClient | None:
    """The paramiko client of ``host``'s SSH connector; None for another connector, or before it connects."""
    found: SSHClient | None = getattr(getattr(host, "connector", None), "client", None)
    return found


def ssh_transport(host: Host) -> Transport | None:
    """The paramiko transport of ``host``'s SSH connection; None when it has none (not connected, or closed)."""
    client = ssh_client(host)
    return client.get_transport() if client is not None else None


def transport_socket(transport: Transport) -> socket.socket | None:
    """The TCP socket under a paramiko transport; None for a proxied one (a proxy command's pipe)."""
    sock = getattr(transport, "sock", None)
    return sock if isinstance(sock, socket.socket) else None


def wrap_connector_commands(host: Host, wrap: Wrap) -> bool:
    """Replace each of :data:`CONNECTOR_COMMANDS` of ``host``'s connector with ``wrap(method)``, once per
    connector; False when it has no connector, is wrapped already, or pyinfra is not one this was checked
    against."""
    connector = getattr(host, "connector", None)
    if connector is None or getattr(connector, _WRAPPED, False) or not checked():
        return False
    for name in CONNECTOR_COMMANDS:
        if callable(method := getattr(connector, name, None)):
            setattr(connector, name, wrap(method))
    setattr(connector, _WRAPPED, True)
    return True
