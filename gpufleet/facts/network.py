"""A node's network: which interface holds an address."""

from __future__ import annotations

import shlex

from pyinfra.api.facts import FactBase

from gpufleet.values import grammar


class AddressInterface(FactBase[str | None]):
    """
    Returns the network interface that holds an IP address on the node, or None when none does (or its name is not
    one an interface may have).

    + address: the IP address

    .. code:: python

        "eth0"
    """

    def command(self, address: str) -> str:
        prefix = 128 if ":" in address else 32
        return f"ip -o addr show to {shlex.quote(f'{address}/{prefix}')} | awk '{{print $2; exit}}'"

    def process(self, output: list[str]) -> str | None:
        name = output[0].strip() if output else ""
        return name if name and grammar.ifname(name) is None else None
