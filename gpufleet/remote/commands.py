"""Commands on inventory hosts from the controller, over pyinfra's own connections.

A rollout drives the routers and reads the replicas' release records between pyinfra runs. It connects the way a
deploy does: pyinfra's ``State`` over the inventory, each host's connector and its ``ssh_*`` data (known_hosts
checking as configured), privilege escalation (``_sudo`` ...) from the host's data, and gpufleet's bound on a
lost connection (:func:`gpufleet.run.lost_nodes.watch_connection`). A host is connected on its first command.

A command is a list of words, each checked (:func:`command_line`) and quoted for the shell: no word can be read by
the shell as anything but itself.
"""

from __future__ import annotations

import io
import re
import shlex
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from paramiko import SSHException
from pyinfra.api.command import StringCommand
from pyinfra.api.config import Config
from pyinfra.api.exceptions import ConnectError
from pyinfra.api.host import Host
from pyinfra.api.inventory import Inventory
from pyinfra.api.state import State

from gpufleet.pyinfra_seam import connector_arguments
from gpufleet.run.lost_nodes import watch_connection

_WORD = re.compile(r"[A-Za-z0-9_./:=@%+,-]{1,4096}")  # names, paths, numbers, KEY=VALUE: no shell syntax


class RemoteError(Exception):
    """A command that must not be run (a word that is not plain)."""


@dataclass(frozen=True)
class RemoteResult:
    """What a command left: whether it exited with an accepted status (False also when the host could not be
    reached: ``stderr`` says why), and its output."""

    ok: bool
    stdout: str
    stderr: str

    def line(self) -> str:
        """The last line of its error output (or of its output), for a one-line report."""
        lines = (self.stderr or self.stdout).strip().splitlines()
        return lines[-1].strip() if lines else "no output"


class Remote(Protocol):
    """Runs one command on one inventory host."""

    def run(self, host: str, words: Sequence[str], *, timeout_s: float,
            ok_status: Collection[int] = (0,)) -> RemoteResult: ...


def command_line(words: Sequence[str]) -> str:
    """The shell line of ``words``, each checked and quoted; RemoteError for an empty command or a word holding
    anything but letters, digits and ``_ . / : = @ % + , -``."""
    if not words:
        raise RemoteError("refusing to run an empty command")
    for word in words:
        if not _WORD.fullmatch(word):
            raise RemoteError(f"refusing to run a command with the word {word!r}")
    return shlex.join(words)


class PyinfraRemote:
    """:class:`Remote` over a fresh pyinfra ``Inventory`` (one per rollout: pyinfra does not share them)."""

    def __init__(self, inventory: Inventory) -> None:
        self.state = State(inventory, Config())

    def _host(self, name: str) -> Host:
        found: Host = self.state.inventory.get_host(name)
        if not found.connected:
            found.connect(raise_exceptions=True, show_errors=False)
            watch_connection(found)
        return found

    def run(self, host: str, words: Sequence[str], *, timeout_s: float,
            ok_status: Collection[int] = (0,)) -> RemoteResult:
        line = command_line(words)
        result, lost = self._attempt(host, line, timeout_s, ok_status)
        if lost:  # a connection that dropped while the rollout waited is made again, once
            self.state.inventory.get_host(host).disconnect()
            result, _ = self._attempt(host, line, timeout_s, ok_status)
        return result

    def _attempt(self, host: str, line: str, timeout_s: float,
                 ok_status: Collection[int]) -> tuple[RemoteResult, bool]:
        """The command's result, and whether it failed because the connection was lost."""
        try:
            target = self._host(host)
            given: dict[str, Any] = {"_timeout": max(1, round(timeout_s)), "_success_exit_codes": list(ok_status)}
            connector = connector_arguments(self.state, target, given)
            ok, output = target.run_shell_command(StringCommand(line), **connector)
        except ConnectError as exc:
            return RemoteResult(False, "", f"{host}: cannot connect: {' '.join(str(exc).split())}"), False
        except TimeoutError:
            return RemoteResult(False, "", f"{host}: the command did not end within {timeout_s:g} s"), False
        except (OSError, EOFError, SSHException) as exc:
            return RemoteResult(False, "", f"{host}: {type(exc).__name__}: {' '.join(str(exc).split())}"), True
        return RemoteResult(bool(ok), output.stdout, output.stderr), False

    def put_text(self, host: str, path: str, text: str) -> RemoteResult:
        """Write ``text`` to ``path`` on ``host`` (a file the connection's user, or its ``_sudo``, may write)."""
        return self.put_bytes(host, path, text.encode())

    def put_bytes(self, host: str, path: str, data: bytes) -> RemoteResult:
        """Write ``data`` to ``path`` on ``host`` (a file the connection's user, or its ``_sudo``, may write)."""
        try:
            target = self._host(host)
            connector = connector_arguments(self.state, target, {"_timeout": 60})
            ok = target.put_file(io.BytesIO(data), path, **connector)
        except ConnectError as exc:
            return RemoteResult(False, "", f"{host}: cannot connect: {' '.join(str(exc).split())}")
        except (OSError, EOFError, SSHException, TimeoutError) as exc:
            return RemoteResult(False, "", f"{host}: {type(exc).__name__}: {' '.join(str(exc).split())}")
        return RemoteResult(bool(ok), "", "" if ok else f"{host}: could not write {path}")

    def get_bytes(self, host: str, path: str, max_bytes: int) -> tuple[RemoteResult, bytes]:
        """The bytes of ``path`` on ``host``, read by the connection's own user (never through ``_sudo``, whose
        download goes through a world-readable copy): at most ``max_bytes``, else a failure."""
        sink = io.BytesIO()
        try:
            target = self._host(host)
            connector = connector_arguments(self.state, target, {"_timeout": 60, "_sudo": False, "_su_user": None})
            ok = target.get_file(path, sink, **connector)
        except ConnectError as exc:
            return RemoteResult(False, "", f"{host}: cannot connect: {' '.join(str(exc).split())}"), b""
        except (OSError, EOFError, SSHException, TimeoutError) as exc:
            return RemoteResult(False, "", f"{host}: {type(exc).__name__}: {' '.join(str(exc).split())}"), b""
        data = sink.getvalue()
        if ok and len(data) > max_bytes:
            return RemoteResult(False, "", f"{host}: {path} holds {len(data):,} bytes, over {max_bytes:,}"), b""
        return RemoteResult(bool(ok), "", "" if ok else f"{host}: could not read {path}"), data if ok else b""

    def close(self) -> None:
        """Close every connection made."""
        for found in self.state.inventory:
            if found.connected:
                found.disconnect()
