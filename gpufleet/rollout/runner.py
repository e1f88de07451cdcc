"""The rollout: the batch planner's waves, one after the other, each taken out of the routers, deployed, put back
and watched, and rolled back when anything fails.

For each wave (its units' replicas together):

1. drain them on every router, and wait until nothing is in flight there, for at most their
   ``vllm_shutdown_timeout_s`` + 10 s (then go on: vLLM's own drain on stop finishes what is left);
2. on each node where a replica's release changes and its ``release.json`` exists, copy it beside
   ``release.previous.json`` (it replaces that file once the wave held); then one limited deploy
   (``pyinfra … --limit NODE …``) per distinct ``--data``, which restarts what changed and waits until each
   replica serves one real completion;
3. put them back (ready) on every router, and wait until every router shows them UP, for at most their
   ``vllm_ready_timeout``;
4. in the first batch (every batch with ``canary_every_batch``), watch them for ``canary_s`` seconds: UP all the
   while, and no worse than their model's replicas not rolled yet (:mod:`gpufleet.rollout.canary`). A canary the
   routers sent fewer than ``min_requests`` requests is watched on, up to ``canary_max_s``, until it has; one still
   short then fails, unless its canary bench (``--canary-bench``) judged it (:func:`gpufleet.rollout.latency.evidence`).

A failure (a router or node that does not answer, a deploy that exits non-zero, a replica not UP in time, a bad
canary) stops the rollout: the wave's deployed replicas are drained again and deployed back to the release they
ran before the wave, then put back, their ``release.previous.json`` unchanged; a replica whose earlier release
was not recorded is left drained. An interrupt (Ctrl-C, SIGTERM) puts every drained replica back first.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from gpufleet.measure.guidellm_client import ClientError
from gpufleet.measure.records import Record
from gpufleet.prometheus_api import PrometheusError
from gpufleet.remote.commands import Remote
from gpufleet.rollout import report as rp
from gpufleet.rollout.batches import Batch
from gpufleet.rollout.canary import Thresholds, traffic, verdict
from gpufleet.rollout.canary_bench import bench_plan, stored_at
from gpufleet.rollout.latency import (
    DEFAULT_MIN_REQUESTS,
    MAX_WATCH_FACTOR,
    MAX_WATCH_S,
    LatencySource,
    Percentiles,
    baseline_record,
    evidence,
    latency_verdict,
    stored_percentiles,
)
from gpufleet.rollout.node_releases import RecordFailure, drop_staged, keep_previous, stage_previous
from gpufleet.rollout.release import Release
from gpufleet.rollout.replicas import Member, Rollable
from gpufleet.rollout.router_control import RouterControl, RouterFailure, RouterView

UP_POLL_S = 2.0
WATCH_POLL_S = 5.0
DEFAULT_CANARY_S = 60.0


class Deployer(Protocol):
    """Runs the vLLM deploy on some hosts, with release values as ``--data``; returns its exit status."""

    def deploy(self, hosts: Sequence[str], data: Release) -> int: ...


@dataclass(frozen=True)
class LatencyJudge:
    """How a canary's latency is judged (:mod:`gpufleet.rollout.latency`): the percentiles' source, the bench
    records of the fleet and the largest ratio (the fewest requests: :attr:`Options.min_requests`)."""

    source: LatencySource
    records: Sequence[Record] = ()
    max_ratio: float = 1.5
    bench: CanaryBench | None = None  # --canary-bench: a fixed-rate bench of each canary before it takes traffic


class CanaryBench(Protocol):
    """Benches one canary at a fixed rate on its own API (:mod:`gpufleet.rollout.canary_bench`)."""

    def bench(self, replica: str, rate: float) -> tuple[Percentiles, str]: ...


@dataclass(frozen=True)
class Options:
    canary_s: float = DEFAULT_CANARY_S
    canary_every_batch: bool = False
    thresholds: Thresholds = field(default_factory=Thresholds)
    latency: LatencyJudge | None = None  # None: the routers' mean response time is the latency judged
    min_requests: int = DEFAULT_MIN_REQUESTS  # what a canary must serve over its watch to be judged
    canary_max_s: float | None = None  # the longest watch of a canary short of them; None: 3 x watch, at most a day

    def watch_bound(self, watch_s: float) -> float:
        """How long a watch of ``watch_s`` seconds may go on while a canary has served too few requests:
        ``canary_max_s``, else :data:`MAX_WATCH_FACTOR` times the watch, at most :data:`MAX_WATCH_S`."""
        default = min(MAX_WATCH_FACTOR * watch_s, MAX_WATCH_S)
        return max(watch_s, default if self.canary_max_s is None else self.canary_max_s)


def _names(members: Sequence[Member]) -> str:
    return ", ".join(m.name for m in members)


class Rollout:
    """One rollout over the planned batches; :meth:`run` returns its report."""

    def __init__(self, command: str, rollable: Rollable, batches: Sequence[Batch], router: RouterControl,
                 remote: Remote, deployer: Deployer, options: Options | None = None, *,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 say: Callable[[str], None] = print) -> None:
        self.command, self.units, self.batches = command, rollable.members, list(batches)
        self.router, self.remote, self.deployer, self.options = router, remote, deployer, options or Options()
        self.clock, self.sleep, self.say = clock, sleep, say
        self.members = {m.name: m for found in self.units.values() for m in found}
        self.report = rp.Report(command, {m.name: rp.Outcome(m.name, m.backend, m.before, m.target)
                                          for m in self.members.values()})
        self.drained: dict[str, Member] = {}  # taken out of the routers and not put back yet
        self.staged: list[tuple[str, str]] = []  # (node, replica): release.json copied, not yet the previous one
        self.in_wave: list[Member] = []  # the wave under way
        self.rolled: set[str] = set()
        self.benched: dict[str, int] = {}  # canaries their --canary-bench judged: the requests it served
        self.unbenched: dict[str, str] = {}  # canaries --canary-bench did not judge: why

    def _outcome(self, member: Member) -> rp.Outcome:
        return self.report.outcomes[member.name]

    def _tell(self, line: str) -> None:
        self.say(f"gpufleet {self.command}: {line}")

    def run(self) -> rp.Report:
        try:
            for number, batch in enumerate(self.batches, 1):
                watch = self.options.canary_s if number == 1 or self.options.canary_every_batch else 0.0
                for wave in batch.waves:
                    moved = [m for unit in wave for m in self.units[unit] if m.target is not None]
                    if moved and not self._wave(moved, watch, f"batch {number} of {len(self.batches)}"):
                        self.report.status = 1
                        return self.report
        except KeyboardInterrupt:
            for member in self.in_wave:
                outcome = self._outcome(member)
                if outcome.state == rp.UNTOUCHED:
                    outcome.state = rp.INTERRUPTED
            with contextlib.suppress(KeyboardInterrupt):  # interrupted again: what is left is said below
                self._put_back(list(self.drained.values()))
            left = ", ".join(self.drained)
            self.report.status = 130
            self.report.failure = (f"interrupted: still drained: {left}" if left
                                   else "interrupted: drained replicas were put back")
        return self.report

    # --- one wave --------------------------------------------------------------------------------------------

    def _wave(self, members: list[Member], watch: float, where: str) -> bool:
        """Roll ``members`` (whole units); False when the rollout stops here."""
        started = self.clock()
        self.in_wave = list(members)
        self._tell(f"{where}: {_names(members)}")
        try:
            self._drain(members)
        except RouterFailure as exc:
            self._put_back(members)
            return self._stop(f"draining {_names(members)} failed: {exc}")
        deployed: list[Member] = []
        failure = None
        try:
            for data, group in self._groups(members, lambda m: m.target):
                self._stage_previous(group)
                status = self._deploy(group, data)
                deployed += group
                if status != 0:
                    failure = f"the deploy of {_names(group)} exited {status}"
                    break
        except RecordFailure as exc:
            failure = str(exc)
        if failure is None and watch > 0:
            failure = self._bench_canaries(members)
        if failure is None:
            failure = self._back_in(members)
        if failure is None and watch > 0:
            failure = self._watch(members, watch)
        if failure is None:
            failure = self._settle_previous(members, keep_previous)
        if failure is not None:
            self._roll_back(members, deployed, failure)
            self._settle_previous(members, drop_staged)
            return self._stop(failure)
        for member in members:
            self.rolled.add(member.name)
            outcome = self._outcome(member)
            outcome.state = rp.ROLLED
            outcome.took("total", self.clock() - started)
        return True

    def _stop(self, failure: str) -> bool:
        self.report.failure = failure
        self._tell(f"stopping: {failure}")
        return False

    def _groups(self, members: Sequence[Member],
                release: Callable[[Member], Release | None]) -> list[tuple[Release, list[Member]]]:
        """Members by the ``--data`` that gives them ``release``, whole units together (the refusals made a unit's
        replicas agree); members ``release`` gives nothing are left out."""
        groups: dict[str, tuple[Release, list[Member]]] = {}
        for unit in dict.fromkeys(self._unit_of(m) for m in members):
            found = [m for m in self.units[unit] if m in members]
            given = next((r for m in found if (r := release(m)) is not None), None)
            if given is None:
                continue
            data = found[0].data(given)
            groups.setdefault(repr(sorted(data.items())), (data, []))[1].extend(found)
        return list(groups.values())

    def _unit_of(self, member: Member) -> str:
        return next(unit for unit, found in self.units.items() if member in found)

    def _drain(self, members: Sequence[Member]) -> None:
        started = self.clock()
        for member in members:
            self.drained[member.name] = member  # before the command: an interrupt puts it back either way
            self.router.set_state(member.backend, member.name, "drain")
        left = self.router.wait_drained([(m.backend, m.name) for m in members],
                                        max(m.drain_timeout_s for m in members))
        for line in left:
            self._tell(f"{line}; going on: vLLM finishes what is left as it stops")
        for member in members:
            self._outcome(member).took("drain", self.clock() - started)

    def _put_back(self, members: Sequence[Member]) -> None:
        """``members`` that are drained ready again on every router (what fails is said, and the rest goes on)."""
        for member in members:
            if member.name not in self.drained:
                continue
            try:
                self.router.set_state(member.backend, member.name, "ready")
            except RouterFailure as exc:
                self._tell(f"could not put {member.name} back: {exc}")
                self._outcome(member).notes.append(f"still drained: {exc}")
                continue
            del self.drained[member.name]

    @staticmethod
    def _changes(member: Member) -> bool:
        return member.target is not None and member.before != member.target

    def _stage_previous(self, members: Sequence[Member]) -> None:
        """Copy each node's release.json beside release.previous.json where this wave changes the release."""
        for member in members:
            if self._changes(member):
                for node in member.recorded_on:
                    if node in member.recorded:
                        stage_previous(self.remote, node, member.name)
                        self.staged.append((node, member.name))

    def _settle_previous(self, members: Sequence[Member],
                         settle: Callable[[Remote, str, str], None]) -> str | None:
        """Make the staged copies of ``members`` the previous releases (the wave held) or drop them (rolled back);
        why that failed, or None."""
        names = {m.name for m in members}
        failure = None
        for node, replica in [s for s in self.staged if s[1] in names]:
            try:
                settle(self.remote, node, replica)
            except RecordFailure as exc:
                failure = failure or str(exc)
            self.staged.remove((node, replica))
        return failure

    def _deploy(self, members: Sequence[Member], data: Release) -> int:
        hosts = list(dict.fromkeys(node for m in members for node in m.nodes))
        self._tell(f"deploying {_names(members)} on {', '.join(hosts)}")
        started = self.clock()
        status = self.deployer.deploy(hosts, data)
        for member in members:
            self._outcome(member).took("deploy", self.clock() - started)
        return status

    def _back_in(self, members: Sequence[Member]) -> str | None:
        """Put ``members`` back on every router and wait until all show them UP; why not, or None."""
        started = self.clock()
        try:
            for member in members:
                self.router.set_state(member.backend, member.name, "ready")
                self.drained.pop(member.name, None)
            deadline = started + max(m.ready_timeout_s for m in members)
            while True:
                down = self._not_up(self.router.show(), members)
                if not down:
                    break
                if self.clock() >= deadline:
                    return f"{down[0]} after {self.clock() - started:.0f} s (vllm_ready_timeout)"
                self.sleep(UP_POLL_S)
        except RouterFailure as exc:
            return str(exc)
        for member in members:
            self._outcome(member).took("up", self.clock() - started)
        return None

    @staticmethod
    def _not_up(view: RouterView, members: Sequence[Member]) -> list[str]:
        return [f"replica {m.name} is {shown[m.name].status if m.name in shown else 'missing'} on router {router}"
                for m in members for router, shown in view.items()
                if m.name not in shown or not shown[m.name].up]

    def _watch(self, members: Sequence[Member], seconds: float) -> str | None:
        """The canary watch: UP on every router all along, long enough for each canary to serve the fewest requests
        it is judged on (up to the options' bound), then no worse than the model's replicas not rolled."""
        self._tell(f"canary watch of {_names(members)} for {seconds:g} s")
        started = self.clock()
        bound = self.options.watch_bound(seconds)
        extended: set[str] = set()  # the canaries short of requests when the watch asked was over
        try:
            before = after = self.router.show()
            while True:
                elapsed = self.clock() - started
                if elapsed < seconds:
                    self.sleep(min(WATCH_POLL_S, seconds - elapsed))
                else:
                    short = [m for m in members if m.name not in self.benched
                             and self._served(before, after, m.name) < self.options.min_requests]
                    if not short or elapsed >= bound:
                        break
                    if not extended:
                        extended = {m.name for m in short}
                        self._tell(f"{_names(short)}: fewer than {self.options.min_requests} requests after"
                                   f" {elapsed:.0f} s (--canary-min-requests); watching on, up to {bound:g} s"
                                   " (--canary-max-s)")
                    self.sleep(min(WATCH_POLL_S, bound - elapsed))
                after = self.router.show()
                down = self._not_up(after, members)
                if down:
                    return f"{down[0]} during the canary watch"
        except RouterFailure as exc:
            return str(exc)
        watched = self.clock() - started
        for member in members:
            self._outcome(member).took("watch", watched)
        wave = {m.name for m in members}
        served: dict[str, int] = {}
        for member in members:
            others = [m.name for m in self.members.values() if m.backend == member.backend
                      and m.name not in self.rolled and m.name not in wave
                      and all(shown.get(m.name) is not None and shown[m.name].up for shown in (*before.values(),
                                                                                               *after.values()))]
            base = traffic((before[r][name].counters(), after[r][name].counters()) for r in after for name in others
                           if name in before.get(r, {}))
            seen = traffic((before[r][member.name].counters(), after[r][member.name].counters()) for r in after
                           if member.name in before.get(r, {}))
            self._outcome(member).notes.append(
                f"canary: {seen.requests} requests, {seen.errors} 5xx, {seen.rtime_ms:.0f} ms"
                + (f" (not rolled: {base.requests}, {base.errors}, {base.rtime_ms:.0f} ms)" if others else ""))
            served[member.name] = seen.requests
            why = verdict(seen, base if others else None, self.options.thresholds,
                          judge_rtime=self.options.latency is None)
            if why:
                return f"replica {member.name}: canary: {why}"
            found = evidence(seen.requests, watched, self.options.min_requests, extended=member.name in extended,
                             benched=self.benched.get(member.name), hint=self._bench_hint(member))
            if not found.judged:
                return f"replica {member.name}: canary: {found.line}"
            if found.line:
                self._outcome(member).notes.append(f"canary: {found.line}")
        if self.options.latency is not None:
            return self._judge_latency(members, served, watched)
        return None

    @staticmethod
    def _served(before: RouterView, after: RouterView, name: str) -> int:
        """Requests the routers sent ``name`` between the two views."""
        return traffic((before[r][name].counters(), after[r][name].counters()) for r in after
                       if name in before.get(r, {}) and name in after[r]).requests

    def _bench_hint(self, member: Member) -> str:
        """What would give ``member`` a load of its own, for a canary not judged."""
        if member.name in self.unbenched:
            return f"its canary bench did not judge it: {self.unbenched[member.name]}"
        if self.options.latency is None:
            return "--canary-bench gives it a load of its own (with a monitoring group, where the bench records are)"
        return "--canary-bench gives it a load of its own"

    def _bench_canaries(self, members: Sequence[Member]) -> str | None:
        """``--canary-bench``: each canary benched on its own API before it is put back, against its release's
        bench record at half that record's ceiling per replica."""
        judge = self.options.latency
        if judge is None or judge.bench is None:
            return None
        for member in members:
            release = str((member.before or {}).get("vllm_version", ""))
            planned = bench_plan(judge.records, member.model, release, member.layout, member.profile)
            outcome = self._outcome(member)
            if planned.rate is None:
                outcome.notes.append(f"canary bench: not run, {planned.why_not}")
                self.unbenched[member.name] = f"not run, {planned.why_not}"
                continue
            self._tell(f"canary bench of {member.name} at {planned.rate:g} req/s")
            try:
                seen, line = judge.bench.bench(member.name, planned.rate)
            except ClientError as exc:
                return f"replica {member.name}: canary bench: {exc}"
            stored = stored_at(planned)
            outcome.notes.append(line + (f"; vLLM {release}'s bench: {stored.line()}" if stored else ""))
            why = latency_verdict(seen, None, stored, judge.max_ratio, self.options.min_requests)
            if why:
                return f"replica {member.name}: canary bench: {why}"
            if stored is None:
                self.unbenched[member.name] = f"no step of vLLM {release}'s bench at {planned.rate:g} req/s"
            elif seen.requests < self.options.min_requests:
                self.unbenched[member.name] = (f"it served {seen.requests:.0f} requests (fewer than"
                                               f" {self.options.min_requests})")
            else:
                self.benched[member.name] = round(seen.requests)
        return None

    def _judge_latency(self, members: Sequence[Member], served: dict[str, int], watched_s: float) -> str | None:
        """Each canary's p95 TTFT and ITL against its shape's replicas not rolled, and its ITL against its release's
        bench record; a canary the routers sent fewer than the minimum of requests was judged on its canary bench
        (:meth:`_watch` failed the others)."""
        judge = self.options.latency
        assert judge is not None
        members = [m for m in members if served.get(m.name, 0) >= self.options.min_requests]
        if not members:
            return None
        wave = {m.name for m in members}
        peers_of = {member.name: [m.name for m in self.members.values() if m.backend == member.backend
                                  and m.name not in wave and m.name not in self.rolled
                                  and (m.layout, m.profile) == (member.layout, member.profile)]
                    for member in members}
        read = dict.fromkeys([*(m.name for m in members), *(p for peers in peers_of.values() for p in peers)])
        try:  # the watch's last samples reach Prometheus
            waited = judge.source.settle(list(read))
        except PrometheusError as exc:
            return f"replica {members[0].name}: canary: its latency could not be read: {exc}"
        window = watched_s + waited
        for member in members:
            peers = peers_of[member.name]
            try:
                seen = judge.source.percentiles([member.name], window)
                base = judge.source.percentiles(peers, window) if peers else None
            except PrometheusError as exc:
                return f"replica {member.name}: canary: its latency could not be read: {exc}"
            release = str((member.before or {}).get("vllm_version", ""))
            # The record is the release it replaces: a replica that keeps its release replaces none (slower than its
            # record, it met a load, not a release).
            stored, against = None, "; its release does not change: not compared with a bench record"
            if member.changes_release:
                record = baseline_record(judge.records, member.model, release, member.layout, member.profile)
                stored = stored_percentiles(record, seen.requests / window, engine=True)
                against = (f"; vLLM {release}'s bench at {stored.requests:.3g} req/s per replica: {stored.line()}"
                           if stored is not None else f"; no bench of vLLM {release} at this load to compare with")
            self._outcome(member).notes.append(
                f"canary latency: {seen.requests:.0f} requests, {seen.line()}"
                + (f"; not rolled ({len(peers)} of its shape): {base.line()}" if base is not None else
                   "; no replica of its shape left unrolled to compare with") + against)
            why = latency_verdict(seen, base, stored, judge.max_ratio, self.options.min_requests, stored_keys=("itl",))
            if why:
                return f"replica {member.name}: canary: {why}"
        return None

    # --- rollback --------------------------------------------------------------------------------------------

    def _roll_back(self, members: Sequence[Member], deployed: Sequence[Member], failure: str) -> None:
        """Give the wave's deployed replicas back the release they ran before it; put everything back."""
        started = self.clock()
        self._put_back([m for m in members if m not in deployed])
        if not deployed:
            return
        self._tell(f"rolling back {_names(deployed)}")
        try:
            self._drain(deployed)
        except RouterFailure as exc:
            self._tell(f"draining for the rollback failed ({exc}); rolling back anyway")
        back: list[Member] = []
        for data, group in self._groups(deployed, lambda m: m.before):
            status = self._deploy(group, data)
            for member in group:
                outcome = self._outcome(member)
                outcome.state = rp.ROLLED_BACK if status == 0 else rp.ROLLBACK_FAILED
                if status != 0:
                    outcome.notes.append(f"the rollback's deploy exited {status}")
            back += group
        for member in deployed:
            if member not in back:
                outcome = self._outcome(member)
                outcome.state = rp.LEFT_DRAINED
                outcome.notes.append("left drained: its release before this rollout was not recorded")
        if back:
            not_up = self._back_in(back)
            if not_up:
                self._tell(f"after the rollback: {not_up}")
                for member in back:
                    self._outcome(member).notes.append(f"after the rollback: {not_up}")
        for member in deployed:
            self._outcome(member).took("rollback", self.clock() - started)
        self._tell(f"rolled back after: {failure}")
