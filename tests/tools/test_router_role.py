"""The router role's HAProxy configuration, run by a real HAProxy (Debian's) in front of loopback replicas.

The configuration is the one the role renders from a plan (two served models, one of them under a hostile name,
three replicas); the replicas are small HTTP servers on 127.0.0.1 that answer like vLLM (``/health``,
``POST /v1/completions``) and can be told to answer 503, to drop the connection unanswered, or to stop.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

import roles.router as router_role
from gpufleet.config.schema import HostConfig
from gpufleet.node import router_admin
from gpufleet.plan import backends as plan_backends
from tests.conftest import DATA, host_tool
from tests.loopback_http import QuietHandler, loopback_server, raw_request
from tests.memory_rule import memory_rule
from tests.unit.test_vllm_role import _config

HOSTILE = "tiny llama $HOME 100% 'q' \"x\""
PLAIN = "meta-llama/Llama-3.1-8B"
KEY = "router-test-key"
ROUTES = yaml.safe_load((DATA / "router" / "routes.yaml").read_text())


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


@dataclass
class Router:
    url: str
    metrics: str
    socket: Path
    replicas: dict[str, FakeReplica]
    stops: dict[str, ExitStack]

    def post(self, model: str, size: int = 0, chunked: bool = False) -> tuple[int, dict[str, Any]]:
        """A completion whose prompt is ``size`` bytes; ``chunked``: its body without a length, in 4 KiB chunks
        (Transfer-Encoding: chunked)."""
        body = json.dumps({"model": model, "prompt": "x" * size, "max_tokens": 1}).encode()
        data = iter([body[i:i + 4096] for i in range(0, len(body), 4096)]) if chunked else body
        request = urllib.request.Request(f"{self.url}/v1/completions", data=data, method="POST",
                                         headers={"Content-Type": "application/json"})
        return _open(request)

    def post_body(self, body: str) -> int:
        """The status of a completion whose body is ``body`` as written."""
        request = urllib.request.Request(f"{self.url}/v1/completions", data=body.encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        return _open(request)[0]

    def models(self, key: str | None) -> tuple[int, dict[str, Any]]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return _open(urllib.request.Request(f"{self.url}/v1/models", headers=headers))

    def status(self) -> dict[str, str]:
        return {s.server: s.status for s in router_admin.Runtime(str(self.socket)).servers()}


def _open(request: urllib.request.Request) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        text = error.read()
        return error.code, json.loads(text) if text.startswith(b"{") else {}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _wait(condition: Any, what: str, timeout: float = 15) -> None:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            pytest.fail(f"not within {timeout} s: {what}")
        time.sleep(0.1)


@contextmanager
def running_haproxy(values: dict[str, Any], workdir: Path) -> Iterator[Path]:
    """Debian's HAProxy running the role's configuration rendered from ``values`` (checked with ``haproxy -c``
    first), under its drop-in's memory rule (tests/memory_rule.py), its files in ``workdir``; yields its runtime
    socket's path, and stops it after the block."""
    haproxy = host_tool("haproxy", "haproxy")
    config = workdir / "haproxy.cfg"
    config.write_text(router_role.render({**values, "admin_socket": str(workdir / "admin.sock")}))
    as_its_unit = memory_rule(router_role.drop_in(_config()))  # the drop-in's memory rule, as on a router
    checked = subprocess.run([haproxy, "-c", "-f", str(config)], capture_output=True, text=True,
                             preexec_fn=as_its_unit)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    with (workdir / "haproxy.log").open("w") as log:
        proc = subprocess.Popen([haproxy, "-db", "-f", str(config)], stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=as_its_unit)
    try:
        yield workdir / "admin.sock"
    finally:
        proc.terminate()
        proc.wait(10)


def stand_ins(names: tuple[str, ...]) -> tuple[dict[str, FakeReplica], dict[str, ExitStack], dict[str, int]]:
    """A FakeReplica for each name, serving on 127.0.0.1: the replicas, what stops each, their ports."""
    replicas = {name: FakeReplica(name) for name in names}
    stops = {name: ExitStack() for name in names}
    ports = {name: int(stops[name].enter_context(loopback_server(replicas[name].handler())).rsplit(":", 1)[1])
             for name in names}
    return replicas, stops, ports


def loopback_plan(ports: dict[str, int]) -> list[Any]:
    """The plan's replicas as the router role reads them: each on a host of its own, at 127.0.0.1:its port."""
    return [SimpleNamespace(name=name, port=port, roles=[SimpleNamespace(host=name, address="127.0.0.1")])
            for name, port in ports.items()]


def loopback_router_config(**values: object) -> HostConfig:
    """A router's config on free loopback ports, checking every second (one check takes a replica out or back)."""
    return _config(router_port=_free_port(), router_metrics_port=_free_port(), router_check_interval_s=1,
                   router_check_fall=1, router_check_rise=1, **values)


@pytest.fixture
def router(tmp_path: Path) -> Iterator[Router]:
    """HAProxy with the role's configuration for two models: HOSTILE on two replicas, PLAIN (API key) on one."""
    names = ("pool_a-0", "pool_b-0", "plain-0")
    replicas, stops, ports = stand_ins(names)
    hostile, plain = _config(vllm_served_model_name=HOSTILE), _config(vllm_served_model_name=PLAIN)
    configs = {"pool_a-0": hostile, "pool_b-0": hostile, "plain-0": plain}
    cfg = loopback_router_config(router_max_request_bytes=16384)
    values = router_role.config_values(
        cfg, "127.0.0.1", plan_backends.backends(loopback_plan(ports), configs),
        router_role.model_lists({None: [HOSTILE], router_role.key_sha256(KEY): [PLAIN]}), [],
        dict.fromkeys(names, 64))
    started = Router(f"http://127.0.0.1:{cfg.router_port}", f"http://127.0.0.1:{cfg.router_metrics_port}/metrics",
                     tmp_path / "admin.sock", replicas, stops)
    try:
        with running_haproxy(values, tmp_path):
            _wait(lambda: started.socket.exists() and set(started.status().values()) == {"UP"}, "every replica UP")
            yield started
    finally:
        for stack in stops.values():
            stack.close()


def test_a_request_goes_to_its_models_replicas_whatever_the_name(router: Router) -> None:
    answered = {router.post(HOSTILE)[1]["replica"] for _ in range(6)}
    assert answered == {"pool_a-0", "pool_b-0"}
    assert router.post(HOSTILE)[1]["model"] == HOSTILE  # passed through untouched
    assert router.post(PLAIN) == (200, {"replica": "plain-0", "model": PLAIN})
    status, body = router.post("tiny llama")  # a prefix of a served name is another model
    assert status == 404 and body["error"]["code"] == 404
    assert router.post(HOSTILE, size=20000)[0] == 413  # over router_max_request_bytes
    # the same held for a body without a length (chunked): what the router's buffer holds of it is measured
    assert router.post(HOSTILE, size=20000, chunked=True)[0] == 413
    assert router.post(HOSTILE, size=8000, chunked=True)[1]["model"] == HOSTILE


# Bodies as written (each valid JSON) and what the router answers: 400 where vLLM would read another model than the
# router (the last "model" of a body, or a key spelled with \u escapes), 200 otherwise.
BODIES = [
    ('{"model": "%s", "prompt": "x", "max_tokens": 1}', 200),
    ('{"model": "%s", "prompt": "x", "model": "other"}', 400),
    ('{"model": "%s",\n "prompt": "x",\n "model" : "other"}', 400),
    ('{"model": "%s", "model": null}', 400),
    ('{"model": "%s", "\\u006dodel": "other"}', 400),
    ('{"model": "%s", "prompt": "\\\\\\u0041"}', 400),
    ('{"model": "%s", "prompt": "say \\"model\\": \\"other\\" please"}', 200),
    ('{"model": "%s", "prompt": "x\\\\", "max_tokens": 1}', 200),
    ('{"model": "%s", "prompt": "caf\\u00e9 \\u4e16 \\u0001 and a literal \\\\u0041"}', 200),
    ('{"model": "%s", "response_format": {"type": "json_schema", "json_schema": {"schema": {"properties": {"model":'
     ' {"type": "string"}}}}}}', 200),
]


@pytest.mark.parametrize(("body", "status"), BODIES)
def test_a_body_vllm_would_read_otherwise_gets_400(router: Router, body: str, status: int) -> None:
    text = body.replace("%s", PLAIN)
    json.loads(text)  # every case is JSON a client may send
    assert router.post_body(text) == status


def test_the_model_list_shows_what_the_key_opens(router: Router) -> None:
    def ids(key: str | None) -> list[str]:
        status, body = router.models(key)
        assert status == 200, body
        return [entry["id"] for entry in body["data"]]

    assert ids(KEY) == sorted([HOSTILE, PLAIN])
    assert ids(None) == [HOSTILE] == ids("another key")


def test_a_replica_answering_503_or_nothing_costs_no_request(router: Router) -> None:
    for mode in ("503", "drop"):
        router.replicas["pool_a-0"].mode = mode
        before = router.replicas["pool_a-0"].posts
        answers = [router.post(HOSTILE) for _ in range(8)]
        assert {status for status, _ in answers} == {200}, (mode, answers)
        assert {body["replica"] for _, body in answers} == {"pool_b-0"}
        assert router.replicas["pool_a-0"].posts > before, f"{mode}: the failing replica was never tried"
        router.replicas["pool_a-0"].mode = "ok"


def test_a_stopped_replica_is_taken_out_and_put_back(router: Router) -> None:
    router.stops["pool_b-0"].close()  # its port refuses connections now
    assert {router.post(HOSTILE)[0] for _ in range(6)} == {200}  # retried at once, before the check notices
    _wait(lambda: router.status()["pool_b-0"] == "DOWN", "pool_b-0 DOWN")
    assert router.status()["pool_a-0"] == "UP"


def test_the_metrics_endpoint_speaks_prometheus(router: Router) -> None:
    router.post(HOSTILE)
    with urllib.request.urlopen(router.metrics, timeout=10) as response:
        text = response.read().decode()
    assert 'haproxy_backend_http_responses_total{proxy="model-meta-llama_Llama-3.1-8B",code="2xx"}' in text
    assert 'haproxy_server_status{proxy="model-tiny_llama__HOME_100___q___x_",server="pool_a-0",state="UP"} 1' in text


def test_a_drained_replica_is_not_up_on_the_metrics_endpoint(router: Router) -> None:
    """What the capacity rule reads (replica:in_service:bool, templates/monitoring/rules/recording.yml.j2): a replica
    drained as a rollout drains it (router_admin.py) leaves state UP for DRAIN, the others stay UP; ready again, it is
    UP."""
    api, backend = router_admin.Runtime(str(router.socket)), "model-tiny_llama__HOME_100___q___x_"

    def states(server: str) -> dict[str, str]:
        with urllib.request.urlopen(router.metrics, timeout=10) as response:
            text = response.read().decode()
        line = re.escape(f'haproxy_server_status{{proxy="{backend}",server="{server}",state="')
        return dict(re.findall(rf'^{line}(\w+)"}} (\d)$', text, re.MULTILINE))

    router_admin.set_state(api, backend, "pool_a-0", "drain")
    assert (states("pool_a-0")["UP"], states("pool_a-0")["DRAIN"], states("pool_b-0")["UP"]) == ("0", "1", "1")
    router_admin.set_state(api, backend, "pool_a-0", "ready")
    assert (states("pool_a-0")["UP"], states("pool_a-0")["DRAIN"]) == ("1", "0")



def _ask(router: Router, method: str, path: str) -> tuple[int, bytes]:
    """One request as sent, a served model and its key in it."""
    host, port = router.url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"model": PLAIN, "prompt": "hi", "max_tokens": 1}).encode()
    return raw_request(host, int(port), method, path, body,
                       {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})


def test_only_the_routes_of_the_models_task_reach_a_replica(router: Router) -> None:
    """Each method and path of tests/data/router/routes.yaml: the router's status, and whether a replica saw the
    request (the router's own GET /health checks aside)."""
    wrong = []
    for route in ROUTES:
        for replica in router.replicas.values():
            with replica.lock:
                replica.seen.clear()
        status, text = _ask(router, route["method"], route["path"])
        reached = [(method, path) for replica in router.replicas.values() for method, path in replica.seen
                   if (method, path) != ("GET", "/health")]
        found = {"status": status, "reaches": bool(reached)}
        if found != {"status": route["status"], "reaches": route["reaches"]}:
            wrong.append((route["method"], route["path"], found, text[:80]))
    assert wrong == []
    assert json.loads(_ask(router, "GET", "/health")[1]) == {"status": "ok"}  # the router's answer, not a replica's
