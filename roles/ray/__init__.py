"""Role ``ray``: the Ray cluster of every replica planned with ``vllm_distributed_backend: ray``.

On the replica's first node a head unit, on the others worker units (``gpufleet-ray-<replica>.service``,
user ``vllm``), each running the planner's ``ray start --block`` bound to the node's fleet address
(VLLM_HOST_IP) with every port fixed (roles/ray/defaults.yml) and the dashboard off unless
``ray_dashboard``; NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME are in each unit's environment. The order
is enforced across nodes: head started and answering, then every worker started, then the head waits
until ``ray status`` counts every node of the replica; only then does ``vllm_serve`` start vLLM on the
head. Run after ``vllm_install`` (Ray comes from the version's virtualenv) and before ``vllm_serve``. After a
reboot the units keep that order without a deploy: a worker's ``ray start`` fails while the head does not answer
and ``Restart=`` tries again, and the head's vLLM waits for every node (the vllm role's drop-in,
:mod:`roles.vllm.ray_drop_in`).

Access: token authentication on (``RAY_AUTH_MODE=token``; ``ray_auth_token`` read on the controller and
written to ``/etc/gpufleet/secrets/<replica>.ray.env``, root 0600, which systemd reads for the unit), the
Ray Client server off (it would run code for anyone, token or not), and the unit reachable only from the
replica's nodes and the monitoring hosts (``IPAddressAllow=``, :mod:`gpufleet.plan.access`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from pyinfra.api.deploy import deploy
from pyinfra.api.operation import OperationMeta
from pyinfra.context import host
from pyinfra.operations.util import any_changed

from gpufleet.netaddr import host_port
from gpufleet.node_paths import (
    RAY_ENV_DIR,
    SECRETS_DIR,
    SYSTEMD_DIR,
    ray_env_file,
    ray_token_file,
    unit_path,
    venv_bin,
)
from gpufleet.node_paths import RAY_UNIT_PREFIX as UNIT_PREFIX
from gpufleet.node_paths import ray_unit as unit_name
from gpufleet.operations import files, node, systemd
from gpufleet.operations import ray as ray_ops
from gpufleet.plan import access
from gpufleet.run.context import assignments, context, host_config
from gpufleet.templates import render
from gpufleet.units.escape import env_file, exec_line
from gpufleet.values.problems import ConfigError, Problem, exit_with
from roles.vllm import replica_files as vf


def _restart_due(changed: Callable[[], bool], started: OperationMeta) -> bool:
    """Whether a Ray unit restarts: its files changed, and starting it in this run did not already load them."""
    return changed() and not started.did_change()


@deploy("Ray: head and worker units of Ray replicas")
def ray() -> None:
    """Converge this node's Ray units in the order head, workers, all joined."""
    cfg = host_config()
    mine = [(replica, role, proc) for replica, role in assignments()
            for proc in role.processes if proc.unit in ("ray-head", "ray-worker")]
    names = [replica.name for replica, _, _ in mine]
    node.observe(
        name="Read the Ray units and their files",
        listings=[f"{SYSTEMD_DIR}/{UNIT_PREFIX}*.service"], units=[unit_name(n) for n in names],
        paths=[RAY_ENV_DIR, SECRETS_DIR, *(p for n in names for p in (ray_env_file(n), ray_token_file(n),
                                                                        unit_path(unit_name(n))))],
    )
    retired = systemd.retired(
        name="Stop and remove Ray units no longer planned here", pattern=f"{SYSTEMD_DIR}/{UNIT_PREFIX}*.service",
        keep=names, unit=unit_name("{name}"), suffix=".service",
        paths=[unit_path(unit_name("{name}")), ray_env_file("{name}"), ray_token_file("{name}")],
    )
    if not mine:
        return
    try:
        token = vf.secret_env(cfg).get("RAY_AUTH_TOKEN")
        monitoring = access.deploy_group()
        allowed = {replica.name: access.ray_sources(cfg, [r.address for r in replica.roles], monitoring)
                   for replica, _, _ in mine}
    except ConfigError as error:
        exit_with(error)
    if not token:
        exit_with(ConfigError([Problem(host.name, "ray_auth_token", "expected a secret reference ({env: NAME} or"
                                                                   " {file: PATH}) for a Ray replica, found null")]))
    files.directory(name=f"Create {RAY_ENV_DIR}", path=RAY_ENV_DIR)
    files.directory(name=f"Create {SECRETS_DIR} (root only)", path=SECRETS_DIR, mode="0700")
    ray_bin = venv_bin(cfg.vllm_version, "ray")
    written = {}
    for replica, role, proc in mine:
        kind = "head" if proc.unit == "ray-head" else "worker"
        env = files.file(
            name=f"{replica.name}: Ray {kind} environment", dest=ray_env_file(replica.name),
            content=env_file({**vf.process_env(cfg), **cfg.vllm_env, **proc.env},
                             f"Written by gpufleet: environment of the Ray {kind} of {replica.name}"))
        secret = files.secret_file(name=f"{replica.name}: Ray token (0600)", dest=ray_token_file(replica.name),
                                   content=env_file({"RAY_AUTH_TOKEN": token}, f"Ray token of {replica.name}"))
        unit = files.file(
            name=f"{replica.name}: Ray {kind} unit", dest=unit_path(unit_name(replica.name)),
            content=render("ray/ray.service.j2", kind=kind, replica=replica.name, env_file=ray_env_file(replica.name),
                           token_file=ray_token_file(replica.name), ip_access=access.unit_lines(allowed[replica.name]),
                           exec_start=exec_line(proc.argv), ray=ray_bin))
        systemd.daemon_reload(name=f"{replica.name}: reload systemd", _if=any_changed(unit, retired))
        written[replica.name] = any_changed(env, unit, secret)
        if kind == "head":
            gcs = host_port(role.address, cfg.ray_port)
            started = systemd.service(name=f"{replica.name}: start the Ray head", unit=unit_name(replica.name),
                                      running=True, enabled=True)
            restarted = systemd.restart(
                name=f"{replica.name}: restart the Ray head (its unit changed)", unit=unit_name(replica.name),
                _if=partial(_restart_due, written[replica.name], started))
            ray_ops.joined(name=f"{replica.name}: wait for the Ray head at {gcs}", ray=ray_bin, gcs=gcs, nodes=1,
                           timeout=cfg.ray_ready_timeout, token_file=ray_token_file(replica.name), always_wait=True,
                           _if=any_changed(started, restarted))
            # vLLM follows its Ray head (Requires=): a (re)started head means waiting until the replica serves
            context().replica_starts.setdefault(replica.name, []).extend([started, restarted])
    # Workers join only once every head answers (operations run in this order on all hosts).
    for replica, _, proc in mine:
        if proc.unit != "ray-worker":
            continue
        started = systemd.service(name=f"{replica.name}: start the Ray worker", unit=unit_name(replica.name),
                                  running=True, enabled=True)
        systemd.restart(
            name=f"{replica.name}: restart the Ray worker (its unit changed)", unit=unit_name(replica.name),
            _if=partial(_restart_due, written[replica.name], started))
    for replica, role, proc in mine:
        if proc.unit == "ray-head":
            gcs = host_port(role.address, cfg.ray_port)
            ray_ops.joined(name=f"{replica.name}: wait until all {len(replica.roles)} nodes joined Ray at {gcs}",
                           ray=ray_bin, gcs=gcs, nodes=len(replica.roles), timeout=cfg.ray_ready_timeout,
                           token_file=ray_token_file(replica.name))
