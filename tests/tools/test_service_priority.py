"""A daemon a test starts runs as its unit would: its own session's share and nice 0, whatever the tier runs at."""

from __future__ import annotations

import os
import subprocess
import sys

TIER = """
import os, subprocess, sys
os.setsid()
with open('/proc/self/autogroup', 'w') as own:
    own.write('5')  # the share scripts/run_tiers.py gives the tiers beside the lab
os.setpriority(os.PRIO_PROCESS, 0, 10)  # and its nice, whatever this test runs at (root may lower it)
sys.path.insert(0, sys.argv[1])
from tests.service_priority import as_a_service
report = "cat /proc/self/autogroup; nice"
daemon = subprocess.run(['sh', '-c', report], start_new_session=True, preexec_fn=as_a_service(), capture_output=True,
                        text=True, check=True).stdout.split()
plain = subprocess.run(['sh', '-c', report], capture_output=True, text=True, check=True).stdout.split()
print(daemon[-2], daemon[-1], plain[-2], plain[-1])
"""


def test_a_daemon_gets_its_own_share_at_nice_0_from_a_tier_at_low_priority() -> None:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    found = subprocess.run([sys.executable, "-c", TIER, root], capture_output=True, text=True, timeout=60, check=True)
    # /proc/self/autogroup reads "/autogroup-N nice K"; `nice` prints the process's nice value
    assert found.stdout.split() == ["0", "0", "5", "10"], found.stdout + found.stderr

