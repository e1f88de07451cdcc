#!/usr/bin/env python3
"""Tell keepalived whether this router's HAProxy serves: the check behind the routers' virtual address.

Runs on a router node as its own unit (standard library only)::

    router_health.py --url http://ADDRESS:PORT/health --state FILE [--interval S] [--timeout S]
                     [--fall N] [--rise N]

Every ``--interval`` seconds it asks HAProxy ``GET /health`` (answered by HAProxy itself on the router's metrics
port) and keeps ``--state`` holding ``1`` while HAProxy passes and ``0`` while it does not; keepalived reads the file
as it changes (``vrrp_track_file``, weight 0 reversed: 0, an empty or a missing file put the router in FAULT, and
it gives the address up at once). A refused connection fails at once: nothing listens, HAProxy is gone. A slow
(over ``--timeout``) or wrong answer must repeat ``--fall`` times in a row, so that one slow answer under load
moves nothing; ``--rise`` passes in a row make the router healthy again. The file starts at 0 and is replaced
whole (a rename, which keepalived sees), and goes back to 0 when this tool stops.
"""

from __future__ import annotations

import argparse
import http.client
import os
import signal
import sys
import time
from dataclasses import dataclass
from types import FrameType
from urllib.parse import urlsplit

PASSED, REFUSED, FAILED = "passed", "refused", "failed"
INTERVAL_S = 1.0  # between two checks, unless --interval says otherwise


def check(url: str, timeout_s: float) -> str:
    """One ``GET`` of ``url``: PASSED (200), REFUSED (nothing listens) or FAILED (anything else)."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname or "", parts.port or 80, timeout=timeout_s)
    try:
        connection.request("GET", parts.path or "/", headers={"Connection": "close"})
        response = connection.getresponse()
        response.read()
        return PASSED if response.status == 200 else FAILED
    except ConnectionRefusedError:
        return REFUSED
    except (OSError, http.client.HTTPException):
        return FAILED
    finally:
        connection.close()


@dataclass
class Verdict:
    """Whether the router is healthy, from its checks in a row."""

    fall: int
    rise: int
    healthy: bool = False
    passed: int = 0
    failed: int = 0

    def add(self, result: str) -> bool:
        """Count one check's result; whether the verdict changed."""
        if result == PASSED:
            self.passed, self.failed = self.passed + 1, 0
        else:
            self.passed = 0
            self.failed = self.fall if result == REFUSED else self.failed + 1
        before = self.healthy
        if self.healthy and self.failed >= self.fall:
            self.healthy = False
        elif not self.healthy and self.passed >= self.rise:
            self.healthy = True
        return self.healthy != before


def write_state(path: str, healthy: bool) -> None:
    """Replace ``path`` with ``1`` or ``0`` in one rename (a reader never sees half a file)."""
    staged = f"{path}.new"
    with open(staged, "w") as handle:
        handle.write("1\n" if healthy else "0\n")
    os.chmod(staged, 0o644)
    os.replace(staged, path)


def _stop(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def _positive(text: str) -> float:
    value = float(text)
    if not 0 < value <= 60:
        raise argparse.ArgumentTypeError(f"expected seconds in (0, 60], found {text}")
    return value


def _count(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 100:
        raise argparse.ArgumentTypeError(f"expected 1 to 100, found {text}")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="HAProxy's health URL (http://ADDRESS:PORT/health)")
    parser.add_argument("--state", required=True, help="the file keepalived reads: 1 healthy, 0 not")
    parser.add_argument("--interval", type=_positive, default=INTERVAL_S, help="seconds between checks")
    parser.add_argument("--timeout", type=_positive, default=1.0, help="seconds one check may take")
    parser.add_argument("--fall", type=_count, default=2, help="slow or wrong answers in a row that fail it")
    parser.add_argument("--rise", type=_count, default=2, help="passed checks in a row that make it healthy")
    args = parser.parse_args(argv)
    if urlsplit(args.url).scheme != "http":
        parser.error(f"expected an http:// URL, found {args.url!r}")
    signal.signal(signal.SIGTERM, _stop)
    verdict = Verdict(args.fall, args.rise)
    write_state(args.state, False)
    try:
        while True:
            started = time.monotonic()
            if verdict.add(check(args.url, args.timeout)):  # said first, then written: the log never lags the file
                print(f"router_health: HAProxy {'passes' if verdict.healthy else 'fails'} {args.url}", flush=True)
                write_state(args.state, verdict.healthy)
            time.sleep(max(0.0, args.interval - (time.monotonic() - started)))
    finally:
        write_state(args.state, False)


if __name__ == "__main__":
    sys.exit(main())
