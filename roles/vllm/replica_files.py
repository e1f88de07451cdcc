"""What the vllm role writes on a node for each replica, computed on the controller from the plan.

- ``config.yaml``: every ``vllm serve`` flag of the replica's process (``Process.config_yaml``), passed as
  ``--config PATH``;
- ``vllm.env``: its plain environment (the model's path, VLLM_HOST_IP, the GPU set, NCCL/GLOO interface, and
  with ``cuda_toolkit`` CUDA_HOME and PATH);
- ``secrets.env``: VLLM_API_KEY and HF_TOKEN, read here from the controller's references, 0600 root;
- ``watchdog.json`` (on the replica's first node): what its watchdog watches and how long it waits;

and the shell the role runs as root on a node (installing vLLM, downloading the model), every value in it
quoted with ``shlex.quote`` and no secret in its text.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import shlex
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

from gpufleet.config.lora_files import adapter_env
from gpufleet.config.schema import HostConfig
from gpufleet.config.secrets import read_secret as _read_secret
from gpufleet.digest import file_sha256
from gpufleet.node_paths import (
    INSTALLED_MARKER,
    MODELS_DIR,
    PIP_SECRET,
    PYCACHE_DIR,
    REVISION_MARKER,
    UNIT_DEFAULT_PATH,
    UV_CACHE_DIR,
    UV_ROOT,
    VLLM_CACHE_DIR,
    VLLM_HOME,
    VLLM_ROOT,
    cuda_home,
)
from gpufleet.operations.files import local_tree
from gpufleet.units.escape import env_file  # noqa: F401  (re-exported: what roles write with vf.env_file)
from gpufleet.values.types import SecretRef

INSTALL_LOCK_TIMEOUT = 1800  # seconds a second install of one version waits for the first


def venv_dir(cfg: HostConfig) -> str:
    """One virtualenv per vLLM version, so an upgrade can switch and roll back."""
    return f"{VLLM_ROOT}/{cfg.vllm_version}"  # node_paths.venv_dir, by a name the tests can point elsewhere


def model_dir(cfg: HostConfig) -> str:
    """Where the model lives on the node: ``vllm_model`` itself when it is a path, else below MODELS_DIR."""
    if cfg.checkpoint().startswith("/"):
        return cfg.checkpoint()
    return f"{MODELS_DIR}/{cfg.checkpoint().replace('/', '--')}"


def below_models(path: str) -> bool:
    """Whether ``path`` lies strictly below MODELS_DIR (normalised, no ``..``): the only place the role deletes in."""
    return posixpath.normpath(path) == path and path.startswith(MODELS_DIR + "/") and ".." not in path.split("/")


def model_identity(cfg: HostConfig) -> str | None:
    """What names the model a node serves, to compare a replica's nodes: a digest of the files pushed from
    ``vllm_model_source`` (their relative names and SHA-256, the digests the push compares, taken once per run),
    or the hub id at the revision the node downloads; None for a path the site provides (the node reports a
    digest of its file names and sizes instead: :class:`gpufleet.facts.vllm.ReplicaStack`)."""
    if cfg.vllm_model_source:
        _, found = local_tree(cfg.vllm_model_source)
        manifest = "".join(f"{relative}\t{file_sha256(path)}\n" for relative, path in found.items())
        return f"pushed files sha256:{hashlib.sha256(manifest.encode()).hexdigest()[:16]}"
    if cfg.checkpoint().startswith("/"):
        return None
    return f"{cfg.checkpoint()}@{cfg.vllm_model_revision or 'main'}"


def download_script(cfg: HostConfig, token_file: str) -> str:
    """Shell (run as root) that downloads the hub model at its revision into a temporary directory beside the
    target, writes the revision marker, and only then moves it into place; the hub token is read from its 0600
    file, never from this text. An interrupted download leaves the previous copy and no marker change."""
    target = model_dir(cfg)
    if not below_models(target):
        raise ValueError(f"expected the model directory below {MODELS_DIR}/, found {target!r}")
    revision = cfg.vllm_model_revision or "main"
    q = shlex.quote
    hf = q(f"{venv_dir(cfg)}/bin/hf")
    return "; ".join([
        "set -eu",
        "umask 022",
        f"tmp=\"$(mktemp -d {q(target + '.download-XXXXXX')})\"",
        "trap 'rm -rf \"$tmp\" \"$tmp.old\"' EXIT",
        f"if [ -f {q(token_file)} ]; then set -a; . {q(token_file)}; set +a; fi",
        f"{hf} download {q(cfg.checkpoint())} --revision {q(revision)} --local-dir \"$tmp\" >/dev/null",
        f"printf '%s\\n' {q(revision)} > \"$tmp/{REVISION_MARKER}\"",
        "chmod 0755 \"$tmp\"",
        f"if [ -e {q(target)} ]; then mv -T {q(target)} \"$tmp.old\"; fi",
        f"mv -T \"$tmp\" {q(target)}",
    ])


def process_env(cfg: HostConfig) -> dict[str, str]:
    """What every process run as the vllm user from the virtualenv gets (vLLM, Ray): its home; vLLM's caches in a
    directory of the release's own (``VLLM_CACHE_ROOT``): vLLM keeps one record per model class there, keyed on the
    release's model code, and a single directory would make every switch of release (an upgrade, then its
    rollback) inspect the model again in a subprocess (seconds of imports on the replica's way back); and, when the
    install compiled no bytecode, a bytecode cache of its own (``PYTHONPYCACHEPREFIX``): the first start on a
    node compiles what it imports there, later starts read it (the virtualenv stays read-only to that user).

    With ``cuda_toolkit``, the toolkit's ``CUDA_HOME`` and a ``PATH`` (systemd expands nothing there, so it is
    written whole) that finds its ``nvcc`` first, then the virtualenv's programs (FlashInfer's just-in-time
    kernels also run ``ninja`` from PATH), then the PATH systemd gives a unit that sets none."""
    env = {"HOME": VLLM_HOME, "VLLM_CACHE_ROOT": f"{VLLM_CACHE_DIR}/{cfg.vllm_version}"}
    if not cfg.vllm_compile_bytecode:
        env["PYTHONPYCACHEPREFIX"] = PYCACHE_DIR
    if cfg.cuda_toolkit:
        toolkit = cuda_home(cfg.cuda_version)
        env["CUDA_HOME"] = toolkit
        env["PATH"] = f"{toolkit}/bin:{venv_dir(cfg)}/bin:{UNIT_DEFAULT_PATH}"
    return env


def replica_env(cfg: HostConfig, plan_env: dict[str, str], adapters: str | None = None) -> dict[str, str]:
    """The plain environment of a replica's vLLM process on one node; ``adapters``: the directory its LoRA adapters
    are resolved from, when the pool declares some."""
    env = {"VLLM_MODEL": model_dir(cfg), **process_env(cfg), "HF_HOME": f"{VLLM_HOME}/hf"}
    if not cfg.vllm_downloads():
        env["HF_HUB_OFFLINE"] = "1"  # staged weights (pushed, downloaded by the deploy, or the site's path)
    if adapters is not None and cfg.vllm_lora_adapters:
        env.update(adapter_env(adapters))
    env.update(cfg.vllm_env)
    env.update(plan_env)  # the plan's GPU set, address and interfaces are not the operator's to override
    return env


STOP_MARGIN_S = 45
"""Seconds a stopping replica gets beyond ``vllm_shutdown_timeout_s`` before it is killed (the unit's
TimeoutStopSec); replica_rank.py kills vLLM 15 s before that."""


def stop_timeout_s(cfg: HostConfig) -> int:
    """The vLLM unit's TimeoutStopSec: the drain time and a margin for vLLM to exit."""
    return cfg.vllm_shutdown_timeout_s + STOP_MARGIN_S


def ranks_json(rank: int, addresses: list[str], port: int, stop_grace_s: int = STOP_MARGIN_S - 15,
               fabric: dict[str, object] | None = None) -> str:
    """``ranks.json`` of a replica's rank on the node at ``addresses[rank]`` (the replica's nodes in rank order),
    what replica_rank.py reads: one node runs vLLM alone; several are bound together through rank 0 at
    ``port``, and a stopped rank gives vLLM ``stop_grace_s`` to drain before it kills it; with ``fabric``
    (:func:`fabric_check`), the replica's fabric check runs before each generation."""
    if len(addresses) == 1:
        return json.dumps({"rank": 0, "nodes": 1}) + "\n"
    found: dict[str, object] = {"rank": rank, "nodes": len(addresses), "leader": addresses[0], "port": port,
                                "bind": addresses[rank], "stop_grace_s": stop_grace_s}
    if fabric:
        found["fabric"] = fabric
    return json.dumps(found) + "\n"


FABRIC_BYTES = 8 * 1024**2  # each way out, and each all-reduce: enough to time a link, little to wait for


def fabric_check(cfg: HostConfig) -> dict[str, object] | None:
    """The fabric check of a multi-node replica's ranks (``node_fabric_*``), None when it is off: gloo on the CPU
    build, NCCL on GPUs, on ``fleet_interface``."""
    if not (cfg.node_lifecycle_enabled and cfg.node_fabric_check):
        return None
    return {"port": cfg.node_fabric_port, "backend": "gloo" if cfg.vllm_platform == "cpu" else "nccl",
            "iface": cfg.fleet_interface or "", "bytes": FABRIC_BYTES, "floor_gbps": cfg.node_fabric_floor_gbps,
            "timeout_s": cfg.node_fabric_timeout_s}


WATCHDOG_INTERVAL_S = 5  # how often the watchdog looks at /health and /metrics


def watchdog_json(cfg: HostConfig, replica: str, url: str) -> str:
    """``watchdog.json`` of a replica on its first node, what replica_watchdog.py reads: the unit it restarts,
    the API it watches and asks one completion of, and its times (``vllm_watchdog_stall_s``, and
    ``vllm_ready_timeout`` to serve after a start)."""
    return json.dumps({"unit": f"vllm@{replica}.service", "url": url,
                       "model": cfg.served_model_name(), "stall_s": cfg.vllm_watchdog_stall_s,
                       "grace_s": cfg.vllm_ready_timeout, "interval_s": WATCHDOG_INTERVAL_S}) + "\n"


def api_key(ref: SecretRef | None) -> str | None:
    """The replicas' API key from the controller's reference ``ref`` (their ``vllm_api_key``; raises ConfigError
    naming the key); None without one."""
    return _read_secret(ref, "vllm_api_key") if ref is not None else None


def hub_token(cfg: HostConfig) -> str | None:
    """The hub token from the controller's reference (raises ConfigError naming the key); None without."""
    return _read_secret(cfg.vllm_hf_token, "vllm_hf_token") if cfg.vllm_hf_token else None


def secret_env(cfg: HostConfig) -> dict[str, str]:
    """VLLM_API_KEY, HF_TOKEN when vLLM itself downloads (:meth:`HostConfig.vllm_downloads`: the deploy stages
    the served model with the token as root, and vLLM never sees it otherwise) and, with the ray backend,
    RAY_AUTH_TOKEN, from the controller's references (raises ConfigError naming the key)."""
    found: dict[str, str] = {}
    if cfg.vllm_api_key:
        found["VLLM_API_KEY"] = str(api_key(cfg.vllm_api_key))
    if (token := hub_token(cfg)) is not None and cfg.vllm_downloads():
        found["HF_TOKEN"] = token
    if cfg.vllm_distributed_backend == "ray" and cfg.ray_auth_token:
        found["RAY_AUTH_TOKEN"] = _read_secret(cfg.ray_auth_token, "ray_auth_token")
    return found


def pip_secret_env(cfg: HostConfig) -> dict[str, str]:
    """The index URL with ``vllm_pip_index_credentials`` (``user:password`` or a token) in it, for the install's
    0600 environment file: ``PIP_INDEX_URL`` for pip, ``UV_DEFAULT_INDEX`` for uv; empty when the index needs
    none (or a wheelhouse replaces it)."""
    url = cfg.vllm_pip_index_url
    if cfg.vllm_wheelhouse_url or not url or cfg.vllm_pip_index_credentials is None:
        return {}
    user, sep, password = _read_secret(cfg.vllm_pip_index_credentials, "vllm_pip_index_credentials").partition(":")
    userinfo = quote(user, safe="") + (":" + quote(password, safe="") if sep else "")
    parts = urlsplit(url)
    secret_url = urlunsplit(parts._replace(netloc=f"{userinfo}@{parts.netloc}"))
    return {"PIP_INDEX_URL": secret_url, "UV_DEFAULT_INDEX": secret_url}


def _sources(cfg: HostConfig, index_flag: str, insecure_flag: str) -> list[str]:
    """Where the installer finds packages: a wheelhouse alone, or an index named here when it needs no
    credentials; each plain-HTTP host of the wheelhouse, index and lock (a site's mirror; pins carry the hashes)
    marked as such."""
    args: list[str] = []
    if cfg.vllm_wheelhouse_url:
        args += ["--no-index", "--find-links", cfg.vllm_wheelhouse_url]
    elif cfg.vllm_pip_index_url and cfg.vllm_pip_index_credentials is None:
        args += [index_flag, cfg.vllm_pip_index_url]
    hosts: list[str] = []
    for url in (cfg.vllm_wheelhouse_url, cfg.vllm_pip_index_url, cfg.requirements_url()):
        parsed = urlsplit(url or "")
        if parsed.scheme == "http" and parsed.hostname and parsed.hostname not in hosts:
            hosts.append(parsed.hostname)
    return args + [a for host in hosts for a in (insecure_flag, host)]


def _requirements(cfg: HostConfig) -> list[str]:
    if lock := cfg.requirements_url():
        return ["--no-deps", "--require-hashes", "-r", lock]
    return [f"{cfg.vllm_package}=={cfg.vllm_version}", f"ray=={cfg.ray_version}", "nvidia-ml-py"]


_PIP_INSTALL = ["install", "--quiet", "--disable-pip-version-check", "--no-input"]


def pip_install_args(cfg: HostConfig) -> list[str]:
    """``pip install`` arguments for the node's virtualenv: from a wheelhouse, an index, and/or a hash lock. The
    install marker records them whichever installer runs (the same sources and pins install the same packages).

    An index URL with credentials is not among them: pip reads it from PIP_INDEX_URL (:func:`pip_secret_env`).
    """
    no_compile = [] if cfg.vllm_compile_bytecode else ["--no-compile"]
    return [*_PIP_INSTALL, *no_compile, *_sources(cfg, "--index-url", "--trusted-host"), *_requirements(cfg)]


def uv_install_args(cfg: HostConfig) -> list[str]:
    """``uv pip install --python BUILD/bin/python`` arguments: :func:`pip_install_args` in uv's words, with uv's
    cache on the node (builds hardlink from it), bytecode compiled as pip does unless ``vllm_compile_bytecode``
    is false (the virtualenv is read-only to the vllm user, which would otherwise compile every module it
    imports at each start) and TLS checked against the system's certificates as Debian's pip does. An index
    with credentials comes from UV_DEFAULT_INDEX."""
    compile_bytecode = ["--compile-bytecode"] if cfg.vllm_compile_bytecode else []
    return ["--quiet", "--no-progress", "--system-certs", *compile_bytecode, "--cache-dir", UV_CACHE_DIR,
            *_sources(cfg, "--default-index", "--allow-insecure-host"), *_requirements(cfg)]


# Reads a hash lock (a URL or a path), failing with one line that names it when it cannot (no lock for this
# vllm_version there); given VERSION, prints its line (continued lines joined) that pins uv==VERSION, for pip to
# install uv by its hash, and fails naming the lock when there is none.
LOCK_SCRIPT = r"""
import re, sys, urllib.request
lock, version = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None
try:
    text = urllib.request.urlopen(lock, timeout=300).read().decode() if "://" in lock else open(lock).read()
except (OSError, ValueError) as exc:
    sys.exit(f"gpufleet: cannot read the requirements lock {lock}: {exc}")
if version is None:
    sys.exit(0)
for line in re.sub(r"\\\r?\n", " ", text).splitlines():
    pinned = re.match(r"\s*uv\s*==\s*([^\s;#]+)", line, re.IGNORECASE)
    if pinned and pinned[1] == version:
        print(line)
        sys.exit(0)
sys.exit(f"gpufleet: {lock} pins no uv=={version} (with its hash): add it, or set vllm_uv_version to null")
"""


def uv_bin(cfg: HostConfig) -> str:
    """The uv that installs this host's virtualenv: ``<UV_ROOT>/<vllm_uv_version>/bin/uv``."""
    return f"{UV_ROOT}/{cfg.vllm_uv_version}/bin/uv"


def _uv_bootstrap(cfg: HostConfig, version: str) -> list[str]:
    """Shell that installs uv once per node and version: pip puts it in a virtualenv of its own, from the same
    wheelhouse or index as vLLM (by the hash the lock pins, when there is a lock), built aside and swapped in
    with one rename, under a lock of its own (installs of several vLLM versions share it)."""
    q = shlex.quote
    home, lock = f"{UV_ROOT}/{version}", f"{UV_ROOT}/.lock"
    busy = (f"gpufleet: another install of uv {version} still holds {lock} after {INSTALL_LOCK_TIMEOUT} s;"
            " let it finish or end it, then run the deploy again")
    pip = '  "$uvbuild/bin/pip" ' + shlex.join([*_PIP_INSTALL, *_sources(cfg, "--index-url", "--trusted-host")])
    if requirements := cfg.requirements_url():
        pin = ['  python3 -c ' + q(LOCK_SCRIPT) + f' {q(requirements)} {q(version)}'
               ' > "$uvbuild/uv-pin.txt"']
        pip += ' --no-deps --require-hashes -r "$uvbuild/uv-pin.txt"'
    else:
        pin, pip = [], pip + " " + q(f"uv=={version}")
    return [
        f"mkdir -p {q(UV_ROOT)}",
        f"mkdir -p -m 0700 {q(UV_CACHE_DIR)}",  # the cache: root's alone
        f"exec 8>{q(lock)}",
        f"flock -w {INSTALL_LOCK_TIMEOUT} 8 || {{ echo {q(busy)} >&2; exit 1; }}",
        f"if [ ! -x {q(home + '/bin/uv')} ]; then",
        f"  rm -rf {q(UV_ROOT)}/.build-{q(version)}-*",  # unfinished attempts: none runs while we hold the lock
        f"  uvbuild=\"$(mktemp -d {q(f'{UV_ROOT}/.build-{version}-XXXXXX')})\"",
        "  chmod 0755 \"$uvbuild\"",
        "  python3 -m venv \"$uvbuild\"",
        *pin,
        pip,
        f"  ln -sfn \"$uvbuild\" {q(home + '.new')}",
        f"  mv -T {q(home + '.new')} {q(home)}",
        "fi",
        "exec 8>&-",
    ]


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
    (``flock``, with a timeout and a message saying what holds it). A lock the node cannot read (none for this
    ``vllm_version`` at that URL) stops it first, with one line. uv fills the virtualenv (installed first, once per
    node: :func:`_uv_bootstrap`); with ``vllm_uv_version`` null, pip does."""
    q = shlex.quote
    venv = venv_dir(cfg)
    marker = f"{venv}/{INSTALLED_MARKER}"
    lock = f"{VLLM_ROOT}/.{cfg.vllm_version}.lock"
    wanted = q(install_marker(cfg))
    busy = (f"gpufleet: another install of vLLM {cfg.vllm_version} still holds {lock} after"
            f" {INSTALL_LOCK_TIMEOUT} s; let it finish or end it, then run the deploy again")
    if cfg.vllm_uv_version:
        bootstrap, make_venv = _uv_bootstrap(cfg, cfg.vllm_uv_version), "python3 -m venv --without-pip \"$build\""
        fill = f"{q(uv_bin(cfg))} pip install --python \"$build/bin/python\" " + shlex.join(uv_install_args(cfg))
    else:
        bootstrap, make_venv = [], "python3 -m venv \"$build\""
        fill = '"$build/bin/pip" ' + shlex.join(pip_install_args(cfg))
    requirements = cfg.requirements_url()
    check_lock = [f"python3 -c {q(LOCK_SCRIPT)} {q(requirements)}"] if requirements else []
    return "\n".join([
        "set -eu",
        "umask 022",
        f"exec 9>{q(lock)}",
        f"flock -w {INSTALL_LOCK_TIMEOUT} 9 || {{ echo {q(busy)} >&2; exit 1; }}",
        f"if [ \"$(cat {q(marker)} 2>/dev/null)\" = {wanted} ]; then exit 0; fi",
        f"if [ -f {q(PIP_SECRET)} ]; then set -a; . {q(PIP_SECRET)}; set +a; fi",
        *check_lock,
        *bootstrap,
        f"build=\"$(mktemp -d {q(build_prefix(cfg) + '-XXXXXX')})\"",
        "chmod 0755 \"$build\"",
        make_venv,
        fill,
        "rm -f \"$build/.lock\"",  # uv's lock file, world-writable: nothing in the build may be writable by others
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
