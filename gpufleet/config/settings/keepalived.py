"""keepalived's settings: the routers' virtual address.

Each field is one variable's record (:mod:`gpufleet.config.settings`); ``roles/keepalived/defaults.yml`` is written
from them.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from gpufleet.config.settings import RoleSettings, setting
from gpufleet.values import grammar
from gpufleet.values.types import OptionalSecret, text


def _virtual_address(value: str) -> str | None:
    """The routers' virtual address: one unicast IPv4 address (VRRP version 2, the version with a group password)."""
    if problem := grammar.node_address(value):
        return problem
    if ":" in value:
        return ("expected an IPv4 address (VRRP 2, whose group has a password, is IPv4 only),"
                f" found {grammar.show(value)}")
    return None

class KeepalivedSettings(RoleSettings):
    """The routers' virtual address: with two or more hosts in the inventory group `routers`, keepalived (the
    distribution's package) keeps router_virtual_address on one router at a time, by VRRP (version 2, unicast
    between the routers' own addresses, a group password). A router whose HAProxy stops answering (its /health on
    router_metrics_port) gives the address up at once; the router with the next priority (the group's order: the
    first router listed has the highest) takes it and announces it (gratuitous ARP). A router that comes back does
    not take the address back (nopreempt): each move cuts the connections in flight on the address. Clients use
    router_virtual_address:router_port; HAProxy on every router listens on it too. Without router_virtual_address
    (the default) no router runs keepalived, and one that did is stopped and disabled.
    """

    router_virtual_address: text(_virtual_address) | None = setting(  # type: ignore[valid-type]
        None,
        "IPv4 address clients reach the routers at; null: no virtual address. In the routers' network (their own "
        "addresses and router_virtual_prefix), and no host's own address. The same on every router. Needs two or "
        "more hosts in `routers` and router_vrrp_password. Held by one router at a time, it moves within seconds "
        "when that router or its HAProxy goes down; unset again, keepalived is stopped and disabled.",
        scope="vrrp", read_on="routers",
    )

    router_virtual_interface: text(grammar.ifname) | None = setting(  # type: ignore[valid-type]
        None,
        "Interface the virtual address is added to on each router; null: fleet_interface, else the interface that "
        "holds the router's own address (read from the router at deploy time). May differ between routers.",
        read_on="routers",
    )

    router_virtual_prefix: Annotated[int, Field(ge=8, le=30)] = setting(
        24,
        "Prefix length (8-30) of the routers' network: the virtual address is added as ADDRESS/PREFIX, and it and "
        "every router's own address must lie in one network of this length. The same on every router.",
        scope="vrrp", read_on="routers",
    )

    router_virtual_router_id: Annotated[int, Field(ge=1, le=255)] = setting(
        51,
        "VRRP's virtual router id (1-255): unique among the VRRP groups on the routers' network segment (two "
        "groups with one id disturb each other). The same on every router.",
        scope="vrrp", read_on="routers",
    )

    router_vrrp_password: OptionalSecret = setting(
        None,
        "The VRRP group's password, a secret reference ({env: NAME} or {file: PATH}, read on the controller): 1 to "
        "8 printable ASCII characters without blanks, quotes, braces, backslashes, '#' or '!' (VRRP 2 carries 8 "
        "bytes). Required with router_virtual_address, and refused without one, as are the other settings here. It "
        "is written only to keepalived's configuration (root:keepalived, 0640). VRRP sends it in clear text: it "
        "keeps a misconfigured neighbour out, not an attacker; the routers accept VRRP from each other only "
        "(keepalived's unit filters by address).",
        scope="vrrp", read_on="routers", secret="reference",
    )
