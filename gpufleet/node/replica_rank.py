#!/usr/bin/env python3
"""Run one node's rank of a vLLM replica so that the replica lives and dies as one (gpufleet node tool).

    replica_rank.py RANKS_JSON -- VLLM_ARGV...

``RANKS_JSON`` (written by the vllm role next to the replica's config.yaml)::

    {"rank": 1, "nodes": 2, "leader": "10.0.0.2", "port": 29590, "bind": "10.0.0.3", "stop_grace_s": 75}

A single-node replica (``nodes`` 1) simply becomes vLLM. In a multi-node replica (the mp backend) rank 0, the
leader, listens on ``port``; each other rank connects to it and proves that it holds the replica's rank secret
(``GPUFLEET_RANK_SECRET``, from the unit's 0600 EnvironmentFile; taken out of the environment before vLLM starts):
the leader sends ``hello NONCE``, the follower answers ``rank N ITS_NONCE HMAC`` and the leader, once it checked
that, proves the secret in turn (``ok HMAC``), each HMAC-SHA256 over both nonces, the rank and who speaks. A peer
that answers wrong, speaks another protocol or stays silent for 5 s is dropped with one line in the log (its
address, nothing of the proof) while the leader goes on accepting. When every rank is connected the
leader starts a generation: it tells each follower to start vLLM and starts its own. From then on the ranks send
each other a heartbeat every 2 s. Whatever ends first on a rank, its own vLLM, the connection to a peer, or a
peer's heartbeat (silent for 15 s: a node that died or was cut off), the rank stops its vLLM (the whole process
group) and exits 75, and systemd starts it again: a follower then waits for the leader, the leader for every
follower. A crash of any rank therefore restarts the whole replica once, and no rank keeps an engine that
belongs to a generation that is gone. SIGTERM (systemctl stop) stops vLLM, which drains its in-flight requests
(``--shutdown-timeout``; it is killed after ``stop_grace_s``), and exits 0.

With a ``fabric`` entry in ``RANKS_JSON`` (``{"port": 29589, "backend": "gloo", "iface": "eth0", "bytes": ...,
"floor_gbps": ..., "timeout_s": 20}``, role node_lifecycle) the leader first asks every rank for the replica's fabric
check (``fabric NONCE``): each runs ``fabric_check.py`` beside this file with this Python, an all-reduce over exactly
the replica's ranks on the interface the units use. When the leader's verdict fails (a rank that does not join, a
way out that stalls or is slower than the floor) it logs the nodes it names and asks again after ``FABRIC_RETRY_S``:
no vLLM starts on that fabric, no unit restarts (systemd's start limit is not spent on it), and a link that is
mended lets the generation start at the next check.

Standard library only; every line it logs goes to stderr (the journal).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import selectors
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Callable

HEARTBEAT_S = 2.0
SILENT_LIMIT_S = 15.0  # a peer silent this long is gone
CONNECT_RETRY_S = 1.0
# SIGTERM, then SIGKILL after this long, when the replica ends (a rank lost, or an error): nothing is left to drain,
# since no request finishes without every rank, and a vLLM whose peer is gone may hang on its way out (lab: a rank
# whose leader was killed took 8.6 s to exit on SIGTERM, the whole replica's restart waiting on it)
STOP_GRACE_S = 2.0
REPORT_EVERY_S = 30.0
PEER_LOST = 75  # the exit status that asks systemd for a restart (Restart=on-failure)
SECRET_ENV = "GPUFLEET_RANK_SECRET"  # the replica's rank secret, the same on each of its nodes
HANDSHAKE_S = 5.0  # a peer that has not proved the rank secret by then is dropped
REFUSED_PAUSE_S = 5.0  # a follower the leader refused tries again after this long
MAX_PENDING = 16  # connections still proving at once: beyond that the oldest is dropped
LINE_LIMIT = 512  # bytes a peer may send before its first line ends


class Stopped(Exception):
    """SIGTERM or SIGINT: stop vLLM and exit 0."""


def log(message: str) -> None:
    print(f"replica_rank: {message}", file=sys.stderr, flush=True)


def _on_signal(signum: int, frame: Any) -> None:
    raise Stopped(signal.Signals(signum).name)


def _keepalive(sock: socket.socket) -> None:
    """Let the kernel notice a peer whose node vanished (no FIN) even between heartbeats."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class Peer:
    """One connection to another rank: lines in, lines out, when it was last heard from."""

    def __init__(self, sock: socket.socket, rank: int | None = None) -> None:
        self.sock = sock
        self.rank = rank
        self.buffer = b""
        self.heard = time.monotonic()
        _keepalive(sock)

    def send(self, line: str) -> None:
        self.sock.sendall(line.encode() + b"\n")

    def lines(self) -> list[str]:
        """The complete lines that have arrived (call when readable); raises ConnectionError when it closed."""
        data = self.sock.recv(4096)
        if not data:
            raise ConnectionError("closed")
        self.heard = time.monotonic()
        self.buffer += data
        *complete, self.buffer = self.buffer.split(b"\n")
        if len(self.buffer) > LINE_LIMIT:
            raise ConnectionError("a line too long")
        return [line.decode(errors="replace").strip() for line in complete]

    def read_line(self, timeout: float | None) -> str:
        """The next line, waiting at most ``timeout`` seconds (None: as long as it takes)."""
        self.sock.settimeout(timeout)
        try:
            while b"\n" not in self.buffer:
                data = self.sock.recv(4096)
                if not data:
                    raise ConnectionError("closed")
                self.buffer += data
        finally:
            self.sock.settimeout(None)
        line, self.buffer = self.buffer.split(b"\n", 1)
        self.heard = time.monotonic()
        return line.decode(errors="replace").strip()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def proof(secret: bytes, speaker: str, leader_nonce: str, follower_nonce: str, rank: int) -> bytes:
    """What ``speaker`` (leader or follower) sends to prove the rank secret for this exchange: HMAC-SHA256, hex."""
    message = f"gpufleet replica_rank {speaker} {leader_nonce} {follower_nonce} {rank}".encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest().encode()


class Refused(Exception):
    """Why a peer was not let in (never anything of the secret or of its answer)."""


class Pending:
    """A connection to the leader that has not proved the rank secret yet."""

    def __init__(self, sock: socket.socket, address: str) -> None:
        self.peer = Peer(sock)
        self.address = address
        self.nonce = secrets.token_hex(16)
        self.deadline = time.monotonic() + HANDSHAKE_S

    def answer(self, line: str, secret: bytes, nodes: int) -> int:
        """The rank the peer proved (its ``ok`` sent); raises Refused."""
        parts = line.split(" ")
        if len(parts) != 4 or parts[0] != "rank" or not (parts[1].isascii() and parts[1].isdigit()):
            raise Refused("spoke another protocol (not a rank, or an older replica_rank)")
        rank, theirs = int(parts[1]), parts[2]
        if not hmac.compare_digest(parts[3].encode(), proof(secret, "follower", self.nonce, theirs, rank)):
            raise Refused("failed to prove the replica's rank secret")
        if not 1 <= rank < nodes:
            raise Refused(f"said it is rank {rank}; expected 1..{nodes - 1}")
        self.peer.send("ok " + proof(secret, "leader", self.nonce, theirs, rank).decode())
        return rank


def gather_followers(bind: str, port: int, nodes: int, secret: bytes) -> dict[int, Peer]:
    """Rank 0: accept one connection per follower rank that proves the rank secret (a rank that connects again
    replaces its old one). Handshakes run side by side: a wrong or silent peer never holds up another."""
    server = socket.create_server((bind, port))
    selector = selectors.DefaultSelector()
    selector.register(server, selectors.EVENT_READ, None)
    pending: dict[socket.socket, Pending] = {}  # oldest first
    peers: dict[int, Peer] = {}
    last_report = time.monotonic()

    def refuse(waiting: Pending, why: str) -> None:
        log(f"refused {waiting.address}: {why}")
        settle(waiting)
        waiting.peer.close()

    def settle(waiting: Pending) -> None:
        selector.unregister(waiting.peer.sock)
        del pending[waiting.peer.sock]

    try:
        while len(peers) < nodes - 1:
            for rank, peer in list(peers.items()):  # a follower that left while the others were awaited
                if _closed(peer):
                    log(f"rank {rank} left before the generation started")
                    peer.close()
                    del peers[rank]
            if time.monotonic() - last_report > REPORT_EVERY_S:
                missing = sorted(set(range(1, nodes)) - set(peers))
                log(f"waiting for rank(s) {', '.join(map(str, missing))} to connect to {bind}:{port}")
                last_report = time.monotonic()
            for key, _ in selector.select(timeout=0.5):
                if key.data is None:
                    _accept(server, selector, pending, refuse)
                    continue
                waiting = key.data
                if waiting.peer.sock not in pending:  # dropped earlier in this round
                    continue
                try:
                    lines = waiting.peer.lines()
                except (OSError, ConnectionError) as exc:
                    refuse(waiting, f"did not prove the rank secret ({exc})")
                    continue
                if not lines:
                    continue
                try:
                    rank = waiting.answer(lines[0], secret, nodes)
                except Refused as why:
                    refuse(waiting, str(why))
                    continue
                except OSError as exc:
                    refuse(waiting, f"left before it was let in ({exc})")
                    continue
                settle(waiting)
                if rank in peers:
                    peers[rank].close()
                waiting.peer.rank = rank
                peers[rank] = waiting.peer
                log(f"rank {rank} connected from {waiting.address}")
            now = time.monotonic()
            for waiting in [w for w in pending.values() if now > w.deadline]:
                refuse(waiting, f"did not prove the rank secret within {HANDSHAKE_S:.0f} s")
    finally:
        for waiting in list(pending.values()):
            refuse(waiting, "had not proved the rank secret when the waiting ended")
        selector.close()
        server.close()
    return peers


def _accept(server: socket.socket, selector: selectors.BaseSelector, pending: dict[socket.socket, Pending],
            refuse: Callable[[Pending, str], None]) -> None:
    """Take a new connection and challenge it; beyond MAX_PENDING, the oldest still proving is dropped."""
    try:
        sock, address = server.accept()
    except OSError:
        return
    try:
        waiting = Pending(sock, str(address[0]))
    except OSError:  # gone already
        sock.close()
        return
    selector.register(sock, selectors.EVENT_READ, waiting)
    pending[sock] = waiting
    if len(pending) > MAX_PENDING:
        refuse(next(iter(pending.values())), f"still proving while {MAX_PENDING} more connections came")
    try:
        waiting.peer.send(f"hello {waiting.nonce}")
    except OSError as exc:
        if sock in pending:
            refuse(waiting, f"left before it was challenged ({exc})")


def _closed(peer: Peer) -> bool:
    peer.sock.setblocking(False)
    try:
        return peer.sock.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        peer.sock.setblocking(True)


def join_leader(leader: str, port: int, rank: int, secret: bytes) -> tuple[Peer, str]:
    """Rank > 0: connect to the leader (retrying until it listens), prove the rank secret and have the leader
    prove it, then wait for its generation."""
    last_report = 0.0
    while True:
        try:
            sock = socket.create_connection((leader, port), timeout=3.0)
        except OSError as exc:
            if time.monotonic() - last_report > REPORT_EVERY_S:
                log(f"waiting for the leader at {leader}:{port} ({exc})")
                last_report = time.monotonic()
            time.sleep(CONNECT_RETRY_S)
            continue
        sock.settimeout(None)
        peer = Peer(sock, 0)
        try:
            if not _prove(peer, rank, secret):
                log(f"refused the leader at {leader}:{port}: it failed to prove the replica's rank secret")
                peer.close()
                time.sleep(REFUSED_PAUSE_S)
                continue
            word, _, generation = peer.read_line(None).partition(" ")
        except (OSError, ConnectionError) as exc:
            if time.monotonic() - last_report > REPORT_EVERY_S:
                log(f"the leader at {leader}:{port} let this rank go before its generation started ({exc})")
                last_report = time.monotonic()
            peer.close()
            time.sleep(CONNECT_RETRY_S)
            continue
        while word == "fabric" and generation:  # the leader asks again until the check passes
            started = time.monotonic()
            verdict = fabric_check(FABRIC, rank, leader)
            if not verdict.get("passed"):  # the leader names the node; what this rank saw is only here
                log(f"rank {rank}: its part of the fabric check of generation {generation} failed at"
                    f" {verdict.get('stage')}: {verdict.get('error') or 'no reason printed'}"
                    f" ({time.monotonic() - started:.1f} s)")
            word, _, generation = peer.read_line(None).partition(" ")
        if word == "go" and generation:
            return peer, generation
        peer.close()


FABRIC: dict[str, Any] = {}  # ranks.json's "fabric": the check before each generation ({}: none)
FABRIC_TOOL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fabric_check.py")
FABRIC_RETRY_S = 10.0  # from one fabric check's start to the next's, for a generation that has not started


def retry_pause(started: float, now: float) -> float:
    """Seconds until the next fabric check of a generation whose check, begun at ``started``, failed: checks begin
    :data:`FABRIC_RETRY_S` apart (one that stalled has already waited out its timeout)."""
    return max(0.0, FABRIC_RETRY_S - (now - started))


def checking_again(pause: float) -> str:
    return f"checking again in {pause:.0f} s" if pause >= 0.5 else "checking again now"


def fabric_argv(python: str, tool: str, fabric: dict[str, Any], rank: int, leader: str) -> list[str]:
    """The command line of one rank of the fabric check (``fabric``: ranks.json's entry, with ``world``)."""
    return [python, tool, "--rank", str(rank), "--world", str(fabric["world"]), "--leader",
            f"{leader}:{fabric['port']}", "--backend", str(fabric["backend"]), "--iface", str(fabric.get("iface", "")),
            "--bytes", str(fabric["bytes"]), "--floor-gbps", str(fabric["floor_gbps"]),
            "--timeout", str(fabric["timeout_s"])]


def fabric_timeout(fabric: dict[str, Any]) -> float:
    """How long one rank of the check may run before it counts as hung."""
    return 3 * float(fabric["timeout_s"]) + 30


HUNG = {"passed": False, "stage": "hung", "slow_nodes": [], "error": "the check itself did not end"}


def read_verdict(rank: int, status: int, stdout: str, stderr: str) -> dict[str, Any]:
    """One rank's verdict from what fabric_check.py printed: the leader's names every node, a follower prints only
    its own failure."""
    try:
        verdict = json.loads(stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"passed": rank != 0 and status == 0, "stage": "no verdict", "error": stderr.strip()[-300:]}
    return verdict if isinstance(verdict, dict) else {"passed": False, "stage": "no verdict"}


def fabric_check(fabric: dict[str, Any], rank: int, leader: str) -> dict[str, Any]:
    """This rank's part of the replica's fabric check (fabric_check.py beside this file, run by this Python: the
    release's, with its torch)."""
    argv = fabric_argv(sys.executable, FABRIC_TOOL, fabric, rank, leader)
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=fabric_timeout(fabric))
    except subprocess.TimeoutExpired:
        return dict(HUNG)
    return read_verdict(rank, done.returncode, done.stdout, done.stderr)


def describe_fabric(verdict: dict[str, Any]) -> str:
    if verdict.get("passed"):
        over = f" over {', '.join(verdict['nodes'])}" if verdict.get("nodes") else ""
        return f"passed, bus bandwidth {verdict.get('busbw_gbps')} GB/s in {verdict.get('seconds')} s{over}"
    if verdict.get("stage") == "join":
        return f"ranks {verdict.get('missing_ranks')} did not join"
    named = ", ".join(verdict.get("slow_nodes") or []) or "no node named"
    how = "stalled" if verdict.get("stalled_nodes") else "too slow"
    detail = f"; {verdict['error']}" if verdict.get("error") else ""
    return (f"{how} at {verdict.get('stage')}: {named} (ways out to the leader in GB/s: {verdict.get('out_gbps')}, "
            f"floor {verdict.get('floor_gbps')}){detail}")


def _prove(peer: Peer, rank: int, secret: bytes) -> bool:
    """The follower's half of the handshake: answer the leader's nonce, check its answer to ours."""
    word, _, nonce = peer.read_line(HANDSHAKE_S).partition(" ")
    if word != "hello" or not nonce:
        return False
    mine = secrets.token_hex(16)
    peer.send(f"rank {rank} {mine} {proof(secret, 'follower', nonce, mine, rank).decode()}")
    word, _, answer = peer.read_line(HANDSHAKE_S).partition(" ")
    return word == "ok" and hmac.compare_digest(answer.encode(), proof(secret, "leader", nonce, mine, rank))


def start_vllm(argv: list[str]) -> subprocess.Popen[bytes]:
    """vLLM in its own process group, so stopping it stops its engine and workers too."""
    return subprocess.Popen(argv, start_new_session=True)


def stop_vllm(child: subprocess.Popen[bytes], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to vLLM's process group (vLLM then drains for its --shutdown-timeout), SIGKILL after ``grace_s``."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, sig)
        try:
            child.wait(wait)
        except subprocess.TimeoutExpired:
            continue
        with contextlib.suppress(ProcessLookupError):  # workers may outlive vLLM's main process: none is left
            os.killpg(child.pid, signal.SIGKILL)
        return


def watch(child: subprocess.Popen[bytes], peers: list[Peer]) -> str:
    """Heartbeat the peers until vLLM exits or a peer is lost; why it ended."""
    selector = selectors.DefaultSelector()
    for peer in peers:
        selector.register(peer.sock, selectors.EVENT_READ, peer)
    next_beat = 0.0
    while True:
        code = child.poll()
        if code is not None:
            return f"vLLM exited with status {code}"
        now = time.monotonic()
        if now >= next_beat:
            for peer in peers:
                try:
                    peer.send("hb")
                except OSError as exc:
                    return f"rank {peer.rank} is unreachable ({exc})"
            next_beat = now + HEARTBEAT_S
        for key, _ in selector.select(timeout=0.5):
            peer = key.data
            try:
                peer.lines()
            except (OSError, ConnectionError) as exc:
                return f"rank {peer.rank}'s connection ended ({exc})"
        for peer in peers:
            if time.monotonic() - peer.heard > SILENT_LIMIT_S:
                return f"rank {peer.rank} has been silent for {SILENT_LIMIT_S:.0f} s"


def run(config: dict[str, Any], argv: list[str]) -> int:
    nodes, rank = int(config["nodes"]), int(config["rank"])
    secret = os.environ.pop(SECRET_ENV, "").strip().encode()  # vLLM does not inherit it
    if nodes <= 1:
        os.execv(argv[0], argv)
    if not secret:
        log(f"rank {rank}: no rank secret in {SECRET_ENV} (the deploy writes it for the unit); not binding ranks")
        return 2
    port = int(config["port"])
    FABRIC.clear()
    FABRIC.update(config.get("fabric") or {})
    if FABRIC:
        FABRIC["world"] = nodes
    peers: list[Peer] = []
    child: subprocess.Popen[bytes] | None = None
    try:
        if rank == 0:
            followers = gather_followers(str(config["bind"]), port, nodes, secret)
            generation = secrets.token_hex(4)
            peers = list(followers.values())
            while FABRIC:  # until the check passes: no vLLM starts on a fabric that fails it
                for peer in peers:
                    peer.send(f"fabric {generation}")
                started = time.monotonic()
                verdict = fabric_check(FABRIC, 0, str(config["bind"]))
                log(f"rank 0: fabric check of generation {generation} "
                    f"{describe_fabric(verdict)} ({time.monotonic() - started:.1f} s)")
                if verdict.get("passed"):
                    break
                pause = retry_pause(started, time.monotonic())
                log(f"rank 0: the replica does not start: its fabric check failed on "
                    f"{', '.join(verdict.get('slow_nodes') or []) or 'an unnamed node'}; {checking_again(pause)}")
                time.sleep(pause)
            for peer in peers:
                peer.send(f"go {generation}")
        else:
            leader, generation = join_leader(str(config["leader"]), port, rank, secret)
            peers = [leader]
        log(f"rank {rank} of {nodes}: generation {generation}, starting vLLM")
        child = start_vllm(argv)
        why = watch(child, peers)
        log(f"rank {rank}: {why}; stopping vLLM so the whole replica starts again")
        stop_vllm(child)
        return PEER_LOST
    except Stopped as stop:
        log(f"rank {rank}: {stop}, stopping vLLM")
        if child is not None:  # systemctl stop: let vLLM finish its in-flight requests (stop_grace_s)
            stop_vllm(child, float(config.get("stop_grace_s", STOP_GRACE_S)))
        return 0
    except OSError as exc:  # the leader cannot listen (address or port taken)
        log(f"rank {rank}: {exc}")
        if child is not None:
            stop_vllm(child)
        return PEER_LOST
    finally:
        for peer in peers:
            peer.close()


def main(args: list[str]) -> int:
    if len(args) < 3 or args[1] != "--":
        log("usage: replica_rank.py RANKS_JSON -- VLLM_ARGV...")
        return 2
    with open(args[0]) as handle:
        config = json.load(handle)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    return run(config, args[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
