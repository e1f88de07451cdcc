"""The monitoring role: Prometheus's scrape configuration, the plan's figures and Alertmanager's configuration.

``tests/data/monitoring/fleet/`` is a small fleet with every kind of target (single-node replicas under a hostile served
name, an mp and a Ray multi-node replica of one model, routers, a monitoring host); ``expected/`` holds its
``scrape_configs`` and its plan's figures. Every target must carry the labels the rules' header promises, and the
role's operations are recorded (tests/recorded_ops.py). What promtool, amtool, systemd-analyze and a real Prometheus
make of the rendered files: tests/tools/test_monitoring_role.py.

After a deliberate change, rewrite the expected files and review their diff::

    GPUFLEET_REGOLD=1 .venv/bin/pytest -q tests/unit/roles/test_monitoring_role.py
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from pyinfra.api import Inventory

import roles.monitoring as role
from gpufleet import node_paths
from gpufleet.cli.inputs import fleet_facts
from gpufleet.config.fleet import Fleet
from gpufleet.config.layers import HostLayers, Layer, role_default_layers
from gpufleet.config.validate import validate_host
from gpufleet.inventory.load import load_fleet
from gpufleet.monitoring import dashboards
from gpufleet.monitoring.plan_rules import plan_rules, replicas_min
from gpufleet.monitoring.scrape_config import JOB_LABELS, RAY_METRICS_OFFSET
from gpufleet.plan import backends as plan_backends
from gpufleet.plan.planner import plan_fleet
from gpufleet.run.context import DeployContext
from tests.conftest import ROOT
from tests.recorded_ops import Recorder
from tests.unit.configs import host_config
from tests.unit.monitoring_files import FLEET, MONITORING_HOST, group_hosts, monitoring_host_files, planned_view
from tests.unit.unit_files import unit_settings

EXPECTED = FLEET / "expected"
HEADER = ROOT / "templates" / "monitoring" / "rules" / "_header.j2"
REGOLD = os.environ.get("GPUFLEET_REGOLD") == "1"


# --- the configuration, as data ----------------------------------------------------------------------------------

def test_the_scrape_configuration_and_the_plan_figures_are_the_golden_ones() -> None:
    _, files = monitoring_host_files()
    rendered = {"scrape_configs.yml": yaml.safe_load(files.configs[role.PROMETHEUS_YML])["scrape_configs"],
                role.PLAN_RULES: yaml.safe_load(files.configs[f"{role.RULES_DIR}/{role.PLAN_RULES}"])}
    for name, data in rendered.items():
        if REGOLD:
            (EXPECTED / name).write_text(yaml.safe_dump(data, sort_keys=False, width=1000, allow_unicode=True))
        assert data == yaml.safe_load((EXPECTED / name).read_text()), name


def _header_promises() -> dict[str, set[str]]:
    """The jobs the rules' header names, and the labels it promises on each job's targets."""
    text = HEADER.read_text()
    jobs_part, _, labels_part = text.partition("#   labels")
    jobs = re.findall(r"^#\s+(?:jobs)?\s+([a-z]+)\s{2,}[A-Za-z]", jobs_part, re.MULTILINE)
    flat = " ".join(line.lstrip("#").strip() for line in labels_part.split("\n#\n")[0].splitlines())

    def names(part: str) -> set[str]:
        items = re.split(r"[,;]", re.sub(r"\([^)]*\)", "", part))
        return {item.split()[0] for item in items if item.strip()}

    every = names(flat.partition("every target:")[2].partition("vllm and ray targets:")[0])
    replicas = names(flat.partition("vllm and ray targets:")[2].partition("router series:")[0])
    return {job: every | (replicas if job in ("vllm", "ray") else set()) for job in jobs}


def test_every_target_carries_the_labels_the_rules_header_promises() -> None:
    promised = _header_promises()
    assert promised == {job: set(labels) for job, labels in JOB_LABELS.items()}
    view, files = monitoring_host_files()
    jobs = {job["job_name"]: job for job in yaml.safe_load(files.configs[role.PROMETHEUS_YML])["scrape_configs"]}
    assert set(jobs) == set(promised)
    for name, job in jobs.items():
        for group in job["static_configs"]:
            assert set(group["labels"]) == promised[name] and all(group["labels"].values()), (name, group)
    # every host's node_exporter, every GPU host's dcgm-exporter, every router, every replica's API
    assert {g["labels"]["node"] for g in jobs["node"]["static_configs"]} == set(view.configs)
    assert {g["labels"]["node"] for g in jobs["dcgm"]["static_configs"]} == set(view.gpu_hosts)
    assert {g["labels"]["node"] for g in jobs["router"]["static_configs"]} == {"router-1.example.net",
                                                                                 "gpu-a01.example.net"}
    assert {g["labels"]["replica"] for g in jobs["vllm"]["static_configs"]} == {r.name for r in view.plan.replicas}


def test_the_routers_series_get_their_models_name_from_the_router_roles_backends() -> None:
    view, files = monitoring_host_files()
    (router,) = [j for j in yaml.safe_load(files.configs[role.PROMETHEUS_YML])["scrape_configs"]
                 if j["job_name"] == "router"]
    found = [(r["source_labels"], r["regex"], r["target_label"], r["replacement"])
             for r in router["metric_relabel_configs"]]
    backends = plan_backends.backends(view.plan)
    assert found == [(["proxy"], re.escape(b.name), "model", b.model.replace("$", "$$")) for b in backends]
    assert {b.model for b in backends} == {"chat $HOME 100% 'q' \"x\"", "llama-8b"}


def test_only_rank_0_of_an_mp_replica_serves_http_and_every_ray_node_exports_metrics() -> None:
    view, files = monitoring_host_files()
    jobs = {j["job_name"]: j for j in yaml.safe_load(files.configs[role.PROMETHEUS_YML])["scrape_configs"]}

    def groups(job: str, replica: str) -> list[tuple[str, str, str]]:
        return [(g["targets"][0], g["labels"]["node"], g["labels"]["role"]) for g in jobs[job]["static_configs"]
                if g["labels"]["replica"] == replica]

    assert groups("vllm", "pipeline-0") == [("10.40.1.11:8000", "gpu-p01.example.net", "rank0")]
    assert groups("vllm", "raypool-0") == [("10.40.2.11:8000", "gpu-r01.example.net", "head")]
    port = view.configs["gpu-r01.example.net"].ray_port + RAY_METRICS_OFFSET
    assert groups("ray", "raypool-0") == [(f"10.40.2.11:{port}", "gpu-r01.example.net", "head"),
                                          (f"10.40.2.12:{port}", "gpu-r02.example.net", "worker")]
    assert "pipeline-0" not in {g["labels"]["replica"] for g in jobs["ray"]["static_configs"]}


def test_a_replica_that_is_not_started_is_not_scraped_nor_expected() -> None:
    fleet, view = planned_view(FLEET / "inventory.py", {"vllm_start": False})
    files = role.monitoring_files(fleet.configs[MONITORING_HOST], "10.40.9.1", view, [])
    jobs = {j["job_name"]: j for j in yaml.safe_load(files.configs[role.PROMETHEUS_YML])["scrape_configs"]}
    assert "vllm" not in jobs and "router" in jobs
    assert len(jobs["ray"]["static_configs"]) == 2  # the Ray units run all the same
    facts = yaml.safe_load(files.configs[f"{role.RULES_DIR}/{role.PLAN_RULES}"])["groups"][0]["rules"]
    assert {rule["record"] for rule in facts} == {"gpufleet:node_gpus_expected"}


def _plan_facts(fleet: Fleet, view: role.FleetView, prefix_pools: set[str]) -> list[dict[str, Any]]:
    """The plan's figures of ``view`` with ``prefix_pools`` routed by prefix."""
    models = {name: dataclasses.replace(m, policy="prefix") if set(m.pools) & prefix_pools else m
              for name, m in view.plan.models.items()}
    text = plan_rules(view.node_gpus, dataclasses.replace(view.plan, models=models), 1.0, "")
    rules: list[dict[str, Any]] = yaml.safe_load(text)["groups"][0]["rules"]
    return rules


@pytest.mark.parametrize(("prefix_pools", "marked"), [
    (set(), []),  # every pool by leastconn (the golden plan): no model gets the prefix cache alert
    ({"chat"}, ["chat $HOME 100% 'q' \"x\""]),
    ({"pipeline", "raypool"}, ["llama-8b"]),  # two pools of one model: one fact
])
def test_only_the_models_routed_by_prefix_are_marked_for_the_prefix_cache_alert(prefix_pools: set[str],
                                                                                 marked: list[str]) -> None:
    fleet, view = planned_view(FLEET / "inventory.py")
    facts = _plan_facts(fleet, view, prefix_pools)
    assert [rule for rule in facts if rule["record"] == "gpufleet:model_prefix_routed"] == [
        {"record": "gpufleet:model_prefix_routed", "expr": "vector(1)", "labels": {"model": model}} for model in marked]


def test_each_replica_of_a_priced_profile_costs_its_gpus_an_hour() -> None:
    """gpufleet:replica_gpu_hour_cost: a replica's GPUs (tp x pp x dp) times its profile's gpu_hour_cost; a replica
    whose profile has none is left out (its model gets no cost of a million tokens)."""
    _, view = planned_view(FLEET / "inventory.py")
    replicas = [r for r in view.plan.replicas if r.starts]
    profiles = sorted({r.gpu_profile for r in replicas})
    priced = {profiles[0]: 2.5}
    text = plan_rules(view.node_gpus, view.plan, 1.0, "", priced)
    costs = {rule["labels"]["replica"]: rule for rule in yaml.safe_load(text)["groups"][0]["rules"]
             if rule["record"] == "gpufleet:replica_gpu_hour_cost"}
    expected = {r.name: r for r in replicas if r.gpu_profile == profiles[0]}
    assert sorted(costs) == sorted(expected) and expected
    for name, replica in expected.items():
        assert costs[name]["expr"] == f"vector({2.5 * replica.tp * replica.pp * replica.dp!r})"
        assert costs[name]["labels"]["model"] == replica.served
    assert "replica_gpu_hour_cost" not in plan_rules(view.node_gpus, view.plan, 1.0, "")


@pytest.mark.parametrize(("value", "problem"), [(0, "a number > 0, found 0"), (1, "a number < 1, found 1"),
                                              ("half", "a number, found 'half'")])
def test_the_prefix_hit_ratio_drop_is_a_fraction_between_0_and_1(value: object, problem: str) -> None:
    assert host_config(alert_prefix_hit_ratio_drop=0.25).alert_prefix_hit_ratio_drop == 0.25
    layers, _ = role_default_layers()
    _, found = validate_host(HostLayers("10.0.0.5", [*layers, Layer("test", {
        "vllm_model": "org/model", "allow_plain_http": True, "alert_prefix_hit_ratio_drop": value})]), "test")
    assert [p.line() for p in found] == [f"test: alert_prefix_hit_ratio_drop: expected {problem} (host 10.0.0.5)"]


@pytest.mark.parametrize(("planned", "ratio", "minimum"), [(10, 0.7, 7), (3, 0.5, 2), (4, 1.0, 4), (1, 0.01, 1),
                                                           (2, 0.5, 1), (4, 0.5, 2)])
def test_a_models_minimum_is_its_ratio_of_the_planned_replicas_rounded_up(planned: int, ratio: float,
                                                                          minimum: int) -> None:
    assert replicas_min(planned, ratio) == minimum


def test_a_host_that_failed_its_gate_is_still_expected_from_its_declared_profile() -> None:
    fleet = load_fleet(str(FLEET / "inventory.py"))
    serving = [h for h in fleet.hosts if fleet.serves(h)]
    facts = {h: f for h, f in fleet_facts(fleet, None).items() if h in serving}
    failed = "gpu-p02.example.net"
    passing = {h: f for h, f in facts.items() if h != failed}
    kept = Fleet(fleet.inventory, list(passing), {h: fleet.configs[h] for h in passing},
                 {p: [h for h in hs if h in passing] for p, hs in fleet.pools.items()})
    ctx = DeployContext(fleet, facts=facts, gate_failures={failed: ["probe: the NVML probe failed"]},
                        plan=plan_fleet(kept, passing))
    assert "pipeline-0" not in {r.name for r in ctx.plan.replicas}  # the deploy leaves the replica out ...
    watched, used = role.monitored_plan(ctx)
    expected = {r.name for r in plan_fleet(fleet, facts).replicas}
    assert {r.name for r in watched.replicas} == expected  # ... Prometheus does not
    assert len(used[failed].gpus) == 8
    ctx.gate_failures.clear()
    assert role.monitored_plan(ctx)[0] is ctx.plan  # every host passed: the deploy's own plan


def _deploy_context(monkeypatch: pytest.MonkeyPatch, **values: Any) -> Fleet:
    """The running deploy's view of the golden fleet, every host passing its gate (``values`` for every host)."""
    fleet = load_fleet(str(FLEET / "inventory.py"), values or None)
    facts = {h: f for h, f in fleet_facts(fleet, None).items() if fleet.serves(h)}
    ctx = DeployContext(fleet, facts=facts, plan=plan_fleet(fleet, facts))
    monkeypatch.setattr(role, "context", lambda *_: ctx)
    monkeypatch.setattr(role, "fleet", lambda: fleet)
    inventory = Inventory(([(h, {}) for h in fleet.hosts], {}), routers=(group_hosts(fleet, "routers"), {}),
                          monitoring=([MONITORING_HOST], {}))
    monkeypatch.setattr(role, "current_state", lambda: SimpleNamespace(inventory=inventory))
    monkeypatch.setattr(role.access, "deploy_group", lambda group="monitoring": ["10.40.9.1"])
    return fleet


def test_the_deploy_configures_prometheus_from_its_own_plan_and_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    fleet = _deploy_context(monkeypatch)
    assert sorted(role.group_members("routers")) == ["gpu-a01.example.net", "router-1.example.net"]
    assert role.group_members("no-such-group") == []
    _, expected = monitoring_host_files()
    assert role.deploy_files(fleet.configs[MONITORING_HOST], "10.40.9.1") == expected


def test_a_filter_the_deploy_cannot_write_exits_2_before_any_change(monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """With prometheus_allowed_from set, every scraped host needs an IP address: a host known by its name only stops
    the deploy with one line."""
    fleet = _deploy_context(monkeypatch, prometheus_allowed_from=["192.168.7.0/24"])
    named = dict(fleet.configs)
    named["gpu-r02.example.net"] = named["gpu-r02.example.net"].model_copy(update={"fleet_address": None})
    monkeypatch.setattr(role, "fleet", lambda: Fleet(fleet.inventory, fleet.hosts, named, fleet.pools))
    with pytest.raises(SystemExit) as exited:
        role.deploy_files(fleet.configs[MONITORING_HOST], "10.40.9.1")
    assert exited.value.code == 2
    assert "found 'gpu-r02.example.net' (give the node a fleet_address)" in capsys.readouterr().err


@pytest.mark.parametrize(("values", "expected"), [
    ({}, ("30s", "300s", "14400s")),  # the defaults
    ({"alertmanager_group_wait_s": 0, "alertmanager_group_interval_s": 45, "alertmanager_repeat_interval_s": 60},
     ("0s", "45s", "60s")),
])
def test_alertmanager_groups_and_repeats_as_its_variables_say(values: dict[str, int],
                                                              expected: tuple[str, str, str]) -> None:
    _, files = monitoring_host_files(**values)
    route = yaml.safe_load(files.configs[role.ALERTMANAGER_YML])["route"]
    assert (route["group_wait"], route["group_interval"], route["repeat_interval"]) == expected
    assert route["group_by"] == ["alertname", "model", "node"]


@pytest.mark.parametrize(("values", "expected"), [
    ({}, ("15s", "10s", "15s")),  # the defaults
    ({"prometheus_scrape_interval_s": 5}, ("5s", "5s", "5s")),  # a scrape gives up within its interval
])
def test_prometheus_scrapes_and_evaluates_as_its_variable_says(values: dict[str, int],
                                                               expected: tuple[str, str, str]) -> None:
    _, files = monitoring_host_files(**values)
    found = yaml.safe_load(files.configs[role.PROMETHEUS_YML])["global"]
    assert (found["scrape_interval"], found["scrape_timeout"], found["evaluation_interval"]) == expected


# --- the drop-ins' IP filter --------------------------------------------------------------------------------------

@pytest.mark.parametrize("allowed_from", [None, ["192.168.7.0/24"]])
def test_prometheus_filters_its_traffic_to_the_hosts_it_scrapes_and_its_readers(
        allowed_from: list[str] | None) -> None:
    """Closed by default: with prometheus_allowed_from unset, only the monitoring hosts and the hosts it scrapes."""
    view, files = monitoring_host_files(prometheus_allowed_from=allowed_from)
    settings = unit_settings(files.prometheus_drop_in)
    (line,) = [v for _, k, v in settings if k == "IPAddressAllow"]
    scraped = {t.host for t in role.targets(view)}
    assert set(line.split()) == {"localhost", *(allowed_from or []), "10.40.9.1/32", "fd00::5/128",
                                 *(f"{a}/32" for a in scraped if "." in a)}
    assert [v for _, k, v in settings if k == "IPAddressDeny"] == ["any"]


@pytest.mark.parametrize(("values", "allowed"), [
    ({}, None),  # loopback: only the host itself reaches it, and it may send to any webhook
    ({"alertmanager_listen_address": "0.0.0.0"}, {"10.40.9.1/32"}),
    ({"alertmanager_listen_address": "0.0.0.0", "prometheus_allowed_from": ["192.168.7.0/24"],
      "alertmanager_webhook_url": "https://192.0.2.10:8443/hook"},
     {"10.40.9.1/32", "192.168.7.0/24", "192.0.2.10/32"}),
])
def test_alertmanager_off_loopback_admits_only_the_monitoring_hosts_readers_and_webhook(
        values: dict[str, object], allowed: set[str] | None) -> None:
    _, files = monitoring_host_files(**values)
    lines = [v for _, k, v in unit_settings(files.alertmanager_drop_in) if k == "IPAddressAllow"]
    if allowed is None:
        assert lines == []
    else:
        assert [set(line.split()) for line in lines] == [{"localhost", *allowed}]


# --- the role's operations, recorded ------------------------------------------------------------------------

def _run_role(monkeypatch: pytest.MonkeyPatch, monitoring_host: bool = True) -> tuple[Recorder, role.MonitoringFiles]:
    fleet, view = planned_view(FLEET / "inventory.py")
    cfg = fleet.configs[MONITORING_HOST]
    wanted = role.monitoring_files(cfg, "10.40.9.1", view, ["10.40.9.1"])
    recorder = Recorder()
    for name in ("apt", "files", "node", "server", "systemd"):
        monkeypatch.setattr(role, name, recorder.module(name))
    monkeypatch.setattr(role, "is_monitoring", lambda: monitoring_host)
    monkeypatch.setattr(role, "host_config", lambda *_: cfg)
    monkeypatch.setattr(role, "deploy_files", lambda *_: wanted)
    role.monitoring.__wrapped__()  # type: ignore[attr-defined]
    return recorder, wanted


def test_the_role_does_nothing_on_a_host_outside_the_monitoring_group(monkeypatch: pytest.MonkeyPatch) -> None:
    ops, _ = _run_role(monkeypatch, monitoring_host=False)
    assert ops.calls == []


def test_the_role_checks_every_file_before_it_swaps_it_in_and_reloads_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    ops, wanted = _run_role(monkeypatch)
    order = [c.op for c in ops.calls]
    position = {id(c): i for i, c in enumerate(ops.calls)}
    (observed,) = ops.named("node.observe")
    assert order.index("node.observe") == 0
    assert set(observed.kwargs["packages"]) == {"prometheus", "prometheus-alertmanager", "python3"}
    (installed,) = ops.named("apt.packages")
    assert installed.kwargs["no_recommends"]  # prometheus recommends Debian's node_exporter: role node_exporter's
    assert set(installed.kwargs["packages"]) == set(observed.kwargs["packages"])
    drop_ins = {role.PROMETHEUS: wanted.prometheus_drop_in, role.ALERTMANAGER: wanted.alertmanager_drop_in}
    for service, text in drop_ins.items():
        (drop_in,) = ops.named("files.file", dest=service.drop_in)
        assert drop_in.kwargs["content"] == text and position[id(drop_in)] < position[id(installed)]  # before it starts
        assert service.drop_in in observed.kwargs["paths"]
    checks = ops.named("server.script")
    assert [c.kwargs["done_file"] for c in checks] == [role.PROMETHEUS.config, role.ALERTMANAGER.config]
    for check in checks:
        candidates = [c for c in ops.named("files.file") if str(c.kwargs["dest"]).startswith(role.CANDIDATE_DIR)
                      and position[id(c)] < position[id(check)]]
        assert candidates, check.kwargs["name"]
        assert position[id(installed)] < position[id(check)]  # promtool and amtool come with the packages
    (log_unit,) = ops.named("files.file", dest=role.ALERT_LOG_FILE)
    (log_restart,) = ops.named("systemd.restart", unit=node_paths.ALERT_LOG_SERVICE)
    (log_running,) = ops.named("systemd.service", unit=node_paths.ALERT_LOG_SERVICE)
    assert log_unit.kwargs["content"] == wanted.alert_log_unit and role.ALERT_LOG_FILE in observed.kwargs["paths"]
    assert (log_running.kwargs["running"], log_running.kwargs["enabled"]) == (True, True)
    # listening before Alertmanager's configuration names it; restarted (after the reload) when its unit changed
    assert position[id(installed)] < position[id(log_running)] < position[id(checks[1])]
    assert position[id(log_unit)] < position[id(log_restart)] < position[id(log_running)]
    assert not log_restart.kwargs["_if"]()
    log_unit.changed = True
    assert log_restart.kwargs["_if"]()
    log_unit.changed = False
    prometheus, alertmanager = (c.kwargs for c in checks)
    assert prometheus["done_sha256"] == _sha256(wanted.configs[role.PROMETHEUS_YML])
    assert alertmanager["done_sha256"] == _sha256(wanted.configs[role.ALERTMANAGER_YML])
    script = prometheus["script"]
    rules = sorted(n for n in wanted.configs if n.startswith(f"{role.RULES_DIR}/"))
    assert script.index("promtool check config prometheus.yml") < script.index("promtool check rules ") < \
        script.index("install ")
    assert script.rindex("mv -fT") == script.index(f"mv -fT {role.PROMETHEUS.config}.gpufleet-new")  # config last
    assert all(f"install -o root -g root -m 0644 {name} " in script for name in rules)
    assert alertmanager["script"].index("amtool check-config alertmanager.yml") < \
        alertmanager["script"].index("install -o root -g prometheus -m 0640 alertmanager.yml ")
    (candidate,) = ops.named("files.file", dest=f"{role.CANDIDATE_DIR}/{role.ALERTMANAGER_YML}")
    assert (candidate.kwargs["group"], candidate.kwargs["mode"]) == ("prometheus", "0640")
    for service, check in zip(role.SERVICES, checks, strict=True):
        (drop_in,) = ops.named("files.file", dest=service.drop_in)
        (restart,) = ops.named("systemd.restart", unit=service.unit)
        (reload,) = ops.named("systemd.reload", unit=service.unit)
        (running,) = ops.named("systemd.service", unit=service.unit)
        assert (running.kwargs["running"], running.kwargs["enabled"]) == (True, True)
        assert not reload.kwargs["_if"]() and not restart.kwargs["_if"]()
        check.changed = True
        assert reload.kwargs["_if"]() and not restart.kwargs["_if"]()  # a new configuration: reloaded, not restarted
        drop_in.changed = True
        assert restart.kwargs["_if"]() and not reload.kwargs["_if"]()  # a restart reads it anyway
        check.changed = drop_in.changed = False


def test_the_dashboards_go_into_grafanas_provisioning_only_where_grafana_is(monkeypatch: pytest.MonkeyPatch) -> None:
    ops, _ = _run_role(monkeypatch)
    (observed,) = ops.named("node.observe")
    wanted = dashboards.grafana_files()
    assert len(wanted) == 1 + len(dashboards.dashboard_files())
    written = {str(c.kwargs["dest"]): c for c in ops.named("files.file") if str(c.kwargs["dest"]) in wanted}
    assert {dest: c.kwargs["content"] for dest, c in written.items()} == wanted
    assert {dashboards.GRAFANA_PROVISIONING_DIR, *wanted} <= set(observed.kwargs["paths"])
    (folder,) = ops.named("files.directory", path=dashboards.GRAFANA_DASHBOARDS_DIR)
    (restart,) = ops.named("systemd.restart", unit=role.GRAFANA_UNIT)
    provider = written[f"{dashboards.GRAFANA_PROVISIONING_DIR}/{dashboards.PROVIDER_FILE}"]
    for installed in (False, True):
        monkeypatch.setattr(role, "grafana_installed", lambda installed=installed: installed)
        assert all(c.kwargs["_if"]() == installed for c in [folder, *written.values()])
        provider.changed = True
        assert restart.kwargs["_if"]() == installed  # Grafana reads a new provider file when it starts
        provider.changed = False
        assert not restart.kwargs["_if"]()


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def test_prometheus_yml_changes_whenever_a_rule_file_does() -> None:
    _, files = monitoring_host_files()
    _, other = monitoring_host_files(alert_queue_waiting_max=7)  # only serving.yml differs
    assert files.configs[f"{role.RULES_DIR}/serving.yml"] != other.configs[f"{role.RULES_DIR}/serving.yml"]
    assert files.configs[role.PROMETHEUS_YML] != other.configs[role.PROMETHEUS_YML]
