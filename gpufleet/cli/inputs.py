"""What the ``gpufleet`` commands share: the inventory's fleet with ``--data``, each host's GPU facts, and the
one-line refusal (exit 2)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NoReturn

import click

from gpufleet.config.fleet import Fleet
from gpufleet.config.layers import is_role_default
from gpufleet.gpu.profiles import ProfileError, profile_facts
from gpufleet.gpu.report import FactsError, NodeFacts, load_facts
from gpufleet.inventory.load import cli_data_override as _data_override
from gpufleet.inventory.load import load_fleet, loaded_inventory, parse_data_args, set_data_override
from gpufleet.netaddr import host_port
from gpufleet.plan import virtual_address
from gpufleet.plan.planner import FleetPlan, plan_fleet
from gpufleet.values import grammar
from gpufleet.values.grammar import decimal
from gpufleet.values.problems import EXIT_BAD_INPUT, ConfigError, exit_with


def fail_lines(lines: list[str]) -> NoReturn:
    """Refuse: each line on stderr, exit 2."""
    for line in lines:
        click.echo(line, err=True)
    raise SystemExit(EXIT_BAD_INPUT)


def cli_fleet(inventory: str, data: tuple[str, ...] = ()) -> Fleet:
    """The inventory's fleet with the command's ``--data``, validated as pyinfra would (bad input: exit 2)."""
    try:
        override = parse_data_args(list(data)) if data else None
        set_data_override(override)
        return load_fleet(inventory, override)
    except ConfigError as error:
        exit_with(error)


class Number(click.ParamType[float | int, Any]):
    """A number option read as every command reads numbers (:func:`gpufleet.values.grammar.decimal`: ASCII digits,
    finite), from ``low`` to ``high``; ``whole``: digits only, an integer."""

    name = "number"

    def __init__(self, low: float, high: float, whole: bool = False, what: str = "a number") -> None:
        self.low, self.high, self.whole, self.what = low, high, whole, what

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float | int:
        if isinstance(value, (int, float)) and not isinstance(value, bool):  # a default
            number: float | None = float(value)
        else:
            text = str(value)
            number = (float(text) if text.isascii() and text.isdigit() and len(text) <= 9 else None) if self.whole \
                else decimal(text)
        if number is None or not self.low <= number <= self.high:
            kind = "a whole number" if self.whole else self.what
            self.fail(f"expected {kind} from {self.low:g} to {self.high:g}, found {str(value)!r}", param, ctx)
        return int(number) if self.whole else number


def shown_host(host: str) -> str:
    """A host argument as a message shows it: escaped, cut short, and not at all when it looks like a secret."""
    return "a name that looks like a credential (not shown)" if grammar.secret_like(host) else grammar.show(host)


DATA_OPTION = click.option("--data", "data", multiple=True, metavar="KEY=VALUE",
                            help="Override a variable as `pyinfra --data` does (validated the same way).")


def group_hosts(fleet: Fleet, group: str) -> list[str]:
    """The hosts of the inventory group ``group`` (the routers, the monitoring hosts), in its order; [] without one."""
    loaded = loaded_inventory(fleet.hosts[0]) if fleet.hosts else None
    return next((list(members) for name, members in loaded.groups if name == group), []) if loaded else []


def prometheus_url(fleet: Fleet, host: str) -> str:
    """The HTTP API of the Prometheus on monitoring host ``host``, as the controller reaches it."""
    cfg = fleet.configs[host]
    return f"http://{host_port(virtual_address.host_address(host, cfg) or host, cfg.prometheus_port)}"


def _source_of(fleet: Fleet, host: str, key: str) -> str:
    """The file that set ``key`` for ``host`` (a role's default or nothing: the inventory, where it goes)."""
    loaded = loaded_inventory(host)
    source = loaded.source_of(host, key, _data_override()) if loaded is not None else fleet.inventory
    return fleet.inventory if is_role_default(source) else source


def fleet_facts(fleet: Fleet, facts_dir: Path | None) -> dict[str, NodeFacts]:
    """Each host's GPU facts: probed JSON from ``facts_dir``, else its declared ``gpu_profile``."""
    facts: dict[str, NodeFacts] = {}
    problems: list[str] = []
    for host in fleet.hosts:
        cfg = fleet.configs[host]
        try:
            if facts_dir is not None:
                facts[host] = load_facts(facts_dir / f"{host}.json")
            elif cfg.gpu_profile:
                facts[host] = profile_facts(cfg.gpu_profile, host)
            else:
                problems.append(f"{_source_of(fleet, host, 'gpu_profile')}: gpu_profile: expected a hardware profile"
                                f" for {host} (or gpufleet plan --facts DIR), found null")
        except (FactsError, ProfileError) as exc:
            where = "" if facts_dir is not None else f"{_source_of(fleet, host, 'gpu_profile')}: gpu_profile: "
            problems.append(f"{where}{exc}")
    if problems:
        fail_lines(problems)
    for host, node in facts.items():
        if not node.nvml.available:
            problems.append(f"{host}: no NVML on this node: {node.nvml.error}")
    if problems:
        fail_lines(problems)
    return facts


def declared_plan(fleet: Fleet) -> FleetPlan:
    """The plan of the pools whose hosts all declare a ``gpu_profile`` (what ``gpufleet check`` plans on)."""
    pools = {pool: hosts for pool, hosts in fleet.pools.items()
             if all(fleet.configs[h].gpu_profile for h in hosts)}
    hosts = [h for members in pools.values() for h in members]
    facts = {h: profile_facts(str(fleet.configs[h].gpu_profile), h) for h in hosts}
    return plan_fleet(Fleet(fleet.inventory, hosts, {h: fleet.configs[h] for h in hosts}, pools), facts)
