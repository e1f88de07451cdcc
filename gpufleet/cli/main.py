"""The ``gpufleet`` command: check, plan and inspect a fleet before any host is touched."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from gpufleet.cli.inputs import DATA_OPTION, Number, cli_fleet, declared_plan, fail_lines, fleet_facts, group_hosts
from gpufleet.config.fleet import Fleet
from gpufleet.config.inventory_shape import MONITORING_GROUP
from gpufleet.inventory.load import (
    configured_health_policy,
    loaded_inventory,
    parse_data_args,
)
from gpufleet.measure.capacity import measured_admission, model_capacities
from gpufleet.measure.ramp import MAX_RATE
from gpufleet.measure.records import Record
from gpufleet.node.vllm_ready import kv_summary
from gpufleet.plan import virtual_address
from gpufleet.plan.model_arch import ModelConfigError, load_arch
from gpufleet.plan.model_memory import GIB, LORA_PART, model_info
from gpufleet.plan.planner import FleetPlan, Replica, plan_fleet
from gpufleet.values.grammar import decimal

EXIT_UNREAD = 1  # gpufleet plan --observed: a node whose observations could not be read


PLUGIN_GROUP = "gpufleet.commands"  # entry points of other distributions that add a command (gpufleet-lab: lab)


def _plugins() -> dict[str, importlib.metadata.EntryPoint]:
    """Commands other installed distributions add, by name; gpufleet imports none of them until one is called."""
    return {point.name: point for point in importlib.metadata.entry_points(group=PLUGIN_GROUP)}


class _Commands(click.Group):
    """Commands whose modules load only when called (they import pyinfra's SSH stack): check stays fast. Commands
    of other distributions (:data:`PLUGIN_GROUP`) load the same way."""

    LAZY: ClassVar[dict[str, str]] = {
        "probe": "gpufleet.cli.gpu:probe_command", "gate": "gpufleet.cli.gpu:make_gate_command",
        "upgrade": "gpufleet.cli.rollout:upgrade_command", "rollback": "gpufleet.cli.rollout:rollback_command",
        "bench": "gpufleet.cli.bench:bench_command", "bench-client": "gpufleet.cli.bench_client:bench_client_command",
        "nodes": "gpufleet.cli.nodes:nodes_command", "diag": "gpufleet.cli.diag:diag_command",
    }

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        """Click's main, with a usage error said in one line (``gpufleet check: no such option '--x'``), exit 2,
        instead of click's usage block."""
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            result = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.UsageError as exc:
            where = exc.ctx.command_path if exc.ctx is not None else "gpufleet"
            message = " ".join(exc.format_message().split()).removesuffix(".")
            click.echo(f"{where}: {message[:1].lower()}{message[1:]} (see {where} --help)", err=True)
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            click.echo(f"gpufleet: {' '.join(exc.format_message().split())}", err=True)
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(result if isinstance(result, int) else 0)  # an int: click's Exit (--help, --version)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.LAZY, *_plugins()})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.LAZY:
            found_here = super().get_command(ctx, cmd_name)
            plugin = None if found_here is not None else _plugins().get(cmd_name)
            loaded = plugin.load() if plugin is not None else None
            return loaded if isinstance(loaded, click.Command) else found_here
        module, name = self.LAZY[cmd_name].split(":")
        found = getattr(importlib.import_module(module), name)
        command: click.Command = found(configured_health_policy) if name == "make_gate_command" else found
        return command


@click.group(cls=_Commands)
@click.version_option(package_name="gpufleet")
def main() -> None:
    """Plan, provision and check vLLM serving fleets on NVIDIA GPU servers."""


@main.command()
@click.argument("inventory")
@DATA_OPTION
def check(inventory: str, data: tuple[str, ...]) -> None:
    """Validate an inventory, its group_vars and the plan on declared gpu_profiles; exit 0, or 2 with one
    line per problem."""
    fleet = cli_fleet(inventory, data)
    for warning in declared_plan(fleet).context_warnings:
        click.echo(f"warning: {warning}", err=True)
    click.echo(f"{inventory}: {len(fleet.hosts)} hosts in {len(fleet.pools)} pools: configuration valid")


def _observed_cells(r: Replica, doc: dict[str, Any] | None, tolerance: float) -> tuple[str, str]:
    """The plan's table with what vLLM reported of a replica's KV cache: (its sequences at max length, its KV
    tokens), each with the plan's figure first."""
    seqs = f"{r.budget.max_concurrency * r.dp:,.1f}"
    tokens = f"{r.budget.kv_tokens:,}"
    if doc is None:
        return seqs, f"{tokens}\nvLLM: not recorded"
    ratio, off, _ = kv_summary(r.budget.kv_tokens, doc.get("kv_cache_tokens"), tolerance)
    if ratio is None:
        return seqs, f"{tokens}\nvLLM: no figure"
    concurrency = doc.get("max_concurrency")
    if isinstance(concurrency, (int, float)) and not isinstance(concurrency, bool):
        seqs += f"\nvLLM {concurrency:,.1f}"
    return seqs, (f"{tokens}\nvLLM {doc['kv_cache_tokens']:,}\nratio {ratio:.3f}"
                  + (f"\n> {tolerance * 100:g}% off" if off else ""))


def _adapter_lines(plan: FleetPlan) -> list[str]:
    """One line per LoRA adapter of each model: the replicas that serve it, and their slots' memory per GPU where
    the plan counts it."""
    slots = {r.name: sum(size for part, size in r.budget.reserve_parts if part == LORA_PART) for r in plan.replicas}
    lines = []
    for model in plan.models.values():
        for adapter, holders in model.adapters:
            counted = ", ".join(f"{name} {slots[name] / GIB:,.2f} GiB/GPU" if slots.get(name) else
                                f"{name} (slots not counted)" for name in holders)
            lines.append(f"model {json.dumps(model.name)}: LoRA adapter {adapter} on {counted}")
    return lines


def _print_table(plan: FleetPlan, observed: dict[str, tuple[dict[str, Any] | None, float]] | None = None) -> None:
    """The plan as a table; with ``observed`` (replica -> what vLLM reported, vllm_plan_tolerance), its KV cache
    tokens and sequences as planned and as vLLM reported them."""
    console = Console(width=160)
    table = Table(title="gpufleet plan", show_lines=True)
    columns = ["replica", "model", "nodes (role: GPUs)", "TP", "PP", "DP", "port", "weights/GPU", "KV pool/GPU",
               "KV B/token/GPU", "seqs @ max len"]
    for col in columns + (["KV tokens"] if observed is not None else []):
        table.add_column(col, min_width=max((len(r.name) for r in plan.replicas), default=0) if col == "replica"
                         else None)
    for r in plan.replicas:
        nodes = "\n".join(f"{x.host} ({x.role}): {','.join(map(str, x.gpus))}" for x in r.roles)
        seqs, *tokens = [f"{r.budget.max_concurrency * r.dp:,.1f}"] if observed is None else _observed_cells(
            r, *observed[r.name])
        seqs += f"\n{r.admission.cell()}" + ("\nfair share" if plan.model_of(r).fair else "")
        table.add_row(r.name, f"{r.model}\nmax_model_len {r.max_model_len:,}", nodes, str(r.tp), str(r.pp),
                      str(r.dp), str(r.port), f"{r.budget.weights_bytes_per_gpu / GIB:,.1f} GiB",
                      f"{r.budget.kv_pool_bytes / GIB:,.1f} GiB", f"{r.kv_bytes_per_token:,}", seqs, *tokens)
    console.print(table)
    for pool, flags in dict.fromkeys((r.pool, r.not_modelled) for r in plan.replicas if r.not_modelled):
        console.print(f"pool {pool}: not modelled in the plan's memory: {', '.join(flags)} (vLLM's KV pool may be"
                      " smaller than planned)", soft_wrap=True, highlight=False, markup=False)
    for adapter_line in _adapter_lines(plan):
        console.print(adapter_line, soft_wrap=True, highlight=False, markup=False)
    for r in plan.replicas:
        for role in r.roles:
            for proc in role.processes:
                line = Text(r.process_line(role, proc))  # plain text: an address in brackets is no markup
                line.stylize("bold", 0, len(r.name))
                console.print(line, soft_wrap=True, highlight=False)


@main.command()
@click.argument("inventory")
@click.option("--facts", "facts_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Directory of probed facts (<host>.json from `gpufleet probe`); default: declared gpu_profile.")
@click.option("--json", "as_json", is_flag=True, help="Print the replicas as JSON.")
@click.option("--observed", is_flag=True,
              help="Plan without the nodes that are out of the fleet (quarantined, retired, being readmitted: their"
                   " lifecycle records), and show the KV cache vLLM reported at each replica's last start, read from"
                   " its first node, and each model's measured ceiling (gpufleet bench), read from the monitoring"
                   " hosts.")
@click.option("--target-rps", "target_text", metavar="RPS",
              help="With --observed: the replicas each model needs for this many requests per second.")
@DATA_OPTION
def plan(inventory: str, facts_dir: Path | None, as_json: bool, observed: bool, target_text: str | None,
         data: tuple[str, ...]) -> None:
    """Compute replicas: nodes, TP/PP/DP, GPU sets, ports, argv and env per node; with --observed, beside what
    vLLM reported and what the bench measured (exit 1 when a node could not be read)."""
    target_rps = decimal(target_text) if target_text is not None else None
    if target_text is not None and not (observed and target_rps is not None and 0 < target_rps <= MAX_RATE):
        fail_lines([f"gpufleet plan: --target-rps: expected requests per second above 0, at most {MAX_RATE:g}, with"
                    f" --observed, found {target_text!r}{'' if observed else ' without --observed'}"])
    fleet = cli_fleet(inventory, data)
    facts = fleet_facts(fleet, facts_dir)
    out: dict[str, str] = {}
    unread: list[str] = []
    if observed:
        out, unread = _out_of_the_fleet(inventory, data, fleet)
        fleet = fleet.only([h for h in fleet.hosts if h not in out])
        facts = {h: f for h, f in facts.items() if h not in out}
    result = plan_fleet(fleet, facts)
    records: list[Record] | None = None
    if observed and not result.problems:
        records, unread_records = _bench_records(inventory, data, fleet)
        unread += unread_records
        result = measured_admission(result, records)
    for warning in result.warnings + result.context_warnings:
        click.echo(f"warning: {warning}", err=True)
    if result.problems:
        fail_lines([problem.line() for problem in result.problems])
    for host, why in out.items():
        click.echo(f"out of the fleet, not planned: {host}: {why}", err=True)
    seen, unread_replicas = _read_observed(inventory, data, result) if observed else (None, [])
    unread += unread_replicas
    if as_json:
        click.echo(json.dumps([{**r.to_json(), **({"observed": seen.get(r.name)} if seen is not None else {})}
                               for r in result.replicas], indent=2))
    else:
        _print_table(result, None if seen is None else {
            r.name: (seen[r.name], fleet.configs[r.nodes[0]].vllm_plan_tolerance) for r in result.replicas})
        loaded = loaded_inventory(fleet.hosts[0]) if fleet.hosts else None
        routers = virtual_address.routers_of(loaded.groups) if loaded is not None else []
        if endpoint := virtual_address.endpoint_line(routers, fleet.configs):
            click.echo(endpoint)
        if records is not None:
            _print_ceilings(records, fleet, result, target_rps)
    for line in unread:
        click.echo(f"gpufleet plan: {line}", err=True)
    if unread:
        raise SystemExit(EXIT_UNREAD)


def _bench_records(inventory: str, data: tuple[str, ...], fleet: Fleet) -> tuple[list[Record], list[str]]:
    """The bench records on the monitoring hosts (gpufleet bench), and the lines of what could not be read."""
    from gpufleet.remote.bench_store import read_records  # pyinfra's SSH stack: loaded only when asked
    from gpufleet.remote.gpu_probe import load_inventory

    hosts = group_hosts(fleet, MONITORING_GROUP)
    if not hosts:
        return [], []
    return read_records(load_inventory(inventory, parse_data_args(list(data)) or None), hosts)


def _print_ceilings(records: list[Record], fleet: Fleet, plan: FleetPlan, target_rps: float | None) -> None:
    """Each model's measured ceiling over its planned replicas (each shape's per replica where they differ; and the
    replicas ``target_rps`` needs), from the bench records on the monitoring hosts."""
    if not group_hosts(fleet, MONITORING_GROUP):
        click.echo("ceilings: no monitoring group holds bench records")
        return
    found = model_capacities(plan.replicas, records)
    for model in plan.models:
        cap = found.get(model)
        if cap is None:
            click.echo(f"ceiling of {json.dumps(model)}: not measured (gpufleet bench)")
            continue
        dates = ", ".join(sorted({r.date for r in cap.sources}))
        note = "" if cap.current else f"; measured on vLLM {cap.release}, not the release planned: bench again"
        each = (f"{cap.ceiling_rps / cap.replicas:.3g} each" if len(cap.shapes) < 2 else ", ".join(
            f"{s.replicas} {s.layout} on {s.gpu_profile} at {s.per_replica_rps:.3g} each" for s in cap.shapes))
        line = (f"ceiling of {json.dumps(model)}: {cap.ceiling_rps:g} req/s over {cap.replicas} replicas"
                f" ({each}; measured {dates}{note})")
        if target_rps is not None:
            line += f"; {target_rps:g} req/s needs {cap.replicas_for(target_rps)} replicas"
        click.echo(line)


def _out_of_the_fleet(inventory: str, data: tuple[str, ...], fleet: Fleet) -> tuple[dict[str, str], list[str]]:
    """The serving hosts out of the fleet (gpufleet.node.node_state.out_of_service), from their lifecycle records."""
    from gpufleet.node.node_state import out_of_service
    from gpufleet.remote import node_records
    from gpufleet.remote.commands import PyinfraRemote
    from gpufleet.remote.gpu_probe import load_inventory  # pyinfra's SSH stack: loaded only when asked

    remote = PyinfraRemote(load_inventory(inventory, parse_data_args(list(data)) or None))
    try:
        records = node_records.read(remote, [h for h in fleet.hosts if fleet.serves(h)],
                                    group_hosts(fleet, MONITORING_GROUP))
    finally:
        remote.close()
    out = {host: why for host, record in records.found.items() if (why := out_of_service(record)) is not None}
    return out, records.problems


def _read_observed(inventory: str, data: tuple[str, ...],
                   plan: FleetPlan) -> tuple[dict[str, dict[str, Any] | None], list[str]]:
    """Each replica's observed.json from its first node, over pyinfra's connections as the inventory gives them."""
    from gpufleet.remote.commands import PyinfraRemote
    from gpufleet.remote.gpu_probe import load_inventory  # pyinfra's SSH stack: loaded only when asked
    from gpufleet.rollout.observed import read_observed

    remote = PyinfraRemote(load_inventory(inventory, parse_data_args(list(data)) or None))
    try:
        return read_observed(remote, plan.replicas)
    finally:
        remote.close()


@main.command("model-info")
@click.argument("config")
@click.option("--kv-dtype", type=click.Choice(["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]), default="auto")
@click.option("--dtype", "model_dtype", default="bfloat16", show_default=True, help="Model dtype for auto KV.")
@click.option("--tp", type=Number(1, 1024, whole=True), default=1, show_default=True)
@click.option("--pp", type=Number(1, 1024, whole=True), default=1, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def model_info_command(config: str, kv_dtype: str, model_dtype: str, tp: int, pp: int, as_json: bool) -> None:
    """Architecture and KV-cache size of a model (config.json, model directory or bundled name)."""
    try:
        info = model_info(load_arch(config), kv_dtype=kv_dtype, model_dtype=model_dtype, tp=tp, pp=pp)
    except (ModelConfigError, ValueError) as exc:
        fail_lines([str(exc)])
    if as_json:
        click.echo(json.dumps(info, indent=2))
    else:
        for key, value in info.items():
            click.echo(f"{key}: {value:,}" if isinstance(value, int) and not isinstance(value, bool)
                       else f"{key}: {value}")



if __name__ == "__main__":
    main()
