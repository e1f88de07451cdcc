"""bench/prefix_routing.py without a lab: its workloads' shapes, the conversations it sends (against a stand-in
replica on 127.0.0.1 that streams its answers), and how a row is read from the replicas' counters."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
import threading
from pathlib import Path
from typing import Any, ClassVar

import pytest

from tests.loopback_http import QuietHandler, loopback_server

_SPEC = importlib.util.spec_from_file_location("bench_prefix_routing",
                                               Path(__file__).parents[3] / "bench" / "prefix_routing.py")
assert _SPEC is not None and _SPEC.loader is not None
bench = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = bench  # its dataclasses look their module up
_SPEC.loader.exec_module(bench)


def test_multi_turn_sends_every_conversations_turn_in_a_shuffled_round_of_its_own() -> None:
    load = bench.workload("multi_turn", 12, 3, 3, random.Random(1))
    assert len(load.rounds) == 3
    assert all(sorted(order) == list(range(12)) for order in load.rounds)
    assert load.rounds[0] != load.rounds[1]  # shuffled anew each round
    assert load.prefixes == list(range(12))  # each conversation shares its prefix with itself only
    assert all(len(opener) == 1 and opener[0]["role"] == "user" for opener in load.openers)
    assert all(len(follow) == 2 for follow in load.follow_ups)
    assert len({opener[0]["content"] for opener in load.openers}) == 12


@pytest.mark.parametrize(("name", "shares"), [("system_prompts", [4, 4, 4]), ("skewed", [6, 3, 3])])
def test_users_share_their_system_prompts(name: str, shares: list[int]) -> None:
    load = bench.workload(name, 12, 3, 3, random.Random(2))
    assert len(load.rounds) == 1 and sorted(load.rounds[0]) == list(range(12))
    assert [load.prefixes.count(k) for k in range(3)] == shares
    for conversation, opener in enumerate(load.openers):
        assert [m["role"] for m in opener] == ["system", "user"]
        same = [o[0]["content"] for c, o in enumerate(load.openers) if load.prefixes[c] == load.prefixes[conversation]]
        assert set(same) == {opener[0]["content"]}


class _StreamingReplica(QuietHandler):
    """Streams "a<n>" for the n-th request it gets; records every request's messages in ``seen``."""

    protocol_version = "HTTP/1.1"
    seen: ClassVar[list[list[dict[str, str]]]] = []
    lock = threading.Lock()
    fail_every = 0

    def do_POST(self) -> None:
        body: dict[str, Any] = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.lock:
            self.seen.append(body["messages"])
            n = len(self.seen)
        if self.fail_every and n % self.fail_every == 0:
            self.answer(503, b"{}")
            return
        chunks = [{"choices": [{"delta": {"role": "assistant"}}]}, {"choices": [{"delta": {"content": f"a{n}"}}]}]
        stream = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        self.answer(200, stream.encode())


def test_each_turn_resends_the_history_after_every_answer_of_the_round_before() -> None:
    _StreamingReplica.seen, _StreamingReplica.fail_every = [], 0
    load = bench.workload("multi_turn", 5, 3, 3, random.Random(3))
    with loopback_server(_StreamingReplica) as url:
        tally = bench.run_workload(load, lambda _: bench.Target(url, "k"), "m", 2, 4, 60)
    seen = _StreamingReplica.seen
    assert tally.sent == 15 and not tally.failures and len(tally.ttft_s) == 15
    assert [len(messages) for messages in seen] == [1] * 5 + [3] * 5 + [5] * 5  # rounds never overlap
    for messages in seen[10:]:
        opener = messages[0]["content"]
        conversation = next(c for c, o in enumerate(load.openers) if o[0]["content"] == opener)
        assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant", "user"]
        assert [messages[2]["content"], messages[4]["content"]] == load.follow_ups[conversation]
        assert all(m["content"].startswith("a") for m in messages[1::2][:2])


def test_a_failed_answer_is_counted_and_the_conversation_goes_on() -> None:
    _StreamingReplica.seen, _StreamingReplica.fail_every = [], 4
    load = bench.workload("system_prompts", 8, 2, 2, random.Random(4))
    with loopback_server(_StreamingReplica) as url:
        tally = bench.run_workload(load, lambda _: bench.Target(url, "k"), "m", 1, 4, 60)
    assert tally.sent == 8 and len(tally.failures) == 2 and len(tally.ttft_s) == 6
    assert all("HTTP 503" in failure for failure in tally.failures)


def test_a_repeated_run_counts_into_the_same_tally() -> None:
    _StreamingReplica.seen, _StreamingReplica.fail_every = [], 0
    tally = bench.Tally()
    with loopback_server(_StreamingReplica) as url:
        for seed in (5, 6):
            load = bench.workload("multi_turn", 3, 2, 2, random.Random(seed))
            assert bench.run_workload(load, lambda _: bench.Target(url, "k"), "m", 2, 4, 60, tally) is tally
    assert tally.sent == 12 and len(tally.ttft_s) == 12 and not tally.failures
    assert len({messages[0]["content"] for messages in _StreamingReplica.seen}) == 6  # fresh text each run


def test_a_row_reads_the_counters_differences() -> None:
    before = {"a": {"hits": 100.0, "queries": 400.0, "requests": 10.0},
              "b": {"hits": 0.0, "queries": 0.0, "requests": 0.0},
              "c": {"hits": 0.0, "queries": 0.0, "requests": 0.0}}
    after = {"a": {"hits": 400.0, "queries": 1000.0, "requests": 22.0},
             "b": {"hits": 100.0, "queries": 600.0, "requests": 12.0},
             "c": {"hits": 0.0, "queries": 200.0, "requests": 2.0}}
    tally = bench.Tally(ttft_s=[0.1, 0.2, 0.3, 0.4], failures=["x"], sent=27)
    row = bench.figures(before, after, tally)
    assert row["hit_ratio"] == round(400 / 1400, 3)
    assert row["requests_per_replica"] == {"a": 12, "b": 12, "c": 2}
    assert row["busiest_over_mean"] == round(12 / (26 / 3), 2)
    assert (row["requests"], row["failed"], row["ttft_p50_s"], row["ttft_p99_s"]) == (27, 1, 0.3, 0.4)


def test_pinned_sends_every_user_of_a_prefix_to_one_replica_in_turn() -> None:
    pick = bench._picker("pinned", bench.Target("https://edge", "c"), None, ["r1", "r2", "r3"], "k", [0, 1, 2, 0, 4])
    assert [pick(c).url for c in range(5)] == [f"http://{r}:8000" for r in ("r1", "r2", "r3", "r1", "r2")]
    assert {pick(c).key for c in range(5)} == {"k"}
    edge = bench.Target("https://edge", "c")
    assert bench._picker("prefix", edge, None, ["r1"], "k", [0])(0) is edge
