"""Debian's HAProxy running the router role's configuration in front of stand-in replicas on 127.0.0.1 (small HTTP
servers that answer like vLLM), and a client's view of it."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import roles.router as router_role
from gpufleet.config.schema import HostConfig
from gpufleet.plan.planner import FleetPlan
from tests.conftest import host_tool
from tests.loopback_http import QuietHandler, free_port, loopback_server
from tests.memory_rule import memory_rule
from tests.polling import until, wait_for_socket
from tests.service_priority import as_a_service
from tests.stand_in_plan import stand_in_plan
from tests.unit.configs import host_config


class FakeReplica:
    """A replica that answers like vLLM; ``mode``: ok, 503 (busy), drop (closes without an answer); ``delay``:
    seconds it takes to answer a completion."""

    def __init__(self, name: str) -> None:
        self.name, self.mode, self.posts, self.delay = name, "ok", 0, 0.0
        self.seen: list[tuple[str, str]] = []  # (method, path) of every request that reached it
        self.lock = threading.Lock()

    def handler(self) -> type[BaseHTTPRequestHandler]:
        replica = self

        class Handler(QuietHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _seen(self) -> None:
                with replica.lock:
                    replica.seen.append((self.command, self.path))

            def do_GET(self) -> None:
                self._seen()
                self._answer(200, {})

            def do_PUT(self) -> None:
                self._seen()
                self._answer(200, {})

            def do_DELETE(self) -> None:
                self._seen()
                self._answer(200, {})

            def _body(self) -> bytes:
                """The request's body, with a length or chunked (as uvicorn, vLLM's server, reads both)."""
                if "Content-Length" in self.headers:
                    return self.rfile.read(int(self.headers["Content-Length"]))
                body = b""
                while size := int(self.rfile.readline().split(b";")[0], 16):
                    body += self.rfile.read(size)
                    self.rfile.readline()
                self.rfile.readline()
                return body

            def do_POST(self) -> None:
                self._seen()
                request = json.loads(self._body())
                with replica.lock:
                    replica.posts += 1
                time.sleep(replica.delay)
                if replica.mode == "503":
                    self._answer(503, {"error": "busy"})
                elif replica.mode == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                else:
                    self._answer(200, {"replica": replica.name, "model": request.get("model")})

        return Handler


def stand_ins(names: tuple[str, ...]) -> tuple[dict[str, FakeReplica], dict[str, ExitStack], dict[str, int]]:
    """A FakeReplica for each name, serving on 127.0.0.1: the replicas, what stops each, their ports."""
    replicas = {name: FakeReplica(name) for name in names}
    stops = {name: ExitStack() for name in names}
    ports = {name: int(stops[name].enter_context(loopback_server(replicas[name].handler())).rsplit(":", 1)[1])
             for name in names}
    return replicas, stops, ports


def loopback_plan(ports: dict[str, int], configs: dict[str, HostConfig]) -> FleetPlan:
    """The plan's replicas as the router role reads them: each on a host of its own (``configs``: by its name), at
    127.0.0.1:its port."""
    return stand_in_plan({name: ("127.0.0.1", port) for name, port in ports.items()}, configs)


def loopback_router_config(**values: object) -> HostConfig:
    """A router's config on free loopback ports, checking every second (one check takes a replica out or back)."""
    return host_config(router_port=free_port(), router_metrics_port=free_port(), router_check_interval_s=1,
                       router_check_fall=1, router_check_rise=1, **values)


@contextmanager
def running_haproxy(values: dict[str, Any], workdir: Path) -> Iterator[Path]:
    """Debian's HAProxy running the role's configuration rendered from ``values`` (checked with ``haproxy -c``
    first), under its drop-in's memory rule (tests/memory_rule.py), its files in ``workdir``; yields its runtime
    socket's path once that socket accepts connections, and stops HAProxy after the block."""
    haproxy = host_tool("haproxy", "haproxy")
    config = workdir / "haproxy.cfg"
    config.write_text(router_role.render({**values, "admin_socket": str(workdir / "admin.sock")}))
    as_its_unit = memory_rule(router_role.drop_in(host_config()))  # the drop-in's memory rule, as on a router
    checked = subprocess.run([haproxy, "-c", "-f", str(config)], capture_output=True, text=True,
                             preexec_fn=as_its_unit)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    with (workdir / "haproxy.log").open("w") as log:
        proc = subprocess.Popen([haproxy, "-db", "-f", str(config)], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=as_a_service(as_its_unit))
    try:
        wait_for_socket(str(workdir / "admin.sock"))
        yield workdir / "admin.sock"
    finally:
        proc.terminate()
        proc.wait(10)


def json_answer(request: urllib.request.Request) -> tuple[int, dict[str, Any]]:
    """The status of ``request`` and its JSON answer (``{}`` for an error answer that is not JSON)."""
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        text = error.read()
        return error.code, json.loads(text) if text.startswith(b"{") else {}


def wait(condition: Callable[[], object], what: str) -> None:
    """Poll ``condition`` until it holds; fails the test naming ``what`` after 15 s (a few of HAProxy's checks)."""
    until(lambda: bool(condition()), what, timeout_s=15, every=0.1)
