"""What ties a Ray replica's vLLM to its Ray cluster on the replica's first node, the Ray head: the drop-in
``vllm@<replica>.service.d/ray.conf`` (templates/vllm/ray.conf.j2), written by the vllm role.

After a reboot of every node, systemd starts each node's units by itself; this drop-in gives the order the deploy
otherwise enforces: vLLM starts after the head's unit (``After=``) and restarts with it (``Requires=``: an explicit
restart of the head, or its automatic one after a crash, restarts vLLM too, whereas ``BindsTo=`` would stop vLLM
as the crashed head goes down, and a vLLM stopped by systemd is not started again), and its ``ExecStartPre``
(``ray_join_wait.py``) waits until every node of the replica has joined, then runs the replica's fabric check over
them (role node_lifecycle's ``node_fabric_*``, as an mp replica's ranks do) until it passes. The workers join by
themselves: their unit starts after the network and, while the head does not answer, ``ray start`` fails and
``Restart=`` tries again. Single-node and mp replicas get no drop-in: their unit is the template's alone.
"""

from __future__ import annotations

from gpufleet.config.schema import HostConfig
from gpufleet.netaddr import host_port
from gpufleet.node_paths import node_tool, ray_unit, replica_dir
from gpufleet.plan.commands import NodeRole
from gpufleet.plan.planner import Replica
from gpufleet.templates import render
from gpufleet.units.escape import exec_line, unit_value
from gpufleet.values.limits import SYSTEMD_DEFAULT_START_S
from roles.vllm.replica_files import fabric_check

TEMPLATE = "vllm/ray.conf.j2"
# vllm@.service allows 5 starts in 300 s (StartLimitBurst, StartLimitIntervalSec) and restarts 5 s after a
# failure: rounds of the wait this long never use the starts up, so the unit waits for the workers however long.
JOIN_WAIT_MIN_S = 60
GATE_S = SYSTEMD_DEFAULT_START_S  # systemd's default start timeout, left to the GPU gate that runs before the wait


def join_wait_argv(replica: Replica, role: NodeRole, ray_port: int, timeout: int,
                   fabric: dict[str, object] | None = None) -> list[str]:
    """The wait's command line, run from the replica's virtualenv against the head's GCS on this node; with
    ``fabric`` (:func:`roles.vllm.replica_files.fabric_check`), the fabric check's settings."""
    venv = f"{replica_dir(replica.name)}/venv/bin"
    argv = [f"{venv}/python", node_tool("ray_join_wait.py"), "--ray", f"{venv}/ray",
            "--address", host_port(role.address, ray_port), "--nodes", str(len(replica.roles)),
            "--timeout", str(timeout)]
    if fabric:
        argv += ["--fabric-port", str(fabric["port"]), "--fabric-backend", str(fabric["backend"]),
                 "--fabric-bytes", str(fabric["bytes"]), "--fabric-floor-gbps", str(fabric["floor_gbps"]),
                 "--fabric-timeout", str(fabric["timeout_s"])]
        argv += ["--fabric-iface", str(fabric["iface"])] if fabric["iface"] else []
    return argv


def drop_in(cfg: HostConfig, replica: Replica, role: NodeRole) -> str | None:
    """The drop-in's text on a node whose part in ``replica`` is ``role``; None but on a Ray head."""
    if role.role != "ray-head":
        return None
    timeout = max(cfg.ray_ready_timeout, JOIN_WAIT_MIN_S)
    return render(TEMPLATE, replica=unit_value(replica.name), ray_unit=unit_value(ray_unit(replica.name)),
                  nodes=len(replica.roles), timeout=timeout, start_timeout=timeout + GATE_S,
                  join_wait=exec_line(join_wait_argv(replica, role, cfg.ray_port, timeout, fabric_check(cfg))))
