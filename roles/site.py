"""The site sequence: every role in the order a deploy converges them, shared by deploys/vllm.py (which runs it)
and deploys/check.py (which works it out read-only and reports the gate and the drift). A host that serves in
no pool (a dedicated router or monitoring host) gets common, node_exporter, router, keepalived and monitoring only:
no driver, no GPU gate, no vLLM; the vLLM replicas and Ray units it ran while it served are retired. The router,
keepalived and monitoring roles act on the hosts of their inventory groups only (keepalived where the routers have
a virtual address; elsewhere it retires what it set up). Last, every host adds the monitoring hosts' start records
(``start_records``), from one line."""

from __future__ import annotations

from pyinfra.api.deploy import deploy
from pyinfra.context import host

from gpufleet.operations import gates
from gpufleet.run.context import fleet, gate_verdict
from roles.common import common
from roles.dcgm import dcgm
from roles.dcgm_exporter import dcgm_exporter
from roles.gpu_watch import gpu_watch
from roles.keepalived import keepalived
from roles.monitoring import monitoring, node_records, start_records
from roles.node_exporter import node_exporter
from roles.node_lifecycle import node_lifecycle
from roles.nvidia_driver import nvidia_driver
from roles.ray import ray
from roles.router import router
from roles.vllm import vllm_install, vllm_retire, vllm_serve


@deploy("GPU health gate")
def gpu_gate() -> None:
    """Stop a host whose GPUs fail its ``gpu_health`` policy (or that the plan cannot use) before it serves; a
    node the driver role changed, or planned from its declared profile, is judged on a fresh probe."""
    gates.gpu_gate(name="GPU health gate", verdict=gate_verdict())


def site() -> None:
    """Add every role's operations, in order, for the current host.

    Each role is called from a line of its own, never from a loop: pyinfra names an operation by the line numbers
    of its call stack alone, not by its file. Roles called from one line would give operations of different roles
    that sit at the same line of their files one name, and hosts whose roles add different operations (a PCIe node
    has no fabric manager) would then order those names in conflict: pyinfra stops on a cycle before it runs
    anything."""
    if not fleet().serves(host.name):  # a dedicated router or monitoring host
        common()
        node_exporter()
        vllm_retire()
        ray()  # plans no Ray unit here: retires those left
        router()
        keepalived()
        monitoring()
    else:
        common()
        nvidia_driver()
        dcgm()
        gpu_gate()
        node_exporter()
        dcgm_exporter()
        vllm_install()
        node_lifecycle()
        ray()
        vllm_serve()
        gpu_watch()
        router()
        keepalived()
        monitoring()
    # Every host, from these lines: their operations then follow every host's earlier ones, the serving nodes'
    # readiness waits and admissions among them, also on a dedicated monitoring host.
    start_records()
    node_records()
