"""What ``gpufleet diag`` gathers from each node: the node tool ``diag_collect.py`` run on every node at once, each
within :data:`NODE_BOUND_S`, and its archive fetched and removed.

Each node has a thread and a connection of its own, over an inventory of its own (pyinfra's states are not shared
between threads), each made before any thread starts (an inventory file is run to make it). A node that has not
answered when its bound is over is reported so, and the others are not held up by it: its thread is left to end on
its own (a daemon thread, gone when the command exits). A host of one of pyinfra's local connectors (``@local``,
``@docker/...``: their commands are gevent's subprocesses, which run in the main thread alone) is collected in the main
thread while the others' threads run, bounded by its commands' own timeouts.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from gpufleet.node_paths import NODE_PYTHON, node_tool
from gpufleet.remote.commands import Remote, RemoteResult

NODE_BOUND_S = 60.0
"""The longest one node's collection takes, from its connection to its archive fetched."""
FETCH_S = 15.0
"""Of a node's bound, what is kept for fetching and removing its archive: the node tool has the rest."""
TOOL = (NODE_PYTHON, "-I", node_tool("diag_collect.py"))
_ARCHIVE = re.compile(r"(/var/tmp/gpufleet-diag-[A-Za-z0-9_]{1,64})/node\.tar\.gz")
_SLACK_BYTES = 1 << 20  # the node's index and the archive's own overhead, beyond its members' cap


class NodeRemote(Remote, Protocol):
    """A :class:`Remote` that also fetches a file's bytes, and closes its connections."""

    def get_bytes(self, host: str, path: str, max_bytes: int) -> tuple[RemoteResult, bytes]: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class NodeRun:
    """One node's collection: how long it took, its archive (empty when none came) and why none came."""

    host: str
    seconds: float
    archive: bytes = b""
    problem: str | None = None


def collect_words(since_s: int, max_bytes: int, budget_s: float, collect_env: bool) -> list[str]:
    return [*TOOL, "collect", "--since-s", str(since_s), "--max-bytes", str(max_bytes), "--budget-s",
            f"{budget_s:.0f}", *(["--collect-env"] if collect_env else [])]


def collect_node(remote: NodeRemote, host: str, since_s: int, max_bytes: int, bound_s: float,
                 collect_env: bool) -> NodeRun:
    """One node's archive: the node tool run, its archive fetched, then removed from the node."""
    started = time.monotonic()

    def failed(why: str) -> NodeRun:
        return NodeRun(host, time.monotonic() - started, problem=why)

    budget = max(1.0, bound_s - FETCH_S)
    done = remote.run(host, collect_words(since_s, max_bytes, budget, collect_env), timeout_s=budget + 5)
    if not done.ok:
        return failed(f"the node tool diag_collect.py failed: {done.line()}")
    try:
        path = str(json.loads(done.stdout.strip().splitlines()[-1])["archive"])
    except (ValueError, IndexError, KeyError, TypeError):
        return failed(f"the node tool diag_collect.py printed no archive: {done.line()}")
    where = _ARCHIVE.fullmatch(path)
    if where is None:
        return failed("the node tool diag_collect.py named an archive outside /var/tmp/gpufleet-diag-*")
    fetched, data = remote.get_bytes(host, path, max_bytes + _SLACK_BYTES)
    removed = remote.run(host, [*TOOL, "remove", where[1]], timeout_s=max(5.0, bound_s - (time.monotonic() - started)))
    if not fetched.ok:
        return failed(f"its archive could not be fetched: {fetched.line()}")
    run = NodeRun(host, time.monotonic() - started, data)
    return run if removed.ok else NodeRun(host, run.seconds, data, f"its archive {path} was left on the node:"
                                                                    f" {removed.line()}")


def collect(hosts: Sequence[str], remote_for: Callable[[str], NodeRemote], since_s: int, max_bytes: int,
            collect_env: bool = False, bound_s: float = NODE_BOUND_S) -> dict[str, NodeRun]:
    """Every host's collection, in parallel, each within ``bound_s`` and over its own ``remote_for(host)``; in the
    order of ``hosts``."""
    runs: dict[str, NodeRun] = {}
    lock = threading.Lock()

    def one(host: str, remote: NodeRemote) -> None:
        started = time.monotonic()
        try:
            run = collect_node(remote, host, since_s, max_bytes, bound_s, collect_env)
        except Exception as exc:  # noqa: BLE001 -- a node's failure, whatever it is, is that node's line alone
            why = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
            run = NodeRun(host, time.monotonic() - started, problem=why)
        finally:
            remote.close()
        with lock:
            runs.setdefault(host, run)

    threads = {host: threading.Thread(target=one, args=(host, remote_for(host)), name=f"diag {host}", daemon=True)
               for host in hosts if not host.startswith("@")}
    deadline = time.monotonic() + bound_s
    for thread in threads.values():
        thread.start()
    for host in (h for h in hosts if h.startswith("@")):
        one(host, remote_for(host))
    for host, thread in threads.items():
        thread.join(max(0.0, deadline - time.monotonic()))
        with lock:
            runs.setdefault(host, NodeRun(host, bound_s, problem=f"no answer within the bound of {bound_s:g} s"))
    return {host: runs[host] for host in hosts}
