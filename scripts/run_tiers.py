"""Run the test tiers as ``make test`` and ``make test-fast`` do, and end with the run's time budget.

``make test``: lint (ruff, mypy) beside the lab tier's start, then the unit and tools tiers, at low CPU priority,
once the lab reaches its first test that mostly waits on timers (marked ``waits``; or once the lab tier ended):
they fill the lab's waits instead of slowing its boot and first deploy, which keep both cores busy. Low priority
is a session of their own whose share of the CPUs is lowered (Linux's autogroup): the scheduler shares the CPUs
between sessions before it looks at a process's nice, and every vLLM on the lab's nodes is a service, so a
session of its own; a plain ``nice`` would leave the two tiers' workers as large a share as each vLLM. The lab tier's
output streams as it runs; the other tiers' is printed when both are done. ``--fast``: lint, then the unit and
tools tiers alone.

The output ends with each tier's wall time, the 25 slowest tests of the run, each failed test with the first
lines of why, and one line of counts; the exit status is 0 only when every tier passed. A copy of each tier's
JUnit report (every test's time and failure) stays in build/test-reports/, replaced by the next run's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
REPORTS = ROOT / "build" / "test-reports"  # a copy of the last run's JUnit reports
SLOWEST = 25
WAITS_POLL_S = 1.0
WHY_LINES = 6  # of each failed test's message, repeated at the end of the output
# The share of the CPUs the tiers beside the lab get, as a nice value of their session (scheduler weight 335 against
# 1024 for each of the lab's vLLMs): they take little from a vLLM starting while the cores are busy, all the cores
# left idle, and never so little that a test waiting on its own daemon times out.
AUTOGROUP_NICE = 5


@dataclass(frozen=True)
class Case:
    """One test of a JUnit report: its id, seconds, outcome, and why it failed (empty unless it did)."""

    name: str
    seconds: float
    outcome: str
    why: str = ""


@dataclass
class Tier:
    """One tier's commands, run in order until one fails; its wall time and its JUnit report."""

    name: str
    commands: list[list[str]]
    report: Path | None = None
    seconds: float = 0.0
    began: float = 0.0  # monotonic clock when its commands started
    status: int = 0
    output: list[str] = field(default_factory=list)
    yields: bool = False  # low CPU priority: a session of its own at a lower share (AUTOGROUP_NICE), and nice

    def run(self, stream: bool, after: Callable[[], bool] = lambda: True) -> None:
        """Run the commands (once ``after`` holds: polled every WAITS_POLL_S, not counted in the tier's time)."""
        while not after():
            time.sleep(WAITS_POLL_S)
        started = self.began = time.monotonic()
        for argv in self.commands:
            returncode, out = self._one(argv, stream)
            if not stream:
                self.output.append(f"$ {' '.join(argv)}\n{out}")
            # pytest's 5: no test collected (a tier with nothing selected), not a failure
            if returncode not in (0, 5):
                self.status = returncode
                break
        self.seconds = time.monotonic() - started

    def _one(self, argv: list[str], stream: bool) -> tuple[int, str]:
        """One command's exit status and (unless streamed) its output; a tier that yields takes its session down
        with it when this run is interrupted."""
        if self.yields:
            argv = ["nice", "-n", "10", *argv]  # what lowers it where the kernel groups no sessions
        with subprocess.Popen(argv, cwd=ROOT, start_new_session=self.yields, text=True,
                              stdout=None if stream else subprocess.PIPE,
                              stderr=None if stream else subprocess.STDOUT) as process:
            if self.yields:
                lower_autogroup(process.pid)
            try:
                out, _ = process.communicate()
            except BaseException:
                if self.yields:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(process.pid, signal.SIGTERM)
                raise
        return process.returncode, out or ""


def lower_autogroup(pid: int, nice: int = AUTOGROUP_NICE) -> None:
    """Give the session ``pid`` leads a lower share of the CPUs, its processes and those they start alike (nothing
    where the kernel does not group sessions: the tier's plain ``nice`` is then what lowers it)."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/autogroup").write_text(f"{nice}\n")


def pytest_argv(report: Path, *paths: str) -> list[str]:
    return [str(BIN / "pytest"), "-q", f"--junitxml={report}", "-o", "junit_logging=no", *paths]


def cases(report: Path | None) -> list[Case]:
    """Each test of a JUnit report."""
    if report is None or not report.exists():
        return []
    found = []
    for case in ET.parse(report).iter("testcase"):
        outcome, why = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, why = "failed", why or child.get("message") or (child.text or "").strip()
            elif child.tag == "skipped" and outcome == "passed":
                outcome = "skipped"
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        found.append(Case(name, float(case.get("time") or 0.0), outcome, why))
    return found


def keep_reports(tiers: list[Tier]) -> None:
    """Copy each tier's JUnit report to :data:`REPORTS`, where it replaces the last run's (nothing when that
    folder cannot be written: a run as another user than the last)."""
    with contextlib.suppress(OSError):
        REPORTS.mkdir(parents=True, exist_ok=True)
        for tier in tiers:
            if tier.report is not None and tier.report.exists():
                shutil.copyfile(tier.report, REPORTS / tier.report.name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fast", action="store_true", help="lint, unit and tools tiers only (no root needed)")
    parser.add_argument("--workers", default="0", help="pytest-xdist workers for the unit and tools tiers")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpufleet-tiers-") as scratch:  # this run's own: removed at its end
        return run_all(args, Path(scratch))


def run_all(args: argparse.Namespace, scratch: Path) -> int:
    # loadgroup: tests that share a costly module fixture (a group, e.g. the lab mirror's built cache) stay on one
    # worker, which builds it once; the others spread as usual
    workers = ["-n", args.workers, "--dist", "loadgroup"] if args.workers != "0" else []
    lint = Tier("lint", [[str(BIN / "ruff"), "check", "."], [str(BIN / "mypy")]])
    fast = Tier("unit+tools", [pytest_argv(scratch / "fast.xml", "tests/unit", "tests/tools", *workers)],
                report=scratch / "fast.xml")
    waits = scratch / "lab-waits"  # the lab tier touches it (tests/lab/conftest.py: --waits-signal)
    lab = Tier("lab", [pytest_argv(scratch / "lab.xml", "tests/lab", f"--waits-signal={waits}")],
               report=scratch / "lab.xml")
    lab_done = threading.Event()
    started = time.monotonic()
    if args.fast:
        lint.run(stream=True)
        if lint.status == 0:
            fast.run(stream=True)
        tiers = [lint, fast]
    else:
        lint.yields = fast.yields = True  # at low CPU priority: the lab's vLLMs keep the cores they need

        def lint_then_fast() -> None:
            lint.run(stream=False)
            if lint.status == 0:
                fast.run(stream=False, after=lambda: waits.exists() or lab_done.is_set())

        beside = threading.Thread(target=lint_then_fast)
        beside.start()
        try:
            lab.run(stream=True)
        finally:
            lab_done.set()
        beside.join()
        print("".join(lint.output + fast.output), end="", flush=True)
        tiers = [lint, fast, lab]
    total = time.monotonic() - started
    every = [case for tier in tiers for case in cases(tier.report)]
    print(f"\n== the run's time budget (this machine: {os.cpu_count()} cores) ==")
    for tier in tiers:
        verdict = "passed" if tier.status == 0 else f"FAILED (exit {tier.status})"
        print(f"{tier.name:>11}: {tier.seconds:7.1f} s  {verdict}")
    print(f"{'wall':>11}: {total:7.1f} s" + ("" if args.fast else " (lint and unit+tools beside the lab)"))
    if not args.fast and fast.began:
        print(f"{'':>11}  unit+tools started {fast.began - started:.0f} s into the lab tier")
    print(f"\n{SLOWEST} slowest tests:")
    for case in sorted(every, key=lambda case: -case.seconds)[:SLOWEST]:
        print(f"{case.seconds:8.1f} s  {case.name}")
    failed = [case for case in every if case.outcome == "failed"]
    if failed:
        print("\nfailed, and why:")
    for case in failed:
        print(f"FAILED {case.name}")
        for line in case.why.splitlines()[:WHY_LINES]:
            print(f"    {line[:300]}")
    counts = {outcome: sum(1 for case in every if case.outcome == outcome)
              for outcome in ("passed", "failed", "skipped")}
    # a tier that failed outside its tests (lint, a collection error, a crash) counts as one failure
    counts["failed"] += sum(1 for tier in tiers if tier.status != 0 and not any(
        case.outcome == "failed" for case in cases(tier.report)))
    print(f"\n{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
    keep_reports(tiers)
    return 0 if all(tier.status == 0 for tier in tiers) else 1


if __name__ == "__main__":
    sys.exit(main())
