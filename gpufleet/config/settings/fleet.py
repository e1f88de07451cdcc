"""Fleet-wide node identity and network: the settings every role and the planner read.

Each field is one variable's record (:mod:`gpufleet.config.settings`); ``roles/fleet/defaults.yml`` is written
from them.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator

from gpufleet.config.settings import RoleSettings, setting
from gpufleet.gpu.profiles import ProfileError, parse_profile
from gpufleet.node.health_rules import HealthPolicy, policy_problems
from gpufleet.values import grammar
from gpufleet.values.problems import KeyedError
from gpufleet.values.types import each, text


def _profile(value: str) -> str | None:
    """A hardware profile, ``<count>x<GPU>[-SXM|-PCIe|-PCIe-pairs]`` (:mod:`gpufleet.gpu.profiles`), e.g.
    ``8xH100-SXM``, ``8xL40S-PCIe``, ``4xA100-PCIe-pairs``, ``2xRTX4090``."""
    try:
        parse_profile(value)
    except ProfileError as exc:
        return str(exc)
    return None


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

class FleetSettings(RoleSettings):
    """Fleet-wide node identity and network, read by every role and by the planner.
    """

    fleet_address: text(grammar.node_address) | None = setting(  # type: ignore[valid-type]
        None,
        "Address of this node on the fleet network (VLLM_HOST_IP, Ray node IP, vLLM --host). null: the inventory "
        "host name.",
        owned_flags=("--host", "--master-addr", "--data-parallel-address"), owned_env=("VLLM_HOST_IP",),
    )

    fleet_interface: text(grammar.ifname) | None = setting(  # type: ignore[valid-type]
        None,
        "Network interface of the fleet network, exported as NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME. Required "
        "for multi-node replicas (hosts with several NICs pick the wrong one otherwise).",
        owned_env=("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"),
    )

    gpu_profile: text(_profile) | None = setting(  # type: ignore[valid-type]
        None,
        "Declared hardware profile, for offline planning and for a deploy to plan a node whose NVML cannot answer "
        "yet (no driver: it converges in one run, and its gate requires the profile's GPUs), e.g. 8xH100-SXM, "
        "8xH200-SXM, 8xA100-SXM, 8xL40S-PCIe, 4xA100-PCIe-pairs, 8xA100-PCIe-pairs, 2xRTX4090. Otherwise probed "
        "facts win (gpufleet plan --facts DIR, or a deploy's probe).",
    )

    gpu_health: Annotated[HealthPolicy, BeforeValidator(_health)] = setting(
        {},
        "Health gate thresholds, checked before vLLM starts (also as the unit's ExecStartPre) and by the GPU "
        "health watch while it serves. A key left out keeps its default (the keys and their defaults: the type "
        "above).",
    )

    allow_plain_http: bool = setting(
        False,
        "Plain-http sources (apt repositories, pip index, wheelhouse, lock): refused unless this is true. A site's "
        "own mirror on a private network may need it; apt's signatures and the lock's hashes then carry the "
        "integrity. A source marked trusted=yes is refused whatever this says.",
    )

    monitoring_addresses: Annotated[list[str], BeforeValidator(each(grammar.ip_network))] = setting(
        [],
        "Addresses (or CIDR networks) of the hosts that scrape metrics: node_exporter, dcgm-exporter and the Ray "
        "heads' metrics accept connections from these (and the node itself) only. Hosts of an inventory group "
        "named `monitoring` are added. Empty: only the node itself reaches them.",
    )
