"""Time the lab: nodes booted to SSH-ready with a warm rootfs cache, and taken down again.

    python bench/lab_boot.py                 # 1, 4 and 8 nodes
    python bench/lab_boot.py --nodes 4 --root-mode copy
    python bench/lab_boot.py --cold          # also time a cold rootfs build (downloads ~100 MB)

Prints JSON. Runs its own lab (own directory, bridge gflabb0, 10.213.250.0/24, no mirror) so a lab
that is already up is left alone. Needs root.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpufleet_lab import nodes, rootfs
from gpufleet_lab.errors import LabError
from gpufleet_lab.state import cache_dir

BRIDGE = "gflabb0"
SUBNET = "10.213.250.0/24"


def time_cold_build() -> float:
    """Seconds to debootstrap the base into an empty cache (then thrown away)."""
    scratch = Path(tempfile.mkdtemp(prefix="gpufleet-lab-cold-", dir=cache_dir().parent))
    try:
        started = time.monotonic()
        rootfs.ensure_base(scratch)
        return time.monotonic() - started
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def time_boot(count: int, root_mode: rootfs.RootMode) -> dict[str, Any]:
    """Seconds for ``up`` (to SSH-ready) and ``down`` of ``count`` nodes."""
    with tempfile.TemporaryDirectory(prefix="gpufleet-lab-bench-") as directory:
        base = Path(directory)
        started = time.monotonic()
        nodes.up(count, None, SUBNET, bridge=BRIDGE, base=base, root_mode=root_mode, start_mirror=False)
        up_s = time.monotonic() - started
        started = time.monotonic()
        nodes.down(base)
        down_s = time.monotonic() - started
    return {"nodes": count, "root_mode": root_mode, "up_s": round(up_s, 2), "down_s": round(down_s, 2),
            "up_s_per_node": round(up_s / count, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, action="append", help="node count (repeatable; default 1, 4, 8)")
    parser.add_argument("--root-mode", choices=["overlay", "copy"], default="overlay")
    parser.add_argument("--cold", action="store_true", help="also time a cold rootfs build")
    args = parser.parse_args()
    report: dict[str, Any] = {"cache": str(cache_dir()), "cpus": os.cpu_count()}
    try:
        if args.cold:
            report["cold_rootfs_build_s"] = round(time_cold_build(), 1)
        started = time.monotonic()
        rootfs.ensure_base(cache_dir())  # warm the cache (a no-op when it is)
        report["cache_warmup_s"] = round(time.monotonic() - started, 2)
        report["runs"] = [time_boot(n, args.root_mode) for n in (args.nodes or [1, 4, 8])]
    except LabError as exc:
        print(f"lab_boot: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
