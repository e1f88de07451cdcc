"""A real HAProxy (Debian's) on loopback with the configuration and edge files the router role renders, in front of
stand-in replicas that take the replicas' own key only (and report vLLM's usage): the edge's tools tests share it.

HAProxy runs as systemd runs it (master-worker), so a reload here is the unit's: SIGUSR2 to the master.
"""

from __future__ import annotations

import http.client
import json
import signal
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest
from gpufleet_lab.tls import make_lab_tls

import roles.router as router_role
from gpufleet.node import router_admin
from gpufleet.plan import backends as plan_backends
from roles.router import token_ledger
from roles.router.peers import Peers
from tests.conftest import host_tool
from tests.loopback_http import ReplicaHandler, free_port, loopback_server
from tests.memory_rule import memory_rule
from tests.polling import holding_a_listener, wait_for_socket
from tests.service_priority import as_a_service
from tests.stand_in_plan import stand_in_plan
from tests.tools.haproxy_run import wait
from tests.unit.configs import host_config

OPEN, CLOSED = "model-open", "model-closed"  # every client may use OPEN; CLOSED only those that name it
REPLICA_KEY = "replica-internal-key-0123456789"
KEYS = {"alice": "alice-key-0123456789abcdef", "bob": "bob-key-0123456789abcdef",
        "carol": "carol-key-0123456789abcdef", "dave": "dave-key-0123456789abcdef"}
CLIENTS = {
    "alice": {"api_key": {"env": "EDGE_ALICE_KEY"}},  # every model, no limit
    "bob": {"api_key": {"env": "EDGE_BOB_KEY"}, "models": [OPEN], "priority": "batch"},  # OPEN: by priority
    "carol": {"api_key": {"env": "EDGE_CAROL_KEY"}, "requests_per_s": 3},
    "dave": {"api_key": {"env": "EDGE_DAVE_KEY"}, "concurrent_requests": 1},
}
RATE = 3


class KeyedReplica:
    """A replica that answers only with the replicas' key; a prompt ``sleep:S`` answers after S seconds."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.authorizations: list[str | None] = []  # the Authorization header of every completion it got
        self.priorities: list[str | None] = []  # and its X-Vllm-Priority header
        self.lock = threading.Lock()

    def handler(self) -> type[BaseHTTPRequestHandler]:
        replica = self

        class Handler(ReplicaHandler):
            def complete(self, request: dict[str, Any]) -> tuple[int, bytes | list[bytes]]:
                with replica.lock:
                    replica.authorizations.append(self.headers.get("Authorization"))
                    replica.priorities.append(self.headers.get("X-Vllm-Priority"))
                if self.headers.get("Authorization") != f"Bearer {REPLICA_KEY}":
                    return 401, b'{"error":"replica: wrong key"}'
                prompt = str(request.get("prompt", ""))
                if prompt.startswith("sleep:"):
                    time.sleep(float(prompt.removeprefix("sleep:")))
                return 200, answer(replica.name, request)

        return Handler


def usage(request: dict[str, Any]) -> tuple[int, int]:
    """The usage a stand-in replica reports: a prompt token per 4 characters, and max_tokens generated."""
    return max(1, len(str(request.get("prompt", ""))) // 4), int(request.get("max_tokens") or 16)


def answer(replica: str, request: dict[str, Any]) -> bytes | list[bytes]:
    """A completion's answer as vLLM's ends: the usage last, streamed (server-sent events, each a chunk of its own,
    as vLLM sends them) or whole."""
    prompt, completion = usage(request)
    counted = {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}
    if request.get("stream"):
        events = [{"replica": replica, "choices": [{"text": "x"}], "usage": None},
                  {"replica": replica, "choices": [], "usage": counted}]
        return [f"data: {json.dumps(e)}\n\n".encode() for e in events] + [b"data: [DONE]\n\n"]
    return json.dumps({"replica": replica, "model": request["model"], "usage": counted}).encode()


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass
class Edge:
    port: int
    plain_port: int | None
    tls: Any  # LabTls or None
    socket: Path
    master: Path
    proc: subprocess.Popen[bytes]
    config: Path
    edge_dir: Path
    replicas: dict[str, KeyedReplica]

    def context(self) -> ssl.SSLContext | None:
        return ssl.create_default_context(cafile=str(self.tls.ca_certificate)) if self.tls else None

    def request(self, method: str, path: str, key: str | None = None, model: str = OPEN, prompt: str = "hi",
                port: int | None = None, tls: bool | None = None, priority: int | None = None) -> Answer:
        """``priority``: the client's own, in the X-Vllm-Priority header and the body's ``priority``."""
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        fields = {"model": model, "prompt": prompt, "max_tokens": 1}
        if priority is not None:
            headers["X-Vllm-Priority"] = str(priority)
            fields["priority"] = priority
        body = json.dumps(fields).encode() if method == "POST" else None
        use_tls = self.tls is not None if tls is None else tls
        connection: http.client.HTTPConnection = (
            http.client.HTTPSConnection("127.0.0.1", port or self.port, timeout=20, context=self.context())
            if use_tls else http.client.HTTPConnection("127.0.0.1", port or self.port, timeout=20))
        try:
            connection.request(method, path, body=body, headers=headers)
            response = connection.getresponse()
            text = response.read()
            return Answer(response.status, {k.lower(): v for k, v in response.getheaders()},
                          json.loads(text) if text.startswith(b"{") else {})
        finally:
            connection.close()

    def post(self, key: str | None, model: str = OPEN, prompt: str = "hi", priority: int | None = None) -> Answer:
        return self.request("POST", "/v1/completions", key, model, prompt, priority=priority)

    def reload(self) -> None:
        """What ``systemctl reload haproxy`` does: SIGUSR2 to the master, which starts new workers that read the
        configuration and the edge files again; the old workers finish what they hold."""
        before = self.workers()
        self.proc.send_signal(signal.SIGUSR2)
        wait(lambda: self.workers() - before, "a new worker after the reload")
        # The old workers let go of the listeners once the master tells them to stop, which a worker starved of CPU
        # does later than the new one is listed: until then a new connection may still reach an old worker.
        ports = {self.port, *([self.plain_port] if self.plain_port else [])}
        wait(lambda: not holding_a_listener(before, ports), "the old workers letting go of the listeners")

    def workers(self) -> set[int]:
        """The worker processes' ids, from the master's CLI (none while the master re-executes itself)."""
        text = b""
        try:
            with socket.socket(socket.AF_UNIX) as conn:
                conn.settimeout(5)
                conn.connect(str(self.master))
                conn.sendall(b"show proc\n")
                conn.shutdown(socket.SHUT_WR)
                while chunk := conn.recv(65536):
                    text += chunk
        except OSError:
            return set()
        return {int(line.split()[0]) for line in text.decode().splitlines()
                if line.split()[1:2] == ["worker"] and line.split()[0].isdigit()}


def write_edge(edge_dir: Path, written: dict[str, str]) -> None:
    edge_dir.mkdir(mode=0o750, exist_ok=True)
    for name, text in written.items():
        path = edge_dir / name
        path.touch(mode=0o640)
        path.write_text(text)


def start_edge(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tls: bool, plain: bool = False,
               peers: Peers | None = None, clients: dict[str, Any] | None = None,
               ledger_port: int | None = None, maxconn: int = 64) -> Iterator[Edge]:
    """An edge in ``tmp_path``; ``peers``: the router's peers section (its PEM written already); ``clients``:
    router_clients (default :data:`CLIENTS`); ``ledger_port``: where its token ledger listens (on loopback);
    ``maxconn``: each replica's."""
    haproxy = host_tool("haproxy", "haproxy")
    tmp_path.mkdir(exist_ok=True)
    for name, key in KEYS.items():
        monkeypatch.setenv(f"EDGE_{name.upper()}_KEY", key)
    monkeypatch.setenv("EDGE_REPLICA_KEY", REPLICA_KEY)
    lab_tls = make_lab_tls(tmp_path / "ca", ["127.0.0.1", "localhost"]) if tls else None
    tls_values: dict[str, Any] = {"router_tls_certificate": {"file": str(lab_tls.certificate)},
                                  "router_tls_key": {"file": str(lab_tls.key)}} if lab_tls else {}
    plain_port = free_port() if plain else None
    replicas = {model: KeyedReplica(f"{model}-0") for model in (OPEN, CLOSED)}
    with ExitStack() as stack:
        ports = {model: int(stack.enter_context(loopback_server(replicas[model].handler())).rsplit(":", 1)[1])
                 for model in replicas}
        configs = {f"{m}-0": host_config(vllm_served_model_name=m, vllm_api_key={"env": "EDGE_REPLICA_KEY"})
                   for m in replicas}
        cfg = host_config(router_port=free_port(), router_metrics_port=free_port(), router_check_interval_s=1,
                          router_check_fall=1, router_check_rise=1, router_clients=clients or CLIENTS,
                          router_plain_http_port=plain_port, **tls_values,
                          **({"router_ledger_port": ledger_port} if ledger_port else {}))
        plan = stand_in_plan({f"{m}-0": ("127.0.0.1", ports[m]) for m in replicas}, {**configs, "router": cfg})
        found = plan_backends.backends(plan)
        upstream = router_role.upstream_keys(plan)
        edge_dir = tmp_path / "edge"
        write_edge(edge_dir, router_role.edge_files(cfg, found, upstream))
        maxconn_by_replica = {r.name: maxconn for r in plan.replicas}
        values = router_role.config_values(cfg, "127.0.0.1", found, [], [], maxconn_by_replica, edge_dir=str(edge_dir),
                                           peers=peers)
        values["admin_socket"] = str(tmp_path / "admin.sock")
        if values["tokens"]:
            lua = tmp_path / "tokens.lua"
            lua.write_text(token_ledger.lua(cfg))
            values["tokens"]["lua"] = str(lua)
            (tmp_path / "token-budgets.json").write_text(token_ledger.budgets(cfg, found, maxconn_by_replica))
        config = tmp_path / "haproxy.cfg"
        config.write_text(router_role.render(values))
        as_its_unit = memory_rule(router_role.drop_in(cfg))  # the drop-in's memory rule, as on a router
        checked = subprocess.run([haproxy, "-c", "-f", str(config)], capture_output=True, text=True,
                                 preexec_fn=as_its_unit)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        master = tmp_path / "master.sock"
        with (tmp_path / "haproxy.log").open("w") as log:
            proc = subprocess.Popen([haproxy, "-W", "-db", "-S", str(master), "-f", str(config)], stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    preexec_fn=as_a_service(as_its_unit))
        stack.callback(proc.wait, 10)
        stack.callback(proc.terminate)
        started = Edge(cfg.router_port, plain_port, lab_tls, tmp_path / "admin.sock", master, proc, config,
                       edge_dir, replicas)
        runtime = router_admin.Runtime(str(started.socket))
        wait_for_socket(str(started.socket))
        wait(lambda: {s.status for s in runtime.servers()} == {"UP"}, "replicas UP")
        yield started


