"""``gpufleet probe`` and ``gpufleet gate``: what each node's GPUs really are, and whether they may serve.

The main CLI registers :data:`probe_command`, and the gate that :func:`make_gate_command` builds with the
health policy of the fleet config's ``gpu_health``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import click
from pyinfra.api.inventory import Inventory

from gpufleet.gpu.report import FactsError, NodeFacts, load_facts, parse_facts
from gpufleet.gpu.topology import nvlink_islands
from gpufleet.node.health_rules import HealthPolicy
from gpufleet.remote.gpu_probe import default_policy, gate_report, load_inventory, probe_hosts

EXIT_FAILED = 1
PYTHON_HELP = "Interpreter on the nodes that has nvidia-ml-py."


def describe(facts: NodeFacts) -> str:
    """One line: GPUs, driver, NVLink islands (or why there is no NVML)."""
    if not facts.nvml.available:
        return str(facts.nvml.error)
    names = sorted({g.name for g in facts.gpus})
    islands = " ".join("[" + ",".join(map(str, island)) + "]" for island in nvlink_islands(facts))
    text = (f"{len(facts.gpus)} x {', '.join(names) or 'no GPUs'}, driver {facts.driver_version} "
            f"(CUDA {facts.cuda_driver_version}), NVLink islands {islands or 'none'}")
    return text + (f", {len(facts.errors)} NVML errors" if facts.errors else "")


def _inventory(inventory: str) -> Inventory:
    try:
        return load_inventory(inventory)
    except Exception as exc:  # noqa: BLE001 - pyinfra raises assorted errors for unreadable inventories
        raise click.ClickException(f"{inventory}: cannot read the inventory: {exc}") from None


@click.command("probe")
@click.argument("inventory", required=False)
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Write each host's facts to DIR/<host>.json.")
@click.option("--local", is_flag=True, help="Probe this machine instead of an inventory's hosts.")
@click.option("--json", "as_json", is_flag=True, help="Print the facts JSON (by host for an inventory).")
@click.option("--python", default="python3", show_default=True, help=PYTHON_HELP)
def probe_command(inventory: str | None, out_dir: Path | None, local: bool, as_json: bool, python: str) -> None:
    """Probe GPUs through NVML: an inventory's hosts over pyinfra, or this machine with --local.

    Exit 0 when every host gave facts (a node without NVML still gives facts that say so), 1 otherwise.
    """
    if local == (inventory is not None):
        raise click.UsageError("give an INVENTORY or --local (not both)")
    if local:
        if out_dir is not None:
            raise click.UsageError("--out goes with an INVENTORY; redirect --local --json instead")
        from gpufleet.node.nvml_probe import probe

        facts = parse_facts(probe(), "local probe")
        click.echo(facts.to_json().rstrip() if as_json else f"{facts.hostname}: {describe(facts)}")
        return
    assert inventory is not None
    run = probe_hosts(_inventory(inventory), python)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        for host, facts in run.facts.items():
            (out_dir / f"{host}.json").write_text(facts.to_json())
    if as_json:
        click.echo(json.dumps({h: f.model_dump(mode="json", by_alias=True) for h, f in run.facts.items()}, indent=2))
    else:
        for host, facts in run.facts.items():
            where = f" -> {out_dir / f'{host}.json'}" if out_dir is not None else ""
            click.echo(f"{host}: {describe(facts)}{where}")
    for host, why in run.failures.items():
        click.echo(f"{host}: no facts: {why}", err=True)
    if run.failures:
        raise SystemExit(EXIT_FAILED)


def _saved_facts(hosts: list[str], facts_dir: Path) -> tuple[dict[str, NodeFacts], dict[str, str]]:
    facts, missing = {}, {}
    for host in hosts:
        try:
            facts[host] = load_facts(facts_dir / f"{host}.json")
        except FactsError as exc:
            missing[host] = str(exc)
    return facts, missing


def make_gate_command(policy_for_host: Callable[[str], HealthPolicy] = default_policy) -> click.Command:
    """The ``gate`` command, judging each host with ``policy_for_host(host)``."""

    @click.command("gate")
    @click.argument("inventory")
    @click.option("--facts", "facts_dir", type=click.Path(file_okay=False, exists=True, path_type=Path),
                  help="Judge saved facts (<host>.json from `gpufleet probe --out`) instead of probing.")
    @click.option("--json", "as_json", is_flag=True, help="Print the verdicts as JSON.")
    @click.option("--python", default="python3", show_default=True, help=PYTHON_HELP)
    def gate(inventory: str, facts_dir: Path | None, as_json: bool, python: str) -> None:
        """Go / no-go per node from its GPU facts: each failed rule with its evidence.

        Exit 0 when every node passes, 1 when any fails or could not be probed.
        """
        if facts_dir is not None:
            facts, unprobed = _saved_facts([h.name for h in _inventory(inventory)], facts_dir)
        else:
            run = probe_hosts(_inventory(inventory), python)
            facts, unprobed = run.facts, run.failures
        report = gate_report(facts, policy_for_host, unprobed)
        click.echo(json.dumps(report.to_json(), indent=2) if as_json else report.text())
        if not report.passed:
            raise SystemExit(EXIT_FAILED)

    return gate

