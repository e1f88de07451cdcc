"""Role ``vllm``: install vLLM, stage the model, and run every replica the plan gives this node.

``vllm_install()`` — system user ``vllm``; a virtualenv per version in ``/opt/vllm/<version>`` (from an
index, a wheelhouse and/or a hash-pinned lock); the model staged before any replica starts (pushed from
the controller, or downloaded on the node at a pinned revision); the templated unit ``vllm@.service``;
per replica ``/etc/gpufleet/vllm/<replica>/`` with ``config.yaml`` (``--config``), ``vllm.env`` and a
``venv`` link, and the API key and hub token in ``/etc/gpufleet/secrets/<replica>.env`` (0600, root);
replicas this node no longer runs are stopped and removed.

``vllm_serve()`` — starts each replica (``vllm_start``), restarts one only when its files changed on
any of its nodes, and waits on its first node for ``/health`` and one real completion.

Variables: roles/vllm/defaults.yml. The layout comes from the plan (``gpufleet.deploy.context``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from io import StringIO
from pathlib import Path

from pyinfra import host
from pyinfra.api.deploy import deploy
from pyinfra.api.operation import OperationMeta
from pyinfra.context import state
from pyinfra.facts.files import FileContents, FindDirectories
from pyinfra.operations import apt, files, server, systemd

from gpufleet.config.problems import ConfigError, exit_with
from gpufleet.deploy import vllm_files as vf
from gpufleet.deploy.context import assignments, host_config
from gpufleet.deploy.secret_ops import secret_file
from gpufleet.node.health_rules import policy_json
from gpufleet.plan.commands import VLLM_ROOT, NodeRole, Process

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = ROOT / "templates" / "vllm"
NODE_TOOLS = "/opt/gpufleet/node"
GATE_POLICY = "/etc/gpufleet/gpu-health.json"
SECRETS_DIR = "/etc/gpufleet/secrets"

# Per deploy: replica name -> the operations on any of its nodes whose change means "restart it".
_CHANGES_KEY = "_gpufleet_vllm_changes"


def _replica_changes() -> dict[str, list[OperationMeta]]:
    registry = getattr(state, _CHANGES_KEY, None)
    if registry is None:
        registry = {}
        setattr(state, _CHANGES_KEY, registry)
    return registry


def _changed(metas: list[OperationMeta]) -> Callable[[], bool]:
    def check() -> bool:
        return any(m.is_complete() and m.did_change() for m in metas)
    return check


def _vllm_process(role: NodeRole) -> Process | None:
    """The node's vLLM process in a replica; None on a Ray worker, which runs none of its own."""
    return next((p for p in role.processes if p.unit == "vllm"), None)


def _secret_path(replica: str) -> str:
    return f"{SECRETS_DIR}/{replica}.env"


def _install_venv() -> OperationMeta:
    cfg = host_config()
    marker = host.get_fact(FileContents, path=f"{vf.venv_dir(cfg)}/{vf.INSTALLED_MARKER}")
    installed = "\n".join(marker or []).strip() == vf.install_marker(cfg)
    return server.shell(
        name=f"Install vLLM {cfg.vllm_version} into {vf.venv_dir(cfg)}",
        commands=[] if installed else [vf.install_script(cfg)],
    )


def _stage_model() -> OperationMeta | None:
    cfg = host_config()
    target = vf.model_dir(cfg)
    if cfg.vllm_model_source:
        files.directory(name=f"Create {Path(target).parent}", path=str(Path(target).parent),
                        user="root", group="root", mode="0755")
        return files.sync(
            name=f"Push the model from the controller to {target}",
            src=cfg.vllm_model_source, dest=target, user="root", group="root", mode="0644", dir_mode="0755",
            delete=True,
        )
    if cfg.vllm_model.startswith("/"):
        return None  # an absolute path the site provides: nothing to stage
    revision = cfg.vllm_model_revision or "main"
    done = host.get_fact(FileContents, path=f"{target}/.gpufleet-revision")
    if "\n".join(done or []).strip() == revision:
        return None
    secrets = _secret_path("hub")
    hf = f"{vf.venv_dir(cfg)}/bin/hf"
    return server.shell(
        name=f"Download {cfg.vllm_model} at {revision} into {target}",
        commands=[
            f"mkdir -p {target} && (set -a; [ -f {secrets} ] && . {secrets}; set +a;"
            f" {hf} download {cfg.vllm_model} --revision {revision} --local-dir {target})"
            f" && echo {revision} > {target}/.gpufleet-revision",
        ],
    )


@deploy("vLLM: install and configure the replicas")
def vllm_install() -> None:
    """Everything a replica needs on this node, without starting or restarting anything."""
    cfg = host_config()
    mine = assignments()
    try:
        secrets = vf.secret_env(cfg)
    except ConfigError as error:
        exit_with(error)

    apt.packages(name="Ensure the system packages vLLM needs", packages=cfg.vllm_system_packages, update=False)
    server.group(name="Create group vllm", group="vllm", system=True)
    server.user(name="Create system user vllm", user="vllm", group="vllm", system=True,
                home=vf.HOME, shell="/usr/sbin/nologin", create_home=False)
    files.directory(name=f"Create {VLLM_ROOT}", path=VLLM_ROOT, user="root", group="root", mode="0755")
    venv = _install_venv()
    if not cfg.vllm_model.startswith("/") and cfg.vllm_hf_token:
        files.directory(name=f"Create {SECRETS_DIR} (root only)", path=SECRETS_DIR,
                        user="root", group="root", mode="0700")
        secret_file(name="Write the hub token (0600)", dest=_secret_path("hub"),
                    content=vf.env_file({"HF_TOKEN": secrets["HF_TOKEN"]}, "hub token for model downloads"))
    model = _stage_model()

    unit = files.template(
        name="Install the vllm@.service template unit",
        src=str(TEMPLATES / "vllm@.service.j2"), dest=f"/etc/systemd/system/{vf.UNIT_TEMPLATE}",
        user="root", group="root", mode="0644",
        etc=vf.ETC, node_tools=NODE_TOOLS, gate_policy=GATE_POLICY, home=vf.HOME, secrets_dir=SECRETS_DIR,
    )
    gate = files.put(
        name=f"Write the GPU health gate policy {GATE_POLICY}",
        src=StringIO(policy_json(cfg.gpu_health)), dest=GATE_POLICY, user="root", group="root", mode="0644",
    )
    files.directory(name=f"Create {vf.ETC}", path=vf.ETC, user="root", group="root", mode="0755")
    files.directory(name=f"Create {SECRETS_DIR} (root only)", path=SECRETS_DIR,
                    user="root", group="root", mode="0700")

    changes = _replica_changes()
    shared = [m for m in (venv, model, unit, gate) if m is not None]
    for replica, role in mine:
        process = _vllm_process(role)
        if process is None:
            continue
        model_arg, config = vf.serve_config(process.argv)
        directory = vf.replica_dir(replica.name)
        ops = [files.directory(name=f"{replica.name}: create {directory}", path=directory,
                               user="root", group="root", mode="0755")]
        ops.append(files.put(
            name=f"{replica.name}: write config.yaml", src=StringIO(vf.config_yaml(config)),
            dest=f"{directory}/config.yaml", user="root", group="root", mode="0644"))
        ops.append(files.put(
            name=f"{replica.name}: write vllm.env",
            src=StringIO(vf.env_file(vf.replica_env(cfg, process.env),
                                     f"Written by gpufleet: environment of replica {replica.name} (no secrets)")),
            dest=f"{directory}/vllm.env", user="root", group="root", mode="0644"))
        ops.append(files.link(
            name=f"{replica.name}: point its venv at vLLM {cfg.vllm_version}", path=f"{directory}/venv",
            target=vf.venv_dir(cfg), user="root", group="root"))
        if secrets:
            ops.append(secret_file(name=f"{replica.name}: write its secrets (0600)", dest=_secret_path(replica.name),
                                   content=vf.env_file(secrets, f"secrets of replica {replica.name}")))
        else:
            ops.append(files.file(name=f"{replica.name}: no secrets file", path=_secret_path(replica.name),
                                  present=False))
        changes.setdefault(replica.name, []).extend(ops + shared)

    planned = {replica.name for replica, role in mine if _vllm_process(role)}
    present = host.get_fact(FindDirectories, path=vf.ETC, maxdepth=1) or []
    for stale in sorted(Path(p).name for p in present if p.rstrip("/") != vf.ETC):
        if stale in planned:
            continue
        systemd.service(name=f"Stop replica {stale}, no longer planned here", service=vf.unit_name(stale),
                        running=False, enabled=False)
        files.directory(name=f"Remove {vf.replica_dir(stale)}", path=vf.replica_dir(stale), present=False)
        files.file(name=f"Remove the secrets of {stale}", path=_secret_path(stale), present=False)
    systemd.daemon_reload(name="Reload systemd after the unit changed", _if=unit.did_change)


@deploy("vLLM: start the replicas and wait until they serve")
def vllm_serve() -> None:
    """Start this node's replicas; restart one (all its nodes) only when its files changed on any of them."""
    cfg = host_config()
    changes = _replica_changes()
    for replica, role in assignments():
        if _vllm_process(role) is None:
            continue
        unit = vf.unit_name(replica.name)
        if not cfg.vllm_start:
            systemd.service(name=f"{replica.name}: leave stopped (vllm_start false)", service=unit,
                            running=False, enabled=False)
            continue
        # Stop every node's process of a changed replica before any starts again: an mp rank that
        # joined the old rank 0 would wait for it forever. Operations run on all hosts before the next.
        systemd.service(
            name=f"{replica.name}: stop {unit} (its configuration changed on one of its nodes)", service=unit,
            running=False, _if=_changed(changes.get(replica.name, [])))
        started = systemd.service(name=f"{replica.name}: start {unit}", service=unit, running=True, enabled=True)
        if role.host != replica.nodes[0]:
            continue  # the first node serves the API; the others are headless ranks or Ray workers
        port = replica.port
        url = f"http://{role.address}:{port}"
        secrets_arg = f" --env-file {_secret_path(replica.name)}" if replica.secret_env else ""
        served = cfg.vllm_served_model_name or cfg.vllm_model
        server.shell(
            name=f"{replica.name}: wait for /health and one real completion on {url}",
            commands=[f"python3 {NODE_TOOLS}/vllm_ready.py --url {url} --model {json.dumps(served)}"
                      f" --unit {unit}{secrets_arg} --timeout {cfg.vllm_ready_timeout}"],
            _if=started.did_change,
        )


def vllm() -> None:
    """Install, configure and serve."""
    vllm_install()
    vllm_serve()
