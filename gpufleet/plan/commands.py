"""Every process a replica runs on every node: its program, leading arguments, typed flags and environment.

A :class:`Process` holds its flags once, as an ordered mapping with the values the planner and the validated
config decided (``str``, ``int``, ``float``, ``bool``, lists, mappings). Its command line (:attr:`Process.argv`)
and its ``vllm serve --config`` file (:meth:`Process.config_yaml`) are both rendered from that mapping.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import yaml

from gpufleet.config.schema import HostConfig
from gpufleet.netaddr import host_port
from gpufleet.node_paths import RAY_TEMP_DIR, VLLM_ROOT, venv_bin

__all__ = [
    "RAY_START_WITHOUT_CLIENT_SERVER", "RAY_TEMP_DIR", "VLLM_ROOT", "FlagValue", "NodeRole", "Process",
    "extra_flags", "ray_start_argv", "ray_start_process", "replica_roles", "secret_env_names", "serve_argv",
    "serve_flags", "serve_process",
]

Scalar: TypeAlias = str | int | float
FlagValue: TypeAlias = Scalar | bool | list[Scalar] | dict[str, Any]

CONFIG_HEADER = "# Written by gpufleet (role vllm): `vllm serve --config` of this replica.\n"


def _text(value: Scalar | dict[str, Any]) -> str:
    """One value as a command-line token: a mapping as compact JSON, anything else as ``str`` has it."""
    return json.dumps(value, separators=(",", ":")) if isinstance(value, dict) else str(value)


def _flag_tokens(name: str, value: FlagValue, joined: bool) -> list[str]:
    """``--name value`` (or ``--name=value``); true -> ``--name``, false -> ``--no-name``; a list repeats."""
    if value is True:
        return [f"--{name}"]
    if value is False:
        return [f"--no-{name}"]
    values = value if isinstance(value, list) else [value]
    if joined:
        return [f"--{name}={_text(v)}" for v in values]
    return [token for v in values for token in (f"--{name}", _text(v))]


@dataclass(frozen=True)
class Process:
    """One long-running process of a replica on one node (one systemd unit).

    ``flags`` maps a flag's name (no leading dashes) to its typed value, in command-line order; ``joined``
    renders them as ``--name=value`` (as ``ray start`` is called) instead of ``--name value``.
    """

    unit: str  # vllm, ray-head, ray-worker
    program: str
    args: list[str]  # before the flags: a subcommand, the model
    flags: dict[str, FlagValue]
    env: dict[str, str]
    joined: bool = False

    @property
    def argv(self) -> list[str]:
        """The command line, as a person reads it and as ``ExecStart=`` runs it."""
        tokens = [t for name, value in self.flags.items() for t in _flag_tokens(name, value, self.joined)]
        return [self.program, *self.args, *tokens]

    def config_yaml(self) -> str:
        """The flags as a ``vllm serve --config`` file: typed values, a mapping as its JSON text, no model."""
        config = {name: _text(value) if isinstance(value, dict) else value for name, value in self.flags.items()}
        return CONFIG_HEADER + yaml.safe_dump(config, sort_keys=False, default_flow_style=False)


@dataclass(frozen=True)
class NodeRole:
    """A node's part in a replica."""

    host: str
    address: str
    role: str  # single, mp-rank-<n>, ray-head, ray-worker
    gpus: list[int]
    processes: list[Process] = field(default_factory=list)


def _extra_value(value: Any) -> FlagValue:
    """A ``vllm_extra_args`` value as a flag's value: a list holds the text its tokens have, unless numbers."""
    if isinstance(value, list):
        return [v if isinstance(v, str | int | float) and not isinstance(v, bool) else str(v) for v in value]
    if isinstance(value, bool | int | float | str | dict):
        return value
    return str(value)


def extra_flags(extra: dict[str, Any]) -> dict[str, FlagValue]:
    """``vllm_extra_args`` as flags: null and empty lists left out; ``no-x: true`` is ``x: false``."""
    flags: dict[str, FlagValue] = {}
    for key, value in extra.items():
        name = key.lstrip("-")
        if value is None or value == []:
            continue
        if value is True and name.startswith("no-"):
            name, value = name[3:], False
        flags[name] = _extra_value(value)
    return flags


def _utilization(value: float) -> int | float:
    """``vllm_gpu_memory_utilization`` as the command line always had it: six significant digits, 1 as ``1``."""
    shown = float(f"{value:g}")
    return int(shown) if shown.is_integer() else shown


def serve_flags(cfg: HostConfig, address: str, port: int, tp: int, pp: int, dp: int,
                max_model_len: int, *, queued_reqs: int | None = None, priority: bool = False,
                usage: bool = False) -> dict[str, FlagValue]:
    """``vllm serve``'s flags for one replica, without the multi-node ones. Secrets never appear here.

    ``queued_reqs``: the plan's ``--max-num-queued-reqs`` (gpufleet.plan.admission); None writes none.
    ``priority``: ``--scheduling-policy priority`` (gpufleet.plan.priority).
    ``usage``: ``--enable-force-include-usage`` (gpufleet.plan.token_budgets)."""
    flags: dict[str, FlagValue] = {
        "served-model-name": cfg.served_model_name(),
        "host": address, "port": port, "tensor-parallel-size": tp, "pipeline-parallel-size": pp,
    }
    if dp > 1:
        flags["data-parallel-size"] = dp
    flags |= {"max-model-len": max_model_len,
              "gpu-memory-utilization": _utilization(cfg.vllm_gpu_memory_utilization)}
    if cfg.vllm_dtype != "auto":
        flags["dtype"] = cfg.vllm_dtype
    if cfg.vllm_kv_cache_dtype != "auto":
        flags["kv-cache-dtype"] = cfg.vllm_kv_cache_dtype
    if cfg.vllm_quantization:
        flags["quantization"] = cfg.vllm_quantization
    if cfg.vllm_model_revision:
        flags["revision"] = cfg.vllm_model_revision
    if cfg.vllm_trust_remote_code:
        flags["trust-remote-code"] = True
    if cfg.vllm_shutdown_timeout_s:
        flags["shutdown-timeout"] = cfg.vllm_shutdown_timeout_s
    if queued_reqs is not None:
        flags["max-num-queued-reqs"] = queued_reqs
    if priority:
        flags["scheduling-policy"] = "priority"
    if usage:
        flags["enable-force-include-usage"] = True
    return flags | extra_flags(cfg.serving_args())


def serve_process(cfg: HostConfig, flags: dict[str, FlagValue], env: dict[str, str]) -> Process:
    """``vllm serve MODEL`` with ``flags``, from the version's virtualenv."""
    return Process("vllm", venv_bin(cfg.vllm_version, "vllm"), ["serve", cfg.checkpoint()], flags, env)


def serve_argv(cfg: HostConfig, address: str, port: int, tp: int, pp: int, dp: int, max_model_len: int) -> list[str]:
    """The command line of :func:`serve_flags`."""
    return serve_process(cfg, serve_flags(cfg, address, port, tp, pp, dp, max_model_len), {}).argv


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
    if cfg.vllm_hf_token and cfg.vllm_downloads():
        names.append("HF_TOKEN")  # only for what vLLM fetches itself: the deploy stages the served model
    if cfg.vllm_distributed_backend == "ray" and cfg.ray_auth_token:
        names.append("RAY_AUTH_TOKEN")  # vLLM joins the replica's Ray cluster as a driver
    return names


# ``ray start`` as the ``ray`` command runs it, with the Ray Client server off: it runs code for whoever reaches
# its port and checks no token, and Ray 2.60 starts it on every head (``--ray-client-server-port`` takes
# 1024-65535 only) unless Ray believes its client dependencies missing.
RAY_START_WITHOUT_CLIENT_SERVER = (
    "import sys, ray.scripts.scripts as s; "
    "s.get_ray_client_dependency_error = lambda: ImportError('Ray Client server off (gpufleet)'); "
    "sys.exit(s.main())"
)


def _ray_port_flags(cfg: HostConfig) -> dict[str, FlagValue]:
    base = cfg.ray_port
    return {"node-manager-port": base + 1, "object-manager-port": base + 2, "metrics-export-port": base + 3,
            "dashboard-agent-listen-port": base + 4, "dashboard-agent-grpc-port": base + 5,
            "runtime-env-agent-port": base + 6, "min-worker-port": cfg.ray_worker_ports[0],
            "max-worker-port": cfg.ray_worker_ports[1], "temp-dir": RAY_TEMP_DIR,
            "disable-usage-stats": True, "block": True}


def _ray_head_flags(cfg: HostConfig, address: str) -> dict[str, FlagValue]:
    flags: dict[str, FlagValue] = {"head": True, "port": cfg.ray_port, "node-ip-address": address}
    # Ray's option takes the word: --include-dashboard=true|false
    if cfg.ray_dashboard:
        flags |= {"include-dashboard": "true", "dashboard-host": address, "dashboard-port": cfg.ray_port + 7}
    else:
        flags["include-dashboard"] = "false"
    return flags | _ray_port_flags(cfg)


def ray_start_process(cfg: HostConfig, address: str, head: str | None, env: dict[str, str]) -> Process:
    """``ray start`` for a head (head None; without the Ray Client server) or a worker joining ``head``; every
    address explicit and every port fixed (ray_port + 1 ... ray_port + 7, workers ray_worker_ports), so a
    firewall can name them."""
    version = cfg.vllm_version
    if head is None:
        return Process("ray-head", venv_bin(version, "python"), ["-c", RAY_START_WITHOUT_CLIENT_SERVER, "start"],
                       _ray_head_flags(cfg, address), env, joined=True)
    flags: dict[str, FlagValue] = {"address": host_port(head, cfg.ray_port), "node-ip-address": address}
    return Process("ray-worker", venv_bin(version, "ray"), ["start"], flags | _ray_port_flags(cfg), env, joined=True)


def ray_start_argv(cfg: HostConfig, address: str, head: str | None) -> list[str]:
    """The command line of :func:`ray_start_process`."""
    return ray_start_process(cfg, address, head, {}).argv


def _ray_roles(cfgs: list[HostConfig], hosts: list[str], addresses: list[str], gpus: list[list[int]],
               serve: dict[str, FlagValue]) -> list[NodeRole]:
    """A Ray head (with vLLM as its driver) and workers."""
    roles = []
    head = addresses[0]
    for rank, (cfg, host, address, node_gpus) in enumerate(zip(cfgs, hosts, addresses, gpus, strict=True)):
        env = node_env(cfg, address, node_gpus) | {
            "RAY_ADDRESS": host_port(head, cfg.ray_port),
            "RAY_AUTH_MODE": "token",  # the token itself: RAY_AUTH_TOKEN from a 0600 EnvironmentFile
            # A Ray node stops at once: its own drain on SIGTERM (for Ray Serve) asks the GCS, which the unit's
            # `ray stop` has already ended, and waited out its 30 s on every stop and reboot (lab: 35 s, exit 1).
            # vLLM, stopped first (its unit is ordered after the Ray node's), drains its own requests.
            "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
        }
        if rank == 0:
            vllm = serve_process(cfg, serve | {"distributed-executor-backend": "ray"}, env)
            roles.append(NodeRole(host, address, "ray-head", node_gpus,
                                  [ray_start_process(cfg, address, None, env), vllm]))
        else:
            roles.append(NodeRole(host, address, "ray-worker", node_gpus, [ray_start_process(cfg, address, head, env)]))
    return roles


def _mp_flags(cfg: HostConfig, nodes: int, rank: int, head: str) -> dict[str, FlagValue]:
    """vLLM's own multi-node flags (the mp backend): rank 0 serves the API, the others are headless."""
    flags: dict[str, FlagValue] = {"distributed-executor-backend": "mp", "nnodes": nodes, "node-rank": rank,
                                   "master-addr": head, "master-port": cfg.vllm_master_port}
    if rank > 0:
        flags["headless"] = True
    return flags


def replica_roles(
    cfgs: list[HostConfig], hosts: list[str], addresses: list[str], gpus: list[list[int]],
    port: int, tp: int, pp: int, dp: int, max_model_len: int, *, queued_reqs: int | None = None,
    priority: bool = False, usage: bool = False,
) -> list[NodeRole]:
    """Every node's role and processes for one replica (one node, or several with PP across them);
    ``queued_reqs``, ``priority`` and ``usage`` as :func:`serve_flags` takes them."""
    if len(hosts) == 1:
        flags = serve_flags(cfgs[0], addresses[0], port, tp, pp, dp, max_model_len, queued_reqs=queued_reqs,
                            priority=priority, usage=usage)
        vllm = serve_process(cfgs[0], flags, node_env(cfgs[0], addresses[0], gpus[0]))
        return [NodeRole(hosts[0], addresses[0], "single", gpus[0], [vllm])]
    if cfgs[0].vllm_distributed_backend == "ray":
        serve = serve_flags(cfgs[0], addresses[0], port, tp, pp, dp, max_model_len, queued_reqs=queued_reqs,
                            priority=priority, usage=usage)
        return _ray_roles(cfgs, hosts, addresses, gpus, serve)
    roles = []
    for rank, (cfg, host, address, node_gpus) in enumerate(zip(cfgs, hosts, addresses, gpus, strict=True)):
        flags = serve_flags(cfg, address, port, tp, pp, dp, max_model_len,
                            queued_reqs=queued_reqs, priority=priority, usage=usage) | _mp_flags(
                                cfg, len(hosts), rank, addresses[0])
        vllm = serve_process(cfg, flags, node_env(cfg, address, node_gpus))
        roles.append(NodeRole(host, address, f"mp-rank-{rank}", node_gpus, [vllm]))
    return roles
