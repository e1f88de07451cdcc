"""The model's capacity follows its replicas in service, and the capacity alert follows the capacity, with no new
bench (scenario ``faults``, after tests/lab/test_bench.py kept each shape's record), under one load through the
routers at 1.25 times the pipeline replica's ceiling alone, about 62% of both replicas' (80% is the alert's line):

- both replicas in service: the load stays below 80% of the model's ceiling, and the alert stays quiet;
- lab1's one-node replica drained on both routers, as a rollout drains it: its shape's ceiling leaves
  ``gpufleet:model_ceiling_rps`` (templates/monitoring/rules/recording.yml.j2), the same load is above 80% of
  what is left, and ModelNearItsCeiling fires;
- the replica ready again: the capacity comes back and the alert resolves.

The drain is router_admin.py's, on each router (lab1 and lab2), as gpufleet upgrade runs it; the test puts the
replica back (ready) whatever happens, and waits until the router shows it UP.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpufleet.monitoring import dashboards
from tests.lab.benching import ensure_records, steady_load
from tests.lab.fleet import PIPELINE, ROUTER_ADMIN, router_servers, served_name, single, wait_router_status
from tests.lab.harness import LAB_VARS, LAB_VLLM_VERSION, Completed, Lab
from tests.lab.prometheus import (
    SCRAPE_INTERVAL_S,
    Prometheus,
    needs_a_bench,
    queries_without_data,
    router_rate,
    wait_for,
)

pytestmark = pytest.mark.filterwarnings("ignore:Unknown ssh-ed25519 host key:UserWarning")

FOLLOW_S = 90  # a scrape of the routers (15 s), an evaluation of the rules (15 s), twice over, and room
LOAD_SHARE = 1.25  # the load, as a share of the pipeline replica's ceiling alone
LOAD_S = 360  # the load's own bound: the phases below take about 200 s
RATE_IN_S = 90  # the routers' one-minute rate reaches the load: a minute, a scrape and an evaluation
# the alert's `for` and two evaluations: a rate above its line this long has made it pending, then firing
QUIET_S = LAB_VARS["alert_capacity_for_s"] + 2 * SCRAPE_INTERVAL_S
FIRE_S = LAB_VARS["alert_capacity_for_s"] + FOLLOW_S


def _capacity_at(prometheus: Prometheus, value: float) -> float | None:
    """The model's capacity once it is ``value`` (within 1%), else None (a probe for wait_for)."""
    found = prometheus.query("gpufleet:model_ceiling_rps")
    now = float(found[0]["value"][1]) if found else None
    return now if now is not None and abs(now - value) <= 0.01 * value else None


def _shape_ceilings(prometheus: Prometheus) -> dict[str, float]:
    """Each shape's ceiling per replica, by layout, as gpufleet bench wrote it (waited for: a bench just run reloads
    Prometheus as it ends)."""
    def both() -> dict[str, float] | None:
        found = {r["metric"]["layout"]: float(r["value"][1])
                 for r in prometheus.query("gpufleet:replica_ceiling_rps")}
        return found if set(found) == {"tp1-pp1", "tp1-pp2"} else None
    shapes, _ = wait_for("each shape's ceiling in Prometheus", both, timeout=60)
    return shapes


@contextlib.contextmanager
def _drained(lab: Lab, replica: str) -> Iterator[None]:
    """``replica`` drained on both routers for the block, then ready again and UP."""
    backend = str(router_servers(lab)[replica]["backend"])
    routers = lab.nodes[:2]
    try:
        for router in routers:
            lab.host(router).check_output(f"{ROUTER_ADMIN} set-state {backend} {replica} drain")
        yield
    finally:
        for router in routers:
            lab.host(router).check_output(f"{ROUTER_ADMIN} set-state {backend} {replica} ready")
        wait_router_status(lab, replica, "UP", timeout=60)


def _alert_active(prometheus: Prometheus, span_s: float) -> list[dict[str, object]]:
    """ModelNearItsCeiling pending or firing at any evaluation of the last ``span_s`` seconds."""
    return prometheus.query(f'max_over_time(ALERTS{{alertname="ModelNearItsCeiling"}}[{max(1, round(span_s))}s])')


def _active_now(prometheus: Prometheus) -> bool:
    return any(a["labels"]["alertname"] == "ModelNearItsCeiling" for a in prometheus.alerts())


def test_the_capacity_alert_follows_the_replicas_in_service_under_one_load(
        lab: Lab, faults: Completed | None, tmp_path: Path) -> None:
    ensure_records(lab, tmp_path, LAB_VLLM_VERSION)
    prometheus = Prometheus(lab.nodes[0])
    shapes = _shape_ceilings(prometheus)
    both = shapes["tp1-pp1"] + shapes["tp1-pp2"]  # one replica of each shape, both in service
    load = LOAD_SHARE * shapes["tp1-pp2"]
    assert 0.8 * shapes["tp1-pp2"] < load < 0.8 * both, shapes
    wait_for("the model's capacity with both replicas", lambda: _capacity_at(prometheus, both), timeout=FOLLOW_S)
    assert not _alert_active(prometheus, 60)
    with steady_load(lab, tmp_path, load, LOAD_S) as sending:
        def rate_above(share: float) -> float | None:
            sending()
            rate = router_rate(prometheus)
            return rate if rate > share * load else None

        # both in service: the load is in (over the drained line), and for the alert's `for` and two evaluations
        # more it stays below 80% of both: quiet
        wait_for("the load in the routers' one-minute rate", lambda: rate_above(0.8 / LOAD_SHARE), timeout=RATE_IN_S)
        time.sleep(QUIET_S)
        sending()
        quiet_rate = router_rate(prometheus)
        assert 0.8 * shapes["tp1-pp2"] < quiet_rate < 0.8 * both, (quiet_rate, shapes)
        assert _alert_active(prometheus, QUIET_S) == [], "ModelNearItsCeiling went pending below 80% of the ceiling"
        with _drained(lab, single(lab)):
            _, took = wait_for("the capacity without lab1's replica",
                               lambda: _capacity_at(prometheus, shapes["tp1-pp2"]), timeout=FOLLOW_S)
            in_service = {r["metric"]["replica"]: float(r["value"][1])
                          for r in prometheus.query("replica:in_service:bool")}
            assert in_service == {single(lab): 0.0, PIPELINE: 1.0}, in_service

            def firing() -> list[dict[str, str]] | None:
                sending()
                return prometheus.firing().get("ModelNearItsCeiling")

            fired, fired_after = wait_for("ModelNearItsCeiling firing", firing, timeout=FIRE_S, every=5)
            assert fired[0]["model"] == served_name("lab"), fired
            drained_rate = router_rate(prometheus)
            assert 0.8 * shapes["tp1-pp2"] < drained_rate < 0.8 * both, (drained_rate, shapes)
            benched = [q for q in dashboards.panel_queries() if needs_a_bench(q)]
            assert benched and queries_without_data(prometheus, benched, {"model": served_name("lab")}) == {}
        _, back = wait_for("the capacity with lab1's replica back", lambda: _capacity_at(prometheus, both),
                           timeout=FOLLOW_S)
        _, resolved = wait_for("ModelNearItsCeiling resolved", lambda: None if _active_now(prometheus) else True,
                               timeout=FOLLOW_S)
        sending()
    print(json.dumps({"load_rps": round(load, 3), "capacity_both_rps": both, "capacity_drained_rps": shapes["tp1-pp2"],
                      "router_rate1m_both": quiet_rate, "router_rate1m_drained": drained_rate,
                      "followed_drain_after_s": round(took, 1), "alert_fired_after_s": round(took + fired_after, 1),
                      "followed_return_after_s": round(back, 1), "resolved_after_s": round(back + resolved, 1)}))
