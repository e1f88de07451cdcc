"""A fleet behind its routers without any node: what ``gpufleet upgrade`` and ``rollback`` run on hosts, answered
from plain data and recorded, with a clock of its own.

:class:`World` holds the routers' view of every replica (admin state, UP or not, counters), the release records on
every node, and how each release behaves (named releases: whether its deploy succeeds, whether it comes UP, the
traffic it gets and how much of it fails). It is the rollout's :class:`~gpufleet.remote.commands.Remote` (it answers
``router_admin.py`` and the record commands exactly as they are built, every word checked as the real one checks
them) and its deployer, and its ``now``/``sleep`` are the rollout's clock. Every change is an event in
:attr:`World.events`: ``drain ROUTER REPLICA``, ``wait-drained ROUTER REPLICA``, ``ready ROUTER REPLICA``,
``keep-previous NODE REPLICA``, ``deploy NODE,NODE [KEY=VALUE ...]``, and ``watch REPLICA, ...`` when the rollout
says it starts a canary watch.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from gpufleet.node_paths import VLLM_ETC
from gpufleet.remote.commands import RemoteResult, command_line
from gpufleet.rollout.release import Release, data_items, release_json
from gpufleet.rollout.router_control import ROUTER_ADMIN

RTIME_WINDOW = 512  # HAProxy averages a server's response time over its last 512 requests (TIME_STATS_SAMPLES)


@dataclass(frozen=True)
class Behaviour:
    """What a replica does on a release."""

    deploy: int = 0  # the exit status of the deploy that gives it this release
    up: bool = True  # UP in the routers once it runs it
    rps: float = 2.0  # requests per second each router sends it while it is ready and UP
    errors: float = 0.0  # the share of them answered 5xx
    rtime: int = 100  # ms
    deploy_s: float = 20.0  # how long its deploy takes


@dataclass
class World:
    routers: list[str]
    replicas: dict[str, tuple[str, tuple[str, ...]]]  # name -> (backend, nodes)
    releases: dict[str, Release]  # named releases
    inventory: str  # the release a deploy without --data gives
    behaviour: dict[str, Behaviour] = field(default_factory=dict)
    busy: set[str] = field(default_factory=set)  # replicas whose requests in flight never finish
    interrupt_at: str | None = None  # the event after which a KeyboardInterrupt is raised
    clock: float = 1000.0
    events: list[str] = field(default_factory=list)
    files: dict[tuple[str, str], dict[str, Release | None]] = field(default_factory=dict)  # (node, replica)
    admin: dict[tuple[str, str], str] = field(default_factory=dict)  # (router, replica) -> ready|drain
    up: dict[str, bool] = field(default_factory=dict)
    # (router, replica) -> [requests, 5xx, rtime]: rtime moves as HAProxy's does, by 1/RTIME_WINDOW of the
    # difference per request, from the response time of the release the replica ran when the world began
    counters: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    staged: dict[str, Release | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in self.replicas:
            self.up.setdefault(name, True)
            for router in self.routers:
                self.admin.setdefault((router, name), "ready")
                self.counters.setdefault((router, name), [0.0, 0.0, float(self._behaviour(name).rtime)])

    # --- set-up and what a test reads -------------------------------------------------------------------------

    def record(self, replica: str, current: str | None, previous: str | None = None) -> None:
        """Release records (named releases; None: no file) of ``replica`` on every one of its nodes."""
        for node in self.replicas[replica][1]:
            self.files[(node, replica)] = {"current": self.releases[current] if current else None,
                                           "previous": self.releases[previous] if previous else None}

    def name_of(self, release: Release | None) -> str | None:
        return next((name for name, known in self.releases.items() if known == release), None if release is None
                    else json.dumps(release, sort_keys=True))

    def running(self, replica: str) -> Release | None:
        node = self.replicas[replica][1][0]
        return self.files.get((node, replica), {}).get("current")

    def _behaviour(self, replica: str) -> Behaviour:
        return self.behaviour.get(self.name_of(self.running(replica)) or "", Behaviour())

    def _event(self, text: str) -> None:
        self.events.append(text)
        if text == self.interrupt_at:
            self.interrupt_at = None
            raise KeyboardInterrupt

    def say(self, line: str) -> None:
        if "canary watch of " in line:
            self._event("watch " + line.split("canary watch of ", 1)[1].rsplit(" for ", 1)[0])

    # --- the clock --------------------------------------------------------------------------------------------

    def now(self) -> float:
        return self.clock

    def sleep(self, seconds: float) -> None:
        """Time passes: every replica ready and UP is sent its requests by every router."""
        for (router, name), counted in self.counters.items():
            if self.admin[(router, name)] == "ready" and self.up[name]:
                behaviour = self._behaviour(name)
                sent = behaviour.rps * seconds
                counted[0] += sent
                counted[1] += sent * behaviour.errors
                counted[2] += (behaviour.rtime - counted[2]) * (1 - (1 - 1 / RTIME_WINDOW) ** sent)
        self.clock += seconds

    # --- the hosts --------------------------------------------------------------------------------------------

    def run(self, host: str, words: Sequence[str], *, timeout_s: float,
            ok_status: Collection[int] = (0,)) -> RemoteResult:
        command_line(words)  # the real check: every word plain
        if tuple(words[:3]) == ROUTER_ADMIN:
            return self._router(host, list(words[3:]))
        if list(words[:3]) == ["env", "LC_ALL=C", "head"]:
            return self._head(host, list(words[words.index("--") + 1:]), ok_status)
        if words[0] == "cp":
            replica = self._replica(words[-2])
            self.staged[words[-1]] = self.files[(host, replica)]["current"]
            self._event(f"stage-previous {host} {replica}")
            return RemoteResult(True, "", "")
        if words[0] == "mv":
            replica = self._replica(words[-1])
            self.files[(host, replica)]["previous"] = self.staged.pop(words[-2])
            self._event(f"keep-previous {host} {replica}")
            return RemoteResult(True, "", "")
        if words[0] == "rm":
            replica = self._replica(words[-1])
            self.staged.pop(words[-1])
            self._event(f"drop-previous {host} {replica}")
            return RemoteResult(True, "", "")
        raise AssertionError(f"unexpected command on {host}: {words}")

    @staticmethod
    def _replica(path: str) -> str:
        return path.removeprefix(VLLM_ETC + "/").split("/", 1)[0]

    def _head(self, host: str, paths: list[str], ok_status: Collection[int]) -> RemoteResult:
        out, err = [], []
        for path in paths:
            kind = "previous" if path.endswith("release.previous.json") else "current"
            found = self.files.get((host, self._replica(path)), {}).get(kind)
            if found is None:
                err.append(f"head: cannot open '{path}' for reading: No such file or directory")
            else:
                out += [f"==> {path} <==", *release_json(found).splitlines(), ""]
        return RemoteResult((1 if err else 0) in ok_status, "\n".join(out), "\n".join(err))

    def status(self, router: str, name: str) -> str:
        if not self.up[name]:
            return "DOWN"
        return "UP" if self.admin[(router, name)] == "ready" else "DRAIN"

    def _router(self, router: str, args: list[str]) -> RemoteResult:
        if args == ["show"]:
            servers = [{"backend": backend, "server": name, "status": self.status(router, name),
                        "admin": self.admin[(router, name)], "scur": 0, "qcur": 0,
                        "req_tot": int(self.counters[(router, name)][0]),
                        "hrsp_5xx": int(self.counters[(router, name)][1]),
                        "rtime": round(self.counters[(router, name)][2])}
                       for name, (backend, _) in self.replicas.items()]
            return RemoteResult(True, json.dumps({"servers": servers}), "")
        command, backend, name = args[:3]
        assert self.replicas[name][0] == backend, f"{name} is not in backend {backend}"
        if command == "set-state":
            self.admin[(router, name)] = args[3]
            self._event(f"{args[3]} {router} {name}")
            return RemoteResult(True, "{}", "")
        assert command == "wait-drained" and args[3] == "--timeout", args
        self._event(f"wait-drained {router} {name}")
        if name in self.busy:
            self.sleep(float(args[4]))
            return RemoteResult(False, "", f"router_admin: {backend}/{name}: not drained after {args[4]} s: in flight"
                                           " 1, queued 0 (admin drain)")
        return RemoteResult(True, "{}", "")

    # --- the deployer -----------------------------------------------------------------------------------------

    def deploy(self, hosts: Sequence[str], data: Release) -> int:
        self._event(" ".join(["deploy", ",".join(hosts), *data_items(data)]))
        given = {**self.releases[self.inventory], **data}
        status = 0
        touched = [name for name, (_, nodes) in self.replicas.items() if set(nodes) & set(hosts)]
        for name in touched:
            for node in self.replicas[name][1]:
                self.files.setdefault((node, name), {"current": None, "previous": None})["current"] = dict(given)
            behaviour = self._behaviour(name)
            self.up[name] = behaviour.up and behaviour.deploy == 0
            status = max(status, behaviour.deploy)
        self.sleep(max((self._behaviour(n).deploy_s for n in touched), default=0.0))
        return status

