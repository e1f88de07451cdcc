"""The serving edge changed by a deploy under load (scenario ``changed``): a client's key rotated and a client added
with HAProxy reloaded, not restarted; a client over its rate limit; admission control under a burst.

The deploy (a copy of the lab's inventory, and ``--data``) sets the routers' admission small (``router_server_maxconn``
2 in each pool, a 0.5 s queue) so that a burst of ten times what the replicas take at once fits the lab, and keeps
vLLM's own limit at what each replica runs: no replica restarts. The fleet is left so (the next deploy puts the
inventory's edge back; the rotated key stays the lab's).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import time
from pathlib import Path
from typing import NamedTuple

import pytest
from gpufleet_lab.nodes import (
    BENCH_KEY_FILE,
    CLIENT_KEY_FILE,
    DAILY_KEY_FILE,
    DAILY_TOKENS_PER_DAY,
    METERED_KEY_FILE,
    METERED_TOKENS_PER_MINUTE,
)
from gpufleet_lab.request_load import Answer, Backlogged, backlog, burst, first_tokens
from gpufleet_lab.state import NodeRecord

from gpufleet.plan.backends import Backend
from roles.router import CLIENT_TABLE
from tests.lab.checks import assert_no_errors, main_pid, metrics
from tests.lab.fleet import (
    PIPELINE,
    ROUTER_PORT,
    address_holder,
    client_key,
    deploy,
    http,
    lab_ca,
    lab_copy,
    record_figure,
    requests_to,
    router_servers,
    router_table,
    router_url,
    served_name,
    single,
    tls,
)
from tests.lab.harness import Completed, Lab
from tests.lab.prometheus import Prometheus, wait_for
from tests.lab.scenarios import EDGE_CHANGED, LabStates

pytestmark = pytest.mark.filterwarnings("ignore:Unknown ssh-ed25519 host key:UserWarning")

MAXCONN = 2  # the routers' maxconn for each replica in this test
QUEUE_S = 0.5  # how long a request waits in the router's queue before its 503
BURST_FACTOR = 10
LEDGER_PORT = 8407  # the token ledger's (router_ledger_port), on each router's loopback
METERED_MAX_TOKENS = 32  # each metered request's
METERED_WAVES = 20  # at most, after the first 100
# Each burst request's completion: long enough (seconds) that no request queued QUEUE_S gets a place. With one
# OpenMP thread per engine the lab's replicas answer 32 tokens in about 0.45 s (CI, p99): a request queued 0.5 s
# then got a place, and the admitted p99 took the queue's wait too (1.27 s against 2 x 0.45).
TOKENS = 128
CLIENTS_METRICS = "systemctl start gpufleet-router-clients.service"
# Fair share: three clients of one model kept backlogged through the router's fair queue, which holds their waiting
# requests up to FAIR_QUEUE_S; their service is weighed over one window of FAIR_WINDOW_S once the queue has filled.
# fa and fb (share 1) differ fourfold in each request's tokens; fc (share 3) has three times their loops.
FAIR = {"fa": (1, 16, 8), "fb": (1, 64, 8), "fc": (3, 16, 24)}  # client: its share, each request's tokens, its loops
FAIR_QUEUE_S = 30.0
FAIR_WARM_S = 5.0
FAIR_WINDOW_S = 60.0
REPLICA_PORT = 8000  # the lab's replicas' API
# HAProxy's httplog line (templates/router/haproxy.cfg.j2: option httplog): its timers TR/Tw/Tc/Tr/Ta in ms, then
# the status. Ta is the request's whole time at the edge, from its first byte to the response's last; TR the part of
# it until the request was whole (headers and body: the edge reads the body for the model), Tw its wait in the queue.
HTTPLOG = re.compile(r"\] \S+ \S+ (?P<tr>-?\d+)/(?P<tw>-?\d+)/-?\d+/-?\d+/(?P<ta>\d+) (?P<status>\d{3}) "
                     r".*\"POST /v1/completions ")


def _write_secret(path: Path, text: str) -> None:
    """A client key file as the lab keeps them: 0600, one line."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text + "\n")


def _kept_clients(lab: Lab) -> dict[str, object]:
    """The lab's clients ``bench``, ``metered`` and ``daily`` as its inventory has them: a deploy of this file that
    sets router_clients keeps them."""
    return {"bench": {"api_key": {"file": str(lab.directory / BENCH_KEY_FILE)}},
            "metered": {"api_key": {"file": str(lab.directory / METERED_KEY_FILE)},
                        "tokens_per_minute": METERED_TOKENS_PER_MINUTE},
            "daily": {"api_key": {"file": str(lab.directory / DAILY_KEY_FILE)}, "tokens_per_day": DAILY_TOKENS_PER_DAY}}


def _queued_reqs(lab: Lab) -> dict[str, int]:
    """vLLM's --max-num-queued-reqs as each pool's replica runs it now (from the plan: they differ)."""
    found = {}
    for group, node, replica in (("lab_single", lab.nodes[0], single(lab)), ("lab_pipeline", lab.nodes[1], PIPELINE)):
        config = lab.host(node).file(f"/etc/gpufleet/vllm/{replica}/config.yaml").content_string
        found[group] = int(re.findall(r"^max-num-queued-reqs: (\d+)$", config, re.MULTILINE)[0])
    return found


def _replica_pids(lab: Lab) -> dict[str, int]:
    """Each node's vLLM main process (lab1: the single replica; lab2 and lab3: the pipeline's ranks)."""
    return {node.name: main_pid(lab, node, f"vllm@{single(lab) if node == lab.nodes[0] else PIPELINE}")
            for node in lab.nodes}


def _client_requests(lab: Lab, router: NodeRecord) -> int:
    """The lab client's requests as ``router``'s table counts them (both routers count alike: peers)."""
    return router_table(lab, router, CLIENT_TABLE).get("lab", {}).get("http_req_cnt", 0)


def _p99(answers: list[Answer]) -> float:
    return _p99_of([a.took_s for a in answers])


def _p99_of(seconds: list[float]) -> float:
    times = sorted(seconds)
    return times[min(len(times) - 1, int(len(times) * 0.99))]


def test_the_edge_rotates_a_key_under_load_limits_a_client_and_sheds_a_burst_fast(
        lab: Lab, changed: Completed | None, lab_states: LabStates, tmp_path: Path,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """One deploy, under load through the virtual address with the client's old key, rotates that key, adds a client
    ``capped`` (1 request/s, 1 at once) and sets the routers' admission small: both routers reload (same main
    process), no replica restarts, no request fails but the old key's 401s once the routers have the new one, and
    the client's counters go on through the reload (peers: the new process gets the old one's tables).
    Then: the new key is served and the old one gets 401; ``capped`` over its rate gets 429s, and its counter
    reaches Prometheus; a burst of ten times what the replicas take at once gets its excess refused (429 over the
    client's concurrency, 503 past the router's queue) within 1 s, each with Retry-After, while the admitted
    requests keep the latency of the same requests unloaded (at the edge, less their wait for a place in the
    queue: p99 within 2x)."""
    routers = lab.nodes[:2]
    old_key = client_key(lab)
    haproxy = {node.name: main_pid(lab, node, "haproxy") for node in routers}
    replicas = _replica_pids(lab)
    key_file = lab.directory / CLIENT_KEY_FILE
    capped_file, capped_key = tmp_path / "capped-key", secrets.token_urlsafe(32)
    _write_secret(capped_file, capped_key)
    clients = {"lab": {"api_key": {"file": str(key_file)}, "requests_per_s": 200, "concurrent_requests": 32},
               "capped": {"api_key": {"file": str(capped_file)}, "requests_per_s": 1, "concurrent_requests": 1},
               **_kept_clients(lab)}
    # each pool's routers' maxconn small, and vLLM's own limit kept at what its replica runs (no restart)
    inventory = lab_copy(tmp_path, {group: f"router_server_maxconn: {MAXCONN}\nvllm_max_num_queued_reqs: {queued}\n"
                                    for group, queued in _queued_reqs(lab).items()})
    options = ("--data", f"router_clients={json.dumps(clients)}", "--data", f"router_queue_timeout_s={QUEUE_S}")
    lab_states.changed(EDGE_CHANGED)
    load = requests_to(lab, None, streams=2, pause_s=0.5, chat=True, timeout_s=60).start()
    try:
        time.sleep(2)
        counted = {router.name: _client_requests(lab, router) for router in routers}
        _write_secret(key_file, secrets.token_urlsafe(32))
        assert_no_errors(deploy(lab, *options, inventory=inventory))
    finally:
        load.stop()
    # the client's counters went on through the reload (the old key's requests after it are no client's)
    kept = {router.name: _client_requests(lab, router) for router in routers}
    assert all(kept[name] >= counted[name] > 0 for name in kept), (counted, kept)
    new_key = client_key(lab)
    assert new_key != old_key
    for node in routers:  # the keys are nowhere a process list, the journal or the configuration shows them
        host = lab.host(node)
        shown = host.check_output("ps -eo args; journalctl -q -o cat --no-pager --since=-10min -u haproxy"
                                  " -u 'gpufleet-router-*'; cat /etc/haproxy/haproxy.cfg /etc/haproxy/gpufleet-edge/*")
        assert not [key for key in (old_key, new_key, capped_key) if key in shown], f"a client key shown on {node.name}"
        modes = host.check_output("stat -c '%a %U:%G %n' /etc/haproxy/gpufleet-edge/*").splitlines()
        assert modes and all(line.startswith("640 root:haproxy ") for line in modes), modes
    assert {node.name: main_pid(lab, node, "haproxy") for node in routers} == haproxy  # reloaded, not restarted
    assert _replica_pids(lab) == replicas
    # in flight at the reload or before it: answered; after it, the old key is no client's
    assert [a.failure for a in load.answers if a.status != 401 and a.failure] == []
    assert sum(1 for a in load.answers if a.status == 200) >= 4
    after = requests_to(lab, None, streams=2, pause_s=0.2, chat=True, limit=4).start()
    assert after.join(120) and after.sent == 8 and after.failures == [], after.failures[:3]
    completion = {"model": served_name("lab"), "prompt": "The fleet is", "max_tokens": 2}
    assert http(f"{router_url(lab)}/v1/completions", completion, old_key, context=tls(lab))[0] == 401

    # a client over its rate: 429 from the router, and its counter in Prometheus
    limited = [http(f"{router_url(lab)}/v1/completions", completion, capped_key, context=tls(lab))[0]
               for _ in range(6)]
    assert limited[0] == 200 and 429 in limited, limited
    for node in routers:
        lab.host(node).check_output(CLIENTS_METRICS)  # the counters now, not at the timer's next turn
    prometheus = Prometheus(lab.nodes[0])

    def counted_429s() -> float | None:
        found = sum(float(r["value"][1]) for r in prometheus.query(
            'gpufleet_router_client_limited_total{client="capped"}'))
        return found if found >= limited.count(429) else None

    counted, counted_after_s = wait_for("capped's 429s in Prometheus", counted_429s, timeout=60)

    # admission: the replicas take MAXCONN each at once; a burst of ten times that
    at_once = MAXCONN * 2
    url, model = router_url(lab), served_name("lab")
    holder = address_holder(lab)
    assert holder is not None
    before = lab.host(holder).check_output("date +%s.%N")
    unloaded = burst(url, model, new_key, at_once, max_tokens=TOKENS, ca_file=lab_ca(lab))
    assert [a.status for a in unloaded] == [200] * at_once, [a.failure for a in unloaded]
    answers = burst(url, model, new_key, BURST_FACTOR * at_once, max_tokens=TOKENS, ca_file=lab_ca(lab))
    admitted = [a for a in answers if a.status == 200]
    refused = [a for a in answers if a.status != 200]
    assert len(answers) == BURST_FACTOR * at_once
    assert {a.status for a in refused} <= {429, 503}, [a.failure for a in refused if a.status not in (429, 503)]
    assert at_once <= len(admitted) < len(answers) and all(a.retry_after for a in refused)
    # fast as the edge timed it: from the request whole at the edge to its response's last byte (HAProxy's Ta less
    # TR). The burst's connections and TLS handshakes are made before its requests, and each request is one TLS
    # record; yet its TR reached 449 ms (12 bursts on a fresh lab): the time HAProxy waited for its turn on the
    # lab's two cores, busy with both engines and the burst's 40 client threads, to read a request already sent.
    # The client's clock holds that wait and its own threads' turns; both are kept as figures. Tw, the wait the
    # edge imposes, reached 654 ms there for a 0.5 s queue timeout: every refusal within 1 s of its request whole
    logged, _ = wait_for("both bursts in the edge's log", lambda: (
        found if len(found := _edge_log(lab, holder, before)) >= at_once + len(answers) else None),
                         timeout=15, every=1)
    assert len(logged) == at_once + len(answers) and [t.status for t in logged[:at_once]] == [200] * at_once, logged
    edge = [t.ta - t.tr for t in logged[at_once:] if t.status in (429, 503)]
    assert len(edge) == len(refused), (edge, [a.status for a in refused])
    assert max(edge) < 1000, sorted(logged[at_once:], key=lambda t: t.ta - t.tr)[-3:]
    # the admitted keep their latency: each one's time at the edge from its request whole, less its wait in the
    # queue for a place (a request queued up to QUEUE_S may get one as a fast answer ends: seen, 0.46 s for 128
    # tokens on lab1, and its client time then held the wait on top of a whole answer), against the unloaded
    # burst's at the edge
    served = [(t.ta - t.tr - max(t.tw, 0)) / 1000 for t in logged[at_once:] if t.status == 200]
    alone = [(t.ta - t.tr) / 1000 for t in logged[:at_once]]
    assert len(served) == len(admitted) and _p99_of(served) <= 2 * _p99_of(alone), (served, alone)
    metered = _spend_a_token_budget(lab, model)
    record_figure(tmp_path_factory, {
        "fault": "the edge changed by a deploy under load (key rotated, client added, admission set small), then a"
                 " client over its rate and a burst",
        "token_budget": METERED_TOKENS_PER_MINUTE, **metered, "load_through_the_deploy": load.figures(),
        "old_key_401s_after_the_reload": sum(1 for a in load.answers if a.status == 401),
        "capped_answers": limited, "capped_429s_in_prometheus_after_s": round(counted_after_s, 1),
        "capped_429s_counted": counted, "burst": len(answers), "admitted": len(admitted),
        "refused_429": sum(1 for a in refused if a.status == 429),
        "refused_503": sum(1 for a in refused if a.status == 503),
        "refused_slowest_s": round(max(edge) / 1000, 3),
        "refused_slowest_request_read_s": round(max(t.tr for t in logged[at_once:] if t.status != 200) / 1000, 3),
        "refused_slowest_at_the_client_s": round(max(a.took_s for a in refused), 3),
        "admitted_served_p99_s": round(_p99_of(served), 3), "unloaded_p99_s": round(_p99_of(alone), 3),
        "admitted_p99_at_the_client_s": round(_p99(admitted), 3),
        "unloaded_p99_at_the_client_s": round(_p99(unloaded), 3)})


def _jain(values: list[float]) -> float:
    """Jain's fairness index: 1 when every value is equal, 1/n when one takes everything."""
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


def test_backlogged_clients_of_one_model_are_served_tokens_by_their_shares(
        lab: Lab, changed: Completed | None, lab_states: LabStates, tmp_path: Path,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Three clients with a share of the lab's model (fa and fb 1, fc 3) keep it backlogged through the virtual
    address, the routers' admission small (MAXCONN each replica) and their queue long: only HAProxy reloads. Over a
    window of FAIR_WINDOW_S, fa and fb are served tokens within 10% of each other (Jain's index at least 0.95),
    though each of fb's requests asks four times fa's tokens (so fa is served more requests); fc is served within
    10% of three times their mean."""
    replicas = _replica_pids(lab)
    clients: dict[str, object] = {"lab": {"api_key": {"file": str(lab.directory / CLIENT_KEY_FILE)}},
                                  **_kept_clients(lab)}
    loads = {}
    for name, (share, max_tokens, streams) in FAIR.items():
        key_file, key = tmp_path / f"{name}-key", secrets.token_urlsafe(32)
        _write_secret(key_file, key)
        clients[name] = {"api_key": {"file": str(key_file)}, "share": share}
        loads[name] = Backlogged(key, max_tokens, streams)
    inventory = lab_copy(tmp_path, {group: f"router_server_maxconn: {MAXCONN}\nvllm_max_num_queued_reqs: {queued}\n"
                                    for group, queued in _queued_reqs(lab).items()})
    lab_states.changed(EDGE_CHANGED)
    assert_no_errors(deploy(lab, "--data", f"router_clients={json.dumps(clients)}",
                            "--data", f"router_queue_timeout_s={FAIR_QUEUE_S}", inventory=inventory))
    assert _replica_pids(lab) == replicas
    started = time.monotonic()
    answers = backlog(router_url(lab), served_name("lab"), loads, FAIR_WARM_S + FAIR_WINDOW_S, ca_file=lab_ca(lab))
    window = (started + FAIR_WARM_S, started + FAIR_WARM_S + FAIR_WINDOW_S)
    served = {name: [a for a in found if a.status == 200 and window[0] <= a.sent + a.took_s <= window[1]]
              for name, found in answers.items()}
    tokens = {name: float(sum(a.tokens or 0 for a in found)) for name, found in served.items()}
    refused = [a.failure for found in answers.values() for a in found if a.status != 200]
    assert refused == [], refused[:3]
    assert all(a.tokens for found in served.values() for a in found)
    equal = [tokens["fa"], tokens["fb"]]
    assert _jain(equal) >= 0.95 and min(equal) >= 0.9 * max(equal), tokens
    assert len(served["fa"]) >= 2 * len(served["fb"]), {name: len(found) for name, found in served.items()}
    assert 0.9 * 3 <= tokens["fc"] / (sum(equal) / 2) <= 1.1 * 3, tokens
    # a streamed answer of a shared model (its usage read on the way, every client's: the lab's here) ends
    streamed = first_tokens(router_url(lab), served_name("lab"), client_key(lab), 3, timeout_s=10, ca_file=lab_ca(lab))
    record_figure(tmp_path_factory, {
        "fault": "three clients (shares 1, 1 and 3) backlogged on one model through a fair edge",
        "window_s": FAIR_WINDOW_S, "tokens": tokens, "requests": {name: len(found) for name, found in served.items()},
        "jain_fa_fb": round(_jain(equal), 4), "fc_over_fa_fb": round(tokens["fc"] / (sum(equal) / 2), 3),
        "streamed_first_token_s": [round(s, 3) for s in streamed]})

def _spend_a_token_budget(lab: Lab, model: str) -> dict[str, object]:
    """The client ``metered`` (a budget of METERED_TOKENS_PER_MINUTE tokens a minute) sends 100 requests at once,
    every other one to each router's own address, then waves of ten until a wave is refused whole: what both
    routers served in the minute (the usage of each answer) exceeds the budget by one request's max_tokens at most.
    Routers that each counted alone would serve up to twice the budget."""
    key = (lab.directory / METERED_KEY_FILE).read_text().strip()
    urls = [f"https://{node.address}:{ROUTER_PORT}" for node in lab.nodes[:2]]
    started = time.monotonic()
    waves = [burst(urls, model, key, 100, max_tokens=METERED_MAX_TOKENS, ca_file=lab_ca(lab))]
    while any(a.status == 200 for a in waves[-1]) and len(waves) < METERED_WAVES:
        waves.append(burst(urls, model, key, 10, max_tokens=METERED_MAX_TOKENS, ca_file=lab_ca(lab)))
    took_s = time.monotonic() - started
    answers = [a for wave in waves for a in wave]
    served = [a.tokens for a in answers if a.status == 200]
    assert took_s < 60 and not any(a.status == 200 for a in waves[-1]), (took_s, len(waves))
    assert None not in served and {a.status for a in answers} <= {200, 429, 503}, [a.failure for a in answers][:3]
    assert 0 < sum(s or 0 for s in served) <= METERED_TOKENS_PER_MINUTE + METERED_MAX_TOKENS, served
    assert all(a.retry_after and a.remaining_tokens for a in answers if a.status == 429)
    return {"token_waves": len(waves), "token_requests": len(answers), "token_admitted": len(served),
            "tokens_served_in_the_minute": sum(s or 0 for s in served), "token_waves_took_s": round(took_s, 1),
            "token_429s": sum(1 for a in answers if a.status == 429)}


def _ledger(lab: Lab, router: NodeRecord) -> dict[str, str]:
    """The tokens ``router``'s token ledger counts the client ``daily`` served (prompt and completion, by model),
    once it holds none; {} while it does. (What a window has left moves as the window does.)"""
    text = lab.host(router).check_output(f"curl -sS http://127.0.0.1:{LEDGER_PORT}/metrics")
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if 'client="daily"' in line)
    held = [value for name, value in lines.items() if "tokens_held" in name]
    settled = {name: value for name, value in lines.items() if name.split("{")[0].endswith("_tokens_total")}
    return settled if held and set(held) == {"0"} and settled else {}


class EdgeTimes(NamedTuple):
    """One completion as the edge logged it: its status and HAProxy's timers in ms (Tw -1: refused before the
    queue)."""

    status: int
    tr: int
    tw: int
    ta: int


def _edge_log(lab: Lab, router: NodeRecord, since: str) -> list[EdgeTimes]:
    """Each completion ``router``'s HAProxy logged since ``since``, in the order it ended."""
    lines = lab.host(router).check_output(f"journalctl -q -o cat --no-pager -u haproxy --since=@{since.strip()}")
    return [EdgeTimes(int(m["status"]), int(m["tr"]), int(m["tw"]), int(m["ta"]))
            for m in map(HTTPLOG.search, lines.splitlines()) if m]


def _prefix_hits(lab: Lab) -> dict[str, float]:
    """Each replica's ``vllm:prefix_cache_hits_total`` (tokens), read on its API node."""
    found = {}
    for node, replica in ((lab.nodes[0], single(lab)), (lab.nodes[1], PIPELINE)):
        lines = metrics(node, REPLICA_PORT).splitlines()
        found[replica] = sum(float(line.rsplit(" ", 1)[1]) for line in lines
                             if line.startswith("vllm:prefix_cache_hits_total{"))
    return found


def test_prefix_routing_keeps_each_conversation_home_across_a_reload_and_a_move_of_the_address(
        lab: Lab, changed: Completed | None, lab_states: LabStates, tmp_path_factory: pytest.TempPathFactory) -> None:
    """router_policy prefix, deployed over the edge's settings (only HAProxy reloads, no replica restarts): four
    conversations of three turns, each turn resending the history, through the virtual address. Both routers reload
    between the first turns and the second (what a rotated key does), and the address moves to the other router
    between the second and the third: the reloaded router and then the other one hold every conversation with its
    home (peers), each conversation's turns all reach its home, whose vLLM counts prefix cache hits, the
    conversations spread over both replicas, and the client's counters go on from where they were."""
    replicas = _replica_pids(lab)
    lab_states.changed(EDGE_CHANGED)
    assert_no_errors(deploy(lab, "--data", "router_policy=prefix"))
    assert _replica_pids(lab) == replicas
    url = f"{router_url(lab)}/v1/chat/completions"
    backend = str(router_servers(lab)[single(lab)]["backend"])
    ids = Backend(backend, "", tuple((name, "") for name in (single(lab), PIPELINE))).server_ids
    names = {server_id: name for name, server_id in ids.items()}
    hits = _prefix_hits(lab)
    # an opening of about 155 tokens (of the 256 the lab serves): the CPU build caches whole blocks of 128
    chats = [[{"role": "user", "content": f"Conversation {number}: " + "tell me about the fleet, " * 14}]
             for number in range(4)]
    keys = [hashlib.sha1(chat[0]["content"].encode()).hexdigest().upper() for chat in chats]  # the table's keys

    def held(router: NodeRecord) -> list[tuple[str, str]] | None:
        """Each conversation's home and the replica of its last turn in ``router``'s table; None if one is missing."""
        table = router_table(lab, router, backend)
        if not all(key in table for key in keys):
            return None
        return [(names[table[key]["gpt0"]], names[table[key]["gpt1"]]) for key in keys]

    def turns(router: NodeRecord) -> list[tuple[str, str]]:
        """Each conversation's next turn through the virtual address, which ``router`` holds."""
        for chat in chats:
            status, text = http(url, {"model": served_name("lab"), "messages": chat, "max_tokens": 4},
                                client_key(lab), context=tls(lab))
            assert status == 200, text
            answer = json.loads(text)["choices"][0]["message"]["content"]
            chat += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"And {len(chat)}?"}]
        found = held(router)
        assert found is not None, f"a conversation missing from {router.name}'s table after its turn"
        return found

    holder = address_holder(lab)
    assert holder is not None
    first = turns(holder)
    homes = [home for home, _ in first]
    assert [last for _, last in first] == homes and set(homes) == {single(lab), PIPELINE}, first  # round robin
    counted = _client_requests(lab, holder)
    for router in lab.nodes[:2]:  # as a rotated key does
        lab.host(router).check_output("systemctl reload haproxy")
    reloaded, reloaded_after_s = wait_for("every conversation in the reloaded router's table", lambda: held(holder),
                                          timeout=15, every=0.5)
    assert reloaded == first and _client_requests(lab, holder) >= counted
    assert turns(holder) == [(home, home) for home in homes]
    other = next(router for router in lab.nodes[:2] if router != holder)
    counted = _client_requests(lab, holder)
    daily = (lab.directory / DAILY_KEY_FILE).read_text().strip()  # a budget used just before the move
    completion = {"model": served_name("lab"), "prompt": "The fleet is", "max_tokens": 4}
    assert http(f"{router_url(lab)}/v1/completions", completion, daily, context=tls(lab))[0] == 200
    used, _ = wait_for("the budget used, settled", lambda: _ledger(lab, holder) or None, timeout=15, every=0.5)
    lab.host(holder).check_output("systemctl stop keepalived")  # it gives the address up at once (priority 0)
    try:
        wait_for("the address on the other router", lambda: address_holder(lab) == other or None, timeout=15,
                 every=0.2)
    finally:
        lab.host(holder).check_output("systemctl start keepalived")  # back as a backup: the address stays
    assert held(other) == [(home, home) for home in homes] and _client_requests(lab, other) >= counted
    assert _ledger(lab, other) == used  # the budget the client used, on the router that took the address
    assert turns(other) == [(home, home) for home in homes]
    gained = {replica: count - hits[replica] for replica, count in _prefix_hits(lab).items()}
    assert all(gained[replica] >= 128 for replica in set(homes)), gained
    record_figure(tmp_path_factory, {
        "fault": "prefix routing: the routers reloaded between two turns, then the address moved",
        "turns_at_home_after_the_reload_and_the_move": 8, "table_back_after_the_reload_s": round(reloaded_after_s, 1),
        "prefix_cache_hit_tokens_gained": gained})
