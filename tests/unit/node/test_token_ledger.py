"""The routers' token ledger (gpufleet/node/token_ledger.py): its decisions as data (tests/data/token_ledger), its
state carried to another router's ledger by replication and by a snapshot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from gpufleet.node.token_ledger import Ledger

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
