"""Every systemd unit and environment file gpufleet writes, rendered with hostile values that pass validation
(spaces, ``$``, ``%``, quotes, backslashes, unicode), checked two ways:

- ``systemd-analyze verify`` accepts each unit, loaded from a throwaway root with stub programs at the paths the
  units run (systemd checks that they are executable) and stub targets for their dependencies
  (tests/tools/test_units_pass_systemd_analyze.py, with the units of ``UNIT_CASES`` here);
- each value reads back literally: ``ExecStart=`` words by a strict parser of systemd's rules (specifiers, then
  quotes and escapes, then ``$`` expansion; anything gpufleet never writes is an error), environment files by a
  POSIX shell that sources them and by the node's own reader (``vllm_ready.read_env_file``).

Templates are rendered by :func:`gpufleet.templates.render` (what the roles write), from the values each role passes.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

import roles.common as common_role
import roles.dcgm_exporter as dcgm_exporter_role
import roles.gpu_watch as gpu_watch_role
import roles.keepalived as keepalived_role
import roles.monitoring as monitoring_role
import roles.node_exporter as node_exporter_role
import roles.ray as ray_role
import roles.router as router_role
import roles.vllm as vllm_role
from gpufleet import node_paths, templates
from gpufleet.config.problems import ConfigError
from gpufleet.deploy import access
from gpufleet.deploy import vllm_files as vf
from gpufleet.node import vllm_ready
from gpufleet.plan.commands import ray_start_argv, serve_flags, serve_process
from gpufleet.units import escape as systemd_text
from tests.conftest import ROOT
from tests.unit.test_vllm_role import _config

TEMPLATES = ROOT / "templates"

# Text that passes validation wherever free text is allowed (vllm_env values, secrets, host names).
HOSTILE = [
    "tiny llama $HOME 100%",
    'say "hi" and \'bye\'',
    "back\\slash \\n not a newline\\",
    "${PATH} $$ %i %% %n",
    "`id` $(id) ; rm -rf / #",
    "modèle ✓ 模型",
    " leading and trailing ",
    "",
]


# --- systemd's reading of what we write (strict: what gpufleet never writes is an error) ------------------------

def unit_settings(text: str) -> list[tuple[str, str, str]]:
    """(section, key, value) of a unit file: comments dropped, backslash-continued lines joined."""
    found, section, pending = [], "", ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line[0] in "#;"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, sep, value = line.partition("=")
        assert sep, f"not a key=value line: {line!r}"
        found.append((section, key.strip(), value.strip()))
    assert not pending, "a continuation at the end of the file"
    return found


def _specifiers(text: str, instance: str) -> str:
    def one(match: re.Match[str]) -> str:
        if match[1] == "%":
            return "%"
        if match[1] == "i":
            return instance
        raise AssertionError(f"unexpected specifier %{match[1]} in {text!r}")
    return re.sub(r"%(.)", one, text)


def _words(text: str) -> list[str]:
    """systemd's word splitting of a command line: "..." with \\\\ and \\" escapes; bare words without quotes."""
    words, i = [], 0
    while i < len(text):
        if text[i] in " \t":
            i += 1
            continue
        if text[i] == '"':
            word, i = "", i + 1
            while text[i] != '"':
                if text[i] == "\\":
                    assert text[i + 1] in '\\"', f"an escape gpufleet never writes in {text!r}"
                    i += 1
                word += text[i]
                i += 1
            i += 1
            assert i == len(text) or text[i] in " \t", f"a quote inside a word in {text!r}"
        else:
            end = i
            while end < len(text) and text[end] not in " \t":
                end += 1
            word = text[i:end]
            assert not set(word) & set("\"'\\"), f"quote or backslash in a bare word in {text!r}"
            i = end
        words.append(word)
    return words


def _expand(word: str, env: dict[str, str]) -> str:
    def one(match: re.Match[str]) -> str:
        if match[0] == "$$":
            return "$"
        assert match[1], f"a bare $ in {word!r}"
        return env[match[1]]
    return re.sub(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$", one, word)


def exec_argv(line: str, instance: str = "", env: dict[str, str] | None = None) -> list[str]:
    """The argv systemd runs for an ``ExecStart=`` value."""
    return [_expand(word, env or {}) for word in _words(_specifiers(line, instance))]


def shell_reads(path: Path, names: list[str]) -> list[str]:
    """The values a POSIX shell gets from ``set -a; . FILE``."""
    script = f"set -a; . '{path}'; set +a; " + "; ".join(f'printf "%s\\0" "${name}"' for name in names)
    done = subprocess.run(["sh", "-c", script], capture_output=True, timeout=30,
                          env={"PATH": os.environ["PATH"], "HOME": "/home/someone-else"})
    assert done.returncode == 0, done.stderr
    return done.stdout.decode().split("\0")[:-1]


# --- what every rendered unit must pass --------------------------------------------------------------------------

@dataclass
class Unit:
    """A unit file as a role writes it: its name on the node, text, what it runs, and the argv systemd must run."""

    name: str
    text: str
    programs: list[str]
    argv: list[str] | None = None  # the ExecStart= argv expected back, literally
    instance: str = ""
    env: dict[str, str] = field(default_factory=dict)
    drop_in_for: str | None = None
    extra: dict[str, str] = field(default_factory=dict)  # units installed beside it (name -> text)


def _render(template: str, **values: object) -> str:
    return templates.render(template, **values)


def _render_ne(cfg_values: dict[str, object]) -> tuple[str, list[str]]:
    cfg = _config(**cfg_values)
    return node_exporter_role.render(cfg, "ignored"), node_exporter_role.exporter_flags(cfg, "ignored")


def _node_exporter_tarball(address: str) -> Unit:
    text, flags = _render_ne({"fleet_address": address})
    return Unit(node_exporter_role.UNIT, text, [node_exporter_role.BINARY], [node_exporter_role.BINARY, *flags])


def _node_exporter_package(address: str) -> Unit:
    text, flags = _render_ne({"fleet_address": address, "node_exporter_install": "package"})
    return Unit(f"{node_exporter_role.PACKAGE_UNIT}.d/gpufleet.conf", text, [node_exporter_role.PACKAGE_BINARY],
                [node_exporter_role.PACKAGE_BINARY, *flags], drop_in_for=node_exporter_role.PACKAGE_UNIT)


def _vllm(_: str) -> Unit:
    replica = "pool-0"
    values = vllm_role.unit_values()
    etc = f"{node_paths.VLLM_ETC}/{replica}"
    return Unit("vllm@.service", _render("vllm/vllm@.service.j2", **values),
                [f"{etc}/venv/bin/python", f"{etc}/venv/bin/vllm"],
                [f"{etc}/venv/bin/python", node_paths.node_tool("replica_rank.py"), f"{etc}/ranks.json", "--",
                 f"{etc}/venv/bin/vllm", "serve", "/var/lib/gpufleet/models/m $HOME", "--config", f"{etc}/config.yaml"],
                instance=replica, env={"VLLM_MODEL": "/var/lib/gpufleet/models/m $HOME"})


def _vllm_watchdog(address: str) -> Unit:
    replica = "pool-0"
    etc = f"{node_paths.VLLM_ETC}/{replica}"
    return Unit(node_paths.WATCHDOG_UNIT_TEMPLATE,
                _render("vllm/vllm-watchdog@.service.j2", **vllm_role.watchdog_unit_values(address)),
                [f"{etc}/venv/bin/python"],
                [f"{etc}/venv/bin/python", "-I", node_paths.node_tool("replica_watchdog.py"),
                 node_paths.watchdog_config(replica)], instance=replica)


def _gpu_watch(_: str) -> Unit:
    """The watch's service, and beside it the timer that starts it (verified with it)."""
    values = gpu_watch_role.service_values()
    argv = [node_paths.NODE_PYTHON, node_paths.node_tool("gpu_watch.py"), "--policy", node_paths.GATE_POLICY,
            "--marker", node_paths.GPU_WATCH_MARKER]
    timer = _render("gpu_watch/gpufleet-gpu-watch.timer.j2", **gpu_watch_role.timer_values(30))
    return Unit(node_paths.GPU_WATCH_SERVICE, _render("gpu_watch/gpufleet-gpu-watch.service.j2", **values),
                [node_paths.NODE_PYTHON], argv, extra={node_paths.GPU_WATCH_TIMER: timer})


def _router_clients(_: str) -> Unit:
    """The router's clients' counters, and beside it the timer that starts it (verified with it)."""
    argv = [node_paths.NODE_PYTHON, "-I", node_paths.node_tool("router_admin.py"), "client-metrics", "--textfile",
            router_role.CLIENTS_TEXTFILE, "--socket", node_paths.ROUTER_ADMIN_SOCKET,
            "--edge-dir", router_role.EDGE_DIR]
    timer = _render("router/gpufleet-router-clients.timer.j2", **router_role.clients_timer_values())
    return Unit(router_role.CLIENTS_SERVICE,
                _render("router/gpufleet-router-clients.service.j2", **router_role.clients_service_values()),
                [node_paths.NODE_PYTHON], argv, extra={router_role.CLIENTS_TIMER: timer})


def _dcgm_exporter(address: str) -> Unit:
    values = dcgm_exporter_role.unit_values(9400, address, ["10.0.0.0/24"], 300)
    listen = f"[{address}]:9400" if ":" in address else f"{address}:9400"
    return Unit(dcgm_exporter_role.SERVICE, _render("dcgm_exporter/dcgm-exporter.service.j2", **values),
                ["/usr/bin/dcgm-exporter"], ["/usr/bin/dcgm-exporter", "-f", dcgm_exporter_role.COUNTERS_FILE,
                                             "-a", listen, "-r", dcgm_exporter_role.HOSTENGINE_ADDRESS, "-x", "300000"])


def _ray(address: str) -> Unit:
    replica = "pool-0"
    cfg = _config(fleet_interface="bond0")
    argv = ray_start_argv(cfg, address, None)
    values: dict[str, object] = {
        "kind": "head", "replica": replica, "env_file": node_paths.ray_env_file(replica),
        "exec_start": systemd_text.exec_line(argv), "ray": f"{vf.venv_dir(cfg)}/bin/ray",
        "token_file": node_paths.ray_token_file(replica), "ip_access": access.unit_lines(["10.0.0.0/24"]),
    }
    return Unit(ray_role.unit_name(replica), _render("ray/ray.service.j2", **values),
                [argv[0], f"{vf.venv_dir(cfg)}/bin/ray"], argv)


def _alert_log(_: str) -> Unit:
    cfg = _config(alertmanager_log_port=9097)
    argv = ["/usr/bin/python3", "-I", node_paths.node_tool("alert_log.py"), "--port", "9097"]
    return Unit(node_paths.ALERT_LOG_SERVICE, monitoring_role.alert_log_unit(cfg), ["/usr/bin/python3"], argv)


def _router_health(address: str) -> Unit:
    cfg = _config(router_metrics_port=8405)
    return Unit(node_paths.ROUTER_HEALTH_SERVICE, keepalived_role.health_unit(cfg, address), [node_paths.NODE_PYTHON],
                keepalived_role.health_argv(cfg, address))


# Each case: a name, and the unit as its role renders it for a node at a (validated) fleet address. The free
# text of the inventory never reaches a unit: addresses are IPs, replica names the planner's, paths gpufleet's.
UNIT_CASES: list[tuple[str, Callable[[str], Unit]]] = [
    ("node_exporter tarball unit", _node_exporter_tarball),
    ("node_exporter package drop-in", _node_exporter_package),
    ("vllm@.service", _vllm),
    ("vllm-watchdog@.service", _vllm_watchdog),
    ("dcgm-exporter.service", _dcgm_exporter),
    ("gpufleet-gpu-watch.service and its timer", _gpu_watch),
    ("gpufleet-router-clients.service and its timer", _router_clients),
    ("ray unit of a head", _ray),
    ("gpufleet-alert-log.service", _alert_log),
    ("gpufleet-router-health.service", _router_health),
]
# Templates that are not systemd units or environment files (apt sources and preferences, DCGM's CSV, Prometheus's
# rules: tests/tools/test_alert_rules.py).
NOT_SYSTEMD = {"nvidia_driver/51gpufleet-nvidia-driver.conf.j2", "nvidia_driver/gpufleet-nvidia-driver.pref.j2",
               "nvidia_driver/gpufleet-nvidia.list.j2", "dcgm_exporter/counters.csv.j2",
               "monitoring/rules/_header.j2", "monitoring/rules/_prometheus.j2", "monitoring/rules/recording.yml.j2",
               "monitoring/rules/gpu.yml.j2", "monitoring/rules/serving.yml.j2", "monitoring/rules/node.yml.j2"}
COVERED = {"node_exporter/node_exporter.service.j2", "node_exporter/package-override.conf.j2",
           "node_exporter/sandbox.conf.j2", "vllm/vllm@.service.j2", "dcgm_exporter/dcgm-exporter.service.j2",
           "vllm/vllm-watchdog@.service.j2", "ray/ray.service.j2", "common/node.env.j2",
           "gpu_watch/gpufleet-gpu-watch.service.j2", "gpu_watch/gpufleet-gpu-watch.timer.j2",
           "router/gpufleet-router-clients.service.j2", "router/gpufleet-router-clients.timer.j2",
           "monitoring/gpufleet-alert-log.service.j2",
           "_sandbox.conf.j2",  # the sandbox: in every unit
           "vllm/ray.conf.j2",  # with vllm@.service and the Ray unit: tests/tools/test_units_pass_systemd_analyze.py
           "router/haproxy-override.conf.j2",  # with Debian's haproxy.service: the same
           "router/haproxy.cfg.j2",  # HAProxy's, not systemd's: tests/tools/test_router_role.py
           "monitoring/override.conf.j2",  # with Debian's prometheus units: tests/tools/test_monitoring_role.py
           "keepalived/gpufleet-router-health.service.j2",
           # with Debian's keepalived.service: tests/tools/test_keepalived_role.py, as keepalived.conf (not systemd's)
           "keepalived/keepalived-override.conf.j2", "keepalived/keepalived.conf.j2"}


def test_every_template_is_covered_here_or_named_as_not_systemd() -> None:
    found = {str(p.relative_to(TEMPLATES)) for p in TEMPLATES.rglob("*.j2")}
    assert found == COVERED | NOT_SYSTEMD, "a new template: add it to UNIT_CASES (or NOT_SYSTEMD with a reason)"


@pytest.mark.parametrize("bad", ["10.0.0.5\nExecStartPre=/bin/sh -c 'id'", "a\rb", "nul\0"])
def test_a_line_break_never_reaches_a_unit(bad: str) -> None:
    with pytest.raises(systemd_text.UnitValueError, match="one line"):
        systemd_text.exec_line(["/usr/bin/x", bad])
    with pytest.raises(systemd_text.UnitValueError, match="one line"):
        systemd_text.unit_value(bad)
    with pytest.raises(systemd_text.UnitValueError, match="one line"):
        systemd_text.env_file({"NAME": bad}, "header")


def test_a_host_without_an_address_never_reaches_node_exporters_unit() -> None:
    with pytest.raises(ConfigError, match="expected IP addresses"):
        node_exporter_role.render(_config(fleet_address=None), "tiny llama $HOME 100%")


@pytest.mark.parametrize("word", HOSTILE)
def test_exec_arg_round_trips_every_hostile_word(word: str) -> None:
    assert exec_argv(systemd_text.exec_line(["/usr/bin/x", word, "plain"])) == ["/usr/bin/x", word, "plain"]


def test_exec_arg_leaves_safe_words_bare() -> None:
    assert systemd_text.exec_line(["/usr/local/bin/node_exporter", "--web.listen-address=[fd00::1]:9100"]) == \
        "/usr/local/bin/node_exporter --web.listen-address=[fd00::1]:9100"
    with pytest.raises(systemd_text.UnitValueError, match="absolute"):
        systemd_text.exec_line(["node_exporter"])


# --- environment files -------------------------------------------------------------------------------------------

def _vllm_env(tmp_path: Path) -> tuple[str, dict[str, str]]:
    hostile = {f"GPUFLEET_TEST_{i}": text for i, text in enumerate(HOSTILE)}
    cfg = _config(vllm_env=hostile, vllm_model="/var/lib/gpufleet/models/m")
    env = vf.replica_env(cfg, {"CUDA_VISIBLE_DEVICES": "0,1", "VLLM_HOST_IP": "fd00::5"})
    assert {k: env[k] for k in hostile} == hostile
    return systemd_text.env_file(env, "Written by gpufleet: environment of replica pool-0 (no secrets)"), env


def _node_env(tmp_path: Path) -> tuple[str, dict[str, str]]:
    name, profile = "nöde $HOME 100% \"x\"", "8xH100-SXM `id`"
    text = _render("common/node.env.j2", **common_role.node_env_values(name, profile))
    return text, {"GPUFLEET_NODE": name, "GPUFLEET_GPU_PROFILE": profile}


def _secrets_env(tmp_path: Path) -> tuple[str, dict[str, str]]:
    secrets = {"VLLM_API_KEY": 'sk-$HOME-"q"-`id`-\\-100%', "HF_TOKEN": "hf_$(id)"}
    return systemd_text.env_file(secrets, "secrets of replica pool-0"), secrets


ENV_CASES = [("vllm.env with hostile vllm_env values", _vllm_env), ("node.env", _node_env),
             ("secrets.env", _secrets_env)]


@pytest.mark.parametrize(("case", "make"), ENV_CASES, ids=[c for c, _ in ENV_CASES])
def test_env_files_read_back_literally(tmp_path: Path, case: str,
                                       make: Callable[[Path], tuple[str, dict[str, str]]]) -> None:
    text, expected = make(tmp_path)
    path = tmp_path / "file.env"
    path.write_text(text)
    assert vllm_ready.read_env_file(str(path)) == expected
    assert shell_reads(path, list(expected)) == list(expected.values())
    for line in text.splitlines():  # one NAME="..." a line, as systemd.exec(5) reads EnvironmentFile=
        assert line.startswith("#") or re.fullmatch(r'[A-Za-z_][A-Za-z0-9_]*="([^"\\]|\\.)*"', line), line


# --- config.yaml: the served name and every flag value as YAML reads them back -----------------------------------

@pytest.mark.parametrize("name", HOSTILE[:6])
def test_config_yaml_keeps_a_hostile_served_name(name: str) -> None:
    cfg = _config().model_copy(update={"vllm_served_model_name": name})  # past validation: defence in depth
    config = serve_process(cfg, serve_flags(cfg, "10.0.0.5", 8000, 1, 1, 1, 4096), {}).config_yaml()
    assert yaml.safe_load(config)["served-model-name"] == name
