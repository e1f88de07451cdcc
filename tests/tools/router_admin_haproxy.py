"""A real HAProxy (Debian's package) for router_admin.py, the router node's tool: ``haproxy -db`` in the foreground
(never the system service) with its admin socket in a test directory, a frontend on a free port of 127.0.0.1 and two
backends: ``lab_single`` with two loopback replicas and ``lab_pipeline`` with one. A replica answers its own name,
``/hold`` once the test releases it, ``/slow`` after ``SLOW_S`` and ``/fail`` with a 500."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

from gpufleet.node import router_admin
from tests.conftest import ROOT, host_tool
from tests.loopback_http import QuietHandler, free_port, loopback_server
from tests.service_priority import as_a_service

TOOL = ROOT / "gpufleet" / "node" / "router_admin.py"
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
        return {entry["server"]: entry for entry in ok_json(self.tool("show"))["servers"]}


def ok_json(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The JSON a run of the tool printed, the run checked to have succeeded without a word on stderr."""
    assert (done.returncode, done.stderr) == (0, ""), done
    doc: dict[str, Any] = json.loads(done.stdout)
    return doc


def _haproxy_config(port: int, admin: Path, servers: dict[str, tuple[str, int]]) -> str:
    """HAProxy's configuration: the frontend on ``port``, the admin socket ``admin``, and each server (by name) in
    its backend at its port of 127.0.0.1."""
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
        port, admin = free_port(), tmp_path / "admin.sock"
        config = tmp_path / "haproxy.cfg"
        servers = {FIRST: (BACKEND, ports[FIRST]), SECOND: (BACKEND, ports[SECOND]),
                   "lab_pipeline-lab3-0": ("lab_pipeline", ports["lab_pipeline-lab3-0"])}
        config.write_text(_haproxy_config(port, admin, servers))
        log = tmp_path / "haproxy.log"
        with log.open("w") as out:
            proc = subprocess.Popen([haproxy, "-db", "-f", str(config)], stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, preexec_fn=as_a_service())
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


def _stop(proc: subprocess.Popen[bytes], replicas: Any) -> None:
    """Release the replicas' held requests, then stop HAProxy (killed if it will not stop)."""
    for replica in replicas:
        replica.release.set()
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
