"""router_policy prefix, run by a real HAProxy (Debian's) on loopback with the configuration the router role renders
for one model on three stand-in replicas (:class:`tests.tools.haproxy_run.FakeReplica`: ``/health``, and each
completion answered with the replica's name). A chat client resends a conversation's history with every turn.
The planner's rules and the rendered text: tests/unit/plan/test_router_policy.py."""

from __future__ import annotations

import concurrent.futures
import difflib
import json
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import roles.router as router_role
from gpufleet.config.schema import HostConfig
from gpufleet.node import router_admin
from gpufleet.plan import backends as plan_backends
from tests.loopback_http import loopback_server
from tests.tools.haproxy_run import (
    FakeReplica,
    json_answer,
    loopback_plan,
    loopback_router_config,
    running_haproxy,
    stand_ins,
    wait,
)
from tests.unit.configs import host_config

MODEL = "chat-model"
NAMES = ("r-0", "r-1", "r-2")
SYSTEM = "You are a helpful assistant; answer in one sentence."
CONVERSATIONS = 12
PROMPT_KEY_BYTES = 256  # of a completion's prompt, the part the router hashes
WIDE_BALANCE = 10  # router_prefix_balance's largest: a replica may hold ten times its share of the requests


@dataclass
class PrefixRouter:
    cfg: HostConfig
    socket: Path
    backend: str
    replicas: dict[str, FakeReplica]
    ports: dict[str, int]
    stops: dict[str, ExitStack]

    def answered_by(self, path: str, body: dict[str, Any]) -> str:
        """The replica that answered ``body`` (200 expected)."""
        request = urllib.request.Request(f"http://127.0.0.1:{self.cfg.router_port}{path}", method="POST",
                                         data=json.dumps({"model": MODEL, **body}).encode(),
                                         headers={"Content-Type": "application/json"})
        status, answer = json_answer(request)
        assert status == 200, answer
        return str(answer["replica"])

    def complete(self, prompt: str) -> str:
        return self.answered_by("/v1/completions", {"prompt": prompt, "max_tokens": 1})

    def status(self) -> dict[str, str]:
        return {s.server: s.status for s in router_admin.Runtime(str(self.socket)).servers()}

    def set_state(self, name: str, state: str) -> None:
        router_admin.set_state(router_admin.Runtime(str(self.socket)), self.backend, name, state)

    def stop(self, name: str) -> None:
        """The stand-in stops: its port refuses connections."""
        self.stops[name].close()

    def start(self, name: str) -> None:
        """The stand-in serves again, on its port."""
        self.stops[name] = ExitStack()
        self.stops[name].enter_context(loopback_server(self.replicas[name].handler(), self.ports[name]))


@dataclass
class Chat:
    """One conversation: a system message when ``number`` is even, then user turns and the answers to them."""

    number: int
    messages: list[dict[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.number % 2 == 0:
            self.messages.append({"role": "system", "content": SYSTEM})

    def turn(self, router: PrefixRouter) -> str:
        """The next turn, sent with the whole history; the replica that answered it."""
        turn = sum(m["role"] == "user" for m in self.messages)
        self.messages.append({"role": "user", "content": f"Conversation {self.number}, turn {turn}: and then?"})
        replica = router.answered_by("/v1/chat/completions", {"messages": self.messages, "max_tokens": 8})
        self.messages.append({"role": "assistant", "content": f"Answer {turn} from {replica}."})
        return replica


def _values(cfg: HostConfig, ports: dict[str, int], policy: str, balance: float = 1.25) -> dict[str, Any]:
    """The role's configuration values for MODEL on the NAMES stand-ins (at ``ports``), with ``policy`` and
    router_prefix_balance ``balance``."""
    configs = {name: host_config(vllm_served_model_name=MODEL, router_policy=policy, router_prefix_balance=balance)
               for name in NAMES}
    found = plan_backends.backends(loopback_plan(ports, configs))
    return router_role.config_values(cfg, "127.0.0.1", found, router_role.model_lists({None: [MODEL]}), [],
                                     dict.fromkeys(NAMES, 8))


@contextmanager
def _router(workdir: Path, policy: str, balance: float = 1.25) -> Iterator[PrefixRouter]:
    """HAProxy with the role's configuration: MODEL on the NAMES stand-ins, with ``policy`` and ``balance``."""
    replicas, stops, ports = stand_ins(NAMES)
    cfg = loopback_router_config()
    values = _values(cfg, ports, policy, balance)
    try:
        with running_haproxy(values, workdir) as socket:
            started = PrefixRouter(cfg, socket, values["backends"][0]["name"], replicas, ports, stops)
            wait(lambda: set(started.status().values()) == {"UP"}, "every replica UP")
            yield started
    finally:
        for stack in stops.values():
            stack.close()


@pytest.fixture
def router(tmp_path: Path) -> Iterator[PrefixRouter]:
    """prefix with a wide bound: a request answered a moment ago may still count as in flight at the router, and
    with a request or two at once the default bound would pass the next one of its replica on (see
    test_the_bound_passes_requests_on_from_a_replica_that_holds_too_many)."""
    with _router(tmp_path, "prefix", WIDE_BALANCE) as started:
        yield started


def _opened(router: PrefixRouter) -> dict[int, tuple[Chat, str]]:
    """CONVERSATIONS chats, each after its first turn, and the replica that answered it, by number."""
    chats = [Chat(number) for number in range(CONVERSATIONS)]
    return {chat.number: (chat, chat.turn(router)) for chat in chats}


def test_each_conversation_stays_on_one_replica_and_the_conversations_spread(router: PrefixRouter) -> None:
    chats = [Chat(number) for number in range(CONVERSATIONS)]
    answered: dict[int, list[str]] = {chat.number: [] for chat in chats}
    for turn in range(4):  # turn by turn across the conversations, of two to four turns each
        for chat in chats:
            if turn < 2 + chat.number % 3:
                answered[chat.number].append(chat.turn(router))
    assert all(len(set(replicas)) == 1 for replicas in answered.values()), answered
    assert {replicas[0] for replicas in answered.values()} == set(NAMES), answered
    # one system message opens every even conversation: their first user messages tell them apart
    assert len({replicas[0] for number, replicas in answered.items() if number % 2 == 0}) > 1, answered


def test_completions_that_share_their_first_256_bytes_go_to_one_replica(router: PrefixRouter) -> None:
    heads = [f"Document {number}: " + "the same long preamble, " * 12 for number in range(8)]
    assert all(len(head) > PROMPT_KEY_BYTES for head in heads)
    tails = ("", " Summarize it.", " Translate it into French, then list its three main points.")
    answered = {head: {router.complete(head[:PROMPT_KEY_BYTES] + tail) for tail in tails} for head in heads}
    assert all(len(replicas) == 1 for replicas in answered.values()), answered
    assert len(set().union(*answered.values())) > 1, answered  # the key is the prompt's, not one for all
    tokens = [router.answered_by("/v1/completions", {"prompt": [1, 2, 3]}) for _ in range(6)]
    assert len(set(tokens)) > 1, tokens  # no key in a prompt of token ids: round robin


def _home(opened: dict[int, tuple[Chat, str]]) -> str:
    """The replica that answers the most of the opened conversations."""
    homes = [replica for _, replica in opened.values()]
    return max(NAMES, key=homes.count)


@pytest.mark.parametrize("state", ["drain", "maint"])
def test_a_drained_replica_gets_no_new_request_and_its_conversations_come_back(router: PrefixRouter,
                                                                              state: str) -> None:
    opened = _opened(router)
    home = _home(opened)
    router.set_state(home, state)
    posts = router.replicas[home].posts
    moved = {number: chat.turn(router) for number, (chat, replica) in opened.items() if replica == home}
    stayed = {number: (chat.turn(router), replica) for number, (chat, replica) in opened.items() if replica != home}
    assert moved and home not in moved.values(), moved
    assert all(now == before for now, before in stayed.values()), stayed  # only its conversations move
    assert router.replicas[home].posts == posts
    router.set_state(home, "ready")
    wait(lambda: router.status()[home] == "UP", f"{home} UP")
    assert {opened[number][0].turn(router) for number in moved} == {home}


def test_a_stopped_replicas_conversations_are_answered_by_the_others_and_come_back(router: PrefixRouter) -> None:
    opened = _opened(router)
    home = _home(opened)
    mine = [chat for chat, replica in opened.values() if replica == home]
    router.stop(home)
    moved = {chat.turn(router) for chat in mine}  # retried on another at once, before the check sees it down
    wait(lambda: router.status()[home] == "DOWN", f"{home} DOWN")
    away = [[chat.turn(router) for _ in range(3)] for chat in mine]
    assert home not in moved | set().union(*away), (moved, away)
    assert all(len(set(turns)) == 1 for turns in away), away  # each stays where it went: its cache is there now
    router.start(home)
    wait(lambda: router.status()[home] == "UP", f"{home} UP again (its health check passed)")
    assert {chat.turn(router) for chat in mine} == {home}


@pytest.mark.parametrize(("balance", "most_at_home"), [(1.25, 4), (WIDE_BALANCE, 6)])
def test_the_bound_passes_requests_on_from_a_replica_that_holds_too_many(tmp_path: Path, balance: float,
                                                                          most_at_home: int) -> None:
    """One prompt answered once (its home is known), then six completions of it at once, each answered after a
    second. With a tight bound (router_prefix_balance 1.25: a replica holds at most 1.25 times its share of the
    requests in flight, rounded up) they are spread: 3 at home as they arrive one by one, one more where two
    arrive on HAProxy's two threads at the same moment; with the widest bound all six wait at home."""
    with _router(tmp_path, "prefix", balance) as router:
        home = router.complete("one shared prompt")
        for replica in router.replicas.values():
            replica.delay = 1.0
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            answered = list(pool.map(lambda _: router.complete("one shared prompt"), range(6)))
    assert answered.count(home) <= most_at_home and max(answered.count(name) for name in NAMES) <= most_at_home
    assert (answered.count(home) == 6) == (balance == WIDE_BALANCE), answered


def test_with_leastconn_the_configuration_is_what_it_was(tmp_path: Path) -> None:
    """leastconn: a conversation's turns go to whichever replica has the fewest requests, and its backend holds what
    it held before router_policy: prefix's differs from it by the key's table, its rules and the servers' ids."""
    with _router(tmp_path, "leastconn") as router:
        chat = Chat(0)
        assert {chat.turn(router) for _ in range(6)} == set(NAMES)
        texts = [router_role.render(_values(router.cfg, router.ports, policy)) for policy in ("leastconn", "prefix")]
    changed = [line for line in difflib.ndiff(*(text.splitlines() for text in texts)) if line[:2] in ("- ", "+ ")]
    servers = [f"server {name} 127.0.0.1:{router.ports[name]}" for name in NAMES]
    assert [line[2:].strip() for line in changed if line.startswith("- ")] == [
        "balance leastconn", *(f"{server} maxconn 8" for server in servers)]
    added = [line[2:].strip() for line in changed if line.startswith("+ ") and not line[2:].strip().startswith("#")]
    ids = plan_backends.Backend("m", "m", tuple((name, "") for name in NAMES)).server_ids  # by name alone
    assert added[-4:] == ["balance roundrobin", *(f"{server} id {ids[name]} maxconn 8"
                                                  for name, server in zip(NAMES, servers, strict=True))]
    words = [line.split(" ")[0] for line in added[:-4]]
    assert words == (["stick-table"] + ["http-request"] * 6 + ["acl", "acl"] * len(NAMES)
                     + ["use-server"] * 2 * len(NAMES) + ["http-response"] * 2), added
    assert "mul(125),add(txn.prefix_slots)" in added[6]
