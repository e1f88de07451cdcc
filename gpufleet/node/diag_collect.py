#!/usr/bin/env python3
"""Gather what one node kept of a window, for ``gpufleet diag`` (gpufleet node tool; standard library only).

    diag_collect.py collect --since-s SECONDS --max-bytes N --budget-s SECONDS [--collect-env]
    diag_collect.py remove DIR
    diag_collect.py capture --reason WORDS [--keep N]
    diag_collect.py captures [--keep N]

``collect`` reads, within ``--budget-s`` seconds and ``--max-bytes`` bytes of members (what does not fit is cut,
its index entry says so), and writes into one tar.gz, readable by root alone (or by the user that ran it through
sudo, so that it can be fetched without a world-readable copy):

- ``units.json``: each of gpufleet's units (:data:`UNIT_PATTERNS`, and the units of each replica directory) as
  ``systemctl show`` gives its state, result, restart count and ``ExecStart``;
- ``journal/<unit>.log``: its journal over the window (``journalctl -o short-iso``), the newest lines kept;
- ``kernel.log``: the kernel log's ``NVRM`` and ``Xid`` lines over the window (or the newest of the file the node
  watch reads in its place);
- ``boots.log``: each boot that began in the window, and whether the boot before it ended with a shutdown;
- ``replicas/<replica>/``: the files of :data:`REPLICA_FILES` (none holds a secret: the secrets are in
  ``/etc/gpufleet/secrets``, which is never read), and with ``--collect-env`` ``vllm collect-env`` from the
  replica's release venv;
- ``nvml_probe.json`` (the NVML probe beside this file), ``node/`` (the lifecycle record, its summary and the
  evidence folders of the window), ``burn-in/`` (each tier's last verdict), ``gpu-watch/`` (the GPU watch's marker
  and samples), ``router/`` (HAProxy's servers as ``router_admin.py show`` reads them, the router health's state);
- ``index.json``: every member with its size and source, and what could not be read and why.

Every member's text goes through :func:`redact_names` (a second line of defence: the values of secrets named in it,
a bearer token, a URL's credentials, a private key block). ``remove`` deletes what ``collect`` wrote once it has
been fetched. ``collect`` prints one line of JSON: the archive's path and size.

``capture`` is ``collect`` of the last hour (:data:`CAPTURE_SINCE_S`, :data:`CAPTURE_MAX_BYTES`), kept on the node
itself when something failed with no controller there: ``gpufleet-capture@REASON.service`` runs it when a replica's
unit ends a restart loop (systemd gave up restarting it: the unit's ``OnFailure=``) or the node watch quarantines
the node. The archive goes into :data:`CAPTURES_DIR` (0700) as ``<UTC time>-<reason>.tar.gz`` (0600), and the
captures past the newest ``--keep`` are removed; ``captures`` lists them, newest first, as JSON (``gpufleet diag
--list`` reads every host's).
"""

from __future__ import annotations

import argparse
import fnmatch
import io
import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import tarfile
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

HERE = Path(__file__).resolve().parent
SCHEMA = "gpufleet.diag-node/1"
# every unit gpufleet installs or configures, by node_paths' names (tests/unit/node/test_diag_collect.py holds them
# to it): the replicas and their ranks, their watchdogs, Ray, the GPU watch, node watch, burn-in, router health and
# alert log (gpufleet-*), the exporters, DCGM, the NVIDIA services, HAProxy, keepalived, Prometheus and Alertmanager
UNIT_PATTERNS = ("vllm@*.service", "vllm-watchdog@*.service", "gpufleet-*.service", "ray*.service",
                 "node_exporter.service", "prometheus-node-exporter.service", "dcgm-exporter.service",
                 "nvidia-dcgm.service", "nvidia-fabricmanager.service", "nvidia-persistenced.service",
                 "haproxy.service", "keepalived.service", "prometheus.service", "prometheus-alertmanager.service")
UNIT_PROPERTIES = ("Id", "LoadState", "ActiveState", "SubState", "Result", "NRestarts", "ExecMainStatus",
                   "ExecMainStartTimestamp", "StateChangeTimestamp", "FragmentPath", "ExecStart")
VLLM_ETC = "/etc/gpufleet/vllm"  # node_paths.VLLM_ETC
SECRETS_DIR = "/etc/gpufleet/secrets"  # node_paths.SECRETS_DIR: never read
REPLICA_FILES = ("config.yaml", "vllm.env", "ranks.json", "release.json", "release.previous.json", "watchdog.json",
                 "observed.json")
NODE_STATE_DIR = "/var/lib/gpufleet/node"  # node_paths.NODE_STATE_DIR
NODE_FILES = ("state.json", "summary.json")
EVIDENCE_DIR = NODE_STATE_DIR + "/evidence"  # node_paths.EVIDENCE_DIR
BURN_IN_DIR = "/var/lib/gpufleet/burn-in"  # node_paths.BURN_IN_DIR
LIFECYCLE_CONFIG = "/etc/gpufleet/lifecycle.json"  # node_paths.LIFECYCLE_CONFIG: where the node watch reads its log
KMSG = "/dev/kmsg"
GPU_WATCH_FILES = ("/run/gpufleet/gpu-gate-failed", "/run/gpufleet/gpu-samples.json")  # node_paths.GPU_WATCH_MARKER...
ROUTER_SOCKET = "/run/haproxy/gpufleet-runtime.sock"  # node_paths.ROUTER_ADMIN_SOCKET
ROUTER_HEALTH_STATE = "/run/gpufleet-router-health/healthy"  # node_paths.ROUTER_HEALTH_STATE
UNIT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # node_paths.UNIT_DEFAULT_PATH
CAPTURES_DIR = "/var/lib/gpufleet/diag"  # node_paths.DIAG_CAPTURES_DIR: root's alone
CAPTURE_NAME = re.compile(r"\d{8}T\d{6}Z-[a-z0-9-]{1,64}\.tar\.gz")  # what capture_name makes
CAPTURE_SINCE_S = 3600  # gpufleet.diag.captures.SINCE_S
CAPTURE_MAX_BYTES = 16 << 20  # gpufleet.diag.captures.MAX_BYTES
CAPTURE_BUDGET_S = 60.0
CAPTURE_KEEP = 20  # gpufleet.diag.captures.KEEP
_SLUG = re.compile(r"[^a-z0-9]+")
OUT_PREFIX = "gpufleet-diag-"
OUT_NAME = "node.tar.gz"
OUT_DIR = re.compile(r"/var/tmp/" + OUT_PREFIX + r"[A-Za-z0-9_]{1,64}")
FILE_MAX_BYTES = 4 << 20  # one file read whole (a record, a config, a verdict)
COMMAND_S = 20.0  # one command, at most (less when the budget has less left)
COLLECT_ENV_S = 30.0
JOURNAL_LINES = 200000  # the newest lines of a unit's journal read at most (journalctl reads them from the end)
MAX_SINCE_S = 30 * 86400
MAX_BYTES = 1 << 30
_REPLICA = re.compile(r"[A-Za-z0-9_.@-]{1,200}")
_UNIT = re.compile(r"[A-Za-z0-9_.@:\\-]{1,255}")
_ID = re.compile(r"[0-9a-f]{32}")  # a boot id
# what the journal of a boot ends with when systemd shut it down (power off, reboot, halt, kexec)
SHUTDOWN_MARKS = ("Reached target shutdown.target", "System is powering down", "System is rebooting",
                  "Reached target System Power Off", "Reached target System Reboot", "Reached target System Halt")

REDACTED = "[redacted]"
SECRET_ENV_NAMES = ("VLLM_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "RAY_AUTH_TOKEN", "GPUFLEET_RANK_SECRET",
                    "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "UV_INDEX_URL", "UV_EXTRA_INDEX_URL")
_NAMED = re.compile(r"\b(" + "|".join(SECRET_ENV_NAMES) + r")(\"?\s*[=:]\s*)(\"[^\"]*\"|'[^']*'|[^\s\"',;]+)")
_FLAG = re.compile(r"(--api-key|--hf-token|--auth-token|--auth_pass|auth_pass)([= ]+)(\"[^\"]*\"|'[^']*'|\S+)")
_BEARER = re.compile(r"(?i)\b(bearer\s+)[^\s\"',;]+")
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@:\"']+:[^/\s@\"']+@")
_PRIVATE_KEY = re.compile(r"-----BEGIN ([A-Z ]*)PRIVATE KEY-----.*?(?:-----END [A-Z ]*PRIVATE KEY-----|\Z)", re.S)


def redact_names(text: str) -> tuple[str, int]:
    """``text`` with what is secret by its place replaced by :data:`REDACTED`: the value after a secret's
    environment name or a secret flag, a bearer token, a URL's user and password, a private key block; and how many
    were replaced."""
    count = 0
    for pattern, keep in ((_PRIVATE_KEY, ""), (_NAMED, r"\1\2"), (_FLAG, r"\1\2"), (_BEARER, r"\1"),
                          (_USERINFO, r"\1")):
        text, found = pattern.subn(keep + REDACTED + ("@" if pattern is _USERINFO else ""), text)
        count += found
    return text, count


class Collection:
    """The members gathered so far, within the byte and time bounds, and what could not be read."""

    def __init__(self, root: str, since: float, max_bytes: int, budget_s: float) -> None:
        self.root = root.rstrip("/")
        self.since = since
        self.max_bytes = max_bytes
        self.started = time.monotonic()
        self.deadline = self.started + budget_s
        self.budget_s = budget_s
        self.members: dict[str, bytes] = {}
        self.entries: list[dict[str, Any]] = []
        self.unread: list[dict[str, str]] = []
        self.venvs: dict[str, str] = {}  # replica -> its venv link's target (the release it runs)
        self.redacted = 0

    @property
    def room(self) -> int:
        return self.max_bytes - sum(len(data) for data in self.members.values())

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def path(self, node_path: str) -> Path:
        """Where a node path is (below ``--root``: the tests' fake node)."""
        return Path(self.root + node_path)

    def miss(self, what: str, why: str) -> None:
        self.unread.append({"what": what, "why": " ".join(why.split())[:500]})

    def add(self, name: str, data: bytes, source: str, keep_tail: bool = False, room: int | None = None) -> None:
        """A member, redacted, cut to the room left (its newest bytes with ``keep_tail``)."""
        text, count = redact_names(data.decode("utf-8", "replace"))
        self.redacted += count
        data = text.encode()
        limit = max(0, min(self.room, room if room is not None else self.room))
        entry: dict[str, Any] = {"name": name, "bytes": len(data), "source": source}
        if len(data) > limit:
            entry["cut_from"] = len(data)
            data = data[len(data) - limit:] if keep_tail else data[:limit]
            entry["bytes"] = len(data)
            entry["cut"] = (f"{'oldest' if keep_tail else 'last'} bytes left out: the node's cap of"
                            f" {self.max_bytes} bytes")
        self.members[name] = data
        self.entries.append(entry)

    def run(self, argv: Sequence[str], what: str, limit_s: float = COMMAND_S,
            env: dict[str, str] | None = None) -> bytes | None:
        """A command's output; None (and why, in the index) when the budget is spent, it fails or it hangs."""
        left = min(limit_s, self.left_s())
        if left <= 0.5:
            self.miss(what, f"not read: the node's bound of {self.budget_s:g} s ran out")
            return None
        try:
            done = subprocess.run(list(argv), capture_output=True, timeout=left,
                                  env=env, check=False)
        except subprocess.TimeoutExpired:
            self.miss(what, f"{argv[0]} did not end within {left:.0f} s")
            return None
        except OSError as exc:
            self.miss(what, f"{argv[0]}: {exc.strerror or exc}")
            return None
        if done.returncode != 0:
            err = done.stderr.decode("utf-8", "replace").strip().splitlines()
            self.miss(what, f"{Path(argv[0]).name} exited {done.returncode}: {err[-1] if err else 'no output'}")
            return None
        return done.stdout

    def read_bytes(self, node_path: str, tail: bool = False, missing: bytes | None = None) -> bytes | None:
        """A regular file's bytes (not a link: nothing points the collection elsewhere, into the secrets): whole, or
        with ``tail`` its newest :data:`FILE_MAX_BYTES`; None (and why, in the index) when it cannot be read,
        ``missing`` when it does not exist."""
        path = self.path(node_path)
        if _under(node_path, SECRETS_DIR):
            self.miss(node_path, "never read: it holds secrets")
            return None
        try:
            fd = os.open(str(path), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            return missing
        except OSError as exc:
            self.miss(node_path, "a link (never followed)" if os.path.islink(str(path)) else str(exc.strerror))
            return None
        with os.fdopen(fd, "rb") as opened:
            info = os.fstat(opened.fileno())
            if not stat.S_ISREG(info.st_mode):
                self.miss(node_path, "not a regular file")
                return None
            if tail:
                opened.seek(max(0, info.st_size - FILE_MAX_BYTES))
            data = opened.read(FILE_MAX_BYTES + 1)
        if len(data) > FILE_MAX_BYTES:
            self.miss(node_path, f"larger than {FILE_MAX_BYTES} bytes")
            return None
        return data

    def read_file(self, node_path: str, name: str) -> None:
        """A regular file as a member (:meth:`read_bytes`); a missing one is left out."""
        data = self.read_bytes(node_path)
        if data is not None:
            self.add(name, data, node_path)


def _under(path: str, directory: str) -> bool:
    real = os.path.normpath(path)
    return real == directory or real.startswith(directory + "/")


def units(c: Collection, replicas: list[str]) -> list[str]:
    """gpufleet's units on this node: those systemd knows by :data:`UNIT_PATTERNS`, and each replica's own."""
    listed = c.run(["systemctl", "list-units", "--all", "--plain", "--no-legend", "--no-pager", "--full", "--",
                    *UNIT_PATTERNS], "the list of units")
    found = [line.split()[0] for line in (listed or b"").decode("utf-8", "replace").splitlines() if line.split()]
    for replica in replicas:
        found += [f"vllm@{replica}.service", f"vllm-watchdog@{replica}.service"]
    return sorted({u for u in found if _UNIT.fullmatch(u) and any(fnmatch.fnmatch(u, p) for p in UNIT_PATTERNS)})


def unit_states(c: Collection, names: list[str]) -> None:
    """``units.json``: each unit's properties of :data:`UNIT_PROPERTIES`, as ``systemctl show`` gives them."""
    if not names:
        return
    shown = c.run(["systemctl", "show", "--no-pager", f"--property={','.join(UNIT_PROPERTIES)}", "--", *names],
                  "the units' states")
    if shown is None:
        return
    doc: dict[str, dict[str, str]] = {}
    for block in shown.decode("utf-8", "replace").split("\n\n"):
        props = dict(line.split("=", 1) for line in block.splitlines() if "=" in line)
        if props.get("Id"):
            doc[props["Id"]] = props
    c.add("units.json", (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode(), "systemctl show")


def journals(c: Collection, names: list[str]) -> None:
    """Each unit's journal over the window, the room left shared among the journals still to read."""
    for n, unit in enumerate(names):
        out = c.run(["journalctl", "--quiet", "--no-pager", "--output=short-iso", f"--since=@{c.since:.0f}",
                     f"--lines={JOURNAL_LINES}", "--unit", unit], f"the journal of {unit}")
        if out:
            c.add(f"journal/{unit}.log", out, f"journalctl --unit {unit}", keep_tail=True,
                  room=c.room // (len(names) - n))


def kernel_log_file(c: Collection) -> str | None:
    """The file the node watch reads as the kernel log (``kernel_log`` of its configuration), when it is not the
    kernel's own (``/dev/kmsg``, which the journal keeps with its times)."""
    try:
        doc = json.loads(c.path(LIFECYCLE_CONFIG).read_text())
    except (OSError, ValueError):
        return None
    found = doc.get("kernel_log") if isinstance(doc, dict) else None
    return found if isinstance(found, str) and found.startswith("/") and found != KMSG else None


def kernel(c: Collection) -> None:
    """The kernel log's NVRM and Xid lines: over the window from the journal, or the newest of the file the node
    watch reads in its place (a file has no times to window by)."""
    source = kernel_log_file(c)
    if source is not None:
        out = c.read_bytes(source, tail=True, missing=b"")  # missing: nothing written to it yet
        what = f"{source} (NVRM and Xid lines)"
    else:
        out = c.run(["journalctl", "--quiet", "--no-pager", "--output=short-iso", "--dmesg",
                     f"--since=@{c.since:.0f}"], "the kernel log")
        what = "journalctl --dmesg (NVRM and Xid lines)"
    if out is not None:
        lines = [line for line in out.decode("utf-8", "replace").splitlines(True) if "NVRM" in line or "Xid" in line]
        c.add("kernel.log", "".join(lines).encode(), what, keep_tail=True)


def _iso(usec: int) -> str:
    return datetime.fromtimestamp(usec / 1e6, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S+0000")


def boots(c: Collection) -> None:
    """``boots.log``: each boot that began in the window, and how the boot before it ended: after a shutdown, or
    without one (power lost, a hard reset, a kernel that stopped), as its journal's last lines say."""
    out = c.run(["journalctl", "--list-boots", "--no-pager", "--output=json"], "the node's boots")
    if out is None:
        return
    try:
        listed = sorted((b for b in json.loads(out) if isinstance(b, dict)), key=lambda b: int(b["index"]))
        found = [(str(b["boot_id"]), int(b["first_entry"]), int(b["last_entry"])) for b in listed]
    except (ValueError, KeyError, TypeError):
        c.miss("the node's boots", "journalctl --list-boots printed no list of boots")
        return
    lines = []
    for (before, _, ended), (boot, began, _) in zip(found, found[1:]):
        if began < c.since * 1e6 or not _ID.fullmatch(before):
            continue
        tail = c.run(["journalctl", "--quiet", "--no-pager", "--output=cat", "--lines=200", f"--boot={before}"],
                     f"the end of boot {before}")
        clean = tail is not None and any(mark in tail.decode("utf-8", "replace") for mark in SHUTDOWN_MARKS)
        how = "after a shutdown" if clean else "without a shutdown (power lost, a hard reset or a kernel that stopped)"
        lines.append(f"{_iso(began)} boot {boot[:12]} began; the boot before it ({before[:12]}) ended at"
                     f" {_iso(ended)} {how}\n")
    c.add("boots.log", "".join(lines).encode(), "journalctl --list-boots, and the end of each boot before one")


def replica_names(c: Collection) -> list[str]:
    try:
        return sorted(p.name for p in c.path(VLLM_ETC).iterdir() if p.is_dir() and _REPLICA.fullmatch(p.name))
    except OSError:
        return []


def replica_files(c: Collection, replicas: list[str]) -> None:
    """Each replica's files, and its venv's target (the release it runs)."""
    for replica in replicas:
        directory = f"{VLLM_ETC}/{replica}"
        for name in REPLICA_FILES:
            c.read_file(f"{directory}/{name}", f"replicas/{replica}/{name}")
        venv = c.path(f"{directory}/venv")
        if venv.is_symlink():
            c.venvs[replica] = os.readlink(str(venv))


def collect_envs(c: Collection, replicas: list[str]) -> None:
    """vLLM's own report of each replica's environment, from its venv, run with nothing of the units' environment."""
    for replica in replicas:
        vllm = f"{VLLM_ETC}/{replica}/venv/bin/vllm"
        out = c.run([str(c.path(vllm)), "collect-env"], f"vllm collect-env of {replica}", COLLECT_ENV_S,
                    env={"PATH": UNIT_PATH, "HOME": "/nonexistent", "LANG": "C.UTF-8"})
        if out is not None:
            c.add(f"replicas/{replica}/collect-env.txt", out, f"{vllm} collect-env")


def node_records(c: Collection) -> None:
    """The lifecycle record and summary, the evidence folders changed within the window, the burn-in verdicts, the
    GPU watch's marker and samples."""
    for name in NODE_FILES:
        c.read_file(f"{NODE_STATE_DIR}/{name}", f"node/{name}")
    try:
        folders = sorted(p for p in c.path(EVIDENCE_DIR).iterdir() if p.is_dir() and not p.is_symlink()
                         and p.stat().st_mtime >= c.since)
    except OSError:
        folders = []
    for folder in folders:
        for item in sorted(folder.iterdir()):
            c.read_file(f"{EVIDENCE_DIR}/{folder.name}/{item.name}", f"node/evidence/{folder.name}/{item.name}")
    try:
        verdicts = sorted(p.name for p in c.path(BURN_IN_DIR).iterdir() if p.name.endswith(".json"))
    except OSError:
        verdicts = []
    for name in verdicts:
        c.read_file(f"{BURN_IN_DIR}/{name}", f"burn-in/{name}")
    for path in GPU_WATCH_FILES:
        c.read_file(path, f"gpu-watch/{Path(path).name}")


def probe_and_router(c: Collection) -> None:
    """The NVML probe's report, and on a router HAProxy's servers and the router health's state."""
    probe = HERE / "nvml_probe.py"
    if probe.is_file():
        out = c.run([sys.executable, str(probe)], "the NVML probe")
        if out is not None:
            c.add("nvml_probe.json", out, "nvml_probe.py")
    else:
        c.miss("the NVML probe", f"{probe} is not on this node")
    sock = c.path(ROUTER_SOCKET)
    try:
        router = sock.is_socket()
    except OSError as exc:  # HAProxy's run folder is its own: the capture unit's sandbox does not see into it
        c.miss("HAProxy's servers", f"{ROUTER_SOCKET}: {exc.strerror}")
        router = False
    if router:
        out = c.run([sys.executable, "-I", str(HERE / "router_admin.py"), "show", "--socket", str(sock)],
                    "HAProxy's servers")
        if out is not None:
            c.add("router/servers.json", out, "router_admin.py show")
    c.read_file(ROUTER_HEALTH_STATE, "router/healthy")


def collect(root: str, since_s: float, max_bytes: int, budget_s: float, collect_env: bool) -> Collection:
    """Everything, in the order it matters when the bounds cut it short."""
    c = Collection(root, time.time() - since_s, max_bytes, budget_s)
    replicas = replica_names(c)
    names = units(c, replicas)
    unit_states(c, names)
    replica_files(c, replicas)
    node_records(c)
    kernel(c)
    boots(c)
    journals(c, names)
    probe_and_router(c)
    if collect_env:
        collect_envs(c, replicas)
    return c


def index(c: Collection, since_s: float) -> dict[str, Any]:
    return {"schema": SCHEMA, "node": socket.gethostname(), "since_s": since_s,
            "since": datetime.fromtimestamp(c.since, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "max_bytes": c.max_bytes, "budget_s": c.budget_s, "seconds": round(time.monotonic() - c.started, 3),
            "bytes": sum(len(d) for d in c.members.values()),
            "members": c.entries, "venvs": c.venvs,
            "unread": c.unread, "redacted": c.redacted}


def write_archive(c: Collection, doc: dict[str, Any], out_dir: str) -> Path:
    """The tar.gz in a new folder of ``out_dir``, both root's alone (or the sudo user's, who fetches it)."""
    folder = Path(tempfile.mkdtemp(prefix=OUT_PREFIX, dir=out_dir))
    path = folder / OUT_NAME
    fd = os.open(str(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as raw, tarfile.open(fileobj=raw, mode="w:gz") as tar:
        for name, data in [("index.json", (json.dumps(doc, indent=1) + "\n").encode()), *c.members.items()]:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o600, int(time.time())
            tar.addfile(info, io.BytesIO(data))
    uid, gid = os.environ.get("SUDO_UID", ""), os.environ.get("SUDO_GID", "")
    if os.geteuid() == 0 and uid.isdigit() and gid.isdigit():
        for owned in (folder, path):
            os.chown(str(owned), int(uid), int(gid))
    return path


def remove(directory: str) -> None:
    """Delete a folder ``collect`` made (and nothing else)."""
    if not OUT_DIR.fullmatch(directory):
        raise SystemExit(f"diag_collect: refusing to remove {directory!r}: not a folder this tool made")
    shutil.rmtree(directory, ignore_errors=True)


def captures(root: str, keep: int | None) -> list[dict[str, Any]]:
    """The captures kept in :data:`CAPTURES_DIR` (below ``root``), newest first: name, bytes, time; with ``keep``,
    those past the newest ``keep`` are removed first."""
    folder = Path(root + CAPTURES_DIR)
    try:
        found = [(p.name, p.lstat()) for p in folder.iterdir() if CAPTURE_NAME.fullmatch(p.name)]
    except FileNotFoundError:
        return []
    found = sorted((f for f in found if stat.S_ISREG(f[1].st_mode)), key=lambda f: f[0], reverse=True)
    if keep is not None:
        for name, _ in found[keep:]:
            (folder / name).unlink(missing_ok=True)
        found = found[:keep]
    return [{"name": name, "bytes": info.st_size,
             "time": datetime.fromtimestamp(info.st_mtime, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
            for name, info in found]


def capture_name(when: datetime, reason: str) -> str:
    """A capture's file name, on a node or a monitoring host: its UTC time, then ``reason`` in lower-case words joined
    by ``-``."""
    slug = _SLUG.sub("-", reason.lower()).strip("-")[:64].strip("-") or "capture"
    return f"{when:%Y%m%dT%H%M%SZ}-{slug}.tar.gz"


def capture(root: str, reason: str, keep: int) -> Path:
    """Collect the last :data:`CAPTURE_SINCE_S` into :data:`CAPTURES_DIR` (below ``root``) as a capture named by now
    and ``reason``, then remove those past the newest ``keep``; where it is."""
    folder = Path(root, CAPTURES_DIR.lstrip("/"))
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    c = collect(root, CAPTURE_SINCE_S, CAPTURE_MAX_BYTES, CAPTURE_BUDGET_S, False)
    made = write_archive(c, {**index(c, CAPTURE_SINCE_S), "capture": reason}, str(folder))
    path = folder / capture_name(datetime.now(timezone.utc), reason)
    os.replace(made, path)  # the same file system: whole or not there
    os.rmdir(made.parent)
    captures(root, keep)
    return path


def _bounded(low: float, high: float, whole: bool = False) -> Any:
    def parse(text: str) -> float:
        try:
            value = int(text) if whole else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, found {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected {low:g} to {high:g}, found {text!r}")
        return value
    return parse


def _reason(text: str) -> str:
    if not 1 <= len(text) <= 200 or not text.isprintable():
        raise argparse.ArgumentTypeError("expected 1 to 200 printable characters")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="diag_collect.py", description=__doc__.splitlines()[1])
    commands = parser.add_subparsers(dest="command", required=True)
    gather = commands.add_parser("collect", help="gather the node's evidence into a tar.gz")
    gather.add_argument("--since-s", required=True, type=_bounded(1, MAX_SINCE_S))
    gather.add_argument("--max-bytes", required=True, type=_bounded(1, MAX_BYTES, whole=True))
    gather.add_argument("--budget-s", required=True, type=_bounded(1, 3600))
    gather.add_argument("--collect-env", action="store_true", help="also run vllm collect-env in each replica's venv")
    gather.add_argument("--root", default="/", help="read the node's files below this folder (tests)")
    gather.add_argument("--out-dir", default="/var/tmp", help="where the archive's folder is made")
    gone = commands.add_parser("remove", help="delete the folder collect made, once fetched")
    gone.add_argument("directory")
    taken = commands.add_parser("capture", help=f"collect the last hour into a capture in {CAPTURES_DIR}")
    taken.add_argument("--reason", required=True, type=_reason, help="what failed, in words (the capture's name)")
    taken.add_argument("--keep", type=_bounded(1, 10000, whole=True), default=CAPTURE_KEEP,
                       help="then remove all but the newest KEEP captures")
    taken.add_argument("--root", default="/", help="read the node's files below this folder (tests)")
    kept = commands.add_parser("captures", help=f"list the captures in {CAPTURES_DIR}, newest first (JSON)")
    kept.add_argument("--keep", type=_bounded(1, 10000, whole=True), help="first remove all but the newest KEEP")
    kept.add_argument("--root", default="/", help="the folder the node's files are below (tests)")
    args = parser.parse_args(argv)
    if args.command == "remove":
        remove(args.directory)
        return 0
    if args.command == "captures":
        print(json.dumps(captures(args.root, args.keep)))
        return 0
    if args.command == "capture":
        path = capture(args.root, args.reason, args.keep)
        print(json.dumps({"capture": str(path), "bytes": path.stat().st_size}))
        return 0
    c = collect(args.root, args.since_s, args.max_bytes, args.budget_s, args.collect_env)
    path = write_archive(c, index(c, args.since_s), args.out_dir)
    print(json.dumps({"archive": str(path), "bytes": path.stat().st_size}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
