#!/usr/bin/env python3
"""Is a vLLM replica ready? ``/health`` answers 200 and one real completion returns tokens.

Runs on the node (standard library only) as root, after the deploy started the replica::

    python3 vllm_ready.py --url http://10.0.0.5:8000 --model NAME [--unit vllm@r.service]
                          [--env-file SECRETS.env] [--timeout 900] [--max-restarts 3]

The API key, when the replica has one, is read from its 0600 environment file, never from argv.
Prints one JSON line; exit 0 when ready, 1 when not within the timeout, or as soon as ``--unit`` has failed
(systemd gave up restarting it), has been restarted ``--max-restarts`` times while this waited, or its journal
says vLLM's engine did not start for a configuration error (a ``ValueError``: memory it cannot get, a length the
model does not have; the same start fails again): a release that cannot start is named in minutes, not after the
whole timeout. (A multi-node replica's rank 0 says so whichever rank failed, and replica_rank.py restarts them
all, so one bad start can take minutes there; engine failures of other kinds are left to the restarts.)
``replica_watchdog.py`` makes its requests with :func:`request` and :func:`completion`.
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request


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


ENGINE_FAILED = "Engine core initialization failed"  # vLLM's last word when its engine did not start
# vLLM raises ValueError where what it is asked cannot work; a worker's or the engine's lines carry their process
CONFIG_ERROR = re.compile(r"^(?:\(\S+ pid=\d+\) )?(ValueError: .+)$", re.M)


def refused_start(unit: str, since: float) -> str | None:
    """The configuration error of a start of ``unit`` since ``since`` (epoch seconds) at which vLLM's engine did not
    start, from the unit's journal: its last ``ValueError`` line; None when there is none."""
    journal = subprocess.run(["journalctl", "-q", "-o", "cat", f"--since=@{int(since)}", "-u", unit],
                             capture_output=True, text=True).stdout
    if ENGINE_FAILED not in journal:
        return None
    errors = CONFIG_ERROR.findall(journal)
    return errors[-1][:500] if errors else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--unit", help="the replica's systemd unit: stop waiting once it has failed")
    parser.add_argument("--env-file")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--max-restarts", type=int, default=3,
                        help="give up once --unit has been restarted this many times while waiting")
    args = parser.parse_args(argv)
    key = read_env_file(args.env_file).get("VLLM_API_KEY") if args.env_file else None
    started, since = time.monotonic(), time.time()
    first_restarts = unit_state(args.unit)[1] if args.unit else 0
    seen = "not tried"
    while True:
        ready, seen = check_once(args.url.rstrip("/"), args.model, key)
        waited = round(time.monotonic() - started, 1)
        if ready:
            print(json.dumps({"ready": True, "url": args.url, "seconds": waited, "seen": seen}))
            return 0
        failed, restarts = unit_state(args.unit) if args.unit else (False, first_restarts)
        crashing = restarts - first_restarts >= args.max_restarts
        refused = refused_start(args.unit, since) if args.unit and not (failed or crashing) else None
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
