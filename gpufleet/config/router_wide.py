"""The edge is the routers', and one: what clients see of it is the same on every router of the fleet (they reach
any of them, and the virtual address moves), it is set for no host that routes nothing (where it would do nothing,
silently), and it leaves no way around the client keys.

- :data:`ROUTER_WIDE`: one value on every host of the group ``routers`` (secrets compared by their reference,
  never shown);
- :data:`EDGE_ONLY`: set for a host outside ``routers`` by a file (or ``--data``) that sets it for no router:
  refused, naming the routers; :data:`POOL_READ`, read from the serving hosts, set only for routers that serve
  nothing: refused, naming the serving hosts;
- every router has an IP address (``fleet_address``, else an inventory name that is one) where replicas are
  served (their filters let the routers in by address), and none listens on another router's address;
- with client keys: every serving pool has a replicas' key (``vllm_api_key``; without one the replicas answer
  anyone), no client's key is a replicas' key (it would sit in clear in the routers' upstream map), and
  ``vllm_api_allowed_from`` lets no wide network reach the replicas past the routers (:data:`WIDEST_PREFIX`).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel

from gpufleet.config.layers import HostLayers, Layer, is_role_default
from gpufleet.config.schema import RECORDS, HostConfig, keys, shown_in_tree
from gpufleet.values.grammar import show
from gpufleet.values.problems import Problem, shown_key
from gpufleet.values.types import SecretRef

ROUTER_WIDE = keys(scope="routers")
"""What clients see of the edge: one value on every router."""

EDGE_ONLY = keys(read_on="routers")
"""Settings only a router reads (a router-wide setting a serving host also reads, ``router_port``, is not one)."""

POOL_READ = keys(read_on="pools")
"""Settings of the routing that are read from the serving pools' hosts (each backend's policy and admission, the
replicas' key and filter), never from a router's own."""

SECRET_HOLDING = frozenset(name for name in ROUTER_WIDE if RECORDS[name].secret)

WIDEST_PREFIX = {4: 16, 6: 48}
"""The widest network ``vllm_api_allowed_from`` may name beside client keys, by IP version: a site's hosts (the
controller, a bench host), not a provider's or the Internet."""


def router_wide_problems(hosts: dict[str, HostLayers], configs: dict[str, HostConfig], routers: Sequence[str],
                         override: dict[str, Any] | None) -> list[Problem]:
    """The edge's settings across the fleet (``routers``: the hosts of the group ``routers``)."""
    sources = _sources(hosts, configs, override)
    problems = _differences([r for r in routers if r in configs], configs, lambda h, k: sources[h].get(k, "controller"))
    problems += _outside(configs, routers, sources)
    return problems


def pool_read_problems(hosts: dict[str, HostLayers], configs: dict[str, HostConfig], routers: Sequence[str],
                       serving: Sequence[str], override: dict[str, Any] | None) -> list[Problem]:
    """:data:`POOL_READ` keys set by a file (or ``--data``) for routers that serve nothing and for no serving host:
    the routers never read them, and the pools keep their own."""
    idle = [r for r in routers if r in configs and r not in serving]
    found = _set_elsewhere(idle, serving, POOL_READ, _sources(hosts, configs, override))
    pools = ", ".join(serving) if serving else "none"
    return [Problem(source, key, f"expected it for the serving pools' hosts, where it is read ({pools}), found it"
                                 f" set for {', '.join(idle_set)} only, which serve nothing", tuple(idle_set))
            for (source, key), idle_set in found.items()]


def _sources(hosts: dict[str, HostLayers], configs: dict[str, HostConfig],
             override: dict[str, Any] | None) -> dict[str, dict[str, str]]:
    """Each valid host's key -> the file that set it (``--data`` last)."""
    return {host: HostLayers(host, layers.layers + ([Layer("--data", override)] if override else [])).merged()[1]
            for host, layers in hosts.items() if host in configs}


def _set_elsewhere(hosts: Sequence[str], readers: Sequence[str], keys: Sequence[str],
                   sources: dict[str, dict[str, str]]) -> dict[tuple[str, str], list[str]]:
    """(file, key) -> the ``hosts`` it set ``key`` for, where that file set it for none of the ``readers``."""
    found: dict[tuple[str, str], list[str]] = {}
    for host in hosts:
        for key in keys:
            source = sources.get(host, {}).get(key)
            if source is None or is_role_default(source):
                continue
            if not any(sources[r].get(key) == source for r in readers if r in sources):
                found.setdefault((source, key), []).append(host)
    return found


def own_address(host: str, cfg: HostConfig) -> str | None:
    """A host's own IP address: ``fleet_address``, else its inventory name when that is one."""
    try:
        return str(ipaddress.ip_address(cfg.fleet_address or host))
    except ValueError:
        return None


def address_problems(configs: dict[str, HostConfig], routers: Sequence[str], serving: Sequence[str],
                     source: Callable[[str, str], str]) -> list[Problem]:
    """A router known by name only beside replicas (their units filter on addresses), or listening on another
    router's address."""
    found: list[Problem] = []
    valid = [r for r in routers if r in configs]
    owners = {address: r for r in valid if (address := own_address(r, configs[r])) is not None}
    for router in valid:
        cfg = configs[router]
        if serving and own_address(router, cfg) is None:
            found.append(Problem(source(router, "fleet_address"), "fleet_address",
                                 "expected the router's IP address (fleet_address, or an inventory name that is one:"
                                 " the replicas let the routers in by address), found the host name"
                                 f" {show(cfg.fleet_address or router)}", (router,)))
        owner = owners.get(cfg.router_listen_address or "")
        if owner is not None and owner != router:
            found.append(Problem(source(router, "router_listen_address"), "router_listen_address",
                                 f"expected the router's own address or 0.0.0.0, found {cfg.router_listen_address},"
                                 f" the address of router {owner}", (router,)))
    return found


ONE_VALUE_WHY = {"router_peer_port": "each router connects to the others' peer port"}
"""Why a router-wide variable holds one value, where that is not that clients reach any router."""


def _differences(routers: Sequence[str], configs: dict[str, HostConfig],
                 source: Callable[[str, str], str]) -> list[Problem]:
    found = []
    for key in ROUTER_WIDE:
        values = {r: getattr(configs[r], key) for r in routers}
        other = next((r for r in routers if values[r] != values[routers[0]]), None)
        if other is None:
            continue
        first = routers[0]
        path, mine, theirs = _diverging(key, values[first], values[other])
        field, hidden = path.rsplit(".", 1)[-1], key in SECRET_HOLDING
        if hidden and (mine is None or theirs is None):
            shown = f"it on {other if mine is None else first} only"
        elif hidden and not (shown_in_tree(field, mine) and shown_in_tree(field, theirs)):
            shown = f"another value on {other} than on {first} (not shown: it holds secrets)"
        else:
            shown = f"{first}: {_shown(mine)}, {other}: {_shown(theirs)}"
        where = source(other, key)
        where = source(first, key) if is_role_default(where) else where  # the file that set a value
        why = ONE_VALUE_WHY.get(key, "clients reach any of them")
        found.append(Problem(where, path, f"expected one value on every router ({why}), found {shown}",
                             tuple(routers)))
    return found


def _diverging(path: str, mine: Any, theirs: Any) -> tuple[str, Any, Any]:
    """The deepest key path where two values of a router-wide setting differ (``router_clients.alice.priority``),
    with the two values there (a secret reference is one value)."""
    if isinstance(mine, BaseModel) and type(mine) is type(theirs) and not isinstance(mine, SecretRef):
        mine, theirs = dict(mine), dict(theirs)
    if isinstance(mine, dict) and isinstance(theirs, dict):
        for key in sorted(mine.keys() | theirs.keys(), key=str):
            if mine.get(key) != theirs.get(key):
                return _diverging(f"{path}.{shown_key(str(key))}", mine.get(key), theirs.get(key))
    return path, mine, theirs


def _shown(value: object) -> str:
    return "none" if value is None else show(value)


def _outside(configs: dict[str, HostConfig], routers: Sequence[str],
             sources: dict[str, dict[str, str]]) -> list[Problem]:
    """EDGE_ONLY keys set for hosts that route nothing, by a file that sets them for no router."""
    found = _set_elsewhere([h for h in configs if h not in routers], routers, EDGE_ONLY, sources)
    listed = ", ".join(routers) if routers else "none"
    return [Problem(source, key, f"expected it on the routers (group routers: {listed}), found it set for"
                                 f" {', '.join(others)}, which route nothing", tuple(others))
            for (source, key), others in found.items()]


def wide_networks(networks: Sequence[str]) -> list[str]:
    """The networks of ``networks`` wider than :data:`WIDEST_PREFIX`."""
    wide = []
    for text in networks:
        network = ipaddress.ip_network(text, strict=False)
        if network.prefixlen < WIDEST_PREFIX[network.version]:
            wide.append(text)
    return wide
