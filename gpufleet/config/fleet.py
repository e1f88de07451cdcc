"""The fleet as an inventory describes it: hosts, their validated configs, and serving pools.

Read from an inventory file by :func:`gpufleet.inventory.load.load_fleet` (and, in a deploy,
:func:`gpufleet.inventory.load.fleet_from_state`)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from gpufleet.config.schema import HostConfig


@dataclass(frozen=True)
class Fleet:
    """Validated configuration of every host, grouped into serving pools."""

    inventory: str
    hosts: list[str]
    configs: dict[str, HostConfig]
    pools: dict[str, list[str]]  # serving pools: a host that only role groups list is in none

    def serves(self, host: str) -> bool:
        """Whether the host is in a serving pool (a dedicated router or monitoring host is not)."""
        return any(host in members for members in self.pools.values())

    def only(self, hosts: Collection[str]) -> Fleet:
        """The fleet of ``hosts`` alone (those that pass their gate and are in the fleet's service): the others
        leave every pool, and a pool left empty goes."""
        return Fleet(self.inventory, [h for h in self.hosts if h in hosts],
                     {h: c for h, c in self.configs.items() if h in hosts},
                     {pool: kept for pool, members in self.pools.items()
                      if (kept := [h for h in members if h in hosts])})
