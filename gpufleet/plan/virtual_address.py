"""The routers' virtual address (``router_virtual_address``): one IPv4 address that keepalived keeps on one router
at a time, by VRRP version 2 (the version whose group has a password) unicast between the routers' own addresses.

:func:`problems` is what ``gpufleet check`` and every deploy refuse before any host, one line each:

- a virtual address with fewer than two hosts in the group ``routers``;
- a value every router must share (the address, ``router_virtual_prefix``, ``router_virtual_router_id``,
  ``router_vrrp_password``) that differs between routers;
- a router without an IPv4 address of its own (``fleet_address``, else an IPv4 host name): VRRP's unicast peers;
- a virtual address outside the routers' network (each router's address with ``router_virtual_prefix``), that
  network's own or broadcast address, or the address of any host of the inventory;
- no ``router_vrrp_password``, or one that keepalived's ``auth_pass`` cannot hold (1 to 8 printable ASCII
  characters, no blank, quote, ``#`` or ``!``), or one the controller cannot read now (unset, not a regular file,
  empty, two lines): the deploy reads it again and stops on the same problem before it changes anything.

:func:`group` gives the deploy and the CLI the VRRP group as data: the address, each router's own address, its
priority (the group's order: the first router listed has the highest) and its peers; :func:`endpoint_line` the
fleet's endpoint as ``gpufleet plan`` and ``gpufleet upgrade``/``rollback`` print it (a rollout still drains each
replica on every router, through each router's own HAProxy).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpufleet.config.inventory_shape import ROUTERS_GROUP
from gpufleet.config.layers import is_role_default
from gpufleet.config.schema import HostConfig, keys
from gpufleet.config.secrets import read_secret
from gpufleet.values import grammar
from gpufleet.values.problems import ConfigError, Problem
from gpufleet.values.types import SecretRef

KEY = "router_virtual_address"
PASSWORD_KEY = "router_vrrp_password"
SHARED = keys(scope="vrrp")
"""The VRRP group's settings: the same on every router."""
KEEPALIVED_CONF = "keepalived's configuration"  # where the VRRP password goes
VRRP_ONLY = tuple(name for name in keys(role="keepalived") if name != KEY)
"""keepalived's settings beside the virtual address, which nothing else reads."""
TOP_PRIORITY = 250  # the first router's VRRP priority; each next one is one lower (255 is the address owner's)
PASSWORD = re.compile(r"[A-Za-z0-9$%&()*+,./:;<=>?@\[\]^_`|~-]{1,8}")
"""What keepalived's ``auth_pass`` holds: VRRP 2 carries 8 bytes; a blank, a quote, ``#`` or ``!`` (comments), a
brace (keepalived reads one as a block's start or end, inside a word too) or a backslash would change how keepalived
reads the line."""
PASSWORD_EXPECTED = ("expected 1 to 8 printable ASCII characters without blanks, quotes, braces, backslashes, '#' or"
                     " '!' (keepalived's auth_pass: VRRP 2 carries 8 bytes)")


@dataclass(frozen=True)
class VirtualAddress:
    """The routers' VRRP group."""

    address: str
    prefix: int
    router_id: int
    routers: tuple[tuple[str, str], ...]  # (router host, its own IPv4 address), in the group's order

    @property
    def network(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(f"{self.address}/{self.prefix}", strict=False)

    def own_address(self, router: str) -> str:
        return dict(self.routers)[router]

    def priority(self, router: str) -> int:
        """VRRP priority: the group's order, the first router highest."""
        return TOP_PRIORITY - [host for host, _ in self.routers].index(router)

    def peers(self, router: str) -> list[str]:
        """The other routers' addresses, which ``router`` sends its advertisements to."""
        return [address for host, address in self.routers if host != router]

    def endpoint(self, port: int) -> str:
        """Where clients reach the fleet: ``ADDRESS:PORT``."""
        return f"{self.address}:{port}"


def router_address(host: str, cfg: HostConfig) -> str | None:
    """A router's own IPv4 address: ``fleet_address``, else its inventory name when that is an IPv4 address."""
    candidate = cfg.fleet_address or host
    try:
        address = ipaddress.ip_address(candidate)
    except ValueError:
        return None
    return str(address) if address.version == 4 else None


def host_address(host: str, cfg: HostConfig) -> str | None:
    """Any host's own address (``fleet_address``, else its name when that is an IP address)."""
    candidate = cfg.fleet_address or host
    try:
        return str(ipaddress.ip_address(candidate))
    except ValueError:
        return None


def routers_of(groups: Iterable[tuple[str, Sequence[str]]]) -> list[str]:
    """The hosts of the group ``routers``, in its order (none without one)."""
    return next((list(members) for name, members in groups if name == ROUTERS_GROUP), [])


def group(routers: Sequence[str], configs: Mapping[str, HostConfig]) -> VirtualAddress | None:
    """The VRRP group of validated routers; None without a virtual address or with fewer than two routers."""
    if len(routers) < 2 or any(r not in configs for r in routers):
        return None
    first = configs[routers[0]]
    if first.router_virtual_address is None:
        return None
    own = [(r, router_address(r, configs[r]) or r) for r in routers]
    return VirtualAddress(str(first.router_virtual_address), first.router_virtual_prefix,
                          first.router_virtual_router_id, tuple(own))


def routers_url(routers: Sequence[str], configs: Mapping[str, HostConfig]) -> str:
    """Where clients reach the routers (``routers``: the group, in its order, non-empty): the virtual address, else
    the first router's own address, on ``router_port``; HTTPS when the routers serve TLS."""
    first = configs[routers[0]]
    vip = group(routers, configs)
    address = vip.address if vip is not None else (host_address(routers[0], first) or routers[0])
    scheme = "https" if first.router_tls_certificate is not None else "http"
    return f"{scheme}://{address}:{first.router_port}"


def endpoint_line(routers: Sequence[str], configs: Mapping[str, HostConfig]) -> str | None:
    """The fleet's endpoint as ``gpufleet plan`` and a rollout print it: the virtual address, and the routers that
    hold it one at a time (each also serves on its own address); None without a virtual address. HTTPS when the
    routers serve TLS on ``router_port``."""
    vip = group(routers, configs)
    if vip is None:
        return None
    first = configs[routers[0]]
    scheme = "https" if first.router_tls_certificate is not None else "http"
    return (f"endpoint: {scheme}://{vip.endpoint(first.router_port)} (router_virtual_address: one of the"
            f" routers {', '.join(routers)} at a time, moved by keepalived)")


def password_problem(password: str) -> str | None:
    """Why keepalived's ``auth_pass`` cannot hold ``password`` (the text never shows it); None when it can."""
    if PASSWORD.fullmatch(password):
        return None
    return f"{PASSWORD_EXPECTED}, found a value that is not (not shown: a secret)"


def read_password(ref: SecretRef | None) -> str:
    """The VRRP group's password, read on the controller (raises ConfigError naming the key, the value unshown)."""
    if ref is None:
        raise ConfigError([Problem("controller", PASSWORD_KEY, f"expected a secret reference with {KEY},"
                                                               " found null")])
    value = read_secret(ref, PASSWORD_KEY, into=KEEPALIVED_CONF)
    if problem := password_problem(value):
        raise ConfigError([Problem("controller", PASSWORD_KEY, problem)])
    return value


def problems(routers: Sequence[str], configs: Mapping[str, HostConfig],
             source: Callable[[str, str], str], ssh: Mapping[str, str] | None = None,
             set_by: Callable[[str, str], str | None] | None = None) -> list[Problem]:
    """What no single host shows about the virtual address; ``source(host, key)``: the file to name for the key;
    ``ssh``: each host's SSH address where the inventory gives one (pyinfra's ``ssh_hostname``); ``set_by(host,
    key)``: the file that set the key itself (None or a role's defaults where none did)."""
    setting = [h for h, cfg in configs.items() if cfg.router_virtual_address is not None]
    if not setting:
        return _without_address(configs, set_by) if set_by is not None else []
    if len(routers) < 2:
        listed = f"{len(routers)} ({', '.join(routers)})" if routers else "none"
        return [Problem(source(setting[0], KEY), KEY, f"expected two or more hosts in the group {ROUTERS_GROUP}"
                                                      f" (keepalived moves the address between them), found {listed}")]
    valid = [r for r in routers if r in configs]  # a router whose own values were refused is named by those
    if not valid:
        return []
    found = _differences(valid, configs, source)
    if found or configs[valid[0]].router_virtual_address is None:
        return found
    first = configs[valid[0]]
    vip = ipaddress.IPv4Address(first.router_virtual_address)
    for router in valid:
        own = router_address(router, configs[router])
        if own is None:
            shown = grammar.show(configs[router].fleet_address or router)
            found.append(Problem(source(router, "fleet_address"), "fleet_address",
                                 f"expected the router's own IPv4 address with {KEY} (its VRRP peers' address),"
                                 f" found {shown}", (router,)))
            continue
        network = ipaddress.IPv4Network(f"{own}/{first.router_virtual_prefix}", strict=False)
        if vip not in network:
            found.append(Problem(source(router, KEY), KEY, f"expected an address in the routers' network {network}"
                                 f" (router {router} at {own}, router_virtual_prefix {first.router_virtual_prefix}),"
                                 f" found {vip}"))
        elif network.prefixlen < 31 and vip in (network.network_address, network.broadcast_address):
            found.append(Problem(source(router, KEY), KEY, f"expected a host address of the routers' network"
                                                           f" {network}, found its own address {vip}"))
    found += _taken(vip, configs, ssh or {}, lambda key: source(valid[0], key))
    found += _router_side_problems(valid, configs, source)
    found += _password_problems(valid[0], first, source)
    return found


LISTENERS = ("node_exporter_listen_address", "alertmanager_listen_address")
"""The addresses a host's own services listen on (``router_listen_address``: :func:`_router_side_problems`)."""


def _taken(vip: ipaddress.IPv4Address, configs: Mapping[str, HostConfig], ssh: Mapping[str, str],
           source: Callable[[str], str]) -> list[Problem]:
    """The virtual address where a host already is: its own address, its SSH address, one its services listen on."""
    for host, cfg in configs.items():
        for what, address in (("the address", host_address(host, cfg)), ("the SSH address", ssh.get(host)),
                              *((f"{key}", getattr(cfg, key)) for key in LISTENERS)):
            if address is not None and _same(address, vip):
                return [Problem(source(KEY), KEY, f"expected an address no host has, found {vip}, {what} of {host}")]
    return []


def _same(address: str, vip: ipaddress.IPv4Address) -> bool:
    try:
        return ipaddress.ip_address(address) == vip
    except ValueError:
        return False


def _without_address(configs: Mapping[str, HostConfig], set_by: Callable[[str, str], str | None]) -> list[Problem]:
    """keepalived's settings set by a file where no virtual address is, which keepalived alone reads: named once
    per file and key, never ignored."""
    found: dict[tuple[str, str], list[str]] = {}
    for host in configs:
        for key in VRRP_ONLY:
            where = set_by(host, key)
            if where is not None and not is_role_default(where):
                found.setdefault((where, key), []).append(host)
    return [Problem(where, key, f"expected it only beside {KEY} (keepalived reads it), found it set without one",
                    tuple(hosts)) for (where, key), hosts in found.items()]


def _router_side_problems(routers: Sequence[str], configs: Mapping[str, HostConfig],
                          source: Callable[[str, str], str]) -> list[Problem]:
    """A router listening on the virtual address (HAProxy binds it as well, on every router), or keeping the
    address on the loopback interface (no neighbour would reach it there)."""
    found: list[Problem] = []
    vip = configs[routers[0]].router_virtual_address
    for router in routers:
        cfg = configs[router]
        listen = cfg.router_listen_address
        if listen is not None and listen not in ("0.0.0.0", router_address(router, cfg)):
            what = "the virtual address" if listen == vip else "another address"
            found.append(Problem(source(router, "router_listen_address"), "router_listen_address",
                                 f"expected the router's own address or 0.0.0.0 beside {KEY} (every router binds the"
                                 f" virtual address as well), found {what} {listen}", (router,)))
        if cfg.router_virtual_interface == "lo":
            found.append(Problem(source(router, "router_virtual_interface"), "router_virtual_interface",
                                 "expected the interface on the routers' network (keepalived answers ARP for the"
                                 " virtual address there), found lo, the loopback", (router,)))
    return found


def _differences(routers: Sequence[str], configs: Mapping[str, HostConfig],
                 source: Callable[[str, str], str]) -> list[Problem]:
    """The shared values that differ between routers (a secret's value never shown)."""
    found = []
    for key in SHARED:
        values = {r: getattr(configs[r], key) for r in routers}
        first = values[routers[0]]
        other = next((r for r in routers if values[r] != first), None)
        if other is None:
            continue
        if key == PASSWORD_KEY:
            shown = f"another value on {other} than on {routers[0]} (not shown: a secret)"
        else:
            shown = f"{routers[0]}={grammar.show(first)}, {other}={grammar.show(values[other])}"
        found.append(Problem(source(other, key), key, f"expected one value on every router, found {shown}"))
    return found


def _password_problems(router: str, cfg: HostConfig, source: Callable[[str, str], str]) -> list[Problem]:
    if cfg.router_vrrp_password is None:
        return [Problem(source(router, PASSWORD_KEY), PASSWORD_KEY,
                        f"expected a secret reference ({{env: NAME}} or {{file: PATH}}) with {KEY}"
                        " (the VRRP group's password), found null")]
    try:
        problem = password_problem(read_secret(cfg.router_vrrp_password, PASSWORD_KEY, into=KEEPALIVED_CONF))
    except ConfigError as error:
        problem = error.problems[0].message
    return [Problem(source(router, PASSWORD_KEY), PASSWORD_KEY, problem)] if problem else []
