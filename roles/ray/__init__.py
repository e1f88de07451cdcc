"""Role ``ray``: the Ray cluster of every replica planned with ``vllm_distributed_backend: ray``.

On the replica's first node a head unit, on the others worker units (``gpufleet-ray-<replica>.service``,
user ``vllm``), each running the planner's ``ray start --block`` bound to the node's fleet address
(VLLM_HOST_IP) with every port fixed (roles/ray/defaults.yml) and the dashboard off unless
``ray_dashboard``; NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME are in each unit's environment. The order
is enforced across nodes: head started and answering, then every worker started, then the head waits
until ``ray status`` counts every node of the replica; only then does ``vllm_serve`` start vLLM on the
head. Run after ``vllm_install`` (Ray comes from the version's virtualenv) and before ``vllm_serve``.
"""

from __future__ import annotations

import shlex
from io import StringIO
from pathlib import Path

from pyinfra import host
from pyinfra.api.deploy import deploy
from pyinfra.facts.files import FindFiles
from pyinfra.operations import files, server, systemd

from gpufleet.deploy import vllm_files as vf
from gpufleet.deploy.context import assignments, host_config

TEMPLATES = Path(__file__).resolve().parents[2] / "templates" / "ray"
ENV_DIR = "/etc/gpufleet/ray"
UNIT_PREFIX = "gpufleet-ray-"


def unit_name(replica: str) -> str:
    return f"{UNIT_PREFIX}{replica}.service"


def _wait_script(ray: str, gcs: str, nodes: int, timeout: int) -> str:
    """Shell that waits until ``ray status`` at ``gcs`` lists ``nodes`` active nodes."""
    count = (f"{shlex.quote(ray)} status --address={gcs} 2>/dev/null"
             " | sed -n '/^Active:/,/^Pending:/p' | grep -c ' node_'")
    return (f"end=$(($(date +%s)+{timeout})); while :; do n=$({count}); [ \"$n\" -ge {nodes} ] && break;"
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
    if not mine:
        return
    files.directory(name=f"Create {ENV_DIR}", path=ENV_DIR, user="root", group="root", mode="0755")
    ray_bin = f"{vf.venv_dir(cfg)}/bin/ray"
    written = {}
    for replica, role, proc in mine:
        kind = "head" if proc.unit == "ray-head" else "worker"
        env = files.put(
            name=f"{replica.name}: Ray {kind} environment", dest=f"{ENV_DIR}/{replica.name}.env",
            src=StringIO(vf.env_file({"HOME": vf.HOME, **cfg.vllm_env, **proc.env},
                                     f"Written by gpufleet: environment of the Ray {kind} of {replica.name}")),
            user="root", group="root", mode="0644")
        unit = files.template(
            name=f"{replica.name}: Ray {kind} unit", src=str(TEMPLATES / "ray.service.j2"),
            dest=f"/etc/systemd/system/{unit_name(replica.name)}", user="root", group="root", mode="0644",
            kind=kind, replica=replica.name, env_file=f"{ENV_DIR}/{replica.name}.env",
            exec_start=shlex.join(proc.argv), ray=ray_bin)
        systemd.daemon_reload(name=f"{replica.name}: reload systemd", _if=unit.did_change)
        written[replica.name] = (env, unit)
        gcs = f"{replica.roles[0].address}:{cfg.ray_port}"
        if kind == "head":
            started = systemd.service(name=f"{replica.name}: start the Ray head", service=unit_name(replica.name),
                                      running=True, enabled=True)
            restarted = systemd.service(
                name=f"{replica.name}: restart the Ray head (its unit changed)", service=unit_name(replica.name),
                restarted=True,
                _if=lambda env=env, unit=unit, started=started: (env.did_change() or unit.did_change())
                and not started.did_change())
            server.shell(
                name=f"{replica.name}: wait for the Ray head at {gcs}",
                commands=[_wait_script(ray_bin, gcs, 1, cfg.ray_ready_timeout)],
                _if=lambda started=started, restarted=restarted: started.did_change() or restarted.did_change())
    # Workers join only once every head answers (operations run in this order on all hosts).
    for replica, role, proc in mine:
        if proc.unit != "ray-worker":
            continue
        env, unit = written[replica.name]
        started = systemd.service(name=f"{replica.name}: start the Ray worker", service=unit_name(replica.name),
                                  running=True, enabled=True)
        systemd.service(
            name=f"{replica.name}: restart the Ray worker (its unit changed)", service=unit_name(replica.name),
            restarted=True,
            _if=lambda env=env, unit=unit, started=started: (env.did_change() or unit.did_change())
            and not started.did_change())
    for replica, role, proc in mine:
        if proc.unit != "ray-head":
            continue
        gcs = f"{role.address}:{cfg.ray_port}"
        nodes = len(replica.roles)
        if _joined_check_needed(ray_bin, gcs, nodes):
            server.shell(
                name=f"{replica.name}: wait until all {nodes} nodes joined Ray at {gcs}",
                commands=[_wait_script(ray_bin, gcs, nodes, cfg.ray_ready_timeout)],
            )


def _joined_check_needed(ray_bin: str, gcs: str, nodes: int) -> bool:
    """Whether the head must wait for its workers: not when it already counts them all (no change)."""
    from pyinfra.facts.server import Command

    count = host.get_fact(Command, command=f"{shlex.quote(ray_bin)} status --address={gcs} 2>/dev/null"
                                           " | sed -n '/^Active:/,/^Pending:/p' | grep -c ' node_' || true")
    try:
        return int(str(count).strip() or 0) < nodes
    except ValueError:
        return True
