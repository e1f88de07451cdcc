"""A node lost during a deploy: its SSH connection is bounded, and the host is named once."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

from gpufleet.deploy import lost_nodes


class _Transport:
    def __init__(self, sock: Any, active: bool = True) -> None:
        self.sock, self.active, self.keepalive = sock, active, 0

    def set_keepalive(self, interval: int) -> None:
        self.keepalive = interval

    def is_active(self) -> bool:
        return self.active


class _Host:
    def __init__(self, transport: _Transport | None, name: str = "10.0.0.5") -> None:
        client = type("Client", (), {"get_transport": lambda _self: transport})()
        self.connector = type("Connector", (), {"client": client})()
        self.name, self.connected = name, True


@pytest.fixture
def tcp() -> Iterator[socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        try:
            yield client
        finally:
            client.close()


def test_a_tcp_connection_gets_keepalives_and_a_bound(tcp: socket.socket) -> None:
    transport = _Transport(tcp)
    assert lost_nodes.watch_connection(_Host(transport))  # type: ignore[arg-type]
    assert transport.keepalive == lost_nodes.KEEPALIVE_S
    assert tcp.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
    assert tcp.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == lost_nodes.LOST_AFTER_S * 1000
    assert tcp.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == lost_nodes.KEEPALIVE_S


def test_no_connection_or_no_socket_keeps_the_defaults() -> None:
    assert not lost_nodes.watch_connection(_Host(None))  # type: ignore[arg-type]
    proxied = _Transport(object())  # a proxy command's pipe: keepalives only
    assert not lost_nodes.watch_connection(_Host(proxied))  # type: ignore[arg-type]
    assert proxied.keepalive == lost_nodes.KEEPALIVE_S


def test_a_host_whose_connection_closed_is_named_once(tcp: socket.socket, capsys: pytest.CaptureFixture[str]) -> None:
    watch = lost_nodes._Watch()
    alive, gone = _Host(_Transport(tcp)), _Host(_Transport(tcp, active=False), "10.0.0.6")
    for host in (alive, gone, gone):  # an operation failed on each; the second failure of 10.0.0.6 says nothing
        watch.operation_host_error(None, host, "op", 0, 0)  # type: ignore[arg-type]
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"gpufleet: [10.0.0.6] lost during the deploy: no answer over SSH for {lost_nodes.LOST_AFTER_S} s; the other"
        " nodes go on, and a rerun once it is back finishes its part"]
