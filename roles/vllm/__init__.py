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
from functools import partial
from pathlib import Path

from pyinfra.api.deploy import deploy
from pyinfra.api.operation import OperationMeta
from pyinfra.context import host

from gpufleet.config.problems import ConfigError, Problem, exit_with
from gpufleet.deploy import access
from gpufleet.deploy import vllm_files as vf
from gpufleet.deploy.context import DeployContext, assignments, context, host_config
from gpufleet.netaddr import host_port
from gpufleet.node.health_rules import policy_json
from gpufleet.node_paths import (
    GATE_POLICY,
    INSTALLED_MARKER,
    MODELS_DIR,
    NODE_TOOLS_DIR,
    PIP_SECRET,
    REVISION_MARKER,
    SECRETS_DIR,
    VLLM_ETC,
    VLLM_HOME,
    VLLM_ROOT,
    VLLM_UNIT_TEMPLATE,
    node_tool,
    replica_dir,
    replica_secrets,
    restart_marker,
    unit_path,
    venv_dir,
)
from gpufleet.operations import apt, files, node, server, systemd, vllm
from gpufleet.plan.commands import NodeRole, Process
from gpufleet.plan.planner import Replica
from gpufleet.systemd_text import env_file
from gpufleet.templates import render

HUB_SECRET = replica_secrets("hub")


def _vllm_process(role: NodeRole) -> Process | None:
    """The node's vLLM process in a replica; None on a Ray worker, which runs none of its own."""
    return next((p for p in role.processes if p.unit == "vllm"), None)


def _changed(metas: list[OperationMeta]) -> Callable[[], bool]:
    def check() -> bool:
        return any(m.is_complete() and m.did_change() for m in metas)
    return check


def _restart_due(ctx: DeployContext, replica: str, changed: Callable[[], bool]) -> bool:
    """Whether a replica restarts: a restart record an interrupted run left, or its files changed in this one."""
    return replica in ctx.pending_restarts or changed()


def unit_values(allowed: list[str] | None = None) -> dict[str, object]:
    """What templates/vllm/vllm@.service.j2 is rendered with: fixed paths, and who may connect (``allowed``,
    from :func:`gpufleet.deploy.access.vllm_sources`; None: anyone)."""
    return {"etc": VLLM_ETC, "node_tools": NODE_TOOLS_DIR, "gate_policy": GATE_POLICY, "home": VLLM_HOME,
            "secrets_dir": SECRETS_DIR, "ip_access": access.unit_lines(allowed)}


def _replica_paths(replica: str) -> list[str]:
    directory = replica_dir(replica)
    return [directory, f"{directory}/config.yaml", f"{directory}/vllm.env", f"{directory}/ranks.json",
            f"{directory}/venv", replica_secrets(replica), restart_marker(replica)]


def _ranks_json(replica: Replica, role: NodeRole, port: int) -> str:
    """The node's ranks.json: on a multi-node mp replica its rank among the replica's nodes; else alone (a Ray
    replica's one vLLM process drives its workers through Ray)."""
    if not role.role.startswith("mp-rank-"):
        return vf.ranks_json(0, [role.address], port)
    addresses = [r.address for r in replica.roles]
    return vf.ranks_json(addresses.index(role.address), addresses, port)


def _stage_model() -> OperationMeta | None:
    cfg = host_config()
    target = vf.model_dir(cfg)
    if cfg.vllm_model_source:
        if not vf.below_models(target):  # validation checks it too; never delete elsewhere
            exit_with(ConfigError([Problem(host.name, "vllm_model",
                                           f"expected a path strictly below {MODELS_DIR}/ to push vllm_model_source"
                                           f" to, found {target!r}")]))
        files.directory(name=f"Create {Path(target).parent}", path=str(Path(target).parent))
        return files.tree(name=f"Push the model from the controller to {target}", src=cfg.vllm_model_source,
                          dest=target)
    if cfg.vllm_model.startswith("/"):
        return None  # an absolute path the site provides: nothing to stage
    revision = cfg.vllm_model_revision or "main"
    return server.script(name=f"Download {cfg.vllm_model} at {revision} into {target}",
                         script=vf.download_script(cfg, HUB_SECRET),
                         done_file=f"{target}/{REVISION_MARKER}", done_text=revision)


@deploy("vLLM: install and configure the replicas")
def vllm_install() -> None:
    """Everything a replica needs on this node, without starting or restarting anything."""
    cfg = host_config()
    ctx = context()
    mine = [(replica, role, process) for replica, role in assignments()
            if (process := _vllm_process(role)) is not None]
    try:
        secrets = vf.secret_env(cfg)
        pip_secret = vf.pip_secret_env(cfg)
        # the API and the mp rendezvous: this node, its replicas' nodes, monitoring, vllm_api_allowed_from
        allowed = access.vllm_sources(cfg, cfg.fleet_address or host.name,
                                      [n.address for replica, _ in assignments() for n in replica.roles],
                                      access.monitoring_group())
    except ConfigError as error:
        exit_with(error)
    model_paths: list[str] = []
    model_listings: list[str] = []
    if cfg.vllm_model_source:
        model_paths, model_listings = files.tree_paths(cfg.vllm_model_source, vf.model_dir(cfg))
    node.observe(
        name="Read vLLM's account, packages, virtualenv, model and replica files",
        users=["vllm"], groups=["vllm"], packages=cfg.vllm_system_packages,
        paths=[VLLM_ROOT, SECRETS_DIR, PIP_SECRET, HUB_SECRET, MODELS_DIR, str(Path(vf.model_dir(cfg)).parent),
               unit_path(VLLM_UNIT_TEMPLATE), GATE_POLICY, VLLM_ETC, *model_paths,
               *(p for replica, _, _ in mine for p in _replica_paths(replica.name))],
        texts=[f"{venv_dir(cfg.vllm_version)}/{INSTALLED_MARKER}", f"{vf.model_dir(cfg)}/{REVISION_MARKER}"],
        listings=[f"{VLLM_ETC}/*", *model_listings],
    )
    apt.packages(name="Ensure the system packages vLLM needs", packages=cfg.vllm_system_packages)
    server.system_account(name="Create the system user and group vllm", user="vllm", home=VLLM_HOME)
    files.directory(name=f"Create {VLLM_ROOT}", path=VLLM_ROOT)
    files.directory(name=f"Create {SECRETS_DIR} (root only)", path=SECRETS_DIR, mode="0700")
    if pip_secret:
        files.secret_file(name="Write the pip index credentials (0600)", dest=PIP_SECRET,
                          content=env_file(pip_secret, "pip index with credentials, read by the vLLM install"))
    else:
        files.absent(name="No pip index credentials", path=PIP_SECRET)
    venv = server.script(name=f"Install vLLM {cfg.vllm_version} into {venv_dir(cfg.vllm_version)}",
                         script=vf.install_script(cfg),
                         done_file=f"{venv_dir(cfg.vllm_version)}/{INSTALLED_MARKER}",
                         done_text=vf.install_marker(cfg))
    if not cfg.vllm_model.startswith("/") and cfg.vllm_hf_token:
        files.secret_file(name="Write the hub token (0600)", dest=HUB_SECRET,
                          content=env_file({"HF_TOKEN": secrets["HF_TOKEN"]}, "hub token for model downloads"))
    files.directory(name=f"Create {MODELS_DIR} (root only writes)", path=MODELS_DIR)
    model = _stage_model()
    unit = files.file(name="Install the vllm@.service template unit", dest=unit_path(VLLM_UNIT_TEMPLATE),
                      content=render("vllm/vllm@.service.j2", **unit_values(allowed)))
    gate = files.file(name=f"Write the GPU health gate policy {GATE_POLICY}", dest=GATE_POLICY,
                      content=policy_json(cfg.gpu_health))
    files.directory(name=f"Create {VLLM_ETC}", path=VLLM_ETC)

    shared = [m for m in (venv, model, unit, gate) if m is not None]
    for replica, role, process in mine:
        directory = replica_dir(replica.name)
        ops = [
            files.directory(name=f"{replica.name}: create {directory}", path=directory),
            files.file(name=f"{replica.name}: write config.yaml", dest=f"{directory}/config.yaml",
                       content=process.config_yaml()),
            files.file(name=f"{replica.name}: write vllm.env", dest=f"{directory}/vllm.env",
                       content=env_file(vf.replica_env(cfg, process.env),
                                        f"Written by gpufleet: environment of replica {replica.name} (no secrets)")),
            files.file(name=f"{replica.name}: write ranks.json (how its ranks find each other)",
                       dest=f"{directory}/ranks.json", content=_ranks_json(replica, role, cfg.vllm_rank_port)),
            files.link(name=f"{replica.name}: point its venv at vLLM {cfg.vllm_version}", path=f"{directory}/venv",
                       target=venv_dir(cfg.vllm_version)),
            files.secret_file(name=f"{replica.name}: write its secrets (0600)", dest=replica_secrets(replica.name),
                              content=env_file(secrets, f"secrets of replica {replica.name}"))
            if secrets else
            files.absent(name=f"{replica.name}: no secrets file", path=replica_secrets(replica.name)),
        ]
        changes = ctx.replica_changes.setdefault(replica.name, [])
        changes.extend(ops + shared)
        # Recorded before any node stops it: a run interrupted from here on still restarts it next time.
        vllm.restart_record(name=f"{replica.name}: record that it must restart", marker=restart_marker(replica.name),
                            changed=_changed(changes),
                            pending=partial(ctx.pending_restarts.add, replica.name))
    systemd.retired(name="Stop and remove replicas no longer planned here", pattern=f"{VLLM_ETC}/*",
                    keep=[replica.name for replica, _, _ in mine], unit="vllm@{name}.service",
                    paths=[replica_dir("{name}"), replica_secrets("{name}")])
    systemd.daemon_reload(name="Reload systemd after the unit changed", _if=unit.did_change)


@deploy("vLLM: start the replicas and wait until they serve")
def vllm_serve() -> None:
    """Start this node's replicas; restart one (all its nodes) only when its files changed on any of them."""
    cfg = host_config()
    ctx = context()
    serving = [replica for replica, role in assignments() if _vllm_process(role) is not None]
    node.observe(name="Read the replicas' units", units=[f"vllm@{replica.name}.service" for replica in serving],
                 paths=[restart_marker(replica.name) for replica in serving])
    for replica, role in assignments():
        if _vllm_process(role) is None:
            continue
        unit = f"vllm@{replica.name}.service"
        marker = restart_marker(replica.name)
        if not cfg.vllm_start:
            systemd.service(name=f"{replica.name}: leave stopped (vllm_start false)", unit=unit,
                            running=False, enabled=False)
            files.absent(name=f"{replica.name}: stopped, so no restart is due", path=marker)
            continue
        changed = _changed(ctx.replica_changes.get(replica.name, []))
        # Stop every node's process of a changed replica before any starts again: an mp rank that
        # joined the old rank 0 would wait for it forever. Operations run on all hosts before the next.
        systemd.stop(name=f"{replica.name}: stop {unit} (its configuration changed on one of its nodes)", unit=unit,
                     _if=partial(_restart_due, ctx, replica.name, changed))
        started = systemd.service(name=f"{replica.name}: start {unit}", unit=unit, running=True, enabled=True)
        starts = ctx.replica_starts.setdefault(replica.name, [])
        starts.append(started)
        if role.host == replica.nodes[0]:  # the first node serves the API; the others are ranks or Ray workers
            url = f"http://{host_port(role.address, replica.port)}"
            ctx.readiness[replica.name] = server.script(
                name=f"{replica.name}: wait for /health and one real completion on {url}",
                script=ready_command(cfg.vllm_served_model_name or cfg.vllm_model, url, unit,
                                     replica_secrets(replica.name) if replica.secret_env else None,
                                     cfg.vllm_ready_timeout),
                _if=_changed(starts),  # a rank (re)started on any of its nodes
            )
        files.absent(name=f"{replica.name}: restarted and serving, clear its restart record", path=marker,
                     _if=partial(ctx.served, replica.name))


def ready_command(served: str, url: str, unit: str, secrets: str | None, timeout: int) -> str:
    """The readiness check's shell line on the first node, every argument quoted for the shell."""
    argv = ["python3", node_tool("vllm_ready.py"), "--url", url, "--model", served, "--unit", unit]
    if secrets:
        argv += ["--env-file", secrets]
    return shlex.join([*argv, "--timeout", str(timeout)])
