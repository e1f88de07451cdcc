"""The node's NVML probe (gpufleet/node/nvml_probe.py), run as a node runs it."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT

PROBE = ROOT / "gpufleet" / "node" / "nvml_probe.py"


def run_probe(env: dict[str, str], *args: str,
              python: tuple[str, ...] = (sys.executable,)) -> subprocess.CompletedProcess[str]:
    """The probe run with ``args`` by ``python`` (this interpreter unless told), in the environment ``env``."""
    return subprocess.run([*python, str(PROBE), *args], env=env, capture_output=True, text=True, timeout=60)
