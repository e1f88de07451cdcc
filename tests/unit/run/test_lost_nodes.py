"""A node lost during a deploy: its SSH connection is bounded, and the host is named once."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest
from paramiko import SSHException

from gpufleet.run import lost_nodes


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


def test_a_connection_ended_under_a_command_is_an_ssh_error_for_pyinfra(tcp: socket.socket) -> None:
    """pyinfra fails the host's operation on an SSH error; paramiko's EOFError would stop the whole deploy."""
    calls: list[str] = []

    class Connector:
        client = type("Client", (), {"get_transport": lambda _self: _Transport(tcp)})()

        def run_shell_command(self, command: str) -> tuple[bool, list[str]]:
            calls.append(command)
            if command == "lost":
                raise EOFError()
            return True, []

        def put_file(self, *args: Any) -> bool:
            raise EOFError()

    host = _Host(None)
    host.connector = Connector()
    lost_nodes.watch_connection(host)  # type: ignore[arg-type]
    lost_nodes.watch_connection(host)  # type: ignore[arg-type]  # a reconnect: wrapped once
    assert host.connector.run_shell_command("true") == (True, [])
    with pytest.raises(SSHException, match=r"the connection to 10\.0\.0\.5 was lost"):
        host.connector.run_shell_command("lost")
    with pytest.raises(SSHException):
        host.connector.put_file("a", "b")
    assert calls == ["true", "lost"]


def test_a_lost_host_whose_operation_had_nothing_to_run_fails_all_the_same(tcp: socket.socket) -> None:
    failed: list[set[Any]] = []
    state = type("State", (), {"fail_hosts": lambda _self, hosts: failed.append(hosts)})()
    watch = lost_nodes._Watch()
    alive, gone = _Host(_Transport(tcp)), _Host(_Transport(tcp, active=False), "10.0.0.6")
    for host in (alive, gone):
        watch.operation_host_success(state, host, "op", 0)  # type: ignore[arg-type]
    assert failed == [{gone}] and watch.lost == {"10.0.0.6"}


def test_a_lost_node_records_no_versions_for_its_replica(tcp: socket.socket) -> None:
    """A node lost while its replica's versions are read fails there and records nothing: the other nodes of the
    replica are not failed for disagreeing with a node that is merely gone."""
    from pyinfra.context import ctx_host, ctx_state

    from gpufleet.operations import vllm as vllm_ops

    gone = _Host(_Transport(tcp, active=False), "10.0.0.6")
    gone.get_fact = lambda *args, **kwargs: None  # type: ignore[attr-defined]
    gone.noop = lambda text: None  # type: ignore[attr-defined]
    stacks: dict[str, Any] = {}
    with ctx_state.use(type("State", (), {"is_executing": True})()), ctx_host.use(gone):
        commands = list(vllm_ops.node_stack._inner(python="/x/python", package="vllm", model="m", model_dir="/m",
                                                   stacks=stacks))
    assert stacks == {} and len(commands) == 1
