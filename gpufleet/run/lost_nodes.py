"""Noticing a node lost during a deploy: SSH connections that fail within a bound instead of hanging.

A node that loses power or its network sends nothing more: no FIN, no RST. pyinfra waits on the command it
started there until TCP gives up, which takes a quarter of an hour. Every connection of a deploy therefore
sends an SSH keepalive every :data:`KEEPALIVE_S` seconds, and its socket has ``TCP_USER_TIMEOUT`` set: data
the node does not acknowledge within :data:`LOST_AFTER_S` seconds closes the connection. The command then
fails on that host as an SSH error (pyinfra drops the host from the rest of the deploy and exits non-zero),
the other hosts go on, and the lost node is named once. Connections made later (after a reboot) get the same
settings through a pyinfra state callback.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable
from functools import wraps
from typing import Any

from paramiko import SSHException
from pyinfra.api.host import Host
from pyinfra.api.state import BaseStateCallback, State

from gpufleet.pyinfra_seam import ssh_client, ssh_transport, transport_socket, wrap_connector_commands

KEEPALIVE_S = 5
LOST_AFTER_S = 30


def _lost_as_ssh_error(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` of an SSH connector, raising :class:`SSHException` where paramiko raises ``EOFError``: the
    connection ended while a command was being started. pyinfra fails the host's operation on an SSH error, but
    takes any other exception for an error of its own and stops the whole deploy."""

    @wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except EOFError as exc:
            raise SSHException(f"the connection to {name} was lost") from exc

    return call


def watch_connection(host: Host) -> bool:
    """Give ``host``'s SSH connection its keepalive and its bound; False when it has no plain TCP socket (a
    connector other than SSH, or a proxied connection), which keeps pyinfra's defaults."""
    wrap_connector_commands(host, lambda method: _lost_as_ssh_error(host.name, method))
    transport = ssh_transport(host)
    if transport is None:
        return False
    transport.set_keepalive(KEEPALIVE_S)
    sock = transport_socket(transport)
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return False
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, max(1, LOST_AFTER_S // KEEPALIVE_S))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, LOST_AFTER_S * 1000)
    return True


def connection_lost(host: Host) -> bool:
    """Whether ``host`` had an SSH connection and it is closed now (the node stopped answering)."""
    transport = ssh_transport(host)
    return ssh_client(host) is not None and (transport is None or not transport.is_active())


class _Watch(BaseStateCallback):
    """Every connection pyinfra opens later in the deploy gets the same settings; a host whose operation failed
    because its connection is gone is named, once."""

    def __init__(self) -> None:
        self.lost: set[str] = set()

    @staticmethod
    def host_connect(state: State, host: Host) -> None:
        watch_connection(host)

    def _name(self, host: Host) -> None:
        if host.name not in self.lost:
            self.lost.add(host.name)
            print(f"gpufleet: [{host.name}] lost during the deploy: no answer over SSH for {LOST_AFTER_S} s; the"
                  " other nodes go on, and a rerun once it is back finishes its part", file=sys.stderr)

    def operation_host_error(self, state: State, host: Host, op_hash: Any, *_: Any) -> None:  # type: ignore[override]
        if connection_lost(host):
            self._name(host)

    def operation_host_success(self, state: State, host: Host, op_hash: Any, *_: Any) -> None:  # type: ignore[override]
        if connection_lost(host):  # nothing ran there (its facts read as defaults): it is gone all the same
            self._name(host)
            state.fail_hosts({host})


def watch(state: State) -> None:
    """Bound every connection of the deploy, those open now and those opened later; name lost nodes."""
    state.add_callback_handler(_Watch())
    for target in state.inventory:
        if target.connected:
            watch_connection(target)
