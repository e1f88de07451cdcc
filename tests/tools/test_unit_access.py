"""How exposed each unit gpufleet writes is: every unit template, rendered as the roles render it, rated by
``systemd-analyze security --offline`` on this machine (``bench/unit_security.py --offline``; systemd 252 on Debian 12,
as on the nodes). Who may connect to the units: tests/unit/plan/test_unit_access.py.
"""

from __future__ import annotations

from gpufleet.units.security import EXPOSURE_BOUND
from tests.conftest import host_tool
from tests.unit.unit_security_bench import bench


def test_every_unit_is_confined() -> None:
    host_tool("systemd-analyze", "systemd")
    rated = bench.measure_offline()
    print(rated)
    scores = {unit: r["exposure"] for unit, r in rated.items() if r["present"]}
    assert len(scores) >= 5 and all(score <= EXPOSURE_BOUND for score in scores.values()), scores
