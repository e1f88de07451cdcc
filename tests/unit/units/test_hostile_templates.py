"""Every systemd unit and environment file gpufleet writes, rendered with hostile values that pass validation
(spaces, ``$``, ``%``, quotes, backslashes, unicode), checked two ways:

- ``systemd-analyze verify`` accepts each unit, loaded from a throwaway root with stub programs at the paths the
  units run (systemd checks that they are executable) and stub targets for their dependencies
  (tests/tools/test_units_pass_systemd_analyze.py, with the units of ``UNIT_CASES``);
- each value reads back literally: ``ExecStart=`` words by a strict parser of systemd's rules (specifiers, then
  quotes and escapes, then ``$`` expansion; anything gpufleet never writes is an error), environment files by a
  POSIX shell that sources them and by the node's own reader (``vllm_ready.read_env_file``).

The units, the hostile values and the strict parser: tests/unit/unit_files.py.

Templates are rendered by :func:`gpufleet.templates.render` (what the roles write), from the values each role passes.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

import roles.common as common_role
import roles.node_exporter as node_exporter_role
from gpufleet import templates
from gpufleet.node import vllm_ready
from gpufleet.plan.commands import serve_flags, serve_process
from gpufleet.units import escape as systemd_text
from gpufleet.values.problems import ConfigError
from roles.vllm import replica_files as vf
from tests.conftest import ROOT
from tests.unit.configs import host_config
from tests.unit.unit_files import HOSTILE, exec_argv

TEMPLATES = ROOT / "templates"


def shell_reads(path: Path, names: list[str]) -> list[str]:
    """The values a POSIX shell gets from ``set -a; . FILE``."""
    script = f"set -a; . '{path}'; set +a; " + "; ".join(f'printf "%s\\0" "${name}"' for name in names)
    done = subprocess.run(["sh", "-c", script], capture_output=True, timeout=30,
                          env={"PATH": os.environ["PATH"], "HOME": "/home/someone-else"})
    assert done.returncode == 0, done.stderr
    return done.stdout.decode().split("\0")[:-1]


# --- what every rendered unit must pass --------------------------------------------------------------------------

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
           "node_lifecycle/gpufleet-node-watch.service.j2", "node_lifecycle/gpufleet-burn-in.service.j2",
           "router/gpufleet-router-clients.service.j2", "router/gpufleet-router-clients.timer.j2",
           "router/gpufleet-token-ledger.service.j2",
           "router/gpufleet-tokens.lua.j2",  # HAProxy's Lua, not systemd's: tests/tools/test_router_tokens.py
           "monitoring/gpufleet-alert-log.service.j2", "common/gpufleet-capture@.service.j2",
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
        node_exporter_role.render(host_config(fleet_address=None), "tiny llama $HOME 100%")


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
    cfg = host_config(vllm_env=hostile, vllm_model="/var/lib/gpufleet/models/m")
    env = vf.replica_env(cfg, {"CUDA_VISIBLE_DEVICES": "0,1", "VLLM_HOST_IP": "fd00::5"})
    assert {k: env[k] for k in hostile} == hostile
    return systemd_text.env_file(env, "Written by gpufleet: environment of replica pool-0 (no secrets)"), env


def _node_env(tmp_path: Path) -> tuple[str, dict[str, str]]:
    name, profile = "nöde $HOME 100% \"x\"", "8xH100-SXM `id`"
    text = templates.render("common/node.env.j2", **common_role.node_env_values(name, profile))
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
    cfg = host_config().model_copy(update={"vllm_served_model_name": name})  # past validation: defence in depth
    config = serve_process(cfg, serve_flags(cfg, "10.0.0.5", 8000, 1, 1, 1, 4096), {}).config_yaml()
    assert yaml.safe_load(config)["served-model-name"] == name
