"""The bench records a monitoring host keeps (``gpufleet bench``): what its ceilings and ``deploys/check.py`` read."""

from __future__ import annotations

import shlex
from typing import Any

from pyinfra.api.facts import FactBase

from gpufleet.measure.records import RECORDS_DIR, parse_records


class BenchRecords(FactBase[list[dict[str, Any]]]):
    """
    Returns every bench record in ``/var/lib/gpufleet/bench`` (one line of JSON each), as its JSON; a line that is
    not a record is left out (none when the directory is missing).

    .. code:: python

        [{"schema": 2, "model": "llama-3.1-70b", "release": "0.32.0", "layout": "tp4-pp1", "ceiling_rps": 3.5, ...}]
    """

    @staticmethod
    def default() -> list[dict[str, Any]]:
        return []

    def command(self) -> str:
        pattern = shlex.quote(RECORDS_DIR) + "/*.json"
        return f"for f in {pattern}; do [ -f \"$f\" ] && cat \"$f\"; done; true"

    def process(self, output: list[str]) -> list[dict[str, Any]]:
        found, _ = parse_records("\n".join(output))
        return [record.to_json() for record in found]
