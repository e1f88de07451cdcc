"""Token budgets at the edge: two real HAProxies (Debian's) with the router role's configuration and Lua, each with
its router's token ledger (gpufleet/node/token_ledger.py, one authority for both over TLS with the routers' own
certificate), in front of stand-in replicas that report vLLM's usage."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpufleet.node import router_admin
from gpufleet.node import token_ledger as ledger_tool
from roles.router import peers
from tests.loopback_http import free_port
from tests.polling import until
from tests.tools.edge_run import CLIENTS, OPEN, Edge, start_edge, usage

KEY = "erin-key-0123456789abcdef"
BUDGET = 1000  # tokens a minute
MAX_TOKENS = 50
REMAINING = "gpufleet_router_client_tokens_remaining"
CLIENT = {"api_key": {"env": "EDGE_ERIN_KEY"}, "models": [OPEN], "tokens_per_minute": BUDGET}


@dataclass
class Router:
    edge: Edge
    ledger_port: int
    ledger: subprocess.Popen[bytes]

    def post(self, prompt: str = "hello world!", max_tokens: int = MAX_TOKENS, stream: bool = False
             ) -> tuple[int, dict[str, str], bytes]:
        body = json.dumps({"model": OPEN, "prompt": prompt, "max_tokens": max_tokens, "stream": stream})
        connection = http.client.HTTPConnection("127.0.0.1", self.edge.port, timeout=20)
        try:
            connection.request("POST", "/v1/completions", body=body,
                               headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
            response = connection.getresponse()
            return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
        finally:
            connection.close()

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ledger_port}/metrics", timeout=5) as answer:
            return str(answer.read().decode())


@pytest.fixture
def routers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Router, Router]]:
    """Routers a (the ledgers' authority: first in the group) and b, with erin's budget of 1,000 tokens a minute."""
    monkeypatch.setenv("EDGE_ERIN_KEY", KEY)
    pem = tmp_path / "peers.pem"
    pem.touch(mode=0o600)
    pem.write_text(peers.draw_pem())
    local = {name: free_port() for name in "ab"}
    listed = ",".join(f"127.0.0.1:{free_port()}" for _ in "ab")
    with ExitStack() as stack:
        found = []
        for index, name in enumerate("ab"):
            edge = stack.enter_context(contextmanager(start_edge)(
                tmp_path / name, monkeypatch, tls=False, clients={**CLIENTS, "erin": CLIENT}, ledger_port=local[name]))
            ledger = subprocess.Popen(
                [sys.executable, "-I", ledger_tool.__file__, "--budgets", str(tmp_path / name / "token-budgets.json"),
                 "--listen", f"127.0.0.1:{local[name]}", "--routers", listed, "--self", str(index), "--pem", str(pem)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            stack.callback(ledger.wait, 10)
            stack.callback(ledger.terminate)
            router = Router(edge, local[name], ledger)
            until(lambda router=router: _answers(router), "the ledger answers", timeout_s=10)
            found.append(router)
        yield found[0], found[1]


def _answers(router: Router) -> bool:
    try:
        router.metrics()
    except OSError:
        return False
    return True


def _served(answers: list[tuple[int, dict[str, str], bytes]]) -> int:
    """The tokens the 200s among ``answers`` were charged (prompt and completion, as their usage says)."""
    return sum(json.loads(body)["usage"]["total_tokens"] for status, _, body in answers if status == 200)


def test_a_minutes_budget_holds_for_100_requests_at_once_through_both_routers(routers: tuple[Router, Router]) -> None:
    a, b = routers
    with concurrent.futures.ThreadPoolExecutor(100) as pool:
        answers = list(pool.map(lambda i: (a, b)[i % 2].post(), range(100)))
    statuses = sorted({status for status, _, _ in answers})
    assert statuses == [200, 429], statuses
    assert 0 < _served(answers) <= BUDGET + MAX_TOKENS
    for status, headers, _ in answers:
        assert int(headers["x-ratelimit-remaining-tokens"]) >= 0
        assert headers["x-ratelimit-reset-tokens"].endswith("s")
        if status == 429:
            assert 1 <= int(headers["retry-after"]) <= 60


def test_each_answer_says_the_budget_left_and_a_cost_above_the_whole_budget_gets_400(
        routers: tuple[Router, Router]) -> None:
    a, _ = routers
    first, second = a.post(), a.post()
    assert first[0] == second[0] == 200
    assert int(second[1]["x-ratelimit-remaining-tokens"]) < int(first[1]["x-ratelimit-remaining-tokens"]) < BUDGET
    status, headers, _ = a.post(max_tokens=BUDGET + 1)
    assert status == 400 and "retry-after" not in headers


def test_a_streamed_answers_usage_settles_its_reservation_and_reaches_the_clients_textfile(
        routers: tuple[Router, Router], tmp_path: Path) -> None:
    a, _ = routers
    status, _, body = a.post(max_tokens=7, stream=True)
    assert status == 200 and b'"usage": {"prompt_tokens"' in body
    prompt, completion = usage({"prompt": "hello world!", "max_tokens": 7})
    until(lambda: f'gpufleet_router_client_completion_tokens_total{{client="erin",model="{OPEN}"}} {completion}'
          in a.metrics(), "the streamed usage settled", timeout_s=10)
    assert f'gpufleet_router_client_prompt_tokens_total{{client="erin",model="{OPEN}"}} {prompt}' in a.metrics()
    textfile = tmp_path / "clients.prom"
    router_admin.run(["client-metrics", "--textfile", str(textfile), "--socket", str(a.edge.socket),
                      "--edge-dir", str(a.edge.edge_dir), "--ledger", str(a.ledger_port)])
    written = textfile.read_text()
    assert 'gpufleet_router_client_requests_total{client="erin"}' in written
    assert f'gpufleet_router_client_token_budget{{client="erin",model="{OPEN}",window="minute"}} {BUDGET}' in written


def test_the_other_routers_ledger_holds_the_budget_used_when_the_first_is_gone(
        routers: tuple[Router, Router]) -> None:
    a, b = routers
    while a.post()[0] == 200:
        pass
    until(lambda: _settled(a) and a.metrics() == b.metrics(), "the used budget settled and replicated to router b")
    left = int(float(_metrics(a)[f'{REMAINING}{{client="erin",model="{OPEN}",window="minute"}}']))
    assert 0 <= left < BUDGET - 2 * MAX_TOKENS
    a.ledger.terminate()
    a.ledger.wait(10)
    status, headers, _ = b.post(prompt="x" * left)  # a cost above what is left, well below a whole budget
    assert status == 429, headers
    assert int(headers["retry-after"]) >= 1
    assert int(headers["x-ratelimit-remaining-tokens"]) == left  # b decides alone, with what a had counted


def _settled(router: Router) -> bool:
    return _metrics(router)[f'gpufleet_router_client_tokens_held{{client="erin",model="{OPEN}"}}'] == "0"


def _metrics(router: Router) -> dict[str, str]:
    return {line.rsplit(" ", 1)[0]: line.rsplit(" ", 1)[1] for line in router.metrics().splitlines()
            if not line.startswith("#")}


def test_a_request_the_router_answers_itself_after_its_reservation_holds_nothing(
        routers: tuple[Router, Router]) -> None:
    a, _ = routers
    runtime = router_admin.Runtime(str(a.edge.socket))
    backend = next(s.backend for s in runtime.servers() if s.server == f"{OPEN}-0")
    router_admin.set_state(runtime, backend, f"{OPEN}-0", "maint")
    status, _, _ = a.post()
    assert status == 503  # no replica: HAProxy's own answer, after the ledger reserved the request's cost
    until(lambda: _settled(a), "the reservation released")
    left = _metrics(a)[f'{REMAINING}{{client="erin",model="{OPEN}",window="minute"}}']
    assert float(left) == BUDGET


def test_a_lone_ledger_saves_its_state_when_it_stops_and_starts_from_it(tmp_path: Path) -> None:
    budgets = tmp_path / "budgets.json"
    budgets.write_text(json.dumps({"clients": {"erin": {"tokens_per_minute": BUDGET}}}))
    port, state = free_port(), tmp_path / "state.json"

    def reserve(tokens: int) -> list[str]:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/reserve", data=f"erin m {tokens} 0".encode())
        with urllib.request.urlopen(request, timeout=5) as answer:
            return str(answer.read().decode()).split()

    for attempt in range(2):
        ledger = subprocess.Popen([sys.executable, "-I", ledger_tool.__file__, "--budgets", str(budgets), "--listen",
                                   f"127.0.0.1:{port}", "--state", str(state)])
        try:
            until(lambda: _reserving(reserve), "the ledger answers", timeout_s=10)
            assert reserve(300)[2] == ("700" if attempt == 0 else "400")  # the first run's hold, still held
        finally:
            ledger.terminate()
            assert ledger.wait(10) == 0
        assert state.exists()


def _reserving(reserve: Callable[[int], list[str]]) -> bool:
    try:
        return reserve(0)[0] == "1"
    except OSError:
        return False
