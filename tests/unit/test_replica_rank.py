"""replica_rank.py binds a multi-node replica's ranks: any rank that ends stops every rank, each exits for a
restart. Real processes on loopback; a stand-in for vLLM that records its pid and sleeps."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "gpufleet" / "node" / "replica_rank.py"
FAKE_VLLM = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(600)"
PEER_LOST = 75


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_for(path: Path, timeout: float = 15) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return int(path.read_text())
        time.sleep(0.05)
    raise AssertionError(f"{path.name} never appeared")


class Replica:
    """Two ranks of one replica on loopback, each a replica_rank.py process running the stand-in."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        port = _free_port()
        self.ranks: dict[int, subprocess.Popen[bytes]] = {}
        self.config = {"nodes": 2, "leader": "127.0.0.1", "port": port, "bind": "127.0.0.1"}

    def start(self, rank: int) -> None:
        config = self.tmp / f"ranks{rank}.json"
        config.write_text(json.dumps({**self.config, "rank": rank}))
        self.ranks[rank] = subprocess.Popen(
            [sys.executable, str(TOOL), str(config), "--", sys.executable, "-c", FAKE_VLLM,
             str(self.pidfile(rank))], stderr=subprocess.PIPE)

    def pidfile(self, rank: int) -> Path:
        return self.tmp / f"vllm{rank}.pid"

    def exit_status(self, rank: int, timeout: float = 30) -> int:
        return self.ranks[rank].wait(timeout)

    def log(self, rank: int) -> str:
        stderr = self.ranks[rank].stderr
        return stderr.read().decode() if stderr is not None else ""

    def stop(self) -> None:
        for process in self.ranks.values():
            if process.poll() is None:
                process.kill()
                process.wait()


@pytest.fixture
def replica(tmp_path: Path) -> Iterator[Replica]:
    found = Replica(tmp_path)
    yield found
    found.stop()


def test_one_node_becomes_vllm(tmp_path: Path) -> None:
    config = tmp_path / "ranks.json"
    config.write_text(json.dumps({"rank": 0, "nodes": 1}))
    done = subprocess.run([sys.executable, str(TOOL), str(config), "--", sys.executable, "-c",
                           "import os; print(os.getppid())"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0
    assert done.stdout.strip() == str(os.getpid())  # exec'd: vLLM's parent is the tool's own parent, this test


def test_vllm_starts_only_once_every_rank_is_there(replica: Replica) -> None:
    replica.start(1)  # the follower first: it waits for the leader
    time.sleep(1.5)
    assert not replica.pidfile(1).exists()
    replica.start(0)
    assert _alive(_wait_for(replica.pidfile(0)))
    assert _alive(_wait_for(replica.pidfile(1)))


@pytest.mark.parametrize("killed", [0, 1])
def test_a_killed_rank_stops_every_rank(replica: Replica, killed: int) -> None:
    replica.start(0)
    replica.start(1)
    pids = {rank: _wait_for(replica.pidfile(rank)) for rank in (0, 1)}
    os.kill(pids[killed], signal.SIGKILL)
    assert replica.exit_status(0) == PEER_LOST
    assert replica.exit_status(1) == PEER_LOST
    time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids.values())
    assert "vLLM exited with status -9" in replica.log(killed)
    assert "connection ended" in replica.log(1 - killed)


def test_stopping_the_leader_stops_the_follower_for_a_restart(replica: Replica) -> None:
    replica.start(0)
    replica.start(1)
    pids = {rank: _wait_for(replica.pidfile(rank)) for rank in (0, 1)}
    replica.ranks[0].send_signal(signal.SIGTERM)
    assert replica.exit_status(0) == 0  # stopped on purpose
    assert replica.exit_status(1) == PEER_LOST  # systemd starts it again: it waits for the next leader
    time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids.values())


def test_a_restarted_follower_joins_a_new_generation(replica: Replica) -> None:
    replica.start(0)
    replica.start(1)
    first = {rank: _wait_for(replica.pidfile(rank)) for rank in (0, 1)}
    os.kill(first[1], signal.SIGKILL)
    assert replica.exit_status(0) == PEER_LOST
    assert replica.exit_status(1) == PEER_LOST
    for rank in (0, 1):  # what systemd does: start both again
        replica.pidfile(rank).unlink()
        replica.start(rank)
    second = {rank: _wait_for(replica.pidfile(rank)) for rank in (0, 1)}
    assert set(second.values()).isdisjoint(first.values())
    assert all(_alive(pid) for pid in second.values())
