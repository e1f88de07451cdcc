"""The lab's bounded request load (lab/gpufleet_lab/request_load.py) against a small HTTP stand-in for vLLM."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import pytest
from gpufleet_lab.request_load import (
    BACKLOG_MAX_S,
    BACKLOG_MAX_STREAMS,
    BURST_MAX,
    CONVERSATION_TURNS,
    PROBES_MAX,
    Backlogged,
    RequestLoad,
    backlog,
    burst,
    first_tokens,
)

from tests.loopback_http import QuietHandler, loopback_server

KEY = 'sk-"lab"$HOME'


class Seen:
    """What the stand-in received, and how it answers."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.paths: list[str] = []
        self.auth: set[str | None] = set()
        self.chat_status = 200
        self.chat_done = True
        self.chats: list[list[dict[str, str]]] = []


@pytest.fixture
def vllm() -> Iterator[tuple[str, Seen]]:
    seen = Seen()

    class Handler(QuietHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with seen.lock:
                seen.paths.append(self.path)
                seen.auth.add(self.headers.get("Authorization"))
            if self.path == "/v1/chat/completions":
                assert body["stream"] is True
                with seen.lock:
                    seen.chats.append(body["messages"])
                    n = len(seen.chats)
                status = seen.chat_status
                chunk = json.dumps({"choices": [{"delta": {"content": f"hi {n}"}}]})
                text = f"data: {chunk}\n\n" + ("data: [DONE]\n\n" if seen.chat_done else "")
            else:
                status, text = 200, json.dumps({"usage": {"completion_tokens": body["max_tokens"]}})
            self.answer(status, text.encode())

    with loopback_server(Handler) as url:
        yield url, seen


def test_streams_alternate_completions_and_streamed_chats_up_to_their_limit(vllm: tuple[str, Seen]) -> None:
    url, seen = vllm
    load = RequestLoad(url, "tiny llama $HOME 100%", KEY, streams=2, pause_s=0.01, limit=4, chat=True).start()
    assert load.join(10)
    figures = load.figures()
    assert (figures["requests"], figures["failed"]) == (8, 0), load.failures
    assert figures["p50_s"] is not None and figures["p99_s"] >= figures["p50_s"]
    assert sorted(seen.paths) == ["/v1/chat/completions"] * 4 + ["/v1/completions"] * 4
    assert seen.auth == {f"Bearer {KEY}"}


def test_a_streams_chats_are_the_turns_of_its_conversations(vllm: tuple[str, Seen]) -> None:
    """Each chat resends its conversation (a unique opening, the answers, the user's turns) with a new message;
    after CONVERSATION_TURNS turns the stream opens a new conversation."""
    url, seen = vllm
    load = RequestLoad(url, "m", None, pause_s=0.01, limit=2 * (CONVERSATION_TURNS + 1), chat=True).start()
    assert load.join(10) and load.failures == []
    chats = seen.chats
    assert [len(messages) for messages in chats] == [1, 3, 5, 1]
    assert chats[1][:2] == [chats[0][0], {"role": "assistant", "content": "hi 1"}]
    assert chats[2][:4] == chats[1] + [{"role": "assistant", "content": "hi 2"}]
    assert [m["role"] for m in chats[2]] == ["user", "assistant"] * 2 + ["user"]
    assert chats[3][0]["content"] != chats[0][0]["content"]  # a new conversation opens differently


@pytest.mark.parametrize(("status", "done", "failure"), [
    (503, True, "HTTPError: HTTP Error 503"),
    (200, False, "ValueError: the stream ended without data: [DONE]"),
])
def test_a_failed_answer_is_counted_with_what_was_wrong(vllm: tuple[str, Seen], status: int, done: bool,
                                                         failure: str) -> None:
    url, seen = vllm
    seen.chat_status, seen.chat_done = status, done
    load = RequestLoad(url, "m", None, pause_s=0.01, limit=4, chat=True).start()
    assert load.join(10)
    assert load.figures()["requests"] == 4 and len(load.failures) == 2, load.failures
    assert all(f.startswith(failure) for f in load.failures), load.failures
    assert seen.auth == {None}


def test_a_load_without_an_answer_stops_by_itself_within_its_time() -> None:
    load = RequestLoad("http://127.0.0.1:9", "m", None, pause_s=0.05, limit_s=0.5, limit=10_000,
                       timeout_s=1).start()
    started = time.monotonic()
    assert load.join(10)
    assert time.monotonic() - started < 5
    figures = load.figures()
    assert figures["requests"] == figures["failed"] > 0 and figures["p50_s"] is None
    assert load.failures[0].startswith("URLError")


def test_each_answer_keeps_when_it_was_sent_and_its_status(vllm: tuple[str, Seen]) -> None:
    url, seen = vllm
    seen.chat_status = 401
    load = RequestLoad(url, "m", None, pause_s=0.01, limit=4, chat=True).start()
    assert load.join(10)
    assert [a.status for a in load.answers] == [401, 200, 401, 200]  # a streamed chat first, then a completion
    assert [a.sent for a in load.answers] == sorted(a.sent for a in load.answers)
    assert load.failures_sent_after(load.answers[1].sent) == [load.answers[2].failure]
    assert load.failures_sent_after(time.monotonic()) == []


def test_a_burst_reaches_the_server_at_one_instant_and_keeps_every_refusal() -> None:
    admitted, lock, bodies = [0], threading.Lock(), []

    class Handler(QuietHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                bodies.append(body)
                admitted[0] += 1
                first = admitted[0] <= 3
            if first:
                time.sleep(0.3)
                self.answer(200, json.dumps({"usage": {"completion_tokens": body["max_tokens"]}}).encode())
            else:
                self.send_response(429)
                self.send_header("Retry-After", "1")
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

    with loopback_server(Handler) as url:
        answers = burst(url, "tiny llama $HOME 100%", KEY, 12, max_tokens=5, timeout_s=10)
    assert sorted(a.status or 0 for a in answers) == [200] * 3 + [429] * 9
    assert {a.retry_after for a in answers if a.status == 429} == {"1"}
    assert all(a.failure is None for a in answers if a.status == 200)
    assert max(a.sent for a in answers) - min(a.sent for a in answers) < 0.2
    assert max(a.took_s for a in answers if a.status == 429) < max(a.took_s for a in answers if a.status == 200)
    assert {(b["model"], b["max_tokens"], b["ignore_eos"]) for b in bodies} == {("tiny llama $HOME 100%", 5, True)}


@pytest.mark.parametrize("count", [0, BURST_MAX + 1])
def test_a_burst_is_bounded(count: int) -> None:
    with pytest.raises(ValueError, match="a burst sends"):
        burst("http://127.0.0.1:9", "m", None, count)


def test_a_burst_without_a_server_says_why_each_request_was_not_sent() -> None:
    answers = burst("http://127.0.0.1:9", "m", None, 3, timeout_s=2)
    assert len(answers) == 3 and all(a.status is None and a.failure for a in answers)


def test_a_backlog_keeps_each_clients_loops_sending_on_kept_connections_until_its_time() -> None:
    """Each client's loops send back to back on connections kept open (one per loop), each answer kept by client
    with its tokens, a refusal too; every loop stops by itself once the time is over."""
    lock, seen = threading.Lock(), {"auth": [], "ports": set(), "bodies": []}

    class Handler(QuietHandler):
        protocol_version = "HTTP/1.1"  # connections kept open between requests

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                seen["auth"].append(self.headers["Authorization"])
                seen["ports"].add(self.client_address[1])
                seen["bodies"].append(body)
            time.sleep(0.02)
            if self.headers["Authorization"] == "Bearer refused":
                self.answer(503, b"{}")
                return
            usage = {"prompt_tokens": 3, "completion_tokens": body["max_tokens"],
                     "total_tokens": 3 + body["max_tokens"]}
            self.answer(200, json.dumps({"usage": usage}).encode())

    clients = {"a": Backlogged("ka", 4, 2), "b": Backlogged("kb", 16, 1), "c": Backlogged("refused", 8, 1)}
    with loopback_server(Handler) as url:
        started = time.monotonic()
        answers = backlog(url, "tiny llama $HOME 100%", clients, 1.0, timeout_s=5)
        took = time.monotonic() - started
    assert 1.0 <= took < 2.0
    assert {a.tokens for a in answers["a"]} == {7} and {a.tokens for a in answers["b"]} == {19}
    assert len(answers["a"]) > len(answers["b"]) >= 10 and all(a.status == 200 for a in answers["a"] + answers["b"])
    assert answers["c"] and {a.status for a in answers["c"]} == {503} and len(answers["c"]) <= 11  # no spin
    assert len(seen["ports"]) == 4  # one connection per loop, kept
    assert seen["auth"].count("Bearer ka") == len(answers["a"])
    assert {(b["model"], b["ignore_eos"]) for b in seen["bodies"]} == {("tiny llama $HOME 100%", True)}
    assert max(a.sent + a.took_s for a in answers["a"]) <= started + 1.0 + 0.1


@pytest.mark.parametrize(("streams", "seconds"), [(0, 1.0), (BACKLOG_MAX_STREAMS + 1, 1.0), (1, 0.0),
                                                  (1, BACKLOG_MAX_S + 1)])
def test_a_backlog_is_bounded(streams: int, seconds: float) -> None:
    with pytest.raises(ValueError, match="a backlog runs"):
        backlog("http://127.0.0.1:9", "m", {"a": Backlogged("k", 1, streams)}, seconds)


def _streaming_handler(delay_s: float, done: bool) -> type[QuietHandler]:
    class Handler(QuietHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert body["stream"] is True and body["max_tokens"] == 2
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for chunk in (b"data: {}\n\n", b"", b"data: [DONE]\n\n" if done else b"data: {}\n\n"):
                if chunk:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                time.sleep(delay_s)
            self.wfile.write(b"0\r\n\r\n")
    return Handler


def test_first_tokens_times_each_streamed_answer_to_its_first_chunk_not_its_end() -> None:
    with loopback_server(_streaming_handler(0.2, done=True)) as url:
        found = first_tokens(url, "m", KEY, 3, pause_s=0.0, timeout_s=5)
    assert len(found) == 3 and all(seconds < 0.15 for seconds in found), found  # each answer takes 0.4 s


def test_first_tokens_refuses_a_stream_that_never_ends() -> None:
    with loopback_server(_streaming_handler(0.0, done=False)) as url, pytest.raises(ValueError, match="probe 0"):
        first_tokens(url, "m", KEY, 1, timeout_s=5)


@pytest.mark.parametrize("count", [0, PROBES_MAX + 1])
def test_a_probe_is_bounded(count: int) -> None:
    with pytest.raises(ValueError, match="a probe sends"):
        first_tokens("http://127.0.0.1:9", "m", None, count)
