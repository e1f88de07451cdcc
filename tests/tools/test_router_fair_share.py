"""Fair share at the edge: a real HAProxy (Debian's) with the router role's configuration and Lua and its token
ledger (gpufleet/node/token_ledger.py), in front of a stand-in replica that takes two requests at once and answers
each after the same time: three backlogged clients whose requests ask for different numbers of tokens are served
tokens in proportion to their shares, not requests, over a count of answers (beside the lab, on two busy cores, a
span of seconds once held eight answers: too few to weigh)."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

from gpufleet.node import token_ledger as ledger_tool
from tests.loopback_http import free_port
from tests.polling import until
from tests.tools.edge_run import CLIENTS, OPEN, start_edge

SHARED = {  # client: (share, max_tokens of each of its requests)
    "fa": (1, 10),
    "fb": (1, 20),
    "fc": (2, 10),
}
PROMPT = "sleep:0.04"  # the stand-in answers after 40 ms: the replica's time is the same for every request
THREADS = 6  # each client's requests in flight at once: all three are always waiting
# The answers counted, in the order they came: the first WARM are the queue filling. Virtual token counters keep
# each backlogged client within one request per place of its share (2 places x fb's 24 tokens here, against some
# 420 tokens per share over 120 answers: 11%, and once 432 against 390 tokens); over 240 answers, half that.
WARM, COUNTED = 30, 240
RUN_S = 120.0  # at most: a machine busy with other work answers slower, and the count, not a span, decides


def _post(port: int, client: str) -> tuple[int, int | str]:
    """The answer's status, and its tokens (a 200) or its body's start (a refusal: whose it was)."""
    body = json.dumps({"model": OPEN, "prompt": PROMPT, "max_tokens": SHARED[client][1]})
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        connection.request("POST", "/v1/completions", body=body,
                           headers={"Authorization": f"Bearer {client}-key-0123456789abcdef",
                                    "Content-Type": "application/json"})
        response = connection.getresponse()
        answer = response.read()
        if response.status != 200:
            return response.status, answer[:120].decode(errors="replace")
        return response.status, int(json.loads(answer)["usage"]["total_tokens"])
    finally:
        connection.close()


def test_backlogged_clients_get_tokens_in_proportion_to_their_shares(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    clients = {**CLIENTS, **{name: {"api_key": {"env": f"EDGE_{name.upper()}_KEY"}, "share": share}
                             for name, (share, _) in SHARED.items()}}
    for name in SHARED:
        monkeypatch.setenv(f"EDGE_{name.upper()}_KEY", f"{name}-key-0123456789abcdef")
    port = free_port()
    with contextmanager(start_edge)(tmp_path, monkeypatch, tls=False, clients=clients, ledger_port=port,
                                    maxconn=2) as edge:
        with (tmp_path / "ledger.err").open("wb") as errors:  # the child keeps its own copy of the descriptor
            ledger = subprocess.Popen([sys.executable, "-I", ledger_tool.__file__, "--budgets",
                                       str(tmp_path / "token-budgets.json"), "--listen", f"127.0.0.1:{port}"],
                                      stdout=subprocess.DEVNULL, stderr=errors)
        try:
            until(lambda: _answers(port), "the ledger answers", timeout_s=10)
            answered: list[tuple[str, int]] = []  # (client, tokens), in the order the answers came
            failed: list[tuple[int, int | str]] = []
            lock = threading.Lock()
            done = threading.Event()
            start = time.monotonic()

            def client_loop(name: str) -> None:
                while not done.is_set() and time.monotonic() - start < RUN_S:
                    status, tokens = _post(edge.port, name)
                    with lock:
                        if status != 200 or not isinstance(tokens, int):
                            failed.append((status, tokens))
                        else:
                            answered.append((name, tokens))
                        if len(answered) >= WARM + COUNTED:
                            done.set()

            threads = [threading.Thread(target=client_loop, args=(name,)) for name in SHARED for _ in range(THREADS)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(RUN_S + 30)
        finally:
            ledger.terminate()
            ledger.wait(10)
    assert not failed, (failed[:3], len(failed), len(answered), (tmp_path / "ledger.err").read_text()[-2000:])
    assert len(answered) >= WARM + COUNTED, len(answered)
    counted = answered[WARM:WARM + COUNTED]
    served = {name: sum(tokens for client, tokens in counted if client == name) for name in SHARED}
    per_share = {name: served[name] / SHARED[name][0] for name in SHARED}
    print(json.dumps({"fair_share_tokens": served}))
    assert min(per_share.values()) > 0 and max(per_share.values()) <= 1.10 * min(per_share.values()), served


def _answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5):
            return True
    except OSError:
        return False
