"""The rollout (gpufleet/rollout/runner.py) against a recorded fleet (tests/rollout_world.py): cases as data.

Each case (tests/data/rollout_runs/*.yml) gives ``routers``, ``replicas`` (``[name, backend, [nodes]]``; replicas that
share a node are one unit), and optionally: ``command`` (upgrade, the default, or rollback); ``releases`` (named;
default ``old`` = vLLM 0.31.0, ``new`` = 0.32.0) and ``inventory`` (what a plain deploy gives; default ``new``);
``running`` and ``previous`` (replica -> release name or null: its release.json and release.previous.json; default
``old`` and none); ``behaviour`` (release name -> :class:`~tests.rollout_world.Behaviour` fields); ``busy``
(replicas that never drain); ``interrupt_at`` (an event after which Ctrl-C comes); ``ready_timeout_s``;
``options`` (batches, max_unavailable, min_available, canary_s, canary_every_batch, max_error_ratio,
max_latency_ratio, canary_min_requests, canary_max_s); ``latency`` (each replica's vLLM p95s over a watch),
``stored`` (the bench record of the release replaced: [rate, TTFT p95 s, ITL p95 s] per step) and ``canary_bench``.
``expect`` holds ``status`` and ``outcomes`` (replica -> state), and optionally ``events`` (every change, in order),
``failure`` (what the report's failure starts with), ``records`` (replica -> [its release.json, its
release.previous.json] at the end, by name), ``admin`` (replica -> its state in the routers at the end), ``timed``
(replica -> the steps its outcome timed), ``watched`` (replica -> the seconds its canary watch lasted) and ``notes``
(replica -> texts each found in one of its report's notes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpufleet.measure.ramp import Slo, Step
from gpufleet.measure.records import Record, RecordKey
from gpufleet.rollout.batches import DEFAULT_BATCHES, Unit, plan_rollout
from gpufleet.rollout.canary import DEFAULT_MAX_ERROR_RATIO, DEFAULT_MAX_LATENCY_RATIO, Thresholds
from gpufleet.rollout.latency import DEFAULT_MIN_REQUESTS, Percentiles
from gpufleet.rollout.replicas import ROLLBACK, UPGRADE, Member, Rollable, units_of
from gpufleet.rollout.report import Report
from gpufleet.rollout.router_control import DRAIN_GRACE_S, RouterControl
from gpufleet.rollout.runner import DEFAULT_CANARY_S, LatencyJudge, Options, Rollout
from tests.conftest import DATA
from tests.rollout_world import Behaviour, World

CASES = sorted((DATA / "rollout_runs").glob("*.yml"))
CASE_KEYS = {"command", "routers", "replicas", "releases", "inventory", "running", "previous", "behaviour", "busy",
             "interrupt_at", "ready_timeout_s", "options", "latency", "canary_bench", "stored", "expect"}
RELEASES = {"old": {"vllm_version": "0.31.0"}, "new": {"vllm_version": "0.32.0"}}
SHUTDOWN_TIMEOUT_S = 60


@dataclass(frozen=True)
class _Placed:
    name: str
    nodes: list[str]


def _world(case: dict[str, Any]) -> World:
    world = World(routers=case["routers"],
                  replicas={name: (backend, tuple(nodes)) for name, backend, nodes in case["replicas"]},
                  releases=case.get("releases", RELEASES), inventory=case.get("inventory", "new"),
                  behaviour={name: Behaviour(**fields) for name, fields in case.get("behaviour", {}).items()},
                  busy=set(case.get("busy", [])), interrupt_at=case.get("interrupt_at"))
    running, previous = case.get("running", {}), case.get("previous", {})
    for name in world.replicas:
        world.record(name, running.get(name, "old"), previous.get(name))
    return world


def _rollable(case: dict[str, Any], world: World, mode: str) -> Rollable:
    """The units and replicas as gpufleet.rollout.replicas.rollable builds them from a plan."""
    inventory = world.releases[world.inventory]
    units, members, ready = [], {}, set()
    for group in units_of([_Placed(name, list(nodes)) for name, (_, nodes) in world.replicas.items()]):
        found = []
        for replica in group:
            backend, nodes = world.replicas[replica.name]
            before = world.running(replica.name)
            previous = world.files[(nodes[0], replica.name)]["previous"]
            found.append(Member(replica.name, backend, nodes, nodes, case.get("ready_timeout_s", 300),
                                SHUTDOWN_TIMEOUT_S + DRAIN_GRACE_S, inventory, before,
                                inventory if mode == UPGRADE else previous,
                                frozenset(n for n in nodes if world.files[(n, replica.name)]["current"])))
        name = "+".join(m.name for m in found)
        units.append(Unit(name, found[0].backend, tuple(dict.fromkeys(n for m in found for n in m.nodes))))
        members[name] = found
        if any(world.up[m.name] for m in found):
            ready.add(name)
    return Rollable(units, members, ready)


class _Percentiles:
    """The case's ``latency``: each replica's [requests, TTFT p95 s, ITL p95 s] over the watch (then, where given,
    the means of both), as vLLM's histograms would give them (several replicas together: their requests summed,
    the slowest figures); the windows asked."""

    def __init__(self, table: dict[str, list[float]]) -> None:
        self.table, self.asked = table, []

    def settle(self, replicas: Sequence[str]) -> float:
        return 15.0  # a scrape interval: what the cases' windows were written with

    def percentiles(self, replicas: Sequence[str], window_s: float) -> Percentiles:
        self.asked.append((tuple(replicas), window_s))
        rows = [self.table[name] for name in replicas if name in self.table]
        if not rows:
            return Percentiles(0.0, None, None)
        means = [max(r[i] for r in rows) if all(len(r) == 5 for r in rows) else None for i in (3, 4)]
        return Percentiles(sum(r[0] for r in rows), max(r[1] for r in rows), max(r[2] for r in rows), *means)


class _Bench:
    """The case's ``canary_bench.seen``: what a fixed-rate bench of each canary gives [answered, TTFT p95 s, ITL p95
    s]; the (replica, rate) pairs asked."""

    def __init__(self, seen: dict[str, list[float]]) -> None:
        self.seen, self.asked = seen, []

    def bench(self, replica: str, rate: float) -> tuple[Percentiles, str]:
        self.asked.append((replica, rate))
        return Percentiles(*self.seen[replica]), f"benched at {rate:g} req/s"


def _record(steps: list[list[float]]) -> Record:
    """The release replaced's bench record (vLLM 0.31.0, one replica): [rate, TTFT p95 s, ITL p95 s] per step (the
    client's and vLLM's alike; then, where given, vLLM's means of both), every step within an objective of 1 s and
    0.1 s but the last, which fails."""
    rows = [Step(r, r, t, t, i, i, 1.0, 2.0, 10.0, 10, 0, 20.0, offered=10, ttft_p95_s=t, itl_p95_s=i,
                 engine_ttft_p99_s=t, engine_itl_p99_s=i, engine_ttft_p95_s=t, engine_itl_p95_s=i,
                 engine_ttft_mean_s=means[0] if means else None, engine_itl_mean_s=means[1] if means else None)
            for r, t, i, *means in steps]
    last = rows[-1]
    rows[-1] = Step(last.rate, last.rate, 5.0, 5.0, 0.5, 0.5, 1.0, 2.0, 10.0, 10, 0, 20.0, offered=10, ttft_p95_s=5.0,
                    itl_p95_s=0.5, engine_ttft_p99_s=5.0, engine_itl_p99_s=0.5)
    return Record(RecordKey("", "0.31.0", "", "", "replica"), 1, Slo(1.0, 0.1), rows, {}, "guidellm 0.8.1",
                  "2026-11-20T00:00:00+00:00", 20.0)


def _run(case: dict[str, Any]) -> tuple[World, Report]:
    mode = case.get("command", UPGRADE)
    world = _world(case)
    found = _rollable(case, world, mode)
    given = case.get("options", {})
    models = {unit.model for unit in found.units}
    batches = plan_rollout(found.units, given.get("batches", DEFAULT_BATCHES), ready=found.ready,
                           max_unavailable=dict.fromkeys(models, given.get("max_unavailable", 1)),
                           min_available=dict.fromkeys(models, given.get("min_available", 1)))
    latency, benched = case.get("latency"), case.get("canary_bench")
    bench = _Bench(benched["seen"]) if benched else None
    stored = case.get("stored") or (benched or {}).get("stored")
    records = [_record(stored)] if stored else []
    options = Options(given.get("canary_s", DEFAULT_CANARY_S), given.get("canary_every_batch", False),
                      Thresholds(given.get("max_error_ratio", DEFAULT_MAX_ERROR_RATIO),
                                 given.get("max_latency_ratio", DEFAULT_MAX_LATENCY_RATIO)),
                      LatencyJudge(_Percentiles(latency), records, given.get("max_latency_ratio", 1.5), bench)
                      if latency is not None else None, given.get("canary_min_requests", DEFAULT_MIN_REQUESTS),
                      given.get("canary_max_s"))
    router = RouterControl(world, world.routers, clock=world.now)
    report = Rollout(mode, found, batches, router, world, world, options, clock=world.now, sleep=world.sleep,
                     say=world.say).run()
    return world, report


def test_there_are_enough_cases() -> None:
    assert len(CASES) >= 10


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_case(path: Path) -> None:
    case = yaml.safe_load(path.read_text())
    assert set(case) <= CASE_KEYS and case.get("command", UPGRADE) in (UPGRADE, ROLLBACK), f"{path.name}: bad case"
    world, report = _run(case)
    expect = case["expect"]
    assert report.status == expect["status"], report.text()
    assert {name: o.state for name, o in report.outcomes.items()} == expect["outcomes"], report.text()
    if "events" in expect:
        assert world.events == expect["events"]
    if "failure" in expect:
        assert (report.failure or "").startswith(expect["failure"]), report.failure
    else:
        assert report.failure is None or report.status != 0
    for name, (current, previous) in expect.get("records", {}).items():
        first = world.replicas[name][1][0]
        found = world.files[(first, name)]
        assert [world.name_of(found["current"]), world.name_of(found["previous"])] == [current, previous], name
    for name, state in expect.get("admin", {}).items():
        assert {world.admin[(router, name)] for router in world.routers} == {state}, name
    for name, steps in expect.get("timed", {}).items():
        assert list(report.outcomes[name].seconds) == steps, name
    for name, seconds in expect.get("watched", {}).items():
        assert report.outcomes[name].seconds.get("watch") == seconds, report.text()
    for name, texts in expect.get("notes", {}).items():
        for text in texts:
            assert any(text in note for note in report.outcomes[name].notes), (text, report.text())


def test_every_rollout_leaves_no_replica_drained_unless_it_says_so() -> None:
    for path in CASES:
        world, report = _run(yaml.safe_load(path.read_text()))
        drained = {name for (_, name), state in world.admin.items() if state != "ready"}
        assert drained == {name for name, o in report.outcomes.items() if o.state == "left drained"}, path.name


def test_the_report_says_from_and_to_and_the_steps() -> None:
    _, report = _run(yaml.safe_load((CASES[0].parent / "happy_path.yml").read_text()))
    lines = report.text().splitlines()
    assert lines[0].startswith('  m-a-0: rolled; vllm_version "0.31.0" -> "0.32.0"; drain ')
    assert "watch 30 s" in lines[0]  # two routers, 2 requests a second each, 30 s:
    assert lines[0].endswith("; canary: 120 requests, 0 5xx, 100 ms (not rolled: 120, 0, 100 ms)")
    assert lines[-1] == "gpufleet upgrade: done: 2 rolled"
    doc = report.to_json()
    assert doc["status"] == 0 and doc["replicas"][0]["from"] == {"vllm_version": "0.31.0"}
    assert doc["replicas"][0]["to"] == {"vllm_version": "0.32.0"} and doc["replicas"][0]["state"] == "rolled"
