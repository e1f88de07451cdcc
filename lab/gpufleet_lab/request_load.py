"""A bounded load of OpenAI API requests: what must keep answering while the lab's fleet is changed under it.

A few streams, each sending one request, waiting for its whole answer, then ``pause_s`` before the next: a
completion, or (with ``chat``) a completion and a streamed chat in turn. A stream's chats are the turns of its
conversation: each resends the history (its opening, unique to the conversation, the answers and the user's
messages) with a new message, and after CONVERSATION_TURNS turns the stream opens another. Every stream stops
by itself after ``limit_s`` or ``limit`` requests, whichever comes first, or when :meth:`RequestLoad.stop` is
called. An answer counts as failed when it is not a 200, when a completion returns no token, or when a stream does
not end with ``data: [DONE]``. Each answer keeps when it was sent and its status, so that a test can tell the
requests sent before a fault from those sent after it. :func:`burst` sends many requests at one instant instead:
what admission control must answer at once; :func:`backlog` keeps several clients' requests waiting for a while
instead: what a fair edge must share; :func:`first_tokens` times one client's streamed answers to their first
token. Standard library only; the lab's tests and ``bench/`` drive it.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

PROMPT = "The fleet is"
BURST_MAX = 400  # requests one burst may send
BACKLOG_MAX_STREAMS = 200  # request loops one backlog may run, all its clients together
BACKLOG_MAX_S = 600.0  # how long one backlog may run
PROBES_MAX = 400  # streamed requests one probe may send
CONVERSATION_TURNS = 3  # chats of one conversation (the lab's max_model_len holds them)


@dataclass(frozen=True)
class Answer:
    """One request: when it was sent (monotonic clock), how long its answer took, its HTTP status (None: none came),
    its Retry-After header, and why it failed (None: it did not)."""

    sent: float
    took_s: float
    status: int | None
    failure: str | None = None
    retry_after: str | None = None
    tokens: int | None = None  # a 200's usage, prompt and completion (total_tokens), where its body says it
    remaining_tokens: str | None = None  # its x-ratelimit-remaining-tokens header (a client with a token budget)


class RequestLoad:
    """``streams`` request loops against one OpenAI-compatible base URL (a replica, or the router)."""

    def __init__(self, url: str, model: str, key: str | None, *, streams: int = 1, pause_s: float = 3.0,
                 limit_s: float = 900.0, limit: int = 400, chat: bool = False, timeout_s: float = 300.0,
                 ca_file: str | None = None) -> None:
        """``ca_file``: the CA that an ``https://`` URL's certificate must chain to (else the system's)."""
        self.url, self.model, self.key, self.chat = url.rstrip("/"), model, key, chat
        self._tls = ssl.create_default_context(cafile=ca_file) if self.url.startswith("https://") else None
        self.streams, self.pause_s, self.limit_s, self.limit, self.timeout_s = (streams, pause_s, limit_s, limit,
                                                                                timeout_s)
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(streams)]
        self.sent = 0
        self.failures: list[str] = []
        self.latencies: list[float] = []
        self.answers: list[Answer] = []

    def start(self) -> RequestLoad:
        for thread in self._threads:
            thread.start()
        return self

    def join(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for every stream to end by itself; whether they all did."""
        end = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, end - time.monotonic()))
        return not any(thread.is_alive() for thread in self._threads)

    def stop(self) -> None:
        """Stop every stream after its request in flight (waits at most that request's timeout)."""
        self._done.set()
        for thread in self._threads:
            thread.join(self.timeout_s + 10)

    def one(self, n: int, conversation: list[dict[str, str]] | None = None) -> None:
        """Request ``n`` of a stream; raises on a failed answer. A streamed chat is the next turn of
        ``conversation`` (its messages so far), which gains the turn and its answer."""
        streamed = self.chat and n % 2 == 1
        turn: list[dict[str, str]] = []
        if streamed:
            history = conversation if conversation is not None else []
            if len(history) >= 2 * CONVERSATION_TURNS:
                history.clear()
            turn = [{"role": "user", "content": f"Say hello, {uuid.uuid4().hex[:12]}" if not history
                     else f"And then? ({len(history) // 2})"}]
            path = "/v1/chat/completions"
            body: dict[str, Any] = {"model": self.model, "max_tokens": 8, "stream": True,
                                    "messages": [*history, *turn]}
        else:
            path, body = "/v1/completions", {"model": self.model, "prompt": PROMPT, "max_tokens": 8}
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        if self.key:
            request.add_header("Authorization", f"Bearer {self.key}")
        with urllib.request.urlopen(request, timeout=self.timeout_s, context=self._tls) as response:
            text = response.read().decode()
        if streamed:
            if not text.rstrip().endswith("data: [DONE]"):
                raise ValueError(f"the stream ended without data: [DONE]: {text[-200:]!r}")
            if conversation is not None:
                conversation.extend([*turn, {"role": "assistant", "content": streamed_text(text)}])
        elif not json.loads(text)["usage"]["completion_tokens"]:
            raise ValueError(f"no completion token: {text[:200]!r}")

    def _loop(self) -> None:
        end, n = time.monotonic() + self.limit_s, 0
        conversation: list[dict[str, str]] = []
        while not self._done.is_set() and time.monotonic() < end and n < self.limit:
            n += 1
            started = time.monotonic()
            failure: str | None = None
            status: int | None = 200
            try:
                self.one(n, conversation)
            except (OSError, ValueError, KeyError, TypeError, http.client.HTTPException) as exc:
                detail = exc.read().decode(errors="replace")[:200] if isinstance(exc, urllib.error.HTTPError) else ""
                failure = f"{type(exc).__name__}: {str(exc)[:200]} {detail}".rstrip()
                status = exc.code if isinstance(exc, urllib.error.HTTPError) else None
            took = time.monotonic() - started
            with self._lock:
                self.sent += 1
                self.answers.append(Answer(started, took, status, failure))
                if failure is None:
                    self.latencies.append(took)
                else:
                    self.failures.append(failure)
            self._done.wait(self.pause_s)

    def failures_sent_after(self, moment: float) -> list[str]:
        """Why each request sent at or after ``moment`` (monotonic clock) failed."""
        with self._lock:
            return [a.failure for a in self.answers if a.failure is not None and a.sent >= moment]

    def figures(self) -> dict[str, Any]:
        """Requests sent and failed, and the latency of the answered ones (median and 99th percentile, s)."""
        with self._lock:
            times = sorted(self.latencies)
            sent, failed = self.sent, len(self.failures)
        if not times:
            return {"requests": sent, "failed": failed, "p50_s": None, "p99_s": None}
        return {"requests": sent, "failed": failed, "p50_s": round(times[len(times) // 2], 2),
                "p99_s": round(times[min(len(times) - 1, int(len(times) * 0.99))], 2)}


def streamed_text(stream: str) -> str:
    """The text of a streamed chat completion: its chunks' content deltas, joined."""
    parts = []
    for line in stream.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:]).get("choices", []):
                parts.append(choice.get("delta", {}).get("content") or "")
    return "".join(parts)


def _total_tokens(text: str) -> int | None:
    """The usage's total_tokens of an answer's JSON body; None where it has none."""
    try:
        return int(json.loads(text)["usage"]["total_tokens"])
    except (ValueError, KeyError, TypeError):
        return None


def _connection(target: urllib.parse.SplitResult, tls: ssl.SSLContext | None,
                timeout_s: float) -> http.client.HTTPConnection:
    """A connection (not opened yet) to ``target``'s host and port: TLS with ``tls``, else plain."""
    host, port = target.hostname or "", target.port or (443 if target.scheme == "https" else 80)
    if tls is not None:
        return http.client.HTTPSConnection(host, port, timeout=timeout_s, context=tls)
    return http.client.HTTPConnection(host, port, timeout=timeout_s)


def burst(url: str | Sequence[str], model: str, key: str | None, count: int, *, max_tokens: int = 8,
          timeout_s: float = 60.0, ca_file: str | None = None) -> list[Answer]:
    """``count`` completions (at most BURST_MAX) sent at one instant: each on a connection of its own, opened
    beforehand (TLS included), so that all of them reach the server within a few milliseconds; with several
    ``url`` (routers), the requests go to each in turn. Each answer is kept as it came, a refusal included; the
    completions are ``max_tokens`` long whatever the model samples."""
    if not 0 < count <= BURST_MAX:
        raise ValueError(f"a burst sends 1 to {BURST_MAX} requests, not {count}")
    targets = [urllib.parse.urlsplit(one.rstrip("/")) for one in ([url] if isinstance(url, str) else url)]
    tls = ssl.create_default_context(cafile=ca_file) if targets[0].scheme == "https" else None
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True}).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    ready = threading.Barrier(count + 1, timeout=timeout_s)
    answers: list[Answer | None] = [None] * count

    def one(index: int) -> None:
        parsed = targets[index % len(targets)]
        connection = _connection(parsed, tls, timeout_s)
        failure = None
        try:
            connection.connect()
        except OSError as exc:
            failure = f"{type(exc).__name__}: {str(exc)[:200]}"
        try:
            ready.wait()
        except threading.BrokenBarrierError:
            failure = failure or "the burst's connections were not all open in time"
        sent = time.monotonic()
        try:
            if failure is not None:
                answers[index] = Answer(sent, 0.0, None, failure)
                return
            connection.request("POST", parsed.path + "/v1/completions", body, headers)
            response = connection.getresponse()
            text = response.read().decode(errors="replace")
            answers[index] = Answer(sent, time.monotonic() - sent, response.status,
                                    None if response.status == 200 else f"HTTP {response.status}: {text[:200]}",
                                    response.getheader("Retry-After"), _total_tokens(text),
                                    response.getheader("x-ratelimit-remaining-tokens"))
        except (OSError, http.client.HTTPException) as exc:
            answers[index] = Answer(sent, time.monotonic() - sent, None, f"{type(exc).__name__}: {str(exc)[:200]}")
        finally:
            connection.close()

    threads = [threading.Thread(target=one, args=(index,), daemon=True) for index in range(count)]
    for thread in threads:
        thread.start()
    with contextlib.suppress(threading.BrokenBarrierError):  # each connection says why it was not sent
        ready.wait()
    for thread in threads:
        thread.join(timeout_s + 10)
    return [answer for answer in answers if answer is not None]


@dataclass(frozen=True)
class Backlogged:
    """One client of a backlog: its key, each of its completions' length in tokens, and how many loops send them."""

    key: str
    max_tokens: int
    streams: int


def backlog(url: str, model: str, clients: Mapping[str, Backlogged], seconds: float, *,
            timeout_s: float = 60.0, ca_file: str | None = None) -> dict[str, list[Answer]]:
    """Each client's ``streams`` loops send completions back to back for ``seconds`` (at most BACKLOG_MAX_S; with
    BACKLOG_MAX_STREAMS loops at most, all clients together), each loop on a connection of its own kept open
    between its requests (a new one after a failure): so a client always has requests waiting, and the loops'
    own work (TLS handshakes) stays out of what the server is measured on. Every answer is kept, by client, a
    refusal included; an answer's ``sent`` plus its ``took_s`` is when it ended."""
    streams = sum(client.streams for client in clients.values())
    if not 0 < seconds <= BACKLOG_MAX_S or not 0 < streams <= BACKLOG_MAX_STREAMS:
        raise ValueError(f"a backlog runs 1 to {BACKLOG_MAX_STREAMS} loops for at most {BACKLOG_MAX_S:.0f} s,"
                         f" not {streams} for {seconds} s")
    target = urllib.parse.urlsplit(url.rstrip("/"))
    tls = ssl.create_default_context(cafile=ca_file) if target.scheme == "https" else None
    end = time.monotonic() + seconds
    answers: dict[str, list[Answer]] = {name: [] for name in clients}
    lock = threading.Lock()

    def loop(name: str, client: Backlogged) -> None:
        body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": client.max_tokens,
                           "ignore_eos": True}).encode()
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {client.key}"}
        connection = _connection(target, tls, timeout_s)
        while time.monotonic() < end:
            sent = time.monotonic()
            try:
                connection.request("POST", target.path + "/v1/completions", body, headers)
                response = connection.getresponse()
                text = response.read().decode(errors="replace")
                answer = Answer(sent, time.monotonic() - sent, response.status,
                                None if response.status == 200 else f"HTTP {response.status}: {text[:200]}",
                                response.getheader("Retry-After"), _total_tokens(text))
            except (OSError, http.client.HTTPException) as exc:
                answer = Answer(sent, time.monotonic() - sent, None, f"{type(exc).__name__}: {str(exc)[:200]}")
                connection.close()
                connection = _connection(target, tls, timeout_s)
            with lock:
                answers[name].append(answer)
            if answer.status != 200:
                time.sleep(0.1)  # a refusal comes at once: its loop must not spin on it
        connection.close()

    threads = [threading.Thread(target=loop, args=(name, client), daemon=True)
               for name, client in clients.items() for _ in range(client.streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, end - time.monotonic()) + timeout_s + 10)
    return answers


def first_tokens(url: str, model: str, key: str | None, count: int, *, prompt: str = PROMPT, pause_s: float = 0.2,
                 timeout_s: float = 60.0, ca_file: str | None = None) -> list[float]:
    """``count`` streamed completions (at most PROBES_MAX) one after another, ``pause_s`` apart, on one connection
    kept open: the seconds from each request sent to the first chunk of its answer (its time to first token).
    Raises on an answer that is not a 200 or a stream that does not end with ``data: [DONE]``."""
    if not 0 < count <= PROBES_MAX:
        raise ValueError(f"a probe sends 1 to {PROBES_MAX} requests, not {count}")
    target = urllib.parse.urlsplit(url.rstrip("/"))
    tls = ssl.create_default_context(cafile=ca_file) if target.scheme == "https" else None
    connection = _connection(target, tls, timeout_s)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    found = []
    try:
        for n in range(count):
            body = json.dumps({"model": model, "prompt": f"{n}: {prompt}", "max_tokens": 2, "stream": True})
            sent = time.monotonic()
            connection.request("POST", target.path + "/v1/completions", body.encode(), headers)
            response = connection.getresponse()
            first, last = None, b""
            for line in iter(response.readline, b""):
                if first is None and line.startswith(b"data: {"):
                    first = time.monotonic() - sent
                last = line.strip() or last
            if response.status != 200 or first is None or last != b"data: [DONE]":
                raise ValueError(f"probe {n}: HTTP {response.status}, the stream ended on {last[:200]!r}")
            found.append(first)
            time.sleep(pause_s)
    finally:
        connection.close()
    return found
