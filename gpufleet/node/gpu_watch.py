#!/usr/bin/env python3
"""Keep a node's vLLM replicas off GPUs that fail at run time (gpufleet node tool, run by gpufleet-gpu-watch.timer).

    python3 gpu_watch.py --policy /etc/gpufleet/gpu-health.json --marker /run/gpufleet/gpu-gate-failed

Each run judges the node with the very gate the replicas' units run as ``ExecStartPre`` (``nvml_probe.py --gate
POLICY --json`` beside this file, in a child process with a time limit), then:

- **the node fails**: the marker (JSON, root 0644: the node, the failed rules, the units stopped) is written first,
  one line per failed rule is logged naming the node, the rule and the GPU (again only when the failures change),
  and every ``vllm@*.service`` that runs or is starting is stopped. A gate failure makes the whole node unfit and
  its gate refuses to start any replica on it, so every replica on the node goes, not only those on the failed
  GPU. Units systemd gave up on (``failed``) are recorded too: they were meant to run. A stopped unit stays
  stopped: ``Restart=`` does not act on ``systemctl stop``, and any later start ends at the unit's gate while
  the node fails;
- **the node passes and the marker is there**: the recorded units that are still enabled are started (a deploy
  may have retired or disabled one since), which is logged, and the marker is removed;
- **the node passes and there is no marker**: nothing.

A probe that gives no verdict within ``--probe-timeout`` is a failure (rule ``probe``): NVML can hang on a lost
GPU. A probe that ends without a verdict (a crash) or cannot read the policy changes nothing (exit 1 or 2): a
broken watch must not stop healthy replicas. Standard library only; every line it logs goes to the journal.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

PROBE = Path(__file__).resolve().with_name("nvml_probe.py")
WATCHED = "vllm@*.service"
_UNIT_NAME = re.compile(r"^vllm@[A-Za-z0-9_.:-]+\.service$")
STOPPABLE = ("active", "activating", "reloading")  # running, starting or waiting for a restart
MEANT_TO_RUN = (*STOPPABLE, "deactivating", "failed")
ENABLED = ("enabled", "enabled-runtime")
PROBE_TIMEOUT_S = 60.0
SAMPLES_KEPT = 120  # an hour of samples at the timer's 30 s

Failure = Dict[str, Any]  # {"rule": ..., "gpu": int or None, "evidence": ...}, as the gate's verdict has them
Runner = Callable[[List[str]], Tuple[int, str, str]]  # argv -> (exit status, stdout, stderr)


class Unjudged(Exception):
    """The gate gave no verdict the watch may act on; ``status`` is the watch's exit status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Unit:
    """A replica unit as systemd reports it."""

    name: str
    active: str  # ActiveState
    file_state: str = ""  # UnitFileState: enabled, disabled, ... ("" without a unit file)


@dataclass
class Plan:
    """What one run does: units to stop, to reset (failed) and start, the marker afterwards (None: none), log lines."""

    stop: list[str] = field(default_factory=list)
    reset: list[str] = field(default_factory=list)
    start: list[str] = field(default_factory=list)
    marker: dict[str, Any] | None = None
    log: list[str] = field(default_factory=list)


def log(line: str) -> None:
    print(line, flush=True)


def failure_line(node: str, failure: Failure) -> str:
    """One journal line per failed rule: the node, the rule, the GPU (or the node as a whole) and the evidence."""
    where = f"gpu {failure.get('gpu')}" if failure.get("gpu") is not None else "the node"
    return f"{node}: GPU health gate failed: {failure.get('rule')} on {where}: {failure.get('evidence')}"


def decide(node: str, failures: list[Failure], units: list[Unit], marker: dict[str, Any] | None) -> Plan:
    """The run's plan from the gate's failures (empty: the node passes), the replica units and the marker."""
    recorded = [name for name in (marker or {}).get("stopped") or [] if _UNIT_NAME.match(str(name))]
    if failures:
        stop = sorted(u.name for u in units if u.active in STOPPABLE)
        kept = sorted(set(recorded) | {u.name for u in units if u.active in MEANT_TO_RUN})
        lines = [] if marker is not None and marker.get("failures") == failures else \
            [failure_line(node, f) for f in failures]
        if stop:
            lines.append(f"{node}: stopping {', '.join(stop)} until the node passes its GPU health gate again")
        return Plan(stop=stop, marker={"node": node, "failures": failures, "stopped": kept}, log=lines)
    if marker is None:
        return Plan()
    states = {u.name: u for u in units}
    start = [name for name in recorded if name in states and states[name].file_state in ENABLED]
    plan = Plan(reset=[name for name in start if states[name].active == "failed"], start=start)
    plan.log.append(f"{node}: passes its GPU health gate again; starting {', '.join(start) or 'nothing'}")
    skipped = [name for name in recorded if name not in start]
    if skipped:
        plan.log.append(f"{node}: not starting {', '.join(skipped)}: disabled or removed since it was stopped")
    return plan


def judge(policy: str, timeout: float = PROBE_TIMEOUT_S, probe: Path = PROBE) -> tuple[str | None, list[Failure],
                                                                                   list[dict[str, Any]]]:
    """The gate's verdict on this node: (hostname, failures, the GPUs' sample), failures empty when it passes; the
    sample (health_rules.link_sample) is what the node watch follows over time."""
    argv = [sys.executable, str(probe), "--gate", policy, "--json"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, [{"rule": "probe", "gpu": None,
                       "evidence": f"the GPU probe gave no verdict within {timeout:g} s (NVML can hang on a lost GPU)"}
                      ], []
    if done.returncode not in (0, 1):
        raise Unjudged(2 if done.returncode == 2 else 1, f"the GPU gate gave no verdict (exit {done.returncode}): "
                                                         f"{_tail(done.stderr)}")
    try:
        verdict = json.loads(done.stdout)
        failures = list(verdict["failures"])
    except (ValueError, KeyError, TypeError):
        raise Unjudged(1, f"the GPU gate printed no verdict: {_tail(done.stdout + done.stderr)}") from None
    if bool(failures) != (done.returncode == 1):
        raise Unjudged(1, f"the GPU gate's exit status {done.returncode} contradicts its verdict")
    sample = verdict.get("sample")
    return verdict.get("hostname"), failures, sample if isinstance(sample, list) else []


def keep_sample(path: Path, sample: list[dict[str, Any]], now: float, kept: int = SAMPLES_KEPT) -> None:
    """Add this run's sample to the last ``kept`` (a JSON list, replaced in one rename, root 0644): the node watch
    reads them for its trends (findings.Trends). One that cannot be read starts a new list."""
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        found = []
    samples = [s for s in found if isinstance(s, dict)] if isinstance(found, list) else []
    write_marker(path, [*samples[-(kept - 1):], {"at": round(now, 1), "gpus": sample}])


def _tail(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1][:300] if lines else "no output"


def _run(argv: list[str]) -> tuple[int, str, str]:
    done = subprocess.run(argv, capture_output=True, text=True)
    return done.returncode, done.stdout, done.stderr


class Systemctl:
    """The replica units through ``systemctl`` (``run``: the node's own, or a test's fake)."""

    def __init__(self, run: Runner = _run) -> None:
        self.run = run

    def units(self, also: list[str]) -> list[Unit]:
        """Every loaded replica unit and the units in ``also``, with their states."""
        status, out, err = self.run(["systemctl", "list-units", "--all", "--plain", "--no-legend", "--no-pager",
                                     "--type=service", WATCHED])
        if status != 0:
            raise Unjudged(1, f"systemctl list-units: {_tail(err)}")
        listed = {word for line in out.splitlines() for word in line.split()[:2]}  # a state bullet may come first
        names = sorted(name for name in listed | set(also) if _UNIT_NAME.match(name))
        if not names:
            return []
        status, out, err = self.run(["systemctl", "show", "--property=Id,ActiveState,UnitFileState", "--", *names])
        if status != 0:
            raise Unjudged(1, f"systemctl show: {_tail(err)}")
        found = []
        for block in out.strip().split("\n\n"):
            values = dict(line.split("=", 1) for line in block.splitlines() if "=" in line)
            if values.get("Id"):
                found.append(Unit(values["Id"], values.get("ActiveState", ""), values.get("UnitFileState", "")))
        return found

    def call(self, verb: str, units: list[str]) -> str | None:
        """``systemctl VERB -- UNITS``, a start or stop queued and not awaited (a hung GPU must not hang the
        watch); the error, or None."""
        queued = ["--no-block"] if verb in ("start", "stop") else []
        status, _, err = self.run(["systemctl", verb, *queued, "--", *units])
        return None if status == 0 else f"systemctl {verb} {' '.join(units)}: {_tail(err)}"


def read_marker(path: Path) -> dict[str, Any] | None:
    """The marker's record; None without one (one that cannot be read records no unit)."""
    try:
        found = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log(f"{path}: unreadable ({exc}); it records no unit")
        return {"stopped": []}
    return found if isinstance(found, dict) else {"stopped": []}


def write_marker(path: Path, record: Any) -> None:
    """Replace the marker (or the samples) in one rename, root 0644 (no secret in it)."""
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps(record, indent=2) + "\n")
    os.chmod(temporary, 0o644)
    os.replace(temporary, path)


def apply(node: str, failures: list[Failure], systemctl: Systemctl, marker_path: Path) -> int:
    """Act on the gate's failures: see the module docstring. Exit status 0, or 1 when systemctl refused a step."""
    marker = read_marker(marker_path)
    plan = decide(node, failures, systemctl.units((marker or {}).get("stopped") or []), marker)
    for line in plan.log:
        log(line)
    errors = []
    if plan.marker is not None and plan.marker != marker:  # first: a run cut short still knows what to start
        write_marker(marker_path, plan.marker)
    for verb, units in (("stop", plan.stop), ("reset-failed", plan.reset), ("start", plan.start)):
        error = systemctl.call(verb, units) if units else None
        if error:
            errors.append(error)
    if plan.marker is None and marker is not None:
        marker_path.unlink()
    for error in errors:
        log(f"{node}: {error}")
    return 1 if errors else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_watch.py", description="Stop this node's vLLM replicas while its GPUs"
                                     " fail the health gate; start them again once they pass.")
    parser.add_argument("--policy", required=True, help="the gpu_health policy JSON the units' gate reads")
    parser.add_argument("--marker", required=True, help="present while the node fails: the rules, the units stopped")
    parser.add_argument("--probe-timeout", type=float, default=PROBE_TIMEOUT_S, help="seconds the probe may take")
    parser.add_argument("--samples", help="where the last GPU samples are kept for the node watch's trends")
    args = parser.parse_args(argv)
    try:
        hostname, failures, sample = judge(args.policy, args.probe_timeout)
        if args.samples and sample:
            keep_sample(Path(args.samples), sample, time.time())
        node = os.environ.get("GPUFLEET_NODE") or hostname or socket.gethostname()
        return apply(node, failures, Systemctl(), Path(args.marker))
    except Unjudged as exc:
        log(f"{os.environ.get('GPUFLEET_NODE') or socket.gethostname()}: changing nothing: {exc}")
        return exc.status


if __name__ == "__main__":
    sys.exit(main())
