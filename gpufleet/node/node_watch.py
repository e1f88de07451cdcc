#!/usr/bin/env python3
"""Keep a node's place in the fleet (gpufleet node tool, run by gpufleet-node-watch.service; standard library only).

    python3 node_watch.py watch --config /etc/gpufleet/lifecycle.json
    python3 node_watch.py burn-in --config ... --tier quick|full     (the deploy's admission, people's readmission)
    python3 node_watch.py move --config ... --to quarantined --why TEXT [--by NAME] [--force]
    python3 node_watch.py show --config ...
    python3 node_watch.py restore --config ... --record-file PATH   (a deploy: the fleet's copy of a lost record)

The node's record (``gpufleet/node/node_state.py``) lives in the config's ``state_file``; every writer (this watch,
a deploy, ``gpufleet nodes``) changes it through this tool, under one lock. ``watch``:

- **tells the routers** whether the node's replicas may take requests: HAProxy's agent check asks the config's
  ``agent`` port each second, and hears ``up`` while the node is serving or suspect (``up 100%`` in the first
  seconds, restoring the weight), ``0% down`` otherwise: no new request reaches a replica of a node that left;
- **reads the kernel log** (``kernel_log``: ``/dev/kmsg`` on a real node) for Xids, grouped into bursts, the GPU
  watch's marker (its gate failed), its samples (``gpu_samples``: trends of throttling, PCIe downgrades and
  NVLinks down, whatever the gate's policy), and the journal for the replica watchdogs' restarts (repeated stalls),
  as findings, each acted on as the catalog says (``gpufleet/node/findings.py``);
- **acts on the state**, whoever set it: a node that left (quarantined, retired) is drained (the agent already
  answers down; in-flight requests get up to ``drain_timeout_s`` to finish), evidence is kept (a quarantined node
  also starts its capture unit: the node tool's archive of the last hour, kept on the node), its replica units
  stop, and a quarantined node runs the ``full`` burn-in while idle; once its cool-off has passed it moves to
  burn-in, and ``readmit_passes`` clean full passes bring it back to serving, its units started again; a node in
  service that a person sends to burn-in (a full burn-in on request) is drained and stopped the same way, and one
  clean full pass brings it back;
- **exports** the state for Prometheus (node_exporter's textfile collector), and whether each LoRA adapter of the
  node's replicas is staged as declared (``staged_adapters.py``: its weights' digest, looked at every 10 s).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib.util
import json
import os
import re
import socketserver
import stat
import sys
import threading
import time
import urllib.request
from collections import deque
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator

HERE = Path(__file__).resolve().parent
RESTORE_WEIGHT_S = 10.0  # after a node comes back, the agent restores the routers' weight this long
POLL_S = 0.2
STALLS_EVERY_S = 30.0  # how often the journal (watchdog restarts) and the GPU watch's samples are read
STOP_WAIT_S = 300.0  # the longest the burn-in waits for the replica units it stopped to end
HEARD_WAIT_S = 5.0  # the longest a drain waits for every router that asks the agent to have heard "down"
ASKING_S = 10.0  # a router that asked the agent this recently is one that must hear "down"
SETTLED_READS = 3  # a drain ends after this many reads in a row, 0.5 s apart, find no request in the engines
_UNIT = re.compile(r"^vllm@[A-Za-z0-9_.:-]+\.service$")
_CAPTURE = re.compile(r"^gpufleet-capture@[A-Za-z0-9_.-]+\.service$")  # node_paths.capture_unit's
_WHY = re.compile(r"^(?=.*\S).{1,200}$", re.DOTALL)  # and printable: see _why_ok


def _sibling(name: str) -> ModuleType:
    """``<name>.py`` from this file's directory (node code has no package to import from)."""
    qualified = f"gpufleet_node_{name}"
    if qualified in sys.modules:
        return sys.modules[qualified]
    spec = importlib.util.spec_from_file_location(qualified, HERE / f"{name}.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {name}.py beside {__file__}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[qualified] = module
    spec.loader.exec_module(module)
    return module


findings, node_state = _sibling("findings"), _sibling("node_state")
staged_adapters = _sibling("staged_adapters")
_run = _sibling("burn_in").run_command  # the same time-limited runner as the burn-in's


def log(line: str) -> None:
    print(line, flush=True)


def utcnow() -> datetime:
    return datetime.now(UTC)


class Config:
    """The node's lifecycle configuration (``/etc/gpufleet/lifecycle.json``, written by the deploy)."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.doc = doc
        self.node: str = doc["node"]
        self.policy = node_state.Policy(**doc["policy"])
        self.catalog: dict[str, Any] = doc["catalog"]
        self.burst_quiet_s = float(doc.get("burst_quiet_s", findings.BURST_QUIET_S))
        self.kernel_log = Path(doc.get("kernel_log", "/dev/kmsg"))
        self.gate_marker = Path(doc.get("gate_marker", "/run/gpufleet/gpu-gate-failed"))
        self.gpu_samples = Path(doc.get("gpu_samples", "/run/gpufleet/gpu-samples.json"))
        self.agent: dict[str, Any] = doc.get("agent") or {}
        self.drain_timeout_s = float(doc.get("drain_timeout_s", 60))
        self.burn_in: dict[str, Any] = doc["burn_in"]
        self.state_file = Path(doc.get("state_file", "/var/lib/gpufleet/node-state.json"))
        self.evidence_dir = Path(doc.get("evidence_dir", "/var/lib/gpufleet/evidence"))
        self.textfile = Path(doc["textfile"]) if doc.get("textfile") else None
        self.replica_metrics: list[str] = list(doc.get("replica_metrics", []))
        self.capture_unit: str | None = doc.get("capture_unit")  # started when the node is quarantined
        self.adapters: list[Any] = staged_adapters.declared(doc.get("adapters", []))  # its replicas' LoRA adapters

    @classmethod
    def load(cls, path: Path) -> Config:
        doc = read_json(path)
        if not isinstance(doc, dict) or not isinstance(doc.get("node"), str) or not isinstance(doc.get("policy"), dict):
            raise ValueError("expected a mapping with the node's name and its policy")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in doc["policy"].values()):
            raise ValueError("expected the policy's counts and seconds as positive whole numbers")
        problems = findings.catalog_problems(doc.get("catalog"), "catalog")
        if problems:
            raise ValueError(problems[0])
        return cls(doc)


# --- the record, under one lock ------------------------------------------------------------------------------------


@contextlib.contextmanager
def locked(config: Config) -> Iterator[dict[str, Any]]:
    """The node's record, read and written back under an exclusive lock (a new record when there is none)."""
    config.state_file.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    lock_path = config.state_file.with_name(f".{config.state_file.name}.lock")
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        record = read_record(config)
        before = json.dumps(record, sort_keys=True)
        yield record
        if json.dumps(record, sort_keys=True) != before:
            write_record(config.state_file, record)


MAX_JSON_BYTES = 8 * 1024**2  # the most a record or the GPU watch's samples may take


def read_json(path: Path) -> Any:
    """A JSON file of this node's own (a record, samples): FileNotFoundError without one; ValueError for one that is
    not a regular file, too large, or not plain JSON (NaN, nesting beyond the parser's depth)."""
    with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as file:  # a FIFO must not block the watch
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_JSON_BYTES:
            raise ValueError(f"{path}: expected a regular file of at most {MAX_JSON_BYTES} bytes")
        data = file.read(MAX_JSON_BYTES + 1)

    def plain(constant: str) -> Any:
        raise ValueError(f"{path}: expected plain JSON, found {constant}")

    try:
        return json.loads(data.decode(), parse_constant=plain)
    except (UnicodeDecodeError, RecursionError) as exc:
        raise ValueError(f"{path}: expected JSON text ({type(exc).__name__})") from None


def read_record(config: Config) -> dict[str, Any]:
    try:
        record = read_json(config.state_file)
    except FileNotFoundError:
        fresh: dict[str, Any] = node_state.new_record(config.node, utcnow())
        return fresh
    if not isinstance(record, dict) or record.get("schema") != node_state.SCHEMA:
        raise ValueError(f"{config.state_file}: not a {node_state.SCHEMA} record")
    return record


def write_record(path: Path, record: dict[str, Any]) -> None:
    """Replace the record, then its summary (the state, the quarantines' count and whether a full burn-in was
    requested: what a deploy reads), each in one rename, root 0644 (no secret in them)."""
    summary = {"state": record["state"], "quarantines": len(record.get("quarantines") or []),
               "requested": bool(record.get("requested"))}
    for target, text in ((path, json.dumps(record, indent=1)), (summary_path(path), json.dumps(summary))):
        temporary = target.with_name(f".{target.name}.tmp")
        temporary.write_text(text + "\n")
        os.chmod(temporary, 0o644)
        os.replace(temporary, target)


def summary_path(state_file: Path) -> Path:
    """Where the record's summary sits beside it (node_paths.NODE_STATE_SUMMARY)."""
    return state_file.with_name("summary.json")


def _why_ok(text: str) -> bool:
    """1 to 200 printable characters, not all blank (no control, line or paragraph separators, no format characters
    such as a right-to-left override)."""
    return bool(_WHY.fullmatch(text)) and text.isprintable()


def replace(record: dict[str, Any], new: dict[str, Any]) -> None:
    record.clear()
    record.update(new)


# --- the routers' agent check --------------------------------------------------------------------------------------


def agent_reply(record: dict[str, Any] | None, now: datetime) -> str:
    """What HAProxy's agent check hears about the node's replicas."""
    if record is None or record.get("state") not in node_state.IN_SERVICE:
        return "0% down\n"
    since = node_state.parse_time(record["since"])
    return "up 100%\n" if (now - since).total_seconds() < RESTORE_WEIGHT_S else "up\n"


class Agent:
    """A TCP server answering each connection with :func:`agent_reply` for the current record. It remembers when each
    router last asked and last heard "down", so that a drain can wait until every router has heard it."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.record: dict[str, Any] | None = None
        self.lock = threading.Lock()
        self.down_since: float | None = None  # when the replies turned "down" (monotonic)
        self.asked: dict[str, float] = {}
        self.heard_down: dict[str, float] = {}
        watch = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                peer = str(self.client_address[0])
                with watch.lock:
                    reply = agent_reply(watch.record, utcnow())
                    watch.answered(peer, reply, time.monotonic())
                with contextlib.suppress(OSError):
                    self.request.sendall(reply.encode())

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self.server = socketserver.ThreadingTCPServer((config.agent["address"], int(config.agent["port"])), Handler)
        self.server.daemon_threads = True

    def set(self, record: dict[str, Any]) -> None:
        with self.lock:
            down = agent_reply(record, utcnow()).endswith("down\n")
            if down and self.down_since is None:
                self.down_since = time.monotonic()
            elif not down:
                self.down_since = None
            self.record = json.loads(json.dumps(record))

    def answered(self, peer: str, reply: str, now: float) -> None:
        """Note one reply (the lock held)."""
        self.asked[peer] = now
        if reply.endswith("down\n"):
            self.heard_down[peer] = now

    def all_heard_down(self) -> bool:
        """Whether every router that asked lately has heard "down" since the replies turned so."""
        with self.lock:
            since = self.down_since
            if since is None:
                return False
            asking = [peer for peer, at in self.asked.items() if at >= since - ASKING_S]
            return all(self.heard_down.get(peer, -1.0) >= since for peer in asking)

    def start(self) -> None:
        threading.Thread(target=self.server.serve_forever, name="agent", daemon=True).start()


# --- the kernel log ------------------------------------------------------------------------------------------------


class KernelLog:
    """New lines of the kernel log from now on: ``/dev/kmsg`` (one record a read) or a file that grows."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.recent: deque[str] = deque(maxlen=200)
        self.fd: int | None = None
        self.device = False
        self.buffer = b""
        self.offset = 0
        self.missing = False  # it was not there when the watch looked first: once it is, all of it is new

    def _open(self) -> None:
        if self.fd is not None:
            return
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            self.missing = True
            return
        self.device = stat.S_ISCHR(os.fstat(self.fd).st_mode)
        self.offset = os.lseek(self.fd, 0, os.SEEK_SET if self.missing and not self.device else os.SEEK_END)

    def lines(self) -> list[str]:
        self._open()
        if self.fd is None:
            return []
        out: list[str] = []
        while True:
            try:
                chunk = os.read(self.fd, 8192)
            except BlockingIOError:
                break
            except OSError as exc:  # /dev/kmsg: EPIPE when records were overwritten; read on
                if exc.errno == 32:
                    continue
                break
            if not chunk:
                if not self.device and os.fstat(self.fd).st_size < self.offset:  # truncated: start over
                    self.offset = os.lseek(self.fd, 0, os.SEEK_SET)
                    continue
                break
            self.offset += len(chunk)
            if self.device:
                out.append(chunk.decode(errors="replace").split(";", 1)[-1].rstrip("\n"))
                continue
            self.buffer += chunk
            *complete, self.buffer = self.buffer.split(b"\n")
            out += [c.decode(errors="replace") for c in complete]
        self.recent.extend(out)
        return out


# --- acting -------------------------------------------------------------------------------------------------------


def replica_units(states: str = "active,activating,reloading") -> list[str]:
    """The replica units systemd runs or is starting on this node (or in any of ``states``)."""
    status, out, _ = _run(["systemctl", "list-units", "--plain", "--no-legend", "--no-pager", "--type=service",
                           f"--state={states}", "vllm@*.service"], 30)
    if status != 0:
        return []
    return sorted({w for line in out.splitlines() for w in line.split()[:2] if _UNIT.match(w)})


def requests_running(urls: list[str]) -> float:
    """The requests the node's replicas' engines hold (vLLM's ``vllm:num_requests_running`` and ``_waiting``); 0
    where none answers."""
    total = 0.0
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                text = response.read().decode(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
                with contextlib.suppress(ValueError):
                    total += float(line.rsplit(None, 1)[-1])
    return total


def gpu_samples(config: Config) -> list[Any]:
    """The GPU watch's last samples (gpu_watch.py --samples); none while it keeps none."""
    try:
        found = read_json(config.gpu_samples)
    except (OSError, ValueError):
        return []
    return found if isinstance(found, list) else []


def keep_evidence(config: Config, record: dict[str, Any], why: str, kernel: KernelLog | None) -> str:
    """A folder of what the node looked like when it left: the record, the kernel log's last lines, the GPUs'
    facts, the replica units' state and journal. Root 0700: journals can name paths and models."""
    stamp = utcnow().strftime("%Y%m%dT%H%M%SZ")
    slug = re.sub(r"[^A-Za-z0-9]+", "-", why)[:40].strip("-") or "left"
    folder = config.evidence_dir / f"{stamp}-{slug}"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    (folder / "record.json").write_text(json.dumps(record, indent=1) + "\n")
    (folder / "kernel.log").write_text("\n".join(kernel.recent if kernel else []) + "\n")
    for name, argv in (("gpus.json", [sys.executable, str(HERE / "nvml_probe.py")]),
                       ("units.txt", ["systemctl", "status", "--no-pager", "--lines=0", "vllm@*.service"]),
                       ("journal.txt", ["journalctl", "--no-pager", "--lines=300", "--unit=vllm@*.service"])):
        status, out, err = _run(argv, 20)
        (folder / name).write_text(out if out else f"(exit {status}) {err.strip()[-500:]}\n")
    return str(folder)


def drain(config: Config, agent: Agent | None) -> None:
    """Wait until the routers send the replicas nothing more and the engines hold no request, ``drain_timeout_s`` at
    most. A router hears "down" at its next agent check (1 s): until every router that asks has heard it, a request
    may still arrive. One that arrived is in the API server before the engine counts it, so the engines must read
    empty several times in a row."""
    deadline = time.monotonic() + config.drain_timeout_s
    heard = time.monotonic() + HEARD_WAIT_S
    while agent is not None and not agent.all_heard_down() and time.monotonic() < heard:
        time.sleep(0.2)
    empty = 0
    while empty < SETTLED_READS and time.monotonic() < deadline:
        empty = empty + 1 if requests_running(config.replica_metrics) == 0 else 0
        if empty < SETTLED_READS:
            time.sleep(0.5)


def stop_units(config: Config, record: dict[str, Any], kernel: KernelLog | None, agent: Agent | None = None) -> None:
    """Drain, keep the evidence, stop the replica units (recorded, so that readmission starts them again)."""
    units = replica_units()
    if units:
        drain(config, agent)
    folder = keep_evidence(config, record, record["history"][-1]["why"] if record["history"] else "left", kernel)
    record["evidence"] = [*(record.get("evidence") or [])[-9:], folder]
    if record["state"] == "quarantined" and config.capture_unit and _CAPTURE.match(config.capture_unit):
        _run(["systemctl", "start", "--no-block", "--", config.capture_unit], 30)  # the last hour, kept on the node
    if units:
        _run(["systemctl", "stop", "--no-block", "--", *units], 30)
        log(f"{config.node}: {record['state']}: stopped {', '.join(units)}; evidence in {folder}")
    record["stopped_units"] = sorted(set(record.get("stopped_units") or []) | set(units))


def run_burn_in(config: Config, tier: str) -> dict[str, Any]:
    """One burn-in, run by its unit (the GPUs and the release's torch are its own sandbox's): its verdict, or a failed
    one saying why there is none."""
    unit = str(config.burn_in["units"][tier])
    verdict_file = Path(config.burn_in["verdicts"]) / f"{tier}.json"  # the unit's to write: read-only here
    started = time.time()
    status, _, err = _run(["systemctl", "start", "--", unit], float(config.burn_in.get("timeout_s", 3600)) + 60)
    try:
        if verdict_file.stat().st_mtime >= started - 1.0:  # never judge by the last run's verdict
            verdict = json.loads(verdict_file.read_text())
            if isinstance(verdict, dict) and "passed" in verdict:
                return verdict
    except (OSError, ValueError):
        pass
    _, journal, _ = _run(["journalctl", "--quiet", "--no-pager", "--output=cat", "--lines=5", "--unit", unit], 20)
    return {"schema": "gpufleet.burn-in/1", "tier": tier, "passed": False, "seconds": None,
            "checks": [{"check": "burn-in", "status": "fail", "gpu": None,
                        "evidence": {"unit": unit, "exit_status": status, "stderr": err.strip()[-300:],
                                     "journal": journal.strip()[-600:]}}]}


def burn_in(config: Config, tier: str) -> dict[str, Any]:
    """Run a tier and fold its verdict into the record; the record after."""
    verdict = run_burn_in(config, tier)
    with locked(config) as record:
        replace(record, node_state.after_burn_in(record, verdict, utcnow(), config.policy))
        log(f"{config.node}: burn-in {tier} {'passed' if verdict['passed'] else 'failed'} in {verdict.get('seconds')}"
            f" s; the node is {record['state']}")
        after: dict[str, Any] = json.loads(json.dumps(record))
        return after


def watchdog_restarts(window_s: float) -> list[tuple[float, str]]:
    """The replica watchdogs' restarts within the last ``window_s`` seconds, from the journal: when, and the line."""
    since = time.time() - window_s
    _, out, _ = _run(["journalctl", "--quiet", "--no-pager", "--output=short-unix", f"--since=@{since:.0f}",
                      "--unit=vllm-watchdog@*", "--grep=restarting vllm@"], 20)
    found = []
    for line in out.splitlines():
        stamp, _, text = line.partition(" ")
        try:
            found.append((float(stamp), text[-300:]))
        except ValueError:
            continue
    return found


def apply_finding(config: Config, finding: Any) -> None:
    """Record a finding and move the node as its action says."""
    now = utcnow()
    what = f"Xid {finding.code} on {finding.gpu}" if finding.kind == "xid" else \
        f"{finding.kind} on {finding.gpu}" if finding.gpu else finding.kind
    with locked(config) as record:
        seen = {"at": node_state.now_text(now), "kind": finding.kind, "code": finding.code, "gpu": finding.gpu,
                "action": finding.action, "evidence": finding.evidence}
        record["findings"] = [*(record.get("findings") or [])[-49:], seen]
        state = record["state"]
        if finding.action == "quarantine" and state not in node_state.OUT_OF_SERVICE:
            replace(record, node_state.quarantine(record, what, now, config.policy, evidence=finding.evidence))
            log(f"{config.node}: {what} ({finding.evidence.get('name')}): {record['state']}")
        elif finding.action == "suspect" and state == "serving":
            replace(record, node_state.move(record, "suspect", what, now, evidence=finding.evidence))
            log(f"{config.node}: {what}: suspect (still serving)")
        else:
            log(f"{config.node}: {what}: recorded")


def reconcile(config: Config, kernel: KernelLog | None, agent: Agent | None = None) -> None:
    """Bring the node to what its state says (see the module docstring)."""
    with locked(config) as record:
        state = record["state"]
        # out of service, or in a burn-in that needs the GPUs (a readmission, or a full burn-in on request): a person
        # may quarantine and readmit faster than this loop looks, so burn-in is reached with the replicas running
        if (state in node_state.OUT_OF_SERVICE or node_state.full_burn_in_due(record)) and replica_units():
            if agent is not None:
                agent.set(record)  # "down" from now on: the drain waits for the routers to hear it
            stop_units(config, record, kernel, agent)
        if state == "quarantined" and node_state.readmission_due(record, utcnow(), config.policy):
            replace(record, node_state.move(record, "burn-in", "cool-off over: readmission burn-in", utcnow()))
            state = "burn-in"
        # a quarantined node runs the full tier once while idle; one being readmitted, until it serves again
        quarantined_idle = state == "quarantined" and not _full_since_quarantine(record)
        tier = "full" if quarantined_idle or node_state.full_burn_in_due(record) else ""
        if state in node_state.IN_SERVICE and record.get("stopped_units"):
            units = [u for u in record["stopped_units"] if _UNIT.match(u)]
            if units:
                _run(["systemctl", "start", "--no-block", "--", *units], 30)
                log(f"{config.node}: {state} again; starting {', '.join(units)}")
            record["stopped_units"] = []
    if tier:
        # the GPUs are the burn-in's alone: a replica still stopping (it drains for up to its stop timeout) holds them
        settle = time.monotonic() + STOP_WAIT_S
        while replica_units("active,activating,deactivating,reloading") and time.monotonic() < settle:
            time.sleep(1.0)
        burn_in(config, tier)


def _full_since_quarantine(record: dict[str, Any]) -> bool:
    last = record.get("last_burn_in") or {}
    return bool(last.get("tier") == "full" and record["quarantines"]
                and last.get("at", "") >= record["quarantines"][-1])


def export(config: Config, record: dict[str, Any], adapters: list[Any] | None = None) -> None:
    """The node's state for Prometheus (node_exporter's textfile collector; the scrape adds the node's labels): one
    series per state (1 for the current one), when it entered it, its quarantines kept, and its last burn-in: passed or
    not, and each failed check by GPU; and whether each LoRA adapter of its replicas is staged as declared
    (``adapters``: the last look's verdicts)."""
    if config.textfile is None:
        return
    lines = ["# HELP gpufleet_node_state The node's lifecycle state (1 for the current one).",
             "# TYPE gpufleet_node_state gauge"]
    lines += [f'gpufleet_node_state{{state="{s}"}} {int(record["state"] == s)}' for s in node_state.STATES]
    since = node_state.parse_time(record["since"]).timestamp()
    lines += ["# HELP gpufleet_node_state_since_seconds When the node entered its state.",
              "# TYPE gpufleet_node_state_since_seconds gauge",
              f"gpufleet_node_state_since_seconds {since:.0f}",
              "# HELP gpufleet_node_quarantines The quarantines the node's record keeps.",
              "# TYPE gpufleet_node_quarantines gauge",
              f'gpufleet_node_quarantines {len(record["quarantines"])}']
    last = record.get("last_burn_in") or {}
    if last:
        tier = "full" if last.get("tier") == "full" else "quick"
        failed = last.get("failed") or []
        lines += ["# HELP gpufleet_burn_in_passed Whether the node's last burn-in passed.",
                  "# TYPE gpufleet_burn_in_passed gauge",
                  f'gpufleet_burn_in_passed{{tier="{tier}"}} {int(bool(last.get("passed")))}',
                  "# HELP gpufleet_burn_in_gpu_passed Whether each GPU passed every check of the node's last burn-in.",
                  "# TYPE gpufleet_burn_in_gpu_passed gauge"]
        for gpu in last.get("gpus") or []:
            passed = not any(f.get("gpu") == gpu for f in failed)
            lines.append(f'gpufleet_burn_in_gpu_passed{{gpu="{int(gpu)}"}} {int(passed)}')
        lines += ["# HELP gpufleet_burn_in_failed_check A check the node's last burn-in failed, by GPU.",
                  "# TYPE gpufleet_burn_in_failed_check gauge"]
        for check_failed in failed:
            check = re.sub(r"[^A-Za-z0-9_.-]", "_", str(check_failed.get("check")))[:40]
            gpu = "" if check_failed.get("gpu") is None else str(int(check_failed["gpu"]))
            lines.append(f'gpufleet_burn_in_failed_check{{check="{check}",gpu="{gpu}"}} 1')
    lines += staged_adapters.textfile_lines(adapters or [])
    text = "\n".join(lines) + "\n"
    config.textfile.parent.mkdir(parents=True, exist_ok=True)
    temporary = config.textfile.with_name(f".{config.textfile.name}.tmp")
    temporary.write_text(text)
    os.chmod(temporary, 0o644)
    os.replace(temporary, config.textfile)


def watch(config: Config) -> int:
    agent = Agent(config) if config.agent else None
    with locked(config) as record:
        snapshot = json.loads(json.dumps(record))
    if agent is not None:
        agent.set(snapshot)
        agent.start()
    kernel = KernelLog(config.kernel_log)
    kernel.lines()  # open at the end: what was logged before the watch started was acted on then
    bursts = findings.Bursts(config.catalog, config.burst_quiet_s)
    gate_failed = config.gate_marker.exists()
    stalls = findings.Stalls(config.catalog, last=time.time())  # restarts before this watch started were seen then
    trends = findings.Trends(config.catalog)
    log(f"{config.node}: watching {config.kernel_log}; the node is {snapshot['state']}")
    next_reconcile = next_stalls = next_adapters = 0.0
    digests, adapters = staged_adapters.Digests(), []
    while True:
        for line in kernel.lines():
            xid = findings.parse_xid(line)
            if xid is not None and (finding := bursts.see(xid, time.monotonic())) is not None:
                apply_finding(config, finding)
                next_reconcile = 0.0
        failing = config.gate_marker.exists()
        if failing and not gate_failed:
            apply_finding(config, findings.Finding("gate_failed", findings.action_of(config.catalog, "gate_failed"),
                                                   None, None, {"marker": config.gate_marker.read_text()[:2000]}))
            next_reconcile = 0.0
        gate_failed = failing
        if time.monotonic() >= next_stalls:
            if (finding := stalls.see(watchdog_restarts(stalls.window_s), time.time())) is not None:
                apply_finding(config, finding)
                next_reconcile = 0.0
            try:
                trending = trends.see(gpu_samples(config), time.time())
            except (ArithmeticError, TypeError, ValueError) as exc:  # samples no GPU watch wrote: nothing found
                log(f"{config.node}: the GPU watch's samples cannot be read: {type(exc).__name__}")
                trending = []
            for finding in trending:
                apply_finding(config, finding)
                next_reconcile = 0.0
            next_stalls = time.monotonic() + STALLS_EVERY_S
        if config.adapters and time.monotonic() >= next_adapters:
            adapters = staged_adapters.verdicts(config.adapters, digests)
            next_adapters = time.monotonic() + staged_adapters.CHECK_EVERY_S
        record = read_record(config)
        if agent is not None:
            agent.set(record)
        if time.monotonic() >= next_reconcile:
            reconcile(config, kernel, agent)
            record = read_record(config)
            if agent is not None:
                agent.set(record)
            export(config, record, adapters)
            next_reconcile = time.monotonic() + 2.0
        time.sleep(POLL_S)


def restore(config: Config, record_file: Path) -> int:
    """Make the fleet's copy of this node's record (``record_file``, which the deploy uploads, root 0600; removed
    here) its own where it holds a longer history, or where the node's own cannot be read (kept beside it as
    ``.corrupt``): a node that lost its disk, or was reinstalled, is what the fleet knew of it, not a new one. The
    record after, or one line and exit 2."""
    try:
        given = read_json(record_file)
        problem = node_state.record_problem(given, config.node)
    except (OSError, ValueError) as exc:
        given, problem = None, str(exc)[:300]
    finally:
        with contextlib.suppress(OSError):
            if stat.S_ISREG(os.lstat(record_file).st_mode):
                record_file.unlink()
    if problem is not None:
        print(f"node watch: restore: {problem}", file=sys.stderr)
        return 2
    try:
        read_record(config)
    except (OSError, ValueError) as exc:
        log(f"{config.node}: its own record cannot be read ({str(exc)[:200]}); kept as .corrupt")
        os.replace(config.state_file, config.state_file.with_name(f"{config.state_file.name}.corrupt"))
    with locked(config) as record:
        if len(given["history"]) > len(record.get("history") or []):
            replace(record, given)
            log(f"{config.node}: restored from the fleet's copy: {given['state']}")
    print(json.dumps(read_record(config), indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="node_watch.py", description="Keep this node's place in the fleet.")
    parser.add_argument("verb", choices=("watch", "burn-in", "move", "show", "restore"))
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--tier", choices=("quick", "full"))
    parser.add_argument("--to", choices=node_state.STATES)
    parser.add_argument("--why", default="")
    parser.add_argument("--by", default="gpufleet")
    parser.add_argument("--why-hex", default="", help="--why as hexadecimal UTF-8 (a controller's plain words)")
    parser.add_argument("--by-hex", default="", help="--by as hexadecimal UTF-8")
    parser.add_argument("--force", action="store_true")
    parser.add_argument("--record-file", type=Path, help="restore: the fleet's copy of the record (removed after)")
    args = parser.parse_args(argv)
    try:
        args.why = bytes.fromhex(args.why_hex).decode() if args.why_hex else args.why
        args.by = bytes.fromhex(args.by_hex).decode() if args.by_hex else args.by
    except ValueError:
        print("node watch: --why-hex and --by-hex take hexadecimal UTF-8", file=sys.stderr)
        return 2
    try:
        config = Config.load(args.config)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        print(f"node watch: {args.config}: {type(exc).__name__}: {str(exc)[:300]}", file=sys.stderr)
        return 2
    if args.verb == "watch":
        return watch(config)
    try:
        return _act(config, args, parser)
    except (OSError, ValueError) as exc:  # the record or its lock unreadable: one line, nothing changed
        print(f"node watch: {str(exc)[:300]}", file=sys.stderr)
        return 2


def _act(config: Config, args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``show``, ``restore``, ``burn-in`` and ``move``."""
    if args.verb == "show":
        print(json.dumps(read_record(config), indent=1))
        return 0
    if args.verb == "restore":
        if args.record_file is None:
            parser.error("restore needs --record-file")
        return restore(config, args.record_file)
    if args.verb == "burn-in":
        if args.tier is None:
            parser.error("burn-in needs --tier")
        record = burn_in(config, args.tier)
        if record["state"] in node_state.IN_SERVICE:
            return 0
        for check in (record.get("last_burn_in") or {}).get("failed") or []:
            where = "the node" if check.get("gpu") is None else f"GPU {check['gpu']}"
            print(f"{config.node}: burn-in {args.tier}: {check.get('check')} failed on {where}: "
                  f"{json.dumps(check.get('evidence'))[:300]}", file=sys.stderr)
        print(f"{config.node}: the node is {record['state']}", file=sys.stderr)
        return 1
    if args.to is None or not _why_ok(args.why) or not _why_ok(args.by):
        print("node watch: move needs --to and a --why (and --by) of 1 to 200 printable characters", file=sys.stderr)
        return 2
    try:
        with locked(config) as record:
            now = utcnow()
            if args.to == "quarantined":
                new = node_state.quarantine(record, args.why, now, config.policy, by=args.by)
            else:
                new = node_state.move(record, args.to, args.why, now, by=args.by, force=args.force)
            replace(record, new)
    except node_state.MoveRefused as refused:
        print(f"node watch: {refused}", file=sys.stderr)
        return 2
    print(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
