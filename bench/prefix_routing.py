"""Prefix-aware routing against least connections on the running lab: the prefix cache hit ratio, time to first
token and the spread of requests over the replicas, per routing policy and workload.

    GPUFLEET_LAB_LAYOUT=singles make lab           # or any lab with three replicas of one shape
    python bench/prefix_routing.py                 # 12 and 24 conversations; leastconn, prefix, pinned
    python bench/prefix_routing.py --sizes 24 --policies leastconn,prefix,pinned,vllm-router \
        --vllm-router /opt/vllm-router/bin/vllm-router
    python bench/prefix_routing.py --repeat 3    # each row over three runs: steadier TTFT figures

Needs the lab up (``$GPUFLEET_LAB_DIR`` picks another). Before each router policy's rows it deploys that policy with
``pyinfra -y inventories/lab/inventory.py deploys/vllm.py --data router_policy=POLICY`` under ``GPUFLEET_LAB_LAYOUT``
(default ``singles``: every node one replica of the same shape; only HAProxy reloads when the layout is in place).
The replicas serve ``--model``: by default ``wide``, a wider random-weight model than the lab's (see
``gpufleet_lab.tiny_model.WIDE``), whose prefill takes time enough for a cached prefix to show in TTFT; the first
deploy restarts the replicas on it, and a plain deploy afterwards puts the lab's own model back.
Policies: ``leastconn`` and ``prefix`` through the routers' virtual address with the client key; ``pinned``, the
ideal router, sends every conversation (every user of a system prompt) straight to one replica, chosen in turn;
``vllm-router`` runs the vLLM project's router (``--policy cache_aware``, the binary given) on this machine's
loopback in front of the same replicas.

Workloads, each bounded in requests (sizes) and time (``--limit-s``), with fresh text each run so that no run hits
another's cache:
- ``multi_turn``: C conversations of T turns; turn t of every conversation is sent in a shuffled round, a few at a
  time, after every answer of turn t-1 came back (the user reads before writing again); each turn resends the
  history and a new user message.
- ``system_prompts``: K long system prompts, C users in all, each user one question after its system prompt.
- ``skewed``: as system_prompts, one system prompt in half of the requests.

Per policy and workload it prints: the hit ratio (the replicas' ``vllm:prefix_cache_hits_total`` over
``vllm:prefix_cache_queries_total``, differences before and after), TTFT p50/p99 (streamed chats), requests per
replica (``vllm:request_success_total``), the busiest replica's share over the mean share, and failed requests.
"""

from __future__ import annotations

import argparse
import http.client
import ipaddress
import json
import os
import random
import re
import shlex
import shutil
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from gpufleet_lab.network import virtual_address
from gpufleet_lab.nodes import API_KEY_FILE, CLIENT_KEY_FILE, TLS_DIR
from gpufleet_lab.state import cache_dir, lab_dir, load_state
from gpufleet_lab.tiny_model import WIDE, make_tiny_model

ROOT = Path(__file__).resolve().parents[1]
PYINFRA = Path(sys.executable).parent / "pyinfra"
INVENTORY, DEPLOY = "inventories/lab/inventory.py", "deploys/vllm.py"
ROUTER_PORT, REPLICA_PORT = 8080, 8000  # roles/router/defaults.yml, the lab's replicas
LOCAL_ROUTER_PORT = 30080  # the vLLM project's router, on loopback
ROUTER_POLICIES = ("leastconn", "prefix")
POLICIES = (*ROUTER_POLICIES, "pinned", "vllm-router")
WORKLOADS = ("multi_turn", "system_prompts", "skewed")
COUNTERS = {"hits": "vllm:prefix_cache_hits_total", "queries": "vllm:prefix_cache_queries_total",
            "requests": "vllm:request_success_total"}
WORDS = ("fleet", "node", "replica", "router", "cache", "prefix", "token", "model", "serve", "drain", "upgrade",
         "metric", "alert", "queue", "batch", "kernel", "tensor", "pipeline", "rank", "shard", "block", "memory",
         "latency", "budget", "window", "engine")
DEPLOY_LIMIT_S = 1800
NODE_MODELS = "/var/lib/gpufleet/models"  # where the replicas' model is pushed (the lab's vllm_model)
# --model: (the model's data for the deploys, or none: the lab's own; --max-model-len, --opening-words defaults)
MODELS = {"tiny": (512, 40), "wide": (2048, 300)}


@dataclass(frozen=True)
class Target:
    """Where one request goes: a base URL, its key, and the CA of an https URL."""

    url: str
    key: str
    ca_file: str | None = None


@dataclass
class Tally:
    """What the clients saw over one run."""

    ttft_s: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    sent: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)


def text(rng: random.Random, words: int) -> str:
    """``words`` words drawn from WORDS, with a number now and then (BPE tokens of the lab's tiny model)."""
    return " ".join(rng.choice(WORDS) if i % 7 else str(rng.randrange(1000)) for i in range(words))


def counters(address: str) -> dict[str, float]:
    """A replica's counters of COUNTERS, summed over their labels."""
    with urllib.request.urlopen(f"http://{address}:{REPLICA_PORT}/metrics", timeout=20) as answer:
        lines = answer.read().decode().splitlines()
    found = dict.fromkeys(COUNTERS, 0.0)
    for name, metric in COUNTERS.items():
        pattern = re.compile(rf"^{re.escape(metric)}(\{{[^}}]*\}})? (\S+)$")
        found[name] = sum(float(m[2]) for line in lines if (m := pattern.match(line)))
    return found


def chat(target: Target, model: str, messages: list[dict[str, str]], max_tokens: int,
         timeout_s: float) -> tuple[float, str]:
    """One streamed chat completion: seconds to its first chunk (vLLM sends none before the first token: a random
    model's tokens may be bytes that make no text yet), and the answer's text."""
    parts = urllib.parse.urlsplit(target.url)
    connection: http.client.HTTPConnection
    if parts.scheme == "https":
        tls = ssl.create_default_context(cafile=target.ca_file)
        connection = http.client.HTTPSConnection(parts.hostname or "", parts.port or 443, timeout=timeout_s,
                                                 context=tls)
    else:
        connection = http.client.HTTPConnection(parts.hostname or "", parts.port or 80, timeout=timeout_s)
    body = json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True,
                       "ignore_eos": True, "temperature": 0})
    started = time.monotonic()
    first: float | None = None
    answer: list[str] = []
    try:
        connection.request("POST", "/v1/chat/completions", body=body,
                           headers={"Content-Type": "application/json", "Authorization": f"Bearer {target.key}"})
        response = connection.getresponse()
        if response.status != 200:
            raise ValueError(f"HTTP {response.status}: {response.read()[:200]!r}")
        done = False
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            choices = json.loads(line[6:])["choices"]
            if choices:  # vLLM sends its first chunk (the role) with the first token, text or not
                first = first if first is not None else time.monotonic() - started
                answer.append(choices[0]["delta"].get("content") or "")
        if not done or first is None:
            raise ValueError("the stream ended without a chunk or without data: [DONE]")
    finally:
        connection.close()
    return first, "".join(answer)


@dataclass(frozen=True)
class Workload:
    """The rounds of one workload: each round a list of (conversation, messages to send); a conversation's
    history grows with each answer (multi-turn)."""

    name: str
    rounds: list[list[int]]  # per round, the conversations that send their next turn, in the order sent
    openers: list[list[dict[str, str]]]  # per conversation, its first messages
    follow_ups: list[list[str]]  # per conversation, the user messages of its later turns
    prefixes: list[int]  # per conversation, the prefix it shares with others (its own, or its system prompt's)


def workload(name: str, size: int, turns: int, prompts: int, rng: random.Random, opening: int = 40,
             turn: int = 8) -> Workload:
    """``name``'s conversations for ``size`` conversations (users), shuffled by ``rng``; ``opening`` and ``turn``:
    the words of an opening (or system prompt) and of a later user message."""
    if name == "multi_turn":
        openers = [[{"role": "user", "content": text(rng, opening)}] for _ in range(size)]
        follow_ups = [[text(rng, turn) for _ in range(turns - 1)] for _ in range(size)]
        rounds = [rng.sample(range(size), size) for _ in range(turns)]
        return Workload(name, rounds, openers, follow_ups, list(range(size)))
    systems = [text(rng, opening) for _ in range(prompts)]
    if name == "skewed":  # one system prompt in half of the requests, the others share the rest
        which = [0 if i < size // 2 else 1 + i % (prompts - 1) for i in range(size)]
    else:
        which = [i % prompts for i in range(size)]
    openers = [[{"role": "system", "content": systems[k]}, {"role": "user", "content": text(rng, turn)}]
               for k in which]
    return Workload(name, [rng.sample(range(size), size)], openers, [[] for _ in range(size)], which)


def run_workload(load: Workload, pick: Callable[[int], Target], model: str, concurrency: int, max_tokens: int,
                 limit_s: float, tally: Tally | None = None) -> Tally:
    """Send every round of ``load``, ``concurrency`` at a time, a round after the last one's answers; each
    conversation to ``pick(conversation)``. Stops sending once ``limit_s`` is spent. Counts into ``tally`` (a new
    one by default)."""
    tally = Tally() if tally is None else tally
    history = [list(opener) for opener in load.openers]
    deadline = time.monotonic() + limit_s

    def one(conversation: int, turn: int) -> None:
        if time.monotonic() > deadline:
            return
        messages = history[conversation]
        if turn > 0:
            messages.append({"role": "user", "content": load.follow_ups[conversation][turn - 1]})
        with tally.lock:
            tally.sent += 1
        try:
            ttft, answer = chat(pick(conversation), model, messages, max_tokens, timeout_s=120)
        except (OSError, ValueError, KeyError, http.client.HTTPException) as exc:
            tally.failures.append(f"{type(exc).__name__}: {str(exc)[:160]}")
            return
        tally.ttft_s.append(ttft)
        messages.append({"role": "assistant", "content": answer})

    with ThreadPoolExecutor(concurrency) as pool:
        for turn, order in enumerate(load.rounds):
            list(pool.map(lambda c, t=turn: one(c, t), order))
    return tally


def percentile(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(len(ordered) * q))], 3) if ordered else None


def figures(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]], tally: Tally) -> dict[str, Any]:
    """One row: hit ratio, TTFT, requests per replica and the busiest one's share over the mean, failures."""
    delta = {node: {k: after[node][k] - before[node][k] for k in COUNTERS} for node in before}
    hits, queries = (sum(d[k] for d in delta.values()) for k in ("hits", "queries"))
    per_replica = {node: int(d["requests"]) for node, d in delta.items()}
    total = sum(per_replica.values())
    mean = total / len(per_replica) if per_replica else 0
    return {"hit_ratio": round(hits / queries, 3) if queries else None, "requests": tally.sent,
            "failed": len(tally.failures), "ttft_p50_s": percentile(tally.ttft_s, 0.5),
            "ttft_p99_s": percentile(tally.ttft_s, 0.99), "requests_per_replica": per_replica,
            "busiest_over_mean": round(max(per_replica.values()) / mean, 2) if mean else None,
            "failures": tally.failures[:3]}


def deploy_policy(policy: str, layout: str, max_model_len: int, data: list[str]) -> None:
    """Deploy the lab with ``router_policy`` = ``policy``, ``vllm_max_model_len`` and the further ``--data``
    arguments ``data`` (only the routers change once the layout and the length are in place)."""
    extra = [arg for item in data for arg in ("--data", item)]
    done = subprocess.run([str(PYINFRA), "-y", INVENTORY, DEPLOY, "--data", f"router_policy={policy}", "--data",
                           f"vllm_max_model_len={max_model_len}", *extra], cwd=ROOT,
                          env={**os.environ, "GPUFLEET_LAB_LAYOUT": layout}, capture_output=True, text=True,
                          timeout=DEPLOY_LIMIT_S)
    if done.returncode != 0:
        sys.exit(f"deploying router_policy={policy} failed (exit {done.returncode}):\n"
                 + "\n".join((done.stdout + done.stderr).splitlines()[-30:]))


@contextmanager
def vllm_router(binary: str, replicas: list[str], options: list[str]) -> Iterator[str]:
    """The vLLM project's router on loopback in front of ``replicas`` (``options``: its own, after the default
    ``--policy cache_aware``); its base URL."""
    process = subprocess.Popen([binary, "--host", "127.0.0.1", "--port", str(LOCAL_ROUTER_PORT), "--policy",
                                "cache_aware", *options, "--worker-urls",
                                *(f"http://{a}:{REPLICA_PORT}" for a in replicas)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{LOCAL_ROUTER_PORT}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    break
            except OSError:
                time.sleep(1)
        else:
            raise SystemExit("the vLLM project's router did not answer /health within 120 s")
        yield url
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(30)


def model_data(model: str) -> list[str]:
    """The deploys' ``--data`` that serve ``model``: none for ``tiny`` (the lab's own); for ``wide``, the wider
    random-weight model, built on this machine (deterministic: the same bytes each time) and pushed to the nodes."""
    if model == "tiny":
        return []
    built = make_tiny_model(cache_dir() / "models" / "wide-llama", WIDE)
    return [f"vllm_model={NODE_MODELS}/wide-llama", f"vllm_model_source={built}", f"vllm_model_config={built}"]


def served_model() -> str:
    """The name the lab serves its model under (inventories/lab/group_vars/lab.yml)."""
    lab_vars = yaml.safe_load((ROOT / "inventories" / "lab" / "group_vars" / "lab.yml").read_text())
    return str(lab_vars["vllm_served_model_name"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="12,24", help="conversations (users) per workload, comma-separated")
    parser.add_argument("--turns", type=int, default=3, help="turns of a multi-turn conversation (default 3)")
    parser.add_argument("--prompts", type=int, default=3, help="system prompts of the shared-prompt workloads")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight at once (default 4)")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens per answer (default 8)")
    parser.add_argument("--model", choices=sorted(MODELS), default="wide",
                        help="wide (default): a random-weight model whose prefill of 1,000 tokens takes about 0.15 s"
                             " on a lab replica, so that a cached prefix shows in TTFT; tiny: the lab's own, whose"
                             " prefill takes 15 ms cached or not (TTFT then shows only how requests queue)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="the replicas' vllm_max_model_len (default: the model's positions, 2048 or 512; the"
                             " CPU build caches blocks of 128 tokens)")
    parser.add_argument("--opening-words", type=int, default=None,
                        help="words of a conversation's opening or a system prompt (default: 300, ~1,000 tokens,"
                             " with wide; 40, ~140 tokens, with tiny)")
    parser.add_argument("--turn-words", type=int, default=8, help="words of a user's later message (default 8)")
    parser.add_argument("--policies", default="leastconn,prefix,pinned", help=f"of {', '.join(POLICIES)}")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"of {', '.join(WORKLOADS)}")
    parser.add_argument("--layout", default="singles", help="GPUFLEET_LAB_LAYOUT of the deploys (default singles)")
    parser.add_argument("--vllm-router", help="the vllm-router binary (policy vllm-router)")
    parser.add_argument("--vllm-router-options", default="",
                        help="the vLLM project's router's options, after --policy cache_aware (one string)")
    parser.add_argument("--data", action="append", default=[], metavar="KEY=VALUE",
                        help="more --data for the deploys (router_prefix_balance=2, say); repeatable")
    parser.add_argument("--no-deploy", action="store_true",
                        help="bench the lab as it is deployed (one router policy: the one it runs)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs of each workload per row, each with fresh text; a row counts them all (default 1)")
    parser.add_argument("--limit-s", type=float, default=600, help="seconds one workload run may send for")
    parser.add_argument("--seed", type=int, default=None, help="the text's seed (default: a fresh one)")
    args = parser.parse_args()
    policies = [p for p in args.policies.split(",") if p]
    workloads = [w for w in args.workloads.split(",") if w]
    unknown = sorted(set(policies) - set(POLICIES)) + sorted(set(workloads) - set(WORKLOADS))
    if unknown or args.turns < 2 or args.prompts < 2 or args.concurrency < 1 or args.repeat < 1:
        parser.error(f"unknown policies or workloads {unknown}, --turns/--prompts below 2 or --repeat below 1")
    if "vllm-router" in policies and not (args.vllm_router and shutil.which(args.vllm_router)):
        parser.error("policy vllm-router needs --vllm-router BINARY")
    state = load_state()
    if state is None:
        sys.exit(f"no lab is up in {lab_dir()}")
    max_model_len, opening_words = MODELS[args.model]
    args.max_model_len = args.max_model_len or max_model_len
    args.opening_words = args.opening_words or opening_words
    data = [*([] if args.no_deploy else model_data(args.model)), *args.data]
    replicas = [node.address for node in state.nodes]
    replica_key = (lab_dir() / API_KEY_FILE).read_text().strip()
    edge = Target(f"https://{virtual_address(ipaddress.IPv4Network(state.subnet))}:{ROUTER_PORT}",
                  (lab_dir() / CLIENT_KEY_FILE).read_text().strip(), str(lab_dir() / TLS_DIR / "ca.crt"))
    model, rng = served_model(), random.Random(args.seed)
    report: dict[str, Any] = {"replicas": replicas, "model": args.model, "turns": args.turns, "prompts": args.prompts,
                              "concurrency": args.concurrency, "max_tokens": args.max_tokens,
                              "max_model_len": args.max_model_len, "opening_words": args.opening_words,
                              "turn_words": args.turn_words, "repeat": args.repeat, "data": args.data,
                              "vllm_router_options": args.vllm_router_options, "sizes": {}}
    deployed = False
    for policy in policies:
        if not args.no_deploy and (policy in ROUTER_POLICIES or not deployed):
            deploy_policy(policy if policy in ROUTER_POLICIES else "leastconn", args.layout, args.max_model_len,
                          data)
            deployed = True
        with (vllm_router(args.vllm_router, replicas, shlex.split(args.vllm_router_options))
              if policy == "vllm-router" else nullcontext()) as local:
            for size in (int(s) for s in args.sizes.split(",")):
                for name in workloads:
                    before, tally = {a: counters(a) for a in replicas}, Tally()
                    for _ in range(args.repeat):  # fresh text each time: no run hits another's cache
                        load = workload(name, size, args.turns, args.prompts, random.Random(rng.random()),
                                        args.opening_words, args.turn_words)
                        pick = _picker(policy, edge, local, replicas, replica_key, load.prefixes)
                        run_workload(load, pick, model, args.concurrency, args.max_tokens, args.limit_s, tally)
                    after = {a: counters(a) for a in replicas}
                    row = figures(before, after, tally)
                    report["sizes"].setdefault(str(size), {}).setdefault(name, {})[policy] = row
                    print(f"{policy:>11} {name:>14} x{size}: hit ratio {row['hit_ratio']}, TTFT p50 "
                          f"{row['ttft_p50_s']} s, busiest/mean {row['busiest_over_mean']}, failed {row['failed']}",
                          file=sys.stderr)
    print(json.dumps(report, indent=1))
    return 0


def _picker(policy: str, edge: Target, local: str | None, replicas: list[str], key: str,
            prefixes: list[int]) -> Callable[[int], Target]:
    """Where each conversation's requests go under ``policy`` (pinned: by the prefix it shares, in turn)."""
    if policy == "pinned":
        return lambda conversation: Target(
            f"http://{replicas[prefixes[conversation] % len(replicas)]}:{REPLICA_PORT}", key)
    if policy == "vllm-router":
        return lambda _: Target(str(local), key)
    return lambda _: edge


if __name__ == "__main__":
    sys.exit(main())
