"""``gpufleet diag``: what the nodes kept of a window, in one archive, and what it says.

    gpufleet diag INVENTORY [--host H ...] [--since 6h] [--out FILE] [--max-mib 64] [--collect-env]

Before any host is contacted, the options are judged and the inventory validated (one line, exit 2). Then every node
asked runs the node tool ``diag_collect.py`` at once, each within 60 s and its byte cap (:mod:`gpufleet.diag.collect`),
and the monitoring hosts' Prometheus gives each node's series over the window (:mod:`gpufleet.diag.series`);
their archives are read, every secret the controller can read from the inventory replaced (:mod:`gpufleet.diag.redact`),
and written as one tar.gz, 0600, with its index (:mod:`gpufleet.diag.archive`). It prints the failure signatures found
in the journals and kernel logs first, then the archive, then each node's time, bytes and what could not be read.
Exit 0 when every node gave its archive, 1 when one did not.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click

from gpufleet.cli.inputs import (
    DATA_OPTION,
    Number,
    cli_fleet,
    declared_plan,
    fail_lines,
    group_hosts,
    prometheus_url,
    shown_host,
)
from gpufleet.config.fleet import Fleet
from gpufleet.config.inventory_shape import MONITORING_GROUP
from gpufleet.diag.archive import Written, write_archive
from gpufleet.diag.captures import listed, take
from gpufleet.diag.collect import NODE_BOUND_S, NodeRemote, collect
from gpufleet.diag.options import DEFAULT_SINCE, OptionError, OutReplaced, out_path, since_seconds
from gpufleet.diag.redact import fleet_secrets
from gpufleet.diag.series import snapshots
from gpufleet.inventory.load import parse_data_args
from gpufleet.node_paths import DIAG_CAPTURES_DIR
from gpufleet.remote.commands import PyinfraRemote
from gpufleet.remote.gpu_probe import load_inventory

EXIT_FAILED = 1
MIB = 1 << 20
DEFAULT_MAX_MIB = 64


def _plan(fleet: Fleet) -> dict[str, object]:
    """The plan of the pools that declare their hardware, as ``gpufleet plan --json`` gives it (the archive's
    plan.json), with its problems."""
    plan = declared_plan(fleet)
    return {"replicas": [r.to_json() for r in plan.replicas], "problems": [p.line() for p in plan.problems],
            "planned_from": "each pool's declared gpu_profile (pools without one are left out)"}


def _report(written: Written, since: str, max_mib: int) -> None:
    """The findings first, then the archive, then each node's time, bytes and what could not be read."""
    click.echo(f"findings: {len(written.findings)}" + ("" if written.findings else " (no failure signature matched)"))
    for finding in written.findings:
        click.echo(f"  {finding.line()}")
    click.echo(f"archive: {written.path} ({written.bytes:,} bytes, 0600; its index.json lists every member and what"
               f" could not be read)")
    for host, node in written.index["nodes"].items():
        if node["problem"] is not None and not node["archive_bytes"]:
            click.echo(f"{host}: {node['seconds']:.1f} s, nothing collected: {node['problem']}")
            continue
        unread = "; ".join(f"{u['what']} ({u['why']})" for u in node["unread"])
        click.echo(f"{host}: {node['seconds']:.1f} s, {sum(m['bytes'] for m in node['members']):,} bytes of the last"
                   f" {since} (cap {max_mib} MiB)" + (f"; could not read: {unread}" if unread else "")
                   + (f"; {node['problem']}" if node["problem"] else ""))


def _prometheus(fleet: Fleet) -> list[str]:
    """The monitoring hosts' Prometheus, in the group's order."""
    return [prometheus_url(fleet, host) for host in group_hosts(fleet, MONITORING_GROUP) if host in fleet.configs]


def _connections(inventory: str, override: dict[str, Any] | None) -> Callable[[str], NodeRemote]:
    """A node's own connection, over an inventory of its own (one per node: pyinfra's states are not shared between
    the threads that collect)."""
    return lambda host: PyinfraRemote(load_inventory(inventory, override))


def capture(inventory: str, data: tuple[str, ...], fleet: Fleet, nodes: Sequence[str], reason: str) -> None:
    """Take a capture of ``nodes`` (:mod:`gpufleet.diag.captures`) and keep it on the monitoring hosts, saying where;
    nothing when the inventory has no monitoring host."""
    monitoring = group_hosts(fleet, MONITORING_GROUP)
    if not monitoring:
        return
    override = parse_data_args(list(data)) or None
    store = PyinfraRemote(load_inventory(inventory, override))
    try:
        with tempfile.TemporaryDirectory(prefix="gpufleet-capture-") as work:
            name, problems = take(nodes, _connections(inventory, override), store, monitoring, _prometheus(fleet),
                                  fleet_secrets(fleet.configs.values()), reason, datetime.now(UTC), Path(work))
    finally:
        store.close()
    click.echo(f"gpufleet diag: captured {', '.join(nodes)} ({reason}) as {DIAG_CAPTURES_DIR}/{name} on"
               f" {', '.join(monitoring)}; gpufleet diag {inventory} --list")
    for line in problems:
        click.echo(f"gpufleet diag: capture: {line}", err=True)


def _list(inventory: str, data: tuple[str, ...]) -> None:
    """Every capture kept on the inventory's hosts (a rollout's on the monitoring hosts, a node's own on it), newest
    first on each."""
    fleet = cli_fleet(inventory, data)
    store = PyinfraRemote(load_inventory(inventory, parse_data_args(list(data)) or None))
    try:
        found, problems = listed(store, fleet.hosts)
    finally:
        store.close()
    click.echo(f"captures: {len(found)}" + ("" if found else f" (none kept in {DIAG_CAPTURES_DIR})"))
    for kept in found:
        click.echo(f"  {kept.line()}")
    for line in problems:
        click.echo(line, err=True)
    if problems:
        raise SystemExit(EXIT_FAILED)


@click.command("diag")
@click.argument("inventory")
@click.option("--host", "hosts", multiple=True, metavar="HOST",
              help="A host of the inventory to collect from (repeat for more); default: every host.")
@click.option("--since", default=DEFAULT_SINCE, show_default=True,
              help="The window: a whole number and one unit s, m, h or d (90s, 30m, 2h, 1d), at most 30d.")
@click.option("--out", "out_text", metavar="FILE",
              help="The archive to write (a new file, 0600); default: gpufleet-diag-<UTC time>.tar.gz here.")
@click.option("--max-mib", type=Number(1, 1024, whole=True), default=DEFAULT_MAX_MIB, show_default=True,
              help="The most each node sends, in MiB, 1 to 1024 (the newest journal lines are kept).")
@click.option("--collect-env", is_flag=True,
              help="Also run `vllm collect-env` in each replica's release venv (slower: it imports torch).")
@click.option("--list", "list_only", is_flag=True,
              help="List the captures kept on every host: a rollout's on the monitoring hosts (a replica rolled back),"
                   " a node's own (a restart loop, a quarantine); collect nothing.")
@DATA_OPTION
def diag_command(inventory: str, hosts: tuple[str, ...], since: str, out_text: str | None, max_mib: int,
                 collect_env: bool, list_only: bool, data: tuple[str, ...]) -> None:
    """Collect from each node, in parallel and within 60 s and --max-mib each, the journals, states
    and restart counts of gpufleet's units, each replica's config, release and ExecStart, the NVML probe, the kernel
    log's Xid and NVRM lines, the lifecycle record and burn-in verdicts, and the routers' servers, and its series
    in the monitoring hosts' Prometheus, into one archive with an index and no secret; print the failure signatures
    found first.

    Exit 0 when every node gave its archive, 1 when one did not, 2 on bad input.
    """
    if list_only:
        given = [name for name, on in (("--host", hosts), ("--out", out_text is not None),
                                       ("--collect-env", collect_env)) if on]
        if given:
            fail_lines([f"gpufleet diag: --list collects nothing: expected no {', '.join(given)} with it"])
        _list(inventory, data)
        return
    try:
        since_s = since_seconds(since)
    except OptionError as exc:
        fail_lines([f"gpufleet diag: {exc}"])
    fleet = cli_fleet(inventory, data)
    for host in hosts:
        if host not in fleet.hosts:
            fail_lines([f"gpufleet diag: --host: expected a host of {inventory} ({', '.join(fleet.hosts)}), found"
                        f" {shown_host(host)}"])
    try:  # last: the file it makes is the one refusal that leaves something behind to remove
        out = out_path(out_text if out_text is not None
                       else f"gpufleet-diag-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}.tar.gz")
    except OptionError as exc:
        fail_lines([f"gpufleet diag: {exc}"])
    chosen = list(dict.fromkeys(hosts)) or fleet.hosts
    secrets = fleet_secrets(fleet.configs.values())
    for line in secrets.unread:
        click.echo(f"warning: not sought by value in what is collected (redacted by name only): {line}", err=True)
    override = parse_data_args(list(data)) or None

    click.echo(f"gpufleet diag: {len(chosen)} nodes, the last {since}, at most {NODE_BOUND_S:g} s and {max_mib} MiB"
               " each", err=True)
    try:
        runs = collect(chosen, _connections(inventory, override), since_s, max_mib * MIB, collect_env)
        series = snapshots(_prometheus(fleet), chosen, since_s, time.time(), max_mib * MIB)
        header = {"inventory": inventory, "hosts": chosen, "since": since, "since_s": since_s,
                  "bound_s": NODE_BOUND_S, "max_bytes_per_node": max_mib * MIB, "collect_env": collect_env}
        written = write_archive(out, runs, secrets, header, max_mib * MIB, _plan(fleet), series)
    except OutReplaced as exc:
        click.echo(f"gpufleet diag: --out {exc}: nothing written", err=True)
        raise SystemExit(EXIT_FAILED) from None
    except BaseException:
        out.remove()  # the file made to prove --out, empty or cut short
        raise
    _report(written, since, max_mib)
    if any(run.problem is not None and not run.archive for run in runs.values()):
        raise SystemExit(EXIT_FAILED)
