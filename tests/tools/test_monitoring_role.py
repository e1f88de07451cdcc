"""The monitoring role's files as Debian's tools take them (``prometheus`` and ``prometheus-alertmanager``, which
``make deps`` installs; ``systemd``): promtool and amtool accept the rendered configuration, the role's swap-in
script puts nothing in place that promtool refuses, the drop-ins pass ``systemd-analyze`` on Debian's units within
gpufleet's exposure bound, a real Prometheus scrapes loopback targets with the rendered configuration, and promtool
runs the rules on the series a fleet's targets give. The configuration as data, and the role's operations:
tests/unit/roles/test_monitoring_role.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
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

import roles.monitoring as role
from gpufleet import node_paths
from gpufleet.monitoring.scrape_config import JOB_LABELS, RAY_METRICS_OFFSET
from gpufleet.plan.planner import FleetPlan, served_models
from gpufleet.units.escape import exec_line
from gpufleet.units.security import EXPOSURE_BOUND, exposure_score
from tests.conftest import ROOT, host_tool, skip_or_fail
from tests.loopback_http import QuietHandler, free_port, loopback_server
from tests.tools.systemd_verify import stub_root, verify_unit
from tests.unit.configs import host_config
from tests.unit.monitoring_files import monitoring_host_files
from tests.unit.unit_files import Unit, exec_argv, unit_settings

DEBIAN_UNITS = Path("/lib/systemd/system")


def _write(tmp_path: Path, files: role.MonitoringFiles) -> Path:
    for name, text in files.configs.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


# --- what promtool and amtool accept -------------------------------------------------------------------------

def test_promtool_accepts_the_configuration_with_its_rule_files(tmp_path: Path) -> None:
    _, files = monitoring_host_files(prometheus_retention="30d")
    _write(tmp_path, files)
    promtool = host_tool("promtool", "prometheus")
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
        skip_or_fail("the script installs files owned by root")
    host_tool("promtool", "prometheus")
    candidate, live = tmp_path / "candidate", tmp_path / "live"
    monkeypatch.setattr(role, "CANDIDATE_DIR", str(candidate))
    monkeypatch.setattr(role, "CONFIG_DIR", str(live))
    service = dataclasses.replace(role.PROMETHEUS, config=str(live / role.PROMETHEUS_YML))
    _, files = monitoring_host_files()
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
    _, files = monitoring_host_files(alertmanager_webhook_url=webhook)
    text = files.configs[role.ALERTMANAGER_YML]
    (tmp_path / role.ALERTMANAGER_YML).write_text(text)
    done = subprocess.run([host_tool("amtool", "prometheus-alertmanager"), "check-config", role.ALERTMANAGER_YML],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    (receiver,) = yaml.safe_load(text)["receivers"]
    urls = ["http://127.0.0.1:9097/", *([webhook] if webhook else [])]  # the alert log always, the webhook when set
    assert receiver["webhook_configs"] == [{"url": url, "send_resolved": True} for url in urls]


# --- the drop-ins on Debian's units ------------------------------------------------------------------------------

@pytest.mark.parametrize("values", [{}, {"prometheus_allowed_from": ["10.9.0.0/24"],
                                         "alertmanager_listen_address": "0.0.0.0"}])
def test_the_drop_ins_pass_systemd_analyze_on_debians_units_within_the_bound(tmp_path: Path,
                                                                            values: dict[str, object]) -> None:
    """Debian's units (as the packages install them) with gpufleet's drop-ins: systemd accepts them, each runs the
    literal command line, and each rates at most gpufleet's exposure bound (Debian's alone: 4.0 and 9.2).
    Prometheus is always behind its IP filter; Alertmanager once it listens beyond loopback."""
    _, files = monitoring_host_files(**values)
    texts = {role.PROMETHEUS: files.prometheus_drop_in, role.ALERTMANAGER: files.alertmanager_drop_in}
    units = []
    for service, text in texts.items():
        debian = DEBIAN_UNITS / service.unit
        host_tool(Path(service.program).name, service.package)
        assert debian.is_file(), f"Debian's {service.package} package is needed (scripts/install-lab-deps.sh)"
        units.append(Unit(service.drop_in.removeprefix(node_paths.SYSTEMD_DIR + "/"), text,
                          [service.program, "/bin/kill"], extra={service.unit: debian.read_text()}))
    stub_root(tmp_path, units)
    (tmp_path / role.PROMETHEUS.config.lstrip("/")).parent.mkdir(parents=True)
    for service in texts:
        (tmp_path / service.config.lstrip("/")).write_text("")  # its condition holds
        verify_unit(tmp_path, service.unit)
        done = subprocess.run(["systemd-analyze", "security", "--offline=yes", f"--root={tmp_path}", "--no-pager",
                               service.unit], capture_output=True, text=True, timeout=120)
        assert exposure_score(done.stdout) <= EXPOSURE_BOUND, done.stdout
    cfg = host_config(fleet_address="10.40.9.1", **values)
    expected = {role.PROMETHEUS: role.prometheus_argv(cfg, "10.40.9.1"), role.ALERTMANAGER: role.alertmanager_argv(cfg)}
    for service, text in texts.items():
        settings = unit_settings(text)
        assert [v for _, k, v in settings if k == "ExecStart"] == ["", exec_line(expected[service])]
        assert exec_argv(exec_line(expected[service])) == expected[service]
        assert ("Unit", "ConditionPathExists", service.config) in settings
        assert ("Service", "EnvironmentFile", "") in settings
        filtered = [v for _, k, v in settings if k == "IPAddressAllow"]
        assert bool(filtered) == (service is role.PROMETHEUS or "alertmanager_listen_address" in values), filtered
    listen = values.get("alertmanager_listen_address", "127.0.0.1")
    assert f"--web.listen-address={listen}:9093" in expected[role.ALERTMANAGER]
    assert "--cluster.listen-address=" in expected[role.ALERTMANAGER]


# --- a real Prometheus scraping the rendered configuration -------------------------------------------------------

HOSTILE = "chat $HOME 100% 'q' \"x\" ${1}"


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
    prometheus = host_tool("prometheus", "prometheus")
    with ExitStack() as stack:
        def serve(body: str = "gpufleet_test_up 1\n") -> int:
            return int(stack.enter_context(loopback_server(_exporter(body))).rsplit(":", 1)[1])

        served = {"served": HOSTILE, "starts": True, "api_key": None, "max_model_len": 4096,
                  "admission": SimpleNamespace(priority=False, usage=False)}
        replicas: list[Any] = [
            SimpleNamespace(name="p-n1", pool="p", port=serve(), nodes=["n1"], **served, roles=[
                SimpleNamespace(host="n1", address="127.0.0.1", role="single", gpus=[0])]),
            SimpleNamespace(name="q-0", pool="q", port=serve(), nodes=["n1", "n2"], **served, roles=[
                SimpleNamespace(host="n1", address="127.0.0.1", role="ray-head", gpus=[1]),
                SimpleNamespace(host="n2", address="127.0.0.1", role="ray-worker", gpus=[0])]),
        ]
        plan = FleetPlan(replicas, served_models(replicas, {"n1": host_config(vllm_served_model_name=HOSTILE)}))
        (model,) = plan.models.values()
        router_body = f'haproxy_backend_http_responses_total{{proxy="{model.backend}",code="2xx"}} 5\n'
        hosts = {}
        for name in ("n1", "n2", "r1"):
            ray = serve()
            hosts[name] = host_config(fleet_address="127.0.0.1", node_exporter_port=serve(), dcgm_exporter_port=serve(),
                                      router_metrics_port=serve(router_body), ray_port=ray - RAY_METRICS_OFFSET,
                                      vllm_served_model_name=HOSTILE)
        view = role.FleetView(hosts, {"n1": "p", "n2": "q", "r1": "routers"}, ["n1", "n2"], ["r1"], plan,
                              {"n1": 2, "n2": 1, "r1": 0})
        config = yaml.safe_load(role.prometheus_yml(hosts["r1"], view, {}))
        config["global"] |= {"scrape_interval": "1s", "scrape_timeout": "1s"}
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
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
    for replica in view.plan.replicas:
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
    return subprocess.run([host_tool("promtool", "prometheus"), "test", "rules", "fleet.test.yml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("shape", [
    "a_single_node_70b", "b_two_nodes_ray",
    "b_two_nodes_mp",
])
def test_the_series_of_a_healthy_fleets_targets_fire_no_alert(tmp_path: Path, shape: str) -> None:
    view, files = monitoring_host_files(ROOT / "tests" / "data" / "plans" / shape / "inventory.py")
    done = _promtool_alerts(tmp_path, files, _series(files, view, None), {})
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_replica_whose_api_is_down_fires_its_alerts(tmp_path: Path) -> None:
    view, files = monitoring_host_files(ROOT / "tests" / "data" / "plans" / "a_single_node_70b" / "inventory.py")
    replica = view.plan.replicas[0]
    (group,) = [g for j in yaml.safe_load(files.configs[role.PROMETHEUS_YML])["scrape_configs"]
                if j["job_name"] == "vllm" for g in j["static_configs"] if g["labels"]["replica"] == replica.name]
    down = {"severity": "critical", "job": "vllm", "instance": group["targets"][0], **group["labels"]}
    model = group["labels"]["model"]
    expected = {"VllmReplicaDown": [{"exp_labels": down}],
                "ModelReplicasBelowMinimum": [{"exp_labels": {"severity": "critical", "model": model}}]}
    done = _promtool_alerts(tmp_path, files, _series(files, view, replica.name), expected)
    assert done.returncode == 0, done.stdout + done.stderr
