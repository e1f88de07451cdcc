"""The fleet as an inventory describes it: hosts, their validated configs, and serving pools."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpufleet.config.inventory import InventoryLayers, loaded_inventory, read_inventory, validate_layers
from gpufleet.config.layers import is_role_default
from gpufleet.config.problems import ConfigError, Problem, exit_with
from gpufleet.config.schema import HostConfig
from gpufleet.node.health_rules import HealthPolicy

if TYPE_CHECKING:
    from gpufleet.plan.planner import PlanProblem


@dataclass(frozen=True)
class Fleet:
    """Validated configuration of every host, grouped into serving pools."""

    inventory: str
    hosts: list[str]
    configs: dict[str, HostConfig]
    pools: dict[str, list[str]]  # serving pools: a host that only role groups list is in none

    def serves(self, host: str) -> bool:
        """Whether the host is in a serving pool (a dedicated router or monitoring host is not)."""
        return any(host in members for members in self.pools.values())


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
            if host in loaded.hosts and (pool := loaded.pool_of(host)) is not None:
                pools.setdefault(pool, []).append(host)
    return Fleet(inventory, hosts, configs, pools)


def _plan_problem(problem: PlanProblem, loaded: InventoryLayers, override: dict[str, Any] | None,
                  pools: dict[str, list[str]]) -> Problem:
    """A planner's problem as a config problem: the file that set the key to blame, where one is named."""

    def source(host: str, key: str) -> str:
        return loaded.source_of(host, key, override)

    if problem.host is not None and problem.keys:  # one process's flags
        key = problem.keys[0]
        return Problem(source(problem.host, key), key, problem.text)
    if not problem.keys:
        return Problem(loaded.path, f"pool {problem.pool}", problem.text)
    host = pools[problem.pool][0]
    # the key someone set; when the planner names only defaults, the model that does not fit them
    key = next((k for k in [*problem.keys, "vllm_model"] if not is_role_default(source(host, k))), problem.keys[0])
    return Problem(source(host, key), key, f"{problem.said_of(key)} (pool {problem.pool})")


def declared_plan_problems(loaded: InventoryLayers, configs: dict[str, HostConfig],
                           override: dict[str, Any] | None = None) -> list[Problem]:
    """The plan's problems on the declared ``gpu_profile``s, for every pool whose hosts all declare one.

    The same planner ``gpufleet plan`` runs, so what the plan refuses, ``gpufleet check`` and pyinfra
    reading the inventory refuse too.
    """
    from gpufleet.hardware_profiles import ProfileError, profile_facts
    from gpufleet.plan.planner import plan_fleet

    pools: dict[str, list[str]] = {}
    for host in loaded.hosts:
        if (pool := loaded.pool_of(host)) is not None:
            pools.setdefault(pool, []).append(host)
    declared = {pool: hosts for pool, hosts in pools.items() if all(configs[h].gpu_profile for h in hosts)}
    hosts = [h for members in declared.values() for h in members]
    if not hosts:
        return []
    facts = {}
    for host in hosts:
        try:
            facts[host] = profile_facts(str(configs[host].gpu_profile), host)
        except ProfileError as exc:
            return [Problem(loaded.source_of(host, "gpu_profile", override), "gpu_profile", str(exc), (host,))]
    plan = plan_fleet(Fleet(loaded.path, hosts, {h: configs[h] for h in hosts}, declared), facts)
    return [_plan_problem(problem, loaded, override, declared) for problem in plan.problems]


def load_fleet(inventory_path: str, override: dict[str, Any] | None = None) -> Fleet:
    """Read an inventory file as pyinfra does; raises ConfigError (or exits 2 from the inventory)."""
    path = Path(inventory_path)
    if not path.is_file():
        found = "a directory" if path.is_dir() else "no such file"
        raise ConfigError([Problem(inventory_path, "", f"expected an inventory file, found {found}")])
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
