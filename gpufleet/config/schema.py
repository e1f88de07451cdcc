"""The typed schema of one host's fleet configuration (every variable the roles and the planner read).

Defaults live in ``roles/<role>/defaults.yml``; this module holds types, ranges and the rules that
tie several values together. Types are strict: ``true`` is not 1 and ``"8000"`` is not 8000; a
float accepts an integer. What a well-formed name, address, URL or path is lives in ``grammar``.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from gpufleet.config import env_names, grammar, limits
from gpufleet.config.apt_source import apt_source
from gpufleet.config.problems import KeyedError, shown_key
from gpufleet.config.vllm_flags import SUPPORTED_VLLM_VERSIONS, load_catalog
from gpufleet.gpu.profiles import ProfileError, parse_profile
from gpufleet.input_files import tree_problem
from gpufleet.node.health_rules import HealthPolicy, policy_problems

Auto = Literal["auto"]
FIRST_UNPRIVILEGED_PORT = 1024
"""gpufleet's services run with an empty capability bounding set (templates/_sandbox.conf.j2): none can bind a port
below this one."""


def _unprivileged(port: int) -> int:
    """At least 1024: gpufleet's services run without the capability to bind a lower port."""
    if port < FIRST_UNPRIVILEGED_PORT:
        raise ValueError(f"expected a port from {FIRST_UNPRIVILEGED_PORT} to 65535 (the service runs without the"
                         f" capability to bind ports below {FIRST_UNPRIVILEGED_PORT}), found {port}")
    return port


Port = Annotated[int, Field(ge=1, le=65535), AfterValidator(_unprivileged)]
PositiveInt = Annotated[int, Field(ge=1)]


def _limit(check: Callable[[int], str | None]) -> AfterValidator:
    """An after-validator from a check of :mod:`gpufleet.config.limits`."""

    def validate(value: int) -> int:
        if problem := check(value):
            raise ValueError(problem)
        return value

    validate.__doc__ = check.__doc__  # what the rule is, for the reference (scripts/gen_docs.py)
    return AfterValidator(validate)


RanksInt = Annotated[int, Field(ge=1, le=limits.REPLICA_MAX_RANKS)]
SystemdSeconds = Annotated[int, Field(ge=1), _limit(limits.systemd_seconds)]
"""Seconds that reach a unit's time span or a node's wait."""

API_PORTS_WHEN_AUTO = 16
"""API ports kept free above ``vllm_port`` when ``vllm_replicas_per_node`` is auto (one per replica; a node
has at most 16 GPUs, so at most 16 single-GPU replicas)."""

WATCHDOG_MIN_STALL_S = 10
"""The shortest ``vllm_watchdog_stall_s``: the watchdog looks every 5 s, and a real completion gets that long."""

SECRET_KEYS = frozenset({"vllm_api_key", "vllm_hf_token", "ray_auth_token", "vllm_pip_index_credentials",
                         "router_vrrp_password", "router_tls_key", "router_tls_certificate"})
"""Variables whose values are secret references; a value found there is never shown."""

SECRET_TREES = frozenset({"router_clients"})
"""Variables that hold secret references among other values: no value under them is ever shown (a client written
``name: <key>``, a key under ``token:``, a list of keys), but a number among :data:`SHOWN_NUMBERS`."""

SHOWN_NUMBERS = frozenset({"requests_per_s", "concurrent_requests"})
"""A client's limits: a number found there is shown (a key is text of at least 16 characters)."""

# vllm_extra_args flags whose value gpufleet writes itself, and the variable that sets each.
OWNED_FLAGS = {
    "--host": "fleet_address", "--port": "vllm_port", "--model": "vllm_model",
    "--served-model-name": "vllm_served_model_name", "--revision": "vllm_model_revision",
    "--tensor-parallel-size": "vllm_tensor_parallel_size", "--pipeline-parallel-size": "vllm_pipeline_parallel_size",
    "--data-parallel-size": "vllm_data_parallel_size", "--max-model-len": "vllm_max_model_len",
    "--gpu-memory-utilization": "vllm_gpu_memory_utilization", "--dtype": "vllm_dtype",
    "--kv-cache-dtype": "vllm_kv_cache_dtype", "--quantization": "vllm_quantization",
    "--trust-remote-code": "vllm_trust_remote_code", "--api-key": "vllm_api_key", "--hf-token": "vllm_hf_token",
    "--config": "vllm_extra_args keys", "--distributed-executor-backend": "vllm_distributed_backend",
    "--nnodes": "vllm_nodes_per_replica", "--node-rank": "vllm_nodes_per_replica",
    "--headless": "vllm_nodes_per_replica", "--master-addr": "fleet_address", "--master-port": "vllm_master_port",
    "--data-parallel-address": "fleet_address", "--data-parallel-rpc-port": "vllm_master_port",
    "--download-dir": "vllm_model", "--tokenizer": "vllm_model",
    "--shutdown-timeout": "vllm_shutdown_timeout_s", "--max-num-queued-reqs": "vllm_max_num_queued_reqs",
}

# vllm_extra_args switches gpufleet needs off, and why.
REFUSED_SWITCHES = {
    "--disable-log-stats": "gpufleet's watchdog, readiness check and alerts read vLLM's stats from /metrics",
}

NODE_PATH_SOURCES = frozenset({"vllm_wheelhouse_url", "vllm_requirements_url"})
"""Install sources that may be a URL or an absolute path on the nodes (pip and uv read either)."""

CPU_KV_SPACE = "VLLM_CPU_KVCACHE_SPACE"
"""The ``vllm_env`` variable that sizes the KV cache of vLLM's CPU build, in whole GiB per worker."""

# Environment variables gpufleet sets itself on vLLM and Ray processes.
OWNED_ENV = {
    "CUDA_VISIBLE_DEVICES": "the plan's GPU sets", "VLLM_HOST_IP": "fleet_address",
    "NCCL_SOCKET_IFNAME": "fleet_interface", "GLOO_SOCKET_IFNAME": "fleet_interface",
    "RAY_ADDRESS": "ray_port", "VLLM_MODEL": "vllm_model", "HF_HOME": "vllm_model", "HOME": "nothing (gpufleet's)",
    "HF_HUB_OFFLINE": "vllm_model_source", "VLLM_API_KEY": "vllm_api_key", "HF_TOKEN": "vllm_hf_token",
    "VLLM_PORT": "vllm_port", "PYTHONPYCACHEPREFIX": "vllm_compile_bytecode",
    "VLLM_CACHE_ROOT": "nothing (gpufleet's, one per release)",
}


def _grammar(check: Callable[[str], str | None]) -> Callable[[Any], Any]:
    """A before-validator from a grammar check (non-text values are left to the type check)."""

    def validate(value: Any) -> Any:
        if isinstance(value, str) and (problem := check(value)):
            raise ValueError(problem)
        return value

    validate.__doc__ = check.__doc__  # what the rule is, for the reference (scripts/gen_docs.py)
    return validate


def _each(check: Callable[[str], str | None]) -> Callable[[Any], Any]:
    """A before-validator that applies a grammar check to every text item of a list."""

    def validate(value: Any) -> Any:
        if isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, str) and (problem := check(item)):
                    raise KeyedError(f"[{i}]", problem)
        return value

    validate.__doc__ = f"Each item: {check.__doc__}" if check.__doc__ else None
    return validate


def _profile(value: str) -> str | None:
    """A hardware profile, ``<count>x<GPU>[-SXM|-PCIe|-PCIe-pairs]`` (:mod:`gpufleet.gpu.profiles`), e.g.
    ``8xH100-SXM``, ``8xL40S-PCIe``, ``4xA100-PCIe-pairs``, ``2xRTX4090``."""
    try:
        parse_profile(value)
    except ProfileError as exc:
        return str(exc)
    return None


def _model(value: str) -> str | None:
    """A Hugging Face id (``org/name``), or an absolute path on the nodes strictly below the models directory."""
    return grammar.model_path(value) if value.startswith("/") else grammar.hf_repo_id(value)


def _controller_dir(value: str) -> str | None:
    """A directory on the controller that is pushed to the nodes: it exists, and holds only directories, regular
    files and links that stay inside it (a link's target would be pushed as a 0644 file)."""
    if grammar.controller_path(value) or not Path(value).expanduser().is_dir():
        return f"expected an existing directory on the controller, found {grammar.show(value)}"
    return tree_problem(Path(value).expanduser())


def _served_name(value: str) -> str | None:
    """A served model name: up to 128 characters, starting with a letter or digit, no control character, no trailing
    blank."""
    if grammar.SERVED_NAME.match(value):
        return None
    return ("expected a model name (up to 128 characters, starting with a letter or digit, no control"
            f" character, no trailing blank), found {grammar.show(value)}")


def _version(value: str) -> str | None:
    """A package version (e.g. ``4.4.1-1``): a digit, then letters, digits and ``.+~-``."""
    if value[:1].isdigit() and all(c.isalnum() or c in ".+~-" for c in value):
        return None
    return f"expected a version (e.g. 4.4.1-1), found {grammar.show(value)}"


def _worker_ports(value: Any) -> Any:
    """Two ports, ``[first, last]``."""
    if isinstance(value, list) and len(value) != 2:
        raise ValueError(f"expected a list of two ports [first, last], found {len(value)} items")
    return tuple(value) if isinstance(value, list) else value


def _health(value: Any) -> Any:
    """The GPU health gate's one schema, shared with the node's gate
    (:func:`gpufleet.node.health_rules.policy_problems`)."""
    if isinstance(value, HealthPolicy):
        return value
    problems = policy_problems(value)
    if problems:
        key, message = problems[0]
        raise KeyedError(key, message)
    return HealthPolicy(**value)


def _virtual_address(value: str) -> str | None:
    """The routers' virtual address: one unicast IPv4 address (VRRP version 2, the version with a group password)."""
    if problem := grammar.node_address(value):
        return problem
    if ":" in value:
        return ("expected an IPv4 address (VRRP 2, whose group has a password, is IPv4 only),"
                f" found {grammar.show(value)}")
    return None


def _secret_ref(value: Any) -> Any:
    """A secret's value is a reference; whatever else is found is named by its type, never shown."""
    if isinstance(value, str):
        raise ValueError(
            "expected a reference {env: NAME} or {file: PATH}, found a literal string"
            " (secrets never live in inventories or group_vars)"
        )
    if value is not None and not isinstance(value, (dict, SecretRef)):
        found = {list: "a list", bool: "true or false", int: "a number", float: "a number"}.get(type(value), "a value")
        raise ValueError(f"expected a reference {{env: NAME}} or {{file: PATH}}, found {found} (not shown: it may be"
                         " a secret)")
    return value


def _text(check: Callable[[str], str | None]) -> Any:
    return Annotated[str, BeforeValidator(_grammar(check))]


def _secret_key_path(value: Any, depth: int = 0) -> str | None:
    """The path (``.a.b``, ``[0]``) of the first secret-named key inside an option's value: a mapping, a list, or
    text that vLLM reads as JSON (``hf-overrides``, ``speculative-config``…); None when there is none."""
    if isinstance(value, str) and value.lstrip()[:1] in ("{", "["):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if depth > 64:
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and grammar.names_secret(key):
            return f".{shown_key(key)}"
        if (inner := _secret_key_path(item, depth + 1)) is not None:
            return (f"[{key}]" if isinstance(key, int) else f".{shown_key(str(key))}") + inner
    return None


class SecretRef(BaseModel):
    """Where a secret is read on the controller: an environment variable or a file."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    env: _text(grammar.env_name) | None = None  # type: ignore[valid-type]
    file: _text(grammar.controller_path) | None = None  # type: ignore[valid-type]

    @model_validator(mode="after")
    def _exactly_one(self) -> SecretRef:
        """Exactly one of ``env`` and ``file``."""
        if (self.env is None) == (self.file is None):
            raise ValueError("expected exactly one of env or file")
        return self


# --- the router's edge: client keys and TLS (checked across the fleet, secrets read: gpufleet.config.edge) ---

CLIENT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
"""A client's name: a HAProxy map key and stick-table key (no blank, at most 63 bytes) and a Prometheus label."""


def _client_names(value: Any) -> Any:
    """Client names: 1-63 of letters, digits, ``_``, ``.``, ``-``, starting with a letter or digit."""
    if isinstance(value, dict):
        for name in value:
            if not isinstance(name, str) or not CLIENT_NAME.match(name):
                raise KeyedError(str(name), "expected a client name (1-63 of letters, digits, '_', '.', '-', starting"
                                            f" with a letter or digit), found {grammar.show(name)}")
    return value


def _client_models(value: Any) -> Any:
    """A client's ``models`` given is a list of one model or more: every served model is ``models`` left out, never
    a key left empty (``models:`` alone reads as null) or an empty list (a client that could use nothing)."""
    if value is None or value == []:
        found = "models: with nothing after it (null)" if value is None else "an empty list"
        raise ValueError(f"expected a list of the served models the client may use (leave models out for every"
                         f" served model), found {found}")
    return value


class RouterClient(BaseModel):
    """One client of the routers: its key, the served models it may use, its limits (None: no limit)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    api_key: SecretRef
    models: Annotated[list[str], BeforeValidator(_each(_served_name))] | None = None  # None: every served model
    requests_per_s: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    concurrent_requests: Annotated[int, Field(ge=1, le=100_000)] | None = None

    _check_secret = field_validator("api_key", mode="before")(_secret_ref)
    _check_models = field_validator("models", mode="before")(_client_models)


class HostConfig(BaseModel):
    """One host's merged configuration: role defaults < all.yml < group_vars < host data < --data."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    # fleet
    fleet_address: _text(grammar.node_address) | None  # type: ignore[valid-type]
    fleet_interface: _text(grammar.ifname) | None  # type: ignore[valid-type]
    gpu_profile: _text(_profile) | None  # type: ignore[valid-type]
    allow_plain_http: bool
    monitoring_addresses: Annotated[list[str], BeforeValidator(_each(grammar.ip_network))]
    gpu_health: Annotated[HealthPolicy, BeforeValidator(_health)]

    # gpu_watch
    gpu_watch_interval_s: int

    # vllm
    vllm_version: Annotated[str, Field(json_schema_extra={"enum": list(SUPPORTED_VLLM_VERSIONS)})]
    vllm_model: _text(_model) | None  # type: ignore[valid-type]  # required on serving hosts (validate_host)
    vllm_model_revision: _text(grammar.hf_revision) | None  # type: ignore[valid-type]
    vllm_served_model_name: _text(_served_name) | None  # type: ignore[valid-type]
    vllm_model_config: _text(grammar.controller_path) | None  # type: ignore[valid-type]
    vllm_dtype: Literal["auto", "bfloat16", "float16", "float32"]
    vllm_quantization: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,63}$")] | None
    vllm_trust_remote_code: bool
    vllm_max_model_len: Annotated[int, Field(ge=1, le=limits.MAX_TOKENS)] | None
    vllm_gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)]
    vllm_kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16"]
    vllm_memory_reserve_gib: Annotated[float, Field(ge=0, le=1024)] | None  # GiB per GPU (the largest has 288)
    vllm_min_concurrency: Annotated[int, Field(ge=1, le=limits.MAX_COUNT)]
    vllm_tensor_parallel_size: RanksInt | Auto
    vllm_pipeline_parallel_size: RanksInt | Auto
    vllm_data_parallel_size: RanksInt
    vllm_nodes_per_replica: RanksInt | Auto
    vllm_replicas_per_node: Annotated[int, Field(ge=1, le=limits.NODE_MAX_GPUS)] | Auto
    vllm_distributed_backend: Literal["mp", "ray"]
    vllm_platform: Literal["cuda", "cpu"]
    vllm_port: Port
    vllm_master_port: Port
    vllm_rank_port: Port
    vllm_api_key: SecretRef | None
    vllm_hf_token: SecretRef | None
    vllm_extra_args: dict[str, Any]
    vllm_env: dict[str, str]
    vllm_package: _text(grammar.pip_name)  # type: ignore[valid-type]
    vllm_system_packages: Annotated[list[str], BeforeValidator(_each(grammar.deb_package))]
    vllm_pip_index_url: str | None
    vllm_pip_index_credentials: SecretRef | None
    vllm_wheelhouse_url: str | None
    vllm_requirements_url: str | None
    vllm_uv_version: _text(grammar.pip_version) | None  # type: ignore[valid-type]
    vllm_compile_bytecode: bool
    vllm_model_source: _text(_controller_dir) | None  # type: ignore[valid-type]
    vllm_start: bool
    vllm_ready_timeout: SystemdSeconds
    vllm_plan_tolerance: Annotated[float, Field(ge=0, le=1)]
    vllm_watchdog_stall_s: int
    vllm_slo_ttft_p99_s: Annotated[float, Field(gt=0, le=360)]
    vllm_slo_itl_p99_s: Annotated[float, Field(gt=0, le=60)]
    vllm_shutdown_timeout_s: Annotated[int, Field(ge=0, le=3600)]
    vllm_max_num_queued_reqs: Annotated[int, Field(ge=1, le=100_000)] | None
    vllm_api_allowed_from: Annotated[list[str], BeforeValidator(_each(grammar.ip_network))] | None

    # ray
    ray_version: _text(grammar.pip_version)  # type: ignore[valid-type]
    ray_port: Port
    ray_dashboard: bool
    ray_worker_ports: Annotated[tuple[Port, Port], BeforeValidator(_worker_ports)]
    ray_ready_timeout: Annotated[int, Field(ge=1), _limit(
        lambda seconds: limits.systemd_seconds(seconds, limits.SYSTEMD_DEFAULT_START_S))]  # + the gate: TimeoutStartSec
    ray_auth_token: SecretRef | None

    # nvidia_driver
    nvidia_driver_branch: Annotated[int, Field(ge=450, le=999)]
    nvidia_driver_kernel_modules: Literal["open", "proprietary"]
    nvidia_driver_version: _text(grammar.deb_version) | None  # type: ignore[valid-type]
    nvidia_driver_reboot: Literal["never", "if-bare", "if-needed", "allowed"]
    nvidia_repo_url: str
    nvidia_repo_keyring_url: str
    nvidia_repo_key_fingerprint: Annotated[str, Field(pattern=r"^[0-9A-F]{40}$")]
    cuda_version: Annotated[str, Field(pattern=r"^[0-9]+\.[0-9]+$")]  # ASCII digits: a package name and a path
    cuda_toolkit: bool

    # dcgm, exporters
    dcgm_version: Annotated[str, Field(pattern=r"^\d+$")]
    dcgm_exporter_version: _text(_version) | None  # type: ignore[valid-type]
    dcgm_exporter_port: Port
    dcgm_exporter_xid_window_s: Annotated[int, Field(ge=10, le=86400)]
    node_exporter_version: Annotated[str, Field(pattern=r"^\d+\.\d+\.\d+$")]
    node_exporter_port: Port
    node_exporter_install: Literal["tarball", "package"]
    node_exporter_tarball_url: str
    node_exporter_tarball_sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    node_exporter_listen_address: _text(grammar.ip_address) | None  # type: ignore[valid-type]
    node_exporter_apt_source: Annotated[
        str, Field(pattern=r"^deb \[([^\]]* )?signed-by=/\S+( [^\]]*)?\] \S+ \S+( \S+)*$")] | None
    node_exporter_apt_keyring: _text(grammar.controller_path) | None  # type: ignore[valid-type]

    # router
    router_port: Port
    router_listen_address: _text(grammar.ip_address) | None  # type: ignore[valid-type]
    router_metrics_port: Port
    router_check_interval_s: Annotated[int, Field(ge=1, le=3600)]
    router_check_fall: Annotated[int, Field(ge=1, le=100)]
    router_check_rise: Annotated[int, Field(ge=1, le=100)]
    router_timeout_s: Annotated[int, Field(ge=1, le=86400)]
    router_connect_timeout_s: Annotated[int, Field(ge=1, le=300)]
    router_retries: Annotated[int, Field(ge=0, le=10)]
    router_max_request_bytes: Annotated[int, Field(ge=16384, le=64 * 2**20)]
    router_max_connections: Annotated[int, Field(ge=1, le=500_000)]
    router_server_maxconn: Annotated[int, Field(ge=1, le=50_000)] | None
    router_queue_timeout_s: Annotated[float, Field(gt=0, le=3600)]
    # how a model's backend picks a replica (the same for every pool that serves the model)
    router_policy: Literal["leastconn", "prefix"]
    router_prefix_balance: Annotated[float, Field(gt=1, le=10)]

    # router: the edge (client keys and limits, TLS)
    router_clients: Annotated[dict[str, RouterClient], BeforeValidator(_client_names)]
    router_tls_certificate: SecretRef | None
    router_tls_key: SecretRef | None
    router_tls_ca: _text(grammar.controller_path) | None  # type: ignore[valid-type]
    router_plain_http_port: Port | None

    # keepalived: the routers' virtual address (the rules across hosts: gpufleet.plan.virtual_address)
    router_virtual_address: _text(_virtual_address) | None  # type: ignore[valid-type]
    router_virtual_interface: _text(grammar.ifname) | None  # type: ignore[valid-type]
    router_virtual_prefix: Annotated[int, Field(ge=8, le=30)]
    router_virtual_router_id: Annotated[int, Field(ge=1, le=255)]
    router_vrrp_password: SecretRef | None
    _check_vrrp_secret = field_validator("router_vrrp_password", mode="before")(_secret_ref)

    # monitoring: alert thresholds
    alert_gpu_critical_xids: list[Annotated[int, Field(ge=1, le=9999)]]
    alert_gpu_nvlink_errors_max: Annotated[int, Field(ge=0), _limit(limits.promql_int)]
    alert_gpu_thermal_throttle_ratio: Annotated[float, Field(gt=0, le=1)]
    alert_gpu_power_throttle_ratio: Annotated[float, Field(gt=0, le=1)]
    alert_gpu_error_window_s: Annotated[int, Field(ge=60, le=86400)]
    alert_gpu_missing_for_s: Annotated[int, Field(ge=0, le=86400)]
    alert_exporter_down_for_s: Annotated[int, Field(ge=0, le=86400)]
    alert_replica_down_for_s: Annotated[int, Field(ge=0, le=86400)]
    alert_engine_stall_s: Annotated[int, Field(ge=60, le=86400)]
    alert_engine_stall_for_s: Annotated[int, Field(ge=0, le=86400)]
    alert_serving_for_s: Annotated[int, Field(ge=0, le=86400)]
    alert_queue_waiting_max: Annotated[int, Field(ge=1, le=1_000_000)]
    alert_kv_cache_usage_max: Annotated[float, Field(gt=0, lt=1)]
    alert_error_ratio_max: Annotated[float, Field(gt=0, lt=1)]
    alert_capacity_ratio: Annotated[float, Field(gt=0, le=10)]
    alert_capacity_for_s: Annotated[int, Field(ge=0, le=86400)]
    alert_prefix_hit_ratio_drop: Annotated[float, Field(gt=0, lt=1)]
    alert_start_time_ratio: Annotated[float, Field(gt=1, le=10)]
    alert_model_disk_free_ratio_min: Annotated[float, Field(gt=0, lt=1)]
    alert_unit_restarts_max: Annotated[int, Field(ge=0, le=1000)]
    alert_model_replicas_min_ratio: Annotated[float, Field(gt=0, le=1)]

    # monitoring: Prometheus and Alertmanager on the monitoring hosts
    prometheus_port: Port
    prometheus_scrape_interval_s: Annotated[int, Field(ge=1, le=15)]
    prometheus_retention: _text(grammar.retention)  # type: ignore[valid-type]
    prometheus_allowed_from: Annotated[list[str], BeforeValidator(_each(grammar.ip_network))] | None
    alertmanager_listen_address: _text(grammar.ip_address)  # type: ignore[valid-type]
    alertmanager_port: Port
    alertmanager_webhook_url: str | None
    alertmanager_log_port: Port
    alertmanager_group_wait_s: Annotated[int, Field(ge=0, le=3600), _limit(limits.alertmanager_wait)]
    alertmanager_group_interval_s: Annotated[int, Field(ge=1, le=86400), _limit(limits.alertmanager_interval)]
    alertmanager_repeat_interval_s: Annotated[int, Field(ge=60, le=604800), _limit(limits.alertmanager_interval)]

    _check_secret = field_validator("vllm_api_key", "vllm_hf_token", "ray_auth_token", "vllm_pip_index_credentials",
                                    "router_tls_certificate", "router_tls_key", mode="before")(_secret_ref)

    @field_validator("gpu_watch_interval_s")
    @classmethod
    def _watch_interval(cls, value: int) -> int:
        """0 (off), or seconds from 5 to 86400."""
        if value != 0 and not 5 <= value <= 86400:
            raise ValueError(f"expected 0 (off) or seconds from 5 to 86400, found {grammar.show(value)}")
        return value

    @field_validator("vllm_watchdog_stall_s")
    @classmethod
    def _watchdog_stall(cls, value: int) -> int:
        """0 (off), or seconds from ``WATCHDOG_MIN_STALL_S`` (10) to 86400."""
        if value != 0 and not WATCHDOG_MIN_STALL_S <= value <= 86400:
            raise ValueError(f"expected 0 (off) or seconds from {WATCHDOG_MIN_STALL_S} to 86400,"
                             f" found {grammar.show(value)}")
        return value

    @field_validator("alert_gpu_critical_xids")
    @classmethod
    def _xids(cls, value: list[int]) -> list[int]:
        """At least one XID, each once."""
        if not value:
            raise ValueError("expected at least one XID (e.g. [79]), found an empty list")
        if repeated := sorted({x for x in value if value.count(x) > 1}):
            raise ValueError(f"expected each XID once, found {', '.join(map(str, repeated))} more than once")
        return value

    @field_validator("vllm_version")
    @classmethod
    def _supported_version(cls, value: str) -> str:
        """A version gpufleet has a flag catalog for (:data:`gpufleet.config.vllm_flags.SUPPORTED_VLLM_VERSIONS`)."""
        if value not in SUPPORTED_VLLM_VERSIONS:
            raise ValueError(f"expected one of {', '.join(SUPPORTED_VLLM_VERSIONS)}, found {grammar.show(value)}")
        return value

    @field_validator("vllm_requirements_url")
    @classmethod
    def _lock_placeholder(cls, value: str | None) -> str | None:
        """``{version}`` (filled with ``vllm_version``) is its only placeholder."""
        if value is not None and {"{", "}"} & set(value.replace("{version}", "")):
            raise ValueError("expected {version} (filled with vllm_version) as its only placeholder,"
                             f" found {grammar.show(value)}")
        return value

    @field_validator("vllm_env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        """Valid names, none that gpufleet sets itself (``OWNED_ENV``), loads code or changes trust
        (:mod:`gpufleet.config.env_names`), none that looks secret."""
        for name in value:
            if problem := grammar.env_name(name):
                raise KeyedError(name, problem)
            if name in OWNED_ENV or name.startswith(("NCCL_SOCKET_", "GLOO_SOCKET_")):
                raise KeyedError(name, f"expected a variable gpufleet does not set, found {name}"
                                       f" (set {OWNED_ENV.get(name, 'fleet_interface')} instead)")
            if problem := env_names.refusal(name):
                raise KeyedError(name, problem)
            if grammar.looks_secret(name):
                raise KeyedError(name, "expected no secret in vllm_env, found a secret-looking name"
                                       " (use a secret reference: vllm_api_key, vllm_hf_token)")
        return value

    def checkpoint(self) -> str:
        """``vllm_model``: the model a serving host serves (validation requires it there; a dedicated router or
        monitoring host has none)."""
        if self.vllm_model is None:
            raise ValueError("vllm_model: expected a value on a serving host, found null")
        return str(self.vllm_model)

    def vllm_downloads(self) -> bool:
        """Whether vLLM itself fetches from the hub at start: only for a draft model named by hub id in
        ``vllm_extra_args.speculative-config`` (the served model is always staged by the deploy first). Only then
        does vLLM get the hub token and hub access (no ``HF_HUB_OFFLINE``)."""
        for key, value in self.vllm_extra_args.items():
            if key.replace("_", "-") != "speculative-config":
                continue
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError:
                    return False
            model = value.get("model") if isinstance(value, dict) else None
            return isinstance(model, str) and not model.startswith("/")
        return False

    def served_model_name(self) -> str:
        """The name clients ask for the model by (``--served-model-name``): ``vllm_served_model_name``, else the
        model."""
        return str(self.vllm_served_model_name or self.checkpoint())

    def api_ports(self) -> int:
        """How many API ports above ``vllm_port`` one node may use (one per replica)."""
        return API_PORTS_WHEN_AUTO if self.vllm_replicas_per_node == "auto" else self.vllm_replicas_per_node

    def requirements_url(self) -> str | None:
        """``vllm_requirements_url`` with ``{version}`` filled with ``vllm_version``: a release's own lock."""
        url = self.vllm_requirements_url
        return url.replace("{version}", self.vllm_version) if url else None

    def contradictions(self, api_ports: int | None = None) -> list[tuple[tuple[str, ...], str]]:
        """Values that each pass alone but not together: (keys involved, what is wrong).

        ``api_ports``: the replicas the plan puts on this node, when known (else ``api_ports()``).
        """
        found: list[tuple[tuple[str, ...], str]] = []
        multi_node = self.vllm_nodes_per_replica != "auto" and self.vllm_nodes_per_replica > 1
        if multi_node and self.vllm_replicas_per_node not in ("auto", 1):
            found.append((
                ("vllm_replicas_per_node", "vllm_nodes_per_replica"),
                f"expected 1 or auto with vllm_nodes_per_replica {self.vllm_nodes_per_replica},"
                f" found {self.vllm_replicas_per_node}",
            ))
        if multi_node and self.vllm_data_parallel_size > 1:
            found.append((
                ("vllm_data_parallel_size", "vllm_nodes_per_replica"),
                f"expected 1 with vllm_nodes_per_replica {self.vllm_nodes_per_replica}"
                f" (multi-node data parallel is not planned yet), found {self.vllm_data_parallel_size}",
            ))
        if multi_node and self.fleet_interface is None:
            found.append((
                ("fleet_interface",),
                "expected an interface name for multi-node replicas (NCCL_SOCKET_IFNAME), found null",
            ))
        found += self._cpu_kv_space_problems()
        if self.vllm_distributed_backend == "ray" and self.ray_auth_token is None:
            found.append((("ray_auth_token", "vllm_distributed_backend"),
                          "expected ray_auth_token ({env: NAME} or {file: PATH}) with vllm_distributed_backend ray"
                          " (Ray's cluster token), found null"))
        found += self._gate_problems()
        found += self._port_problems(api_ports or self.api_ports())
        found += self._url_problems()
        found += self._extra_args_problems()
        return found

    def cpu_kv_space_gib(self) -> int | None:
        """``VLLM_CPU_KVCACHE_SPACE`` from ``vllm_env``: the GiB of RAM each worker of vLLM's CPU build keeps its
        KV cache in; None when unset or not a whole number (see `contradictions`)."""
        value = self.vllm_env.get(CPU_KV_SPACE, "").strip()
        return int(value) if value.isascii() and value.isdigit() and int(value) > 0 else None

    def _cpu_kv_space_problems(self) -> list[tuple[tuple[str, ...], str]]:
        value = self.vllm_env.get(CPU_KV_SPACE)
        if value is not None and self.cpu_kv_space_gib() is None:
            return [((f"vllm_env.{CPU_KV_SPACE}",), f"expected a whole number of GiB >= 1 (vLLM reads it with int()),"
                                                    f" found {grammar.show(value)}")]
        if value is None and self.vllm_platform == "cpu":
            return [((f"vllm_env.{CPU_KV_SPACE}", "vllm_platform"),
                     f"expected vllm_env to set {CPU_KV_SPACE} (the whole GiB of RAM each worker keeps its KV cache"
                     " in, which the planner sizes the cache from) with vllm_platform cpu, found none")]
        return []

    def _gate_problems(self) -> list[tuple[tuple[str, ...], str]]:
        """GPU gate rules the host can never pass: another GPU count or model than its declared ``gpu_profile``, a
        driver branch above the one gpufleet installs (``nvidia_driver_branch``)."""
        found: list[tuple[tuple[str, ...], str]] = []
        policy = self.gpu_health
        branch = self.nvidia_driver_branch
        if policy.min_driver_branch > branch:
            found.append((("gpu_health.min_driver_branch", "nvidia_driver_branch"),
                          "expected gpu_health.min_driver_branch at most nvidia_driver_branch, the branch gpufleet"
                          f" installs (the gate would never pass), found {policy.min_driver_branch} > {branch}"))
        if self.gpu_profile is None:
            return found
        profile = parse_profile(self.gpu_profile)
        if policy.expected_gpu_count is not None and policy.expected_gpu_count != profile.count:
            found.append((("gpu_health.expected_gpu_count", "gpu_profile"),
                          f"expected gpu_health.expected_gpu_count to be {profile.count}, the GPUs of gpu_profile"
                          f" {self.gpu_profile} (the gate would never pass), found {policy.expected_gpu_count}"))
        model = policy.expected_gpu_model
        if model is not None and model.lower() not in profile.gpu.nvml_name.lower():
            found.append((("gpu_health.expected_gpu_model", "gpu_profile"),
                          f"expected gpu_health.expected_gpu_model to be a part of {profile.gpu.nvml_name!r}, the"
                          f" GPU of gpu_profile {self.gpu_profile} (the gate would never pass),"
                          f" found {grammar.show(model)}"))
        return found

    def _port_problems(self, api_ports: int) -> list[tuple[tuple[str, ...], str]]:
        found: list[tuple[tuple[str, ...], str]] = []
        first, last = self.ray_worker_ports
        if first > last:
            found.append((("ray_worker_ports",), f"expected [first, last] with first <= last, found [{first}, {last}]"))
        ranges = {
            "vllm_port": (self.vllm_port, self.vllm_port + api_ports - 1),
            "ray_port": (self.ray_port, self.ray_port + 8),
            "ray_worker_ports": (min(first, last), max(first, last)),
            "vllm_master_port": (self.vllm_master_port,) * 2,
            "vllm_rank_port": (self.vllm_rank_port,) * 2,
            "node_exporter_port": (self.node_exporter_port,) * 2,
            "dcgm_exporter_port": (self.dcgm_exporter_port,) * 2,
            "prometheus_port": (self.prometheus_port,) * 2,
            "alertmanager_port": (self.alertmanager_port,) * 2,
            "alertmanager_log_port": (self.alertmanager_log_port,) * 2,
            "router_port": (self.router_port,) * 2,
            "router_metrics_port": (self.router_metrics_port,) * 2,
        }
        if self.router_plain_http_port is not None:
            ranges["router_plain_http_port"] = (self.router_plain_http_port,) * 2
        why = {"vllm_port": f"one API port per replica, {api_ports} on this node",
               "ray_port": "Ray listens on ray_port .. ray_port + 8"}
        for key, (low, high) in ranges.items():
            if high > 65535:
                found.append(((key,), f"expected ports up to 65535 ({why[key]}), found {low}..{high}"))

        def shown(key: str) -> str:
            low, high = ranges[key]
            return f"{key} {low}" if low == high else f"{key} {low}..{high}"

        keys = list(ranges)
        for i, a in enumerate(keys):
            for b in keys[i + 1:]:
                (a_low, a_high), (b_low, b_high) = ranges[a], ranges[b]
                if a_low <= b_high and b_low <= a_high:
                    if a_low == a_high == b_low == b_high:
                        message = f"expected a port of its own, found {a_low} for both {' and '.join(sorted((a, b)))}"
                        found.append(((b, a), message))
                    else:
                        found.append(((a, b), f"expected {shown(a)} clear of {shown(b)}, found an overlap"))
        return found

    def _url_problems(self) -> list[tuple[tuple[str, ...], str]]:
        found: list[tuple[tuple[str, ...], str]] = []
        plain = self.allow_plain_http
        urls = {"vllm_pip_index_url": self.vllm_pip_index_url, "vllm_wheelhouse_url": self.vllm_wheelhouse_url,
                "vllm_requirements_url": self.vllm_requirements_url, "nvidia_repo_url": self.nvidia_repo_url,
                "nvidia_repo_keyring_url": self.nvidia_repo_keyring_url,
                "node_exporter_tarball_url": self.node_exporter_tarball_url}
        for key, value in urls.items():
            hint = grammar.PIP_CREDENTIALS if key.startswith("vllm_") else grammar.NOT_SECRET_URL
            if key in NODE_PATH_SOURCES and value is not None and value.startswith("/"):
                problem = grammar.node_dir(value)  # on the nodes: pip and uv read a --find-links or -r path
            elif key in NODE_PATH_SOURCES and value is not None and "://" not in value:
                problem = f"expected a URL or an absolute path on the nodes, found {grammar.show(value)}"
            else:
                problem = grammar.url(value, plain, credentials_hint=hint) if value is not None else None
            if problem:
                found.append(((key,), problem))
        webhook = self.alertmanager_webhook_url
        if webhook and (problem := grammar.url(webhook, plain, ("https", "http"), grammar.NOT_SECRET_URL)):
            found.append((("alertmanager_webhook_url",), problem))
        elif webhook and not ipaddress.ip_address(self.alertmanager_listen_address).is_loopback:
            host = urlsplit(webhook).hostname or ""
            try:
                ipaddress.ip_address(host)
            except ValueError:
                found.append((("alertmanager_webhook_url",), "expected an IP address as its host while"
                               f" alertmanager_listen_address is {self.alertmanager_listen_address} (Alertmanager's"
                               f" IP filter admits addresses only), found {grammar.show(host)}"))
        source = self.node_exporter_apt_source
        if source is not None and (problem := apt_source(source, plain)):
            found.append((("node_exporter_apt_source",), problem))
        return found

    def _extra_args_problems(self) -> list[tuple[tuple[str, ...], str]]:
        found: list[tuple[tuple[str, ...], str]] = []
        catalog = load_catalog(self.vllm_version)
        if self.vllm_quantization is not None:
            for problem in catalog.check_config({"quantization": self.vllm_quantization}):
                found.append((("vllm_quantization",), f"vLLM {self.vllm_version}: {problem.message}"))
        for key, value in self.vllm_extra_args.items():
            where = (f"vllm_extra_args.{shown_key(key)}",)
            base = key.lstrip("-").partition(".")[0]
            spec = catalog.spec("--" + base)
            flag = spec.name if spec else "--" + base.replace("_", "-")
            if key.startswith("-"):
                found.append((where, f"expected a flag name without dashes, found {grammar.show(key)}"))
            elif flag in OWNED_FLAGS:
                found.append((where, f"expected a flag gpufleet does not own, found {flag};"
                                     f" set {OWNED_FLAGS[flag]} instead"))
            elif flag in REFUSED_SWITCHES and value is not False:
                found.append((where, f"expected {flag} left out ({REFUSED_SWITCHES[flag]}),"
                                     f" found {grammar.show(value)}"))
            elif grammar.looks_secret(base):
                found.append((where, "expected no secret in vllm_extra_args (config.yaml is 0644), found a"
                                     " secret-looking flag; use a secret reference"))
            elif nested := _secret_key_path(value):
                found.append(((f"{where[0]}{nested}",), "expected no secret in vllm_extra_args (config.yaml is 0644),"
                                                        " found a secret-named key (value not shown)"))
            else:
                for problem in catalog.check_config({key: value}):
                    message = problem.message.replace("expects ", "expected ", 1).replace(", got ", ", found ", 1)
                    at = (f"{where[0]}.{problem.subkey}",) if problem.subkey else where
                    found.append((at, f"vLLM {self.vllm_version}: {message}"))
        return found


SCHEMA_KEYS: frozenset[str] = frozenset(HostConfig.model_fields)
