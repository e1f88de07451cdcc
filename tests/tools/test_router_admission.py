"""Admission at the router, run by a real HAProxy (Debian's) on loopback with the configuration the router role
renders: a replica of maxconn 1 that answers slowly, more requests at once than it and the queue timeout let
through. The excess gets the router's own 503 with Retry-After about when the queue timeout runs out; the admitted
requests are answered by the replica, which never holds more than its maxconn.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

import roles.router as router_role
from gpufleet.node import router_admin
from gpufleet.plan import backends as plan_backends
from tests.loopback_http import ReplicaHandler, free_port, loopback_server
from tests.stand_in_plan import stand_in_plan
from tests.tools.haproxy_run import running_haproxy, wait
from tests.unit.configs import host_config

MODEL = "slow-model"
REPLICA = "slow-0"
ANSWER_S = 1.5  # how long the replica takes to answer a completion
QUEUE_TIMEOUT_S = 2.5  # between one and two answers: the second request is admitted in time, the third is not
REQUESTS = 6


class SlowReplica:
    """Answers GET /health at once and every completion after ANSWER_S; counts what it holds at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.holding = self.most = self.answered = 0

    def handler(self) -> type[BaseHTTPRequestHandler]:
        replica = self

        class Handler(ReplicaHandler):
            def complete(self, request: dict[str, Any]) -> tuple[int, bytes]:
                with replica.lock:
                    replica.holding += 1
                    replica.most = max(replica.most, replica.holding)
                time.sleep(ANSWER_S)
                with replica.lock:
                    replica.holding -= 1
                    replica.answered += 1
                return 200, json.dumps({"replica": REPLICA}).encode()

        return Handler


@dataclass(frozen=True)
class Answer:
    status: int
    retry_after: str | None
    seconds: float
    body: dict[str, Any]


@dataclass
class Router:
    port: int
    socket: Path
    backend: str
    replica: SlowReplica

    def post(self) -> Answer:
        body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1}).encode()
        started = time.monotonic()
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=15)
        try:
            connection.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            text = response.read()
            return Answer(response.status, response.getheader("Retry-After"), time.monotonic() - started,
                          json.loads(text) if text.startswith(b"{") else {})
        finally:
            connection.close()

    def status(self) -> str:
        (server,) = router_admin.Runtime(str(self.socket)).servers()
        return server.status


@pytest.fixture
def router(tmp_path: Path) -> Iterator[Router]:
    """HAProxy with the role's configuration: one model, one slow replica of maxconn 1."""
    replica = SlowReplica()
    with ExitStack() as stack:
        port = int(stack.enter_context(loopback_server(replica.handler())).rsplit(":", 1)[1])
        cfg = host_config(router_port=free_port(), router_metrics_port=free_port(), router_check_interval_s=1,
                          router_check_fall=1, router_check_rise=1, router_queue_timeout_s=QUEUE_TIMEOUT_S)
        plan = stand_in_plan({REPLICA: ("127.0.0.1", port)}, {REPLICA: host_config(vllm_served_model_name=MODEL)})
        (backend,) = plan_backends.backends(plan)
        values = router_role.config_values(cfg, "127.0.0.1", [backend], router_role.model_lists({None: [MODEL]}), [],
                                           {REPLICA: 1})
        started = Router(cfg.router_port, stack.enter_context(running_haproxy(values, tmp_path)), backend.name,
                         replica)
        wait(lambda: started.status() == "UP", "the replica UP")
        yield started


def test_requests_beyond_maxconn_and_the_queue_get_a_quick_503_with_retry_after(router: Router) -> None:
    with concurrent.futures.ThreadPoolExecutor(REQUESTS) as pool:
        answers = list(pool.map(lambda _: router.post(), range(REQUESTS)))
    served = [a for a in answers if a.status == 200]
    shed = [a for a in answers if a.status != 200]
    # the first is admitted at once, the second when the first is answered (ANSWER_S < QUEUE_TIMEOUT_S); the
    # third could start only after two answers, past the queue timeout
    assert len(served) == 2, answers
    assert all(a.body == {"replica": REPLICA} for a in served), served
    assert router.replica.most == 1 and router.replica.answered == 2
    assert {a.status for a in shed} == {503}, shed
    assert {a.retry_after for a in shed} == {"3"}  # the queue timeout, rounded up to whole seconds
    assert all(a.body.get("error", {}).get("code") == 503 for a in shed), shed
    # shed when the queue timeout ran out: not at once, not after a long timeout
    assert all(QUEUE_TIMEOUT_S - 0.1 <= a.seconds <= QUEUE_TIMEOUT_S + 1.5 for a in shed), [a.seconds for a in shed]


def test_with_no_replica_up_the_503_comes_at_once_with_retry_after(router: Router) -> None:
    router_admin.set_state(router_admin.Runtime(str(router.socket)), router.backend, REPLICA, "maint")
    answer = router.post()
    assert (answer.status, answer.retry_after) == (503, "3"), answer
    assert answer.seconds < 1.0, answer
    assert router.replica.answered == 0
