"""The monitoring role: Prometheus's scrape configuration, the plan's facts and Alertmanager's configuration.

``tests/monitoring/fleet/`` is a small fleet with every kind of target (single-node replicas under a hostile served
name, an mp and a Ray multi-node replica of one model, routers, a monitoring host); ``expected/`` holds its
``scrape_configs`` and its plan's facts. The rendered files must pass ``promtool`` and ``amtool``, every target must
carry the labels the rules' header promises, the drop-ins must pass ``systemd-analyze`` on Debian's units within
gpufleet's exposure bound, the role's operations are recorded (tests/recorded_ops.py), a real Prometheus scrapes
loopback targets with the rendered configuration, and promtool runs the rules on the series a healthy fleet's
targets give. promtool and amtool come with Debian's ``prometheus`` and ``prometheus-alertmanager`` packages
(scripts/install-lab-deps.sh installs them); without them, these tests fail.

After a deliberate change, rewrite the expected files and review their diff::

    GPUFLEET_REGOLD=1 .venv/bin/pytest -q tests/test_monitoring_role.py
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from pyinfra.api import Inventory

import roles.monitoring as role
import roles.router as router_role
from gpufleet import dashboards, node_paths
from gpufleet.cli import fleet_facts
from gpufleet.config.inventory import loaded_inventory
from gpufleet.deploy.context import DeployContext
from gpufleet.fleet import Fleet, load_fleet
from gpufleet.plan.planner import plan_fleet
from gpufleet.plan_facts import replicas_min
from gpufleet.scrape_config import JOB_LABELS, RAY_METRICS_OFFSET
from gpufleet.systemd_text import exec_line
from gpufleet.unit_security import EXPOSURE_BOUND, exposure_score
from tests.conftest import ROOT
from tests.loopback_http import QuietHandler, loopback_server
from tests.recorded_ops import Recorder
from tests.test_hostile_templates import Unit, _stub_root, _verify, exec_argv, unit_settings
from tests.test_vllm_role import _config

FLEET = ROOT / "tests" / "monitoring" / "fleet"
EXPECTED = FLEET / "expected"
HEADER = ROOT / "templates" / "monitoring" / "rules" / "_header.j2"
REGOLD = os.environ.get("GPUFLEET_REGOLD") == "1"
MONITORING_HOST = "mon-1.example.net"
DEBIAN_UNITS = Path("/lib/systemd/system")


def _tool(name: str, package: str) -> str:
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: apt-get install -y {package} (scripts/install-lab-deps.sh installs it)")
    return found


def _group(fleet: Fleet, group: str) -> list[str]:
    """The hosts an inventory group lists, as the inventory file defined it."""
    return [h for h in fleet.hosts if any(name == group and h in members
                                          for name, members in loaded_inventory(h).groups)]  # type: ignore[union-attr]


def _view(inventory: Path, override: dict[str, Any] | None = None) -> tuple[Fleet, role.FleetView]:
    """A fleet planned offline from its declared profiles, as the monitoring hosts see it."""
    fleet = load_fleet(str(inventory), override)
    facts = fleet_facts(fleet, None)
    plan = plan_fleet(fleet, {h: f for h, f in facts.items() if fleet.serves(h)})
    assert plan.problems == []
    return fleet, role.fleet_view(fleet, plan.replicas, facts, _group(fleet, "routers"))


def _files(inventory: Path = FLEET / "inventory.py", **values: Any) -> tuple[role.FleetView, role.MonitoringFiles]:
    fleet, view = _view(inventory)
    cfg = fleet.configs[MONITORING_HOST].model_copy(update=values) if MONITORING_HOST in fleet.configs else _config(
        **values)
    return view, role.monitoring_files(cfg, cfg.fleet_address or "10.40.9.1", view, ["10.40.9.1"])


def _write(tmp_path: Path, files: role.MonitoringFiles) -> Path:
    for name, text in files.configs.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


# --- the configuration, as data ----------------------------------------------------------------------------------

def test_the_scrape_configuration_and_the_plan_facts_are_the_golden_ones() -> None:
    _, files = _files()
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
    view, files = _files()
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
    assert {g["labels"]["replica"] for g in jobs["vllm"]["static_configs"]} == {r.name for r in view.replicas}


def test_the_routers_series_get_their_models_name_from_the_router_roles_backends() -> None:
    view, files = _files()
    (router,) = [j for j in yaml.safe_load(files.configs[role.PROMETHEUS_YML])["scrape_configs"]
                 if j["job_name"] == "router"]
    found = [(r["source_labels"], r["regex"], r["target_label"], r["replacement"])
             for r in router["metric_relabel_configs"]]
    backends = router_role.backends(view.replicas, dict(view.configs))
    assert found == [(["proxy"], re.escape(b.name), "model", b.model.replace("$", "$$")) for b in backends]
    assert {b.model for b in backends} == {"chat $HOME 100% 'q' \"x\"", "llama-8b"}


def test_only_rank_0_of_an_mp_replica_serves_http_and_every_ray_node_exports_metrics() -> None:
    view, files = _files()
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
    fleet, view = _view(FLEET / "inventory.py", {"vllm_start": False})
    files = role.monitoring_files(fleet.configs[MONITORING_HOST], "10.40.9.1", view, [])
    jobs = {j["job_name"]: j for j in yaml.safe_load(files.configs[role.PROMETHEUS_YML])["scrape_configs"]}
    assert "vllm" not in jobs and "router" in jobs
    assert len(jobs["ray"]["static_configs"]) == 2  # the Ray units run all the same
    facts = yaml.safe_load(files.configs[f"{role.RULES_DIR}/{role.PLAN_RULES}"])["groups"][0]["rules"]
    assert {rule["record"] for rule in facts} == {"gpufleet:node_gpus_expected"}


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
    replicas, used = role.monitored_plan(ctx)
    assert {r.name for r in replicas} == {r.name for r in plan_fleet(fleet, facts).replicas}  # ... Prometheus not
    assert len(used[failed].gpus) == 8
    ctx.gate_failures.clear()
    assert role.monitored_plan(ctx)[0] is ctx.plan.replicas  # every host passed: the deploy's own plan


def _deploy_context(monkeypatch: pytest.MonkeyPatch, **values: Any) -> Fleet:
    """The running deploy's view of the golden fleet, every host passing its gate (``values`` for every host)."""
    fleet = load_fleet(str(FLEET / "inventory.py"), values or None)
    facts = {h: f for h, f in fleet_facts(fleet, None).items() if fleet.serves(h)}
    ctx = DeployContext(fleet, facts=facts, plan=plan_fleet(fleet, facts))
    monkeypatch.setattr(role, "context", lambda *_: ctx)
    monkeypatch.setattr(role, "fleet", lambda: fleet)
    inventory = Inventory(([(h, {}) for h in fleet.hosts], {}), routers=(_group(fleet, "routers"), {}),
                          monitoring=([MONITORING_HOST], {}))
    monkeypatch.setattr(role, "current_state", lambda: SimpleNamespace(inventory=inventory))
    monkeypatch.setattr(role.access, "deploy_group", lambda group="monitoring": ["10.40.9.1"])
    return fleet


def test_the_deploy_configures_prometheus_from_its_own_plan_and_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    fleet = _deploy_context(monkeypatch)
    assert sorted(role.group_members("routers")) == ["gpu-a01.example.net", "router-1.example.net"]
    assert role.group_members("no-such-group") == []
    _, expected = _files()
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


# --- what promtool and amtool accept -------------------------------------------------------------------------

def test_promtool_accepts_the_configuration_with_its_rule_files(tmp_path: Path) -> None:
    _, files = _files(prometheus_retention="30d")
    _write(tmp_path, files)
    promtool = _tool("promtool", "prometheus")
    rules = [n for n in files.configs if n.startswith(f"{role.RULES_DIR}/")]
    for argv in ([promtool, "check", "config", role.PROMETHEUS_YML], [promtool, "check", "rules", *rules]):
        done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(rules)} rule files found" in subprocess.run(
        [promtool, "check", "config", role.PROMETHEUS_YML], cwd=tmp_path, capture_output=True, text=True).stdout
    # a rule file it refuses fails the check that guards the swap-in
    (tmp_path / rules[0]).write_text("groups:\n  - name: x\n    rules:\n      - record: bad name\n        expr: up\n")
    done = subprocess.run([promtool, "check", "config", role.PROMETHEUS_YML], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0


def test_the_swap_in_script_puts_nothing_in_place_that_promtool_refuses(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The role's own script, run here on directories of the test's: checked files replace the live ones, the
    configuration last; a refused rule file leaves the live files as they were."""
    if os.geteuid() != 0:
        pytest.skip("the script installs files owned by root")
    _tool("promtool", "prometheus")
    candidate, live = tmp_path / "candidate", tmp_path / "live"
    monkeypatch.setattr(role, "CANDIDATE_DIR", str(candidate))
    monkeypatch.setattr(role, "CONFIG_DIR", str(live))
    service = dataclasses.replace(role.PROMETHEUS, config=str(live / role.PROMETHEUS_YML))
    _, files = _files()
    _write(candidate, files)
    (live / role.RULES_DIR).mkdir(parents=True)
    names = [n for n in files.configs if n.startswith(f"{role.RULES_DIR}/")] + [role.PROMETHEUS_YML]
    checks = f"promtool check config {role.PROMETHEUS_YML}; promtool check rules {' '.join(names[:-1])}"
    script = role._check_and_install(service, names, checks, "root", "0644")
    assert subprocess.run(["sh", "-c", script], capture_output=True, timeout=120).returncode == 0
    assert all((live / n).read_text() == files.configs[n] for n in names)
    (candidate / names[0]).write_text("groups:\n  - name: x\n    rules:\n      - record: bad name\n        expr: up\n")
    (candidate / role.PROMETHEUS_YML).write_text(files.configs[role.PROMETHEUS_YML] + "# changed\n")
    done = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "bad name" in done.stdout + done.stderr
    assert all((live / n).read_text() == files.configs[n] for n in names)  # untouched


@pytest.mark.parametrize("webhook", [None, "", "https://hooks.example.net/alerts?team=gpu%20fleet"])
def test_amtool_accepts_alertmanagers_configuration(tmp_path: Path, webhook: str | None) -> None:
    _, files = _files(alertmanager_webhook_url=webhook)
    text = files.configs[role.ALERTMANAGER_YML]
    (tmp_path / role.ALERTMANAGER_YML).write_text(text)
    done = subprocess.run([_tool("amtool", "prometheus-alertmanager"), "check-config", role.ALERTMANAGER_YML],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    (receiver,) = yaml.safe_load(text)["receivers"]
    urls = ["http://127.0.0.1:9097/", *([webhook] if webhook else [])]  # the alert log always, the webhook when set
    assert receiver["webhook_configs"] == [{"url": url, "send_resolved": True} for url in urls]


@pytest.mark.parametrize(("values", "expected"), [
    ({}, ("30s", "300s", "14400s")),  # the defaults
    ({"alertmanager_group_wait_s": 0, "alertmanager_group_interval_s": 45, "alertmanager_repeat_interval_s": 60},
     ("0s", "45s", "60s")),
])
def test_alertmanager_groups_and_repeats_as_its_variables_say(values: dict[str, int],
                                                              expected: tuple[str, str, str]) -> None:
    _, files = _files(**values)
    route = yaml.safe_load(files.configs[role.ALERTMANAGER_YML])["route"]
    assert (route["group_wait"], route["group_interval"], route["repeat_interval"]) == expected
    assert route["group_by"] == ["alertname", "model", "node"]


# --- the drop-ins on Debian's units ------------------------------------------------------------------------------

@pytest.mark.parametrize("allowed_from", [None, ["10.9.0.0/24"]])
def test_the_drop_ins_pass_systemd_analyze_on_debians_units_within_the_bound(tmp_path: Path,
                                                                            allowed_from: list[str] | None) -> None:
    """Debian's units (as the packages install them) with gpufleet's drop-ins: systemd accepts them, each runs the
    literal command line, and each rates at most gpufleet's exposure bound (Debian's alone: 4.0 and 9.2)."""
    _, files = _files(prometheus_allowed_from=allowed_from)
    texts = {role.PROMETHEUS: files.prometheus_drop_in, role.ALERTMANAGER: files.alertmanager_drop_in}
    units = []
    for service, text in texts.items():
        debian = DEBIAN_UNITS / service.unit
        assert debian.is_file(), f"Debian's {service.package} package is needed (scripts/install-lab-deps.sh)"
        units.append(Unit(service.drop_in.removeprefix(node_paths.SYSTEMD_DIR + "/"), text,
                          [service.program, "/bin/kill"], extra={service.unit: debian.read_text()}))
    _stub_root(tmp_path, units)
    (tmp_path / role.PROMETHEUS.config.lstrip("/")).parent.mkdir(parents=True)
    for service in texts:
        (tmp_path / service.config.lstrip("/")).write_text("")  # its condition holds
        _verify(tmp_path, service.unit)
        done = subprocess.run(["systemd-analyze", "security", "--offline=yes", f"--root={tmp_path}", "--no-pager",
                               service.unit], capture_output=True, text=True, timeout=120)
        assert exposure_score(done.stdout) <= EXPOSURE_BOUND, done.stdout
    cfg = _config(fleet_address="10.40.9.1")
    expected = {role.PROMETHEUS: role.prometheus_argv(cfg, "10.40.9.1"), role.ALERTMANAGER: role.alertmanager_argv(cfg)}
    for service, text in texts.items():
        settings = unit_settings(text)
        assert [v for _, k, v in settings if k == "ExecStart"] == ["", exec_line(expected[service])]
        assert exec_argv(exec_line(expected[service])) == expected[service]
        assert ("Unit", "ConditionPathExists", service.config) in settings
        assert ("Service", "EnvironmentFile", "") in settings
        filtered = [v for _, k, v in settings if k == "IPAddressAllow"]
        assert bool(filtered) == (service is role.PROMETHEUS and allowed_from is not None), filtered
    assert "--web.listen-address=127.0.0.1:9093" in expected[role.ALERTMANAGER]
    assert "--cluster.listen-address=" in expected[role.ALERTMANAGER]


def test_prometheus_filters_its_traffic_to_the_hosts_it_scrapes_when_asked() -> None:
    view, files = _files(prometheus_allowed_from=["192.168.7.0/24"])
    (line,) = [v for _, k, v in unit_settings(files.prometheus_drop_in) if k == "IPAddressAllow"]
    scraped = {t.host for t in role.targets(view)}
    assert set(line.split()) == {"localhost", "192.168.7.0/24", "10.40.9.1/32", "fd00::5/128",
                                 *(f"{a}/32" for a in scraped if "." in a)}


# --- the role's operations, recorded ------------------------------------------------------------------------

def _run_role(monkeypatch: pytest.MonkeyPatch, monitoring_host: bool = True) -> tuple[Recorder, role.MonitoringFiles]:
    fleet, view = _view(FLEET / "inventory.py")
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
    _, files = _files()
    _, other = _files(alert_queue_waiting_max=7)  # only serving.yml differs
    assert files.configs[f"{role.RULES_DIR}/serving.yml"] != other.configs[f"{role.RULES_DIR}/serving.yml"]
    assert files.configs[role.PROMETHEUS_YML] != other.configs[role.PROMETHEUS_YML]


# --- a real Prometheus scraping the rendered configuration -------------------------------------------------------

HOSTILE = "chat $HOME 100% 'q' \"x\" ${1}"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _exporter(body: str) -> type[QuietHandler]:
    class Handler(QuietHandler):
        def do_GET(self) -> None:
            data = body.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


def _query(base: str, expr: str) -> list[dict[str, Any]]:
    url = f"{base}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    with urllib.request.urlopen(url, timeout=10) as response:
        return list(json.loads(response.read())["data"]["result"])


@pytest.fixture
def scraped(tmp_path: Path) -> Iterator[tuple[str, role.FleetView]]:
    """Prometheus (Debian's binary, in the foreground) with the role's configuration for loopback targets: a node
    with a single-node replica of a hostile model name and a Ray head, a Ray worker, a router; scraping every second."""
    prometheus = _tool("prometheus", "prometheus")
    with ExitStack() as stack:
        def serve(body: str = "gpufleet_test_up 1\n") -> int:
            return int(stack.enter_context(loopback_server(_exporter(body))).rsplit(":", 1)[1])

        replicas = [
            SimpleNamespace(name="p-n1", pool="p", port=serve(), roles=[
                SimpleNamespace(host="n1", address="127.0.0.1", role="single", gpus=[0])]),
            SimpleNamespace(name="q-0", pool="q", port=serve(), roles=[
                SimpleNamespace(host="n1", address="127.0.0.1", role="ray-head", gpus=[1]),
                SimpleNamespace(host="n2", address="127.0.0.1", role="ray-worker", gpus=[0])]),
        ]
        (backend,) = router_role.backends(replicas, {"n1": _config(vllm_served_model_name=HOSTILE)})  # type: ignore[arg-type]
        router_body = f'haproxy_backend_http_responses_total{{proxy="{backend.name}",code="2xx"}} 5\n'
        hosts = {}
        for name in ("n1", "n2", "r1"):
            ray = serve()
            hosts[name] = _config(fleet_address="127.0.0.1", node_exporter_port=serve(), dcgm_exporter_port=serve(),
                                  router_metrics_port=serve(router_body), ray_port=ray - RAY_METRICS_OFFSET,
                                  vllm_served_model_name=HOSTILE)
        view = role.FleetView(hosts, {"n1": "p", "n2": "q", "r1": "routers"}, ["n1", "n2"], ["r1"],
                              replicas, {"n1": 2, "n2": 1, "r1": 0})  # type: ignore[arg-type]
        config = yaml.safe_load(role.prometheus_yml(hosts["r1"], view, {}))
        config["global"] |= {"scrape_interval": "1s", "scrape_timeout": "1s"}
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = _free_port()
        with (tmp_path / "prometheus.log").open("w") as log:
            proc = subprocess.Popen([prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
                                     f"--storage.tsdb.path={tmp_path / 'data'}",
                                     f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
        stack.callback(proc.wait, 10)
        stack.callback(proc.terminate)
        base = f"http://127.0.0.1:{port}"
        expected = len(role.targets(view))
        end = time.monotonic() + 60
        while True:
            try:
                if len(_query(base, "up == 1")) == expected:
                    break
            except OSError:
                pass
            if time.monotonic() > end or proc.poll() is not None:
                pytest.fail(f"not every target up within 60 s: {(tmp_path / 'prometheus.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield base, view


def test_a_real_prometheus_scrapes_every_target_with_its_labels(scraped: tuple[str, role.FleetView]) -> None:
    base, view = scraped
    found = [r["metric"] for r in _query(base, "up")]
    assert len(found) == len(role.targets(view))
    for labels in found:
        assert set(JOB_LABELS[labels["job"]]) <= set(labels), labels
    by_job = {(m["job"], m["node"], m.get("role", "")) for m in found}
    assert by_job == {("node", "n1", ""), ("node", "n2", ""), ("node", "r1", ""), ("dcgm", "n1", ""),
                      ("dcgm", "n2", ""), ("router", "r1", ""), ("vllm", "n1", "rank0"), ("vllm", "n1", "head"),
                      ("ray", "n1", "head"), ("ray", "n2", "worker")}
    ray = {m["node"]: m for m in found if m["job"] == "ray"}
    assert (ray["n1"]["model"], ray["n1"]["replica"]) == (HOSTILE, "q-0")
    assert (ray["n1"]["gpus"], ray["n2"]["gpus"]) == ("1", "0")


def test_a_real_prometheus_gives_the_routers_series_their_models_name_literally(
        scraped: tuple[str, role.FleetView]) -> None:
    base, _ = scraped
    (series,) = _query(base, "haproxy_backend_http_responses_total")
    assert series["metric"]["model"] == HOSTILE  # $HOME and ${1} kept, not expanded
    assert series["metric"]["node"] == "r1"


# --- the rules on the series a fleet's targets give ------------------------------------------------------------

def _alert_names(files: role.MonitoringFiles) -> list[str]:
    return [rule["alert"] for name, text in files.configs.items() if name.startswith(f"{role.RULES_DIR}/")
            for group in yaml.safe_load(text)["groups"] for rule in group["rules"] if "alert" in rule]


def _series(files: role.MonitoringFiles, view: role.FleetView, down: str | None) -> list[dict[str, str]]:
    """``up`` of every target (0 for the vLLM target of replica ``down``), each GPU host's GPU temperatures, and the
    state of every replica's rank units on its nodes (node_exporter's systemd collector): ``vllm@`` on each node of
    an mp replica and on a Ray replica's head, ``gpufleet-ray-`` on each node of a Ray replica."""
    found = []
    for replica in view.replicas:
        for rank, node_role in enumerate(replica.roles):
            units = [f"vllm@{replica.name}.service"] if rank == 0 or replica.backend == "mp" else []
            units += [f"gpufleet-ray-{replica.name}.service"] if replica.backend == "ray" else []
            labels = f'job="node", node="{node_role.host}", state="active"'
            found += [{"series": f'node_systemd_unit_state{{{labels}, name="{unit}"}}', "values": "1x40"}
                      for unit in units]
    for job in yaml.safe_load(files.configs[role.PROMETHEUS_YML])["scrape_configs"]:
        for group in job["static_configs"]:
            labels = {"job": job["job_name"], "instance": group["targets"][0], **group["labels"]}
            selector = ", ".join(f"{k}={json.dumps(v)}" for k, v in labels.items())
            value = "0x40" if job["job_name"] == "vllm" and labels["replica"] == down else "1x40"
            found.append({"series": f"up{{{selector}}}", "values": value})
            if job["job_name"] == "dcgm":
                for gpu in range(view.node_gpus[labels["node"]]):
                    found.append({"series": f"DCGM_FI_DEV_GPU_TEMP{{{selector}, gpu=\"{gpu}\"}}", "values": "60x40"})
    return found


def _promtool_alerts(tmp_path: Path, files: role.MonitoringFiles, series: list[dict[str, str]],
                     expected: dict[str, list[dict[str, Any]]]) -> subprocess.CompletedProcess[str]:
    _write(tmp_path, files)
    rule_files = [n for n in files.configs if n.startswith(f"{role.RULES_DIR}/")]
    tests = {"rule_files": rule_files, "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": series,
        "alert_rule_test": [{"eval_time": "30m", "alertname": name, "exp_alerts": expected.get(name, [])}
                            for name in _alert_names(files)]}]}
    for name in rule_files:  # promtool compares annotations whole: leave them out
        doc = yaml.safe_load((tmp_path / name).read_text())
        for group in doc["groups"]:
            for rule in group["rules"]:
                rule.pop("annotations", None)
        (tmp_path / name).write_text(yaml.safe_dump(doc))
    (tmp_path / "fleet.test.yml").write_text(yaml.safe_dump(tests, sort_keys=False))
    return subprocess.run([_tool("promtool", "prometheus"), "test", "rules", "fleet.test.yml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("shape", [
    "a_single_node_70b", "b_two_nodes_ray",
    "b_two_nodes_mp",
])
def test_the_series_of_a_healthy_fleets_targets_fire_no_alert(tmp_path: Path, shape: str) -> None:
    view, files = _files(ROOT / "tests" / "plans" / shape / "inventory.py")
    done = _promtool_alerts(tmp_path, files, _series(files, view, None), {})
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_replica_whose_api_is_down_fires_its_alerts(tmp_path: Path) -> None:
    view, files = _files(ROOT / "tests" / "plans" / "a_single_node_70b" / "inventory.py")
    replica = view.replicas[0]
    (group,) = [g for j in yaml.safe_load(files.configs[role.PROMETHEUS_YML])["scrape_configs"]
                if j["job_name"] == "vllm" for g in j["static_configs"] if g["labels"]["replica"] == replica.name]
    down = {"severity": "critical", "job": "vllm", "instance": group["targets"][0], **group["labels"]}
    model = group["labels"]["model"]
    expected = {"VllmReplicaDown": [{"exp_labels": down}],
                "ModelReplicasBelowMinimum": [{"exp_labels": {"severity": "critical", "model": model}}]}
    done = _promtool_alerts(tmp_path, files, _series(files, view, replica.name), expected)
    assert done.returncode == 0, done.stdout + done.stderr
