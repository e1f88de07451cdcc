"""Waiting in tests that run real processes, polled and bounded: for a condition (failing with what was awaited),
or for a server to accept connections (on a port, or on a Unix socket)."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

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


def listening_inodes(ports: set[int]) -> set[str]:
    """The socket inodes listening on any of ``ports`` (TCP, IPv4 or IPv6) in this network namespace."""
    found: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) in ports:  # 0A: LISTEN
                found.add(fields[9])
    return found


def holding_a_listener(pids: set[int], ports: set[int]) -> set[int]:
    """The processes among ``pids`` that still hold a socket listening on one of ``ports`` (a HAProxy worker told to
    stop lets go of its listeners before it finishes its requests; one gone holds none)."""
    sockets = {f"socket:[{inode}]" for inode in listening_inodes(ports)}
    holding = set()
    for pid in pids:
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in sockets for fd in os.listdir(f"/proc/{pid}/fd")):
                holding.add(pid)
        except (FileNotFoundError, ProcessLookupError):
            continue  # the process, or one of its descriptors, is gone
    return holding
