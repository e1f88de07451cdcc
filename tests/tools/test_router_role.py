"""The router role's HAProxy configuration, run by a real HAProxy (Debian's) in front of loopback replicas.

The configuration is the one the role renders from a plan (two served models, one of them under a hostile name,
three replicas); the replicas are small HTTP servers on 127.0.0.1 that answer like vLLM (``/health``,
``POST /v1/completions``) and can be told to answer 503, to drop the connection unanswered, or to stop.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

import roles.router as router_role
from gpufleet.node import router_admin
from gpufleet.plan import backends as plan_backends
from tests.conftest import DATA
from tests.loopback_http import raw_request
from tests.tools.haproxy_run import (
    FakeReplica,
    json_answer,
    loopback_plan,
    loopback_router_config,
    running_haproxy,
    stand_ins,
    wait,
)
from tests.unit.configs import host_config

HOSTILE = "tiny llama $HOME 100% 'q' \"x\""
PLAIN = "meta-llama/Llama-3.1-8B"
KEY = "router-test-key"
ROUTES = yaml.safe_load((DATA / "router" / "routes.yaml").read_text())


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
        return json_answer(request)

    def post_body(self, body: str) -> int:
        """The status of a completion whose body is ``body`` as written."""
        request = urllib.request.Request(f"{self.url}/v1/completions", data=body.encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        return json_answer(request)[0]

    def models(self, key: str | None) -> tuple[int, dict[str, Any]]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return json_answer(urllib.request.Request(f"{self.url}/v1/models", headers=headers))

    def status(self) -> dict[str, str]:
        return {s.server: s.status for s in router_admin.Runtime(str(self.socket)).servers()}


@pytest.fixture
def router(tmp_path: Path) -> Iterator[Router]:
    """HAProxy with the role's configuration for two models: HOSTILE on two replicas, PLAIN (API key) on one."""
    names = ("pool_a-0", "pool_b-0", "plain-0")
    replicas, stops, ports = stand_ins(names)
    hostile, plain = host_config(vllm_served_model_name=HOSTILE), host_config(vllm_served_model_name=PLAIN)
    configs = {"pool_a-0": hostile, "pool_b-0": hostile, "plain-0": plain}
    cfg = loopback_router_config(router_max_request_bytes=16384)
    values = router_role.config_values(
        cfg, "127.0.0.1", plan_backends.backends(loopback_plan(ports, configs)),
        router_role.model_lists({None: [HOSTILE], router_role.key_sha256(KEY): [PLAIN]}), [],
        dict.fromkeys(names, 64))
    started = Router(f"http://127.0.0.1:{cfg.router_port}", f"http://127.0.0.1:{cfg.router_metrics_port}/metrics",
                     tmp_path / "admin.sock", replicas, stops)
    try:
        with running_haproxy(values, tmp_path):
            wait(lambda: set(started.status().values()) == {"UP"}, "every replica UP")
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
    ('{"model": "%s", "prompt": "\\u007e"}', 400),
    ('{"model": "%s", "prompt": "\\u007f and \\u007F"}', 200),
    ('{"model": "%s", "response_format": {"type": "json_schema", "json_schema": {"schema": {"properties": {"model":'
     ' {"type": "string"}}}}}}', 200),
]


@pytest.mark.parametrize(("body", "status"), BODIES)
def test_a_body_vllm_would_read_otherwise_gets_400(router: Router, body: str, status: int) -> None:
    text = body.replace("%s", PLAIN)
    json.loads(text)  # every case is JSON a client may send
    assert router.post_body(text) == status


def test_every_character_as_pythons_json_writes_it_passes(router: Router) -> None:
    """What an encoder writes is never refused as spelled otherwise: every ASCII character, DEL and the controls
    included (json escapes those as \\u00XX), and some beyond, in one prompt (a lab client's chat history held a
    DEL the model had written, and its next turns got 400 while the printable range took it in)."""
    prompt = "".join(map(chr, range(128))) + "caf\u00e9 \u2028 \U0001f642"
    assert router.post_body(json.dumps({"model": HOSTILE, "prompt": prompt, "max_tokens": 1})) == 200


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
    wait(lambda: router.status()["pool_b-0"] == "DOWN", "pool_b-0 DOWN")
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
