"""Ray's settings, for multi-node replicas with ``vllm_distributed_backend: ray``.

Each field is one variable's record (:mod:`gpufleet.config.settings`); ``roles/ray/defaults.yml`` is written
from them.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Field

from gpufleet.config.settings import RoleSettings, setting
from gpufleet.values import grammar, limits
from gpufleet.values.types import OptionalSecret, Port, limit, text


def _worker_ports(value: Any) -> Any:
    """Two ports, ``[first, last]``."""
    if isinstance(value, list) and len(value) != 2:
        raise ValueError(f"expected a list of two ports [first, last], found {len(value)} items")
    return tuple(value) if isinstance(value, list) else value

class RaySettings(RoleSettings):
    """Ray cluster for multi-node replicas with vllm_distributed_backend: ray.
    """

    ray_version: text(grammar.pip_version) = setting(  # type: ignore[valid-type]
        "2.60.0",
        "Ray release installed on every node of a replica (must match across them).",
        release=True,
    )

    ray_port: Port = setting(
        6379,
        "GCS port of the head node. Ray's other ports follow it: node manager +1, object manager +2, metrics +3, "
        "dashboard agent +4 (HTTP) and +5 (gRPC), runtime env agent +6, dashboard +7. The Ray Client server (it "
        "runs code for anyone who reaches it, token or not) is not started. Every port is reachable from the "
        "replica's own nodes and the monitoring hosts only (systemd IPAddressAllow=).",
        owned_env=("RAY_ADDRESS",),
    )

    ray_worker_ports: Annotated[tuple[Port, Port], BeforeValidator(_worker_ports)] = setting(
        [20000, 20199],
        "First and last port of Ray's worker processes (first <= last).",
    )

    # the bound is the unit's TimeoutStartSec, the readiness gate's time added
    ray_ready_timeout: Annotated[int, Field(ge=1), limit(
        lambda seconds: limits.systemd_seconds(seconds, limits.SYSTEMD_DEFAULT_START_S))] = setting(
        300,
        "Seconds for the head to answer and for every worker to join before the deploy fails the replica.",
    )

    ray_dashboard: bool = setting(
        False,
        "Ray's dashboard and job API execute code for whoever reaches them: off unless asked for.",
    )

    ray_auth_token: OptionalSecret = setting(
        None,
        "Ray's cluster token (RAY_AUTH_MODE=token): a secret reference, {env: NAME} or {file: PATH} on the "
        "controller, written to each node of a Ray replica in a 0600 root-owned file. Required with "
        "vllm_distributed_backend: ray.",
        secret="env_file",
    )
