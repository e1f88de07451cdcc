"""router_admin.py, the router node's tool, against a real HAProxy (Debian's package) started for the tests.

The fixtures run tests/tools/router_admin_haproxy.py's: ``haproxy -db`` in the foreground (never the system
service) with its admin socket in a test directory, and two backends of loopback replicas.
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
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from gpufleet import node_paths
from gpufleet.node import router_admin
from tests.conftest import DATA
from tests.tools.router_admin_haproxy import BACKEND, FIRST, SECOND, SLOW_S, TOOL, Router, ok_json, running_router

REFUSED = DATA / "router_admin" / "refused.json"


def _refused(done: subprocess.CompletedProcess[str]) -> str:
    """The one line a refusal prints, after the tool's prefix."""
    assert done.returncode == 1, done
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("router_admin: "), done.stderr
    return lines[0].removeprefix("router_admin: ")


@pytest.fixture(scope="module")
def unchanged_router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    """One router for the tests that must leave it as it is (they check they did)."""
    with running_router(tmp_path_factory.mktemp("router")) as started:
        yield started


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
    shown = ok_json(unchanged_router.tool("show"))["servers"]
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
    ok_json(router.tool("set-state", BACKEND, SECOND, "maint"))  # FIRST takes every request
    assert [_status(router, path) for path in ["/", "/fail", "/", "/fail", "/fail", "/slow"]] == \
        [200, 500, 200, 500, 500, 200]
    shown = router.servers()
    assert (shown[FIRST]["req_tot"], shown[FIRST]["hrsp_5xx"]) == (6, 3)
    # an average over its requests, the slow one among them: 50-51 ms on an idle machine (the slow one's 300 ms over
    # six). HAProxy times with a clock of its own that advances by the poll's timeout alone when a poll returns later
    # than that (a process starved of CPU, as beside the lab: 48 ms seen), so the bound is half, still far above the
    # 0-1 ms of the fast requests alone
    assert shown[FIRST]["rtime"] >= SLOW_S * 1000 / 6 / 2
    assert (shown[SECOND]["req_tot"], shown[SECOND]["hrsp_5xx"], shown[SECOND]["rtime"]) == (0, 0, 0)
    ok_json(router.tool("set-state", BACKEND, SECOND, "ready"))
    assert router.answered_by(4) == {FIRST, SECOND}
    shown = router.servers()
    assert shown[FIRST]["req_tot"] + shown[SECOND]["req_tot"] == 10 and shown[SECOND]["hrsp_5xx"] == 0


def test_a_drained_server_gets_no_new_request_and_ready_brings_it_back(router: Router) -> None:
    assert router.answered_by(4) == {FIRST, SECOND}
    drained = ok_json(router.tool("set-state", BACKEND, FIRST, "drain"))
    assert (drained["admin"], drained["was"], drained["server"], drained["weight"]) == ("drain", "ready", FIRST, 0)
    shown = router.servers()
    assert (shown[FIRST]["status"], shown[FIRST]["admin"], shown[FIRST]["weight"]) == ("DRAIN", "drain", 0)
    assert (shown[SECOND]["status"], shown[SECOND]["admin"]) == ("UP", "ready")
    assert router.answered_by(6) == {SECOND}
    back = ok_json(router.tool("set-state", BACKEND, FIRST, "ready"))
    assert (back["admin"], back["was"], back["status"], back["weight"]) == ("ready", "drain", "UP", 1)
    assert router.answered_by(4) == {FIRST, SECOND}


def test_maint_takes_a_server_out_and_ready_brings_it_back(router: Router) -> None:
    assert ok_json(router.tool("set-state", BACKEND, SECOND, "maint"))["status"] == "MAINT"
    assert router.answered_by(4) == {FIRST}
    assert ok_json(router.tool("set-state", BACKEND, SECOND, "ready"))["admin"] == "ready"
    assert router.answered_by(4) == {FIRST, SECOND}


def test_weight_zero_takes_no_traffic_and_reads_back(router: Router) -> None:
    weighed = ok_json(router.tool("set-weight", BACKEND, FIRST, "0"))
    assert (weighed["weight"], weighed["initial_weight"], weighed["was"], weighed["admin"]) == (0, 1, 1, "ready")
    assert router.answered_by(6) == {SECOND}
    assert ok_json(router.tool("set-weight", BACKEND, FIRST, "256"))["weight"] == 256
    assert router.servers()[FIRST]["weight"] == 256
    assert ok_json(router.tool("set-weight", BACKEND, FIRST, "1"))["was"] == 256
    assert router.answered_by(4) == {FIRST, SECOND}


def _in_flight(router: Router, path: str) -> tuple[threading.Thread, list[str]]:
    """A request to ``path`` through the frontend that FIRST serves (SECOND is in maintenance), under way."""
    ok_json(router.tool("set-state", BACKEND, SECOND, "maint"))
    answers: list[str] = []
    thread = threading.Thread(target=lambda: answers.append(router.get(path)), daemon=True)
    thread.start()
    assert router.replicas[FIRST].arrived.wait(5), "the request did not reach the replica"
    return thread, answers


def test_wait_drained_returns_once_the_request_in_flight_has_finished(router: Router, tmp_path: Path) -> None:
    thread, answers = _in_flight(router, "/hold")
    assert router.servers()[FIRST]["scur"] == 1
    ok_json(router.tool("set-state", BACKEND, FIRST, "drain"))
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
    waited = ok_json(subprocess.CompletedProcess(waiting.args, waiting.returncode, out, err))
    assert (waited["drained"], waited["scur"], waited["qcur"], waited["admin"]) == (True, 0, 0, "drain")
    assert waited["waited_s"] >= 2 * router_admin.POLL_S
    thread.join(5)
    assert answers == [FIRST]  # the drain let the request finish


def test_wait_drained_times_out_while_a_request_stays_open(router: Router) -> None:
    thread, answers = _in_flight(router, "/hold")
    ok_json(router.tool("set-state", BACKEND, FIRST, "drain"))
    started = time.monotonic()
    line = _refused(router.tool("wait-drained", BACKEND, FIRST, "--timeout", "0.5"))
    assert 0.5 <= time.monotonic() - started < 5
    assert re.fullmatch(rf"{BACKEND}/{FIRST}: not drained after [0-9.]+ s: in flight 1, queued 0 \(admin drain\)", line)
    router.replicas[FIRST].release.set()
    thread.join(5)
    assert answers == [FIRST]
    assert ok_json(router.tool("wait-drained", BACKEND, FIRST, "--timeout", "5"))["scur"] == 0


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
