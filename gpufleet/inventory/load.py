"""YAML group_vars for pyinfra inventories, validated as the inventory is read.

An inventory file ends with ``apply_group_vars(globals())``: every group gets the values of
``group_vars/<group>.yml``, every host those of ``group_vars/all.yml``, each host is validated, the
plan's rules run on the declared ``gpu_profile``s, and bad input stops the run with exit 2 before
pyinfra connects to any host. ``pyinfra --data`` still overrides everything: under pyinfra's CLI its
``--data`` arguments are validated here too, and deploys re-validate with them (``fleet_from_state``).
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpufleet.config.edge import edge_problems
from gpufleet.config.fleet import Fleet
from gpufleet.config.group_vars_files import group_vars_file_problems
from gpufleet.config.inventory_shape import (
    ROLE_GROUPS,
    ROUTERS_GROUP,
    SourceLines,
    late_problems,
    membership_problems,
    read_groups,
)
from gpufleet.config.layers import (
    HostLayers,
    Layer,
    display_path,
    is_role_default,
    read_yaml_mapping,
    role_default_layers,
)
from gpufleet.config.schema import HostConfig
from gpufleet.config.secrets import ENV_FILE_SECRETS, unfit_secret
from gpufleet.config.settings.vllm import API_PORTS_WHEN_AUTO
from gpufleet.config.validate import validate_host
from gpufleet.config.yaml_strict import DECIMAL_INT
from gpufleet.gpu.profiles import ProfileError, profile_facts
from gpufleet.input_files import found_at, json_depth_problem
from gpufleet.node.health_rules import HealthPolicy
from gpufleet.node_paths import replica_host_part
from gpufleet.plan import virtual_address
from gpufleet.plan.planner import PlanProblem, plan_fleet
from gpufleet.pyinfra_seam import cli_file_error, under_pyinfra_cli, wrap_inventory_exec
from gpufleet.values import grammar, limits
from gpufleet.values.problems import EXIT_BAD_INPUT, ConfigError, Problem, exit_with, shown_key
from gpufleet.values.types import SecretRef


@dataclass(frozen=True)
class InventoryLayers:
    """What apply_group_vars learnt about one inventory file."""

    path: str
    groups: list[tuple[str, list[str]]]  # in definition order, without "all"
    hosts: dict[str, HostLayers]

    def pool_of(self, host: str) -> str | None:
        """A host's serving pool: the last serving group that lists it ("all" when no group does); None for a
        host that only :data:`ROLE_GROUPS` list (a dedicated router or monitoring host)."""
        listed = [name for name, members in self.groups if host in members]
        pools = [name for name in listed if name not in ROLE_GROUPS]
        if pools:
            return pools[-1]
        return None if listed else "all"

    def source_of(self, host: str, key: str, override: dict[str, Any] | None = None) -> str:
        """The file that set the variable a key path (``gpu_health.min_driver_branch``) starts with for ``host``:
        ``--data``, a group_vars file, the inventory, a role's defaults; the inventory when nothing set it."""
        variable = key.split(".")[0].split("[")[0]
        layers = self.hosts[host].layers + ([Layer("--data", override)] if override else [])
        return HostLayers(host, layers).merged()[1].get(variable, self.path)

    def label_of(self, host: str) -> str:
        """The group a host's metrics carry as their ``pool`` label: its serving pool, else the last role group
        that lists it (``routers``, ``monitoring``)."""
        listed = [name for name, members in self.groups if host in members]
        return self.pool_of(host) or listed[-1]


# Filled by apply_group_vars when an inventory file is executed: by host name, and by file.
_LOADED: dict[str, InventoryLayers] = {}
_BY_FILE: dict[Path, InventoryLayers] = {}


def group_vars_dir(inventory_file: Path) -> Path:
    """``group_vars/`` beside the inventory file (whatever it is: one that is not a directory is refused), else beside
    its folder (for ``inventories/prod.py``, the checkout's top)."""
    beside = inventory_file.parent / "group_vars"
    return beside if os.path.lexists(beside) else inventory_file.parent.parent / "group_vars"


def collect_layers(namespace: dict[str, Any]) -> tuple[InventoryLayers, dict[str, Any], list[Problem]]:
    """Read the group_vars for an inventory namespace; returns layers, the new group values, problems."""
    inv_file = Path(namespace["__file__"]).resolve()
    inv_shown = display_path(inv_file)
    gv_dir = group_vars_dir(inv_file)
    defaults, problems = role_default_layers()

    def yaml_layer(name: str) -> Layer | None:
        path = gv_dir / f"{name}.yml"
        if not path.exists() and not path.is_symlink():  # a link that leads nowhere is said, not skipped
            return None
        values, found = read_yaml_mapping(path)
        problems.extend(found)
        return Layer(display_path(path), values)

    all_layer = yaml_layer("all")
    new_values: dict[str, Any] = {}
    hosts: dict[str, HostLayers] = {}
    host_data: dict[str, dict[str, Any]] = {}

    def host_layers(name: str) -> HostLayers:
        if name not in hosts:
            hosts[name] = HostLayers(name, list(defaults) + ([all_layer] if all_layer else []))
        return hosts[name]

    lines = SourceLines(inv_file)
    found_groups, shape = read_groups(namespace, lines, inv_shown)
    problems += shape + membership_problems(found_groups, lines, inv_shown)
    problems += group_vars_file_problems(gv_dir, inv_file, [g.name for g in found_groups])
    for group in found_groups:
        group_layer = yaml_layer(group.name)
        for host, data in group.hosts:
            layers = host_layers(host).layers
            if group_layer:
                layers.append(group_layer)
            if group.data:
                layers.append(Layer(inv_shown, group.data))
            host_data.setdefault(host, {}).update(data)
        entries = [host if not data else (host, data) for host, data in group.hosts]
        new_values[group.name] = (entries, {**(group_layer.values if group_layer else {}), **group.data})
    groups = [(g.name, list(dict.fromkeys(host for host, _ in g.hosts))) for g in found_groups]

    for host, data in host_data.items():
        if data:
            hosts[host].layers.append(Layer(inv_shown, data))

    all_hosts = list(hosts)
    new_values["all"] = (all_hosts, dict(all_layer.values) if all_layer else {})
    return InventoryLayers(inv_shown, groups, hosts), new_values, problems


def _host_problems(loaded: InventoryLayers, configs: dict[str, HostConfig],
                   override: dict[str, Any] | None) -> list[Problem]:
    """What no single host shows: bad host names, one fleet_address on two hosts."""
    problems = [Problem(loaded.path, "hosts", message) for host in loaded.hosts
                if (message := grammar.host_name(host))]
    owner: dict[str, str] = {}
    for host, config in configs.items():
        address = config.fleet_address
        if address is None:
            continue
        if address in owner:
            problems.append(Problem(loaded.source_of(host, "fleet_address", override), "fleet_address",
                                    f"expected an address of its own per host, found {address} for both"
                                    f" {owner[address]} and {host}"))
        owner.setdefault(address, host)
    return problems


def _replica_name_problems(loaded: InventoryLayers) -> list[Problem]:
    """Pools whose replicas' names a HAProxy server or a systemd unit cannot hold: the planner names a replica
    ``<pool>-<host's first label>[-<k>]`` (``k`` up to one per API port), or ``<pool>-<k>`` across nodes."""
    problems: list[Problem] = []
    for host in loaded.hosts:
        pool = loaded.pool_of(host)
        if pool is None:
            continue
        longest = f"{pool}-{replica_host_part(host)}-{API_PORTS_WHEN_AUTO - 1}"
        if problem := limits.replica_name(pool, longest):
            shown = pool if len(pool) <= 40 else f"{pool[:37]}..."
            problems.append(Problem(loaded.path, f"{shown} (a pool)", problem, (host,)))
    return problems


def _secret_content_problems(loaded: InventoryLayers, configs: dict[str, HostConfig],
                             override: dict[str, Any] | None) -> list[Problem]:
    """Secrets bound for an environment file that the controller reads now with a line break or control character
    in them (each reference read once, none shown)."""
    problems: list[Problem] = []
    seen: dict[SecretRef, str | None] = {}
    for host, config in configs.items():
        for key in ENV_FILE_SECRETS:
            ref = getattr(config, key)
            if ref is None:
                continue
            if ref not in seen:
                seen[ref] = unfit_secret(ref)
            if seen[ref] is not None:
                problems.append(Problem(loaded.source_of(host, key, override), key, str(seen[ref]), (host,)))
    return problems


def _virtual_address_problems(loaded: InventoryLayers, configs: Mapping[str, HostConfig],
                              override: dict[str, Any] | None = None) -> list[Problem]:
    """:func:`gpufleet.plan.virtual_address.problems` for an inventory as ``apply_group_vars`` read it (``--data``
    included)."""

    def set_by(host: str, key: str) -> str | None:
        """The file that set ``key`` for ``host`` (a role's defaults.yml, or None, where none did)."""
        layers = loaded.hosts[host].layers + ([Layer("--data", override)] if override else [])
        return HostLayers(host, layers).merged()[1].get(key)

    def source(host: str, key: str) -> str:
        """The file that set ``key`` for ``host``; for a role's default, the file that set the virtual address
        (else the inventory)."""
        for found in (set_by(host, key), set_by(host, virtual_address.KEY)):
            if found is not None and not is_role_default(found):
                return found
        return loaded.path

    ssh = {host: str(address) for host in configs
           if isinstance(address := loaded.hosts[host].merged()[0].get("ssh_hostname"), str)}
    return virtual_address.problems(virtual_address.routers_of(loaded.groups), configs, source, ssh, set_by)


def validate_layers(loaded: InventoryLayers, override: dict[str, Any] | None = None) -> dict[str, HostConfig]:
    """Validate every host; raises ConfigError with every problem found."""
    problems: list[Problem] = []
    configs: dict[str, HostConfig] = {}
    routers = {host for group, members in loaded.groups if group == ROUTERS_GROUP for host in members}
    for name, layers in loaded.hosts.items():
        if override:
            layers = HostLayers(name, [*layers.layers, Layer("--data", override)])
        config, found = validate_host(layers, loaded.path, serving=loaded.pool_of(name) is not None,
                                      routes=name in routers)
        problems += found
        if config is not None:
            configs[name] = config
    problems += _host_problems(loaded, configs, override)
    problems += _secret_content_problems(loaded, configs, override)
    problems += _replica_name_problems(loaded)
    problems += _virtual_address_problems(loaded, configs, override)
    if problems:
        raise ConfigError(problems)
    return configs


def data_value(text: str) -> Any:
    """One ``--data`` value read as pyinfra's CLI reads it (``pyinfra_cli.util.parse_cli_arg``): true/false
    in any case, then an integer, then JSON, else the text itself. Kept here so that ``gpufleet check`` does
    not import pyinfra's CLI (which monkey-patches the process with gevent). JSON nested too deep for a parser
    to recurse into raises ValueError (see :func:`_data_items`)."""
    if problem := json_depth_problem(text):
        raise ValueError(problem)
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        number = int(text)
    except ValueError:
        pass
    else:  # int() also takes other scripts' digits, underscores, blanks and leading zeros: read one way only
        if not DECIMAL_INT.match(text):
            raise ValueError(f"expected an integer in ASCII decimal digits (no leading zero, no underscore), found"
                             f" {text!r}")
        return number
    try:
        return json.loads(text, object_pairs_hook=_once_each)
    except _DuplicateKey as exc:
        raise ValueError(f"expected each key once in the JSON value, found {exc.args[0]} again") from None
    except ValueError:
        return text


class _DuplicateKey(Exception):
    """A JSON object that names a key twice (``json`` keeps the last silently; YAML's reader refuses it)."""


def _once_each(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise _DuplicateKey(shown_key(key))
        found[key] = value
    return found


def parse_data_args(items: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` strings as pyinfra's ``--data`` reads them."""
    for item in items:
        key, eq, _ = item.partition("=")
        if not eq:
            raise ConfigError([Problem("--data", key, "expected KEY=VALUE, found no '='")])
    return _data_items(items)


def _data_items(items: list[str]) -> dict[str, Any]:
    """The ``KEY=VALUE`` items that have an ``=``, read; raises ConfigError for a value nested too deep."""
    data: dict[str, Any] = {}
    problems: list[Problem] = []
    for key, eq, value in (item.partition("=") for item in items):
        if eq:
            try:
                data[key] = data_value(value)
            except ValueError as exc:
                problems.append(Problem("--data", key, str(exc)))
    if problems:
        raise ConfigError(problems)
    return data


def set_data_override(data: dict[str, Any] | None) -> None:
    """``--data`` given to ``gpufleet check`` / ``plan``: validated as the inventory is read, as under pyinfra."""
    global _DATA_OVERRIDE
    _DATA_OVERRIDE = data or None


_DATA_OVERRIDE: dict[str, Any] | None = None


def cli_data_override(argv: list[str] | None = None) -> dict[str, Any] | None:
    """The ``--data KEY=VALUE`` arguments of the running command: gpufleet's (``set_data_override``), else
    those of the ``pyinfra`` command line (``argv``, default ``sys.argv`` under pyinfra's CLI), so bad
    ``--data`` stops the run as the inventory is read."""
    if _DATA_OVERRIDE is not None:
        return _DATA_OVERRIDE
    if argv is None:
        if not under_pyinfra_cli():
            return None
        argv = sys.argv[1:]
    items: list[str] = []
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        if arg == "--data" and i + 1 < len(argv):
            items.append(argv[i + 1])
        elif arg.startswith("--data="):
            items.append(arg.removeprefix("--data="))
    return _data_items(items) or None


def apply_group_vars(namespace: dict[str, Any]) -> None:
    """Attach group_vars to the inventory's groups and validate (with the plan's rules); exit 2 on bad input."""
    loaded, new_values, problems = collect_layers(namespace)
    if not problems and not loaded.hosts:
        problems.append(Problem(loaded.path, "", "expected at least one host in a group, found nothing to deploy"))
    if problems:
        exit_with(ConfigError(problems))
    try:
        override = cli_data_override()
        configs = validate_layers(loaded, override)
        serving = [host for host in loaded.hosts if loaded.pool_of(host) is not None]
        routers = [host for name, members in loaded.groups if name == ROUTERS_GROUP for host in members]
        plan_problems = (edge_problems(loaded.hosts, serving, configs, override, routers, loaded.path)
                         or declared_plan_problems(loaded, configs, override))
        if plan_problems:
            raise ConfigError(plan_problems)
    except ConfigError as error:
        exit_with(error)
    namespace.update(new_values)
    for host in loaded.hosts:
        _LOADED[host] = loaded
    _BY_FILE[Path(namespace["__file__"]).resolve()] = loaded


def loaded_inventory(host: str) -> InventoryLayers | None:
    """The layers recorded for a host when its inventory file was read."""
    return _LOADED.get(host)


def _error_line(path: Path, exc: BaseException) -> int | None:
    """The line of ``path`` an exception went through last."""
    if isinstance(exc, SyntaxError) and exc.filename and Path(exc.filename).resolve() == path:
        return exc.lineno
    lines = [frame.lineno for frame in traceback.extract_tb(exc.__traceback__)
             if Path(frame.filename).resolve() == path]
    return lines[-1] if lines else None


def read_inventory(path: Path) -> InventoryLayers | None:
    """Execute an inventory file (as pyinfra does) and return what apply_group_vars recorded.

    An inventory that fails to compile, import or run raises ConfigError: one line, ``file:line: Error: …``.
    """
    resolved = path.resolve()
    _BY_FILE.pop(resolved, None)
    try:
        namespace = runpy.run_path(str(resolved), run_name="gpufleet_inventory")
    except SystemExit as exc:
        if exc.code in (None, 0):  # left before apply_group_vars: said below
            return _BY_FILE.get(resolved)
        if exc.code == EXIT_BAD_INPUT:
            raise  # apply_group_vars' exit 2 after printing the problems
        where = display_path(resolved)
        text = exc.code if isinstance(exc.code, str) else (  # a str: the file's own reason (lab.py: no lab up)
            f"expected the inventory to run through, found it exited with status {exc.code}")
        raise ConfigError([Problem(where, "", text.removeprefix(f"{where}: "))]) from None
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - any failure of the user's file is bad input
        raise ConfigError([_failure(resolved, exc)]) from None
    loaded = _BY_FILE.get(resolved)
    if loaded is not None and (problems := _late_additions(resolved, namespace, loaded)):
        raise ConfigError(problems)
    return loaded


def _late_additions(path: Path, namespace: dict[str, Any], loaded: InventoryLayers) -> list[Problem]:
    """Groups and hosts the inventory file defined after its ``apply_group_vars(globals())`` call."""
    seen = {name: frozenset(members) for name, members in loaded.groups}
    return late_problems(namespace, seen, SourceLines(path), loaded.path)


def _failure(path: Path, exc: BaseException) -> Problem:
    """An inventory file that failed to compile, import or run: ``file:line: Error: first line``."""
    line = _error_line(path, exc)
    where = display_path(path) + (f":{line}" if line else "")
    text = exc.msg if isinstance(exc, SyntaxError) else str(exc)
    first = (text.strip().splitlines() or [""])[0]
    return Problem(where, "", f"{type(exc).__name__}: {first}".rstrip(": "))


def report_inventory_errors() -> None:
    """Under pyinfra's CLI, an inventory file that fails to compile or run says so in one line and exits 2.

    Called from the project's ``config.py``, which pyinfra executes before it reads ``--data`` and the inventory;
    pyinfra itself would print the traceback and exit 1. ``--data`` nested too deep is refused here, before
    pyinfra's parser recurses into it. Only the inventory file is covered: deploy files keep
    pyinfra's own report.
    """
    try:
        cli_data_override(sys.argv[1:])  # pyinfra reads --data next, and would recurse into JSON nested too deep
    except ConfigError as error:
        exit_with(error)
    wrap_inventory_exec(_reporting_errors)


def _reporting_errors(original: Callable[..., Any]) -> Callable[..., Any]:
    """pyinfra's CLI's ``exec_file`` for the inventory, its failures and late additions reported as bad input."""

    def exec_inventory(filename: str, *args: Any, **kwargs: Any) -> Any:
        try:
            attrs = original(filename, *args, **kwargs)
        except SystemExit:
            raise
        except Exception as exc:  # noqa: BLE001 - pyinfra wraps the file's own error; report the original
            exit_with(ConfigError([_failure(Path(filename).resolve(), cli_file_error(exc))]))
        resolved = Path(filename).resolve()
        loaded = _BY_FILE.get(resolved)
        if isinstance(attrs, dict) and loaded is not None and (problems := _late_additions(resolved, attrs, loaded)):
            exit_with(ConfigError(problems))
        return attrs

    return exec_inventory


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
            "expected the inventory to end with apply_group_vars(globals()) (gpufleet.inventory.load),"
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
    # the key someone set, on a host of its pool or of the pools it must agree with; when the planner names only
    # defaults, the model that does not fit them
    hosts = [(pool, host) for pool in (problem.pool, *problem.also) for host in pools[pool]]
    named = [(pool, host, key) for key in problem.keys for pool, host in hosts]
    pool, host, key = next((found for found in [*named, (*hosts[0], "vllm_model")]
                            if not is_role_default(source(found[1], found[2]))), named[0])
    return Problem(source(host, key), key, f"{problem.said_of(key)} (pool {pool})")


def declared_plan_problems(loaded: InventoryLayers, configs: dict[str, HostConfig],
                           override: dict[str, Any] | None = None) -> list[Problem]:
    """The plan's problems on the declared ``gpu_profile``s, for every pool whose hosts all declare one.

    The same planner ``gpufleet plan`` runs, so what the plan refuses, ``gpufleet check`` and pyinfra
    reading the inventory refuse too.
    """
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


def _not_a_file(path: str) -> str | None:
    """What ``path`` is when it is not a regular file (links followed), as a message names it; None for a file."""
    if not path:
        return "an empty path"
    found = found_at(path)
    return None if found == "a regular file" else found


def load_fleet(inventory_path: str, override: dict[str, Any] | None = None) -> Fleet:
    """Read an inventory file as pyinfra does; raises ConfigError (or exits 2 from the inventory)."""
    if (found := _not_a_file(inventory_path)) is not None:
        raise ConfigError([Problem(inventory_path or "''", "", f"expected an inventory file, found {found}")])
    path = Path(inventory_path)
    loaded = read_inventory(path)
    if loaded is None:
        raise ConfigError([Problem(inventory_path, "", "expected the inventory to end with"
                                   " apply_group_vars(globals()) (gpufleet.inventory.load), found no call")])
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
