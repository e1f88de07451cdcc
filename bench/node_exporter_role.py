"""The node_exporter role against a plain pyinfra deploy doing the same job, on one lab node, no change.

    python bench/node_exporter_role.py [--runs 5]

Boots a private 1-node lab (as bench/converge.py does), converges node_exporter with the role, then times
``pyinfra -y inventories/lab/inventory.py D`` for D = bench/deploys/node_exporter_role.py and
bench/deploys/node_exporter_plain.py, alternating, ``--runs`` times each, every run a no-change run (checked).
Prints JSON: each run's seconds, the medians and their ratio (role / plain). Needs root.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from converge import PYINFRA, ROOT, boot_lab, machine
from gpufleet_lab import nodes
from gpufleet_lab.state import LAB_DIR_ENV

DEPLOYS = {"role": "bench/deploys/node_exporter_role.py", "plain": "bench/deploys/node_exporter_plain.py"}


def run(directory: Path, deploy: str) -> tuple[float, str]:
    env = {**os.environ, LAB_DIR_ENV: str(directory)}
    started = time.monotonic()
    done = subprocess.run([str(PYINFRA), "-y", "inventories/lab/inventory.py", deploy], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    seconds = time.monotonic() - started
    if done.returncode != 0:
        raise RuntimeError(f"{deploy} failed: {done.stderr[-2000:]}")
    return seconds, done.stderr


def changed(log: str) -> bool:
    """Whether the results table shows an operation that changed something (its Success column not '-')."""
    rows = [line.split() for line in log.splitlines() if line.strip().startswith("Grand total")]
    return bool(rows) and rows[-1][-3] != "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="gpufleet-node-exporter-"))
    report: dict[str, Any] = {"benchmark": "node_exporter_role", "machine": machine(), "runs": {"role": [],
                                                                                              "plain": []}}
    try:
        boot_lab(1, directory)
        run(directory, DEPLOYS["role"])  # first converge
        for kind in ("plain", "role"):  # both now find nothing to do
            _, log = run(directory, DEPLOYS[kind])
            if changed(log):
                raise RuntimeError(f"the {kind} deploy changed something after the role converged: {log[-3000:]}")
        for _ in range(args.runs):
            for kind, deploy in DEPLOYS.items():
                seconds, log = run(directory, deploy)
                if changed(log):
                    raise RuntimeError(f"{kind}: a no-change run changed something")
                report["runs"][kind].append(round(seconds, 2))
        medians = {kind: statistics.median(values) for kind, values in report["runs"].items()}
        report["median_s"] = medians
        report["ratio_role_to_plain"] = round(medians["role"] / medians["plain"], 2)
    finally:
        nodes.down(directory)
        shutil.rmtree(directory, ignore_errors=True)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
