"""The benchmark client: guidellm (the vLLM project's LLM benchmark, pinned to :data:`VERSION`), run on the
controller from a virtual environment of its own, installed from a hash-pinned lock by ``gpufleet bench-client``
(:mod:`gpufleet.measure.client_env`), one run per step of the ramp.

Each step is one ``guidellm run`` with a scenario file (mode 0600 in a private temporary directory, removed after)
that holds the target, the key and the step: a constant rate for ``step_s`` seconds, bounded by ``rate x step_s``
requests and by a hard stop (:func:`step_bound_s`) for the requests still running. Nothing secret is on its command
line. Requests not answered at the hard stop are not answered (the step's ``offered`` less those answered and
failed). The client's latencies come from guidellm's JSON report over the requests that succeeded: TTFT and
end-to-end per request, ITL as each request's mean time between tokens (the step is judged on vLLM's own histograms
instead: :mod:`gpufleet.measure.ramp`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gpufleet.measure import client_env
from gpufleet.measure.ramp import Step

VERSION = "0.8.1"
"""The guidellm release gpufleet drives (its scenario schema and JSON report are version-specific)."""

CLIENT_ENV = "GPUFLEET_GUIDELLM"
"""An environment variable naming a guidellm executable to use instead of gpufleet's own virtual environment: one
the operator installed and answers for (gpufleet installs nothing for it, and does not check it against its lock)."""

WHEELHOUSE_ENV = "GPUFLEET_BENCH_WHEELHOUSE"
"""A directory of wheels ``gpufleet bench-client`` installs the client from, offline (its ``--wheelhouse``)."""

WORKER_PROCESSES_MAX = 8
"""guidellm's sending processes: half the controller's CPUs, 1 to this many (each imports torch on start; the
async workers of one process keep hundreds of streams open)."""

GRACE_S = 60.0
"""Seconds a step's requests get after its last one is sent before the step stops (unanswered: failed)."""


UNPARSED = "JSONDecodeError("
"""How guidellm's report names an answer it could not read: a streamed chunk whose text holds a character Python
takes for a line break (U+0085, U+2028 and the like, which vLLM sends as they are; its line reader splits the chunk
there). The replica answered: such requests are counted apart (``unparsed``), not as failed."""


REASONS_MAX = 3
"""Distinct failure reasons a step keeps and prints."""

REASON_CHARS = 200
"""The longest reason kept (guidellm's exception text can carry a whole response)."""


class ClientError(RuntimeError):
    """The client is not installed as gpufleet's lock says, or did not produce a report (message: one line)."""


@dataclass(frozen=True)
class Target:
    """Where the requests go: an OpenAI-compatible base URL, the served model name, the bearer key (a secret),
    the CA file that signs the target's certificate (None: the system's), and the tokenizer guidellm counts
    and makes prompts with (a local directory or a Hugging Face name)."""

    base_url: str
    model: str
    api_key: str | None
    ca_file: str | None
    tokenizer: str


@dataclass(frozen=True)
class Workload:
    """What each request asks: synthetic prompts and outputs of random lengths (token counts: mean, spread,
    bounds), or the rows of a dataset file already in guidellm's columns (``dataset``)."""

    prompt_tokens: tuple[int, int, int, int] = (64, 16, 1, 128)
    output_tokens: tuple[int, int, int, int] = (32, 8, 1, 64)
    dataset: Path | None = None


def workload_for(max_model_len: int) -> Workload:
    """Random lengths from a model length: prompts around a quarter of it (at most 1024 tokens), outputs around an
    eighth (at most 256), each up to twice its mean, prompt and output together within ``max_model_len``."""
    prompt = max(1, min(max_model_len // 4, 1024))
    output = max(1, min(max_model_len // 8, 256))
    return Workload((prompt, max(1, prompt // 4), 1, min(2 * prompt, max_model_len // 2)),
                    (output, max(1, output // 4), 1, min(2 * output, max_model_len // 4)))


def step_bound_s(step_s: float) -> float:
    """The longest one step may take: its sending time and :data:`GRACE_S`."""
    return step_s + GRACE_S


def step_requests(rate: float, step_s: float) -> int:
    """The requests one step sends: ``rate x step_s``, at least one."""
    return max(1, math.ceil(rate * step_s))


def scenario(target: Target, workload: Workload, rate: float, step_s: float, report: Path) -> dict[str, Any]:
    """guidellm's scenario for one step (its ``spec``)."""
    data: dict[str, Any]
    if workload.dataset is not None:
        data = {"kind": "json_file", "path": str(workload.dataset)}
    else:
        (p_mean, p_sd, p_min, p_max), (o_mean, o_sd, o_min, o_max) = workload.prompt_tokens, workload.output_tokens
        data = {"kind": "synthetic_text", "prompt_tokens": p_mean, "prompt_tokens_stdev": p_sd,
                "prompt_tokens_min": p_min, "prompt_tokens_max": p_max, "output_tokens": o_mean,
                "output_tokens_stdev": o_sd, "output_tokens_min": o_min, "output_tokens_max": o_max}
    backend: dict[str, Any] = {
        "kind": "openai_http", "target": target.base_url, "model": target.model,
        "request_format": "/v1/completions", "verify": target.base_url.startswith("https://"),
        "validate_backend": False,  # its check asks /health, which a closed edge does not route
        "http2": False, "timeout": step_bound_s(step_s),
    }
    if target.api_key:
        backend["api_key"] = target.api_key
    return {"spec": {
        "backend": backend,
        "profile": {"kind": "constant", "rate": [rate]},
        "data": [data],
        "tokenizer": {"kind": "huggingface_auto", "model": target.tokenizer},
        "constraints": [{"kind": "max_requests", "count": step_requests(rate, step_s)},
                        {"kind": "max_duration", "seconds": step_bound_s(step_s)}],
        "outputs": [{"kind": "json", "path": str(report)}],
    }}


def failure_reasons(bench: dict[str, Any], limit: int = REASONS_MAX) -> list[str]:
    """The first ``limit`` distinct reasons of a benchmark's errored requests, as guidellm wrote them (a refused
    certificate, an HTTP status, a timeout: it names the URL, never the key), with how many requests gave each; the
    requests still running at the step's bound as one more reason."""
    counts: dict[str, int] = {}
    requests = bench.get("requests") or {}
    for request in requests.get("errored") or []:
        error = " ".join(str((request.get("info") or {}).get("error") or "no reason given").split())
        if not error.startswith(UNPARSED):
            counts[error[:REASON_CHARS]] = counts.get(error[:REASON_CHARS], 0) + 1
    found = [f"{n} x {reason}" for reason, n in counts.items()][:limit]
    incomplete = int(((bench.get("metrics") or {}).get("request_totals") or {}).get("incomplete", 0))
    if incomplete:
        found.append(f"{incomplete} x not answered within the step's bound")
    return found


def step_from_report(doc: dict[str, Any], rate: float, offered: int) -> Step:
    """A :class:`Step` from guidellm's JSON report of one constant-rate benchmark that offered ``offered``
    requests."""
    benchmarks = doc.get("benchmarks") or []
    if len(benchmarks) != 1:
        raise ClientError(f"expected one benchmark in guidellm's report, found {len(benchmarks)}")
    bench = benchmarks[0]
    metrics = bench["metrics"]
    totals = metrics["request_totals"]
    seconds = float(bench.get("duration") or 0.0)

    def pct(name: str, which: str, scale: float) -> float | None:
        dist = (metrics.get(name) or {}).get("successful") or {}
        if not dist.get("count"):
            return None
        return float(dist["percentiles"][which]) * scale

    output = (metrics.get("output_token_count") or {}).get("successful") or {}
    succeeded = int(totals.get("successful", 0))
    unparsed = sum(1 for request in (bench.get("requests") or {}).get("errored") or []
                   if str((request.get("info") or {}).get("error") or "").startswith(UNPARSED))
    return Step(
        rate=rate,
        achieved_rps=(succeeded + unparsed) / seconds if seconds > 0 else 0.0,
        ttft_p50_s=pct("time_to_first_token_ms", "p50", 1e-3), ttft_p99_s=pct("time_to_first_token_ms", "p99", 1e-3),
        itl_p50_s=pct("inter_token_latency_ms", "p50", 1e-3), itl_p99_s=pct("inter_token_latency_ms", "p99", 1e-3),
        e2e_p50_s=pct("request_latency", "p50", 1.0), e2e_p99_s=pct("request_latency", "p99", 1.0),
        output_tokens_per_s=float(output.get("total_sum") or 0.0) / seconds if seconds > 0 else 0.0,
        succeeded=succeeded,
        failed=int(totals.get("errored", 0)) - unparsed,
        seconds=seconds,
        offered=offered,
        ttft_p95_s=pct("time_to_first_token_ms", "p95", 1e-3), itl_p95_s=pct("inter_token_latency_ms", "p95", 1e-3),
        started_at=float(bench.get("start_time") or 0.0),
        ended_at=float(bench.get("end_time") or 0.0),
        unparsed=unparsed,
        failure_reasons=failure_reasons(bench),
    )


def cache_home() -> Path:
    """Where gpufleet keeps what it builds on the controller: ``$XDG_CACHE_HOME/gpufleet`` (``~/.cache/gpufleet``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gpufleet"


def client_venv() -> Path:
    """gpufleet's own virtual environment of the client: ``<cache>/guidellm-VERSION``."""
    return cache_home() / f"guidellm-{VERSION}"


def client_path(say: Callable[[str], None]) -> Path:
    """The guidellm executable: :data:`CLIENT_ENV`'s (said with ``say``; a relative path is taken from the current
    directory, made absolute here since the client runs in a directory of its own), else that of gpufleet's own
    virtual environment (:func:`client_venv`) when it was installed from the lock gpufleet ships (``gpufleet
    bench-client`` installs it; nothing is installed here). :class:`ClientError` (one line naming that command) when
    it is missing or was installed from another lock, or when :data:`CLIENT_ENV` names no executable."""
    if given := os.environ.get(CLIENT_ENV):
        if not (os.path.isfile(given) and os.access(given, os.X_OK)):
            raise ClientError(f"{CLIENT_ENV}: expected a guidellm executable, found {given!r}")
        found = Path(os.path.abspath(given))
        say(f"the client is {CLIENT_ENV}'s {found} (not checked against gpufleet's lock)")
        return found
    if problem := client_env.check(client_venv(), client_env.lock_path(VERSION), "guidellm"):
        raise ClientError(problem)
    return client_venv() / "bin" / "guidellm"


class StoppedEarly(Exception):
    """The step was stopped before its end by its watch (``reason``), at ``ended_at`` (Unix time)."""

    def __init__(self, reason: str, ended_at: float) -> None:
        super().__init__(reason)
        self.reason, self.ended_at = reason, ended_at


def run_step(client: Path, target: Target, workload: Workload, rate: float, step_s: float,
             watch: Callable[[], str | None] | None = None) -> Step:
    """One step against ``target``: guidellm at a constant ``rate`` for ``step_s`` seconds, stopped by itself, or
    ended (with its sending processes) as soon as ``watch``, asked every :data:`WATCH_EVERY_S`, gives a reason:
    then :class:`StoppedEarly`."""
    with tempfile.TemporaryDirectory(prefix="gpufleet-bench-") as tmp:
        folder = Path(tmp)
        report = folder / "report.json"
        path = folder / "scenario.json"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(scenario(target, workload, rate, step_s, report), out)
        processes = max(1, min(WORKER_PROCESSES_MAX, (os.cpu_count() or 2) // 2))
        env = {**os.environ, "HF_HUB_DISABLE_TELEMETRY": "1", "GUIDELLM__LOGGING__CONSOLE_LOG_LEVEL": "ERROR",
               "GUIDELLM__MAX_WORKER_PROCESSES": str(processes),
               "GUIDELLM__LOGGING__LOG_FILE": str(folder / "guidellm.log")}
        if target.ca_file:
            env["SSL_CERT_FILE"] = target.ca_file
        limit_s = step_bound_s(step_s) + 120
        returncode, output = _run_watched([str(client), "run", "--scenario", str(path), "--disable-console"],
                                          folder, env, limit_s, watch)
        if returncode != 0 or not report.exists():
            lines = [line.strip() for line in output.splitlines() if line.strip()]
            last = lines[-1][:REASON_CHARS] if lines else "no output"
            if target.api_key:
                last = last.replace(target.api_key, "(the key)")
            raise ClientError(f"guidellm failed (exit {returncode}): {last}")
        step = step_from_report(json.loads(report.read_text()), rate, step_requests(rate, step_s))
        if target.api_key and any(target.api_key in reason for reason in step.failure_reasons):
            step = replace(step, failure_reasons=[r.replace(target.api_key, "(the key)") for r in step.failure_reasons])
        return step


WATCH_EVERY_S = 2.0
"""Seconds between two questions to a step's watch."""

END_WITHIN_S = 10.0
"""Seconds the client's processes get to end on SIGTERM before SIGKILL."""


def _run_watched(argv: list[str], cwd: Path, env: dict[str, str], limit_s: float,
                 watch: Callable[[], str | None] | None) -> tuple[int, str]:
    """Run the client in a session of its own (its sending processes with it); its exit status and its output
    (stderr, then stdout). Ended when ``watch`` gives a reason (:class:`StoppedEarly`) or at ``limit_s``
    (:class:`ClientError`)."""
    process = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    deadline = time.monotonic() + limit_s
    try:
        while True:
            wait_s = max(0.0, deadline - time.monotonic())
            try:
                out, err = process.communicate(timeout=min(wait_s, WATCH_EVERY_S) if watch else wait_s)
                return process.returncode, err + out
            except subprocess.TimeoutExpired:
                if time.monotonic() >= deadline:
                    raise ClientError(f"guidellm did not end within {limit_s:g} s") from None
                if watch is not None and (reason := watch()) is not None:
                    raise StoppedEarly(reason, time.time()) from None
    finally:
        if process.returncode is None:
            _end(process)


def _end(process: subprocess.Popen[str]) -> None:
    """End the client's session: SIGTERM, then SIGKILL after :data:`END_WITHIN_S`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            process.communicate(timeout=END_WITHIN_S)
            return
        except subprocess.TimeoutExpired:
            continue
