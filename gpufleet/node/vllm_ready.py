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


def check_once(url: str, model: str, key: str | None) -> tuple[bool, str]:
    """One readiness attempt: (ready, what was seen)."""
    try:
        status, _ = request(f"{url}/health", None, None, 10)
    except (OSError, urllib.error.URLError, http.client.HTTPException) as exc:
        return False, f"not answering: {exc}"
    if status != 200:
        return False, f"/health answered {status}"
    _, tokens, seen = completion(url, model, key)
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


def write_json(path: str, doc: dict[str, Any]) -> None:
    """Replace ``path`` whole with ``doc`` (0644): written to a new file beside it, then renamed over it."""
    directory, name = os.path.split(os.path.abspath(path))
    handle, temporary = tempfile.mkstemp(prefix=f".{name}.", dir=directory)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            os.fchmod(out.fileno(), 0o644)
            out.write(json.dumps(doc, indent=2) + "\n")
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def _record(args: argparse.Namespace, since: float) -> dict[str, Any]:
    """Observe vLLM's KV cache, write it to ``--observed``, and say what the JSON line adds."""
    doc = observe(args.url.rstrip("/"), args.unit, since, args.planned_kv_tokens, args.max_model_len, args.tolerance)
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
    args = parser.parse_args(argv)
    key = read_env_file(args.env_file).get("VLLM_API_KEY") if args.env_file else None
    started, since = time.monotonic(), time.time()
    recorded = record_time(args.restart_record)
    first_restarts = unit_state(args.unit)[1] if args.unit else 0
    seen = "not tried"
    while True:
        ready, seen = check_once(args.url.rstrip("/"), args.model, key)
        waited = round(time.monotonic() - started, 1)
        if ready:
            observed = _record(args, since) if args.observed else {}
            print(json.dumps({"ready": True, "url": args.url, "seconds": waited, "seen": seen, **observed}))
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
