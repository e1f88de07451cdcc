#!/usr/bin/env python3
"""Restart a wedged vLLM replica: one whose unit runs and whose API answers while its engine makes no progress.

Runs on the replica's first node (the one serving its API) as root, standard library only, in
``vllm-watchdog@<replica>.service``, which starts after ``vllm@<replica>.service`` and stops with it::

    python3 replica_watchdog.py WATCHDOG.json   # {"unit", "url", "model", "stall_s", "grace_s", "interval_s"}

Every ``interval_s`` it reads the replica's ``/health`` and ``/metrics``. While ``/health`` answers 200 the
replica is wedged when

- requests are running or waiting and neither ``vllm:generation_tokens_total`` nor
  ``vllm:prompt_tokens_total`` has moved for ``stall_s``; or
- nothing progressed (no token, no request completed) for ``stall_s`` and one real completion of one token,
  given ``stall_s`` to answer, fails (a stopped engine leaves the API answering ``/health``).

It then logs one line, ``restarting <unit>: <why>``, and asks systemd to restart the unit (which restarts this
watchdog too). After a start it judges nothing until the replica serves (``/health`` 200 and one completion),
for at most ``grace_s``; while ``/health`` does not answer 200 it judges nothing. A completion the API refuses
(401, 404: a key or model name that does not match) proves nothing about the engine: it is logged once and the
metrics alone judge. The API key, when the replica has one, is ``VLLM_API_KEY`` in the environment (the
replica's secrets file, read by systemd), never argv.
"""

from __future__ import annotations

import argparse
import http.client
import importlib
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable, Protocol

# The metrics read (vLLM's V1 engine; counters carry _total), each summed over its labels (engines, reasons).
METRICS = {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
           "tokens": "vllm:generation_tokens_total", "prompt": "vllm:prompt_tokens_total",
           "completed": "vllm:request_success_total"}
_SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(\{(?:[^"}]|"(?:[^"\\]|\\.)*")*\})?\s+(\S+)')
# A request a client gave up on is aborted, not finished by the engine: no progress.
_ABORTED = 'finished_reason="abort"'
_UNIT = re.compile(r"^vllm@[A-Za-z0-9_.-]+\.service$")
HTTP_TIMEOUT_S = 10.0  # /health and /metrics
# Answers to a completion that say the request is wrong (key, model name), not that the engine is: no verdict.
REFUSED = (400, 401, 403, 404, 422)

WAIT, OK, PROBE, RESTART = "wait", "ok", "probe", "restart"


def parse_metrics(text: str) -> dict[str, float]:
    """The :data:`METRICS` found in Prometheus text, by their short names, each summed over its labels (aborted
    requests left out)."""
    wanted = {name: key for key, name in METRICS.items()}
    found: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or match.group(1) not in wanted or _ABORTED in (match.group(2) or ""):
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        if value == value:  # not NaN
            key = wanted[match.group(1)]
            found[key] = found.get(key, 0.0) + value
    return found


@dataclass(frozen=True)
class Sample:
    """One look at the replica at time ``at`` (seconds, monotonic)."""

    at: float
    health: int | None  # /health's status; None: no answer
    running: float | None = None  # the metrics; None: not read or not exported
    waiting: float | None = None
    tokens: float | None = None
    prompt: float | None = None
    completed: float | None = None


@dataclass(frozen=True)
class Verdict:
    """What to do now: ``wait`` (not judged), ``ok``, ``probe`` (make one completion, then call ``probed``) or
    ``restart``; and why."""

    action: str
    why: str


class Watchdog:
    """The stall rules over a replica's samples, with the clock given by the caller (no I/O)."""

    def __init__(self, stall_s: float, grace_s: float, now: float) -> None:
        self.stall_s = stall_s
        self.grace_s = grace_s
        self.notes: list[str] = []  # what the caller logs once: the replica serves, a refused completion, ...
        self.started(now)

    def started(self, now: float) -> None:
        """The replica (re)started at ``now``: nothing is judged until it serves, for at most ``grace_s``."""
        self.since = now
        self.serving = False
        self.refused = False
        self.silence_noted = False
        self.counters: dict[str, float] = {}  # tokens, prompt, completed: as last seen
        self.tokens_at = now  # tokens last moved, or the replica last had nothing to do
        self.progress_at = now  # a token or a completion last came out

    def judge(self, sample: Sample) -> Verdict:
        at = sample.at
        if sample.health != 200:
            seen = "no answer" if sample.health is None else f"{sample.health}"
            if self.serving:
                self.notes.append(f"/health: {seen}; not judging until it answers 200 again")
                self.started(at)
            elif at - self.since >= self.grace_s and not self.silence_noted:
                self.silence_noted = True
                self.notes.append(f"/health: {seen} {at - self.since:.0f} s after the start; not judging until it"
                                  " answers 200")
            return Verdict(WAIT, f"/health: {seen}")
        if self._moved("tokens", sample.tokens) | self._moved("prompt", sample.prompt):
            self.tokens_at = self.progress_at = at
        if self._moved("completed", sample.completed):
            self.progress_at = at
        running, waiting = sample.running or 0.0, sample.waiting or 0.0
        if running + waiting <= 0:
            self.tokens_at = at  # the stall clock runs only while there is work
        if not self.serving:
            return Verdict(PROBE, "starting: /health answers 200")
        quiet = at - self.tokens_at
        if quiet >= self.stall_s:
            return Verdict(RESTART, f"{running:g} requests running and {waiting:g} waiting, and no token processed"
                                    f" for {quiet:.0f} s")
        idle = at - self.progress_at
        if idle >= self.stall_s and not self.refused:
            return Verdict(PROBE, f"no token processed and no request completed for {idle:.0f} s")
        return Verdict(OK, "progressing" if idle < self.stall_s else "idle (judged by the metrics alone)")

    def _moved(self, name: str, value: float | None) -> bool:
        """Whether a counter moved since the last sample that had it (a first sighting is no move)."""
        if value is None:
            return False
        last = self.counters.get(name)
        self.counters[name] = value
        return last is not None and last != value

    def probed(self, at: float, status: int | None, tokens: int, seen: str) -> Verdict:
        """The completion a ``probe`` verdict asked for: its HTTP status (None: no answer), tokens, and what was
        seen."""
        refused = status in REFUSED
        if tokens > 0 or refused:
            if refused and not self.refused:
                self.notes.append(f"the watchdog's completion was refused ({seen}); judging by the metrics alone")
            elif not refused and not self.serving:
                self.notes.append(f"serving: /health answers 200, {seen}")
            self.refused = self.refused or refused
            self.serving = True
            self.tokens_at = self.progress_at = at
            return Verdict(OK, seen)
        if not self.serving:
            if at - self.since < self.grace_s:
                return Verdict(WAIT, f"starting: {seen}")
            return Verdict(RESTART, f"/health answers 200 but no completion succeeded in the {at - self.since:.0f} s"
                                    f" since it started: {seen}")
        return Verdict(RESTART, f"/health answers 200 but nothing progressed for {at - self.progress_at:.0f} s and a"
                                f" real completion failed: {seen}")


class Replica(Protocol):
    """What the watchdog reads from the replica and does to it (HTTP and systemctl on a node; fakes in tests)."""

    def health(self) -> int | None: ...

    def metrics(self) -> dict[str, float]: ...

    def complete(self) -> tuple[int | None, int, str]: ...

    def restart(self) -> tuple[bool, str]: ...


def look(replica: Replica, at: float) -> Sample:
    """One sample: ``/health``, and the metrics when it answers 200."""
    health = replica.health()
    found = replica.metrics() if health == 200 else {}
    return Sample(at, health, found.get("running"), found.get("waiting"), found.get("tokens"), found.get("prompt"),
                  found.get("completed"))


def watch(replica: Replica, dog: Watchdog, unit: str, interval_s: float, clock: Callable[[], float],
          sleep: Callable[[float], None], log: Callable[[str], None], rounds: int | None = None) -> None:
    """Judge the replica every ``interval_s`` (forever, or ``rounds`` times) and restart it when wedged."""
    done = 0
    while rounds is None or done < rounds:
        done += 1
        verdict = dog.judge(look(replica, clock()))
        if verdict.action == PROBE:
            status, tokens, seen = replica.complete()
            verdict = dog.probed(clock(), status, tokens, seen)
        for note in dog.notes:
            log(f"{unit}: {note}")
        dog.notes.clear()
        if verdict.action == RESTART:
            log(f"restarting {unit}: {verdict.why}")
            restarted, seen = replica.restart()
            if not restarted:
                log(f"could not restart {unit}: {seen}")
            dog.started(clock())
        sleep(interval_s)


class HttpReplica:
    """The replica on this node: its API over HTTP (``vllm_ready``'s requests) and its unit through systemctl."""

    def __init__(self, ready: ModuleType, url: str, model: str, key: str | None, unit: str, timeout: float) -> None:
        self.ready, self.url, self.model, self.key, self.unit, self.timeout = ready, url, model, key, unit, timeout

    def _get(self, path: str) -> tuple[int, bytes] | None:
        try:
            answer: tuple[int, bytes] = self.ready.request(f"{self.url}{path}", None, None, HTTP_TIMEOUT_S)
        except (OSError, http.client.HTTPException):
            return None
        return answer

    def health(self) -> int | None:
        answer = self._get("/health")
        return None if answer is None else answer[0]

    def metrics(self) -> dict[str, float]:
        answer = self._get("/metrics")
        if answer is None or answer[0] != 200:
            return {}
        return parse_metrics(answer[1].decode("utf-8", "replace"))

    def complete(self) -> tuple[int | None, int, str]:
        found: tuple[int | None, int, str] = self.ready.completion(self.url, self.model, self.key, 1, self.timeout)
        return found

    def restart(self) -> tuple[bool, str]:
        # --no-block: systemd stops this watchdog as part of the restart it queues
        try:
            done = subprocess.run(["systemctl", "restart", "--no-block", self.unit], capture_output=True, text=True,
                                  timeout=60)
        except (OSError, subprocess.SubprocessError) as exc:
            return False, str(exc)
        return done.returncode == 0, (done.stderr or done.stdout).strip() or f"exit status {done.returncode}"


def _vllm_ready() -> ModuleType:
    """``vllm_ready.py`` beside this file: node tools are files, not a package, and ``-I`` leaves their directory
    off the import path."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    return importlib.import_module("vllm_ready")


@dataclass(frozen=True)
class Config:
    """WATCHDOG.json, as the vllm role writes it beside the replica's other files."""

    unit: str  # vllm@<replica>.service
    url: str  # the replica's API on this node
    model: str  # the served model name
    stall_s: float
    grace_s: float
    interval_s: float


def load_config(path: str) -> Config:
    """WATCHDOG.json, checked: exits 2 with one line when it is not what the role writes."""
    try:
        with open(path, encoding="utf-8") as handle:
            found = json.load(handle)
    except (OSError, ValueError) as exc:
        print(f"replica_watchdog: {path}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    doc = found if isinstance(found, dict) else {}
    numbers = ("stall_s", "grace_s", "interval_s")
    problems = [f"{key}: expected a number > 0" for key in numbers
                if isinstance(doc.get(key), bool) or not isinstance(doc.get(key), (int, float)) or doc[key] <= 0]
    problems += [f"{key}: expected text" for key in ("url", "model") if not isinstance(doc.get(key), str)]
    if not isinstance(doc.get("unit"), str) or not _UNIT.match(doc["unit"]):
        problems.append("unit: expected vllm@<replica>.service")
    if problems:
        print(f"replica_watchdog: {path}: {'; '.join(problems)}", file=sys.stderr)
        raise SystemExit(2)
    return Config(doc["unit"], doc["url"].rstrip("/"), doc["model"], *(float(doc[key]) for key in numbers))


def _log(line: str) -> None:
    print(line, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="replica_watchdog.py", description=__doc__.splitlines()[0])
    parser.add_argument("config", help="the replica's watchdog.json")
    config = load_config(parser.parse_args(argv).config)
    replica = HttpReplica(_vllm_ready(), config.url, config.model,
                          os.environ.get("VLLM_API_KEY") or None, config.unit, config.stall_s)
    _log(f"watching {config.unit} at {config.url}: restart after {config.stall_s:g} s without progress,"
         f" {config.grace_s:g} s to serve after a start")
    watch(replica, Watchdog(config.stall_s, config.grace_s, time.monotonic()), config.unit, config.interval_s,
          time.monotonic, time.sleep, _log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
