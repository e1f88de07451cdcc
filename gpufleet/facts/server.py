"""The node itself: its kernel's boot id."""

from __future__ import annotations

from pyinfra.api.facts import FactBase


class BootId(FactBase[str]):
    """
    Returns the kernel's boot id: a new one after every boot (systemd-nspawn sets one per container boot too).

    .. code:: python

        "1b4e28ba-2fa1-11d2-883f-0016d3cca427"
    """

    def command(self) -> str:
        return "cat /proc/sys/kernel/random/boot_id"

    @staticmethod
    def default() -> str:  # pyinfra's value when the command prints nothing
        return ""

    def process(self, output: list[str]) -> str:
        return output[0].strip() if output else ""
