"""Waiting in tests that run real processes, polled and bounded: for a condition (failing with what was awaited),
or for a server to accept connections (on a port, or on a Unix socket)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import pytest


def until(condition: Callable[[], bool], what: str, timeout_s: float = 10, every: float = 0.05) -> float:
    """Poll ``condition`` every ``every`` seconds until it holds; the seconds it took. Fails the test naming
    ``what`` after ``timeout_s``."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout_s:
            pytest.fail(f"not within {timeout_s} s: {what}")
        time.sleep(every)
    return time.monotonic() - started


def wait_for_port(port: int, timeout: float = 15.0) -> None:
    """Wait until a server accepts connections on ``port`` of 127.0.0.1; the last refusal raises after ``timeout``
    seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def wait_for_socket(path: str, timeout_s: float = 15.0) -> None:
    """Wait until a server accepts connections on the Unix socket at ``path``. The file alone is not enough: HAProxy
    binds (so the file appears) before it listens, and a connection in between is refused."""

    def accepts() -> bool:
        with socket.socket(socket.AF_UNIX) as probe:
            try:
                probe.connect(path)
            except (FileNotFoundError, ConnectionRefusedError):
                return False
            return True

    until(accepts, f"a server accepting connections on {path}", timeout_s=timeout_s)
