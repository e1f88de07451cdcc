"""The typed schema of one host's fleet configuration (every variable the roles and the planner read).

Defaults live in ``roles/<role>/defaults.yml``; this module holds types, ranges and the rules that
tie several values together.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gpufleet.node.health_rules import HealthPolicy
from gpufleet.vllm_flags import SUPPORTED_VLLM_VERSIONS

Auto = Literal["auto"]
Port = Annotated[int, Field(ge=1, le=65535)]
PositiveInt = Annotated[int, Field(ge=1)]

_HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_IFNAME = re.compile(r"^[A-Za-z0-9_.:@-]{1,15}$")


class SecretRef(BaseModel):
    """Where a secret is read on the controller: an environment variable or a file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    env: str | None = None
    file: str | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> SecretRef:
        if (self.env is None) == (self.file is None):
            raise ValueError("expected exactly one of env or file")
        return self


def _secret_ref(value: Any) -> Any:
    if isinstance(value, str):
        raise ValueError(
            "expected a reference {env: NAME} or {file: PATH}, found a literal string"
            " (secrets never live in inventories or group_vars)"
        )
    return value


class HostConfig(BaseModel):
    """One host's merged configuration: role defaults < all.yml < group_vars < host data < --data."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # fleet
    fleet_address: str | None
    fleet_interface: str | None
    gpu_profile: str | None
    allow_plain_http: bool
    monitoring_addresses: list[str]
    gpu_health: HealthPolicy

    # vllm
    vllm_version: str
    vllm_model: str
    vllm_model_revision: str | None
    vllm_served_model_name: str | None
    vllm_model_config: str | None
    vllm_dtype: Literal["auto", "bfloat16", "float16", "float32"]
    vllm_quantization: str | None
    vllm_trust_remote_code: bool
    vllm_max_model_len: PositiveInt | None
    vllm_gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)]
    vllm_kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16"]
    vllm_memory_reserve_gib: Annotated[float, Field(ge=0)]
    vllm_min_concurrency: PositiveInt
    vllm_tensor_parallel_size: PositiveInt | Auto
    vllm_pipeline_parallel_size: PositiveInt | Auto
    vllm_data_parallel_size: PositiveInt
    vllm_nodes_per_replica: PositiveInt | Auto
    vllm_replicas_per_node: PositiveInt | Auto
    vllm_distributed_backend: Literal["mp", "ray"]
    vllm_port: Port
    vllm_master_port: Port
    vllm_api_key: SecretRef | None
    vllm_hf_token: SecretRef | None
    vllm_extra_args: dict[str, Any]
    vllm_env: dict[str, str]
    vllm_package: str
    vllm_system_packages: list[str]
    vllm_pip_index_url: str | None
    vllm_wheelhouse_url: str | None
    vllm_requirements_url: str | None
    vllm_model_source: str | None
    vllm_start: bool
    vllm_ready_timeout: PositiveInt
    vllm_api_allowed_from: list[str] | None

    # ray
    ray_version: str
    ray_port: Port
    ray_dashboard: bool
    ray_worker_ports: tuple[Port, Port]
    ray_ready_timeout: PositiveInt
    ray_auth_token: SecretRef | None

    # nvidia_driver
    nvidia_driver_branch: Annotated[int, Field(ge=450, le=999)]
    nvidia_driver_kernel_modules: Literal["open", "proprietary"]
    nvidia_driver_version: Annotated[str, Field(pattern=r"^[0-9][A-Za-z0-9.+~:-]*$")] | None
    nvidia_driver_reboot: Literal["never", "if-needed", "allowed"]
    nvidia_repo_url: Annotated[str, Field(pattern=r"^(https?|file)://\S+$")]
    nvidia_repo_keyring_url: Annotated[str, Field(pattern=r"^(https?|file)://\S+$")]
    nvidia_repo_key_fingerprint: Annotated[str, Field(pattern=r"^[0-9A-F]{40}$")]
    cuda_version: Annotated[str, Field(pattern=r"^\d+\.\d+$")]

    # dcgm, exporters
    dcgm_version: Annotated[str, Field(pattern=r"^\d+$")]
    dcgm_exporter_version: str | None
    dcgm_exporter_port: Port
    node_exporter_version: Annotated[str, Field(pattern=r"^\d+\.\d+\.\d+$")]
    node_exporter_port: Port
    node_exporter_install: Literal["tarball", "package"]
    node_exporter_tarball_url: Annotated[str, Field(pattern=r"^(https?|file)://\S+$")]
    node_exporter_tarball_sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    node_exporter_listen_address: Annotated[str, Field(pattern=r"^[0-9A-Fa-f.:]+$")] | None
    node_exporter_apt_source: Annotated[str, Field(pattern=r"^deb \[([^\]]* )?signed-by=/\S+( [^\]]*)?\] \S+ \S+( \S+)*$")] | None
    node_exporter_apt_keyring: str | None

    _check_secret = field_validator("vllm_api_key", "vllm_hf_token", "ray_auth_token", mode="before")(_secret_ref)

    @field_validator("vllm_version")
    @classmethod
    def _supported_version(cls, value: str) -> str:
        if value not in SUPPORTED_VLLM_VERSIONS:
            raise ValueError(f"expected one of {', '.join(SUPPORTED_VLLM_VERSIONS)}, found {value!r}")
        return value

    @field_validator("vllm_model")
    @classmethod
    def _model_ref(cls, value: str) -> str:
        if not (value.startswith("/") or _HF_ID.match(value)):
            raise ValueError(f"expected a Hugging Face id (org/name) or an absolute path, found {value!r}")
        return value

    @field_validator("fleet_interface")
    @classmethod
    def _ifname(cls, value: str | None) -> str | None:
        if value is not None and not _IFNAME.match(value):
            raise ValueError(f"expected a network interface name, found {value!r}")
        return value

    def contradictions(self) -> list[tuple[tuple[str, ...], str]]:
        """Values that each pass alone but not together: (keys involved, what is wrong)."""
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
        ports = {
            "dcgm_exporter_port": self.dcgm_exporter_port,
            "node_exporter_port": self.node_exporter_port,
            "vllm_master_port": self.vllm_master_port,
            "ray_port": self.ray_port,
        }
        taken: dict[int, str] = {}
        for key, port in ports.items():
            if port in taken:
                found.append(((key, taken[port]), f"expected a port of its own, found {port} for both {taken[port]} and {key}"))
            taken[port] = key
        api_last = self.vllm_port + 15
        for key, port in ports.items():
            if self.vllm_port <= port <= api_last:
                found.append((
                    ("vllm_port", key),
                    f"expected API ports {self.vllm_port}..{api_last} (one per replica) clear of"
                    f" {key} {port}, found an overlap",
                ))
        return found


SCHEMA_KEYS: frozenset[str] = frozenset(HostConfig.model_fields)
