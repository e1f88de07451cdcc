"""``gpufleet lab``: bring the local lab fleet up, show it, take it down."""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import NoReturn, TypeVar

import click

from gpufleet.values.problems import EXIT_BAD_INPUT, one_line
from gpufleet_lab import network, nodes
from gpufleet_lab.errors import LabError, LabInputError
from gpufleet_lab.first_request import first_request

T = TypeVar("T")


def _fail(message: str, status: int = 1) -> NoReturn:
    click.echo(f"gpufleet lab: {one_line(message)}", err=True)
    sys.exit(status)


def _run(action: Callable[[], T]) -> T:
    """Run a lab action; any LabError becomes one line on stderr and exit status 1 (2 for bad input)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    logging.getLogger("paramiko").setLevel(logging.WARNING)
    try:
        return action()
    except LabInputError as exc:
        _fail(str(exc), EXIT_BAD_INPUT)
    except LabError as exc:
        _fail(str(exc))
    except KeyboardInterrupt:
        _fail("interrupted")


@click.group("lab")
def lab_group() -> None:
    """The local lab: Debian nodes booted by systemd-nspawn on this machine, reached over SSH."""


@lab_group.command("up")
@click.option("--nodes", "count", type=click.IntRange(1, 64), default=3, show_default=True, help="Number of nodes.")
@click.option("--profile", "profiles", multiple=True, metavar="PROFILE",
              help=f"Hardware profile: once for all nodes, or once per node (default {nodes.DEFAULT_PROFILE}).")
@click.option("--subnet", default=network.DEFAULT_SUBNET, show_default=True,
              help="Lab subnet: the bridge takes .1, nodes .11, .12, ...")
@click.option("--bridge", default=network.DEFAULT_BRIDGE, show_default=True,
              help="Name of the host bridge (a second lab needs its own, its own subnet and GPUFLEET_LAB_DIR).")
def up_command(count: int, profiles: tuple[str, ...], subnet: str, bridge: str) -> None:
    """Boot the lab's nodes and wait until each answers over SSH."""
    started = time.monotonic()
    state = _run(lambda: nodes.up(count, list(profiles) or None, subnet, bridge=bridge))
    click.echo(f"lab up: {len(state.nodes)} node(s) on {state.bridge} ({state.subnet})"
               f" in {time.monotonic() - started:.1f} s")
    for node in state.nodes:
        click.echo(f"  {node.name}  {node.address}  {node.profile}")
    click.echo(f"ssh -F {state.ssh_config} lab1   |   pyinfra inventories/lab/inventory.py deploys/common.py")


@lab_group.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
def status_command(as_json: bool) -> None:
    """List the lab's nodes, their addresses and profiles, and whether each is up."""
    lab = _run(nodes.status)
    if as_json:
        payload = None if lab is None else {**asdict(lab), "nodes": [{**asdict(n), "up": n.up} for n in lab.nodes]}
        click.echo(json.dumps(payload, indent=2))
        return
    if lab is None:
        click.echo("no lab is up")
        return
    click.echo(f"bridge {lab.bridge} {lab.bridge_address} ({lab.subnet}); key {lab.ssh_key}")
    click.echo(f"{'NODE':<7}{'ADDRESS':<16}{'PROFILE':<20}STATE")
    for node in lab.nodes:
        state = "up" if node.up else ("no ssh" if node.process_alive else "down")
        click.echo(f"{node.name:<7}{node.address:<16}{node.profile:<20}{state}")


@lab_group.command("client")
@click.option("--inventory", default="inventories/lab/inventory.py", show_default=True,
              help="The lab's inventory file.")
@click.option("--client", "client_name", default="lab", show_default=True,
              help="The router client (a key of router_clients) whose key the request carries.")
def client_command(inventory: str, client_name: str) -> None:
    """Print the routers' endpoint, the CA that signs their certificate, the client's key file, and a curl line that
    gets a completion through the virtual address (curl reads the key from a 0600 header file beside the key's)."""
    found = _run(lambda: first_request(inventory, client_name))
    for line in found.lines():
        click.echo(line)


@lab_group.command("down")
def down_command() -> None:
    """Power off every lab node and remove the lab's bridge, mounts and node directories."""
    started = time.monotonic()
    state = _run(nodes.down)
    if state is None:
        click.echo("no lab is up")
        return
    click.echo(f"lab down: {len(state.nodes)} node(s) stopped in {time.monotonic() - started:.1f} s")


if __name__ == "__main__":
    lab_group()
