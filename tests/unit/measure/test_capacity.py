"""A model's measured ceiling per replica of each of its shapes (gpufleet/measure/capacity.py), the ceilings ``gpufleet
bench`` writes for Prometheus (gpufleet/monitoring/ceiling_rules.py) beside the shape the plan's figures give each
replica (gpufleet/monitoring/plan_rules.py), and what ``gpufleet plan --observed`` prints of them.

``tests/data/capacity/`` serves one model under two shapes, as the lab does: two one-node replicas (tp8-pp1) and a
pipeline over two nodes (tp8-pp2), on 8xH100-SXM. Records are given as the capacity reads them (key, replicas that
served the bench, ceiling, date). That Prometheus's capacity follows the replicas in service, under promtool:
tests/data/alert_rules/ceilings.test.yml.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

import gpufleet.remote.bench_store as store
import gpufleet.remote.gpu_probe as live_probe
from gpufleet.cli.inputs import fleet_facts
from gpufleet.cli.main import main
from gpufleet.inventory.load import load_fleet
from gpufleet.measure.capacity import ModelCapacity, ShapeCeiling, model_capacities
from gpufleet.measure.records import Record, RecordKey
from gpufleet.monitoring import ceiling_rules
from gpufleet.monitoring.plan_rules import plan_rules
from gpufleet.plan.planner import FleetPlan, plan_fleet
from gpufleet.remote import commands as remote_module
from tests.conftest import DATA
from tests.unit.node_files import NodeFiles

FLEET = str(DATA / "capacity" / "inventory.py")
MODEL = "llama-8b"
PROFILE = "8xH100-SXM"
DATE = "2026-11-20T00:00:00+00:00"


@dataclass(frozen=True)
class _Ceiling:
    rate: float | None


@dataclass(frozen=True)
class _Measured:
    """A bench record as the capacity reads it."""

    key: RecordKey
    replicas: int
    rate: float | None
    date: str = DATE

    @property
    def ceiling(self) -> _Ceiling:
        return _Ceiling(self.rate)

    def per_replica_rps(self) -> float | None:
        return None if self.rate is None else self.rate / max(1, self.replicas)

    def concurrency_at_ceiling(self) -> int | None:  # not read: admission stays the plan's (test_measured_admission)
        return None


def _one(layout: str, rate: float | None, release: str = "0.32.0") -> Any:
    return _Measured(RecordKey(MODEL, release, layout, PROFILE, "replica"), 1, rate)


def _routers(rate: float, replicas: int = 3) -> Any:
    return _Measured(RecordKey(MODEL, "0.32.0", "tp8-pp1+tp8-pp2", PROFILE, "routers"), replicas, rate)


def _planned() -> FleetPlan:
    fleet = load_fleet(FLEET)
    return plan_fleet(fleet, fleet_facts(fleet, None))


def _capacity(records: Sequence[Any]) -> ModelCapacity | None:
    return model_capacities(_planned().replicas, list(records)).get(MODEL)


def test_each_shape_takes_its_one_replica_records_ceiling() -> None:
    cap = _capacity([_one("tp8-pp1", 10.0), _one("tp8-pp2", 16.0)])
    assert cap is not None
    assert cap.shapes == (ShapeCeiling("tp8-pp1", PROFILE, 10.0, 2), ShapeCeiling("tp8-pp2", PROFILE, 16.0, 1))
    assert (cap.ceiling_rps, cap.replicas, cap.release, cap.current) == (36.0, 3, "0.32.0", True)
    assert cap.replicas_for(48.0) == 4  # 12 req/s a replica on average


def test_a_routers_record_of_the_mix_is_shared_in_proportion_to_each_shapes_own() -> None:
    cap = _capacity([_routers(30.0), _one("tp8-pp1", 10.0), _one("tp8-pp2", 16.0)])
    assert cap is not None and cap.ceiling_rps == pytest.approx(30.0)  # what the routers' record measured
    single, pipeline = cap.shapes
    assert (single.per_replica_rps, pipeline.per_replica_rps) == (pytest.approx(25 / 3), pytest.approx(40 / 3))
    assert len(cap.sources) == 3


def test_without_each_shapes_own_record_a_routers_record_gives_every_shape_its_average() -> None:
    cap = _capacity([_routers(30.0), _one("tp8-pp2", 16.0)])
    assert cap is not None and cap.ceiling_rps == 30.0
    assert [(s.layout, s.per_replica_rps, s.replicas) for s in cap.shapes] == [("tp8-pp1", 10.0, 2),
                                                                              ("tp8-pp2", 10.0, 1)]


def test_a_shape_without_a_ceiling_leaves_the_model_unmeasured() -> None:
    assert _capacity([_one("tp8-pp1", 10.0)]) is None
    assert _capacity([_one("tp8-pp1", 10.0), _one("tp8-pp2", None)]) is None  # its first step missed


def test_an_earlier_releases_records_stand_in_and_say_so() -> None:
    cap = _capacity([_one("tp8-pp1", 10.0, "0.31.0"), _one("tp8-pp2", 16.0, "0.31.0")])
    assert cap is not None and (cap.release, cap.current, cap.ceiling_rps) == ("0.31.0", False, 36.0)


def test_the_ceilings_name_each_shape_as_the_plans_figures_name_each_replicas() -> None:
    """Prometheus joins gpufleet:replica_shape (the plan, every deploy) with gpufleet:replica_ceiling_rps (the bench)
    on model, layout and GPU profile: every replica of the plan finds its shape's ceiling."""
    plan = _planned()
    found = model_capacities(plan.replicas, [_one("tp8-pp1", 10.0), _one("tp8-pp2", 16.0)])
    ceilings = yaml.safe_load(ceiling_rules.ceiling_rules(found, "# the test's\n"))["groups"][0]
    assert ceilings["name"] == ceiling_rules.GROUP
    assert ceilings["rules"] == [
        {"record": "gpufleet:replica_ceiling_rps", "expr": "vector(10.0)",
         "labels": {"model": MODEL, "release": "0.32.0", "layout": "tp8-pp1", "gpu_profile": PROFILE}},
        {"record": "gpufleet:replica_ceiling_rps", "expr": "vector(16.0)",
         "labels": {"model": MODEL, "release": "0.32.0", "layout": "tp8-pp2", "gpu_profile": PROFILE}}]
    facts = yaml.safe_load(plan_rules({}, plan, 1.0, ""))["groups"][0]["rules"]
    shapes = [rule for rule in facts if rule["record"] == "gpufleet:replica_shape"]
    assert shapes == [
        {"record": "gpufleet:replica_shape", "expr": "vector(1)",
         "labels": {"model": MODEL, "replica": name, "layout": layout, "gpu_profile": PROFILE}}
        for name, layout in (("pipeline-0", "tp8-pp2"), ("single-gpu-s01", "tp8-pp1"), ("single-gpu-s02", "tp8-pp1"))]
    measured = {(r["labels"]["model"], r["labels"]["layout"], r["labels"]["gpu_profile"]) for r in ceilings["rules"]}
    assert {(s["labels"]["model"], s["labels"]["layout"], s["labels"]["gpu_profile"]) for s in shapes} == measured


def test_a_model_never_benched_gets_an_empty_ceiling_file() -> None:
    assert yaml.safe_load(ceiling_rules.ceiling_rules({}, ""))["groups"] == [
        {"name": ceiling_rules.GROUP, "rules": []}]


def _plan(monkeypatch: pytest.MonkeyPatch, records: Sequence[Any], *args: str) -> Any:
    def read(inventory: object, hosts: list[str]) -> tuple[list[Record], list[str]]:
        assert hosts == ["mon-1.example.net"]
        return list(records), []

    monkeypatch.setattr(remote_module, "PyinfraRemote", lambda inventory: NodeFiles({}))  # no observed.json yet
    monkeypatch.setattr(live_probe, "load_inventory", lambda *given, **named: None)
    monkeypatch.setattr(store, "read_records", read)
    return CliRunner().invoke(main, ["plan", FLEET, "--observed", *args], catch_exceptions=False)


def test_plan_observed_gives_each_shapes_rate_and_the_replicas_a_target_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    done = _plan(monkeypatch, [_one("tp8-pp1", 10.0), _one("tp8-pp2", 16.0)], "--target-rps", "48")
    assert done.exit_code == 0, done.output
    assert (f'ceiling of "{MODEL}": 36 req/s over 3 replicas (2 tp8-pp1 on {PROFILE} at 10 each, 1 tp8-pp2 on'
            f" {PROFILE} at 16 each; measured {DATE}); 48 req/s needs 4 replicas") in done.stdout.splitlines()


def test_plan_observed_from_a_routers_record_gives_each_shape_the_average(monkeypatch: pytest.MonkeyPatch) -> None:
    done = _plan(monkeypatch, [_routers(30.0)], "--target-rps", "25")
    assert done.exit_code == 0, done.output
    assert (f'ceiling of "{MODEL}": 30 req/s over 3 replicas (2 tp8-pp1 on {PROFILE} at 10 each, 1 tp8-pp2 on'
            f" {PROFILE} at 10 each; measured {DATE}); 25 req/s needs 3 replicas") in done.stdout.splitlines()
    unmeasured = _plan(monkeypatch, [])
    assert f'ceiling of "{MODEL}": not measured (gpufleet bench)' in unmeasured.stdout.splitlines()


@pytest.mark.parametrize(("given", "observed"), [("0", True), ("nan", True), ("٤٨", True), ("4_8", True),
                                                 ("1e9", True), ("48", False)])
def test_a_target_rate_is_a_number_read_as_every_command_reads_one(monkeypatch: pytest.MonkeyPatch, given: str,
                                                                   observed: bool) -> None:
    args = ["plan", FLEET, *(["--observed"] if observed else []), "--target-rps", given]
    done = CliRunner().invoke(main, args, catch_exceptions=False)
    assert done.exit_code == 2
    assert done.output.splitlines() == [
        f"gpufleet plan: --target-rps: expected requests per second above 0, at most 100000, with --observed, found"
        f" {given!r}{'' if observed else ' without --observed'}"]
