#!/usr/bin/env python3
"""The routers' token ledger: every client's token budgets per model, one authority for all routers.

Runs on each router as its own service (standard library only)::

    token_ledger.py --budgets PATH --listen 127.0.0.1:PORT [--peer-listen ADDR:PORT --pem PATH
                    --authority ADDR --peers ADDR,...]

HAProxy asks the ledger on loopback, once when it admits a request and once when the answer has ended:

- ``POST /reserve`` ``{"client", "model", "tokens"}``: the request's cost at most (its prompt's bytes, each at least
  a token, times the prompt weight, and its ``max_tokens`` times the completion weight), held until it is settled.
  Admitted while the cost fits what the client's budgets have left, counting what is held; the answer is
  ``{"admitted", "id", "remaining", "reset_s", "retry_after_s"}``: the tokens left in the tightest window after
  this request, the seconds until that window is whole again, and for a refusal the seconds until this cost fits.
- ``POST /settle`` ``[{"id", "prompt", "completion"}, ...]``: the usage vLLM reported (or, with none reported,
  nothing for an error answer and the reservation for any other); a reservation never settled is charged whole
  when ``hold_s`` has passed (the router's timeout and a minute: its answer was lost).

Budgets are sliding windows: a minute (``tokens_per_minute``) and a day (``tokens_per_day``), each the tokens
charged in the last 60 s or 86,400 s. A client's budget applies to each model it uses, apart.

One authority for all routers: the first router of ``--routers`` whose ledger answers. A ledger forwards each
call to the routers listed before its own (``--self``) over TLS (``--pem``: the routers' own certificate, on both
sides), the first that answers deciding, and decides itself when none does; a router that did not answer is
passed over for ``DOWN_S``. Every change is sent to every other router's ledger (``POST /replicate``), and a ledger
that starts takes the state of the first that answers (``GET /snapshot``), else the one it saved when it stopped
(``--state``: SIGTERM writes it): a failover, a restart or a router's return finds the budgets used.

Fair share (``"slots"``: the backends shared fairly, each with the requests its replicas take at once): every
client's request to such a backend asks the ledger, and the reservation's answer waits until the request's turn,
at most ``"queue_s"`` (then ``2``: the router answers 503 as for its own queue). Each client has a counter per
backend of the weighed tokens it was served, over its share (``"shares"``, 1 by default): the reservation's cost
when its request is let through, corrected by the usage that settles it. When a request ends, the next let through
is the oldest of the waiting client with the lowest counter (virtual token counters, Sheng et al., OSDI '24), and a
client that starts waiting again gets no credit for the time it was away: its counter rises to the lowest of the
clients waiting. So backlogged clients are served tokens in proportion to their shares, whatever each request
costs. Classes come before counters (``"classes"``: each client's priority, the one vLLM schedules it by, lowest
first): a waiting request of an interactive client goes before any of a batch client's. This queue is each router's
own (the requests wait in its HAProxy); budgets stay the authority's.

``GET /metrics`` (loopback): each client's prompt and completion tokens per model, settled, what it holds in
reservations and what its budgets have left, in Prometheus' text format.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import signal
import socket
import ssl
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MINUTE_S, DAY_S = 60.0, 86400.0
DAY_BIN_S = 60.0  # the day's window counts in minutes
HOLD_S = 3600.0  # a reservation unsettled this long is charged whole (its router is gone); budgets' hold_s sets it
MAX_BODY = 1 << 20  # one call's JSON
FORWARD_TIMEOUT_S = 1.0  # a call forwarded to a router listed earlier; past it, that router is passed over
DOWN_S = 5.0  # how long a router whose ledger did not answer is passed over
MAX_SNAPSHOT = 64 << 20  # a ledger's whole state, as another router sends it
MAX_PENDING = 100_000  # changes kept for a router that does not answer
LATE_S = 0.5  # a fair turn come this long past the queue's timeout gives its place back (HAProxy waits 2 s more)
UNCLASSED = 1 << 30  # the class of a client the budgets give none: after every class
REPLICATE_EVERY_S = 0.05
METRICS = (
    ("prompt_tokens_total", "counter", "prompt tokens of its settled requests, by model (vLLM's usage)"),
    ("completion_tokens_total", "counter", "completion tokens of its settled requests, by model (vLLM's usage)"),
    ("tokens_held", "gauge", "tokens its requests in flight hold (their reservations, weighed)"),
    ("tokens_remaining", "gauge", "tokens its budget's window has left, less what is held"),
    ("token_budget", "gauge", "its budget per window (router_clients' tokens_per_minute, tokens_per_day)"),
)
SETTLE_WAIT_S = 1.0  # Retry-After when what the budget lacks is held by requests in flight


@dataclass
class Window:
    """Tokens charged in a sliding window of ``span_s``, in bins of ``bin_s`` (0: each charge apart)."""

    span_s: float
    bin_s: float = 0.0
    charges: deque[list[float]] = field(default_factory=deque)  # [time, tokens], oldest first
    total: float = 0.0

    def charge(self, now: float, tokens: float) -> None:
        if self.bin_s and self.charges and now - self.charges[-1][0] < self.bin_s:
            self.charges[-1][1] += tokens
        else:
            self.charges.append([now, tokens])
        self.total += tokens

    def used(self, now: float) -> float:
        while self.charges and self.charges[0][0] <= now - self.span_s:
            self.total -= self.charges.popleft()[1]
        return max(self.total, 0.0)

    def fits_after(self, now: float, room: float) -> float:
        """Seconds until the window holds at most ``room`` tokens (charges leave it as they age); inf: never."""
        used = self.used(now)
        if used <= room:
            return 0.0
        for at, tokens in self.charges:
            used -= tokens
            if used <= room:  # a charge made a moment after ``now`` (its call took the lock first) ages a span
                return min(max(at + self.span_s - now, 0.0), self.span_s)
        return math.inf

    def reset_s(self, now: float) -> float:
        """Seconds until every charge has left the window."""
        self.used(now)
        return min(max(self.charges[-1][0] + self.span_s - now, 0.0), self.span_s) if self.charges else 0.0


@dataclass
class Account:
    """One client's use of one model: its windows, what it holds, what it was charged."""

    windows: list[tuple[float, Window]]  # (limit, window)
    held: float = 0.0
    prompt: int = 0
    completion: int = 0


@dataclass(frozen=True)
class Answer:
    """A reservation's answer: ``retry_after_s`` is 0 when admitted, inf for a cost above a whole budget."""

    admitted: bool
    id: str
    remaining: int  # -1: no budget
    reset_s: float
    retry_after_s: float

    def line(self) -> str:
        """``admitted id remaining reset_s retry_after_s`` (whole seconds, rounded up; ``-`` for no id, -1 for
        never): what HAProxy's Lua reads, which has no JSON parser."""
        retry = -1 if math.isinf(self.retry_after_s) else math.ceil(self.retry_after_s)
        return f"{int(self.admitted)} {self.id or '-'} {self.remaining} {math.ceil(self.reset_s)} {retry}"


class Ledger:
    """Budgets by client (``{"clients": {name: {"tokens_per_minute", "tokens_per_day"}}, "weights": {"prompt",
    "completion"}}``), reservations and charges. Thread-safe; every change is also a replication event."""

    def __init__(self, budgets: dict[str, Any], origin: str = "local") -> None:
        self.accounts: dict[tuple[str, str], Account] = {}
        self.holds: dict[str, tuple[tuple[str, str], float, float]] = {}  # id -> (account, tokens, since)
        self.lock = threading.RLock()  # reentrant: a reload (SIGHUP) may land while the main thread holds it
        self.origin, self.serial = origin, 0
        self.events: list[dict[str, Any]] = []  # changes not yet sent to the other routers
        self.set_budgets(budgets)

    def set_budgets(self, budgets: dict[str, Any]) -> None:
        """Take new budgets (a reload): each account's windows keep what they counted, under the new limits."""
        with self.lock:
            self.limits = {name: (c.get("tokens_per_minute"), c.get("tokens_per_day"))
                           for name, c in budgets.get("clients", {}).items()}
            weights = budgets.get("weights", {})
            self.prompt_weight = float(weights.get("prompt", 1.0))
            self.completion_weight = float(weights.get("completion", 1.0))
            self.hold_s = float(budgets.get("hold_s", HOLD_S))
            for (client, _), account in self.accounts.items():
                account.windows = self._windows(client, {window.span_s: window for _, window in account.windows})

    def _windows(self, client: str, kept: dict[float, Window]) -> list[tuple[float, Window]]:
        """``client``'s budgets as (limit, window): a minute's, a day's, where it has one; a window ``kept`` by its
        span goes on counting."""
        minute, day = self.limits.get(client, (None, None))
        return [(float(limit), kept.get(span) or Window(span, bin_s))
                for limit, span, bin_s in ((minute, MINUTE_S, 0.0), (day, DAY_S, DAY_BIN_S)) if limit]

    def _account(self, key: tuple[str, str]) -> Account:
        if key not in self.accounts:
            self.accounts[key] = Account(self._windows(key[0], {}))
        return self.accounts[key]

    def reserve(self, client: str, model: str, tokens: float, now: float) -> Answer:
        with self.lock:
            self._expire(now)
            key = (client, model)
            account = self._account(key)
            cost = max(float(tokens), 0.0)
            left = [limit - window.used(now) - account.held for limit, window in account.windows]
            admitted = all(cost <= room for room in left)
            ident = ""
            if admitted:
                self.serial += 1
                ident = f"{self.origin}-{self.serial}"
                self._hold(ident, key, cost, now)
                self.events.append({"op": "hold", "id": ident, "client": client, "model": model, "tokens": cost,
                                    "at": now})
            retry = 0.0
            if not admitted:
                waits = [math.inf if cost > limit else window.fits_after(now, limit - account.held - cost)
                         for limit, window in account.windows]
                retry = max(waits)
                if math.isinf(retry) and cost <= min(limit for limit, _ in account.windows):
                    retry = SETTLE_WAIT_S  # what blocks it is held: it frees as requests end
            remaining = min(left, default=math.inf) - (cost if admitted else 0.0)
            reset = max((window.reset_s(now) for _, window in account.windows), default=0.0)
            return Answer(admitted, ident, int(max(remaining, 0)) if math.isfinite(remaining) else -1, reset, retry)

    def settle(self, ident: str, prompt: int | None, completion: int | None, now: float) -> None:
        with self.lock:
            self._settle(ident, prompt, completion, now)
            self.events.append({"op": "settle", "id": ident, "prompt": prompt, "completion": completion, "at": now})

    def apply(self, event: dict[str, Any]) -> None:
        """A change another router's ledger made (``/replicate``)."""
        with self.lock:
            if event["op"] == "hold" and event["id"] not in self.holds:
                self._hold(event["id"], (event["client"], event["model"]), float(event["tokens"]), event["at"])
            elif event["op"] == "settle":
                self._settle(event["id"], event["prompt"], event["completion"], event["at"])

    def _hold(self, ident: str, key: tuple[str, str], tokens: float, now: float) -> None:
        self.holds[ident] = (key, tokens, now)
        self._account(key).held += tokens

    def _settle(self, ident: str, prompt: int | None, completion: int | None, now: float) -> None:
        hold = self.holds.pop(ident, None)
        if hold is None:
            return
        key, tokens, _ = hold
        account = self._account(key)
        account.held -= tokens
        if prompt is None or completion is None:
            cost = tokens if prompt is None and completion is None else 0.0
        else:
            account.prompt += prompt
            account.completion += completion
            cost = prompt * self.prompt_weight + completion * self.completion_weight
        for _, window in account.windows:
            window.charge(now, cost)

    def _expire(self, now: float) -> None:
        for ident in [i for i, (_, _, since) in self.holds.items() if now - since > self.hold_s]:
            self._settle(ident, None, None, now)

    def metrics(self, now: float) -> str:
        """Each account's counters in Prometheus' text format (:data:`METRICS`)."""
        lines = [f"# HELP gpufleet_router_client_{name} {about}\n# TYPE gpufleet_router_client_{name} {kind}"
                 for name, kind, about in METRICS]
        with self.lock:
            for (client, model), account in sorted(self.accounts.items()):
                labels = f'client="{client}",model="{_label(model)}"'
                lines.append(f"gpufleet_router_client_prompt_tokens_total{{{labels}}} {account.prompt}")
                lines.append(f"gpufleet_router_client_completion_tokens_total{{{labels}}} {account.completion}")
                lines.append(f"gpufleet_router_client_tokens_held{{{labels}}} {account.held:g}")
                for limit, window in account.windows:
                    name = "minute" if window.span_s == MINUTE_S else "day"
                    left = limit - window.used(now) - account.held
                    lines.append(f'gpufleet_router_client_tokens_remaining{{{labels},window="{name}"}} {left:g}')
                    lines.append(f'gpufleet_router_client_token_budget{{{labels},window="{name}"}} {limit:g}')
        return "\n".join(lines) + "\n"

    def snapshot(self) -> dict[str, Any]:
        """The whole state, for a ledger that starts (:meth:`restore`)."""
        with self.lock:
            return {"accounts": [{"client": c, "model": m, "prompt": a.prompt, "completion": a.completion,
                                  "windows": [list(map(list, w.charges)) for _, w in a.windows]}
                                 for (c, m), a in self.accounts.items()],
                    "holds": [{"id": i, "client": k[0], "model": k[1], "tokens": t, "at": at}
                              for i, (k, t, at) in self.holds.items()]}

    def restore(self, state: dict[str, Any]) -> None:
        with self.lock:
            for entry in state.get("accounts", []):
                account = self._account((entry["client"], entry["model"]))
                account.prompt, account.completion = int(entry["prompt"]), int(entry["completion"])
                for (_, window), charges in zip(account.windows, entry["windows"]):
                    for at, tokens in charges:
                        window.charges.append([float(at), float(tokens)])
                        window.total += float(tokens)
            for hold in state.get("holds", []):
                self._hold(hold["id"], (hold["client"], hold["model"]), float(hold["tokens"]), float(hold["at"]))

    def take_events(self) -> list[dict[str, Any]]:
        with self.lock:
            events, self.events = self.events, []
        return events


@dataclass
class Ticket:
    """One request of a fairly shared backend: its client, its cost over the client's share (charged when it is let
    through), when it came, and the event its reservation waits on."""

    backend: str
    client: str
    cost: float
    since: float
    event: threading.Event = field(default_factory=threading.Event)
    through: bool = False


class FairQueue:
    """The requests waiting for a fairly shared backend, let through by their clients' virtual token counters (see
    the module's docstring). Thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # reentrant: a reload (SIGHUP) may land while the main thread holds it
        self.slots: dict[str, int] = {}  # backend -> requests let through at once
        self.shares: dict[str, float] = {}
        self.classes: dict[str, int] = {}  # client -> its class's priority (lowest first)
        self.hold_s = HOLD_S
        self.in_flight: dict[str, int] = {}
        self.counters: dict[str, dict[str, float]] = {}  # backend -> client -> weighed tokens over its share
        self.waiting: dict[str, dict[str, deque[str]]] = {}  # backend -> client -> its tickets, oldest first
        self.tickets: dict[str, Ticket] = {}

    def configure(self, slots: dict[str, int], shares: dict[str, float], classes: dict[str, int],
                  hold_s: float) -> None:
        with self.lock:
            self.slots, self.shares, self.classes, self.hold_s = dict(slots), dict(shares), dict(classes), hold_s
            for backend in list(self.waiting):
                self._let_through(backend)

    def shared(self, backend: str) -> bool:
        return backend in self.slots

    def enter(self, ident: str, backend: str, client: str, tokens: float, now: float) -> Ticket:
        """Queue a request (``tokens``: its reservation's cost); its ticket's event is set when it may go."""
        ticket = Ticket(backend, client, tokens / self.shares.get(client, 1.0), now)
        with self.lock:
            self._expire(now)
            self.tickets[ident] = ticket
            queues = self.waiting.setdefault(backend, {})
            counters = self.counters.setdefault(backend, {})
            if not queues.get(client):  # it starts waiting: no credit for the time it was away
                others = [counters.get(other, 0.0) for other, queue in queues.items() if queue and other != client]
                counters[client] = max([counters.get(client, 0.0), *([min(others)] if others else [])])
            queues.setdefault(client, deque()).append(ident)
            self._let_through(backend)
        return ticket

    def wait(self, ident: str, ticket: Ticket, timeout_s: float) -> bool:
        """Whether the request may go within ``timeout_s``; one that may not has left the queue."""
        if ticket.event.wait(timeout_s):
            return True
        with self.lock:
            if ticket.through:
                return True
            self.waiting[ticket.backend][ticket.client].remove(ident)
            del self.tickets[ident]
            return False

    def release(self, ident: str, tokens: float | None) -> None:
        """A request ended (``tokens``: what it cost, weighed; None: its reservation stands): the next may go."""
        with self.lock:
            ticket = self.tickets.get(ident)
            if ticket is None or not ticket.through:
                return
            del self.tickets[ident]
            self.in_flight[ticket.backend] -= 1
            if tokens is not None:
                counters = self.counters[ticket.backend]
                counters[ticket.client] += tokens / self.shares.get(ticket.client, 1.0) - ticket.cost
            self._let_through(ticket.backend)

    def _let_through(self, backend: str) -> None:
        queues, counters = self.waiting.get(backend, {}), self.counters.setdefault(backend, {})
        while self.in_flight.get(backend, 0) < self.slots.get(backend, 0):
            waiting = [client for client, queue in queues.items() if queue]
            if not waiting:
                return
            client = min(waiting, key=lambda name: (self.classes.get(name, UNCLASSED), counters.get(name, 0.0), name))
            ticket = self.tickets[queues[client].popleft()]
            ticket.through = True
            counters[client] = counters.get(client, 0.0) + ticket.cost
            self.in_flight[backend] = self.in_flight.get(backend, 0) + 1
            ticket.event.set()

    def _expire(self, now: float) -> None:
        """Requests let through and never settled within ``hold_s`` (their answer was lost) free their place."""
        for ident in [i for i, t in self.tickets.items() if t.through and now - t.since > self.hold_s]:
            ticket = self.tickets.pop(ident)
            self.in_flight[ticket.backend] -= 1
            self._let_through(ticket.backend)


def _label(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _context(pem: str, server: bool) -> ssl.SSLContext:
    """TLS between the routers' ledgers: the routers' own certificate on both sides, nothing else admitted."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(pem)
    context.load_verify_locations(pem)
    context.verify_mode = ssl.CERT_REQUIRED
    if not server:
        context.check_hostname = False  # one certificate for every router: its name is none of their addresses
    return context


class Service:
    """The ledger behind its two listeners: HAProxy's calls (loopback) and the other routers' (TLS)."""

    def __init__(self, ledger: Ledger, budgets: dict[str, Any], routers: tuple[str, ...] = (), me: int = 0,
                 pem: str | None = None) -> None:
        self.ledger, self.routers, self.me = ledger, routers, me
        self.fair = FairQueue()
        self.set_budgets(budgets)
        self.client_context = _context(pem, server=False) if pem else None
        self.down_until = [0.0] * len(routers)
        self.connections = threading.local()

    def set_budgets(self, budgets: dict[str, Any]) -> None:
        self.models: dict[str, str] = budgets.get("models", {})  # backend -> served model
        self.max_tokens: dict[str, int] = budgets.get("max_tokens", {})  # backend -> its max_model_len
        self.queue_s = float(budgets.get("queue_s", 0.0))
        self.fair.configure(budgets.get("slots", {}), budgets.get("shares", {}), budgets.get("classes", {}),
                            float(budgets.get("hold_s", HOLD_S)))
        self.ledger.set_budgets(budgets)

    def reserve(self, line: str, now: float) -> str:
        """``client backend prompt_bytes max_tokens`` (max_tokens -1: none sent) -> ``admitted id remaining
        reset_s retry_after_s`` (:meth:`Answer.line`), from the first router that answers; for a fairly shared
        backend, once the request's turn has come (``2 - 0 0 RETRY``: it did not come within ``queue_s``)."""
        client, backend, cost = self._cost(line)
        answer = self._decide(line, client, backend, cost, now)
        admitted, ident, *_ = answer.split()
        if admitted != "1" or not self.fair.shared(backend):
            return answer
        started = time.monotonic()
        if (self.fair.wait(ident, self.fair.enter(ident, backend, client, cost, now), self.queue_s)
                and time.monotonic() - started <= self.queue_s + LATE_S):
            return answer
        # it never went, or its turn came too late for HAProxy, whose wait ends LATE_S after the queue's (a place
        # given to a request the router no longer waits for would be held until hold_s): nothing is charged
        self.settle(f"{ident} error error", time.time())
        return f"2 - 0 0 {math.ceil(self.queue_s)}"

    def decide(self, line: str, now: float) -> str:
        """The budgets' answer to a reservation (:meth:`reserve`'s line), from the first router that answers: what
        another router's ledger asks this one (its fair queue is its own)."""
        return self._decide(line, *self._cost(line), now)

    def _decide(self, line: str, client: str, backend: str, cost: float, now: float) -> str:
        if (answer := self._forward("/reserve", line, now)) is not None:
            return answer
        return self.ledger.reserve(client, self.models.get(backend, backend), cost, now).line()

    def _cost(self, line: str) -> tuple[str, str, float]:
        """A reservation's client, backend and cost: its prompt's bytes and its max_tokens (-1: the backend's
        max_model_len), weighed."""
        client, backend, prompt_bytes, max_tokens = _fields(line, 4)
        completion = int(max_tokens) if int(max_tokens) >= 0 else self.max_tokens.get(backend, 0)
        cost = int(prompt_bytes) * self.ledger.prompt_weight + completion * self.ledger.completion_weight
        return client, backend, cost

    def settle(self, lines: str, now: float) -> str:
        """``id prompt completion`` per line: vLLM's usage, ``- -`` where it reported none (the reservation is
        charged), ``error error`` for an error answer (nothing is). A fairly shared request's end lets the next go."""
        for line in lines.splitlines():
            ident, prompt, completion = _fields(line, 3)
            if prompt == "error":
                self.fair.release(ident, 0.0)
            elif "-" not in (prompt, completion):
                self.fair.release(ident, int(prompt) * self.ledger.prompt_weight
                                  + int(completion) * self.ledger.completion_weight)
            else:
                self.fair.release(ident, None)
        if self._forward("/settle", lines, now) is not None:
            return "ok"
        for line in lines.splitlines():
            ident, prompt, completion = _fields(line, 3)
            if prompt == "error":
                self.ledger.settle(ident, 0, 0, now)
            else:
                self.ledger.settle(ident, None if prompt == "-" else int(prompt),
                                   None if completion == "-" else int(completion), now)
        return "ok"

    def _forward(self, path: str, body: str, now: float) -> str | None:
        """The answer of the first router listed before this one that answers; None: this one decides."""
        for index in range(self.me):
            if self.down_until[index] > now:
                continue
            answer = self._call(self.routers[index], path, body.encode())
            if answer is not None:
                return answer.decode()
            self.down_until[index] = now + DOWN_S
        return None

    def _call(self, router: str, path: str, data: bytes | None = None) -> bytes | None:
        """One call to another router's ledger on this thread's kept connection to it (a TLS handshake per call
        would cost more than the call); None when it does not answer."""
        if self.client_context is None:
            return None
        kept: dict[str, http.client.HTTPSConnection] = self.connections.__dict__.setdefault("by_router", {})
        for attempt in range(2):  # a kept connection the other side closed: once more on a new one
            if router not in kept:
                host, _, port = router.rpartition(":")
                kept[router] = http.client.HTTPSConnection(host.strip("[]"), int(port), timeout=FORWARD_TIMEOUT_S,
                                                           context=self.client_context)
            connection = kept[router]
            try:
                connection.request("POST" if data is not None else "GET", path, body=data)
                answer = connection.getresponse()
                body = answer.read(MAX_SNAPSHOT)
                return bytes(body) if answer.status == 200 else None
            except (OSError, http.client.HTTPException) as exc:
                connection.close()
                del kept[router]
                if attempt or isinstance(exc, TimeoutError):  # a router that is slow to answer is not asked twice
                    return None
        return None

    def catch_up(self) -> bool:
        """Take the state of the first other router that answers (a ledger that starts knows nothing); False: none
        did."""
        for index, router in enumerate(self.routers):
            if index != self.me and (state := self._call(router, "/snapshot")) is not None:
                self.ledger.restore(json.loads(state))
                return True
        return False

    def replicate_forever(self) -> None:
        """Send this ledger's changes to every other router's ledger, a batch every ``REPLICATE_EVERY_S``."""
        others = [router for index, router in enumerate(self.routers) if index != self.me]
        pending: dict[str, list[dict[str, Any]]] = {router: [] for router in others}
        while True:
            time.sleep(REPLICATE_EVERY_S)
            events = self.ledger.take_events()
            for router in others:
                pending[router].extend(events)
                if pending[router] and self._call(router, "/replicate", json.dumps(pending[router]).encode()):
                    pending[router] = []
                del pending[router][:-MAX_PENDING]  # a router away for long takes a snapshot when it returns


def _fields(line: str, count: int) -> list[str]:
    parts = line.split()
    if len(parts) != count or any(len(p) > 255 for p in parts):
        raise ValueError(f"expected {count} fields, found {len(parts)}")
    return parts


def _handler(service: Service, trusted_peer: bool) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            # an answer is one small write after another: without this, each waits for the peer's delayed ACK
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def _answer(self, status: int, text: str, kind: str = "text/plain") -> None:
            data = text.encode()
            head = (f"HTTP/1.1 {status} {self.responses[status][0]}\r\nContent-Type: {kind}\r\n"
                    f"Content-Length: {len(data)}\r\n\r\n")
            self.wfile.write(head.encode() + data)  # one write: the head and the body

        def do_GET(self) -> None:
            if self.path == "/metrics" and not trusted_peer:
                self._answer(200, service.ledger.metrics(time.time()), "text/plain; version=0.0.4")
            elif self.path == "/snapshot" and trusted_peer:
                self._answer(200, json.dumps(service.ledger.snapshot()), "application/json")
            else:
                self._answer(404, "not found\n")

        def _body(self) -> bytes | None:
            """The request's body, with a length or chunked (HAProxy's HTTP client sends chunks); None: too large."""
            if "chunked" not in self.headers.get("Transfer-Encoding", "").lower():
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if 0 <= length <= MAX_BODY else None
            body = b""
            while size := int(self.rfile.readline(64).split(b";")[0].strip() or b"0", 16):
                if len(body) + size > MAX_BODY:
                    return None
                body += self.rfile.read(size)
                self.rfile.readline(64)
            while self.rfile.readline(1024).strip():  # the trailer, to its empty line
                pass
            return body

        def do_POST(self) -> None:
            data = self._body()
            if data is None:
                self._answer(413, "too large\n")
                self.close_connection = True
                return
            body = data.decode("utf-8", "replace")
            now = time.time()
            try:
                if self.path == "/reserve":  # a peer's call is decided here; its request waits in its own queue
                    self._answer(200, service.decide(body, now) if trusted_peer else service.reserve(body, now))
                elif self.path == "/settle":
                    self._answer(200, service.settle(body, now))
                elif self.path == "/replicate" and trusted_peer:
                    for event in json.loads(body):
                        service.ledger.apply(event)
                    self._answer(200, "ok")
                else:
                    self._answer(404, "not found\n")
            except (ValueError, KeyError, TypeError) as exc:
                self._answer(400, f"{type(exc).__name__}\n")

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


def _save_and_exit(ledger: Ledger, path: str) -> None:
    """Write the state (one rename: a reader never sees half of it), then exit: what a restart starts from when no
    other router's ledger answers."""
    staged = f"{path}.tmp"
    with open(staged, "w", encoding="utf-8") as out:
        json.dump(ledger.snapshot(), out)
    os.replace(staged, path)
    sys.exit(0)


def _read(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return dict(json.load(f))


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", required=True, help="the budgets' JSON file")
    parser.add_argument("--listen", required=True, type=_address, help="HAProxy's side: 127.0.0.1:PORT")
    parser.add_argument("--routers", default="", help="every router's ledger, ADDR:PORT,... in the authority's order")
    parser.add_argument("--self", dest="me", type=int, default=0, help="this router's place in --routers")
    parser.add_argument("--pem", help="the routers' certificate and key (TLS between ledgers)")
    parser.add_argument("--state", help="where the state is saved when the ledger stops, and read when it starts")
    args = parser.parse_args(argv)
    budgets = _read(args.budgets)
    routers = tuple(r for r in args.routers.split(",") if r)
    ledger = Ledger(budgets, origin=f"r{args.me}-{int(time.time())}")
    service = Service(ledger, budgets, routers, args.me, args.pem)
    signal.signal(signal.SIGHUP, lambda *_: service.set_budgets(_read(args.budgets)))  # systemctl reload, from now
    servers = [ThreadingHTTPServer(args.listen, _handler(service, trusted_peer=False))]
    if routers and args.pem:
        peer_server = ThreadingHTTPServer(_address(routers[args.me]), _handler(service, trusted_peer=True))
        peer_server.socket = _context(args.pem, server=True).wrap_socket(peer_server.socket, server_side=True)
        servers.append(peer_server)
    if not (routers and args.pem and service.catch_up()) and args.state and os.path.exists(args.state):
        ledger.restore(_read(args.state))
    if args.state:
        signal.signal(signal.SIGTERM, lambda *_: _save_and_exit(ledger, args.state))
    for server in servers:
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
    service.replicate_forever()  # until systemd stops the service
    return 0


if __name__ == "__main__":
    sys.exit(main())
