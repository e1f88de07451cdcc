"""Role ``vllm``: install vLLM, stage the model, and run every replica the plan gives this node.

``vllm_install()`` — system user ``vllm``; a virtualenv per version, built in its own directory
``/opt/vllm/.build-<version>-<digest>`` and then swapped in as the link ``/opt/vllm/<version>`` (from an
index, a wheelhouse and/or a hash-pinned lock); the model staged before any replica starts, in the
root-owned ``/var/lib/gpufleet/models/`` (pushed from the controller, or downloaded on the node at a pinned
revision into a temporary directory moved into place when complete); the templated unit
``vllm@.service``; per replica ``/etc/gpufleet/vllm/<replica>/`` with ``config.yaml`` (``--config``),
``vllm.env`` and a ``venv`` link, and the API key and hub token in ``/etc/gpufleet/secrets/<replica>.env``
(0600, root); replicas this node no longer runs are stopped and removed. The vllm user owns nothing of it:
only ``/var/lib/vllm`` (its home and caches).

``vllm_serve()`` — starts each replica (``vllm_start``), restarts one only when its files changed on
any of its nodes, and waits on its first node for ``/health`` and one real completion. A restart the
deploy decided on is first recorded on every node of the replica (``restart-pending`` in its directory)
and cleared only once the replica serves again, so a run interrupted in between restarts it next time
(and ``deploys/check.py`` reports it as drift).

Variables: roles/vllm/defaults.yml. The layout comes from the plan (``gpufleet.deploy.context``).
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from io import StringIO
from pathlib import Path

from pyinfra import host
from pyinfra.api.deploy import deploy
from pyinfra.api.operation import OperationMeta
from pyinfra.context import state
from pyinfra.facts.files import File, FileContents, FindDirectories
from pyinfra.operations import apt, files, server, systemd

from gpufleet.config.problems import ConfigError, Problem, exit_with
from gpufleet.deploy import access
from gpufleet.deploy import vllm_files as vf
from gpufleet.deploy.context import assignments, host_config
from gpufleet.deploy.secret_ops import secret_file
from gpufleet.netaddr import host_port
from gpufleet.node.health_rules import policy_json
from gpufleet.plan.commands import VLLM_ROOT, NodeRole, Process
from gpufleet.systemd_text import env_file

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = ROOT / "templates" / "vllm"
NODE_TOOLS = "/opt/gpufleet/node"
GATE_POLICY = "/etc/gpufleet/gpu-health.json"
SECRETS_DIR = "/etc/gpufleet/secrets"

# Per deploy: replica name -> the operations on any of its nodes whose change means "restart it".
_CHANGES_KEY = "_gpufleet_vllm_changes"
# Per deploy: replica name -> True when any of its nodes held a restart-pending marker before this run.
_PENDING_KEY = "_gpufleet_vllm_pending"
# Per deploy: replica name -> the readiness wait on its first node.
_READY_KEY = "_gpufleet_vllm_ready"


def _registry(key: str) -> dict:
    """A mapping kept on pyinfra's state for this deploy, shared by every host's operations."""
    registry = getattr(state, key, None)
    if registry is None:
        registry = {}
        setattr(state, key, registry)
    return registry


def _replica_changes() -> dict[str, list[OperationMeta]]:
    return _registry(_CHANGES_KEY)


def _changed(metas: list[OperationMeta]) -> Callable[[], bool]:
    def check() -> bool:
        return any(m.is_complete() and m.did_change() for m in metas)
    return check


def restart_marker(replica: str) -> str:
    """Present on a node while a restart of ``replica`` that a deploy decided on has not been completed."""
    return f"{vf.replica_dir(replica)}/restart-pending"


def pending_restarts() -> list[str]:
    """This node's replicas whose restart-pending marker is present (drift: an interrupted restart)."""
    return [replica.name for replica, role in assignments()
            if _vllm_process(role) is not None and host.get_fact(File, path=restart_marker(replica.name))]


def _restart_due(replica: str) -> Callable[[], bool]:
    changed = _changed(_replica_changes().get(replica, []))
    pending = _registry(_PENDING_KEY)
    return lambda: bool(pending.get(replica)) or changed()


def _served(replica: str) -> Callable[[], bool]:
    """Whether the replica's readiness wait ran in this deploy and succeeded."""
    def check() -> bool:
        wait = _registry(_READY_KEY).get(replica)
        return wait is not None and wait.is_complete() and wait.executed and wait.did_succeed()
    return check


def _vllm_process(role: NodeRole) -> Process | None:
    """The node's vLLM process in a replica; None on a Ray worker, which runs none of its own."""
    return next((p for p in role.processes if p.unit == "vllm"), None)


def _secret_path(replica: str) -> str:
    return f"{SECRETS_DIR}/{replica}.env"


def unit_values(allowed: list[str] | None = None) -> dict[str, str]:
    """What templates/vllm/vllm@.service.j2 is rendered with: fixed paths, and who may connect (``allowed``,
    from :func:`gpufleet.deploy.access.vllm_sources`; None: anyone)."""
    return {"etc": vf.ETC, "node_tools": NODE_TOOLS, "gate_policy": GATE_POLICY, "home": vf.HOME,
            "secrets_dir": SECRETS_DIR, "ip_access": access.unit_lines(allowed)}


def _install_venv() -> OperationMeta:
    cfg = host_config()
    try:
        pip_secret = vf.pip_secret_env(cfg)
    except ConfigError as error:
        exit_with(error)
    if pip_secret:
        secret_file(name="Write the pip index credentials (0600)", dest=vf.PIP_SECRET,
                    content=env_file(pip_secret, "pip index with credentials, read by the vLLM install"))
    else:
        files.file(name="No pip index credentials", path=vf.PIP_SECRET, present=False)
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
        if not vf.below_models(target):  # validation checks it too; never delete elsewhere
            exit_with(ConfigError([Problem(host.name, "vllm_model", f"expected a path strictly below {vf.MODELS}/"
                                                                    f" to push vllm_model_source to, found {target!r}")]))
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
    done = host.get_fact(FileContents, path=f"{target}/{vf.REVISION_MARKER}")
    if "\n".join(done or []).strip() == revision:
        return None
    return server.shell(
        name=f"Download {cfg.vllm_model} at {revision} into {target}",
        commands=[vf.download_script(cfg, _secret_path("hub"))],
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

    apt.packages(name="Ensure the system packages vLLM needs", update=False,  # pyinfra pastes names unquoted
                 packages=[shlex.quote(package) for package in cfg.vllm_system_packages])
    server.group(name="Create group vllm", group="vllm", system=True)
    server.user(name="Create system user vllm", user="vllm", group="vllm", system=True,
                home=vf.HOME, shell="/usr/sbin/nologin", create_home=False)
    files.directory(name=f"Create {VLLM_ROOT}", path=VLLM_ROOT, user="root", group="root", mode="0755")
    files.directory(name=f"Create {SECRETS_DIR} (root only)", path=SECRETS_DIR,
                    user="root", group="root", mode="0700")
    venv = _install_venv()
    if not cfg.vllm_model.startswith("/") and cfg.vllm_hf_token:
        secret_file(name="Write the hub token (0600)", dest=_secret_path("hub"),
                    content=env_file({"HF_TOKEN": secrets["HF_TOKEN"]}, "hub token for model downloads"))
    files.directory(name=f"Create {vf.MODELS} (root only writes)", path=vf.MODELS,
                    user="root", group="root", mode="0755")
    model = _stage_model()

    try:  # the API and the mp rendezvous: this node, its replicas' nodes, monitoring, vllm_api_allowed_from
        allowed = access.vllm_sources(cfg, cfg.fleet_address or host.name,
                                      [node.address for replica, _ in mine for node in replica.roles],
                                      access.monitoring_group())
    except ConfigError as error:
        exit_with(error)
    unit = files.template(
        name="Install the vllm@.service template unit",
        src=str(TEMPLATES / "vllm@.service.j2"), dest=f"/etc/systemd/system/{vf.UNIT_TEMPLATE}",
        user="root", group="root", mode="0644", **unit_values(allowed),
    )
    gate = files.put(
        name=f"Write the GPU health gate policy {GATE_POLICY}",
        src=StringIO(policy_json(cfg.gpu_health)), dest=GATE_POLICY, user="root", group="root", mode="0644",
    )
    files.directory(name=f"Create {vf.ETC}", path=vf.ETC, user="root", group="root", mode="0755")

    changes = _replica_changes()
    pending = _registry(_PENDING_KEY)
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
            src=StringIO(env_file(vf.replica_env(cfg, process.env),
                                     f"Written by gpufleet: environment of replica {replica.name} (no secrets)")),
            dest=f"{directory}/vllm.env", user="root", group="root", mode="0644"))
        ops.append(files.link(
            name=f"{replica.name}: point its venv at vLLM {cfg.vllm_version}", path=f"{directory}/venv",
            target=vf.venv_dir(cfg), user="root", group="root"))
        if secrets:
            ops.append(secret_file(name=f"{replica.name}: write its secrets (0600)", dest=_secret_path(replica.name),
                                   content=env_file(secrets, f"secrets of replica {replica.name}")))
        else:
            ops.append(files.file(name=f"{replica.name}: no secrets file", path=_secret_path(replica.name),
                                  present=False))
        changes.setdefault(replica.name, []).extend(ops + shared)
        if host.get_fact(File, path=restart_marker(replica.name)):
            pending[replica.name] = True
        # Recorded before any node stops it: a run interrupted from here on still restarts it next time.
        files.file(name=f"{replica.name}: record that it must restart", path=restart_marker(replica.name),
                   user="root", group="root", mode="0644", _if=_changed(changes[replica.name]))

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
    for replica, role in assignments():
        if _vllm_process(role) is None:
            continue
        unit = vf.unit_name(replica.name)
        if not cfg.vllm_start:
            systemd.service(name=f"{replica.name}: leave stopped (vllm_start false)", service=unit,
                            running=False, enabled=False)
            files.file(name=f"{replica.name}: stopped, so no restart is due", path=restart_marker(replica.name),
                       present=False)
            continue
        # Stop every node's process of a changed replica before any starts again: an mp rank that
        # joined the old rank 0 would wait for it forever. Operations run on all hosts before the next.
        systemd.service(
            name=f"{replica.name}: stop {unit} (its configuration changed on one of its nodes)", service=unit,
            running=False, _if=_restart_due(replica.name))
        started = systemd.service(name=f"{replica.name}: start {unit}", service=unit, running=True, enabled=True)
        if role.host == replica.nodes[0]:  # the first node serves the API; the others are ranks or Ray workers
            url = f"http://{host_port(role.address, replica.port)}"
            _registry(_READY_KEY)[replica.name] = server.shell(
                name=f"{replica.name}: wait for /health and one real completion on {url}",
                commands=[ready_command(cfg.vllm_served_model_name or cfg.vllm_model, url, unit,
                                        _secret_path(replica.name) if replica.secret_env else None,
                                        cfg.vllm_ready_timeout)],
                _if=started.did_change,
            )
        files.file(name=f"{replica.name}: restarted and serving, clear its restart record",
                   path=restart_marker(replica.name), present=False, _if=_served(replica.name))


def ready_command(served: str, url: str, unit: str, secrets: str | None, timeout: int) -> str:
    """The readiness check's shell line on the first node, every argument quoted for the shell."""
    argv = ["python3", f"{NODE_TOOLS}/vllm_ready.py", "--url", url, "--model", served, "--unit", unit]
    if secrets:
        argv += ["--env-file", secrets]
    return shlex.join([*argv, "--timeout", str(timeout)])


def vllm() -> None:
    """Install, configure and serve."""
    vllm_install()
    vllm_serve()
