"""The waits that start real servers: a Unix socket's file is not yet a server (HAProxy binds, then listens), and a
reload is done once the old workers hold no listener."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from tests.polling import holding_a_listener, wait_for_socket


def test_a_socket_bound_but_not_listening_is_not_ready_and_one_listening_is(tmp_path: Path) -> None:
    path = str(tmp_path / "admin.sock")
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(path)  # the file exists: HAProxy's state between its bind and its listen
        with pytest.raises(pytest.fail.Exception, match="accepting connections"):
            wait_for_socket(path, timeout_s=0.3)
        server.listen()
        wait_for_socket(path, timeout_s=0.3)


def test_no_file_is_not_ready(tmp_path: Path) -> None:
    with pytest.raises(pytest.fail.Exception, match="accepting connections"):
        wait_for_socket(str(tmp_path / "none.sock"), timeout_s=0.2)


def test_a_process_holds_a_listener_until_it_closes_it_and_one_gone_holds_none() -> None:
    """What a reload waits for: the old HAProxy workers letting go of the listening sockets."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        port = server.getsockname()[1]
        assert holding_a_listener({os.getpid()}, {port}) == set()  # bound, not yet listening
        server.listen()
        assert holding_a_listener({os.getpid()}, {port}) == {os.getpid()}
        assert holding_a_listener({os.getpid()}, {port + 1 if port < 65535 else port - 1}) == set()
        with subprocess.Popen(["sleep", "0"]) as gone:
            gone.wait()
        assert holding_a_listener({gone.pid, os.getpid()}, {port}) == {os.getpid()}
    assert holding_a_listener({os.getpid()}, {port}) == set()
