"""The waits that start real servers: a Unix socket's file is not yet a server (HAProxy binds, then listens)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.polling import wait_for_socket


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
