#!/usr/bin/env python3
"""One rank of a fabric check: an all-reduce over exactly a replica's ranks, on the interface its units use
(gpufleet node tool, run with the release's own Python and torch).

    python3 fabric_check.py --rank R --world W --leader ADDR:PORT --backend gloo|nccl [--iface IF] \\
        --bytes N --floor-gbps F --timeout S

Every rank of the replica runs it at once (the deploy starts them together, before the replica's units). The ranks
meet at the leader's store; a rank that does not arrive within ``--timeout`` is named (by its rank and host) and the
check fails. Then each rank sends the leader a buffer and receives one from it, so each node's way out is timed on
its own: a node whose outgoing link is lossy or slow is named, where an all-reduce alone would only be slow. Last,
timed all-reduces give the bus bandwidth (algorithm bandwidth x 2(n-1)/n, nccl-tests' definition), held to the
floor. The leader (rank 0) prints the verdict as JSON; exit 0 when it passed, 1 when not, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import time
from datetime import timedelta
from typing import Any

SCHEMA = "gpufleet.fabric-check/1"
GIGA = 1e9
ALLREDUCE_SECONDS = 2.0


def _bus_factor(world: int) -> float:
    return 2 * (world - 1) / world if world > 1 else 1.0


def check(args: argparse.Namespace) -> dict[str, Any]:
    """Join, time each rank's way out and back, then the all-reduce; the leader's view of every rank."""
    if args.iface:  # the interface the replica's units use, for the collective's own sockets
        os.environ["GLOO_SOCKET_IFNAME"] = args.iface
        os.environ["NCCL_SOCKET_IFNAME"] = args.iface
    import torch  # type: ignore[import-not-found]
    import torch.distributed as dist  # type: ignore[import-not-found]

    host, port = args.leader.rsplit(":", 1)
    started = time.monotonic()
    timeout = timedelta(seconds=args.timeout)
    store = dist.TCPStore(host, int(port), args.world, args.rank == 0, timeout=timeout, wait_for_workers=False)
    store.set(f"node/{args.rank}", socket.gethostname())
    verdict: dict[str, Any] = {"schema": SCHEMA, "world": args.world, "backend": args.backend, "iface": args.iface,
                               "floor_gbps": args.floor_gbps}
    keys = [f"node/{r}" for r in range(args.world)]
    try:
        store.wait(keys, timeout)
    except Exception:  # noqa: BLE001 - torch raises its own timeout types across releases
        missing = [r for r in range(args.world) if not store.check([f"node/{r}"])]
        verdict.update(passed=False, stage="join", missing_ranks=missing,
                       seconds=round(time.monotonic() - started, 2))
        return verdict
    nodes = [store.get(k).decode() for k in keys]
    verdict["nodes"] = nodes
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device(f"cuda:{args.local_gpu}")
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, store=store, rank=args.rank, world_size=args.world, timeout=timeout)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    buf = torch.ones(args.bytes // 4, dtype=torch.float32, device=device)
    out_gbps: dict[int, float] = {}  # rank -> its way out to the leader (the leader's: its slowest way out)
    stage, blamed = "out", 0
    try:
        for peer in range(1, args.world):
            dist.barrier()
            if args.rank == 0:
                t0 = time.perf_counter()
                blamed = peer  # a recv that never ends: the peer's way out
                dist.recv(buf, src=peer)
                sync()
                out_gbps[peer] = args.bytes / (time.perf_counter() - t0) / GIGA
                blamed = 0  # a send that never ends: the leader's way out
                dist.send(buf, dst=peer)
            elif args.rank == peer:
                dist.send(buf, dst=0)
                t0 = time.perf_counter()
                dist.recv(buf, src=0)
                sync()
                mine = torch.tensor([args.bytes / (time.perf_counter() - t0) / GIGA], dtype=torch.float64)
                dist.send(mine.to(device) if args.backend == "nccl" else mine, dst=0)
            if args.rank == 0:
                blamed = peer
                got = torch.zeros(1, dtype=torch.float64, device=device if args.backend == "nccl" else "cpu")
                dist.recv(got, src=peer)
                out_gbps[0] = min(out_gbps.get(0, float("inf")), float(got.item()))
        stage = "allreduce"
        dist.all_reduce(buf)  # warm
        sync()
        rounds = 0
        t0 = time.perf_counter()
        while True:
            dist.all_reduce(buf)
            sync()
            rounds += 1
            done = torch.tensor([time.perf_counter() - t0 >= ALLREDUCE_SECONDS], dtype=torch.int32, device=device)
            dist.broadcast(done, src=0)  # every rank stops after the same round
            if bool(done.item()):
                break
        elapsed = time.perf_counter() - t0
    except Exception as exc:  # noqa: BLE001 - a collective that times out: torch raises its backend's own types
        stalled = [nodes[blamed]] if stage == "out" else \
            [nodes[r] for r, _ in sorted(out_gbps.items(), key=lambda item: item[1])[:1]]
        verdict.update(passed=False, stage=stage, stalled_nodes=stalled, slow_nodes=stalled,
                       out_gbps={nodes[r]: round(g, 3) for r, g in sorted(out_gbps.items())},
                       error=" ".join(str(exc).split())[:300], seconds=round(time.monotonic() - started, 2))
        return verdict
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    busbw = args.bytes * rounds / elapsed / GIGA * _bus_factor(args.world)
    slow = sorted(r for r, gbps in out_gbps.items() if gbps < args.floor_gbps)
    verdict.update(
        busbw_gbps=round(busbw, 3), floor_gbps=args.floor_gbps, rounds=rounds,
        out_gbps={nodes[r]: round(g, 3) for r, g in sorted(out_gbps.items())},
        slow_nodes=[nodes[r] for r in slow],
        passed=busbw >= args.floor_gbps and not slow, stage="allreduce",
        seconds=round(time.monotonic() - started, 2))
    return verdict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fabric_check.py", description="One rank of a replica's fabric check.")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--leader", required=True, metavar="ADDR:PORT")
    parser.add_argument("--backend", choices=("gloo", "nccl"), required=True)
    parser.add_argument("--iface", default="", help="the network interface the replica's units use")
    parser.add_argument("--local-gpu", type=int, default=0)
    parser.add_argument("--bytes", type=int, required=True)
    parser.add_argument("--floor-gbps", type=float, required=True)
    parser.add_argument("--timeout", type=float, required=True, help="seconds for every rank to arrive")
    args = parser.parse_args(argv)
    if not (0 <= args.rank < args.world and args.bytes >= 4 and args.floor_gbps > 0 and args.timeout > 0):
        print("fabric check: need 0 <= rank < world, bytes >= 4, a positive floor and timeout", file=sys.stderr)
        return 2
    verdict = check(args)
    if args.rank == 0 or not verdict.get("passed", False):
        print(json.dumps(verdict))
    return 0 if verdict.get("passed") else 1


if __name__ == "__main__":
    sys.exit(main())
