"""router_policy: the planner's rules for a model's routing (its pools agree; with ``prefix`` its replicas share
cache keys) and the router's configuration for each policy. The refusals as users see them:
tests/data/corpus/router_policy.yaml; HAProxy running the configuration: tests/tools/test_router_prefix.py."""

from __future__ import annotations

import os
from typing import Any

import pytest

import roles.router as router_role
from gpufleet.plan import backends as plan_backends
from gpufleet.plan.planner import FleetPlan, PlanProblem
from gpufleet.values.vllm_flags import load_catalog
from tests.conftest import DATA, Project
from tests.stand_in_plan import stand_in_plan
from tests.unit.configs import host_config
from tests.unit.project_plans import fleet_plan

MODEL = '"meta-llama/Llama-3.1-8B-Instruct"'
REGOLD = os.environ.get("GPUFLEET_REGOLD") == "1"  # rewrite the golden configurations (review their diff)
CHAT, TINY = "chat-model", "tiny llama $HOME 100%"
# the router's replicas: name -> (served model, address, API port)
REPLICAS = {"a-h1": (CHAT, "10.0.0.1", 8000), "a-h2": (CHAT, "10.0.0.2", 8000), "b-h3": (TINY, "10.0.0.3", 8001)}

# vllm_extra_args -> what FlagCatalog.given finds for --enable-prefix-caching: (the key as written, its meaning)
PREFIX_CACHING_GIVEN: list[tuple[str, dict[str, Any], tuple[str, object] | None]] = [
    ("0.33.0", {}, None),
    ("0.33.0", {"max-num-seqs": 8}, None),
    ("0.33.0", {"enable-prefix-caching": False}, ("enable-prefix-caching", False)),
    ("0.33.0", {"enable_prefix_caching": True}, ("enable_prefix_caching", True)),
    ("0.33.0", {"no-enable-prefix-caching": True}, ("no-enable-prefix-caching", False)),
    ("0.33.0", {"no_enable_prefix_caching": True}, ("no_enable_prefix_caching", False)),
    ("0.33.0", {"disable-prefix-caching": True}, ("disable-prefix-caching", False)),  # 0.33's alias
    ("0.31.0", {"disable-prefix-caching": True}, None),  # no such option in 0.31: its own check refuses it
    ("0.33.0", {"enable-prefix-caching.x": False}, None),  # a sub-key is no setting of the option
]


@pytest.mark.parametrize(("version", "extra", "expected"), PREFIX_CACHING_GIVEN)
def test_the_catalog_reads_an_option_as_vllm_does(version: str, extra: dict[str, Any],
                                                   expected: tuple[str, object] | None) -> None:
    assert load_catalog(version).given(extra, "--enable-prefix-caching") == expected


def test_the_catalog_reads_block_size_and_hash_algorithm_under_either_spelling() -> None:
    catalog = load_catalog("0.33.0")
    assert catalog.given({"block_size": 32}, "--block-size") == ("block_size", 32)
    assert catalog.given({"prefix-caching-hash-algo": "xxhash"}, "--prefix-caching-hash-algo") == (
        "prefix-caching-hash-algo", "xxhash")
    defaults = {option: spec.default for option in ("--block-size", "--prefix-caching-hash-algo")
                if (spec := catalog.spec(option)) is not None}
    assert defaults == {"--block-size": None, "--prefix-caching-hash-algo": "sha256"}


def _two_pools(project: Project, all_yml: str, a: dict[str, Any], b: dict[str, Any]) -> FleetPlan:
    """Pools a (host h1) and b (host h2) of one model, ``a`` and ``b`` their hosts' data."""
    return fleet_plan(project, "vllm_model: meta-llama/Llama-3.1-8B-Instruct\nvllm_max_model_len: 8192\n"
                      + all_yml, f'a = [("h1", {a!r})]\nb = [("h2", {b!r})]\n')


def test_the_pool_that_differs_from_the_first_is_refused_and_the_first_serves(project: Project) -> None:
    plan = _two_pools(project, "router_policy: prefix\n", {"vllm_extra_args": {"block-size": 16}},
                      {"vllm_extra_args": {"block_size": 32}})
    key = "vllm_extra_args.block-size"
    detail = (f"expected the same block size on every pool that serves {MODEL} with router_policy prefix (its"
              " replicas share cache keys), found 16 in pool a and 32 in pool b")
    assert plan.problems == [PlanProblem("b", f"{key}: {detail}", keys=(key,), detail=detail, also=("a",))]
    assert plan.problems_of("h1", "a") == [] and plan.problems_of("h2", "b") == plan.problems
    assert {r.pool for r in plan.replicas} == {"a", "b"}  # both planned: only b's hosts are kept from serving


# (all.yml, pool a's data, pool b's data) -> the problems' lines, as `gpufleet plan` prints them
ROUTING: list[tuple[str, dict[str, Any], dict[str, Any], list[str]]] = [
    ("", {}, {}, []),
    ("router_policy: prefix\n", {}, {}, []),
    ("", {"router_policy": "prefix"}, {}, [
        f"pool b: router_policy: expected the same router_policy on every pool that serves {MODEL} (the router has"
        " one backend per served model), found prefix in pool a and leastconn in pool b"]),
    ("", {}, {"router_prefix_balance": 3}, [  # with leastconn too: both pools' configuration must say one thing
        f"pool b: router_prefix_balance: expected the same router_prefix_balance on every pool that serves {MODEL}"
        " (the router has one backend per served model), found 2.0 in pool a and 3.0 in pool b"]),
    ("router_policy: prefix\n", {}, {"vllm_extra_args": {"prefix_caching_hash_algo": "sha256"}}, []),  # default
    ("router_policy: prefix\n", {"vllm_version": "0.31.0"}, {"vllm_version": "0.33.0"}, []),  # sha256 in both
    ("router_policy: prefix\n", {"vllm_extra_args": {"block-size": 16}}, {"vllm_extra_args": {"block-size": "16"}},
     []),
    ("router_policy: prefix\n", {}, {"vllm_extra_args": {"prefix-caching-hash-algo": "xxhash_cbor"}}, [
        f"pool b: vllm_extra_args.prefix-caching-hash-algo: expected the same prefix caching hash algorithm on every"
        f" pool that serves {MODEL} with router_policy prefix (its replicas share cache keys), found sha256 in pool a"
        " and xxhash_cbor in pool b"]),
    ("router_policy: prefix\n", {"vllm_extra_args": {"block-size": 32}}, {}, [
        f"pool b: vllm_extra_args.block-size: expected the same block size on every pool that serves {MODEL} with"
        " router_policy prefix (its replicas share cache keys), found 32 in pool a and the default in pool b"]),
    ("router_policy: prefix\n", {"vllm_extra_args": {"no-enable-prefix-caching": True}}, {}, [
        "pool a: vllm_extra_args.no-enable-prefix-caching: expected prefix caching on with router_policy prefix (the"
        " router sends requests that share a prefix to the replica that has it cached), found it off"]),
    ("vllm_extra_args: {enable-prefix-caching: false}\n", {}, {}, []),  # leastconn: no cache to aim at
    # another served name: another backend, with a policy of its own
    ("", {"router_policy": "prefix"}, {"vllm_served_model_name": "other", "vllm_extra_args": {"block-size": 32}}, []),
]


@pytest.mark.parametrize(("all_yml", "a", "b", "expected"), ROUTING)
def test_the_pools_of_one_model_agree_on_its_routing(project: Project, all_yml: str, a: dict[str, Any],
                                                    b: dict[str, Any], expected: list[str]) -> None:
    assert [problem.line() for problem in _two_pools(project, all_yml, a, b).problems] == expected


# --- the router's configuration ---------------------------------------------------------------------------------

def _render(**chat: object) -> str:
    """The router's configuration for REPLICAS, the hosts that serve CHAT set with ``chat``."""
    configs = {name: host_config(vllm_served_model_name=model, **(chat if model == CHAT else {}))
               for name, (model, _, _) in REPLICAS.items()}
    plan = stand_in_plan({name: (address, port) for name, (_, address, port) in REPLICAS.items()}, configs)
    found = plan_backends.backends(plan)
    values = router_role.config_values(host_config(), "10.0.0.9", found, router_role.model_lists({None: [CHAT, TINY]}),
                                       ["10.0.0.8"], dict.fromkeys(REPLICAS, 16))
    return router_role.render(values)


# (golden file of tests/data/router/, the CHAT hosts' variables); leastconn's file is the configuration from before
# router_policy, byte for byte
GOLDEN = [
    ("haproxy-leastconn.cfg", {}),
    ("haproxy-leastconn.cfg", {"router_policy": "leastconn", "router_prefix_balance": 3}),
    ("haproxy-prefix.cfg", {"router_policy": "prefix", "router_prefix_balance": 1.5}),  # TINY's backend unchanged
]


@pytest.mark.parametrize(("golden", "chat"), GOLDEN)
def test_the_router_configuration_of_each_policy(golden: str, chat: dict[str, object]) -> None:
    path = DATA / "router" / golden
    if REGOLD:
        path.write_text(_render(**chat))
    assert _render(**chat) == path.read_text()


# router_prefix_balance -> the bound in whole percent, at least 101 (a replica may always hold its share)
BALANCE_FACTORS = [(1.25, 125), (1.5, 150), (1.1, 110), (10, 1000), (1.004, 101), (1.001, 101)]


@pytest.mark.parametrize(("balance", "factor"), BALANCE_FACTORS)
def test_the_balance_is_the_bound_in_percent(balance: float, factor: int) -> None:
    assert plan_backends.Backend("m", "m", (), policy="prefix", prefix_balance=balance).bound_percent == factor
    assert plan_backends.Backend("m", "m", ()).bound_percent is None


def test_a_backend_takes_the_policy_of_its_models_first_replica() -> None:
    text = _render(router_policy="prefix", router_prefix_balance=2)
    chat, tiny = (text.split(f"backend {name}\n")[1].split("\n\n")[0] for name in ("model-chat-model",
                                                                                    "model-tiny_llama__HOME_100_"))
    assert ",mul(200),add(txn.prefix_slots)," in chat and "    balance roundrobin\n" in chat
    assert "balance leastconn" not in chat and "prefix" not in tiny and "    balance leastconn\n" in tiny


def _servers(*names: str) -> plan_backends.Backend:
    return plan_backends.Backend("m", "m", tuple((n, f"10.0.0.{i}:8000") for i, n in enumerate(names, 1)),
                                 policy="prefix", prefix_balance=1.5)


def test_a_servers_id_comes_from_its_replicas_name_alone() -> None:
    """A replica added or removed changes no other replica's id (the prefix table stores ids, not positions)."""
    two, three = _servers("pool-a", "pool-b"), _servers("pool-0", "pool-a", "pool-b")
    assert {n: three.server_ids[n] for n in ("pool-a", "pool-b")} == two.server_ids
    assert len(set(three.server_ids.values())) == 3
    assert all(1 <= i <= 2**31 - 1 for i in three.server_ids.values())
    text = _render(router_policy="prefix", router_prefix_balance=2)  # CHAT's replicas a-h1 and a-h2
    server_id = _servers("a-h1").server_ids["a-h1"]
    assert f"server a-h1 10.0.0.1:8000 id {server_id} " in text and f"sc_get_gpt(0,1) eq {server_id} }}" in text


def test_ids_that_clash_take_the_next_free_one_in_name_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plan_backends, "SERVER_ID_SPAN", 3)  # three ids for three servers: some must clash
    ids = _servers("c", "a", "b").server_ids
    assert sorted(ids.values()) == [1, 2, 3] and list(ids) == ["a", "b", "c"]
