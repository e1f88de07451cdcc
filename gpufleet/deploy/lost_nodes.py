"""Noticing a node lost during a deploy: SSH connections that fail within a bound instead of hanging.

A node that loses power or its network sends nothing more: no FIN, no RST. pyinfra waits on the command it
started there until TCP gives up, which takes a quarter of an hour. Every connection of a deploy therefore
sends an SSH keepalive every :data:`KEEPALIVE_S` seconds, and its socket has ``TCP_USER_TIMEOUT`` set: data
the node does not acknowledge within :data:`LOST_AFTER_S` seconds closes the connection. The command then
fails on that host (pyinfra drops the host from the rest of the deploy and exits non-zero), the other hosts go
on, and :func:`report` names the lost nodes at the end. Connections made later (after a reboot) get the same
settings through a pyinfra state callback.
"""

from __future__ import annotations

import socket
import sys
from typing import Any

from pyinfra.api.host import Host
from pyinfra.api.state import BaseStateCallback, State

KEEPALIVE_S = 5
LOST_AFTER_S = 30


def watch_connection(host: Host) -> bool:
    """Give ``host``'s SSH connection its keepalive and its bound; False when it has no plain TCP socket (a
    connector other than SSH, or a proxied connection), which keeps pyinfra's defaults."""
    client = getattr(host.connector, "client", None)
    transport = client.get_transport() if client is not None else None
    if transport is None:
        return False
    transport.set_keepalive(KEEPALIVE_S)
    sock = getattr(transport, "sock", None)
    if not isinstance(sock, socket.socket) or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return False
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, max(1, LOST_AFTER_S // KEEPALIVE_S))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, LOST_AFTER_S * 1000)
    return True


def connection_lost(host: Host) -> bool:
    """Whether ``host`` had an SSH connection and it is closed now (the node stopped answering)."""
    client = getattr(host.connector, "client", None)
    transport = client.get_transport() if client is not None else None
    return client is not None and (transport is None or not transport.is_active())


class _Watch(BaseStateCallback):
    """Every connection pyinfra opens later in the deploy gets the same settings; a host whose operation failed
    because its connection is gone is named, once."""

    def __init__(self) -> None:
        self.lost: set[str] = set()

    @staticmethod
    def host_connect(state: State, host: Host) -> None:
        watch_connection(host)

    def operation_host_error(self, state: State, host: Host, op_hash: Any, *_: Any) -> None:  # type: ignore[override]
        if host.name not in self.lost and connection_lost(host):
            self.lost.add(host.name)
            print(f"gpufleet: [{host.name}] lost during the deploy: no answer over SSH for {LOST_AFTER_S} s; the"
                  " other nodes go on, and a rerun once it is back finishes its part", file=sys.stderr)


def watch(state: State) -> None:
    """Bound every connection of the deploy, those open now and those opened later; name lost nodes."""
    state.add_callback_handler(_Watch())
    for target in state.inventory:
        if target.connected:
            watch_connection(target)
