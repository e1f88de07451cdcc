"""The routers as a rollout drives them, on every host of the inventory group ``routers``: take a replica out
(drain), wait until it has nothing in flight, put it back (ready), and read every server's state and counters.

Each step runs the node tool ``router_admin.py`` (installed on every node by role common) over
:mod:`gpufleet.remote.commands`; a backend is a served model, a server one of its replicas, named as the plan names
it (:func:`roles.router.backends`). A change is made on every router before one that failed is reported, so a
router that answers is never left behind by one that does not.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gpufleet.node_paths import node_tool
from gpufleet.remote.commands import Remote, RemoteResult
from gpufleet.rollout.canary import Counters

ROUTER_ADMIN = ("python3", "-I", node_tool("router_admin.py"))
COMMAND_TIMEOUT_S = 60.0  # show, set-state: the tool's own waits are a few seconds
DRAIN_GRACE_S = 10  # wait-drained lasts vllm_shutdown_timeout_s plus this; vLLM's own drain covers what is left
NOT_DRAINED = "not drained after"  # what router_admin.py says when wait-drained ran out of time


class RouterFailure(Exception):
    """A router that could not be read or changed: one line per router."""


@dataclass(frozen=True)
class ServerView:
    """One server of one router's backend, as ``router_admin.py show`` prints it."""

    backend: str
    server: str
    status: str  # UP, DOWN, DRAIN, MAINT, "UP 1/2", ...
    admin: str  # ready, drain, maint
    scur: int = 0
    qcur: int = 0
    req_tot: int = 0
    hrsp_5xx: int = 0
    rtime: int = 0

    @property
    def up(self) -> bool:
        """Serving: HAProxy says UP (a server being drained says DRAIN, one failing its checks DOWN)."""
        return self.status.split(" ", 1)[0] == "UP"

    def counters(self) -> Counters:
        return Counters(self.req_tot, self.hrsp_5xx, self.rtime)


RouterView = dict[str, dict[str, ServerView]]
"""router host -> server name -> what that router shows for it."""


def parse_show(text: str, router: str) -> dict[str, ServerView]:
    """``router_admin.py show``'s JSON as server name -> view; RouterFailure when it is not that."""
    try:
        doc = json.loads(text)
        found: dict[str, ServerView] = {}
        for entry in doc["servers"]:
            count = {key: int(entry.get(key, 0)) for key in ("scur", "qcur", "req_tot", "hrsp_5xx", "rtime")}
            view = ServerView(str(entry["backend"]), str(entry["server"]), str(entry["status"]), str(entry["admin"]),
                              count["scur"], count["qcur"], count["req_tot"], count["hrsp_5xx"], count["rtime"])
            found[view.server] = view
    except (ValueError, KeyError, TypeError) as exc:
        raise RouterFailure(f"router {router}: router_admin.py show: unexpected answer ({exc})") from None
    return found


def _failed(router: str, what: str, result: RemoteResult) -> str:
    return f"router {router}: {what}: {result.line().removeprefix('router_admin: ')}"


class RouterControl:
    """Every router of the inventory, through ``remote``."""

    def __init__(self, remote: Remote, routers: Sequence[str],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.remote, self.routers, self.clock = remote, list(routers), clock

    def _tool(self, router: str, *words: str, timeout_s: float = COMMAND_TIMEOUT_S) -> RemoteResult:
        return self.remote.run(router, [*ROUTER_ADMIN, *words], timeout_s=timeout_s)

    def show(self) -> RouterView:
        """What every router shows for every server; RouterFailure naming each router that did not answer."""
        view: RouterView = {}
        problems: list[str] = []
        for router in self.routers:
            result = self._tool(router, "show")
            if not result.ok:
                problems.append(_failed(router, "show", result))
                continue
            try:
                view[router] = parse_show(result.stdout, router)
            except RouterFailure as exc:
                problems.append(str(exc))
        if problems:
            raise RouterFailure("; ".join(problems))
        return view

    def set_state(self, backend: str, server: str, state: str) -> None:
        """``state`` (ready, drain, maint) for ``backend/server`` on every router."""
        problems = []
        for router in self.routers:
            result = self._tool(router, "set-state", backend, server, state)
            if not result.ok:
                problems.append(_failed(router, f"set {backend}/{server} {state}", result))
        if problems:
            raise RouterFailure("; ".join(problems))

    def wait_drained(self, servers: Sequence[tuple[str, str]], timeout_s: float) -> list[str]:
        """Wait until every (backend, server) has nothing in flight or queued on every router, all of it within
        ``timeout_s``; the lines of what was still in flight when the time was over (empty: all drained)."""
        deadline = self.clock() + timeout_s
        left: list[str] = []
        for router in self.routers:
            for backend, server in servers:
                wait = max(0.0, deadline - self.clock())
                result = self._tool(router, "wait-drained", backend, server, "--timeout", f"{wait:.1f}",
                                    timeout_s=wait + COMMAND_TIMEOUT_S)
                if result.ok:
                    continue
                if NOT_DRAINED not in result.stderr:
                    raise RouterFailure(_failed(router, f"wait until {backend}/{server} is drained", result))
                left.append(_failed(router, "drain", result))
        return left
