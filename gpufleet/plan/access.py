"""Who may connect to gpufleet's services on a node: the ``IPAddressAllow=`` list of each unit.

Every unit gpufleet writes that listens on the network gets ``IPAddressDeny=any`` and an allow list (systemd's
per-unit IP filter, cgroup BPF: it drops packets in both directions, to and from any port of the unit's
processes, except to and from the listed addresses and localhost):

- exporters (node_exporter, dcgm-exporter): the node itself and the monitoring hosts;
- a replica's Ray units: the replica's own nodes and the monitoring hosts (Ray's metrics port is in the
  same unit as its GCS, raylet and workers, so the monitoring hosts reach those too; the token guards them);
- ``vllm@.service`` (the API and the mp rendezvous share it): the nodes of every replica the node takes part
  in, the monitoring hosts, the routers and ``vllm_api_allowed_from``; a fleet with routers has this filter
  whatever ``vllm_api_allowed_from`` says (clients go through the routers), one without has none while that is
  null (API open);
- ``vllm-watchdog@.service`` (it listens nowhere: it reaches its replica's API on this node): the node's own
  address;
- Prometheus on a monitoring host, always: the host itself, every host it scrapes, the monitoring hosts and
  ``prometheus_allowed_from`` (its API has no login: nobody else reads the fleet's metrics);
- Alertmanager on a monitoring host, when it listens beyond loopback: the host itself, the monitoring hosts,
  ``prometheus_allowed_from`` and the webhook's address (whoever reaches it can silence alerts).

The monitoring hosts are ``monitoring_addresses`` plus the hosts of an inventory group named ``monitoring``
(their ``fleet_address``, else their inventory name, which must then be an IP address). Computed on the
controller; :func:`unit_lines` renders a list into the unit. The routers are the hosts of the inventory group
``routers`` (the same way). The router's own metrics endpoint takes the router itself and the monitoring hosts
(HAProxy's ``src`` filter, :func:`exporter_sources`).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

from gpufleet.config.inventory_shape import MONITORING_GROUP
from gpufleet.config.schema import HostConfig
from gpufleet.values.problems import ConfigError, Problem


def allow_list(*sources: Iterable[str]) -> list[str]:
    """Addresses and networks from ``sources``, each once, in a stable order. A host name (a node without
    ``fleet_address``) raises ConfigError: systemd filters on addresses only."""
    seen: dict[str, None] = {}
    for source in sources:
        for entry in source:
            try:
                seen[str(ipaddress.ip_network(entry, strict=False))] = None
            except ValueError:
                raise ConfigError([Problem("controller", "fleet_address", "expected IP addresses for systemd's"
                                           f" IPAddressAllow=, found {entry!r} (give the node a fleet_address)")]
                                  ) from None
    return sorted(seen, key=lambda n: (ipaddress.ip_network(n).version, ipaddress.ip_network(n)))


def monitoring_sources(cfg: HostConfig, group_hosts: Iterable[str] = ()) -> list[str]:
    """The hosts that scrape metrics: ``monitoring_addresses`` and the ``monitoring`` group's addresses."""
    return allow_list(cfg.monitoring_addresses, group_hosts)


def exporter_sources(cfg: HostConfig, node_address: str, group_hosts: Iterable[str] = ()) -> list[str]:
    """Who may reach node_exporter and dcgm-exporter on a node: the node and the monitoring hosts."""
    return allow_list([node_address], monitoring_sources(cfg, group_hosts))


def ray_sources(cfg: HostConfig, replica_addresses: Iterable[str], group_hosts: Iterable[str] = ()) -> list[str]:
    """Who may reach a replica's Ray units: the replica's nodes and the monitoring hosts (Ray's metrics)."""
    return allow_list(replica_addresses, monitoring_sources(cfg, group_hosts))


def vllm_sources(cfg: HostConfig, node_address: str, peer_addresses: Iterable[str],
                 group_hosts: Iterable[str] = (), routers: Iterable[str] = ()) -> list[str] | None:
    """Who may reach ``vllm@.service`` on a node (the API and the mp rendezvous); None: anyone (no routers, and
    ``vllm_api_allowed_from`` null). ``peer_addresses``: the nodes of every replica the node serves in;
    ``routers``: the routers' addresses, which send it the clients' requests."""
    routers = list(routers)
    if cfg.vllm_api_allowed_from is None and not routers:
        return None
    return allow_list([node_address], peer_addresses, monitoring_sources(cfg, group_hosts), routers,
                      cfg.vllm_api_allowed_from or [])


def prometheus_sources(cfg: HostConfig, node_address: str, scraped: Iterable[str],
                       group_hosts: Iterable[str] = ()) -> list[str]:
    """Whom Prometheus may talk to on a monitoring host: the host itself, every host it scrapes, the monitoring
    hosts and ``prometheus_allowed_from``."""
    return allow_list([node_address], scraped, monitoring_sources(cfg, group_hosts),
                      cfg.prometheus_allowed_from or [])


def alertmanager_sources(cfg: HostConfig, node_address: str, group_hosts: Iterable[str] = ()) -> list[str] | None:
    """Whom Alertmanager may talk to on a monitoring host when it listens beyond loopback: the host itself, the
    monitoring hosts, ``prometheus_allowed_from`` and the webhook it sends to (its address: validation refuses a
    webhook by host name there); None on loopback (only the host reaches it, and it may send anywhere)."""
    if ipaddress.ip_address(cfg.alertmanager_listen_address).is_loopback:
        return None
    webhook = urlsplit(cfg.alertmanager_webhook_url).hostname if cfg.alertmanager_webhook_url else None
    return allow_list([node_address], monitoring_sources(cfg, group_hosts), cfg.prometheus_allowed_from or [],
                      [webhook] if webhook else [])


def watchdog_sources(node_address: str) -> list[str] | None:
    """Whom a replica's watchdog may talk to: its node's API address. None (no filter) for a node known by a host
    name, which systemd cannot filter on."""
    try:
        return allow_list([node_address])
    except ConfigError:
        return None


def unit_lines(allowed: list[str] | None) -> str:
    """The ``[Service]`` lines of an allow list (empty text for None: no filter)."""
    if allowed is None:
        return ""
    return ("# Reachable only from these addresses and localhost (systemd's IP filter, both directions).\n"
            "IPAddressDeny=any\n"
            f"IPAddressAllow={' '.join(['localhost', *allowed])}\n")


def group_addresses(inventory: Any, group: str = MONITORING_GROUP) -> list[str]:
    """The addresses of an inventory group's hosts (``fleet_address``, else the host's name); [] without one."""
    try:
        hosts = inventory.get_group(group)
    except Exception:  # noqa: BLE001 - pyinfra raises NoGroupError for a group the inventory does not define
        return []
    found = []
    for member in hosts:
        address = member.data.get("fleet_address") or member.name
        try:
            ipaddress.ip_address(address)
        except ValueError:
            raise ConfigError([Problem(member.name, "fleet_address", f"expected an IP address for a host of group"
                                                                     f" {group}, found {address!r}")]) from None
        found.append(address)
    return found


def deploy_group(group: str = MONITORING_GROUP) -> list[str]:
    """The addresses of a group of the running deploy's inventory (:func:`group_addresses`; exits 2 on a host
    without an IP address): the monitoring hosts, or :data:`ROUTERS_GROUP`'s."""
    from pyinfra.context import state

    from gpufleet.values.problems import exit_with

    try:
        return group_addresses(state.inventory, group)
    except ConfigError as error:
        exit_with(error)
