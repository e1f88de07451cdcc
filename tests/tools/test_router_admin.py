"""router_admin.py, the router node's tool, against a real HAProxy (Debian's package) started for the tests.

The fixtures run ``haproxy -db`` in the foreground (never the system service) with its admin socket in a test
directory, a frontend on a free port of 127.0.0.1 and two backends: ``lab_single`` with two loopback replicas and
``lab_pipeline`` with one. A replica answers its own name, ``/hold`` once the test releases it, ``/slow`` after
``SLOW_S`` and ``/fail`` with a 500.
``tests/data/router_admin/refused.json`` holds command lines the tool must refuse: ``argv``, the one ``line`` it prints
(after its prefix) and the commands ``sent`` to the socket, read through a relay that records them.
"""

from __future__ import annotations

import json
import re
import socket
import socketserver
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

from gpufleet import node_paths
from gpufleet.node import router_admin
from tests.conftest import DATA, ROOT, host_tool
from tests.loopback_http import QuietHandler, loopback_server

TOOL = ROOT / "gpufleet" / "node" / "router_admin.py"
REFUSED = DATA / "router_admin" / "refused.json"
BACKEND = "lab_single"
FIRST, SECOND = "lab_single-lab1-0", "lab_single-lab2-0"
HOLD_MAX_S = 10.0
SLOW_S = 0.3


class Replica:
    """A loopback replica: it answers its name; ``/hold`` once released."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.arrived = threading.Event()  # a /hold request reached it
        self.release = threading.Event()

    def handler(self) -> type[BaseHTTPRequestHandler]:
        replica = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:
                if self.path == "/hold":
                    replica.arrived.set()
                    replica.release.wait(HOLD_MAX_S)
                elif self.path == "/slow":
                    time.sleep(SLOW_S)
                body = replica.name.encode()
                try:
                    self.send_response(500 if self.path == "/fail" else 200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except ConnectionError:
                    pass  # a health check HAProxy dropped as it stopped

        return Handler


@dataclass
class Router:
    """The running HAProxy: its frontend's URL, admin socket and replicas."""

    url: str
    socket: Path
    replicas: dict[str, Replica] = field(default_factory=dict)

    def tool(self, *argv: str, socket_path: Path | None = None) -> subprocess.CompletedProcess[str]:
        """router_admin.py as a node runs it (``python3 -I``), on this router's socket unless told otherwise."""
        return subprocess.run([sys.executable, "-I", str(TOOL), *argv, "--socket", str(socket_path or self.socket)],
                              capture_output=True, text=True, timeout=30)

    def get(self, path: str = "/") -> str:
        """One request through the frontend, on its own connection: the replica that answered."""
        with urllib.request.urlopen(f"{self.url}{path}", timeout=HOLD_MAX_S + 5) as response:
            return str(response.read().decode())

    def answered_by(self, requests: int) -> set[str]:
        return {self.get() for _ in range(requests)}

    def servers(self) -> dict[str, dict[str, Any]]:
        return {entry["server"]: entry for entry in _ok(self.tool("show"))["servers"]}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _ok(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert (done.returncode, done.stderr) == (0, ""), done
    doc: dict[str, Any] = json.loads(done.stdout)
    return doc


def _refused(done: subprocess.CompletedProcess[str]) -> str:
    """The one line a refusal prints, after the tool's prefix."""
    assert done.returncode == 1, done
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("router_admin: "), done.stderr
    return lines[0].removeprefix("router_admin: ")


def _config(port: int, admin: Path, servers: dict[str, tuple[str, int]]) -> str:
    backends: dict[str, list[str]] = {}
    for name, (backend, replica_port) in servers.items():
        backends.setdefault(backend, []).append(f"    server {name} 127.0.0.1:{replica_port}")
    text = [
        "global", f"    stats socket {admin} mode 600 level admin",
        # a check every 100 ms, each with 2 s to answer: without "timeout check" HAProxy gives a check only its
        # interval, and a stand-in replica starved by the lab beside it (CI) answered late: "UP 1/2", L7TOUT
        "defaults", "    mode http", "    timeout connect 2s", "    timeout client 30s", "    timeout server 30s",
        "    timeout check 2s",
        "frontend api", f"    bind 127.0.0.1:{port}", f"    default_backend {BACKEND}",
    ]
    for backend, lines in backends.items():
        text += [f"backend {backend}", "    balance roundrobin", "    option httpchk GET /health",
                 "    default-server check inter 100ms rise 1 fall 2", *lines]
    return "\n".join(text) + "\n"


@contextmanager
def running_router(tmp_path: Path) -> Iterator[Router]:
    """HAProxy and its replicas, up until the block ends."""
    haproxy = host_tool("haproxy", "haproxy")
    replicas = {name: Replica(name) for name in (FIRST, SECOND, "lab_pipeline-lab3-0")}
    with ExitStack() as stack:
        urls = {name: stack.enter_context(loopback_server(replica.handler())) for name, replica in replicas.items()}
        ports = {name: int(url.rsplit(":", 1)[1]) for name, url in urls.items()}
        port, admin = _free_port(), tmp_path / "admin.sock"
        config = tmp_path / "haproxy.cfg"
        config.write_text(_config(port, admin, {FIRST: (BACKEND, ports[FIRST]), SECOND: (BACKEND, ports[SECOND]),
                                                "lab_pipeline-lab3-0": ("lab_pipeline", ports["lab_pipeline-lab3-0"])}))
        log = tmp_path / "haproxy.log"
        with log.open("w") as out:
            proc = subprocess.Popen([haproxy, "-db", "-f", str(config)], stdout=out, stderr=subprocess.STDOUT)
        stack.callback(_stop, proc, replicas.values())
        api, deadline = router_admin.Runtime(str(admin)), time.monotonic() + 10
        while True:
            if proc.poll() is not None:
                pytest.fail(f"haproxy exited {proc.returncode}: {log.read_text()}")
            try:
                if {found.status for found in api.servers()} == {"UP"}:
                    break
            except router_admin.RouterError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"haproxy's servers are not UP after 10 s: {log.read_text()}")
            time.sleep(0.05)
        yield Router(f"http://127.0.0.1:{port}", admin, replicas)


@pytest.fixture
def router(tmp_path: Path) -> Iterator[Router]:
    """A router of the test's own, for a test that changes it."""
    with running_router(tmp_path) as started:
        yield started


@pytest.fixture(scope="module")
def unchanged_router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    """One router for the tests that must leave it as it is (they check they did)."""
    with running_router(tmp_path_factory.mktemp("router")) as started:
        yield started


def _stop(proc: subprocess.Popen[bytes], replicas: Any) -> None:
    for replica in replicas:
        replica.release.set()
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


class _Relay(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """A socket in front of HAProxy's that records every command line it passes on."""

    daemon_threads = True

    def __init__(self, path: Path, target: Path) -> None:
        self.target = target
        self.commands: list[str] = []
        super().__init__(str(path), _RelayHandler)


class _RelayHandler(socketserver.StreamRequestHandler):
    server: _Relay

    def handle(self) -> None:
        line = self.rfile.readline()
        self.server.commands.append(line.decode())
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as upstream:
            upstream.connect(str(self.server.target))
            upstream.sendall(line)
            while chunk := upstream.recv(65536):
                self.wfile.write(chunk)


@contextmanager
def relaying(path: Path, target: Path) -> Iterator[_Relay]:
    """A relay at ``path`` to HAProxy's socket ``target``, until the block ends."""
    relay = _Relay(path, target)
    threading.Thread(target=relay.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield relay
    finally:
        relay.shutdown()
        relay.server_close()


def test_show_lists_every_server_of_every_backend_up(unchanged_router: Router) -> None:
    shown = _ok(unchanged_router.tool("show"))["servers"]
    assert [(s["backend"], s["server"]) for s in shown] == [(BACKEND, FIRST), (BACKEND, SECOND),
                                                             ("lab_pipeline", "lab_pipeline-lab3-0")]
    for entry in shown:
        entry["check_status"] = entry["check_status"].removeprefix("* ")  # "* ": a check under way as it was read
        assert entry == {"backend": entry["backend"], "server": entry["server"], "status": "UP", "admin": "ready",
                         "scur": 0, "qcur": 0, "weight": 1, "initial_weight": 1, "check_status": "L7OK",
                         "req_tot": 0, "hrsp_5xx": 0, "rtime": 0}  # health checks are no requests


def _status(router: Router, path: str) -> int:
    """The HTTP status of one request through the frontend."""
    try:
        router.get(path)
    except urllib.error.HTTPError as answer:
        return answer.code
    return 200


def test_show_counts_each_servers_requests_5xx_and_response_time(router: Router) -> None:
    _ok(router.tool("set-state", BACKEND, SECOND, "maint"))  # FIRST takes every request
    assert [_status(router, path) for path in ["/", "/fail", "/", "/fail", "/fail", "/slow"]] == \
        [200, 500, 200, 500, 500, 200]
    shown = router.servers()
    assert (shown[FIRST]["req_tot"], shown[FIRST]["hrsp_5xx"]) == (6, 3)
    assert shown[FIRST]["rtime"] >= SLOW_S * 1000 / 6  # an average over its requests, the slow one among them
    assert (shown[SECOND]["req_tot"], shown[SECOND]["hrsp_5xx"], shown[SECOND]["rtime"]) == (0, 0, 0)
    _ok(router.tool("set-state", BACKEND, SECOND, "ready"))
    assert router.answered_by(4) == {FIRST, SECOND}
    shown = router.servers()
    assert shown[FIRST]["req_tot"] + shown[SECOND]["req_tot"] == 10 and shown[SECOND]["hrsp_5xx"] == 0


def test_a_drained_server_gets_no_new_request_and_ready_brings_it_back(router: Router) -> None:
    assert router.answered_by(4) == {FIRST, SECOND}
    drained = _ok(router.tool("set-state", BACKEND, FIRST, "drain"))
    assert (drained["admin"], drained["was"], drained["server"], drained["weight"]) == ("drain", "ready", FIRST, 0)
    shown = router.servers()
    assert (shown[FIRST]["status"], shown[FIRST]["admin"], shown[FIRST]["weight"]) == ("DRAIN", "drain", 0)
    assert (shown[SECOND]["status"], shown[SECOND]["admin"]) == ("UP", "ready")
    assert router.answered_by(6) == {SECOND}
    back = _ok(router.tool("set-state", BACKEND, FIRST, "ready"))
    assert (back["admin"], back["was"], back["status"], back["weight"]) == ("ready", "drain", "UP", 1)
    assert router.answered_by(4) == {FIRST, SECOND}


def test_maint_takes_a_server_out_and_ready_brings_it_back(router: Router) -> None:
    assert _ok(router.tool("set-state", BACKEND, SECOND, "maint"))["status"] == "MAINT"
    assert router.answered_by(4) == {FIRST}
    assert _ok(router.tool("set-state", BACKEND, SECOND, "ready"))["admin"] == "ready"
    assert router.answered_by(4) == {FIRST, SECOND}


def test_weight_zero_takes_no_traffic_and_reads_back(router: Router) -> None:
    weighed = _ok(router.tool("set-weight", BACKEND, FIRST, "0"))
    assert (weighed["weight"], weighed["initial_weight"], weighed["was"], weighed["admin"]) == (0, 1, 1, "ready")
    assert router.answered_by(6) == {SECOND}
    assert _ok(router.tool("set-weight", BACKEND, FIRST, "256"))["weight"] == 256
    assert router.servers()[FIRST]["weight"] == 256
    assert _ok(router.tool("set-weight", BACKEND, FIRST, "1"))["was"] == 256
    assert router.answered_by(4) == {FIRST, SECOND}


def _in_flight(router: Router, path: str) -> tuple[threading.Thread, list[str]]:
    """A request to ``path`` through the frontend that FIRST serves (SECOND is in maintenance), under way."""
    _ok(router.tool("set-state", BACKEND, SECOND, "maint"))
    answers: list[str] = []
    thread = threading.Thread(target=lambda: answers.append(router.get(path)), daemon=True)
    thread.start()
    assert router.replicas[FIRST].arrived.wait(5), "the request did not reach the replica"
    return thread, answers


def test_wait_drained_returns_once_the_request_in_flight_has_finished(router: Router, tmp_path: Path) -> None:
    thread, answers = _in_flight(router, "/hold")
    assert router.servers()[FIRST]["scur"] == 1
    _ok(router.tool("set-state", BACKEND, FIRST, "drain"))
    with relaying(tmp_path / "relay.sock", router.socket) as relay:
        waiting = subprocess.Popen([sys.executable, "-I", str(TOOL), "wait-drained", BACKEND, FIRST, "--timeout", "10",
                                    "--socket", str(relay.server_address)], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 10
        while len(relay.commands) < 6 and time.monotonic() < deadline:  # three looks (two commands each)
            time.sleep(0.02)
        assert waiting.poll() is None, "wait-drained returned while a request was in flight"
        router.replicas[FIRST].release.set()
        out, err = waiting.communicate(timeout=10)
    waited = _ok(subprocess.CompletedProcess(waiting.args, waiting.returncode, out, err))
    assert (waited["drained"], waited["scur"], waited["qcur"], waited["admin"]) == (True, 0, 0, "drain")
    assert waited["waited_s"] >= 2 * router_admin.POLL_S
    thread.join(5)
    assert answers == [FIRST]  # the drain let the request finish


def test_wait_drained_times_out_while_a_request_stays_open(router: Router) -> None:
    thread, answers = _in_flight(router, "/hold")
    _ok(router.tool("set-state", BACKEND, FIRST, "drain"))
    started = time.monotonic()
    line = _refused(router.tool("wait-drained", BACKEND, FIRST, "--timeout", "0.5"))
    assert 0.5 <= time.monotonic() - started < 5
    assert re.fullmatch(rf"{BACKEND}/{FIRST}: not drained after [0-9.]+ s: in flight 1, queued 0 \(admin drain\)", line)
    router.replicas[FIRST].release.set()
    thread.join(5)
    assert answers == [FIRST]
    assert _ok(router.tool("wait-drained", BACKEND, FIRST, "--timeout", "5"))["scur"] == 0


@pytest.mark.parametrize("case", json.loads(REFUSED.read_text()), ids=lambda case: " ".join(case["argv"])[:60])
def test_refused_command_lines_print_one_line_and_send_no_change(unchanged_router: Router, tmp_path: Path,
                                                                 case: dict[str, Any],
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with relaying(tmp_path / "relay.sock", unchanged_router.socket) as relay:
        argv = [*case["argv"], *([] if "--socket" in case["argv"] else ["--socket", str(relay.server_address)])]
        rc = router_admin.main(argv)  # in this process for speed; the other tests run the file as a node does
    out, err = capsys.readouterr()
    assert _refused(subprocess.CompletedProcess(argv, rc, out, err)) == case["line"]
    assert relay.commands == [f"{sent}\n" for sent in case["sent"]]
    servers = router_admin.Runtime(str(unchanged_router.socket)).servers()
    assert {(found.admin, found.weight) for found in servers} == {("ready", 1)}


def test_the_tool_is_installed_on_nodes_and_knows_the_routers_socket() -> None:
    assert "router_admin.py" in node_paths.NODE_TOOL_FILES
    assert router_admin.DEFAULT_SOCKET == node_paths.ROUTER_ADMIN_SOCKET


@pytest.mark.parametrize(("words", "sent"), [
    (("set", "server", "be/srv", "state", "drain"), "set server be/srv state drain"),
    (("set", "weight", "be/srv", "0"), "set weight be/srv 0"),
])
def test_commands_are_checked_words(words: tuple[str, ...], sent: str) -> None:
    assert router_admin.command(*words) == sent


@pytest.mark.parametrize("word", ["a;b", "a b", "a\n", "", "a\\;b", "a#b"])
def test_a_word_that_is_no_name_never_becomes_a_command(word: str) -> None:
    with pytest.raises(router_admin.RouterError, match="refusing to send"):
        router_admin.command("set", "server", word, "state", "ready")


@pytest.mark.parametrize(("mask", "state"), [(0, "ready"), (0x08, "drain"), (0x10, "drain"), (0x01, "maint"),
                                             (0x09, "maint"), (0x20, "maint"), (0x40, "ready")])
def test_admin_state_from_haproxys_mask(mask: int, state: str) -> None:
    assert router_admin.admin_state(mask) == state


def test_a_socket_that_does_not_answer_is_one_line(tmp_path: Path) -> None:
    silent, stale = str(tmp_path / "silent.sock"), str(tmp_path / "stale.sock")
    with socket.socket(socket.AF_UNIX) as listener, socket.socket(socket.AF_UNIX) as gone:
        listener.bind(silent)
        listener.listen()  # accepts (the kernel does) and never answers
        gone.bind(stale)  # a socket file nothing listens on, as a stopped HAProxy leaves
        with pytest.raises(router_admin.RouterError, match=r"silent\.sock: no answer to 'show stat' within 0\.3 s"):
            router_admin.Runtime(silent, timeout=0.3).ask("show", "stat")
        with pytest.raises(router_admin.RouterError, match=r"stale\.sock: nothing listens there"):
            router_admin.Runtime(stale).ask("show", "stat")
