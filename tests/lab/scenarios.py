"""The lab's scenarios: the states lab tests need, each reached once in a full run, in an order where no test has
to undo another's change.

A test names its scenario by taking its fixture (tests/lab/conftest.py): ``bare``, ``serving``, ``watched``,
``faults``, ``changed`` or ``ray``. The session sorts lab tests by
scenario, so a full run goes through them in that order; a test run alone (``pytest tests/lab -k NAME``) reaches
its scenario by itself, with the deploys that lead there. Scenarios that share a state (``serving``, ``watched``,
``faults``, ``changed``) only order the tests: read-only checks first, then the healthy watch over them, then
faults that heal, then tests that leave the fleet changed, whose change the next scenario's deploy replaces.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.lab.fleet import RAY, deploy, restore_nodes
from tests.lab.harness import Completed, Lab
from tests.lab.prometheus import Prometheus, wait_for


@dataclass(frozen=True)
class Scenario:
    """A place in the run's order, and the state of the lab it needs."""

    name: str
    state: str
    about: str
    accepts: tuple[str, ...] = ()  # states a test left that this scenario's tests also run on (no deploy first)


# Alerts about the last hour rather than the fleet now (see LabStates.healthy_since).
HISTORY_ALERTS = frozenset({"GpufleetUnitRestarting"})
# What a failed test left (tests/lab/conftest.py): unknown; the next scenario restores the nodes first.
AFTER_FAILURE = "after a failed test"
# What test_changing_one_groups_setting_restarts_only_that_groups_replicas leaves: lab_single on other settings.
GROUP_CHANGED = "serving, a group's settings changed"
# What tests/lab/test_edge.py leaves: the routers on other clients and admission, every replica as deployed.
EDGE_CHANGED = "serving, the routers' settings changed"
# What tests/lab/test_adapters.py leaves: lab_single serving one LoRA adapter more, every replica as deployed.
ADAPTER_ADDED = "serving, one adapter more"
SCENARIOS = (
    Scenario("bare", "bare", "the lab as booted: nothing deployed"),
    Scenario("serving", "serving", "deploys/vllm.py from bare nodes, the lab's default: read-only checks"),
    Scenario("watched", "serving", "the same fleet, untouched: no alert fired since it was healthy"),
    Scenario("faults", "serving", "the same fleet: faults that heal, alerts, upgrades and rollbacks"),
    Scenario("changed", "serving", "the same fleet: tests that leave it changed for the next deploy to replace",
             accepts=(EDGE_CHANGED, GROUP_CHANGED, ADAPTER_ADDED)),
    Scenario("ray", "ray", "deploys/vllm.py with the pipeline pool on Ray"),
)
FAILED_TAIL = 4000  # characters of a failed deploy's output a test shows
BY_NAME = {scenario.name: scenario for scenario in SCENARIOS}
RANK = {scenario.name: rank for rank, scenario in enumerate(SCENARIOS)}
# The options of the deploy (deploys/vllm.py) that brings any lab into a state: it converges from wherever the lab is.
DEPLOYS: dict[str, tuple[str, ...]] = {"serving": (), "ray": RAY}


@dataclass
class LabStates:
    """Where the session's lab is, and how to bring it where a test needs it."""

    lab: Lab
    current: str = "bare"
    reached: dict[str, Completed] = field(default_factory=dict)  # state -> the deploy that last brought it there
    failed: dict[str, str] = field(default_factory=dict)  # state -> the end of the deploy that failed to reach it
    _healthy_since: float | None = None

    def reach(self, scenario: Scenario) -> Completed | None:
        """Bring the lab into ``scenario``'s state unless it is there; the deploy that brought it there (None for
        ``bare``). A deploy that fails fails the test that needed it, with its output's end, and every later test
        of that state at once: a deploy that fails would fail again, minutes each time."""
        wanted = scenario.state
        if wanted in self.failed:
            pytest.fail(f"the deploy to {wanted!r} failed earlier in this session:\n{self.failed[wanted]}",
                        pytrace=False)
        if wanted == self.current:
            return self.reached.get(wanted)
        if self.current in scenario.accepts:
            return self.reached.get(wanted)
        if wanted == "bare":
            pytest.fail(f"scenario bare needs a lab as booted, and this session's lab is {self.current}: run"
                        " the test in a session of its own", pytrace=False)
        if self.current == AFTER_FAILURE:
            restore_nodes(self.lab)
        self.changed()
        done = deploy(self.lab, *DEPLOYS[wanted])
        if done.rc != 0:
            self.failed[wanted] = done.output[-FAILED_TAIL:]
            pytest.fail(f"the deploy to {wanted!r} exited {done.rc}:\n{self.failed[wanted]}", pytrace=False)
        self.current = wanted
        self.reached[wanted] = done
        return done

    def changed(self, left: str = "unknown") -> None:
        """A test left the fleet other than its scenario's state: the next scenario deploys again, unless it accepts
        ``left`` (a state the test names: what it changed)."""
        self.current = left
        self._healthy_since = None

    def healthy_since(self) -> float:
        """When the monitoring group's Prometheus (lab1) first saw every target up and every alert of before the
        deploy resolved, pending ones included, on the serving lab (waited for on the first call). A replica the
        deploy started reaches the model's ready count through two recording rules, an evaluation each: until
        then ModelReplicasBelowMinimum can be pending though the deploy saw every replica serve (seen on the lab,
        10 s after a slow deploy)."""
        if self._healthy_since is None:
            prometheus = Prometheus(self.lab.nodes[0])

            def all_up() -> list[dict[str, Any]] | None:
                targets = prometheus.targets()
                return targets if targets and all(t["health"] == "up" for t in targets) else None

            try:
                wait_for("every target up", all_up, timeout=180)
            except AssertionError:
                down = [(t["scrapeUrl"], t["lastError"]) for t in prometheus.targets() if t["health"] != "up"]
                raise AssertionError(f"targets not up: {down}") from None
            # The recording group evaluated before the last target's first scrape recorded a partial count (a rank
            # of the pipeline not scraped yet), and an alert group evaluated after it may read that yet (seen: the
            # healthy watch found VllmReplicaRankMissing pending once, Prometheus started by the deploy 20 s
            # before). Once every group was evaluated after every target was up, an alert that read a partial count
            # is pending already (and waited for below), and every later evaluation reads whole ones.
            up_at = time.time()
            wait_for("every rule group evaluated after every target was up", lambda: True if
                     prometheus.rules_evaluated_since(up_at) else None, timeout=60, every=1)
            # Prometheus may have run before the replicas did (deploys/monitoring.py): the lab is healthy once what
            # it said then has resolved.
            # GpufleetUnitRestarting counts an hour of restarts: the fault proofs restart replicas on purpose, so it
            # fires for up to an hour after them, whatever the fleet does now (seen: every test after a failed one
            # timed out here). It is the past, not the state this wait is for.
            def resolved() -> bool | None:
                return True if not [a for a in prometheus.alerts()
                                    if a["labels"].get("alertname") not in HISTORY_ALERTS] else None

            try:
                wait_for("the alerts of before the deploy resolved", resolved, timeout=180)
            except AssertionError:
                left = sorted({f"{a['labels'].get('alertname')} ({a['state']}, {a['labels'].get('instance', '')})"
                               for a in prometheus.alerts() if a["labels"].get("alertname") not in HISTORY_ALERTS})
                raise AssertionError(f"the alerts of before the deploy not resolved within 180 s: {left}") from None
            self._healthy_since = time.monotonic()
        return self._healthy_since


def scenario_of(fixturenames: list[str]) -> Scenario | None:
    """The scenario a test takes by its fixtures (None: it takes none)."""
    named = [BY_NAME[name] for name in fixturenames if name in BY_NAME]
    if len(named) > 1:
        raise pytest.UsageError(f"a lab test takes one scenario, found {[s.name for s in named]}")
    return named[0] if named else None
