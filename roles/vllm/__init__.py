"""Role ``vllm``: install vLLM, stage the model, and run every replica the plan gives this node.

``vllm_install()`` — system user ``vllm``; a virtualenv per version, built in its own directory
``/opt/vllm/.build-<version>-<digest>`` and then swapped in as the link ``/opt/vllm/<version>`` (from an
index, a wheelhouse and/or a hash-pinned lock); the model staged before any replica starts, in the
root-owned ``/var/lib/gpufleet/models/`` (pushed from the controller, or downloaded on the node at a pinned
revision into a temporary directory moved into place when complete); the templated unit
``vllm@.service`` (on a Ray replica's head with the drop-in ``vllm@<replica>.service.d/ray.conf``:
:mod:`roles.vllm.ray_drop_in`); per replica ``/etc/gpufleet/vllm/<replica>/`` with ``config.yaml`` (``--config``),
``vllm.env``, a ``venv`` link and ``release.json`` (what it runs: :mod:`gpufleet.rollout.release`; writing
it restarts nothing), the API key and hub token in ``/etc/gpufleet/secrets/<replica>.env``
(0600, root) and, on each node of a multi-node mp replica, the rank secret its ranks prove to each other in
``/etc/gpufleet/secrets/<replica>.rank.env`` (0600, root: drawn by the deploy, kept while its nodes agree); the
template unit of replicas' watchdogs ``vllm-watchdog@.service`` and, on a replica's first node, its
``watchdog.json``; replicas this node no longer runs are stopped and removed. The vllm user owns nothing of it:
only ``/var/lib/vllm`` (its home and caches). Last, the nodes of each multi-node replica must
agree on vLLM, torch, Python, Ray and the model, or all of them stop before any starts it.

``vllm_retire()`` — on a host that serves in no pool (it may have served before): every replica left on it is
stopped and removed.

``vllm_serve()`` — starts each replica (``vllm_start``), restarts one only when its files changed on
any of its nodes, and waits on its first node for ``/health`` and one real completion; that wait then records
the KV cache vLLM reports (``observed.json`` in the replica's directory), which every run shows beside the plan's
(a warning beyond ``vllm_plan_tolerance``), and times the start: seconds from the unit's main process start to vLLM's
weights loaded, its KV cache sized, ``/health`` answering and the first completion (in ``observed.json`` too, and
for node_exporter in ``/var/lib/node_exporter/textfile_collector/gpufleet-replica-start-<replica>.prom``: the
monitoring hosts keep each release's start record from them, role monitoring). A restart the deploy decided on
is first recorded on every node of the replica (``restart-pending`` in its directory) and cleared only once the
replica serves again, so a run interrupted in between restarts it next time (and ``deploys/check.py`` reports it
as drift). On its first node, the replica's watchdog runs with it (``vllm_watchdog_stall_s``;
``gpufleet/node/replica_watchdog.py``) and restarts it when it is wedged.

Variables: roles/vllm/defaults.yml. The layout comes from the plan (``gpufleet.run.context``).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from secrets import token_hex

from pyinfra.api.deploy import deploy
from pyinfra.api.operation import OperationMeta
from pyinfra.context import host

from gpufleet.config import lora_files
from gpufleet.config.inventory_shape import ROUTERS_GROUP
from gpufleet.config.schema import HostConfig
from gpufleet.measure.starts import start_key
from gpufleet.node.health_rules import policy_json
from gpufleet.node.replica_rank import SECRET_ENV as RANK_SECRET_ENV
from gpufleet.node_paths import (
    ADAPTERS_DIR,
    GATE_POLICY,
    INSTALLED_MARKER,
    MODELS_DIR,
    NODE_TOOLS_DIR,
    PIP_SECRET,
    RESTART_LOOP_CAPTURE,
    REVISION_MARKER,
    SECRETS_DIR,
    VLLM_ETC,
    VLLM_HOME,
    VLLM_ROOT,
    VLLM_UNIT_TEMPLATE,
    WATCHDOG_UNIT_TEMPLATE,
    adapter_store,
    node_tool,
    observed_file,
    rank_secret_file,
    release_file,
    replica_dir,
    replica_secrets,
    resolver_dir,
    restart_marker,
    start_textfile,
    unit_path,
    venv_dir,
    vllm_ray_drop_in,
    watchdog_config,
    watchdog_enabled_link,
    watchdog_unit,
)
from gpufleet.operations import apt, files, node, server, shared_secrets, systemd, vllm
from gpufleet.plan import access
from gpufleet.plan.commands import NodeRole, Process
from gpufleet.plan.planner import Replica
from gpufleet.rollout.release import release_json, release_of
from gpufleet.run.context import DeployContext, assignments, context, host_config
from gpufleet.templates import render
from gpufleet.units.escape import env_file
from gpufleet.values.problems import ConfigError, Problem, exit_with
from roles.vllm import ray_drop_in
from roles.vllm import replica_files as vf

HUB_SECRET = replica_secrets("hub")


def _vllm_process(role: NodeRole) -> Process | None:
    """The node's vLLM process in a replica; None on a Ray worker, which runs none of its own."""
    return next((p for p in role.processes if p.unit == "vllm"), None)


def _changed(metas: list[OperationMeta]) -> Callable[[], bool]:
    def check() -> bool:
        return any(m.is_complete() and m.did_change() for m in metas)
    return check


def _replica_changed(ctx: DeployContext, replica: str) -> Callable[[], bool]:
    """Whether a replica's files changed on any of its nodes in this run, or one of its adapters got new weights."""
    files_changed = _changed(ctx.replica_changes.setdefault(replica, []))
    return lambda: files_changed() or replica in ctx.adapters_replaced


def _restart_due(ctx: DeployContext, replica: str, changed: Callable[[], bool]) -> bool:
    """Whether a replica restarts: a restart record an interrupted run left, or ``changed`` (its files or an
    adapter's weights, in this run)."""
    return replica in ctx.pending_restarts or changed()


def unit_values(allowed: list[str] | None = None, stop_timeout_s: int = vf.STOP_MARGIN_S) -> dict[str, object]:
    """What templates/vllm/vllm@.service.j2 is rendered with: fixed paths, who may connect (``allowed``, from
    :func:`gpufleet.plan.access.vllm_sources`; None: anyone) and how long a stop may take (drain included)."""
    return {"etc": VLLM_ETC, "node_tools": NODE_TOOLS_DIR, "gate_policy": GATE_POLICY, "home": VLLM_HOME,
            "secrets_dir": SECRETS_DIR, "ip_access": access.unit_lines(allowed), "stop_timeout_s": stop_timeout_s,
            "on_failure": RESTART_LOOP_CAPTURE}


def watchdog_unit_values(node_address: str) -> dict[str, object]:
    """What templates/vllm/vllm-watchdog@.service.j2 is rendered with: fixed paths, and the one address the
    watchdog may reach (its node's, where its replicas' APIs listen)."""
    return {"etc": VLLM_ETC, "node_tools": NODE_TOOLS_DIR, "secrets_dir": SECRETS_DIR,
            "ip_access": access.unit_lines(access.watchdog_sources(node_address))}


def _watched(cfg: HostConfig, replica: Replica, role: NodeRole) -> bool:
    """Whether this node runs the replica's watchdog: its first node (the API), unless vllm_watchdog_stall_s is 0."""
    return cfg.vllm_watchdog_stall_s > 0 and role.host == replica.nodes[0]


def _watchdog_file(replica: Replica, role: NodeRole) -> OperationMeta:
    cfg, path = host_config(), watchdog_config(replica.name)
    if not _watched(cfg, replica, role):
        return files.absent(name=f"{replica.name}: no watchdog file on this node", path=path)
    return files.file(name=f"{replica.name}: write watchdog.json (what its watchdog watches)", dest=path,
                      content=vf.watchdog_json(cfg, replica.name, replica.api_url))


def _run_watchdog(replica: Replica, role: NodeRole) -> None:
    """On the replica's first node, its watchdog runs with it (restarted when its unit or file changed); elsewhere,
    or with vllm_start false, none."""
    cfg, unit = host_config(), watchdog_unit(replica.name)
    if not (cfg.vllm_start and _watched(cfg, replica, role)):
        systemd.service(name=f"{replica.name}: no watchdog on this node", unit=unit, running=False, enabled=False)
        return
    systemd.restart(name=f"{replica.name}: restart {unit} (its unit or watchdog.json changed)", unit=unit,
                    _if=_changed(context().watchdog_changes.get(replica.name, [])))
    systemd.service(name=f"{replica.name}: run {unit} (restarts the replica when it is wedged)", unit=unit,
                    running=True, enabled=True)


def _replica_paths(replica: str) -> list[str]:
    directory = replica_dir(replica)
    return [directory, f"{directory}/config.yaml", f"{directory}/vllm.env", f"{directory}/ranks.json",
            f"{directory}/venv", replica_secrets(replica), rank_secret_file(replica), restart_marker(replica),
            vllm_ray_drop_in(replica), watchdog_config(replica), release_file(replica)]


def _ray_drop_in(replica: Replica, role: NodeRole) -> OperationMeta:
    """On a Ray replica's head, the unit's drop-in that orders vLLM after the replica's Ray cluster; else none."""
    path = vllm_ray_drop_in(replica.name)
    text = ray_drop_in.drop_in(host_config(), replica, role)
    if text is None:
        return files.absent(name=f"{replica.name}: no Ray drop-in for its unit", path=path)
    return files.file(name=f"{replica.name}: order its unit after its Ray cluster", dest=path, content=text)


def _ranks_json(replica: Replica, role: NodeRole, cfg: HostConfig) -> str:
    """The node's ranks.json: on a multi-node mp replica its rank among the replica's nodes; else alone (a Ray
    replica's one vLLM process drives its workers through Ray)."""
    if not _bound(role):
        return vf.ranks_json(0, [role.address], cfg.vllm_rank_port)
    addresses = [r.address for r in replica.roles]
    return vf.ranks_json(addresses.index(role.address), addresses, cfg.vllm_rank_port,
                         vf.stop_timeout_s(cfg) - 15, vf.fabric_check(cfg))


def _bound(role: NodeRole) -> bool:
    """Whether the node is a rank of a multi-node mp replica (its ranks prove the replica's rank secret)."""
    return role.role.startswith("mp-rank-")


def rank_secret_what(replica: str) -> str:
    """A replica's rank secret, as messages name it."""
    return f"the rank secret of replica {replica}"


def draw_rank_secret(replica: str) -> str:
    """A new rank secret for ``replica``, as its file holds it: 32 random bytes in hex."""
    return env_file({RANK_SECRET_ENV: token_hex(32)}, f"rank secret of replica {replica}")


def _rank_secret(replica: Replica, role: NodeRole) -> OperationMeta:
    """On a multi-node mp replica's node, its rank secret (the same on all its nodes); else none."""
    path = rank_secret_file(replica.name)
    if not _bound(role):
        return files.absent(name=f"{replica.name}: no rank secret on this node", path=path)
    ctx = context()
    return shared_secrets.kept(name=f"{replica.name}: keep its rank secret (0600, the same on all its nodes)",
                               what=rank_secret_what(replica.name), path=path, holders=replica.nodes,
                               found=ctx.shared_secrets_seen.setdefault(path, {}), chosen=ctx.shared_secrets,
                               draw=partial(draw_rank_secret, replica.name))


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
    if cfg.checkpoint().startswith("/"):
        return None  # an absolute path the site provides: nothing to stage
    revision = cfg.vllm_model_revision or "main"
    return server.script(name=f"Download {cfg.checkpoint()} at {revision} into {target}",
                         script=vf.download_script(cfg, HUB_SECRET),
                         done_file=f"{target}/{REVISION_MARKER}", done_text=revision)


@deploy("vLLM: install and configure the replicas")
def vllm_install() -> None:
    """Everything a replica needs on this node, without starting or restarting anything, in phases: read the node,
    install vLLM, stage the model, write the units, write each replica's files; then retire the replicas no longer
    planned here and check that each multi-node replica's nodes agree."""
    cfg = host_config()
    mine = [(replica, role, process) for replica, role in assignments()
            if (process := _vllm_process(role)) is not None]
    try:
        secrets = vf.secret_env(cfg)
        token = vf.hub_token(cfg) if not cfg.checkpoint().startswith("/") else None
        pip_secret = vf.pip_secret_env(cfg)
        # the API and the mp rendezvous: this node, its replicas' nodes, monitoring, routers, vllm_api_allowed_from
        allowed = access.vllm_sources(cfg, cfg.fleet_address or host.name,
                                      [n.address for replica, _ in assignments() for n in replica.roles],
                                      access.deploy_group(), access.deploy_group(ROUTERS_GROUP))
    except ConfigError as error:
        exit_with(error)
    _read_node(cfg, [replica for replica, _, _ in mine])
    venv = _install(cfg, pip_secret)
    model = _stage(token)
    _stage_adapters(cfg)
    unit, watchdog, gate = _units(cfg, allowed)
    shared = [m for m in (venv, model, unit, gate) if m is not None]
    drop_ins = _replica_files(cfg, mine, secrets, shared, watchdog)
    retired = _retire_replicas(keep=[replica.name for replica, _, _ in mine])
    systemd.daemon_reload(name="Reload systemd after the unit or a drop-in changed",
                          _if=_changed([unit, watchdog, retired, *drop_ins]))
    _nodes_agree()


def _read_node(cfg: HostConfig, replicas: list[Replica]) -> None:
    """Read, in one command, everything the phases compare: the account, packages, virtualenv, model, units and
    each replica's files."""
    model_paths: list[str] = []
    model_listings: list[str] = []
    if cfg.vllm_model_source:
        model_paths, model_listings = files.tree_paths(cfg.vllm_model_source, vf.model_dir(cfg))
    adapter_paths, adapter_listings = _adapter_paths(cfg, replicas)
    node.observe(
        name="Read vLLM's account, packages, virtualenv, model, adapters and replica files",
        users=["vllm"], groups=["vllm"], packages=cfg.vllm_system_packages,
        paths=[VLLM_ROOT, SECRETS_DIR, PIP_SECRET, HUB_SECRET, MODELS_DIR, str(Path(vf.model_dir(cfg)).parent),
               unit_path(VLLM_UNIT_TEMPLATE), unit_path(WATCHDOG_UNIT_TEMPLATE), GATE_POLICY, VLLM_ETC, *model_paths,
               *(p for replica in replicas for p in _replica_paths(replica.name)), *adapter_paths],
        texts=[f"{venv_dir(cfg.vllm_version)}/{INSTALLED_MARKER}", f"{vf.model_dir(cfg)}/{REVISION_MARKER}"],
        listings=[f"{VLLM_ETC}/*", *model_listings, *adapter_listings],
    )


def _install(cfg: HostConfig, pip_secret: dict[str, str]) -> OperationMeta:
    """The system packages, the vllm account, and vLLM's virtualenv for ``vllm_version`` (the pip index's
    credentials in a 0600 file while it is set)."""
    apt.packages(name="Ensure the system packages vLLM needs", packages=cfg.vllm_system_packages)
    server.system_account(name="Create the system user and group vllm", user="vllm", home=VLLM_HOME)
    files.directory(name=f"Create {VLLM_ROOT}", path=VLLM_ROOT)
    files.directory(name=f"Create {SECRETS_DIR} (root only)", path=SECRETS_DIR, mode="0700")
    if pip_secret:
        files.secret_file(name="Write the pip index credentials (0600)", dest=PIP_SECRET,
                          content=env_file(pip_secret, "pip index with credentials, read by the vLLM install"))
    else:
        files.absent(name="No pip index credentials", path=PIP_SECRET)
    return server.script(name=f"Install vLLM {cfg.vllm_version} into {venv_dir(cfg.vllm_version)}",
                         script=vf.install_script(cfg),
                         done_file=f"{venv_dir(cfg.vllm_version)}/{INSTALLED_MARKER}",
                         done_text=vf.install_marker(cfg))


def _stage(token: str | None) -> OperationMeta | None:
    """The model, staged before any replica starts (the hub token in a 0600 file for a hub model's download)."""
    if token is not None:
        files.secret_file(name="Write the hub token (0600)", dest=HUB_SECRET,
                          content=env_file({"HF_TOKEN": token}, "hub token for model downloads"))
    files.directory(name=f"Create {MODELS_DIR} (root only writes)", path=MODELS_DIR)
    return _stage_model()


def _adapter_paths(cfg: HostConfig, replicas: list[Replica]) -> tuple[list[str], list[str]]:
    """What the adapters' phases compare: every staged and resolver path, and the listings pruned."""
    paths, listings = [ADAPTERS_DIR], [f"{ADAPTERS_DIR}/*"]
    for adapter in cfg.vllm_lora_adapters.values():
        store = adapter_store(adapter.sha256)
        paths += [store, f"{store}/{lora_files.CONFIG_FILE}", f"{store}/{lora_files.WEIGHTS_FILE}"]
    for replica in replicas:
        resolver = resolver_dir(replica.name)
        paths.append(resolver)
        listings.append(f"{resolver}/*")
        for name in cfg.vllm_lora_adapters:
            paths += [f"{resolver}/{name}", f"{resolver}/{name}/{lora_files.CONFIG_FILE}",
                      f"{resolver}/{name}/{lora_files.WEIGHTS_FILE}"]
    return paths, listings


def _stage_adapters(cfg: HostConfig) -> None:
    """Each declared LoRA adapter's revision, pushed from the controller into its own directory named by its
    weights' digest (root:vllm, 0750 and 0640: readable by the replicas' account only), each file kept equal to the
    controller's by its SHA-256 (the weights' was checked against the inventory's before any host); revisions
    this node's pool no longer declares removed."""
    files.directory(name=f"Create {ADAPTERS_DIR} (read by the vllm group only)", path=ADAPTERS_DIR, group="vllm",
                    mode="0750")
    kept = []
    for name, adapter in sorted(cfg.vllm_lora_adapters.items()):
        store = adapter_store(adapter.sha256)
        kept.append(store)
        files.directory(name=f"Adapter {name}: create {store}", path=store, group="vllm", mode="0750")
        for staged in (lora_files.CONFIG_FILE, lora_files.WEIGHTS_FILE):
            files.file(name=f"Adapter {name}: stage {staged}", dest=f"{store}/{staged}",
                       src=str(Path(adapter.source).expanduser() / staged), group="vllm", mode="0640")
    files.pruned(name="Remove adapter revisions this node's pool no longer declares", pattern=f"{ADAPTERS_DIR}/*",
                 keep=kept)


def _resolver_files(cfg: HostConfig, replica: str) -> None:
    """The adapters ``replica`` serves, as vLLM's filesystem resolver reads them: per name, its
    ``adapter_config.json`` naming the replica's model and a link to its staged weights; none without adapters.
    Not one of the replica's changes: an adapter added is resolved by the running engine, no restart. An adapter
    declared again with other weights restarts it (:func:`gpufleet.operations.vllm.adapters_replaced`)."""
    resolver = resolver_dir(replica)
    if not cfg.vllm_lora_adapters:
        files.absent(name=f"{replica}: no adapters", path=resolver)
        return
    files.directory(name=f"{replica}: create {resolver}", path=resolver, group="vllm", mode="0750")
    for name, adapter in sorted(cfg.vllm_lora_adapters.items()):
        folder = f"{resolver}/{name}"
        files.directory(name=f"{replica}: adapter {name}", path=folder, group="vllm", mode="0750")
        config = lora_files.resolver_config(lora_files.read_adapter(adapter.source), cfg.checkpoint())
        files.file(name=f"{replica}: adapter {name}'s config for the resolver",
                   dest=f"{folder}/{lora_files.CONFIG_FILE}", content=config, group="vllm", mode="0640")
        files.link(name=f"{replica}: adapter {name}'s weights ({adapter.sha256[:16]})",
                   path=f"{folder}/{lora_files.WEIGHTS_FILE}",
                   target=f"{adapter_store(adapter.sha256)}/{lora_files.WEIGHTS_FILE}")
    files.pruned(name=f"{replica}: remove adapters no longer declared", pattern=f"{resolver}/*",
                 keep=[f"{resolver}/{name}" for name in cfg.vllm_lora_adapters])


def _units(cfg: HostConfig, allowed: list[str] | None) -> tuple[OperationMeta, OperationMeta, OperationMeta]:
    """The replicas' and their watchdogs' template units, and the GPU health gate's policy they start behind."""
    unit = files.file(name="Install the vllm@.service template unit", dest=unit_path(VLLM_UNIT_TEMPLATE),
                      content=render("vllm/vllm@.service.j2", **unit_values(allowed, vf.stop_timeout_s(cfg))))
    watchdog = files.file(name="Install the vllm-watchdog@.service template unit",
                          dest=unit_path(WATCHDOG_UNIT_TEMPLATE),
                          content=render("vllm/vllm-watchdog@.service.j2",
                                         **watchdog_unit_values(cfg.fleet_address or host.name)))
    gate = files.file(name=f"Write the GPU health gate policy {GATE_POLICY}", dest=GATE_POLICY,
                      content=policy_json(cfg.gpu_health))
    files.directory(name=f"Create {VLLM_ETC}", path=VLLM_ETC)
    return unit, watchdog, gate


def _replica_files(cfg: HostConfig, mine: list[tuple[Replica, NodeRole, Process]], secrets: dict[str, str],
                   shared: list[OperationMeta], watchdog: OperationMeta) -> list[OperationMeta]:
    """Each replica's files on this node, and its restart record when any of them (or what it shares: vLLM, the
    model, the unit, the gate) changed; the Ray drop-ins written, for the daemon reload."""
    ctx = context()
    for replica, role, _ in mine:  # every node's, before any node's rank secret is decided
        if _bound(role):
            path = rank_secret_file(replica.name)
            shared_secrets.seen(name=f"{replica.name}: read its rank secret's digest", path=path,
                                found=ctx.shared_secrets_seen.setdefault(path, {}), what=rank_secret_what(replica.name))
    drop_ins: list[OperationMeta] = []
    for replica, role, process in mine:
        directory = replica_dir(replica.name)
        ops = [
            files.directory(name=f"{replica.name}: create {directory}", path=directory),
            files.file(name=f"{replica.name}: write config.yaml", dest=f"{directory}/config.yaml",
                       content=process.config_yaml()),
            files.file(name=f"{replica.name}: write vllm.env", dest=f"{directory}/vllm.env",
                       content=env_file(vf.replica_env(cfg, process.env, resolver_dir(replica.name)),
                                        f"Written by gpufleet: environment of replica {replica.name} (no secrets)")),
            files.file(name=f"{replica.name}: write ranks.json (how its ranks find each other)",
                       dest=f"{directory}/ranks.json", content=_ranks_json(replica, role, cfg)),
            files.link(name=f"{replica.name}: point its venv at vLLM {cfg.vllm_version}", path=f"{directory}/venv",
                       target=venv_dir(cfg.vllm_version)),
            files.secret_file(name=f"{replica.name}: write its secrets (0600)", dest=replica_secrets(replica.name),
                              content=env_file(secrets, f"secrets of replica {replica.name}"))
            if secrets else
            files.absent(name=f"{replica.name}: no secrets file", path=replica_secrets(replica.name)),
            _rank_secret(replica, role),
        ]
        ops.append(_ray_drop_in(replica, role))
        drop_ins.append(ops[-1])
        _resolver_files(cfg, replica.name)
        # Read before release.json is written again: an adapter declared with other weights restarts the replica.
        vllm.adapters_replaced(name=f"{replica.name}: read which adapters get new weights (it restarts for them)",
                               release=release_file(replica.name),
                               adapters={name: a.sha256 for name, a in cfg.vllm_lora_adapters.items()},
                               replaced=partial(ctx.adapters_replaced.add, replica.name))
        # What it runs, for gpufleet upgrade and rollback: not one of its changes (writing it restarts nothing).
        files.file(name=f"{replica.name}: write release.json (what it runs)", dest=release_file(replica.name),
                   content=release_json(release_of(cfg)))
        ctx.watchdog_changes.setdefault(replica.name, []).extend([_watchdog_file(replica, role), watchdog])
        changes = ctx.replica_changes.setdefault(replica.name, [])
        changes.extend(ops + shared)
        # Recorded before any node stops it: a run interrupted from here on still restarts it next time.
        vllm.restart_record(name=f"{replica.name}: record that it must restart", marker=restart_marker(replica.name),
                            changed=_replica_changed(ctx, replica.name),
                            pending=partial(ctx.pending_restarts.add, replica.name))
    return drop_ins


def _retire_replicas(keep: list[str]) -> OperationMeta:
    """Stop and remove every replica on this node that ``keep`` does not name: its unit and all its files."""
    return systemd.retired(name="Stop and remove replicas no longer planned here", pattern=f"{VLLM_ETC}/*",
                           keep=keep, unit="vllm@{name}.service",
                           paths=[replica_dir("{name}"), replica_secrets("{name}"), rank_secret_file("{name}"),
                                  vllm_ray_drop_in("{name}"), watchdog_enabled_link("{name}"),
                                  start_textfile("{name}")])


@deploy("vLLM: retire the replicas of a host that serves in no pool")
def vllm_retire() -> None:
    """On a host in no serving pool (a dedicated router or monitoring host): the replicas it ran while it served
    are stopped and removed, as on a serving node the plan gives fewer; vLLM's installs and model stay."""
    node.observe(name="Read the replicas left on this node", listings=[f"{VLLM_ETC}/*"])
    retired = _retire_replicas(keep=[])
    systemd.daemon_reload(name="Reload systemd after replicas were removed", _if=retired.did_change)


def _nodes_agree() -> None:
    """For each multi-node replica of this node: record what the node runs it with, then (once every node has:
    operations run on all hosts before the next) fail all of the replica's nodes when they disagree, before any of
    its units starts (role ray, ``vllm_serve``)."""
    cfg, ctx = host_config(), context()
    multi = [(replica, role) for replica, role in assignments() if len(replica.roles) > 1]
    model = vf.model_identity(cfg) if multi else None
    for replica, role in multi:
        python = (f"{replica_dir(replica.name)}/venv/bin/python" if _vllm_process(role) is not None
                  else f"{venv_dir(cfg.vllm_version)}/bin/python")  # a Ray worker runs the version's virtualenv
        vllm.node_stack(name=f"{replica.name}: read the vLLM, torch, Python and Ray versions and the model it runs",
                        python=python, package=cfg.vllm_package, model=model, model_dir=vf.model_dir(cfg),
                        stacks=ctx.replica_stacks.setdefault(replica.name, {}))
    for replica, _ in multi:
        vllm.nodes_agree(name=f"{replica.name}: check that its nodes run the same vLLM, torch, Python, Ray and model",
                         replica=replica.name, nodes=replica.nodes, stacks=ctx.replica_stacks[replica.name])


@deploy("vLLM: start the replicas and wait until they serve")
def vllm_serve() -> None:
    """Start this node's replicas; restart one (all its nodes) only when its files changed on any of them."""
    cfg = host_config()
    ctx = context()
    serving = [(replica, role) for replica, role in assignments() if _vllm_process(role) is not None]
    node.observe(name="Read the replicas' units and what vLLM reported on their first node",
                 units=[unit for replica, _ in serving
                        for unit in (f"vllm@{replica.name}.service", watchdog_unit(replica.name))],
                 paths=[restart_marker(replica.name) for replica, _ in serving],
                 texts=[observed_file(replica.name) for replica, role in serving if role.host == replica.nodes[0]])
    for replica, role in assignments():
        if _vllm_process(role) is None:
            continue
        unit = f"vllm@{replica.name}.service"
        marker = restart_marker(replica.name)
        if not cfg.vllm_start:
            systemd.service(name=f"{replica.name}: leave stopped (vllm_start false)", unit=unit,
                            running=False, enabled=False)
            files.absent(name=f"{replica.name}: stopped, so no restart is due", path=marker)
            _run_watchdog(replica, role)
            continue
        changed = _replica_changed(ctx, replica.name)
        # Stop every node's process of a changed replica before any starts again: an mp rank that
        # joined the old rank 0 would wait for it forever. Operations run on all hosts before the next.
        # Its start limit counts afresh: five deploys in five minutes that each restart it are no restart loop.
        systemd.stop(name=f"{replica.name}: stop {unit} (its configuration or an adapter's weights changed on one of"
                          " its nodes)", unit=unit, fresh_start_limit=True,
                     _if=partial(_restart_due, ctx, replica.name, changed))
        started = systemd.service(name=f"{replica.name}: start {unit}", unit=unit, running=True, enabled=True)
        starts = ctx.replica_starts.setdefault(replica.name, [])
        starts.append(started)
        if role.host == replica.nodes[0]:  # the first node serves the API; the others are ranks or Ray workers
            url = replica.api_url
            kv = KvCheck(observed_file(replica.name), replica.budget.kv_tokens, replica.max_model_len,
                         cfg.vllm_plan_tolerance)
            timed = StartCheck(start_textfile(replica.name),
                               {"replica": replica.name, **start_key(replica).labels()})
            wait = ctx.readiness[replica.name] = server.script(
                name=f"{replica.name}: wait for /health and one real completion on {url}",
                script=ready_command(cfg.served_model_name(), url, unit, marker,
                                     replica_secrets(replica.name) if replica.secret_env else None,
                                     cfg.vllm_ready_timeout, kv, timed, sorted(cfg.vllm_lora_adapters)),
                _if=_changed(starts),  # a rank (re)started on any of its nodes
            )
            vllm.kv_report(name=f"{replica.name}: show the KV cache vLLM reports beside the plan's",
                           replica=replica.name, observed=kv.observed, planned=kv.planned_tokens,
                           tolerance=kv.tolerance, router_policy=cfg.router_policy, fresh=_changed([wait]))
            vllm.start_seen(name=f"{replica.name}: read its last start's phases (for the start records)",
                            replica=replica.name, observed=kv.observed, starts=ctx.starts, fresh=_changed([wait]))
        _run_watchdog(replica, role)
        files.absent(name=f"{replica.name}: restarted and serving, clear its restart record", path=marker,
                     _if=partial(ctx.served, replica.name))


@dataclass(frozen=True)
class KvCheck:
    """What the readiness wait compares vLLM's KV cache with, and where it records what vLLM reports."""

    observed: str  # the replica's observed.json on its first node
    planned_tokens: int  # the plan's KV cache tokens
    max_model_len: int
    tolerance: float  # vllm_plan_tolerance

    def argv(self) -> list[str]:
        return ["--observed", self.observed, "--planned-kv-tokens", str(self.planned_tokens),
                "--max-model-len", str(self.max_model_len), "--tolerance", str(self.tolerance)]


@dataclass(frozen=True)
class StartCheck:
    """Where the readiness wait writes the phases of the start it waited for, and the labels they carry."""

    textfile: str  # the replica's start for node_exporter, on its first node
    labels: dict[str, str]  # replica, model, release, layout, gpu_profile

    def argv(self) -> list[str]:
        return ["--start-textfile", self.textfile, "--start-labels", json.dumps(self.labels, sort_keys=True)]


def ready_command(served: str, url: str, unit: str, record: str, secrets: str | None, timeout: int,
                  kv: KvCheck | None = None, timed: StartCheck | None = None, adapters: list[str] | None = None) -> str:
    """The readiness check's shell line on the first node, every argument quoted for the shell; with ``kv``, it
    then records the KV cache vLLM reports beside the plan's, with ``timed`` the start's phases, and with
    ``adapters`` it asks each LoRA adapter for a completion too (vLLM loads each then, and lists it).
    ``record``: the replica's restart record, which the deploy touches before it stops the replica (a start refused
    before the wait began then counts)."""
    argv = ["python3", node_tool("vllm_ready.py"), "--url", url, "--model", served, "--unit", unit,
            "--restart-record", record]
    if secrets:
        argv += ["--env-file", secrets]
    for adapter in adapters or []:
        argv += ["--adapter", adapter]
    return shlex.join([*argv, *(timed.argv() if timed else []), "--timeout", str(timeout),
                       *(kv.argv() if kv else [])])
