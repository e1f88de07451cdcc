"""The argv and environment of every process a replica runs on every node."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from gpufleet.config.schema import HostConfig
from gpufleet.netaddr import host_port

VLLM_ROOT = "/opt/vllm"


@dataclass(frozen=True)
class Process:
    """One long-running process of a replica on one node (one systemd unit)."""

    unit: str  # vllm, ray-head, ray-worker
    argv: list[str]
    env: dict[str, str]


@dataclass(frozen=True)
class NodeRole:
    """A node's part in a replica."""

    host: str
    address: str
    role: str  # single, mp-rank-<n>, ray-head, ray-worker
    gpus: list[int]
    processes: list[Process] = field(default_factory=list)


def vllm_binary(version: str) -> str:
    """Each vLLM version has its own virtualenv, so an upgrade can switch and roll back."""
    return f"{VLLM_ROOT}/{version}/bin/vllm"


def flag_args(flags: dict[str, Any]) -> list[str]:
    """``vllm_extra_args`` as command-line tokens: true -> --x, false -> --no-x, lists repeat, mappings as JSON."""
    out: list[str] = []
    for name, value in flags.items():
        flag = "--" + name.lstrip("-")
        if value is True:
            out.append(flag)
        elif value is False:
            out.append("--no-" + name.lstrip("-"))
        elif isinstance(value, list):
            for item in value:
                out += [flag, str(item)]
        elif isinstance(value, dict):
            out += [flag, json.dumps(value, separators=(",", ":"))]
        elif value is not None:
            out += [flag, str(value)]
    return out


def serve_argv(cfg: HostConfig, address: str, port: int, tp: int, pp: int, dp: int, max_model_len: int) -> list[str]:
    """``vllm serve`` for one replica, without the multi-node flags. Secrets never appear here."""
    argv = [vllm_binary(cfg.vllm_version), "serve", cfg.vllm_model,
            "--served-model-name", cfg.vllm_served_model_name or cfg.vllm_model,
            "--host", address, "--port", str(port),
            "--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp)]
    if dp > 1:
        argv += ["--data-parallel-size", str(dp)]
    argv += ["--max-model-len", str(max_model_len),
             "--gpu-memory-utilization", f"{cfg.vllm_gpu_memory_utilization:g}"]
    if cfg.vllm_dtype != "auto":
        argv += ["--dtype", cfg.vllm_dtype]
    if cfg.vllm_kv_cache_dtype != "auto":
        argv += ["--kv-cache-dtype", cfg.vllm_kv_cache_dtype]
    if cfg.vllm_quantization:
        argv += ["--quantization", cfg.vllm_quantization]
    if cfg.vllm_model_revision:
        argv += ["--revision", cfg.vllm_model_revision]
    if cfg.vllm_trust_remote_code:
        argv.append("--trust-remote-code")
    return argv + flag_args(cfg.vllm_extra_args)


def node_env(cfg: HostConfig, address: str, gpus: list[int]) -> dict[str, str]:
    """Environment of a replica's processes on one node."""
    env = {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in gpus), "VLLM_HOST_IP": address}
    if cfg.fleet_interface:
        env["NCCL_SOCKET_IFNAME"] = cfg.fleet_interface
        env["GLOO_SOCKET_IFNAME"] = cfg.fleet_interface
    return env


def secret_env_names(cfg: HostConfig) -> list[str]:
    """Variables a replica gets from its 0600 EnvironmentFile (values never in the plan)."""
    names = []
    if cfg.vllm_api_key:
        names.append("VLLM_API_KEY")
    if cfg.vllm_hf_token:
        names.append("HF_TOKEN")
    if cfg.vllm_distributed_backend == "ray" and cfg.ray_auth_token:
        names.append("RAY_AUTH_TOKEN")  # vLLM joins the replica's Ray cluster as a driver
    return names


RAY_TEMP_DIR = "/var/lib/vllm/ray"  # outside vLLM's PrivateTmp, so vLLM's driver reaches the local raylet


# ``ray start`` as the ``ray`` command runs it, with the Ray Client server off: it runs code for whoever reaches
# its port and checks no token, and Ray 2.60 starts it on every head (``--ray-client-server-port`` takes
# 1024-65535 only) unless Ray believes its client dependencies missing.
RAY_START_WITHOUT_CLIENT_SERVER = (
    "import sys, ray.scripts.scripts as s; "
    "s.get_ray_client_dependency_error = lambda: ImportError('Ray Client server off (gpufleet)'); "
    "sys.exit(s.main())"
)


def ray_start_argv(cfg: HostConfig, address: str, head: str | None) -> list[str]:
    """``ray start`` for a head (head None; without the Ray Client server) or a worker joining ``head``; every
    address explicit and every port fixed (ray_port + 1 ... ray_port + 7, workers ray_worker_ports), so a
    firewall can name them."""
    ray = f"{VLLM_ROOT}/{cfg.vllm_version}/bin/ray"
    base = cfg.ray_port
    ports = [f"--node-manager-port={base + 1}", f"--object-manager-port={base + 2}",
             f"--metrics-export-port={base + 3}", f"--dashboard-agent-listen-port={base + 4}",
             f"--dashboard-agent-grpc-port={base + 5}", f"--runtime-env-agent-port={base + 6}",
             f"--min-worker-port={cfg.ray_worker_ports[0]}", f"--max-worker-port={cfg.ray_worker_ports[1]}",
             f"--temp-dir={RAY_TEMP_DIR}", "--disable-usage-stats", "--block"]
    if head is None:
        dashboard = ["--include-dashboard=true", f"--dashboard-host={address}", f"--dashboard-port={base + 7}"] \
            if cfg.ray_dashboard else ["--include-dashboard=false"]
        return [f"{VLLM_ROOT}/{cfg.vllm_version}/bin/python", "-c", RAY_START_WITHOUT_CLIENT_SERVER, "start",
                "--head", f"--port={base}", f"--node-ip-address={address}", *dashboard, *ports]
    return [ray, "start", f"--address={host_port(head, base)}", f"--node-ip-address={address}", *ports]


def replica_roles(
    cfgs: list[HostConfig], hosts: list[str], addresses: list[str], gpus: list[list[int]],
    port: int, tp: int, pp: int, dp: int, max_model_len: int,
) -> list[NodeRole]:
    """Every node's role and processes for one replica (one node, or several with PP across them)."""
    base = serve_argv(cfgs[0], addresses[0], port, tp, pp, dp, max_model_len)
    if len(hosts) == 1:
        env = node_env(cfgs[0], addresses[0], gpus[0])
        return [NodeRole(hosts[0], addresses[0], "single", gpus[0], [Process("vllm", base, env)])]
    roles = []
    head = addresses[0]
    for rank, (cfg, host, address, node_gpus) in enumerate(zip(cfgs, hosts, addresses, gpus)):
        env = node_env(cfg, address, node_gpus)
        if cfg.vllm_distributed_backend == "ray":
            env["RAY_ADDRESS"] = host_port(head, cfg.ray_port)
            env["RAY_AUTH_MODE"] = "token"  # the token itself: RAY_AUTH_TOKEN from a 0600 EnvironmentFile
            if rank == 0:
                procs = [Process("ray-head", ray_start_argv(cfg, address, None), env),
                         Process("vllm", base + ["--distributed-executor-backend", "ray"], env)]
                roles.append(NodeRole(host, address, "ray-head", node_gpus, procs))
            else:
                procs = [Process("ray-worker", ray_start_argv(cfg, address, head), env)]
                roles.append(NodeRole(host, address, "ray-worker", node_gpus, procs))
            continue
        argv = serve_argv(cfg, address, port, tp, pp, dp, max_model_len) + [
            "--distributed-executor-backend", "mp", "--nnodes", str(len(hosts)), "--node-rank", str(rank),
            "--master-addr", head, "--master-port", str(cfg.vllm_master_port)]
        if rank > 0:
            argv.append("--headless")
        roles.append(NodeRole(host, address, f"mp-rank-{rank}", node_gpus, [Process("vllm", argv, env)]))
    return roles
