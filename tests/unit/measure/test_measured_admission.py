"""Router admission sized from bench records (gpufleet/measure/capacity.py ``measured_admission``,
gpufleet/plan/admission.py ``measured``): cases in tests/data/capacity/admission.yaml on the fleet of
tests/data/capacity/inventory.py, each record built as ``gpufleet bench`` writes it; and ``gpufleet plan
--observed`` showing the measured figure and its basis."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from click.testing import CliRunner

import gpufleet.remote.bench_store as store
import gpufleet.remote.gpu_probe as live_probe
from gpufleet.cli.inputs import fleet_facts
from gpufleet.cli.main import main
from gpufleet.inventory.load import load_fleet
from gpufleet.measure.capacity import measured_admission, replica_shape
from gpufleet.measure.ramp import Slo, Step
from gpufleet.measure.records import Record, RecordKey
from gpufleet.plan.planner import FleetPlan, plan_fleet
from gpufleet.remote import commands as remote_module
from tests.conftest import DATA
from tests.unit.node_files import NodeFiles

FLEET = str(DATA / "capacity" / "inventory.py")
CASES = yaml.safe_load((DATA / "capacity" / "admission.yaml").read_text())
SLO = Slo(ttft_p99_s=1.0, itl_p99_s=0.1)
DATE = "2026-11-20T00:00:00+00:00"


def _step(rate: float, passed: bool, running: float | None) -> Step:
    latency = 0.5 if passed else 5.0
    return Step(rate=rate, achieved_rps=rate, ttft_p50_s=latency, ttft_p99_s=latency, itl_p50_s=0.01,
                itl_p99_s=0.01, e2e_p50_s=1.0, e2e_p99_s=1.0, output_tokens_per_s=100.0, succeeded=100, failed=0,
                seconds=30.0, offered=100, engine_ttft_p99_s=latency, engine_itl_p99_s=0.01, running_max=running)


def _record(doc: dict[str, Any]) -> Record:
    key = RecordKey("llama-8b", str(doc.get("release", "0.32.0")), doc["layout"], "8xH100-SXM",
                    doc.get("scope", "replica"))
    return Record(key, 1, SLO, [_step(*step) for step in doc["steps"]], {}, "guidellm", str(doc.get("date", DATE)),
                  30.0)


def _planned(data: dict[str, Any] | None = None) -> FleetPlan:
    fleet = load_fleet(FLEET, data)
    return plan_fleet(fleet, fleet_facts(fleet, None))


@pytest.mark.parametrize("case", CASES, ids=[case["name"] for case in CASES])
def test_admission_is_sized_from_the_record_of_the_replicas_release_and_shape(case: dict[str, Any]) -> None:
    planned = _planned(case.get("data"))
    records = [_record(doc) for doc in case["records"]]
    round_trip = [Record.from_json(record.to_json()) for record in records]  # as the monitoring host keeps them
    found = measured_admission(planned, round_trip)
    assert [r.name for r in found.replicas] == [r.name for r in planned.replicas]
    for before, after in zip(planned.replicas, found.replicas, strict=True):
        expect = case["expect"].get(replica_shape(before)[0])
        if expect is None:
            assert after.admission == before.admission, before.name
            continue
        queued = before.admission.queued_reqs
        assert queued is not None and after.admission.queued_reqs == queued  # a bench moves no engine flag
        maxconn, basis = expect
        assert (after.admission.maxconn, after.admission.basis) == (
            queued if maxconn == "queued" else maxconn, basis.format(queued=f"{queued:,}")), before.name


def test_plan_observed_shows_the_measured_maxconn_and_its_record(monkeypatch: pytest.MonkeyPatch) -> None:
    record = _record({"layout": "tp8-pp1", "steps": [[2, True, 9.0], [4, True, 17.6], [8, False, 31.0]]})

    def read(inventory: object, hosts: list[str]) -> tuple[list[Record], list[str]]:
        return [record], []

    monkeypatch.setattr(remote_module, "PyinfraRemote", lambda inventory: NodeFiles({}))  # no observed.json yet
    monkeypatch.setattr(live_probe, "load_inventory", lambda *given, **named: None)
    monkeypatch.setattr(store, "read_records", read)
    shown = CliRunner().invoke(main, ["plan", FLEET, "--observed", "--json"], catch_exceptions=False)
    assert shown.exit_code == 0, shown.output
    replicas = {doc["name"]: doc for doc in yaml.safe_load(shown.stdout)}
    single = [doc for name, doc in replicas.items() if doc["tp"] == 8 and doc["pp"] == 1]
    assert single and all((doc["router_maxconn"], doc["router_maxconn_basis"]) == (
        17, "measured: 17 at the ceiling (bench of 2026-11-20)") for doc in single), single
    offline = CliRunner().invoke(main, ["plan", FLEET, "--json"], catch_exceptions=False)
    assert all(doc["router_maxconn_basis"] == "at max_model_len" for doc in yaml.safe_load(offline.stdout))
