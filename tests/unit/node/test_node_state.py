"""A node's lifecycle (``gpufleet/node/node_state.py``) as data: ``tests/data/node_state/lifecycles.yml`` holds lives of
one node, step by step, with the state after each step or the line a refused move gives."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import yaml

from gpufleet.node import node_state
from tests.conftest import DATA

LIVES: dict[str, list[dict[str, Any]]] = yaml.safe_load((DATA / "node_state" / "lifecycles.yml").read_text())
POLICY = node_state.Policy(readmit_passes=2, cool_off_s=600, retire_after=3, retire_window_s=7 * 86400)
START = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)


def _verdict(tier: str, passed: bool) -> dict[str, Any]:
    checks = [{"check": "matmul", "status": "pass" if passed else "fail", "gpu": 0,
               "evidence": {"serial": "1653824070194"}}]
    return {"schema": "gpufleet.burn-in/1", "tier": tier, "passed": passed, "seconds": 42.0, "checks": checks}


@pytest.mark.parametrize("name", sorted(LIVES))
def test_a_life(name: str) -> None:
    record, now = node_state.new_record("gpu-a01", START), START
    for number, step in enumerate(LIVES[name], 1):
        now += timedelta(seconds=step.get("after", 0))
        where = f"step {number}: {step}"
        if "due" in step:
            assert node_state.readmission_due(record, now, POLICY) is step["expect"], where
            continue
        try:
            if "burn_in" in step:
                record = node_state.after_burn_in(record, _verdict(**step["burn_in"]), now, POLICY)
            elif "quarantine" in step:
                record = node_state.quarantine(record, step["quarantine"], now, POLICY, by="test")
            else:
                record = node_state.move(record, step["move"], "by hand", now, "test", force=step.get("force", False))
        except node_state.MoveRefused as refused:
            assert str(refused) == f"gpu-a01: {step['refused']}", where
            continue
        assert "refused" not in step, where
        assert record["state"] == step["state"], where
    assert [h["to"] for h in record["history"]][-1] == record["state"] or "refused" in LIVES[name][-1]


def test_every_move_is_kept_with_when_why_who_and_the_evidence() -> None:
    record = node_state.new_record("gpu-a01", START)
    record = node_state.after_burn_in(record, _verdict("quick", False), START, POLICY)
    assert [(h["from"], h["to"], h["by"]) for h in record["history"]] == [("new", "quarantined", "gpufleet")]
    entry = record["history"][0]
    assert (entry["at"], entry["why"]) == ("2026-11-01T12:00:00Z", "burn-in quick failed")
    assert entry["evidence"]["burn_in"]["failed"][0]["check"] == "matmul"
    assert record["gpus"]["1653824070194"]["failed"][0]["check"] == "matmul"  # by serial
    assert record["last_burn_in"]["passed"] is False and record["quarantines"] == ["2026-11-01T12:00:00Z"]


def test_retiring_writes_a_note_for_the_vendor() -> None:
    record, now = node_state.new_record("gpu-a01", START), START
    record = node_state.after_burn_in(record, _verdict("quick", False), now, POLICY)  # names the GPU's serial
    for _ in range(2):
        now += timedelta(hours=1)
        record = node_state.move(record, "burn-in", "cool-off over", now)
        record = node_state.quarantine(record, "Xid 79 on 0000:3b:00", now, POLICY)
    assert record["state"] == "retired"
    note = record["history"][-1]["evidence"]["vendor_note"]
    assert note.splitlines()[0] == "Node gpu-a01: retired on 2026-11-01T14:00:00Z after 3 quarantines since " \
                                   "2026-10-25T14:00:00Z."
    assert "GPU serials: 1653824070194." in note and note.count("Xid 79 on 0000:3b:00") == 2
    assert "2026-11-01T12:00:00Z: burn-in quick failed" in note


@pytest.mark.parametrize(("state", "places"), [("new", False), ("burn-in", False), ("serving", True),
                                               ("suspect", True), ("quarantined", False), ("retired", False)])
def test_only_a_serving_or_suspect_node_holds_replicas(state: str, places: bool) -> None:
    assert node_state.places_replicas({"state": state}) is places
    assert node_state.places_replicas(None) is False
