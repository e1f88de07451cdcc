"""Keep one lab node running across its own reboots: ``python -m gpufleet.lab.supervise -- systemd-nspawn ...``.

systemd-nspawn exits with status 133 when the node's systemd reboots (``systemctl reboot``, a role that
reboots after a driver change); with no systemd on the host to restart it, this small parent starts it
again. SIGTERM is passed on to nspawn (a clean shutdown of the node) and ends the loop; the exit status
is nspawn's.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from types import FrameType

REBOOT_STATUS = 133
MAX_REBOOTS_PER_MINUTE = 5


def supervise(argv: list[str]) -> int:
    """Run ``argv`` until it exits for a reason other than a reboot, or until SIGTERM."""
    child: subprocess.Popen[bytes] | None = None
    stopping = False

    def pass_on(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, pass_on)
    signal.signal(signal.SIGINT, pass_on)
    reboots: list[float] = []
    while True:
        child = subprocess.Popen(argv)
        status = child.wait()
        if stopping or status != REBOOT_STATUS:
            return status
        now = time.monotonic()
        reboots = [t for t in reboots if now - t < 60] + [now]
        if len(reboots) > MAX_REBOOTS_PER_MINUTE:
            print(f"supervise: {len(reboots)} reboots in a minute; leaving the node down", flush=True)
            return status
        print("supervise: the node rebooted; starting it again", flush=True)


def main() -> int:
    args = sys.argv[1:]
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        print("usage: python -m gpufleet.lab.supervise -- systemd-nspawn ...", file=sys.stderr)
        return 2
    return supervise(args)


if __name__ == "__main__":
    sys.exit(main())
