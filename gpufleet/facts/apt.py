"""Debian packages on a node: the version apt would install."""

from __future__ import annotations

import shlex

from pyinfra.api.facts import FactBase


class AptCandidate(FactBase[str | None]):
    """
    Returns the version apt would install for a package, or None when apt knows no version of it
    (its repository's lists were never fetched).

    + package: the package name

    .. code:: python

        "580.95.05-1"
    """

    def command(self, package: str) -> str:
        return f"apt-cache policy {shlex.quote(package)} 2>/dev/null | sed -n 's/^ *Candidate: //p'"

    def process(self, output: list[str]) -> str | None:
        version = output[0].strip() if output else ""
        return None if version in ("", "(none)") else version
