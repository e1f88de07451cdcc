#!/usr/bin/env python3
"""Write every alert Alertmanager sends to the journal, one line each (gpufleet node tool).

Runs on a monitoring host as ``gpufleet-alert-log.service`` (role monitoring), Alertmanager's receiver that is
always there, beside ``alertmanager_webhook_url``'s webhook when one is set::

    alert_log.py --port 9097

It takes Alertmanager's webhook notifications (``POST``, JSON, version 4) on 127.0.0.1 and prints one line per alert
on stdout, which the journal keeps (``journalctl -u gpufleet-alert-log``)::

    FIRING GpuXidCritical gpu=0 node=gpu-a07 severity=critical since 2026-11-23T08:40:15Z: "GPU 0 of gpu-a07 ..."

The status, the alert's name, its other labels sorted by name, since when (and until when, once resolved) and its
summary. A label value outside ``A-Z a-z 0-9 _ . : / @ + , -`` and the summary are written as JSON strings, so a
value can neither break the line nor forge another. A body that is not such a notification is answered 400 and
logged in one line; one over MAX_BODY, 413. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

LISTEN = "127.0.0.1"  # Alertmanager runs on the same host
MAX_BODY = 4 * 1024 * 1024  # Alertmanager sends a group's alerts at once: thousands of alerts fit
PLAIN = re.compile(r"[A-Za-z0-9_.:/@+,-]+")
STATUSES = {"firing": "FIRING", "resolved": "RESOLVED"}
NEVER = "0001-01-01T00:00:00Z"  # Alertmanager's endsAt of an alert still firing


class NotANotification(ValueError):
    """The body is not an Alertmanager webhook notification."""


def shown(value: object) -> str:
    """``value`` as it goes into a line: plain when it is, else a JSON string."""
    text = str(value)
    return text if PLAIN.fullmatch(text) else json.dumps(text)


def alert_line(alert: Mapping[str, Any]) -> str:
    """One alert of a notification as its journal line."""
    labels = alert.get("labels")
    annotations = alert.get("annotations", {})
    if not isinstance(labels, dict) or not isinstance(annotations, dict):
        raise NotANotification("an alert without a labels object")
    status = STATUSES.get(str(alert.get("status")), "UNKNOWN")
    name = shown(labels.get("alertname", "unnamed"))
    pairs = [f"{shown(key)}={shown(value)}" for key, value in sorted(labels.items()) if key != "alertname"]
    when = f"since {shown(alert.get('startsAt', '?'))}"
    ends = alert.get("endsAt")
    if status == "RESOLVED" and ends and ends != NEVER:
        when += f" until {shown(ends)}"
    summary = annotations.get("summary") or annotations.get("description") or ""
    return " ".join([status, name, *pairs, when]) + f": {json.dumps(str(summary))}"


def notification_lines(body: bytes) -> list[str]:
    """Every alert of a notification's body as its line. Raises NotANotification."""
    try:
        payload = json.loads(body)
    except (UnicodeDecodeError, ValueError) as error:
        raise NotANotification(f"not JSON ({error})") from None
    alerts = payload.get("alerts") if isinstance(payload, dict) else None
    if not isinstance(alerts, list) or not all(isinstance(a, dict) for a in alerts):
        raise NotANotification("no list of alerts")
    return [alert_line(alert) for alert in alerts]


def handler(log: Callable[[str], None]) -> type[BaseHTTPRequestHandler]:
    """The request handler that writes each notification's lines with ``log``."""

    class Notifications(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:  # no access log: the alerts are the log
            pass

        def answer(self, status: int) -> None:
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_POST(self) -> None:  # http.server's name for a POST's handler
            try:
                length = int(self.headers.get("Content-Length", ""))
            except ValueError:
                length = -1
            if not 0 <= length <= MAX_BODY:
                log(f"refused a notification: expected a Content-Length of 0 to {MAX_BODY}, found "
                    f"{shown(self.headers.get('Content-Length', 'none'))}")
                self.close_connection = True
                self.answer(413 if length > MAX_BODY else 411)
                return
            try:
                lines = notification_lines(self.rfile.read(length))
            except NotANotification as error:
                log(f"refused a notification: {error}")
                self.answer(400)
                return
            for line in lines:
                log(line)
            self.answer(200)

    return Notifications


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)

    def log(line: str) -> None:
        print(line, flush=True)

    server = ThreadingHTTPServer((LISTEN, args.port), handler(log))
    log(f"alert log: taking Alertmanager's notifications on {LISTEN} port {args.port}")
    server.serve_forever()  # until systemd stops it
    return 0


if __name__ == "__main__":
    sys.exit(main())
