#!/usr/bin/env python3
"""Is a vLLM replica ready? ``/health`` answers 200 and one real completion returns tokens.

Runs on the node (standard library only) as root, after the deploy started the replica::

    python3 vllm_ready.py --url http://10.0.0.5:8000 --model NAME [--unit vllm@r.service]
                          [--restart-record /etc/gpufleet/vllm/r/restart-pending]
                          [--env-file SECRETS.env] [--timeout 900] [--max-restarts 3]
                          [--observed observed.json --planned-kv-tokens N --max-model-len N --tolerance 0.05]

The API key, when the replica has one, is read from its 0600 environment file, never from argv.
Prints one JSON line; exit 0 when ready, 1 when not within the timeout, or as soon as ``--unit`` has failed
(systemd gave up restarting it), has been restarted ``--max-restarts`` times while this waited, or its journal
says vLLM's engine did not start for a configuration error (a ``ValueError``: memory it cannot get, a length the
model does not have; the same start fails again): a release that cannot start is named in minutes, not after the
whole timeout. (A multi-node replica's rank 0 says so whichever rank failed, and replica_rank.py restarts them
all, so one bad start can take minutes there; engine failures of other kinds are left to the restarts.) With
``--restart-record`` (the record the deploy touched before it stopped the replica), a start that failed so before
the wait began counts too: the journal is read from the first start after the record was written.
``replica_watchdog.py`` makes its requests with :func:`request` and :func:`completion`.

With ``--observed``, once ready it reads what vLLM itself reports of its KV cache: the labels of its
``vllm:cache_config_info`` gauge on ``/metrics`` (``kv_cache_size_tokens`` and ``kv_cache_max_concurrency``, the
figures of its "KV cache size: N tokens" and "Maximum concurrency for N tokens per request" start-up lines, else
``num_gpu_blocks`` x ``block_size`` and that over ``--max-model-len``), or, without the gauge, those lines in the
unit's journal; whether it caches prefixes and with which hash (the gauge's ``enable_prefix_caching`` and
``prefix_caching_hash_algo``: null without the label); and ``/version``. It writes them beside the plan's figure to
that file (0644, replaced whole), and its JSON line gains ``kv_cache_tokens`` (planned, observed, ratio) and a
``warning`` when they differ by more than ``--tolerance``. A replica that reports no figure is still ready. The
controller summarises the comparison with :func:`kv_summary`.

With ``--start-textfile`` (and ``--start-labels``, a JSON object of label values: the replica, its model, release,
layout and GPU profile), once ready it times the start it waited for: seconds from the unit's main process start
(systemd's ``ExecMainStartTimestampMonotonic``) to each of :data:`START_PHASES`: vLLM's weights in place and its KV
cache sized (the times of its last "Loading weights took" or "Model loading took" and "KV cache size" lines in the
unit's journal since that start), ``/health`` answering 200 and the first completion returning tokens (what this
wait saw). A phase not seen since the start is null, never guessed (every one where systemd gives no start). It
writes them for node_exporter's textfile collector to that file (0644, replaced whole:
``gpufleet_replica_start_seconds{phase}`` and ``gpufleet_replica_start_time_seconds``), and its JSON line, and
``observed.json`` with ``--observed``, gain ``start`` (``labels``, ``started``: Unix time, ``phases``).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any


def read_env_file(path: str) -> dict[str, str]:
    """``NAME="value"`` lines of a systemd EnvironmentFile, as gpufleet writes them: inside the quotes a
    backslash escapes ``"``, ``\\``, a backquote or ``$`` and stays before any other character (systemd's rule)."""
    found: dict[str, str] = {}
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            line = line.strip()
            if not line or line.startswith("#") or "=" not in line:
                continue
            name, value = line.split("=", 1)
            if len(value) >= 2 and value[0] == value[-1] == '"':
                value = re.sub(r'\\([\\"`$])', r"\1", value[1:-1])
            found[name.strip()] = value
    return found


def request(url: str, body: dict[str, object] | None, key: str | None, timeout: float) -> tuple[int, bytes]:
    """GET ``url`` (POST ``body`` as JSON): (status, body). Raises OSError (URLError, a timeout) when there is no
    answer, or http.client.HTTPException."""
    data = None if body is None else json.dumps(body).encode()
    outgoing = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
    outgoing.add_header("Content-Type", "application/json")
    if key:
        outgoing.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(outgoing, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def completion(url: str, model: str, key: str | None, max_tokens: int = 4,
               timeout: float = 120) -> tuple[int | None, int, str]:
    """One real completion: (HTTP status, None without an answer; tokens returned; what was seen)."""
    try:
        status, body = request(f"{url}/v1/completions",
                               {"model": model, "prompt": "The fleet is", "max_tokens": max_tokens, "temperature": 0},
                               key, timeout)
    except (OSError, urllib.error.URLError, http.client.HTTPException) as exc:
        return None, 0, f"not answering: {exc}"
    if status != 200:
        return status, 0, f"/v1/completions answered {status}: {body[:200]!r}"
    try:
        tokens = int((json.loads(body).get("usage") or {}).get("completion_tokens") or 0)
    except (ValueError, TypeError, AttributeError):
        return status, 0, f"/v1/completions answered 200 without a usage count: {body[:200]!r}"
    return status, tokens, f"/v1/completions returned {tokens} tokens"


def _unserved_adapters(url: str, adapters: list[str], key: str | None) -> str:
    """What the first of ``adapters`` that answers no completion answered (vLLM loads each on its first request);
    empty when all did."""
    for adapter in adapters:
        status, tokens, seen = completion(url, adapter, key)
        if status != 200 or tokens < 1:
            return f"LoRA adapter {adapter}: {seen}"
    return ""


def check_once(url: str, model: str, key: str | None, seen_at: dict[str, float] | None = None) -> tuple[bool, str]:
    """One readiness attempt: (ready, what was seen). ``seen_at`` gets the time (Unix) ``ready`` since which
    ``/health`` has answered 200 without a break, and ``first_completion`` once a completion returned tokens."""
    seen_at = {} if seen_at is None else seen_at
    try:
        status, _ = request(f"{url}/health", None, None, 10)
    except (OSError, urllib.error.URLError, http.client.HTTPException) as exc:
        seen_at.pop("ready", None)
        return False, f"not answering: {exc}"
    if status != 200:
        seen_at.pop("ready", None)
        return False, f"/health answered {status}"
    seen_at.setdefault("ready", time.time())
    _, tokens, seen = completion(url, model, key)
    if tokens > 0:
        seen_at["first_completion"] = time.time()
    return tokens > 0, seen


def unit_state(unit: str) -> tuple[bool, int]:
    """(the unit has failed, systemd's count of its automatic restarts)."""
    shown = subprocess.run(["systemctl", "show", "--property=ActiveState,NRestarts", unit],
                           capture_output=True, text=True).stdout
    values = dict(line.split("=", 1) for line in shown.splitlines() if "=" in line)
    restarts = values.get("NRestarts", "0")
    return values.get("ActiveState") == "failed", int(restarts) if restarts.isdigit() else 0


ENGINE_FAILED = "EngineCore failed to start"  # what vLLM 0.31 and 0.32 log when their engine did not start
# vLLM raises ValueError where what it is asked cannot work; a worker's or the engine's lines carry their process
CONFIG_ERROR = re.compile(r"^(?:\(\S+ pid=\d+\) )?(?:[A-Z]+ [\d-]+ [\d:.]+ \[\S+\] )?(ValueError: .+)$", re.M)


def unit_journal(unit: str, since: float) -> str:
    """The journal of ``unit`` since ``since`` (epoch seconds), its messages only."""
    return subprocess.run(["journalctl", "-q", "-o", "cat", f"--since=@{int(since)}", "-u", unit],
                          capture_output=True, text=True).stdout


def record_time(path: str | None) -> float | None:
    """When the deploy last touched the replica's restart record (epoch seconds); None without one."""
    try:
        return os.stat(path).st_mtime if path else None
    except OSError:
        return None


def refused_start(unit: str, since: float, recorded: float | None = None) -> str | None:
    """The configuration error of a start of ``unit`` at which vLLM's engine did not start, from the unit's journal:
    its last ``ValueError`` line; None when there is none. The journal is read from ``since`` (epoch seconds), or,
    given ``recorded`` (when the deploy wrote the restart record, before it stopped the replica), from systemd's
    first "Starting UNIT" line after that: what the stopped release logged never counts."""
    if recorded is not None and recorded < since:
        journal = unit_journal(unit, recorded)
        first_start = journal.find(f"Starting {unit}")
        journal = journal[first_start:] if first_start >= 0 else ""  # not started since: nothing to judge yet
    else:
        journal = unit_journal(unit, since)
    if ENGINE_FAILED not in journal:
        return None
    errors = CONFIG_ERROR.findall(journal)
    return errors[-1][:500] if errors else None


CACHE_INFO = "vllm:cache_config_info"  # vLLM's CacheConfig as the labels of a gauge set to 1, one per engine
_SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)\{((?:[^"}]|"(?:[^"\\]|\\.)*")*)\}\s+\S+')
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
# vLLM's start-up lines ("GPU" on CUDA, "CPU" on its CPU build; numbers with thousands separators)
_KV_LINE = re.compile(r"\b[A-Z]+ KV cache size: ([0-9,]+) tokens")
_CONCURRENCY_LINE = re.compile(r"Maximum concurrency for [0-9,]+ tokens per request: ([0-9.]+)x")


def cache_config(text: str) -> dict[str, str] | None:
    """The labels of ``vllm:cache_config_info`` in Prometheus text (engine 0's when there are several); None
    without one."""
    found = []
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and match.group(1) == CACHE_INFO:
            found.append({name: re.sub(r"\\(.)", lambda m: "\n" if m[1] == "n" else m[1], value)
                          for name, value in _LABEL.findall(match.group(2))})
    return min(found, key=lambda labels: labels.get("engine", "")) if found else None


def _number(value: str | None) -> float | None:
    """A label's number (vLLM writes None as ``None``); None when it is none."""
    try:
        found = float((value or "").replace(",", ""))
    except ValueError:
        return None
    return found if math.isfinite(found) and found >= 0 else None


def _whole(value: str | None) -> int | None:
    found = _number(value)
    return int(found) if found is not None and found == int(found) else None


def kv_figures(labels: dict[str, str], max_model_len: int | None) -> dict[str, Any]:
    """KV cache tokens, block size, blocks and maximum concurrency from the labels of ``vllm:cache_config_info``:
    vLLM's own capacity (``kv_cache_size_tokens``, ``kv_cache_max_concurrency``: per engine, as it logs them) where
    it has one, else ``num_gpu_blocks`` x ``block_size`` and that over ``max_model_len``."""
    blocks, block_size = _whole(labels.get("num_gpu_blocks")), _whole(labels.get("block_size"))
    tokens = _whole(labels.get("kv_cache_size_tokens"))
    if tokens is None and blocks is not None and block_size is not None:
        tokens = blocks * block_size
    concurrency = _number(labels.get("kv_cache_max_concurrency"))
    if concurrency is None and tokens is not None and max_model_len:
        concurrency = tokens / max_model_len
    return {"kv_cache_tokens": tokens, "block_size": block_size, "num_blocks": blocks,
            "max_concurrency": None if concurrency is None else round(concurrency, 2)}


def _flag(value: str | None) -> bool | None:
    """A label's bool (vLLM writes Python's ``True`` and ``False``); None when it is neither."""
    return {"true": True, "false": False}.get((value or "").lower())


def prefix_caching(labels: dict[str, str]) -> dict[str, Any]:
    """Whether vLLM caches prefixes and the hash it keys its cached blocks with, from the labels of
    ``vllm:cache_config_info`` (None: a label it lacks)."""
    algo = labels.get("prefix_caching_hash_algo")
    return {"enable_prefix_caching": _flag(labels.get("enable_prefix_caching")),
            "prefix_caching_hash_algo": algo if algo and algo != "None" else None}


def journal_figures(journal: str) -> dict[str, Any]:
    """KV cache tokens and maximum concurrency from vLLM's last start-up lines in ``journal`` (None: no line)."""
    tokens, concurrency = _KV_LINE.findall(journal), _CONCURRENCY_LINE.findall(journal)
    return {"kv_cache_tokens": _whole(tokens[-1]) if tokens else None, "block_size": None, "num_blocks": None,
            "max_concurrency": _number(concurrency[-1]) if concurrency else None}


def kv_summary(planned: int, observed: int | None, tolerance: float) -> tuple[float | None, bool, str]:
    """The plan's KV cache tokens beside vLLM's: (observed / planned, whether they differ by more than
    ``tolerance``, one line saying so)."""
    if observed is None:
        return None, False, f"KV cache planned {planned:,} tokens, vLLM reported no figure"
    ratio = observed / planned if planned > 0 else None
    line = (f"KV cache planned {planned:,} tokens, vLLM reports {observed:,}"
            f" (ratio {'-' if ratio is None else f'{ratio:.3f}'})")
    off = ratio is None or abs(ratio - 1) > tolerance
    if off:
        line += f": more than {tolerance * 100:g}% off the plan (vllm_plan_tolerance)"
    return ratio, off, line


def vllm_version(url: str) -> str | None:
    """What ``/version`` answers; None when it does not."""
    try:
        status, body = request(f"{url}/version", None, None, 10)
        version = json.loads(body).get("version") if status == 200 else None
    except (OSError, http.client.HTTPException, ValueError, AttributeError):
        return None
    return version if isinstance(version, str) else None


def observe(url: str, unit: str | None, since: float, planned: int, max_model_len: int | None,
            tolerance: float) -> dict[str, Any]:
    """What vLLM reports of its KV cache (``/metrics``, else the unit's journal since ``since``) beside the plan, and
    of its prefix caching (``/metrics`` only)."""
    labels = None
    with contextlib.suppress(OSError, http.client.HTTPException):  # no answer: no figure
        status, body = request(f"{url}/metrics", None, None, 10)
        labels = cache_config(body.decode("utf-8", "replace")) if status == 200 else None
    figures = kv_figures(labels or {}, max_model_len)
    source: str | None = CACHE_INFO
    if figures["kv_cache_tokens"] is None and unit:
        with contextlib.suppress(OSError, subprocess.SubprocessError):  # no journal: no figure
            figures, source = journal_figures(unit_journal(unit, since)), "journal"
    if figures["kv_cache_tokens"] is None:
        source = None
    ratio, _, _ = kv_summary(planned, figures["kv_cache_tokens"], tolerance)
    return {**figures, **prefix_caching(labels or {}), "max_model_len": max_model_len,
            "planned_kv_cache_tokens": planned, "ratio": None if ratio is None else round(ratio, 4),
            "tolerance": tolerance, "source": source, "vllm_version": vllm_version(url),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


START_PHASES = ("weights_loaded", "kv_cache_sized", "ready", "first_completion")
"""What a start goes through, in order, each timed in seconds from the unit's main process start."""
START_METRIC = "gpufleet_replica_start_seconds"
START_TIME_METRIC = "gpufleet_replica_start_time_seconds"
# vLLM's model loader logs "Loading weights took 1.23 seconds" (CPU and GPU builds) and its GPU runner "Model loading
# took 14.99 GiB memory and 5.12 seconds" after it: the last of them is when the weights are in place (every worker's)
_WEIGHTS_LINE = re.compile(r"\b(?:Loading weights took|Model loading took) ")


def main_start(unit: str) -> float | None:
    """When the unit's main process started (Unix time), from systemd's monotonic timestamp of it (the clock this
    process's ``time.monotonic`` reads); None when systemd gives none (the unit does not run)."""
    shown = subprocess.run(["systemctl", "show", "--property=ExecMainStartTimestampMonotonic", unit],
                           capture_output=True, text=True).stdout
    value = shown.strip().partition("=")[2]
    if not value.isdigit() or int(value) == 0:
        return None
    return time.time() - (time.monotonic() - int(value) / 1e6)


def parse_journal(text: str) -> list[tuple[float, str]]:
    """Each entry of ``journalctl -o json`` output: its time (Unix) and message (a message journald keeps as bytes,
    not being UTF-8, decoded with replacements); lines that are not entries are left out."""
    found: list[tuple[float, str]] = []
    for line in text.splitlines():
        try:
            doc = json.loads(line)
            at = int(doc["__REALTIME_TIMESTAMP"]) / 1e6
            message = doc.get("MESSAGE")
            if isinstance(message, list):
                message = bytes(message).decode("utf-8", "replace")
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        if isinstance(message, str):
            found.append((at, message))
    return found


def journal_entries(unit: str, since: float) -> list[tuple[float, str]]:
    """The unit's journal since ``since`` (Unix time): each entry's time and message."""
    return parse_journal(subprocess.run(["journalctl", "-q", "-o", "json", "--output-fields=MESSAGE",
                                         f"--since=@{int(since)}", "-u", unit], capture_output=True, text=True).stdout)


def start_phases(started: float | None, entries: list[tuple[float, str]], ready_at: float | None,
                 completed_at: float | None) -> dict[str, float | None]:
    """Seconds from ``started`` (the unit's main process start, Unix time) to each of :data:`START_PHASES`: the last
    weights line and the last KV cache line of ``entries`` (the unit's journal: time, message) since the start, and
    ``ready_at`` (since when ``/health`` answered 200) and ``completed_at`` (the first completion that returned
    tokens). None for a phase not seen since the start (each of them without ``started``)."""
    def after_start(at: float | None) -> float | None:
        return None if started is None or at is None or at < started else round(at - started, 2)

    def last(line: re.Pattern[str]) -> float | None:
        times = [at for at, message in entries if started is not None and at >= started and line.search(message)]
        return max(times) if times else None

    return {"weights_loaded": after_start(last(_WEIGHTS_LINE)), "kv_cache_sized": after_start(last(_KV_LINE)),
            "ready": after_start(ready_at), "first_completion": after_start(completed_at)}


def prometheus_labels(labels: dict[str, str]) -> str:
    """``name="value",...`` as Prometheus's text format writes labels (backslash, double quote and newline escaped)."""
    escaped = {name: value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
               for name, value in labels.items()}
    return ",".join(f'{name}="{value}"' for name, value in escaped.items())


def start_textfile(labels: dict[str, str], started: float | None, phases: dict[str, float | None]) -> str:
    """The start's phases (those known) and its time, for node_exporter's textfile collector."""
    lines = [f"# HELP {START_METRIC} Seconds from the replica's process start to each phase of its last start the"
             " deploy waited for (vllm_ready.py).", f"# TYPE {START_METRIC} gauge"]
    lines += [f"{START_METRIC}{{{prometheus_labels({**labels, 'phase': phase})}}} {value!r}"
              for phase in START_PHASES if (value := phases.get(phase)) is not None]
    lines += [f"# HELP {START_TIME_METRIC} When that start began: its unit's main process start (Unix time).",
              f"# TYPE {START_TIME_METRIC} gauge"]
    if started is not None:
        lines.append(f"{START_TIME_METRIC}{{{prometheus_labels(labels)}}} {started:.3f}")
    return "\n".join(lines) + "\n"


def time_start(unit: str | None, labels: dict[str, str], seen_at: dict[str, float]) -> dict[str, Any]:
    """The start this wait saw through (``seen_at``: :func:`check_once`'s times), timed from ``unit``'s main process
    start and journal: ``labels``, ``started`` (Unix time, None when unknown) and ``phases``."""
    started = main_start(unit) if unit else None
    entries: list[tuple[float, str]] = []
    if unit and started is not None:
        with contextlib.suppress(OSError, subprocess.SubprocessError):  # no journal: no line seen
            entries = journal_entries(unit, started)
    phases = start_phases(started, entries, seen_at.get("ready"), seen_at.get("first_completion"))
    return {"labels": labels, "started": None if started is None else round(started, 3), "phases": phases}


def write_json(path: str, doc: dict[str, Any]) -> None:
    """Replace ``path`` whole with ``doc`` (0644): written to a new file beside it, then renamed over it."""
    write_text(path, json.dumps(doc, indent=2) + "\n")


def write_text(path: str, text: str) -> None:
    """Replace ``path`` whole with ``text`` (0644): written to a new file beside it, then renamed over it (a reader,
    node_exporter's textfile collector among them, never sees half a file)."""
    directory, name = os.path.split(os.path.abspath(path))
    handle, temporary = tempfile.mkstemp(prefix=f".{name}.", dir=directory)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            os.fchmod(out.fileno(), 0o644)
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def _record(args: argparse.Namespace, since: float, start: dict[str, Any] | None) -> dict[str, Any]:
    """Observe vLLM's KV cache, write it (and ``start``, when timed) to ``--observed``, and say what the JSON line
    adds."""
    doc = observe(args.url.rstrip("/"), args.unit, since, args.planned_kv_tokens, args.max_model_len, args.tolerance)
    if start is not None:
        doc["start"] = start
    _, off, line = kv_summary(args.planned_kv_tokens, doc["kv_cache_tokens"], args.tolerance)
    added: dict[str, Any] = {"kv_cache_tokens": {"planned": args.planned_kv_tokens,
                                                 "observed": doc["kv_cache_tokens"], "ratio": doc["ratio"]}}
    try:
        write_json(args.observed, doc)
    except OSError as exc:
        added["warning"] = f"cannot write {args.observed}: {exc}"
    if off:
        added["warning"] = "; ".join(filter(None, [line, added.get("warning")]))
    return added


def _record_start(args: argparse.Namespace, seen_at: dict[str, float]) -> dict[str, Any]:
    """Time the start, write it to ``--start-textfile``, and say what the JSON line adds."""
    start = time_start(args.unit, args.start_labels, seen_at)
    added: dict[str, Any] = {"start": start}
    try:
        write_text(args.start_textfile, start_textfile(start["labels"], start["started"], start["phases"]))
    except OSError as exc:
        added["warning"] = f"cannot write {args.start_textfile}: {exc}"
    return added


def _labels(text: str) -> dict[str, str]:
    """``--start-labels``: a JSON object of text values."""
    try:
        found = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object of labels, found invalid JSON: {exc}") from None
    if not isinstance(found, dict) or not all(isinstance(v, str) for v in found.values()):
        raise argparse.ArgumentTypeError(f"expected a JSON object of text values, found {text!r}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--unit", help="the replica's systemd unit: stop waiting once it has failed")
    parser.add_argument("--restart-record", help="the replica's restart record, touched by the deploy before it"
                        " stopped the replica: a start that failed since then counts")
    parser.add_argument("--env-file")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--max-restarts", type=int, default=3,
                        help="give up once --unit has been restarted this many times while waiting")
    parser.add_argument("--observed", help="once ready, write what vLLM reports of its KV cache to this file")
    parser.add_argument("--planned-kv-tokens", type=int, default=0, help="the plan's KV cache tokens")
    parser.add_argument("--max-model-len", type=int, help="the replica's max_model_len")
    parser.add_argument("--tolerance", type=float, default=0.05,
                        help="warn when vLLM's KV cache tokens differ from the plan's by more than this fraction")
    parser.add_argument("--start-textfile", help="once ready, write the start's phases to this file for"
                        " node_exporter's textfile collector")
    parser.add_argument("--start-labels", type=_labels, default={},
                        help="the labels of the start's series, as a JSON object")
    parser.add_argument("--adapter", action="append", default=[],
                        help="once ready, a LoRA adapter that must answer a completion too (repeatable)")
    args = parser.parse_args(argv)
    key = read_env_file(args.env_file).get("VLLM_API_KEY") if args.env_file else None
    started, since = time.monotonic(), time.time()
    recorded = record_time(args.restart_record)
    first_restarts = unit_state(args.unit)[1] if args.unit else 0
    seen = "not tried"
    seen_at: dict[str, float] = {}
    while True:
        ready, seen = check_once(args.url.rstrip("/"), args.model, key, seen_at)
        waited = round(time.monotonic() - started, 1)
        if ready and (unserved := _unserved_adapters(args.url.rstrip("/"), args.adapter, key)):
            print(json.dumps({"ready": False, "url": args.url, "seconds": round(time.monotonic() - started, 1),
                              "seen": unserved}))
            return 1
        if ready:
            timed = _record_start(args, seen_at) if args.start_textfile else {}
            observed = _record(args, since, timed.get("start")) if args.observed else {}
            line = {"ready": True, "url": args.url, "seconds": waited, "seen": seen, **timed, **observed}
            if warning := "; ".join(filter(None, [observed.get("warning"), timed.get("warning")])):
                line["warning"] = warning
            print(json.dumps(line))
            return 0
        failed, restarts = unit_state(args.unit) if args.unit else (False, first_restarts)
        crashing = restarts - first_restarts >= args.max_restarts
        refused = refused_start(args.unit, since, recorded) if args.unit and not (failed or crashing) else None
        if failed or crashing or refused or waited > args.timeout:
            if failed or crashing or refused:
                why = ("failed" if failed else f"restarted {restarts - first_restarts} times while waiting"
                       if crashing else f"did not start: {refused}")
                seen = f"{args.unit} {why} ({seen}); see journalctl -u {args.unit}"
            print(json.dumps({"ready": False, "url": args.url, "seconds": waited, "seen": seen}))
            return 1
        time.sleep(2)


if __name__ == "__main__":
    sys.exit(main())
