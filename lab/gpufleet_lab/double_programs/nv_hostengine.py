#!/usr/bin/python3
"""nv-hostengine, gpufleet LAB DOUBLE: holds DCGM's host engine port open and does nothing else.

Accepts NVIDIA's ``-n/--no-daemon`` (the double always stays in the foreground), ``-b/--bind-interface ADDR``
(default 127.0.0.1), ``-p/--port PORT`` (default 5555); ``--service-account``, ``-f/--log-filename`` and
``--log-level`` are accepted and ignored. Clients (``dcgm-exporter -r``) can connect; nothing answers them.
"""

from __future__ import annotations

import argparse
import signal
import socketserver
import sys


class _Idle(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while self.request.recv(4096):
            pass


class _Server(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nv-hostengine", description="gpufleet lab double of DCGM's host engine")
    parser.add_argument("-n", "--no-daemon", action="store_true")
    parser.add_argument("-b", "--bind-interface", default="127.0.0.1")
    parser.add_argument("-p", "--port", type=int, default=5555)
    parser.add_argument("--service-account", default="")
    parser.add_argument("-f", "--log-filename", default="")
    parser.add_argument("--log-level", default="")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with _Server((args.bind_interface, args.port), _Idle) as server:
        print(f"nv-hostengine (lab double): listening on {args.bind_interface}:{args.port}", file=sys.stderr)
        server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
