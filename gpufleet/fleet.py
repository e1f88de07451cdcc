"""The fleet as an inventory describes it: hosts, their validated configs, and serving pools."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpufleet.config.inventory import InventoryLayers, loaded_inventory, read_inventory, validate_layers
from gpufleet.config.problems import ConfigError, Problem, exit_with
from gpufleet.config.schema import HostConfig
from gpufleet.node.health_rules import HealthPolicy


@dataclass(frozen=True)
class Fleet:
    """Validated configuration of every host, grouped into serving pools."""

    inventory: str
    hosts: list[str]
    configs: dict[str, HostConfig]
    pools: dict[str, list[str]]


def _fleet_from_layers(inventory: str, hosts: list[str], override: dict[str, Any] | None) -> Fleet:
    layers_by_file: dict[str, InventoryLayers] = {}
    missing = []
    for host in hosts:
        loaded = loaded_inventory(host)
        if loaded is None:
            missing.append(host)
        else:
            layers_by_file[loaded.path] = loaded
    if missing:
        raise ConfigError([Problem(
            inventory, "",
            "expected the inventory to end with apply_group_vars(globals()) (gpufleet.config.inventory),"
            f" found hosts it never saw: {', '.join(missing)}",
        )])
    configs: dict[str, HostConfig] = {}
    pools: dict[str, list[str]] = {}
    for loaded in layers_by_file.values():
        configs.update(validate_layers(loaded, override))
        for host in hosts:
            if host in loaded.hosts:
                pools.setdefault(loaded.pool_of(host), []).append(host)
    return Fleet(inventory, hosts, configs, pools)


def load_fleet(inventory_path: str, override: dict[str, Any] | None = None) -> Fleet:
    """Read an inventory file as pyinfra does; raises ConfigError (or exits 2 from the inventory)."""
    path = Path(inventory_path)
    if not path.is_file():
        raise ConfigError([Problem(inventory_path, "", "expected an inventory file, found no such file")])
    loaded = read_inventory(path)
    if loaded is None:
        raise ConfigError([Problem(inventory_path, "", "expected the inventory to end with"
                                   " apply_group_vars(globals()) (gpufleet.config.inventory), found no call")])
    return _fleet_from_layers(inventory_path, list(loaded.hosts), override)


def fleet_from_state(state: Any) -> Fleet:
    """The fleet of a running pyinfra deploy (``--data`` included); exits 2 on bad input.

    Call at the top of a deploy file: it validates every host before any operation is added.
    """
    inventory = state.inventory
    try:
        return _fleet_from_layers("inventory", [h.name for h in inventory], inventory.get_override_data())
    except ConfigError as error:
        exit_with(error)


def configured_health_policy(host: str) -> HealthPolicy:
    """A host's ``gpu_health`` from the inventory read last (defaults when it has none)."""
    loaded = loaded_inventory(host)
    if loaded is None:
        return HealthPolicy()
    try:
        return validate_layers(loaded)[host].gpu_health
    except ConfigError as error:
        exit_with(error)
