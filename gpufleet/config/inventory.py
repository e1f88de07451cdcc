"""YAML group_vars for pyinfra inventories, validated as the inventory is read.

An inventory file ends with ``apply_group_vars(globals())``: every group gets the values of
``group_vars/<group>.yml``, every host those of ``group_vars/all.yml``, each host is validated, and
bad input stops the run with exit 2 before pyinfra connects to any host. ``pyinfra --data`` still
overrides everything; deploys re-validate with it (``fleet_configs``).
"""

from __future__ import annotations

import runpy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpufleet.config.layers import HostLayers, Layer, display_path, read_yaml_mapping, role_default_layers
from gpufleet.config.problems import ConfigError, Problem, exit_with
from gpufleet.config.schema import HostConfig
from gpufleet.config.validate import validate_host


@dataclass(frozen=True)
class InventoryLayers:
    """What apply_group_vars learnt about one inventory file."""

    path: str
    groups: list[tuple[str, list[str]]]  # in definition order, without "all"
    hosts: dict[str, HostLayers]

    def pool_of(self, host: str) -> str:
        """A host's serving pool: the last group that lists it, the one whose values win ("all" when none does)."""
        return next((name for name, members in reversed(self.groups) if host in members), "all")


# Filled by apply_group_vars when an inventory file is executed: by host name, and by file.
_LOADED: dict[str, InventoryLayers] = {}
_BY_FILE: dict[Path, InventoryLayers] = {}


def _is_group(name: str, value: Any) -> bool:
    if name.startswith("_") or name == "all":
        return False
    hosts = value[0] if isinstance(value, tuple) and len(value) == 2 else value
    return isinstance(hosts, list) and all(isinstance(h, (str, tuple)) for h in hosts)


def _split(value: Any) -> tuple[list[Any], dict[str, Any]]:
    if isinstance(value, tuple):
        return list(value[0]), dict(value[1])
    return list(value), {}


def _host_name(entry: str | tuple[str, dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    return (entry, {}) if isinstance(entry, str) else (entry[0], dict(entry[1]))


def group_vars_dir(inventory_file: Path) -> Path:
    """``group_vars/`` beside the inventory file, else beside its folder (the project root)."""
    beside = inventory_file.parent / "group_vars"
    return beside if beside.is_dir() else inventory_file.parent.parent / "group_vars"


def collect_layers(namespace: dict[str, Any]) -> tuple[InventoryLayers, dict[str, Any], list[Problem]]:
    """Read the group_vars for an inventory namespace; returns layers, the new group values, problems."""
    inv_file = Path(namespace["__file__"]).resolve()
    inv_shown = display_path(inv_file)
    gv_dir = group_vars_dir(inv_file)
    defaults, problems = role_default_layers()

    def yaml_layer(name: str) -> Layer | None:
        path = gv_dir / f"{name}.yml"
        if not path.is_file():
            return None
        values, found = read_yaml_mapping(path)
        problems.extend(found)
        return Layer(display_path(path), values)

    all_layer = yaml_layer("all")
    new_values: dict[str, Any] = {}
    groups: list[tuple[str, list[str]]] = []
    hosts: dict[str, HostLayers] = {}
    host_data: dict[str, dict[str, Any]] = {}

    def host_layers(name: str) -> HostLayers:
        if name not in hosts:
            hosts[name] = HostLayers(name, list(defaults) + ([all_layer] if all_layer else []))
        return hosts[name]

    for name, value in list(namespace.items()):
        if not _is_group(name, value):
            continue
        entries, inline = _split(value)
        group_layer = yaml_layer(name)
        members = []
        for entry in entries:
            host, data = _host_name(entry)
            members.append(host)
            layers = host_layers(host).layers
            if group_layer:
                layers.append(group_layer)
            if inline:
                layers.append(Layer(inv_shown, inline))
            host_data.setdefault(host, {}).update(data)
        groups.append((name, members))
        new_values[name] = (entries, {**(group_layer.values if group_layer else {}), **inline})

    for host, data in host_data.items():
        if data:
            hosts[host].layers.append(Layer(inv_shown, data))

    all_hosts = [h for h in hosts]
    new_values["all"] = (all_hosts, dict(all_layer.values) if all_layer else {})
    return InventoryLayers(inv_shown, groups, hosts), new_values, problems


def validate_layers(loaded: InventoryLayers, override: dict[str, Any] | None = None) -> dict[str, HostConfig]:
    """Validate every host; raises ConfigError with every problem found."""
    problems: list[Problem] = []
    configs: dict[str, HostConfig] = {}
    for name, layers in loaded.hosts.items():
        if override:
            layers = HostLayers(name, layers.layers + [Layer("--data", override)])
        config, found = validate_host(layers, loaded.path)
        problems += found
        if config is not None:
            configs[name] = config
    if problems:
        raise ConfigError(problems)
    return configs


def apply_group_vars(namespace: dict[str, Any]) -> None:
    """Attach group_vars to the inventory's groups and validate; exit 2 on bad input."""
    loaded, new_values, problems = collect_layers(namespace)
    if problems:
        exit_with(ConfigError(problems))
    try:
        validate_layers(loaded)
    except ConfigError as error:
        exit_with(error)
    namespace.update(new_values)
    for host in loaded.hosts:
        _LOADED[host] = loaded
    _BY_FILE[Path(namespace["__file__"]).resolve()] = loaded


def loaded_inventory(host: str) -> InventoryLayers | None:
    """The layers recorded for a host when its inventory file was read."""
    return _LOADED.get(host)


def read_inventory(path: Path) -> InventoryLayers | None:
    """Execute an inventory file (as pyinfra does) and return what apply_group_vars recorded."""
    resolved = path.resolve()
    _BY_FILE.pop(resolved, None)
    runpy.run_path(str(resolved), run_name="gpufleet_inventory")
    return _BY_FILE.get(resolved)
