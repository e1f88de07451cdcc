"""The routers' token ledger (gpufleet/node/token_ledger.py): its decisions as data (tests/data/token_ledger), its
state carried to another router's ledger by replication and by a snapshot."""

from __future__ import annotations

import itertools
import time
from collections import deque
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpufleet.node import token_ledger as token_ledger_module
from gpufleet.node.token_ledger import LATE_S, FairQueue, Ledger, Service, Ticket

CASES = yaml.safe_load((Path(__file__).parents[2] / "data" / "token_ledger" / "cases.yaml").read_text())


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_the_ledger_decides_each_step_as_written(case: dict[str, Any]) -> None:
    ledger = Ledger(case["budgets"])
    ids: dict[str, str] = {}
    for number, step in enumerate(case["steps"]):
        if "settle" in step:
            ident, prompt, completion = step["settle"]
            ledger.settle(ids[ident], prompt, completion, step["at"])
            continue
        answer = ledger.reserve(*step["reserve"], now=step["at"])
        ids[f"id{number}"] = answer.id
        names = ("admitted", "id", "remaining", "reset_s", "retry_after_s")
        fields = dict(zip(names, answer.line().split(), strict=True))
        for name in ("admitted", "remaining", "reset_s", "retry_after_s"):
            if name in step:
                assert int(fields[name]) == step[name], f"step {number}: {name}: {answer}"


def test_a_replica_ledger_fed_the_changes_decides_as_the_first() -> None:
    budgets = {"clients": {"alice": {"tokens_per_minute": 1000}}}
    first, second = Ledger(budgets, "a"), Ledger(budgets, "b")
    held = first.reserve("alice", "m", 700, 0.0)
    for event in first.take_events():
        second.apply(event)
    assert second.reserve("alice", "m", 400, 1.0).admitted is False
    first.settle(held.id, 100, 100, 2.0)
    for event in first.take_events():
        second.apply(event)
    assert second.reserve("alice", "m", 800, 3.0).line().split()[2] == "0"


def test_a_ledger_that_starts_takes_the_state_of_another() -> None:
    budgets = {"clients": {"alice": {"tokens_per_minute": 1000, "tokens_per_day": 5000}}}
    first = Ledger(budgets, "a")
    done = first.reserve("alice", "m", 500, 0.0)
    first.settle(done.id, 200, 100, 1.0)
    first.reserve("alice", "m", 300, 2.0)
    second = Ledger(budgets, "b")
    second.restore(first.snapshot())
    mine = second.reserve("alice", "m", 400, 3.0).line().split()
    theirs = first.reserve("alice", "m", 400, 3.0).line().split()
    assert mine[:1] + mine[2:] == theirs[:1] + theirs[2:] == ["1", "0", "86398", "0"]
    assert 'gpufleet_router_client_prompt_tokens_total{client="alice",model="m"} 200' in second.metrics(3.0)



FAIR = yaml.safe_load((Path(__file__).parents[2] / "data" / "token_ledger" / "fair.yaml").read_text())


def _ended(case: dict[str, Any]) -> list[tuple[str, float]]:
    """The requests of ``case`` in the order they ended (the oldest let through first): (client, tokens charged)."""
    queue = FairQueue()
    clients = case["clients"]
    queue.configure({"b": case["slots"]}, {name: c.get("share", 1) for name, c in clients.items()},
                    {name: c["class"] for name, c in clients.items() if "class" in c}, 3600.0)
    waiting: dict[str, Ticket] = {}
    going: deque[tuple[str, Ticket]] = deque()
    ended: list[tuple[str, float]] = []

    def through() -> None:  # each call lets one request through at most: their order is the order they went in
        for ident in [i for i, ticket in waiting.items() if ticket.event.is_set()]:
            going.append((ident, waiting.pop(ident)))

    def arrive(name: str) -> None:
        for n in range(clients[name]["backlog"]):
            waiting[f"{name}-{n}"] = queue.enter(f"{name}-{n}", "b", name, clients[name]["reserve"], now=0.0)
            through()

    for name, client in clients.items():
        if "after" not in client:
            arrive(name)
    while going:
        ident, ticket = going.popleft()
        charged = clients[ticket.client]["charged"]
        queue.release(ident, charged)
        ended.append((ticket.client, charged))
        through()
        for name, client in clients.items():
            if client.get("after") == len(ended):
                arrive(name)
    return ended


@pytest.mark.parametrize("case", FAIR, ids=[c["id"] for c in FAIR])
def test_backlogged_clients_are_served_tokens_in_proportion_to_their_shares(case: dict[str, Any]) -> None:
    ended = _ended(case)
    assert len(ended) == sum(c["backlog"] for c in case["clients"].values())  # every request went, once
    tokens = dict.fromkeys(case["clients"], 0.0)
    for client, charged in ended[case["from"]:case["to"]]:
        tokens[client] += charged
    first = tokens[next(iter(case["clients"]))]
    for name, ratio in case["expect"].items():
        assert tokens[name] / first == pytest.approx(ratio, rel=0.10), tokens


def test_a_request_that_waits_past_its_bound_leaves_the_queue_and_one_never_settled_frees_its_place() -> None:
    queue = FairQueue()
    queue.configure({"b": 1}, {}, {}, 30.0)
    first = queue.enter("1", "b", "a", 10, now=0.0)
    second = queue.enter("2", "b", "a", 10, now=0.0)
    assert queue.wait("1", first, 0.0) and not queue.wait("2", second, 0.01)
    queue.release("2", 10)  # it left: no place to free, nothing let through
    third = queue.enter("3", "b", "a", 10, now=10.0)
    assert not third.event.is_set() and queue.in_flight["b"] == 1
    fourth = queue.enter("4", "b", "a", 10, now=31.0)  # the first was never settled: its place is free again
    assert third.event.is_set() and not fourth.event.is_set()


def test_a_reservation_waits_for_its_turn_here_and_another_routers_is_only_decided() -> None:
    budgets = {"clients": {}, "slots": {"b": 1}, "queue_s": 0.05}
    service = Service(Ledger(budgets, "a"), budgets)
    first = service.reserve("alice b 10 5", 0.0).split()
    assert first[0] == "1"  # the one place
    assert service.reserve("alice b 10 5", 0.0).split()[0] == "2"  # waited its bound: the router's own 503
    assert service.decide("bob b 10 5", 0.0).split()[0] == "1"  # a peer's call: the budgets' answer, at once
    service.settle(f"{first[1]} 3 5", 1.0)
    assert service.reserve("bob b 10 5", 1.0).split()[0] == "1"  # the place is free again


def test_a_turn_that_comes_too_late_for_the_router_gives_its_place_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reservation whose turn is answered past the queue's timeout and LATE_S (its thread woke late, the machine
    busy) is answered busy and frees its place: HAProxy no longer waits for it, and would never settle it."""
    budgets = {"clients": {}, "slots": {"b": 1}, "queue_s": 0.05}
    service = Service(Ledger(budgets, "a"), budgets)
    clock = itertools.chain([0.0, 0.05 + LATE_S + 0.1], itertools.repeat(10.0))

    class Late:
        monotonic = staticmethod(lambda: next(clock))
        time = staticmethod(time.time)

    monkeypatch.setattr(token_ledger_module, "time", Late)
    assert service.reserve("alice b 10 5", 0.0).split()[0] == "2"  # let through, but too late: busy
    assert service.fair.in_flight["b"] == 0
    assert service.reserve("bob b 10 5", 1.0).split()[0] == "1"  # its place is free
