"""replica_rank.py binds a multi-node replica's ranks: only peers that prove the replica's rank secret join, any
rank that ends stops every rank, each exits for a restart. Real processes on loopback; a stand-in for vLLM that
records its pid and sleeps."""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.loopback_http import free_port

TOOL = Path(__file__).resolve().parents[3] / "gpufleet" / "node" / "replica_rank.py"
FAKE_VLLM = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(600)"
# a vLLM slow to stop: SIGTERM does nothing (as a drain, or a hang on a lost peer, would keep it)
DEAF_VLLM = f"import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); {FAKE_VLLM}"
PEER_LOST = 75
SECRET_ENV = "GPUFLEET_RANK_SECRET"
SECRET = "5ec7e7" * 10
HANDSHAKE_S = 5.0


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

    def __init__(self, tmp: Path, tool: Path = TOOL, fake_vllm: str = FAKE_VLLM) -> None:
        self.tmp, self.tool, self.fake_vllm = tmp, tool, fake_vllm
        port = free_port()
        self.ranks: dict[int, subprocess.Popen[bytes]] = {}
        self.read: dict[int, str] = {}  # what wait_logged read of each rank's log
        self.config = {"nodes": 2, "leader": "127.0.0.1", "port": port, "bind": "127.0.0.1"}

    def start(self, rank: int, secret: str | None = SECRET, key: int | None = None) -> None:
        """Start ``rank`` (kept under ``key``, by default the rank) holding ``secret`` (None: none)."""
        key = rank if key is None else key
        config = self.tmp / f"ranks{key}.json"
        config.write_text(json.dumps({**self.config, "rank": rank}))
        env = {name: value for name, value in os.environ.items() if name != SECRET_ENV}
        if secret is not None:
            env[SECRET_ENV] = secret
        self.ranks[key] = subprocess.Popen(
            [sys.executable, str(self.tool), str(config), "--", sys.executable, "-c", self.fake_vllm,
             str(self.pidfile(key))], stderr=subprocess.PIPE, env=env)

    def pidfile(self, rank: int) -> Path:
        return self.tmp / f"vllm{rank}.pid"

    def exit_status(self, rank: int, timeout: float = 30) -> int:
        return self.ranks[rank].wait(timeout)

    def log(self, rank: int) -> str:
        stderr = self.ranks[rank].stderr
        return self.read.get(rank, "") + (stderr.read().decode() if stderr is not None else "")

    def wait_logged(self, rank: int, pattern: str, timeout: float = 15) -> None:
        """Wait until ``rank``'s log has a line that matches ``pattern``."""
        stderr = self.ranks[rank].stderr
        assert stderr is not None
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.read.get(rank, "")):
            left = deadline - time.monotonic()
            assert left > 0 and select.select([stderr], [], [], left)[0], f"rank {rank} never logged {pattern!r}"
            self.read[rank] = self.read.get(rank, "") + os.read(stderr.fileno(), 65536).decode()

    def stop(self) -> None:
        """Kill every rank, then every stand-in vLLM a rank started (a rank killed by SIGKILL leaves its vLLM,
        which runs in a process group of its own)."""
        for process in self.ranks.values():
            if process.poll() is None:
                process.kill()
                process.wait()
        for pidfile in self.tmp.glob("vllm*.pid"):
            with contextlib.suppress(ValueError, ProcessLookupError):
                os.kill(int(pidfile.read_text()), signal.SIGKILL)


@pytest.fixture
def replica(tmp_path: Path) -> Iterator[Replica]:
    found = Replica(tmp_path)
    yield found
    found.stop()


def test_one_node_becomes_vllm(tmp_path: Path) -> None:
    config = tmp_path / "ranks.json"
    config.write_text(json.dumps({"rank": 0, "nodes": 1}))
    done = subprocess.run([sys.executable, str(TOOL), str(config), "--", sys.executable, "-c",
                           f"import os; print(os.getppid(), os.environ.get({SECRET_ENV!r}))"],
                          capture_output=True, text=True, timeout=30, env={**os.environ, SECRET_ENV: SECRET})
    assert done.returncode == 0
    # exec'd: vLLM's parent is the tool's own parent, this test; and vLLM's environment has no rank secret
    assert done.stdout.split() == [str(os.getpid()), "None"]


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


def test_a_rank_whose_peer_is_lost_kills_a_vllm_slow_to_stop(tmp_path: Path) -> None:
    """A replica that lost a rank has nothing to drain: the other rank's vLLM, deaf to SIGTERM here, is killed
    within the tool's short grace (2 s), not the drain a stop on purpose allows; that rank exits for its restart."""
    replica = Replica(tmp_path, fake_vllm=DEAF_VLLM)
    try:
        replica.start(0)
        replica.start(1)
        pids = {rank: _wait_for(replica.pidfile(rank)) for rank in (0, 1)}
        killed = time.monotonic()
        os.kill(pids[0], signal.SIGKILL)
        assert replica.exit_status(1) == PEER_LOST
        assert time.monotonic() - killed < 10, "the follower's vLLM was given more than the short grace"
        time.sleep(0.2)
        assert not _alive(pids[1])
    finally:
        replica.stop()


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


def _environ(pid: int) -> list[bytes]:
    return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")


def _leader_log_after_stop(replica: Replica) -> str:
    """Stop every rank as systemctl stop does (each stops its vLLM, which holds its stderr too); the leader's log."""
    for process in replica.ranks.values():
        process.send_signal(signal.SIGTERM)
    for process in replica.ranks.values():
        process.wait(30)
    return replica.log(0)


def test_the_secret_is_in_no_argv_no_log_and_not_in_vllms_environment(replica: Replica) -> None:
    replica.start(0)
    replica.start(1)
    pids = {rank: _wait_for(replica.pidfile(rank)) for rank in (0, 1)}
    for pid in (*pids.values(), *(process.pid for process in replica.ranks.values())):
        assert SECRET.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
    for pid in pids.values():  # vLLM does not inherit it
        assert not any(entry.startswith(SECRET_ENV.encode()) for entry in _environ(pid))
    replica.ranks[0].send_signal(signal.SIGTERM)
    replica.exit_status(0)
    replica.exit_status(1)
    logs = replica.log(0) + replica.log(1)
    assert "rank 1 connected from 127.0.0.1" in logs
    assert SECRET not in logs
    assert not re.search(r"[0-9a-f]{32}", logs)  # no nonce, no proof


def test_a_wrong_secret_is_refused_and_the_real_follower_joins(replica: Replica) -> None:
    replica.start(0)
    replica.start(1, secret="not-" + SECRET, key=9)  # an impostor: says rank 1, holds another secret
    replica.wait_logged(0, "refused 127.0.0.1: failed to prove")  # the leader turned it away
    replica.start(1)
    assert _alive(_wait_for(replica.pidfile(0)))
    assert _alive(_wait_for(replica.pidfile(1)))
    assert not replica.pidfile(9).exists()
    log = _leader_log_after_stop(replica)
    assert "refused 127.0.0.1: failed to prove the replica's rank secret" in log
    assert "rank 1 connected from 127.0.0.1" in log


def test_old_silent_and_garbled_peers_neither_join_nor_stall_the_real_follower(replica: Replica) -> None:
    replica.start(0)
    port = int(replica.config["port"])
    deadline = time.monotonic() + 15
    while True:  # the leader listens
        try:
            silent = [socket.create_connection(("127.0.0.1", port))]
            break
        except ConnectionRefusedError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    silent += [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]  # each would hold a 5 s wait
    old = socket.create_connection(("127.0.0.1", port))
    old.sendall(b"rank 1\n")  # the protocol before the handshake
    garbled = socket.create_connection(("127.0.0.1", port))
    garbled.sendall(b"x" * 4096)
    started = time.monotonic()
    replica.start(1)
    _wait_for(replica.pidfile(0))
    _wait_for(replica.pidfile(1))
    assert time.monotonic() - started < HANDSHAKE_S  # nobody waited out a silent peer
    for sock in (*silent, old, garbled):
        sock.close()
    log = _leader_log_after_stop(replica)
    assert "refused 127.0.0.1: spoke another protocol (not a rank, or an older replica_rank)" in log
    assert "refused 127.0.0.1: did not prove the rank secret (a line too long)" in log
    assert log.count("refused 127.0.0.1: had not proved the rank secret when the waiting ended") == 4
    assert log.count("rank 1 connected") == 1


def test_a_silent_peer_is_dropped_after_the_handshake_bound(replica: Replica) -> None:
    replica.start(0)
    port = int(replica.config["port"])
    deadline = time.monotonic() + 15
    while True:
        try:
            silent = socket.create_connection(("127.0.0.1", port))
            break
        except ConnectionRefusedError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    silent.settimeout(HANDSHAKE_S + 5)
    connected = time.monotonic()
    assert silent.recv(4096).startswith(b"hello ")
    assert silent.recv(4096) == b""  # the leader hung up on it
    assert HANDSHAKE_S - 0.5 < time.monotonic() - connected < HANDSHAKE_S + 3
    silent.close()
    replica.start(1)  # the leader is still waiting for its follower
    _wait_for(replica.pidfile(1))
    assert f"refused 127.0.0.1: did not prove the rank secret within {HANDSHAKE_S:.0f} s" in (
        _leader_log_after_stop(replica))


def test_a_follower_refuses_a_leader_that_cannot_prove_the_secret(replica: Replica) -> None:
    server = socket.create_server(("127.0.0.1", int(replica.config["port"])))
    replica.start(1)
    server.settimeout(15)
    fake, _ = server.accept()
    with fake:
        fake.sendall(b"hello " + b"0" * 32 + b"\n")
        assert fake.recv(4096).startswith(b"rank 1 ")
        fake.sendall(b"ok " + b"0" * 64 + b"\n" + b"go 1234\n")
        time.sleep(1.0)
    server.close()
    assert not replica.pidfile(1).exists()
    replica.ranks[1].send_signal(signal.SIGTERM)
    assert replica.exit_status(1) == 0
    assert "refused the leader at 127.0.0.1" in replica.log(1)


def test_a_rank_without_its_secret_does_not_start(replica: Replica) -> None:
    replica.start(1, secret=None)
    assert replica.exit_status(1) == 2
    assert f"no rank secret in {SECRET_ENV}" in replica.log(1)
    assert not replica.pidfile(1).exists()


# fabric_check.py's stand-in: the torch part is the lab's (tests/lab/test_faults.py); here each rank prints the
# verdict its environment gives it (a follower: passed unless given one), as the real one does.
FAKE_FABRIC = """import json, os, sys
rank = int(sys.argv[sys.argv.index("--rank") + 1])
open(os.environ["FABRIC_LOG"] + str(rank), "w").write(" ".join(sys.argv[1:]))
mine = os.environ["FABRIC_VERDICT"] if rank == 0 else os.environ.get("FABRIC_FOLLOWER_VERDICT", "")
print(open(mine).read() if mine else json.dumps({"passed": True}))
"""
FAILED_FABRIC = {"passed": False, "stage": "out", "slow_nodes": ["lab3"], "stalled_nodes": ["lab3"], "out_gbps": {},
                 "floor_gbps": 0.5, "error": "Timed out waiting 5000ms for recv operation"}
FOLLOWER_FAILED = {"passed": False, "stage": "out", "error": "Connection reset by peer"}


@pytest.fixture
def checked(tmp_path: Path) -> Iterator[Replica]:
    """A replica whose ranks.json asks for the fabric check, run by a stand-in beside a copy of replica_rank.py."""
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "replica_rank.py").write_bytes(TOOL.read_bytes())
    (tools / "fabric_check.py").write_text(FAKE_FABRIC)
    found = Replica(tmp_path, tools / "replica_rank.py")
    found.config["fabric"] = {"port": 29589, "backend": "gloo", "iface": "lo", "bytes": 1024, "floor_gbps": 0.5,
                              "timeout_s": 5}
    yield found
    found.stop()


def test_a_failed_fabric_check_names_the_node_and_starts_no_vllm_until_it_passes(
        checked: Replica, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The leader names the node and asks again, no rank exits (no unit restart is spent on it), no vLLM starts;
    once the link is mended the same generation starts on both ranks."""
    verdict, followers = tmp_path / "verdict.json", tmp_path / "follower-verdict.json"
    verdict.write_text(json.dumps(FAILED_FABRIC))
    followers.write_text(json.dumps(FOLLOWER_FAILED))
    monkeypatch.setenv("FABRIC_LOG", str(tmp_path / "fabric-argv-"))
    monkeypatch.setenv("FABRIC_VERDICT", str(verdict))
    monkeypatch.setenv("FABRIC_FOLLOWER_VERDICT", str(followers))
    checked.start(0)
    checked.start(1)
    checked.wait_logged(0, r"fabric check of generation \w+ stalled at out: lab3 .*Timed out waiting")
    # the next check starts FABRIC_RETRY_S (10 s) after this one did: the stand-in's took well under a second
    checked.wait_logged(0, r"rank 0: the replica does not start: its fabric check failed on lab3; checking again"
                           r" in (9|10) s")
    # what the follower saw is in its own log: the leader's verdict cannot carry it
    checked.wait_logged(1, r"rank 1: its part of the fabric check of generation \w+ failed at out: Connection"
                           r" reset by peer \(\d+\.\d s\)")
    time.sleep(1)
    assert checked.ranks[0].poll() is None and checked.ranks[1].poll() is None  # waiting, not restarting
    assert not checked.pidfile(0).exists() and not checked.pidfile(1).exists()  # no vLLM on that fabric
    verdict.write_text(json.dumps({"passed": True, "busbw_gbps": 3.2, "seconds": 2.5}))
    assert _alive(_wait_for(checked.pidfile(0), timeout=30)) and _alive(_wait_for(checked.pidfile(1), timeout=30))
    argv = (tmp_path / "fabric-argv-1").read_text().split()
    assert argv[argv.index("--leader") + 1] == "127.0.0.1:29589" and argv[argv.index("--world") + 1] == "2"
    assert argv[argv.index("--iface") + 1] == "lo" and argv[argv.index("--timeout") + 1] == "5"


def test_a_passed_fabric_check_starts_the_generation(checked: Replica, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    verdict = tmp_path / "verdict.json"
    verdict.write_text(json.dumps({"passed": True, "busbw_gbps": 3.2, "seconds": 2.5}))
    monkeypatch.setenv("FABRIC_LOG", str(tmp_path / "fabric-argv-"))
    monkeypatch.setenv("FABRIC_VERDICT", str(verdict))
    checked.start(0)
    checked.start(1)
    assert _alive(_wait_for(checked.pidfile(0))) and _alive(_wait_for(checked.pidfile(1)))
    checked.wait_logged(0, r"fabric check of generation \w+ passed, bus bandwidth 3.2 GB/s")
