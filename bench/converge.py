"""Time the full deploy on a private lab: a first converge from bare nodes, then a rerun that should change nothing.

    python bench/converge.py                  # 1, 4 and 8 nodes (one lab each, brought up and down in turn)
    python bench/converge.py --nodes 1        # one node
    python bench/converge.py --nodes 4 --keep --log-dir /tmp/converge-logs

Prints JSON. For each node count it boots its own lab (its own lab directory under a temp dir, its own bridge
``gflabb<k>`` and subnet ``10.213.<k>.0/24``, k the first free one in 150..199), runs
``pyinfra -y -vv --json inventories/lab/inventory.py deploys/vllm.py`` against it: a first converge, then (once the
machine's load has settled below its core count, at most 5 minutes) three reruns, reported by their median; and
takes the lab down (always; ``--keep`` leaves it up). Per run: wall seconds, the controller's CPU seconds (the
pyinfra process; the lab's nodes share this machine's cores with it), pyinfra's exit status, operations per host
that changed, did not change and failed, and the shell commands pyinfra ran per host. Needs root.

How the numbers are read from pyinfra 3.10:

- operations: ``--json`` prints the deploy's results on stdout (one line), per operation the hosts where it
  changed something (``success``: it ran commands), did nothing (``no_change``) or failed (``error``). When a
  run aborts before its results (every host failed: "No hosts remaining!") the ``[host] Success`` /
  ``No changes`` / ``Error: executed N commands`` lines of the log are counted instead (``ops_source``).
- commands: ``-vv`` makes pyinfra echo each shell command it runs as ``[host] >>> command`` on stderr, facts'
  commands included. Counted per host, split at ``--> Beginning operation run...``: ``prepare`` is what the
  deploy file's own code read while adding operations (the fleet's probe); ``execute`` is the operations'
  commands and the facts they read (with ``-y`` pyinfra skips change detection, so operations read their facts
  only as they run). SFTP uploads (files.put, files.template without sudo) run no shell command and are not
  counted: pyinfra logs no host for them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gpufleet_lab import network, nodes
from gpufleet_lab.errors import LabError
from gpufleet_lab.state import LAB_DIR_ENV

ROOT = Path(__file__).resolve().parents[1]
PYINFRA = Path(sys.executable).parent / "pyinfra"
INVENTORY = "inventories/lab/inventory.py"
DEPLOY = "deploys/vllm.py"
PYINFRA_ARGS = ["-y", "-vv", "--json"]
BRIDGE_PREFIX = "gflabb"
THIRD_OCTETS = range(150, 200)
TAIL_LINES = 25
RERUNS = 3  # no-change reruns after the first converge; the report's "rerun" is their median
SETTLE_LIMIT_S = 300

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# A line pyinfra prefixes with its host: "[10.213.150.11] ..." (a nested operation's: "[host] nested ...");
# log records come indented by four spaces, echoed commands do not.
_HOST_LINE = re.compile(r"^\s*\[(?P<host>[^\]\s]+)\]\s+(?:nested\s+)?(?P<rest>.*)$")
_EXECUTE_MARKER = "--> Beginning operation run"
_START_OP = re.compile(r"^\s*--> Starting (?:.* )?operation: (?P<name>.*)$")
_OP_ERROR = re.compile(r"^Error(?: \(ignored[^)]*\))?: executed \d+ commands")


def strip_ansi(text: str) -> str:
    """``text`` without terminal colour codes (pyinfra colours its log when it thinks it may)."""
    return _ANSI.sub("", text)


def host_lines(log: str) -> Iterator[tuple[str, str]]:
    """``(host, rest)`` for each line of a pyinfra log that starts with a ``[host]`` prefix."""
    for line in strip_ansi(log).splitlines():
        match = _HOST_LINE.match(line)
        if match:
            yield match["host"], match["rest"].strip()


def count_commands(log: str) -> dict[str, dict[str, int]]:
    """Shell commands per host in a ``pyinfra -vv`` log (stderr), by phase.

    ``-vv`` echoes each command as ``[host] >>> command``. Commands before ``--> Beginning operation run...``
    are ``prepare`` (facts read to plan), the rest ``execute``. A command spanning lines counts once: its
    continuation lines carry no prefix. Returns ``{host: {"prepare": n, "execute": m, "total": n + m}}``.
    """
    counts: dict[str, Counter[str]] = {}
    phase = "prepare"
    for raw in strip_ansi(log).splitlines():
        if raw.lstrip().startswith(_EXECUTE_MARKER):
            phase = "execute"
            continue
        match = _HOST_LINE.match(raw)
        if match and match["rest"].startswith(">>> "):
            counts.setdefault(match["host"], Counter())[phase] += 1
    return {host: {"prepare": c["prepare"], "execute": c["execute"], "total": c["prepare"] + c["execute"]}
            for host, c in sorted(counts.items())}


def results_json(stdout: str) -> dict[str, Any] | None:
    """The ``results`` object pyinfra ``--json`` printed on stdout (the last JSON line), or None."""
    for line in reversed(stdout.strip().splitlines()):
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            payload = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(payload, dict) and isinstance(payload.get("results"), dict):
            return payload["results"]
    return None


def ops_from_results(results: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Operations per host from pyinfra's ``--json`` results: ``{host: {"changed", "unchanged", "error"}}``.

    pyinfra counts an operation as changed on a host (``success``) when it ran commands there.
    """
    per_host: dict[str, Counter[str]] = {}
    for op in results.get("operations", []):
        for key, outcome in (("success", "changed"), ("no_change", "unchanged"), ("error", "error")):
            for host in op.get(key, []):
                per_host.setdefault(host, Counter())[outcome] += 1
    return {host: {k: c[k] for k in ("changed", "unchanged", "error")} for host, c in sorted(per_host.items())}


def ops_from_log(log: str) -> dict[str, dict[str, int]]:
    """Operations per host from the status line pyinfra logs after each one (when there is no ``--json`` result).

    ``[host] Success`` (or ``Success on retry N``) is changed, ``[host] No changes`` unchanged,
    ``[host] Error: executed N commands`` (ignored or not) an error; a nested operation's line counts too.
    """
    per_host: dict[str, Counter[str]] = {}
    for host, rest in host_lines(log):
        if rest.startswith("Success"):
            outcome = "changed"
        elif rest.startswith("No changes"):
            outcome = "unchanged"
        elif _OP_ERROR.match(rest):
            outcome = "error"
        else:
            continue
        per_host.setdefault(host, Counter())[outcome] += 1
    return {host: {k: c[k] for k in ("changed", "unchanged", "error")} for host, c in sorted(per_host.items())}


def failed_operations(log: str, results: dict[str, Any] | None) -> list[dict[str, Any]]:
    """``[{"host", "operation", "output"}]`` for each operation that failed.

    The operation is the one started last before a host's ``Error: executed N commands`` line; ``output`` is
    what that host printed after its last command (pyinfra prints a failed command's stdout and stderr), at
    most ten lines. With ``--json`` results, failures they list but the log does not show are added without
    output.
    """
    failed: list[dict[str, Any]] = []
    current = ""
    since_command: dict[str, list[str]] = {}
    for line in strip_ansi(log).splitlines():
        start = _START_OP.match(line)
        if start:
            current = start["name"].strip()
            continue
        match = _HOST_LINE.match(line)
        if not match:
            continue
        host, rest = match["host"], match["rest"].strip()
        if rest.startswith(">>> "):
            since_command[host] = []
        elif _OP_ERROR.match(rest):
            failed.append({"host": host, "operation": current, "output": since_command.get(host, [])[-10:]})
            since_command[host] = []
        elif not rest.startswith(("Loaded fact", "Success", "No changes")):
            since_command.setdefault(host, []).append(rest)
    if results is not None:
        seen = {(f["host"], f["operation"]) for f in failed}
        failed += [{"host": host, "operation": str(op.get("name", "")), "output": []}
                   for op in results.get("operations", []) for host in op.get("error", [])
                   if (host, str(op.get("name", ""))) not in seen]
    return failed


def log_tail(log: str, lines: int = TAIL_LINES) -> list[str]:
    """The last ``lines`` non-empty lines of a log, colour codes removed."""
    return [line.rstrip() for line in strip_ansi(log).splitlines() if line.strip()][-lines:]


def summarize_run(rc: int | None, seconds: float, stdout: str, stderr: str) -> dict[str, Any]:
    """One pyinfra run's report from its exit status, wall time and output."""
    results = results_json(stdout)
    ops = ops_from_results(results) if results is not None else ops_from_log(stderr)
    commands = count_commands(stderr)
    report: dict[str, Any] = {
        "seconds": round(seconds, 1),
        "rc": rc,
        "commands_per_host": {host: c["total"] for host, c in commands.items()},
        "commands_by_phase_per_host": {host: {"prepare": c["prepare"], "execute": c["execute"]}
                                       for host, c in commands.items()},
        "changed_ops_per_host": {host: o["changed"] for host, o in ops.items()},
        "unchanged_ops_per_host": {host: o["unchanged"] for host, o in ops.items()},
        "error_ops_per_host": {host: o["error"] for host, o in ops.items()},
        "ops_source": "json" if results is not None else "log",
    }
    if rc != 0:
        report["failed_operations"] = failed_operations(stderr, results)
        report["stderr_tail"] = log_tail(stderr)
    return report


def machine() -> dict[str, Any]:
    """This machine's cores and memory (the lab's nodes share them)."""
    memory_kib = 0
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemTotal:"):
                memory_kib = int(line.split()[1])
    return {"cores": os.cpu_count(), "memory_gib": round(memory_kib / 2**20, 1)}


def candidates() -> Iterator[tuple[str, str]]:
    """``(bridge, subnet)`` pairs to try, from a pid-chosen start in 150..199 so two benches rarely collide."""
    start = os.getpid() % len(THIRD_OCTETS)
    for i in range(len(THIRD_OCTETS)):
        k = THIRD_OCTETS[(start + i) % len(THIRD_OCTETS)]
        bridge = f"{BRIDGE_PREFIX}{k}"
        if not network.link_exists(bridge):
            yield bridge, f"10.213.{k}.0/24"


def boot_lab(count: int, directory: Path) -> tuple[str, str]:
    """Bring up a ``count``-node lab in ``directory`` on the first free bridge and subnet; ``(bridge, subnet)``."""
    last = "no bridge gflabb150..199 is free"
    for bridge, subnet in candidates():
        try:
            nodes.up(count, None, subnet, bridge=bridge, base=directory)
            return bridge, subnet
        except LabError as exc:
            last = str(exc)
            if "already exists" not in last and "overlaps" not in last:
                raise
    raise LabError(f"no free bridge and subnet for the bench lab: {last}")


def run_pyinfra(directory: Path, timeout: float, log_path: Path | None) -> dict[str, Any]:
    """Run the full deploy once against the lab in ``directory`` and summarize it."""
    env = {**os.environ, LAB_DIR_ENV: str(directory)}
    argv = [str(PYINFRA), *PYINFRA_ARGS, INVENTORY, DEPLOY]
    load = os.getloadavg()[0]
    cpu_before = _children_cpu()
    started = time.monotonic()
    try:
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        rc: int | None = done.returncode
        stdout, stderr = done.stdout, done.stderr
    except subprocess.TimeoutExpired as exc:
        rc = None
        stdout = _text(exc.stdout)
        stderr = _text(exc.stderr) + f"\nbench: pyinfra killed after {timeout:.0f} s\n"
    seconds = time.monotonic() - started
    controller_cpu = _children_cpu() - cpu_before
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text(stderr)
        log_path.with_suffix(".json").write_text(stdout)
    report = summarize_run(rc, seconds, stdout, stderr)
    report["load_before"] = round(load, 2)
    report["controller_cpu_s"] = round(controller_cpu, 2)
    if rc is None:
        report["timed_out"] = True
    return report


def settle(limit: float = SETTLE_LIMIT_S) -> float:
    """Wait until the 1-minute load is below the core count (the replicas the first converge started have
    finished loading their models), at most ``limit`` seconds; the seconds waited."""
    started = time.monotonic()
    while os.getloadavg()[0] >= (os.cpu_count() or 1) and time.monotonic() - started < limit:
        time.sleep(5)
    return round(time.monotonic() - started, 1)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


def measure(count: int, timeout: float, keep: bool, log_dir: Path | None) -> dict[str, Any]:
    """Boot a private ``count``-node lab, converge it twice, take it down (unless ``keep``)."""
    directory = Path(tempfile.mkdtemp(prefix=f"gpufleet-converge-{count}-"))
    report: dict[str, Any] = {"nodes": count}
    booted = False
    try:
        started = time.monotonic()
        bridge, subnet = boot_lab(count, directory)
        booted = True
        report.update(bridge=bridge, subnet=subnet, lab_up_s=round(time.monotonic() - started, 1))
        logs = log_dir / f"nodes{count}" if log_dir else None
        report["first"] = run_pyinfra(directory, timeout, logs / "first.log" if logs else None)
        if report["first"]["rc"] == 0:
            report["settle_s"] = settle()
            reruns = [run_pyinfra(directory, timeout, logs / f"rerun{i}.log" if logs else None)
                      for i in range(1, RERUNS + 1)]
            report["rerun"] = sorted(reruns, key=lambda r: r["seconds"])[len(reruns) // 2]  # the median
            report["rerun_seconds"] = [r["seconds"] for r in reruns]
        else:
            report["rerun"] = None
            report["rerun_skipped"] = "the first converge failed"
    finally:
        if keep and booted:
            report["lab_dir"] = str(directory)
        else:
            started = time.monotonic()
            nodes.down(directory)
            if booted:
                report["lab_down_s"] = round(time.monotonic() - started, 1)
            shutil.rmtree(directory, ignore_errors=True)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, action="append", help="node count (repeatable; default 1, 4, 8)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds one pyinfra run may take (default 3600)")
    parser.add_argument("--keep", action="store_true", help="leave each lab up (its directory is in the JSON)")
    parser.add_argument("--log-dir", type=Path, help="keep each run's pyinfra log (stderr) and --json output here")
    args = parser.parse_args(argv)
    report: dict[str, Any] = {"benchmark": "converge", "machine": machine(), "pyinfra_args": PYINFRA_ARGS,
                              "runs": []}
    try:
        for count in args.nodes or [1, 4, 8]:
            report["runs"].append(measure(count, args.timeout, args.keep, args.log_dir))
    except LabError as exc:
        print(f"converge: {exc}", file=sys.stderr)
        print(json.dumps(report, indent=2))
        return 1
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
