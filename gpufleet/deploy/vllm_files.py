"""What the vllm role writes on a node for each replica, computed on the controller from the plan.

- ``config.yaml``: every ``vllm serve`` flag of the replica's process, passed as ``--config PATH``;
- ``vllm.env``: its plain environment (the model's path, VLLM_HOST_IP, the GPU set, NCCL/GLOO interface);
- ``secrets.env``: VLLM_API_KEY and HF_TOKEN, read here from the controller's references, 0600 root;

and the shell the role runs as root on a node (installing vLLM, downloading the model), every value in it
quoted with ``shlex.quote`` and no secret in its text.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
import shlex
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import yaml

from gpufleet.config.grammar import MODELS_PREFIX
from gpufleet.config.problems import ConfigError, Problem
from gpufleet.config.schema import HostConfig, SecretRef
from gpufleet.plan.commands import VLLM_ROOT
from gpufleet.systemd_text import env_file  # noqa: F401  (re-exported: what roles write with vf.env_file)

ETC = "/etc/gpufleet/vllm"
HOME = "/var/lib/vllm"  # the vllm user's home and caches (StateDirectory=vllm): nothing root runs or trusts
MODELS = MODELS_PREFIX  # root-owned: hub ids are downloaded to <MODELS>/<org>--<name>
REVISION_MARKER = ".gpufleet-revision"
PIP_SECRET = "/etc/gpufleet/secrets/pip.env"  # PIP_INDEX_URL with credentials, 0600 root
INSTALL_LOCK_TIMEOUT = 1800  # seconds a second install of one version waits for the first
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
    """Where the model lives on the node: ``vllm_model`` itself when it is a path, else below MODELS."""
    if cfg.vllm_model.startswith("/"):
        return cfg.vllm_model
    return f"{MODELS}/{cfg.vllm_model.replace('/', '--')}"


def below_models(path: str) -> bool:
    """Whether ``path`` lies strictly below MODELS (normalised, no ``..``): the only place the role deletes in."""
    return posixpath.normpath(path) == path and path.startswith(MODELS + "/") and ".." not in path.split("/")


def download_script(cfg: HostConfig, token_file: str) -> str:
    """Shell (run as root) that downloads the hub model at its revision into a temporary directory beside the
    target, writes the revision marker, and only then moves it into place; the hub token is read from its 0600
    file, never from this text. An interrupted download leaves the previous copy and no marker change."""
    target = model_dir(cfg)
    if not below_models(target):
        raise ValueError(f"expected the model directory below {MODELS}/, found {target!r}")
    revision = cfg.vllm_model_revision or "main"
    q = shlex.quote
    hf = q(f"{venv_dir(cfg)}/bin/hf")
    return "; ".join([
        "set -eu",
        "umask 022",
        f"tmp=\"$(mktemp -d {q(target + '.download-XXXXXX')})\"",
        "trap 'rm -rf \"$tmp\" \"$tmp.old\"' EXIT",
        f"if [ -f {q(token_file)} ]; then set -a; . {q(token_file)}; set +a; fi",
        f"{hf} download {q(cfg.vllm_model)} --revision {q(revision)} --local-dir \"$tmp\" >/dev/null",
        f"printf '%s\\n' {q(revision)} > \"$tmp/{REVISION_MARKER}\"",
        "chmod 0755 \"$tmp\"",
        f"if [ -e {q(target)} ]; then mv -T {q(target)} \"$tmp.old\"; fi",
        f"mv -T \"$tmp\" {q(target)}",
    ])


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
    """VLLM_API_KEY, HF_TOKEN and, with the ray backend, RAY_AUTH_TOKEN from the controller's references (raises
    ConfigError naming the key)."""
    found: dict[str, str] = {}
    if cfg.vllm_api_key:
        found["VLLM_API_KEY"] = _read_secret(cfg.vllm_api_key, "vllm_api_key")
    if cfg.vllm_hf_token:
        found["HF_TOKEN"] = _read_secret(cfg.vllm_hf_token, "vllm_hf_token")
    if cfg.vllm_distributed_backend == "ray" and cfg.ray_auth_token:
        found["RAY_AUTH_TOKEN"] = _read_secret(cfg.ray_auth_token, "ray_auth_token")
    return found


def pip_secret_env(cfg: HostConfig) -> dict[str, str]:
    """``PIP_INDEX_URL`` with ``vllm_pip_index_credentials`` (``user:password`` or a token) in it, for the
    install's 0600 environment file; empty when the index needs none (or a wheelhouse replaces it)."""
    url = cfg.vllm_pip_index_url
    if cfg.vllm_wheelhouse_url or not url or cfg.vllm_pip_index_credentials is None:
        return {}
    user, sep, password = _read_secret(cfg.vllm_pip_index_credentials, "vllm_pip_index_credentials").partition(":")
    userinfo = quote(user, safe="") + (":" + quote(password, safe="") if sep else "")
    parts = urlsplit(url)
    return {"PIP_INDEX_URL": urlunsplit(parts._replace(netloc=f"{userinfo}@{parts.netloc}"))}


def pip_install_args(cfg: HostConfig) -> list[str]:
    """``pip install`` arguments for the node's virtualenv: from a wheelhouse, an index, and/or a hash lock.

    An index URL with credentials is not among them: pip reads it from PIP_INDEX_URL (:func:`pip_secret_env`).
    """
    args = ["install", "--quiet", "--disable-pip-version-check", "--no-input"]
    if cfg.vllm_wheelhouse_url:
        args += ["--no-index", "--find-links", cfg.vllm_wheelhouse_url]
    elif cfg.vllm_pip_index_url and cfg.vllm_pip_index_credentials is None:
        args += ["--index-url", cfg.vllm_pip_index_url]
    for url in (cfg.vllm_wheelhouse_url, cfg.vllm_pip_index_url, cfg.vllm_requirements_url):
        parsed = urlsplit(url or "")
        if parsed.scheme == "http" and parsed.hostname and parsed.hostname not in args:
            args += ["--trusted-host", parsed.hostname]  # a site's plain-HTTP mirror; pins carry the hashes
    if cfg.vllm_requirements_url:
        return args + ["--no-deps", "--require-hashes", "-r", cfg.vllm_requirements_url]
    return args + [f"{cfg.vllm_package}=={cfg.vllm_version}", f"ray=={cfg.ray_version}", "nvidia-ml-py"]


def install_marker(cfg: HostConfig) -> str:
    """What a finished install records (no credentials); a different one (or none) means install again."""
    found: dict[str, Any] = {"vllm_version": cfg.vllm_version, "pip": pip_install_args(cfg)}
    if cfg.vllm_pip_index_credentials is not None and not cfg.vllm_wheelhouse_url:
        found["index"] = cfg.vllm_pip_index_url
    return json.dumps(found, sort_keys=True)


def build_prefix(cfg: HostConfig) -> str:
    """Where this install's virtualenv is built and stays (its scripts' shebangs name it): a fresh directory
    ``<prefix>-XXXXXX`` per attempt, so no attempt ever touches the build in use."""
    digest = hashlib.sha256(install_marker(cfg).encode()).hexdigest()[:12]
    return f"{VLLM_ROOT}/.build-{cfg.vllm_version}-{digest}"


def install_script(cfg: HostConfig) -> str:
    """Shell that builds the version's virtualenv in a directory of its own and then points
    ``/opt/vllm/<version>`` at it with one rename: a working virtualenv stays in use until the new one is
    complete, an interrupted install is redone from scratch by the next run, and of the earlier builds of the
    version only the one just replaced is kept (until the next install). One install at a time per version
    (``flock``, with a timeout and a message saying what holds it)."""
    q = shlex.quote
    venv = venv_dir(cfg)
    marker = f"{venv}/{INSTALLED_MARKER}"
    lock = f"{VLLM_ROOT}/.{cfg.vllm_version}.lock"
    wanted = q(install_marker(cfg))
    busy = (f"gpufleet: another install of vLLM {cfg.vllm_version} still holds {lock} after"
            f" {INSTALL_LOCK_TIMEOUT} s; let it finish or end it, then run the deploy again")
    return "\n".join([
        "set -eu",
        "umask 022",
        f"exec 9>{q(lock)}",
        f"flock -w {INSTALL_LOCK_TIMEOUT} 9 || {{ echo {q(busy)} >&2; exit 1; }}",
        f"if [ \"$(cat {q(marker)} 2>/dev/null)\" = {wanted} ]; then exit 0; fi",
        f"if [ -f {q(PIP_SECRET)} ]; then set -a; . {q(PIP_SECRET)}; set +a; fi",
        f"build=\"$(mktemp -d {q(build_prefix(cfg) + '-XXXXXX')})\"",
        "chmod 0755 \"$build\"",
        "python3 -m venv \"$build\"",
        '"$build/bin/pip" ' + shlex.join(pip_install_args(cfg)),
        f"printf '%s\\n' {wanted} > \"$build/{INSTALLED_MARKER}\"",
        f"ln -sfn \"$build\" {q(venv + '.new')}",
        f"previous=\"$(readlink {q(venv)} || true)\"",
        f"if [ -d {q(venv)} ] && [ ! -L {q(venv)} ]; then mv -T {q(venv)} {q(venv + '.old')}; fi",
        f"mv -T {q(venv + '.new')} {q(venv)}",
        f"rm -rf {q(venv + '.old')}",
        # The previous build stays until the next install: replicas still running from it restart later
        # in this deploy, and it is there to roll back to. Unfinished builds go.
        f"for old in {q(VLLM_ROOT)}/.build-{q(cfg.vllm_version)}-*; do"
        " case \"$old\" in \"$build\"|\"$previous\") ;; *) rm -rf \"$old\";; esac; done",
    ])
