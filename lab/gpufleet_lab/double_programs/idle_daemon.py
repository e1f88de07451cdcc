#!/usr/bin/python3
"""A gpufleet LAB DOUBLE daemon (nv-fabricmanager, nvidia-persistenced): starts, says so, and waits for SIGTERM.

It accepts and ignores any arguments, so the units keep the real programs' command lines. Fabric state and
persistence mode on a lab node come from the simulated NVML, not from this process.
"""

from __future__ import annotations

import os
import signal
import sys


def main() -> int:
    name = os.path.basename(sys.argv[0])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"{name} (gpufleet lab double): running; arguments {sys.argv[1:]} ignored", file=sys.stderr, flush=True)
    while True:
        signal.pause()


if __name__ == "__main__":
    sys.exit(main())
