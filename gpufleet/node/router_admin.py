#!/usr/bin/env python3
"""Drive HAProxy on a router node through its runtime API: drain, wait, weigh and bring back a model's replicas.

Runs on the router node as root (standard library only), over SSH from ``gpufleet upgrade``::

    router_admin.py show [--socket PATH]
    router_admin.py set-state BACKEND SERVER ready|drain|maint [--socket PATH]
    router_admin.py wait-drained BACKEND SERVER --timeout S [--socket PATH]
    router_admin.py set-weight BACKEND SERVER WEIGHT [--socket PATH]
    router_admin.py client-metrics --textfile PATH [--socket PATH] [--edge-dir PATH] [--ledger PORT]

A backend is a served model, a server one of its replicas (named as the plan names it). ``show`` lists every
server of every backend: its ``status`` as HAProxy's statistics say it (UP, DOWN, DRAIN, MAINT, ...), its
``admin`` state (``ready``, ``drain`` or ``maint``), the requests in flight (``scur``) and queued (``qcur``), its
``weight`` and ``initial_weight``, its last ``check_status``, and for a canary watch its counters since the
router's worker started: requests (``req_tot``; sessions, ``stot``, where HAProxy counts no requests), 5xx
responses (``hrsp_5xx``), and its average response time in ms over its last 1024 requests (``rtime``).
``set-state`` and ``set-weight`` read the server back until it says what was set; ``set-state drain`` also sets
the weight to 0 and ``ready`` sets the configured weight back. ``wait-drained`` polls until
the server has nothing in flight and nothing queued; its ``--timeout`` is in seconds (0: look once).

``client-metrics`` writes the counters of every client of the edge (``router_clients``: the stick table
``gpufleet-clients``, the limits from the edge's maps) as a node_exporter textfile (0644, replaced whole):
requests, 4xx answers, 429s, admitted requests, requests in flight, and each client's limits; with ``--ledger``,
the token ledger's counters too (its ``GET /metrics`` on that loopback port: tokens per client and model, what its
budgets have left), or none while it does not answer.

Every argument is checked before anything reaches the socket: names in HAProxy's identifier characters
(``A-Z a-z 0-9 _ . : -``), a state from the three above, a weight 0-256, a timeout 0-86400. Each command prints
one JSON document on stdout and exits 0, or prints one line on stderr and exits 1 (bad argument, socket missing,
unknown backend or server, HAProxy refusing, timeout).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import socket
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import NoReturn

DEFAULT_SOCKET = "/run/haproxy/gpufleet-runtime.sock"  # node_paths.ROUTER_ADMIN_SOCKET: the router role binds it
DEFAULT_EDGE_DIR = "/etc/haproxy/gpufleet-edge"  # roles/router EDGE_DIR: the edge's maps
CLIENT_TABLE = "gpufleet-clients"  # roles/router CLIENT_TABLE
IO_TIMEOUT_S = 5.0  # one runtime API command, connect to last byte
SETTLE_S = 2.0  # how long a change may take to read back
POLL_S = 0.2  # wait-drained's pace
MAX_WAIT_S = 86400.0
MAX_WEIGHT = 256  # HAProxy's absolute weight range is 0-256
STATES = ("ready", "drain", "maint")

_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,255}")  # HAProxy's identifier characters (proxies, servers)
_WORD = re.compile(r"[A-Za-z0-9_.:/-]+")  # what a runtime command is made of: names, ``be/srv``, numbers
_WEIGHT = re.compile(r"[0-9]{1,3}")

# srv_admin_state of ``show servers state`` is a mask (HAProxy's management guide): forced, inherited,
# configured and DNS-resolution maintenance; forced and inherited drain.
_MAINT_BITS = 0x01 | 0x02 | 0x04 | 0x20
_DRAIN_BITS = 0x08 | 0x10


class RouterError(Exception):
    """Why the command failed, as the one line it prints."""


@dataclass(frozen=True)
class Server:
    """One server of one backend, as ``show`` prints it."""

    backend: str
    server: str
    status: str  # show stat's status: UP, DOWN, DRAIN, MAINT, NOLB, "no check", "UP 1/2", ...
    admin: str  # ready, drain, maint; unknown when ``show servers state`` did not list it
    scur: int  # requests in flight
    qcur: int  # requests queued for it
    weight: int  # the weight set (srv_uweight)
    initial_weight: int  # the configured weight (srv_iweight)
    check_status: str  # L7OK, L4CON, ...; empty without a check or in maintenance
    req_tot: int  # requests it was sent since the router's worker started (stot, sessions, where HAProxy has none)
    hrsp_5xx: int  # of which answered 5xx
    rtime: int  # average response time (ms) over its last 1024 requests


def check_name(what: str, value: str) -> str:
    """``value`` when it is a HAProxy identifier; the line that refuses it otherwise."""
    if not _NAME.fullmatch(value):
        raise RouterError(f"{what}: expected 1-255 characters of A-Z a-z 0-9 _ . : -, found {value!r}")
    return value


def check_state(value: str) -> str:
    if value not in STATES:
        raise RouterError(f"state: expected one of {', '.join(STATES)}, found {value!r}")
    return value


def check_weight(value: str) -> int:
    if not _WEIGHT.fullmatch(value) or int(value) > MAX_WEIGHT:
        raise RouterError(f"weight: expected a whole number 0-{MAX_WEIGHT}, found {value!r}")
    return int(value)


def check_timeout(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or not 0 <= seconds <= MAX_WAIT_S:
        raise RouterError(f"--timeout: expected seconds 0-{MAX_WAIT_S:g}, found {value!r}")
    return seconds


def command(*words: str) -> str:
    """One runtime API command from checked words: nothing that HAProxy's CLI splits on (``;``, spaces, a
    newline) or unescapes (``\\``) can be in one."""
    for word in words:
        if not _WORD.fullmatch(word):
            raise RouterError(f"refusing to send {word!r} to HAProxy")
    return " ".join(words)


def admin_state(mask: int) -> str:
    """``srv_admin_state`` as one of :data:`STATES` (maintenance wins over drain)."""
    if mask & _MAINT_BITS:
        return "maint"
    return "drain" if mask & _DRAIN_BITS else "ready"


def parse_stat(text: str) -> dict[tuple[str, str], dict[str, str]]:
    """``show stat`` CSV: each server's row by (backend, server)."""
    if not text.startswith("# pxname,"):
        raise RouterError(f"show stat: unexpected answer: {_first_line(text)}")
    rows = csv.DictReader(text[2:].splitlines())
    return {(row["pxname"], row["svname"]): row for row in rows
            if row.get("type") == "2" and row.get("pxname") and row.get("svname")}


def parse_servers_state(text: str) -> dict[tuple[str, str], dict[str, str]]:
    """``show servers state`` (format 1): each server's fields by (backend, server)."""
    lines = text.splitlines()
    if len(lines) < 2 or lines[0].strip() != "1" or not lines[1].startswith("# "):
        raise RouterError(f"show servers state: unexpected answer: {_first_line(text)}")
    names = lines[1][2:].split()
    found: dict[tuple[str, str], dict[str, str]] = {}
    for line in lines[2:]:
        fields = line.split()
        if len(fields) >= len(names):
            row = dict(zip(names, fields))
            found[(row["be_name"], row["srv_name"])] = row
    return found


def merge(stat: dict[tuple[str, str], dict[str, str]], state: dict[tuple[str, str], dict[str, str]]) -> list[Server]:
    """Every server of ``show stat``, its admin state and weights from ``show servers state``."""
    servers = []
    for (backend, name), row in stat.items():
        more = state.get((backend, name))
        servers.append(Server(
            backend=backend, server=name, status=row.get("status", ""),
            admin=admin_state(_int(more["srv_admin_state"])) if more else "unknown",
            scur=_int(row.get("scur", "")), qcur=_int(row.get("qcur", "")),
            weight=_int(more["srv_uweight"] if more else row.get("uweight", "")),
            initial_weight=_int(more["srv_iweight"]) if more else _int(row.get("weight", "")),
            check_status=row.get("check_status", ""),
            req_tot=_int(row.get("req_tot") or row.get("stot", "")), hrsp_5xx=_int(row.get("hrsp_5xx", "")),
            rtime=_int(row.get("rtime", ""))))
    return servers


def _int(text: str | None) -> int:
    """A counter as HAProxy prints it; empty (not applicable) is 0."""
    return int(text) if text and text.isdigit() else 0


def _first_line(text: str) -> str:
    lines = text.strip().splitlines()
    return repr(lines[0][:200]) if lines else "nothing"


class Runtime:
    """HAProxy's runtime API on a UNIX socket: one command per connection."""

    def __init__(self, path: str, timeout: float = IO_TIMEOUT_S) -> None:
        self.path, self.timeout = path, timeout

    def ask(self, *words: str) -> str:
        """HAProxy's answer to the command ``words``, or RouterError when none comes within the timeout."""
        line = command(*words)
        deadline = time.monotonic() + self.timeout
        chunks = []
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(self.timeout)
                conn.connect(self.path)
                conn.sendall(line.encode("ascii") + b"\n")
                while True:
                    conn.settimeout(max(deadline - time.monotonic(), 0.001))
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    chunks.append(chunk)
        except FileNotFoundError:
            raise RouterError(f"{self.path}: no such socket (is the router's HAProxy running?)") from None
        except ConnectionRefusedError:
            raise RouterError(f"{self.path}: nothing listens there (is the router's HAProxy running?)") from None
        except socket.timeout:
            raise RouterError(f"{self.path}: no answer to {line!r} within {self.timeout:g} s") from None
        except OSError as exc:
            raise RouterError(f"{self.path}: {exc.strerror or exc}") from None
        return b"".join(chunks).decode("utf-8", "replace")

    def servers(self) -> list[Server]:
        """Every server of every backend."""
        stat = parse_stat(self.ask("show", "stat", "-1", "4", "-1"))
        return merge(stat, parse_servers_state(self.ask("show", "servers", "state")))

    def server(self, backend: str, server: str) -> Server:
        """The server ``backend/server``; RouterError naming what is unknown."""
        servers = self.servers()
        for found in servers:
            if (found.backend, found.server) == (backend, server):
                return found
        if any(found.backend == backend for found in servers):
            raise RouterError(f"backend {backend} has no server {server}")
        raise RouterError(f"unknown backend {backend}")

    def change(self, *words: str) -> None:
        """A command that answers nothing when it succeeds."""
        answer = self.ask(*words)
        if answer.strip():
            raise RouterError(f"HAProxy refused {' '.join(words)}: {_first_line(answer)}")


def settle(read: Callable[[], Server], done: Callable[[Server], bool], what: str,
           clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> Server:
    """``read()`` until ``done`` says so, for at most SETTLE_S; RouterError saying ``what`` was not reached."""
    deadline = clock() + SETTLE_S
    while True:
        found = read()
        if done(found):
            return found
        if clock() >= deadline:
            raise RouterError(f"{found.backend}/{found.server}: {what} was sent but it reads back admin"
                              f" {found.admin}, weight {found.weight}")
        sleep(0.1)


def set_state(api: Runtime, backend: str, server: str, state: str) -> dict[str, object]:
    """``drain`` sets the weight to 0 first (a backend with router_policy prefix sends a key's requests to its
    replica only while its weight is above 0: HAProxy's drain alone keeps such requests coming); ``ready`` sets
    the state, then the configured weight back."""
    was = api.server(backend, server)
    weight = 0 if state == "drain" else was.initial_weight
    if state == "drain":
        api.change("set", "weight", f"{backend}/{server}", "0")
    api.change("set", "server", f"{backend}/{server}", "state", state)
    if state == "ready":
        api.change("set", "weight", f"{backend}/{server}", str(weight))
    now = settle(lambda: api.server(backend, server),
                 lambda found: found.admin == state and (state == "maint" or found.weight == weight),
                 f"state {state}")
    return {**asdict(now), "was": was.admin}


def set_weight(api: Runtime, backend: str, server: str, weight: int) -> dict[str, object]:
    was = api.server(backend, server)
    api.change("set", "weight", f"{backend}/{server}", str(weight))
    now = settle(lambda: api.server(backend, server), lambda found: found.weight == weight, f"weight {weight}")
    return {**asdict(now), "was": was.weight}


def wait_drained(api: Runtime, backend: str, server: str, timeout: float,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> dict[str, object]:
    """Poll until ``backend/server`` has no request in flight or queued; RouterError with what is left once
    ``timeout`` seconds have passed."""
    started = clock()
    while True:
        found = api.server(backend, server)
        waited = clock() - started
        if found.scur == 0 and found.qcur == 0:
            return {**asdict(found), "drained": True, "waited_s": round(waited, 2)}
        if waited >= timeout:
            raise RouterError(f"{backend}/{server}: not drained after {waited:.1f} s: in flight {found.scur},"
                              f" queued {found.qcur} (admin {found.admin})")
        sleep(min(POLL_S, max(timeout - waited, 0.0)))


# What each client's metric is read from: the stick table's columns, then the limits' maps.
CLIENT_COUNTERS = (
    ("requests_total", "http_req_cnt", "counter", "requests the client sent (with its key)"),
    ("errors_4xx_total", "http_err_cnt", "counter", "its requests answered 4xx, by the router or a replica"),
    ("limited_total", "gpc0", "counter", "its requests answered 429: over one of its limits"),
    ("admitted_total", "gpc1", "counter", "its requests passed on to a replica"),
    ("requests_in_flight", "conn_cur", "gauge", "its requests the router holds now"),
)
CLIENT_LIMITS = (("rate_limit", "rates.map", "requests per second it may send (router_clients)"),
                 ("concurrency_limit", "concurrency.map", "requests it may have in flight (router_clients)"))
_TABLE_ENTRY = re.compile(r"^0x[0-9a-f]+: key=(\S+) (.*)$")


def parse_table(text: str) -> dict[str, dict[str, int]]:
    """``show table``: each entry's counters by its key."""
    if not text.startswith("# table:"):
        raise RouterError(f"show table: unexpected answer: {_first_line(text)}")
    entries: dict[str, dict[str, int]] = {}
    for line in text.splitlines()[1:]:
        if match := _TABLE_ENTRY.match(line.strip()):
            fields = dict(item.split("=", 1) for item in match[2].split() if "=" in item)
            entries[match[1]] = {name: _int(value) for name, value in fields.items()}
    return entries


def parse_map(text: str) -> dict[str, str]:
    """``show map <file>``: each entry's value by its key."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(" ", 2)
        if len(parts) == 3 and parts[0].startswith("0x"):
            found[parts[1]] = parts[2]
    return found


def client_metrics(api: Runtime, edge_dir: str) -> str:
    """The clients' metrics in Prometheus's text format: every client of the edge's maps (0 until it sends)."""
    entries = parse_table(api.ask("show", "table", CLIENT_TABLE))
    limits = {metric: parse_map(api.ask("show", "map", f"{edge_dir}/{name}")) for metric, name, _ in CLIENT_LIMITS}
    clients = sorted({*entries, *parse_map(api.ask("show", "map", f"{edge_dir}/models.map"))})
    lines: list[str] = []
    for metric, column, kind, about in CLIENT_COUNTERS:
        lines += [f"# HELP gpufleet_router_client_{metric} {about}", f"# TYPE gpufleet_router_client_{metric} {kind}"]
        lines += [f'gpufleet_router_client_{metric}{{client="{name}"}} {entries.get(name, {}).get(column, 0)}'
                  for name in clients]
    for metric, _, about in CLIENT_LIMITS:
        lines += [f"# HELP gpufleet_router_client_{metric} {about}", f"# TYPE gpufleet_router_client_{metric} gauge"]
        lines += [f'gpufleet_router_client_{metric}{{client="{name}"}} {value}'
                  for name, value in sorted(limits[metric].items()) if value.isdigit()]
    return "\n".join(lines) + "\n"


def ledger_metrics(port: int) -> str:
    """The token ledger's metrics (gpufleet/node/token_ledger.py) on loopback; "" while it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=IO_TIMEOUT_S) as answer:
            return str(answer.read(16 << 20).decode())
    except (OSError, ValueError):
        return ""


def write_textfile(path: str, text: str) -> None:
    """Replace ``path`` with ``text`` in one rename (node_exporter never reads half a file), 0644."""
    staged = f"{path}.{os.getpid()}.tmp"
    with open(staged, "w", encoding="utf-8") as out:
        out.write(text)
    os.chmod(staged, 0o644)
    os.replace(staged, path)


class _Parser(argparse.ArgumentParser):
    """argparse whose refusals are one line and exit 1, like every other failure here."""

    def error(self, message: str) -> NoReturn:
        raise RouterError(f"{self.prog}: {message}")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="router_admin.py", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    shown = commands.add_parser("show", help="every server of every backend")
    state = commands.add_parser("set-state", help="set a server ready, drain or maint")
    wait = commands.add_parser("wait-drained", help="wait until a server has nothing in flight or queued")
    weight = commands.add_parser("set-weight", help="set a server's weight (0-256)")
    metrics = commands.add_parser("client-metrics", help="the edge's clients' counters as a node_exporter textfile")
    metrics.add_argument("--textfile", required=True, help="the .prom file to write")
    metrics.add_argument("--edge-dir", default=DEFAULT_EDGE_DIR, help=f"the edge's maps ({DEFAULT_EDGE_DIR})")
    metrics.add_argument("--ledger", type=int, help="the token ledger's loopback port (clients with token budgets)")
    for sub in (state, wait, weight):
        sub.add_argument("backend")
        sub.add_argument("server")
    state.add_argument("state", help="ready, drain or maint")
    wait.add_argument("--timeout", required=True, help="seconds (0-86400)")
    weight.add_argument("weight", help="0-256")
    for sub in (shown, state, wait, weight, metrics):
        sub.add_argument("--socket", default=DEFAULT_SOCKET, help=f"HAProxy's admin socket ({DEFAULT_SOCKET})")
    return parser


def run(argv: list[str] | None) -> dict[str, object]:
    """The command line's JSON document; RouterError when it fails."""
    args = _parser().parse_args(argv)
    api = Runtime(args.socket)
    if args.command == "show":
        return {"servers": [asdict(found) for found in api.servers()]}
    if args.command == "client-metrics":
        text = client_metrics(api, args.edge_dir) + (ledger_metrics(args.ledger) if args.ledger else "")
        write_textfile(args.textfile, text)
        return {"textfile": args.textfile, "clients": text.count("gpufleet_router_client_requests_total{")}
    backend, server = check_name("backend", args.backend), check_name("server", args.server)
    if args.command == "set-state":
        return set_state(api, backend, server, check_state(args.state))
    if args.command == "set-weight":
        return set_weight(api, backend, server, check_weight(args.weight))
    return wait_drained(api, backend, server, check_timeout(args.timeout))


def main(argv: list[str] | None = None) -> int:
    try:
        doc = run(argv)
    except RouterError as exc:
        print(f"router_admin: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
