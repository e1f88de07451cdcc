#!/usr/bin/env python3
"""Wait until a replica's Ray cluster counts every node of the replica (gpufleet node tool).

Runs on a Ray replica's first node, as ``ExecStartPre`` of its vLLM unit (user ``vllm``), before vLLM starts::

    ray_join_wait.py --ray VENV/bin/ray --address HEAD:PORT --nodes N [--timeout 300]

Every 2 s it runs ``ray status --address=HEAD:PORT`` and counts the nodes listed alive (under ``Active:`` and
``Idle:``, as the deploy's own wait counts them). The token is never an argument: ``ray status`` finds
``RAY_AUTH_MODE`` and ``RAY_AUTH_TOKEN`` in the unit's environment, which systemd read, as root, from the
replica's files. Exit 0 once at least N nodes are alive; 1 when the timeout passes first, saying how many had
joined (systemd starts the unit again, and the wait begins again). Standard library only; it logs to stderr.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Callable

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


def main(argv: list[str] | None = None, count: Callable[[str, str], int | None] = ray_status,
         clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> int:
    """The command line; ``count``, ``clock`` and ``sleep`` stand in for ``ray status`` and time in tests."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--ray", required=True, help="the replica's virtualenv's ray program")
    parser.add_argument("--address", required=True, help="the Ray head's GCS, HOST:PORT")
    parser.add_argument("--nodes", type=int, required=True, help="how many nodes the replica has")
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args(argv)

    def log(message: str) -> None:
        print(f"ray_join_wait: Ray at {args.address}: {message}", file=sys.stderr, flush=True)

    found = wait_joined(lambda: count(args.ray, args.address), args.nodes, args.timeout, clock=clock, sleep=sleep,
                        log=log)
    if found is not None and found >= args.nodes:
        return 0
    joined = "the head does not answer" if found is None else f"{found} of {args.nodes} nodes joined"
    log(f"{joined} after {args.timeout:g} s; vLLM does not start, systemd tries again")
    return 1


if __name__ == "__main__":
    sys.exit(main())
