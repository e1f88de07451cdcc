"""What the vllm role writes on a node for each replica, computed on the controller from the plan.

- ``config.yaml``: every ``vllm serve`` flag of the replica's process, passed as ``--config PATH``;
- ``vllm.env``: its plain environment (the model's path, VLLM_HOST_IP, the GPU set, NCCL/GLOO interface);
- ``secrets.env``: VLLM_API_KEY and HF_TOKEN, read here from the controller's references, 0600 root.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from gpufleet.config.problems import ConfigError, Problem
from gpufleet.config.schema import HostConfig, SecretRef
from gpufleet.plan.commands import VLLM_ROOT

ETC = "/etc/gpufleet/vllm"
HOME = "/var/lib/vllm"
MODELS = f"{HOME}/models"
UNIT_TEMPLATE = "vllm@.service"
INSTALLED_MARKER = ".gpufleet-installed"
_NUMBER = re.compile(r"^-?\d+(\.\d+)?$")


def replica_dir(replica: str) -> str:
    return f"{ETC}/{replica}"


def unit_name(replica: str) -> str:
    return f"vllm@{replica}.service"


def venv_dir(cfg: HostConfig) -> str:
    """One virtualenv per vLLM version, so an upgrade can switch and roll back."""
    return f"{VLLM_ROOT}/{cfg.vllm_version}"


def model_dir(cfg: HostConfig) -> str:
    """Where the model lives on the node: ``vllm_model`` itself when it is a path, else under /var/lib/vllm."""
    if cfg.vllm_model.startswith("/"):
        return cfg.vllm_model
    return f"{MODELS}/{cfg.vllm_model.replace('/', '--')}"


def _value(token: str) -> Any:
    """A number where it reads back as the same text (``0.92``, ``8``); the text otherwise (``1.10``, ``0123``)."""
    if _NUMBER.match(token):
        number = float(token) if "." in token else int(token)
        if str(number) == token:
            return number
    return token


def serve_config(argv: list[str]) -> tuple[str, dict[str, Any]]:
    """Split ``[vllm, serve, MODEL, --flag, value, --switch, ...]`` into the model and the ``--config`` mapping.

    ``--x v`` -> ``x: v``, ``--x`` -> ``x: true``, ``--no-x`` -> ``x: false``, a repeated flag -> a list.
    """
    if len(argv) < 3 or argv[1] != "serve":
        raise ValueError(f"expected `vllm serve MODEL ...`, found {argv[:3]}")
    model, rest = argv[2], argv[3:]
    config: dict[str, Any] = {}
    i = 0
    while i < len(rest):
        token = rest[i]
        if not token.startswith("--"):
            raise ValueError(f"expected a flag, found {token!r}")
        name = token[2:]
        if i + 1 < len(rest) and not rest[i + 1].startswith("--"):
            value: Any = _value(rest[i + 1])
            i += 2
        else:
            value = not name.startswith("no-")
            name = name[3:] if name.startswith("no-") else name
            i += 1
        if name in config:
            previous = config[name]
            config[name] = (previous if isinstance(previous, list) else [previous]) + [value]
        else:
            config[name] = value
    return model, config


def config_yaml(config: dict[str, Any]) -> str:
    return "# Written by gpufleet (role vllm): `vllm serve --config` of this replica.\n" + yaml.safe_dump(
        config, sort_keys=False, default_flow_style=False)


def env_file(env: dict[str, str], header: str) -> str:
    """A systemd EnvironmentFile: one ``NAME="value"`` a line."""
    lines = [f"# {header}"]
    for name, value in env.items():
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        lines.append(f'{name}="{escaped}"')
    return "\n".join(lines) + "\n"


def replica_env(cfg: HostConfig, plan_env: dict[str, str]) -> dict[str, str]:
    """The plain environment of a replica's vLLM process on one node."""
    env = {"VLLM_MODEL": model_dir(cfg), "HOME": HOME, "HF_HOME": f"{HOME}/hf"}
    if cfg.vllm_model_source or cfg.vllm_model.startswith("/"):
        env["HF_HUB_OFFLINE"] = "1"  # staged weights: nothing to fetch at start
    env.update(cfg.vllm_env)
    env.update(plan_env)  # the plan's GPU set, address and interfaces are not the operator's to override
    return env


def _read_secret(ref: SecretRef, key: str) -> str:
    if ref.env is not None:
        value = (os.environ.get(ref.env) or "").strip()
        if not value:
            raise ConfigError([Problem("controller", key, f"expected environment variable {ref.env} to be set,"
                                                       " found it unset or empty")])
        return value
    path = Path(os.path.expanduser(str(ref.file)))
    try:
        value = path.read_text().strip()
    except OSError as exc:
        raise ConfigError([Problem("controller", key, f"expected a readable secret file {path},"
                                                   f" found: {exc.strerror}")]) from None
    if not value:
        raise ConfigError([Problem("controller", key, f"expected a secret in {path}, found an empty file")])
    return value


def secret_env(cfg: HostConfig) -> dict[str, str]:
    """VLLM_API_KEY and HF_TOKEN from the controller's references (raises ConfigError naming the key)."""
    found: dict[str, str] = {}
    if cfg.vllm_api_key:
        found["VLLM_API_KEY"] = _read_secret(cfg.vllm_api_key, "vllm_api_key")
    if cfg.vllm_hf_token:
        found["HF_TOKEN"] = _read_secret(cfg.vllm_hf_token, "vllm_hf_token")
    return found


def pip_install_args(cfg: HostConfig) -> list[str]:
    """``pip install`` arguments for the node's virtualenv: from a wheelhouse, an index, and/or a hash lock."""
    args = ["install", "--quiet", "--disable-pip-version-check", "--no-input"]
    if cfg.vllm_wheelhouse_url:
        args += ["--no-index", "--find-links", cfg.vllm_wheelhouse_url]
    elif cfg.vllm_pip_index_url:
        args += ["--index-url", cfg.vllm_pip_index_url]
    for url in (cfg.vllm_wheelhouse_url, cfg.vllm_pip_index_url, cfg.vllm_requirements_url):
        parsed = urlsplit(url or "")
        if parsed.scheme == "http" and parsed.hostname and parsed.hostname not in args:
            args += ["--trusted-host", parsed.hostname]  # a site's plain-HTTP mirror; pins carry the hashes
    if cfg.vllm_requirements_url:
        return args + ["--no-deps", "--require-hashes", "-r", cfg.vllm_requirements_url]
    return args + [f"{cfg.vllm_package}=={cfg.vllm_version}", f"ray=={cfg.ray_version}", "nvidia-ml-py"]


def install_marker(cfg: HostConfig) -> str:
    """What a finished install records; a different one (or none) means install again."""
    return json.dumps({"vllm_version": cfg.vllm_version, "pip": pip_install_args(cfg)}, sort_keys=True)


def install_script(cfg: HostConfig) -> str:
    """Shell that (re)creates the version's virtualenv; the marker is written last, so an interrupted install
    is redone from scratch by the next run and never half-used (units point at a version only once it is in)."""
    venv = venv_dir(cfg)
    pip = shlex.join([f"{venv}/bin/pip", *pip_install_args(cfg)])
    marker = shlex.quote(f"{venv}/{INSTALLED_MARKER}")
    wanted = shlex.quote(install_marker(cfg))
    # One install at a time per version: a rerun waits for one still running from an interrupted deploy,
    # then finds it finished (or redoes it).
    return " && ".join([
        f"exec 9>{shlex.quote(venv + '.lock')}",
        "flock 9",
        f"{{ [ \"$(cat {marker} 2>/dev/null)\" = {wanted} ] && exit 0 || true; }}",
        f"rm -rf {shlex.quote(venv)}",
        f"python3 -m venv {shlex.quote(venv)}",
        pip,
        f"printf '%s\\n' {wanted} > {marker}.tmp",
        f"mv {marker}.tmp {marker}",
    ])
