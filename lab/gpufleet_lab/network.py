"""The lab's network: one host bridge, the nodes' addresses on it, and nothing routed beyond it.

The bridge takes the subnet's first host address (10.213.0.1 in 10.213.0.0/24); nodes take .11, .12, ...
Each node's ``host0`` (the container side of the veth systemd-nspawn attaches to the bridge) is
configured by systemd-networkd inside the node from a file the lab writes into its rootfs: a static
address, no gateway, no IPv6 autoconfiguration. The node therefore has no default route and reaches
only the lab subnet; the host does not forward between interfaces for it.
"""

from __future__ import annotations

import ipaddress
import json
import re
import subprocess
from pathlib import Path

from gpufleet_lab.errors import LabError

DEFAULT_BRIDGE = "gflab0"
DEFAULT_SUBNET = "10.213.0.0/24"
FIRST_NODE_HOST = 11  # node addresses start at .11
_IFNAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,14}$")


def check_bridge_name(name: str) -> str:
    if not _IFNAME.match(name):
        raise LabError(f"--bridge {name!r} is not an interface name (a letter, then up to 14 of A-Z a-z 0-9 _ -)")
    return name


def parse_subnet(cidr: str) -> ipaddress.IPv4Network:
    try:
        net = ipaddress.IPv4Network(cidr, strict=True)
    except ValueError as exc:
        raise LabError(f"--subnet {cidr!r} is not an IPv4 network like {DEFAULT_SUBNET}: {exc}") from None
    if not net.is_private:
        raise LabError(f"--subnet {cidr} is not a private range; the lab uses private addresses only")
    return net


def bridge_address(net: ipaddress.IPv4Network) -> ipaddress.IPv4Address:
    return net.network_address + 1


def virtual_address(net: ipaddress.IPv4Network) -> ipaddress.IPv4Address:
    """The routers' virtual address on the lab bridge (``router_virtual_address``): .10, below the first node."""
    return net.network_address + FIRST_NODE_HOST - 1


def node_addresses(net: ipaddress.IPv4Network, count: int) -> list[ipaddress.IPv4Address]:
    """The addresses of nodes 1..count: .11, .12, ... of the subnet."""
    last = net.network_address + FIRST_NODE_HOST + count - 1
    if count < 1 or last >= net.broadcast_address:
        room = max(0, net.num_addresses - FIRST_NODE_HOST - 1)
        raise LabError(f"subnet {net} holds {room} lab nodes (from .{FIRST_NODE_HOST}); asked for {count}")
    return [net.network_address + FIRST_NODE_HOST + i for i in range(count)]


def _ip_json(*args: str) -> list[dict[str, object]]:
    done = subprocess.run(["ip", "-json", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return []
    parsed: list[dict[str, object]] = json.loads(done.stdout or "[]")
    return parsed


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise LabError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")


def link_exists(name: str) -> bool:
    return Path("/sys/class/net", name).exists()


def bridge_ports(bridge: str) -> list[str]:
    """Interfaces enslaved to ``bridge`` (the host sides of the nodes' veths)."""
    return [str(link["ifname"]) for link in _ip_json("link", "show", "master", bridge)] if link_exists(bridge) else []


def check_subnet_free(net: ipaddress.IPv4Network, bridge: str) -> None:
    """Refuse a subnet that overlaps one the host already routes through another interface."""
    for route in _ip_json("-4", "route", "show"):
        dst, dev = str(route.get("dst", "")), str(route.get("dev", ""))
        if dst in ("", "default") or dev == bridge:
            continue
        try:
            overlaps = ipaddress.IPv4Network(dst, strict=False).overlaps(net)
        except ValueError:
            continue
        if overlaps:
            raise LabError(f"subnet {net} overlaps {dst} on {dev}; pick another with --subnet")


def host_forwards_ipv4() -> bool:
    """True when the host routes between its interfaces (then only the nodes' lack of a gateway keeps them in)."""
    try:
        return Path("/proc/sys/net/ipv4/ip_forward").read_text().strip() == "1"
    except OSError:
        return False


def create_bridge(bridge: str, net: ipaddress.IPv4Network) -> None:
    """Create the bridge with the host's lab address; IPv6 off so the lab link stays quiet."""
    if link_exists(bridge):
        raise LabError(f"interface {bridge} already exists; is another lab up? (`gpufleet lab down` removes the lab's)")
    _ip("link", "add", bridge, "type", "bridge", "forward_delay", "0", "stp_state", "0")
    disable_v6 = Path("/proc/sys/net/ipv6/conf", bridge, "disable_ipv6")
    if disable_v6.exists():
        disable_v6.write_text("1\n")
    _ip("addr", "add", f"{bridge_address(net)}/{net.prefixlen}", "dev", bridge)
    _ip("link", "set", bridge, "up")


def link_with_index(index: int) -> str | None:
    """The name of this host's interface with ``index`` (a node's ``host0`` names its peer by it), or None."""
    return next((str(link["ifname"]) for link in _ip_json("link", "show") if link.get("ifindex") == index), None)


def delete_link(name: str) -> None:
    """Remove an interface (a veth: both ends go) if it is there."""
    if link_exists(name):
        subprocess.run(["ip", "link", "del", name], capture_output=True, check=False)


def delete_bridge(bridge: str) -> None:
    """Remove any veth left on the bridge, then the bridge."""
    for port in bridge_ports(bridge):
        subprocess.run(["ip", "link", "del", port], capture_output=True, check=False)
    if link_exists(bridge):
        _ip("link", "del", bridge)


def networkd_config(address: ipaddress.IPv4Address, net: ipaddress.IPv4Network) -> str:
    """The node's ``/etc/systemd/network/10-lab.network``: a static address on host0 and no gateway."""
    return (
        "# gpufleet lab: this node's address on the lab bridge; no gateway, no route out.\n"
        "[Match]\nName=host0\n\n"
        f"[Network]\nAddress={address}/{net.prefixlen}\n"
        "LinkLocalAddressing=no\nIPv6AcceptRA=no\n"
    )


def hosts_file(names: dict[str, ipaddress.IPv4Address], host_name: str, host_address: ipaddress.IPv4Address) -> str:
    """``/etc/hosts`` for a node: loopback plus every lab node and the host's bridge address."""
    lines = ["127.0.0.1\tlocalhost", "::1\t\tlocalhost ip6-localhost ip6-loopback", f"{host_address}\t{host_name}"]
    lines += [f"{addr}\t{name}" for name, addr in names.items()]
    return "\n".join(lines) + "\n"
