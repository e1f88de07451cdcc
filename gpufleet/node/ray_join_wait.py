#!/usr/bin/env python3
"""Wait until a replica's Ray cluster counts every node of the replica (gpufleet node tool).

Runs on a Ray replica's first node, as ``ExecStartPre`` of its vLLM unit (user ``vllm``), before vLLM starts::

    ray_join_wait.py --ray VENV/bin/ray --address HEAD:PORT --nodes N [--timeout 300] \
        [--fabric-port P --fabric-backend gloo|nccl --fabric-iface IF --fabric-bytes B --fabric-floor-gbps F \
         --fabric-timeout S]

Every 2 s it runs ``ray status --address=HEAD:PORT`` and counts the nodes listed alive (under ``Active:`` and
``Idle:``, as the deploy's own wait counts them). The token is never an argument: ``ray status`` finds
``RAY_AUTH_MODE`` and ``RAY_AUTH_TOKEN`` in the unit's environment, which systemd read, as root, from the
replica's files. Exit 0 once at least N nodes are alive; 1 when the timeout passes first, saying how many had
joined (systemd starts the unit again, and the wait begins again). It logs to stderr.

With ``--fabric-port``, the replica's fabric check follows (role node_lifecycle's ``node_fabric_*``, as an mp
replica's ranks run it: replica_rank.py): as a Ray driver, one task pinned to each node of the cluster runs
fabric_check.py with that node's Python, rank 0 on the head, whose store the others join; the check is asked again
every ``FABRIC_RETRY_S`` until it passes, naming the nodes it blames each time, and vLLM does not start before it
does (exit 1 when the timeout passes first). Ray itself is imported only then, from the replica's virtualenv.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any


def _replica_rank() -> ModuleType:
    """replica_rank.py beside this file (node code has no package to import from): the fabric check's command line,
    verdict and description, as an mp replica's ranks run it."""
    spec = importlib.util.spec_from_file_location("gpufleet_node_replica_rank", Path(__file__).with_name(
        "replica_rank.py"))
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load replica_rank.py beside {__file__}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


replica_rank = _replica_rank()

POLL_S = 2.0
STATUS_TIMEOUT_S = 30.0  # one ``ray status`` that hangs counts as no answer


def count_alive(status: str) -> int:
    """How many nodes ``ray status`` lists alive: its `` COUNT node_<id>`` lines from ``Active:`` (``Idle:``
    included) up to ``Pending:``; a node ``ray start`` started has a type of its own, so COUNT is 1."""
    alive, inside = 0, False
    for line in status.splitlines():
        if line.startswith("Active:"):
            inside = True
        elif line.startswith("Pending:"):
            inside = False
        elif inside:
            words = line.split()
            if len(words) == 2 and words[0].isdigit() and words[1].startswith("node_"):
                alive += int(words[0])
    return alive


def ray_status(ray: str, address: str) -> int | None:
    """Nodes alive at ``address`` by ``ray status``; None when it does not answer."""
    try:
        done = subprocess.run([ray, "status", f"--address={address}"], capture_output=True, text=True,
                              timeout=STATUS_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return count_alive(done.stdout) if done.returncode == 0 else None


def wait_joined(count: Callable[[], int | None], nodes: int, timeout: float,
                clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                log: Callable[[str], None] = print) -> int | None:
    """Ask ``count`` every POLL_S until it says ``nodes`` or more, or ``timeout`` seconds pass; the last count
    (None: never answered). Each change of the count is logged once."""
    deadline = clock() + timeout
    seen: int | None = None
    first = True
    while True:
        found = count()
        if first or found != seen:
            log(f"{found} of {nodes} nodes joined" if found is not None else "the Ray head does not answer yet")
            first = False
        seen = found
        if found is not None and found >= nodes:
            return found
        if clock() >= deadline:
            return found
        sleep(POLL_S)


FABRIC_TOOL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fabric_check.py")


def run_rank(argv: list[str], timeout: float) -> tuple[int, str, str] | None:
    """One rank of the check, in a Ray task on its node: ``argv`` run with that node's Python (the worker's own, the
    replica's virtualenv's); its exit status and output, or None when it hung. Ray hides the GPUs from a task that
    asked for none (CUDA_VISIBLE_DEVICES empty): the check runs before vLLM, on the node's GPUs, so it sees them."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    try:
        done = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return None
    return done.returncode, done.stdout, done.stderr


def ray_fabric(address: str, fabric: dict[str, Any]) -> dict[str, Any]:
    """One fabric check over every live node of the Ray cluster at ``address`` (``fabric``: the check's settings):
    the leader's verdict, which names the nodes by host name."""
    import ray  # type: ignore[import-not-found]
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # type: ignore[import-not-found]

    head = address.rsplit(":", 1)[0].strip("[]")  # the leader's address as fabric_check.py takes it
    try:
        if not ray.is_initialized():
            ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR)
        alive = sorted((n for n in ray.nodes() if n.get("Alive")),
                       key=lambda n: (n.get("NodeManagerAddress") != head, str(n.get("NodeManagerAddress"))))
        world = {**fabric, "world": len(alive)}
        one_rank = ray.remote(num_cpus=0)(run_rank)
        limit = replica_rank.fabric_timeout(world)
        refs = [one_rank.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False))
                .remote(replica_rank.fabric_argv("python3", FABRIC_TOOL, world, rank, head), limit)
                for rank, node in enumerate(alive)]
        results = ray.get(refs, timeout=limit + 60)
    except Exception as exc:  # noqa: BLE001 - Ray's own error types vary across releases
        return {"passed": False, "stage": "ray", "slow_nodes": [], "error": " ".join(str(exc).split())[:300]}
    return dict(replica_rank.HUNG) if results[0] is None else replica_rank.read_verdict(0, *results[0])


def fabric_settings(args: argparse.Namespace) -> dict[str, Any] | None:
    """The check's settings from the command line, as ranks.json's ``fabric`` holds them; None without
    ``--fabric-port``."""
    if args.fabric_port is None:
        return None
    return {"port": args.fabric_port, "backend": args.fabric_backend, "iface": args.fabric_iface,
            "bytes": args.fabric_bytes, "floor_gbps": args.fabric_floor_gbps, "timeout_s": args.fabric_timeout}


def check_fabric(check: Callable[[], dict[str, Any]], deadline: float, clock: Callable[[], float],
                 sleep: Callable[[float], None], log: Callable[[str], None]) -> bool:
    """Ask ``check`` until it passes (True), or ``deadline`` passes after a failed one (False); each verdict logged."""
    while True:
        started = clock()
        verdict = check()
        log(f"fabric check {replica_rank.describe_fabric(verdict)} ({clock() - started:.1f} s)")
        if verdict.get("passed"):
            return True
        named = ", ".join(verdict.get("slow_nodes") or []) or "an unnamed node"
        if clock() >= deadline:
            log(f"vLLM does not start: its fabric check failed on {named}; systemd tries again")
            return False
        pause = replica_rank.retry_pause(started, clock())
        log(f"vLLM does not start: its fabric check failed on {named}; {replica_rank.checking_again(pause)}")
        sleep(pause)


_IFACE = re.compile(r"[A-Za-z0-9_.:-]{1,15}")  # a Linux interface name


def _wrong(args: argparse.Namespace) -> str | None:
    """The first argument out of its bounds, as ``--NAME: expected ..., found ...``; None when all are in them."""
    bounds = [("--nodes", args.nodes, 1 <= args.nodes <= 4096, "1 to 4096 nodes"),
              ("--timeout", args.timeout, 0 <= args.timeout <= 86400, "0 to 86400 seconds")]
    if args.fabric_port is not None:
        bounds += [("--fabric-port", args.fabric_port, 0 < args.fabric_port < 65536, "a port 1 to 65535"),
                   ("--fabric-bytes", args.fabric_bytes, 4 <= args.fabric_bytes <= 2**34, "4 bytes to 16 GiB"),
                   ("--fabric-floor-gbps", args.fabric_floor_gbps, 0 < args.fabric_floor_gbps <= 1e6,
                    "a floor above 0 GB/s"),
                   ("--fabric-timeout", args.fabric_timeout, 0 < args.fabric_timeout <= 3600, "0 to 3600 seconds"),
                   ("--fabric-iface", args.fabric_iface, args.fabric_iface == "" or bool(_IFACE.fullmatch(
                       args.fabric_iface)), "an interface name")]
    for name, value, ok, expected in bounds:
        if not ok:
            return f"{name}: expected {expected}, found {str(value)[:40]!r}"
    return None


def main(argv: list[str] | None = None, count: Callable[[str, str], int | None] = ray_status,
         clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
         fabric: Callable[[str, dict[str, Any]], dict[str, Any]] = ray_fabric) -> int:
    """The command line; ``count``, ``fabric``, ``clock`` and ``sleep`` stand in for Ray and time in tests."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--ray", required=True, help="the replica's virtualenv's ray program")
    parser.add_argument("--address", required=True, help="the Ray head's GCS, HOST:PORT")
    parser.add_argument("--nodes", type=int, required=True, help="how many nodes the replica has")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--fabric-port", type=int, help="the port of the fabric check's store on the head")
    parser.add_argument("--fabric-backend", choices=("gloo", "nccl"), default="nccl")
    parser.add_argument("--fabric-iface", default="", help="the interface the replica's units use")
    parser.add_argument("--fabric-bytes", type=int, default=8 * 1024**2)
    parser.add_argument("--fabric-floor-gbps", type=float, default=1.0)
    parser.add_argument("--fabric-timeout", type=float, default=20.0)
    args = parser.parse_args(argv)
    if (wrong := _wrong(args)) is not None:
        parser.error(wrong)
    settings = fabric_settings(args)

    def log(message: str) -> None:
        print(f"ray_join_wait: Ray at {args.address}: {message}", file=sys.stderr, flush=True)

    deadline = clock() + args.timeout
    found = wait_joined(lambda: count(args.ray, args.address), args.nodes, args.timeout, clock=clock, sleep=sleep,
                        log=log)
    if found is None or found < args.nodes:
        joined = "the head does not answer" if found is None else f"{found} of {args.nodes} nodes joined"
        log(f"{joined} after {args.timeout:g} s; vLLM does not start, systemd tries again")
        return 1
    if settings is None:
        return 0
    return 0 if check_fabric(lambda: fabric(args.address, settings), deadline, clock, sleep, log) else 1


if __name__ == "__main__":
    sys.exit(main())
