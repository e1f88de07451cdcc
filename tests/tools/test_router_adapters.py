"""LoRA adapters at the routers, run by a real HAProxy (Debian's) on loopback with the configuration the router role
renders for one model on three stand-in replicas (:class:`tests.tools.haproxy_run.FakeReplica`, each completion
answered with the replica's name), two of whose pools declare the adapters: an adapter's requests reach only those
two, each adapter keeps to one of them while it is ready, the adapters spread over both, and a client sees them as
models."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gpufleet_lab.tiny_adapters import WEIGHTS_FILE, TinyAdapter, make_tiny_adapter

import roles.router as router_role
from gpufleet.digest import file_sha256
from gpufleet.node import router_admin
from gpufleet.plan import backends as plan_backends
from tests.tools.haproxy_run import json_answer, loopback_plan, loopback_router_config, running_haproxy, stand_ins, wait
from tests.unit.configs import host_config

MODEL = "org/model"
NAMES = ("r-0", "r-1", "r-2")
HOLDERS = ("r-0", "r-1")  # the replicas whose pools declare the adapters
ADAPTERS = tuple(f"team-{n}" for n in range(6))
TURNS = 5  # requests per adapter, one at a time


def _ask(port: int, model: str) -> str:
    """The replica that answered one completion for ``model`` through the router (200 expected)."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", method="POST",
                                     data=json.dumps({"model": model, "prompt": "hi", "max_tokens": 1}).encode(),
                                     headers={"Content-Type": "application/json"})
    status, answer = json_answer(request)
    assert status == 200, answer
    return str(answer["replica"])


@pytest.fixture
def declared(tmp_path: Path) -> dict[str, dict[str, str]]:
    """ADAPTERS as a pool declares them: the lab's tiny adapters, made for MODEL."""
    found = {}
    for number, name in enumerate(ADAPTERS):
        folder = make_tiny_adapter(tmp_path / name, TinyAdapter(name, 4, number), base=MODEL)
        found[name] = {"source": str(folder), "sha256": file_sha256(folder / WEIGHTS_FILE)}
    return found


@pytest.fixture
def router(tmp_path: Path, declared: dict[str, dict[str, str]]) -> Iterator[dict[str, Any]]:
    """HAProxy in front of the NAMES stand-ins, the HOLDERS declaring ``declared``."""
    _, stops, ports = stand_ins(NAMES)
    cfg = loopback_router_config()
    configs = {name: host_config(vllm_lora_adapters=declared if name in HOLDERS else {}) for name in NAMES}
    found = plan_backends.backends(loopback_plan(ports, configs))
    values = router_role.config_values(cfg, "127.0.0.1", found, router_role.model_lists({None: list(found[0].names)}),
                                       [], dict.fromkeys(NAMES, 8))
    try:
        with running_haproxy(values, tmp_path) as socket:
            runtime = router_admin.Runtime(str(socket))
            wait(lambda: {s.status for s in runtime.servers()} == {"UP"}, "every replica UP")
            yield {"port": cfg.router_port, "runtime": runtime, "backend": found[0].name}
    finally:
        for stack in stops.values():
            stack.close()


def test_each_adapter_keeps_to_one_replica_that_serves_it_and_the_adapters_spread(router: dict[str, Any]) -> None:
    homes = {}
    for adapter in ADAPTERS:
        answered = {_ask(router["port"], adapter) for _ in range(TURNS)}
        assert len(answered) == 1 and answered <= set(HOLDERS), (adapter, answered)
        homes[adapter] = answered.pop()
    assert set(homes.values()) == set(HOLDERS), homes  # rendezvous hashing spreads six adapters over both
    # the model's own requests go to every replica (least connections), the one without adapters too
    assert "r-2" in {_ask(router["port"], MODEL) for _ in range(12)}


def test_a_drained_replicas_adapters_move_to_the_other_one_that_serves_them(router: dict[str, Any]) -> None:
    homes = {adapter: _ask(router["port"], adapter) for adapter in ADAPTERS}
    drained = homes[ADAPTERS[0]]
    router_admin.set_state(router["runtime"], router["backend"], drained, "drain")
    try:
        moved = {adapter: _ask(router["port"], adapter) for adapter in ADAPTERS}
        other = next(h for h in HOLDERS if h != drained)
        assert set(moved.values()) == {other}, moved  # never the replica that serves none
    finally:
        router_admin.set_state(router["runtime"], router["backend"], drained, "ready")
    assert {adapter: _ask(router["port"], adapter) for adapter in ADAPTERS} == homes  # and back home


def test_a_client_sees_the_adapters_as_models(router: dict[str, Any]) -> None:
    request = urllib.request.Request(f"http://127.0.0.1:{router['port']}/v1/models")
    status, answer = json_answer(request)
    assert status == 200 and {m["id"] for m in answer["data"]} == {MODEL, *ADAPTERS}, answer
    status, answer = json_answer(urllib.request.Request(
        f"http://127.0.0.1:{router['port']}/v1/completions", method="POST",
        data=json.dumps({"model": "team-none", "prompt": "hi"}).encode(), headers={"Content-Type": "application/json"}))
    assert status == 404, answer


def test_an_adapter_whose_replicas_are_all_out_is_a_503_with_retry_after_never_another_replica(
        router: dict[str, Any]) -> None:
    """Both replicas that serve the adapters drained (as a rollout drains one, or a restart takes it down): an
    adapter's request is the router's 503 with Retry-After, never the replica that serves none (its 404 would say the
    adapter does not exist); the model's own requests go on to that replica."""
    for holder in HOLDERS:
        router_admin.set_state(router["runtime"], router["backend"], holder, "drain")
    try:
        request = urllib.request.Request(
            f"http://127.0.0.1:{router['port']}/v1/completions", method="POST",
            data=json.dumps({"model": ADAPTERS[0], "prompt": "hi", "max_tokens": 1}).encode(),
            headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                status, headers, body = answer.status, answer.headers, answer.read()
        except urllib.error.HTTPError as refused:
            status, headers, body = refused.code, refused.headers, refused.read()
        assert status == 503 and int(headers["Retry-After"]) >= 1, (status, body)
        assert "replica" not in json.loads(body), body  # the router's answer, not a stand-in's
        assert _ask(router["port"], MODEL) == "r-2"
    finally:
        for holder in HOLDERS:
            router_admin.set_state(router["runtime"], router["backend"], holder, "ready")
    assert _ask(router["port"], ADAPTERS[0]) in HOLDERS
