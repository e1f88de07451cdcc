"""Role ``ray``: the Ray cluster of every replica planned with ``vllm_distributed_backend: ray``.

On the replica's first node a head unit, on the others worker units (``gpufleet-ray-<replica>.service``,
user ``vllm``), each running the planner's ``ray start --block`` bound to the node's fleet address
(VLLM_HOST_IP) with every port fixed (roles/ray/defaults.yml) and the dashboard off unless
``ray_dashboard``; NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME are in each unit's environment. The order
is enforced across nodes: head started and answering, then every worker started, then the head waits
until ``ray status`` counts every node of the replica; only then does ``vllm_serve`` start vLLM on the
head. Run after ``vllm_install`` (Ray comes from the version's virtualenv) and before ``vllm_serve``.

Access: token authentication on (``RAY_AUTH_MODE=token``; ``ray_auth_token`` read on the controller and
written to ``/etc/gpufleet/secrets/<replica>.ray.env``, root 0600, which systemd reads for the unit), the
Ray Client server off (it would run code for anyone, token or not), and the unit reachable only from the
replica's nodes and the monitoring hosts (``IPAddressAllow=``, :mod:`gpufleet.deploy.access`).
"""

from __future__ import annotations

import shlex
from io import StringIO
from pathlib import Path

from pyinfra import host
from pyinfra.api.deploy import deploy
from pyinfra.facts.files import FindFiles
from pyinfra.operations import files, server, systemd

from gpufleet.config.problems import ConfigError, Problem, exit_with
from gpufleet.deploy import access
from gpufleet.deploy import vllm_files as vf
from gpufleet.deploy.context import assignments, host_config
from gpufleet.deploy.secret_ops import secret_file
from gpufleet.netaddr import host_port
from gpufleet.systemd_text import exec_line

TEMPLATES = Path(__file__).resolve().parents[2] / "templates" / "ray"
ENV_DIR = "/etc/gpufleet/ray"
UNIT_PREFIX = "gpufleet-ray-"
SECRETS_DIR = "/etc/gpufleet/secrets"  # root, 0700 (role vllm creates it too)


def unit_name(replica: str) -> str:
    return f"{UNIT_PREFIX}{replica}.service"


def token_file(replica: str) -> str:
    """The replica's Ray token as an EnvironmentFile (``RAY_AUTH_TOKEN=...``), root 0600."""
    return f"{SECRETS_DIR}/{replica}.ray.env"


def _count_nodes(ray: str, gcs: str, token: str) -> str:
    """Shell printing how many nodes ``ray status`` at ``gcs`` lists active (the token read from its file)."""
    return (f"(set -a; . {shlex.quote(token)}; set +a; RAY_AUTH_MODE=token {shlex.quote(ray)} status"
            f" --address={gcs} 2>/dev/null) | sed -n '/^Active:/,/^Pending:/p' | grep -c ' node_'")


def _wait_script(ray: str, gcs: str, nodes: int, timeout: int, token: str) -> str:
    """Shell that waits until ``ray status`` at ``gcs`` lists ``nodes`` active nodes."""
    count = _count_nodes(ray, gcs, token)
    return (f"end=$(($(date +%s)+{timeout})); while :; do n=$( {count} ); [ \"$n\" -ge {nodes} ] && break;"
            f" if [ $(date +%s) -gt $end ]; then echo \"Ray at {gcs}: $n of {nodes} nodes joined"
            f" after {timeout} s\" >&2; exit 1; fi; sleep 2; done; echo \"Ray at {gcs}: $n nodes\"")


@deploy("Ray: head and worker units of Ray replicas")
def ray() -> None:
    """Converge this node's Ray units in the order head, workers, all joined."""
    cfg = host_config()
    mine = [(replica, role, proc) for replica, role in assignments()
            for proc in role.processes if proc.unit in ("ray-head", "ray-worker")]
    present = host.get_fact(FindFiles, path="/etc/systemd/system", fname=f"{UNIT_PREFIX}*.service",
                            maxdepth=1) or []
    planned = {unit_name(replica.name) for replica, _, _ in mine}
    for stale in sorted(Path(p).name for p in present if Path(p).name not in planned):
        systemd.service(name=f"Stop {stale}, no longer planned here", service=stale, running=False, enabled=False)
        files.file(name=f"Remove {stale}", path=f"/etc/systemd/system/{stale}", present=False)
        gone = stale.removeprefix(UNIT_PREFIX).removesuffix(".service")
        files.file(name=f"Remove the Ray environment of {gone}", path=f"{ENV_DIR}/{gone}.env", present=False)
        files.file(name=f"Remove the Ray token of {gone}", path=token_file(gone), present=False)
    if not mine:
        return
    try:
        token = vf.secret_env(cfg).get("RAY_AUTH_TOKEN")
    except ConfigError as error:
        exit_with(error)
    if not token:
        exit_with(ConfigError([Problem(host.name, "ray_auth_token", "expected a secret reference ({env: NAME} or"
                                                                   " {file: PATH}) for a Ray replica, found null")]))
    monitoring = access.monitoring_group()
    files.directory(name=f"Create {ENV_DIR}", path=ENV_DIR, user="root", group="root", mode="0755")
    files.directory(name=f"Create {SECRETS_DIR} (root only)", path=SECRETS_DIR, user="root", group="root",
                    mode="0700")
    ray_bin = f"{vf.venv_dir(cfg)}/bin/ray"
    written = {}
    for replica, role, proc in mine:
        kind = "head" if proc.unit == "ray-head" else "worker"
        env = files.put(
            name=f"{replica.name}: Ray {kind} environment", dest=f"{ENV_DIR}/{replica.name}.env",
            src=StringIO(vf.env_file({"HOME": vf.HOME, **cfg.vllm_env, **proc.env},
                                     f"Written by gpufleet: environment of the Ray {kind} of {replica.name}")),
            user="root", group="root", mode="0644")
        secret = secret_file(name=f"{replica.name}: Ray token (0600)", dest=token_file(replica.name),
                             content=vf.env_file({"RAY_AUTH_TOKEN": token}, f"Ray token of {replica.name}"))
        try:
            allowed = access.ray_sources(cfg, [r.address for r in replica.roles], monitoring)
        except ConfigError as error:
            exit_with(error)
        unit = files.template(
            name=f"{replica.name}: Ray {kind} unit", src=str(TEMPLATES / "ray.service.j2"),
            dest=f"/etc/systemd/system/{unit_name(replica.name)}", user="root", group="root", mode="0644",
            kind=kind, replica=replica.name, env_file=f"{ENV_DIR}/{replica.name}.env",
            token_file=token_file(replica.name), ip_access=access.unit_lines(allowed),
            exec_start=exec_line(proc.argv), ray=ray_bin)
        systemd.daemon_reload(name=f"{replica.name}: reload systemd", _if=unit.did_change)
        written[replica.name] = (env, unit, secret)
        gcs = host_port(replica.roles[0].address, cfg.ray_port)
        if kind == "head":
            started = systemd.service(name=f"{replica.name}: start the Ray head", service=unit_name(replica.name),
                                      running=True, enabled=True)
            restarted = systemd.service(
                name=f"{replica.name}: restart the Ray head (its unit changed)", service=unit_name(replica.name),
                restarted=True,
                _if=lambda env=env, unit=unit, secret=secret, started=started:
                (env.did_change() or unit.did_change() or secret.did_change()) and not started.did_change())
            server.shell(
                name=f"{replica.name}: wait for the Ray head at {gcs}",
                commands=[_wait_script(ray_bin, gcs, 1, cfg.ray_ready_timeout, token_file(replica.name))],
                _if=lambda started=started, restarted=restarted: started.did_change() or restarted.did_change())
    # Workers join only once every head answers (operations run in this order on all hosts).
    for replica, role, proc in mine:
        if proc.unit != "ray-worker":
            continue
        env, unit, secret = written[replica.name]
        started = systemd.service(name=f"{replica.name}: start the Ray worker", service=unit_name(replica.name),
                                  running=True, enabled=True)
        systemd.service(
            name=f"{replica.name}: restart the Ray worker (its unit changed)", service=unit_name(replica.name),
            restarted=True,
            _if=lambda env=env, unit=unit, secret=secret, started=started:
            (env.did_change() or unit.did_change() or secret.did_change()) and not started.did_change())
    for replica, role, proc in mine:
        if proc.unit != "ray-head":
            continue
        gcs = host_port(role.address, cfg.ray_port)
        nodes = len(replica.roles)
        if _joined_check_needed(ray_bin, gcs, nodes, token_file(replica.name)):
            server.shell(
                name=f"{replica.name}: wait until all {nodes} nodes joined Ray at {gcs}",
                commands=[_wait_script(ray_bin, gcs, nodes, cfg.ray_ready_timeout, token_file(replica.name))],
            )


def _joined_check_needed(ray_bin: str, gcs: str, nodes: int, token: str) -> bool:
    """Whether the head must wait for its workers: not when it already counts them all (no change)."""
    from pyinfra.facts.server import Command

    count = host.get_fact(Command, command=f"{_count_nodes(ray_bin, gcs, token)} || true")
    try:
        return int(str(count).strip() or 0) < nodes
    except ValueError:
        return True
