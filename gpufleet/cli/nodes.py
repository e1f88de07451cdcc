"""``gpufleet nodes``: each node's place in the fleet, and people's moves through the same path as the automatic one.

    gpufleet nodes INVENTORY [--json]
    gpufleet nodes INVENTORY quarantine|readmit|retire|burn-in HOST --why TEXT [--force]

The list reads every serving node's record (its own, or the monitoring hosts' copy where that holds more) and keeps
each on the monitoring hosts. A move is judged first (an unknown host, one in no serving pool, a move the state
machine does not allow, a missing or unprintable reason: one line, exit 2, before any node is changed), then made by
the node's own tool, so that its watch acts on it as on a finding: a quarantine drains the node at every router
before its replicas stop; a readmission runs the full burn-in until it has passed ``node_readmit_passes`` times (a
suspect node, which still serves, is simply cleared); ``burn-in`` runs the full burn-in on request: the node, in
service, is drained and stopped as for a quarantine (none is counted), and one clean full pass brings it back.
"""

from __future__ import annotations

import getpass
import json
from datetime import UTC, datetime

import click

from gpufleet.cli.inputs import DATA_OPTION, cli_fleet, fail_lines, group_hosts, shown_host
from gpufleet.config.inventory_shape import MONITORING_GROUP
from gpufleet.inventory.load import parse_data_args
from gpufleet.node import node_state
from gpufleet.remote import node_records
from gpufleet.remote.commands import PyinfraRemote
from gpufleet.remote.gpu_probe import load_inventory
from gpufleet.values import grammar

ACTIONS = {"quarantine": "quarantined", "readmit": "burn-in", "retire": "retired", "burn-in": "burn-in"}
# the states each action starts from, beyond what the state machine allows (it lets a node in service go to burn-in:
# that is the full burn-in on request, not a readmission)
FROM: dict[str, tuple[str, ...]] = {"readmit": ("quarantined", "retired", "suspect"),
                                    "burn-in": node_state.IN_SERVICE}
EXIT_FAILED = 1


def why_problem(why: str) -> str | None:
    """What is wrong with a reason (kept in the node's history on the node and the monitoring hosts), without
    showing it: it may hold what it must not."""
    try:
        why.encode()
    except UnicodeEncodeError:
        return "text that is not UTF-8"
    if grammar.secret_like(why):
        return "text that looks like a credential (not shown; it would be kept in the node's history)"
    if (char := grammar.control_char(why)) is not None:
        return f"a control, format or line-break character ({char})"
    if not why.strip():
        return "only blanks" if why else "nothing"
    if len(why) > 200:
        return f"{len(why)} characters"
    return None


def describe(host: str, record: node_records.Record | None) -> str:
    """One line: the node's state and since when, its GPUs' failures, its last burn-in and its last move."""
    if record is None:
        return f"{host}: new (no record yet: its first deploy admits it)"
    last = record.get("last_burn_in") or {}
    burn = (f"last burn-in {last.get('tier')} {'passed' if last.get('passed') else 'FAILED'} {last.get('at')}"
            if last else "no burn-in yet")
    failing = [k for k, v in (record.get("gpus") or {}).items() if v.get("failed")]
    move = (record.get("history") or [{}])[-1]
    why = f"; last move: {move.get('why')} ({move.get('by')})" if move else ""
    gpus = f"; GPUs with failures: {', '.join(sorted(failing))}" if failing else ""
    return (f"{host}: {record['state']} since {record['since']}; {len(record.get('quarantines') or [])} "
            f"quarantine(s); {burn}{gpus}{why}")


@click.command("nodes")
@click.argument("inventory")
@click.argument("action", required=False, type=click.Choice(sorted(ACTIONS)))
@click.argument("host", required=False)
@click.option("--why", "whys", multiple=True, help="Why (kept in the node's history): 1 to 200 printable characters.")
@click.option("--force", is_flag=True, help="Readmit a retired node.")
@click.option("--json", "as_json", is_flag=True, help="Print the records as JSON.")
@DATA_OPTION
def nodes_command(inventory: str, action: str | None, host: str | None, whys: tuple[str, ...], force: bool,
                  as_json: bool, data: tuple[str, ...]) -> None:
    """List each node's lifecycle state, GPUs, last burn-in and history; or quarantine, readmit or retire a node, or
    run the full burn-in on one in service (drained and stopped meanwhile).

    Exit 0 when every record was read (and the move made), 1 when one could not be, 2 on bad input.
    """
    fleet = cli_fleet(inventory, data)
    nodes = [h for h in fleet.hosts if fleet.serves(h)]
    why = whys[-1] if whys else None
    if action is None and (host is not None or whys or force):
        raise click.UsageError("give an action (quarantine, readmit, retire or burn-in) with HOST, --why and --force")
    if action is not None:
        if host is None:
            raise click.UsageError(f"give the HOST to {action}")
        if host not in fleet.hosts:
            fail_lines([f"{inventory}: HOST: expected a host of the inventory ({', '.join(fleet.hosts)}),"
                        f" found {shown_host(host)}"])
        if host not in nodes:
            fail_lines([f"{inventory}: {host}: expected a host of a serving pool, found one in no pool (a router"
                        " or monitoring host has no lifecycle)"])
        if not fleet.configs[host].node_lifecycle_enabled:
            fail_lines([f"{inventory}: {host}: node_lifecycle_enabled: expected true to {action} the node (its"
                        " watch acts on the move), found false"])
        if force and action != "readmit":
            fail_lines([f"gpufleet nodes {action}: --force: expected only with readmit (a retired node back),"
                        f" found it with {action}"])
        if len(whys) > 1:
            fail_lines([f"gpufleet nodes {action}: --why: expected once, found {len(whys)} times"])
        problem = "nothing" if why is None else why_problem(why)
        if problem is not None:
            fail_lines([f"gpufleet nodes {action}: --why: expected 1 to 200 printable characters, found {problem}"])
    monitoring = group_hosts(fleet, MONITORING_GROUP)
    remote = PyinfraRemote(load_inventory(inventory, parse_data_args(list(data)) if data else None))
    try:
        targets = [host] if action is not None and host is not None else nodes
        records = node_records.read(remote, targets, monitoring)
        problems = list(records.problems)
        if action is not None and host is not None and why is not None:
            current = records.found.get(host) or node_state.new_record(host, datetime.now(UTC))
            # readmitting a suspect node clears it (it still serves); any other readmission starts with burn-in
            to = "serving" if action == "readmit" and current["state"] == "suspect" else ACTIONS[action]
            if current["state"] not in FROM.get(action, node_state.STATES):
                fail_lines([f"gpufleet nodes {action}: {host}: cannot {action} a node that is {current['state']}"
                            f" (only one that is {', '.join(FROM[action])})"])
            try:  # judged here first, as the node's tool will judge it
                node_state.move(current, to, why, datetime.now(UTC), force=force)  # type: ignore[arg-type]
            except node_state.MoveRefused as refused:
                fail_lines([f"gpufleet nodes {action}: {refused}"])
            moved, error = node_records.move(remote, host, to, why, f"{getpass.getuser()} (gpufleet nodes)", force)
            if moved is None:
                click.echo(f"{host}: not moved: {error}", err=True)
                raise SystemExit(EXIT_FAILED)
            records.found[host] = moved
        for record in records.found.values():
            if record is not None:
                problems += node_records.keep(remote, monitoring, record)
    finally:
        remote.close()
    if as_json:
        click.echo(json.dumps(records.found, indent=1))
    else:
        for name, record in records.found.items():
            click.echo(f"{name}: not known (its record could not be read, below)" if record is None
                       and name in records.unread else describe(name, record))
    for line in problems:
        click.echo(line, err=True)
    if problems:
        raise SystemExit(EXIT_FAILED)
