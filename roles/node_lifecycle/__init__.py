"""Role ``node_lifecycle``: a node earns its place by burn-in and leaves it by quarantine.

After it, a serving node has ``/etc/gpufleet/burn-in.json`` (every bound of the burn-in: the floors of its GPU model,
gpufleet.gpu.burn_in_floors, or ``burn_in_floors``), ``/etc/gpufleet/lifecycle.json`` (the lifecycle's policy, the
findings catalog with ``node_findings`` in it, the agent's address and port, the kernel log, the burn-in's units),
``gpufleet-burn-in-quick.service`` and ``gpufleet-burn-in-full.service`` (one run of a tier each: role common's
``burn_in.py`` with the release's own Python and torch, on the GPUs, its verdict in ``/var/lib/gpufleet/burn-in/``),
and ``gpufleet-node-watch.service`` enabled and running: root runs role common's node tool
``/opt/gpufleet/node/node_watch.py``, which keeps the node's record in ``/var/lib/gpufleet/node/state.json``,
answers the routers' agent checks on ``node_agent_port`` (from the routers only), reads the kernel log for Xids
and moves the node as the catalog says, and starts a burn-in unit when one is due (gpufleet/node/node_watch.py says
how). The watch has no GPU of its own: the burn-in's units hold what it needs (devices, JIT-compiled kernels).

A node with no record, or one that has not yet passed its admission, runs the quick burn-in here, before role ray
and role vllm start anything: one that fails it is quarantined and this deploy stops on it (its evidence is in its
record). A node with no record of its own that the monitoring hosts' copy knows (it lost its disk, or was
reinstalled) gets that record back first: one that had left stays out, one in service runs the quick burn-in again.
Each node's record as the admission left it goes to the monitoring hosts' copy (role monitoring's
``node_records``), which ``gpufleet nodes`` and the next deploys read. A node that is quarantined or retired when
the deploy starts (by its own record, or the monitoring hosts' copy where that holds more) is left out of the plan
(run context). A changed unit reloads systemd; a changed unit, configuration or node tool restarts the watch. With
``node_lifecycle_enabled: false`` the watch is stopped, disabled and removed, and so are the burn-in's units. Variables:
roles/node_lifecycle/defaults.yml.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pyinfra.api.deploy import deploy
from pyinfra.context import host
from pyinfra.operations.util import any_changed

from gpufleet.config import lora_files
from gpufleet.config.inventory_shape import ROUTERS_GROUP
from gpufleet.config.schema import HostConfig
from gpufleet.config.settings.node_lifecycle import repository_catalog
from gpufleet.gpu.burn_in_floors import burn_in_floors
from gpufleet.gpu.profiles import GPU_MODELS
from gpufleet.node.findings import merged
from gpufleet.node_paths import (
    BURN_IN_DIR,
    BURN_IN_FLOORS,
    BURN_IN_TIERS,
    EVIDENCE_DIR,
    GATE_POLICY,
    GPU_SAMPLES,
    GPU_WATCH_MARKER,
    LIFECYCLE_CONFIG,
    NODE_PYTHON,
    NODE_STATE_DIR,
    NODE_STATE_FILE,
    NODE_STATE_SUMMARY,
    NODE_TOOLS_DIR,
    NODE_WATCH_SERVICE,
    QUARANTINE_CAPTURE,
    TEXTFILE_DIR,
    burn_in_service,
    node_tool,
    resolver_dir,
    unit_path,
    venv_bin,
)
from gpufleet.operations import files, lifecycle, node, systemd
from gpufleet.plan import access
from gpufleet.run.context import assignments, context, gpu_facts, host_config
from gpufleet.templates import render
from gpufleet.units.escape import exec_line
from gpufleet.values.problems import ConfigError, Problem, exit_with

SERVICE_FILE = unit_path(NODE_WATCH_SERVICE)
BURN_IN_FILES = {tier: unit_path(burn_in_service(tier)) for tier in BURN_IN_TIERS}
NODE_TEXTFILE = f"{TEXTFILE_DIR}/gpufleet-node.prom"
GIB = 1024**3


def catalog(override: dict[str, Any]) -> dict[str, Any]:
    """The findings catalog of the repository with ``node_findings`` in it, with JSON's string keys."""
    out = merged(repository_catalog(), override)
    return {"source": out["source"], "xid": {str(k): v for k, v in sorted(out["xid"].items())},
            "checks": dict(sorted(out["checks"].items()))}


def floors_values(cfg: HostConfig, gpu_name: str | None) -> dict[str, Any]:
    """Every bound of the node's burn-in: its GPU model's floors, ``burn_in_floors`` over them."""
    model = next((m.key for m in GPU_MODELS.values() if m.nvml_name == gpu_name), None)
    wanted = ("matmul_tflops", "copy_gbps", "allreduce_busbw_gbps")
    if model is None and set(cfg.burn_in_floors) != set(wanted):
        raise ConfigError([Problem(host.name, "burn_in_floors", f"expected every floor ({', '.join(wanted)}) for a"
                                   f" GPU gpufleet has no floors for, found {sorted(cfg.burn_in_floors) or 'none'}"
                                   f" (GPU {gpu_name!r})")])
    base = burn_in_floors(model) if model is not None else None
    floors = {k: float(cfg.burn_in_floors.get(k, getattr(base, k, 0.0))) for k in wanted}
    cpu = cfg.burn_in_device == "cpu"
    return {"device": cfg.burn_in_device, "dtype": "float32" if cpu else "bfloat16",
            "matmul_n": cfg.burn_in_matmul_n, "matmul_seconds": cfg.burn_in_seconds,
            "matmul_tflops": floors["matmul_tflops"], "copy_bytes": (64 if cpu else 1024) * 1024**2,
            "copy_seconds": round(cfg.burn_in_seconds / 3, 3), "copy_gbps": floors["copy_gbps"],
            "allreduce_bytes": (16 if cpu else 256) * 1024**2, "allreduce_busbw_gbps": floors["allreduce_busbw_gbps"],
            "gate_policy": GATE_POLICY}


# The node tools the watch's process loads: a change to one is a change to its configuration, which restarts it.
WATCH_TOOLS = ("node_watch.py", "findings.py", "node_state.py", "burn_in.py", "staged_adapters.py")


def tools_digest() -> str:
    """The SHA-256 of the node tools the watch loads, as the controller installs them (role common)."""
    from importlib.resources import files as package_files

    digest = hashlib.sha256()
    for tool in WATCH_TOOLS:
        digest.update(package_files("gpufleet").joinpath("node", tool).read_bytes())
    return digest.hexdigest()


def staged_adapters(cfg: HostConfig, replicas: list[str]) -> list[dict[str, str]]:
    """The LoRA adapters the node watch checks (``gpufleet/node/staged_adapters.py``): each of the pool's, for each
    replica on this node, by the weights file its resolver folder links to and their declared digest."""
    return [{"replica": replica, "name": name, "path": f"{resolver_dir(replica)}/{name}/{lora_files.WEIGHTS_FILE}",
             "sha256": adapter.sha256}
            for replica in sorted(replicas) for name, adapter in sorted(cfg.vllm_lora_adapters.items())]


def config_values(cfg: HostConfig, name: str, address: str, metrics: list[str],
                  adapters: list[dict[str, str]] | None = None) -> dict[str, Any]:
    """What the node watch reads (``/etc/gpufleet/lifecycle.json``), and the digest of the tools it runs."""
    return {
        "tools_sha256": tools_digest(),
        "node": name,
        "policy": {"readmit_passes": cfg.node_readmit_passes, "cool_off_s": int(cfg.node_cool_off_s),
                   "retire_after": cfg.node_retire_after, "retire_window_s": int(cfg.node_retire_window_s)},
        "catalog": catalog(cfg.node_findings),
        "burst_quiet_s": cfg.node_xid_burst_quiet_s,
        "kernel_log": cfg.node_kernel_log,
        "gate_marker": GPU_WATCH_MARKER,
        "gpu_samples": GPU_SAMPLES,
        "agent": {"address": address, "port": cfg.node_agent_port},
        "drain_timeout_s": cfg.node_drain_timeout_s,
        "burn_in": {"units": {tier: burn_in_service(tier) for tier in BURN_IN_TIERS}, "verdicts": BURN_IN_DIR,
                    "timeout_s": str(burn_in_timeout_s(cfg))},
        "state_file": NODE_STATE_FILE,
        "evidence_dir": EVIDENCE_DIR,
        "textfile": NODE_TEXTFILE,
        "replica_metrics": metrics,
        "capture_unit": QUARANTINE_CAPTURE,
        "adapters": adapters or [],
    }


def burn_in_timeout_s(cfg: HostConfig) -> int:
    """How long one burn-in may run: dcgmi's level 3 takes about half an hour on 8 GPUs."""
    return max(3600, int(cfg.burn_in_seconds * 10))


def burn_in_values(cfg: HostConfig, tier: str) -> dict[str, object]:
    """What templates/node_lifecycle/gpufleet-burn-in.service.j2 is rendered with, for one tier."""
    verdict = f"{BURN_IN_DIR}/{tier}.json"
    argv = [venv_bin(cfg.vllm_version, "python"), node_tool("burn_in.py"), "--tier", tier, "--floors",
            BURN_IN_FLOORS, "--out", verdict]
    return {"service": burn_in_service(tier), "tier": tier, "node_tools": NODE_TOOLS_DIR, "verdict": verdict,
            "exec_start": exec_line(argv), "timeout_s": burn_in_timeout_s(cfg),
            "state_dir": BURN_IN_DIR.removeprefix("/var/lib/"),
            "gpu": "nvml" if cfg.burn_in_device == "cpu" else "compute", "ip_access": access.unit_lines([])}


def service_values(cfg: HostConfig, allowed: list[str]) -> dict[str, object]:
    """What templates/node_lifecycle/gpufleet-node-watch.service.j2 is rendered with."""
    argv = [NODE_PYTHON, node_tool("node_watch.py"), "watch", "--config", LIFECYCLE_CONFIG]
    return {"service": NODE_WATCH_SERVICE, "node_tools": NODE_TOOLS_DIR, "exec_start": exec_line(argv),
            "state_dir": NODE_STATE_DIR.removeprefix("/var/lib/"), "textfile_dir": f"-{TEXTFILE_DIR}",
            "kernel_log": cfg.node_kernel_log, "ip_access": access.unit_lines(allowed), "state_file": NODE_STATE_FILE,
            "burn_in_services": " ".join(burn_in_service(tier) for tier in BURN_IN_TIERS)}


@deploy("Node lifecycle")
def node_lifecycle() -> None:
    """The node's watch and its configuration; the admission burn-in of a node that has not passed it."""
    cfg = host_config()
    paths = [SERVICE_FILE, *BURN_IN_FILES.values(), LIFECYCLE_CONFIG, BURN_IN_FLOORS]
    node.observe(name="Read the node lifecycle's unit, configuration and record", units=[NODE_WATCH_SERVICE],
                 paths=paths, texts=[NODE_STATE_SUMMARY, NODE_STATE_FILE])
    if not cfg.node_lifecycle_enabled:
        systemd.service(name=f"Stop and disable {NODE_WATCH_SERVICE} (node_lifecycle_enabled false)",
                        unit=NODE_WATCH_SERVICE, running=False, enabled=False)
        gone = [files.absent(name=f"Remove {path}", path=path) for path in (SERVICE_FILE, *BURN_IN_FILES.values())]
        systemd.daemon_reload(name="Reload systemd: the node lifecycle's units went", _if=any_changed(*gone))
        return
    address = cfg.fleet_address or host.name
    facts = gpu_facts()
    try:
        floors = floors_values(cfg, facts.gpus[0].name if facts is not None and facts.gpus else None)
        routers = access.deploy_group(ROUTERS_GROUP)
        allowed = access.allow_list([address], routers)
    except ConfigError as error:
        exit_with(error)
    replicas = [replica for replica, _ in assignments()]  # the replicas with a rank on this node
    metrics = sorted({f"http://{replica.api_address}/metrics" for replica in replicas
                      if replica.nodes and replica.nodes[0] == host.name})
    adapters = staged_adapters(cfg, [replica.name for replica in replicas])
    floors_file = files.file(name=f"Write the burn-in's floors {BURN_IN_FLOORS}", dest=BURN_IN_FLOORS,
                             content=json.dumps(floors, indent=1, sort_keys=True) + "\n")
    config = files.file(name=f"Write the node lifecycle's configuration {LIFECYCLE_CONFIG}", dest=LIFECYCLE_CONFIG,
                        content=json.dumps(config_values(cfg, host.name, address, metrics, adapters), indent=1) + "\n")
    burn_in_units = [
        files.file(name=f"Write the {tier} burn-in's unit {path}", dest=path,
                   content=render("node_lifecycle/gpufleet-burn-in.service.j2", **burn_in_values(cfg, tier)))
        for tier, path in BURN_IN_FILES.items()]
    unit = files.file(name=f"Write the node watch's unit {SERVICE_FILE}", dest=SERVICE_FILE,
                      content=render("node_lifecycle/gpufleet-node-watch.service.j2", **service_values(cfg, allowed)))
    systemd.daemon_reload(name="Reload systemd: the node watch's or a burn-in's unit changed",
                          _if=any_changed(unit, *burn_in_units))
    admitted = lifecycle.admission(name="Admit the node: the quick burn-in before a replica lands on it",
                                   config=LIFECYCLE_CONFIG, state_file=NODE_STATE_SUMMARY,
                                   lost=context().lost_records.get(host.name))
    lifecycle.record_seen(name="Read the node's record for the monitoring hosts' copy", state_file=NODE_STATE_FILE,
                          seen=context().records_seen,
                          fresh=lambda: admitted.is_complete() and admitted.did_change())
    systemd.restart(name=f"Restart {NODE_WATCH_SERVICE}: its unit, configuration, floors or tools changed",
                    unit=NODE_WATCH_SERVICE, _if=any_changed(unit, config, floors_file))
    systemd.service(name=f"Enable and start {NODE_WATCH_SERVICE}", unit=NODE_WATCH_SERVICE, running=True,
                    enabled=True)
