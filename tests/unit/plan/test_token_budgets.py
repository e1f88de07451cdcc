"""Token budgets in the plan (gpufleet.plan.token_budgets) and the router's configuration: the models a client with
a token budget may use are served with ``--enable-force-include-usage`` and their backends ask the token ledger;
the others are left as they were. The ledger's own decisions: tests/unit/node/test_token_ledger.py; the edge with
real HAProxies: tests/tools/test_router_tokens.py; the refusals as users see them: tests/data/corpus/routers.yaml."""

from __future__ import annotations

import json
from typing import Any

import pytest

import roles.router as router_role
from gpufleet.cli.main import _print_table as print_table
from gpufleet.plan import backends as plan_backends
from gpufleet.plan.planner import FleetPlan
from gpufleet.plan.token_budgets import meters_tokens
from roles.router import token_ledger
from tests.conftest import Project
from tests.stand_in_plan import stand_in_plan
from tests.unit.configs import host_config
from tests.unit.project_plans import fleet_plan

CHAT, CODE = "chat", "code"
BATCH = {"api_key": {"env": "KEY_BATCH"}, "tokens_per_minute": 5000, "models": [CODE]}


@pytest.mark.parametrize(("clients", "model", "expected"), [
    ({}, CHAT, False),
    ({"alice": {"api_key": {"env": "K"}}}, CHAT, False),
    ({"alice": {"api_key": {"env": "K"}, "tokens_per_day": 9}}, CHAT, True),  # every model
    ({"batch": BATCH}, CHAT, False),  # not its model
    ({"batch": BATCH}, CODE, True),
])
def test_a_model_is_metered_when_a_client_with_a_token_budget_may_use_it(
        clients: dict[str, Any], model: str, expected: bool) -> None:
    assert meters_tokens(model, [host_config(), host_config(router_clients=clients)]) is expected


def _chat_and_code(project: Project, monkeypatch: pytest.MonkeyPatch) -> FleetPlan:
    """The two models' pools planned with the routers' clients already written; only ``code`` reports streamed
    usage (a client with a budget or a share may use only it)."""
    monkeypatch.setenv("KEY_REPLICAS", "replicas-key-0123456789")
    plan = fleet_plan(project, "vllm_model: meta-llama/Llama-3.1-8B-Instruct\nvllm_max_model_len: 8192\n"
                      "vllm_api_key: {env: KEY_REPLICAS}\n",
                      f'chat = [("10.0.0.1", {{"vllm_served_model_name": "{CHAT}"}})]\n'
                      f'code = [("10.0.0.2", {{"vllm_served_model_name": "{CODE}"}})]\nrouters = ["10.0.0.1"]\n')
    assert plan.problems == []
    argv = {r.served: r.roles[0].processes[-1].argv for r in plan.replicas}
    assert "--enable-force-include-usage" in argv[CODE] and "--enable-force-include-usage" not in argv[CHAT]
    return plan


def test_the_planner_has_only_the_metered_models_report_streamed_usage(
        project: Project, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEY_BATCH", "batch-key-0123456789abcdef")
    project.group_vars("routers", f"router_clients: {{'batch': {BATCH!r}}}\n")
    plan = _chat_and_code(project, monkeypatch)
    assert {m.name: (m.metered, m.max_model_len) for m in plan.models.values()} == {CHAT: (False, 8192),
                                                                                    CODE: (True, 8192)}


def test_only_a_metered_models_backend_asks_the_ledger_and_its_budgets_name_only_metered_clients() -> None:
    router = host_config(router_clients={"batch": BATCH, "carol": {"api_key": {"env": "C"}}},
                         router_token_weights={"prompt": 1, "completion": 4})
    configs = {"h1": host_config(vllm_served_model_name=CHAT), "h2": host_config(vllm_served_model_name=CODE),
               "r1": router}
    found = plan_backends.backends(stand_in_plan({"h1": ("10.0.0.1", 8000), "h2": ("10.0.0.2", 8000)}, configs))
    text = router_role.render(router_role.config_values(router, "10.0.0.9", found, [], [],
                                                        dict.fromkeys(("h1", "h2"), 4)))
    assert f"lua-load-per-thread {token_ledger.LUA}\n" in text
    chat, code = (text.split(f"backend model-{model}\n")[1].split("\n\n")[0] for model in (CHAT, CODE))
    assert "lua.gpufleet_reserve model-code " in code and "filter lua.gpufleet_usage" in code
    assert "gpufleet_reserve" not in chat and "gpufleet_usage" not in chat
    maps = router_role.edge_maps(router.router_clients, {"batch": "b" * 20, "carol": "c" * 20}, found, {})
    assert [line for line in maps["budgets"].splitlines() if not line.startswith("#")] == ["batch 1"]
    budgets = json.loads(token_ledger.budgets(router, found, dict.fromkeys(("h1", "h2"), 4)))
    assert budgets == {"clients": {"batch": {"tokens_per_minute": 5000, "tokens_per_day": None}},
                       "weights": {"prompt": 1.0, "completion": 4.0}, "models": {"model-code": CODE},
                       "max_tokens": {"model-code": 4096}, "hold_s": router.router_timeout_s + 60, "shares": {},
                       "classes": {}, "slots": {}, "queue_s": router.router_queue_timeout_s}


def test_without_a_token_budget_the_router_loads_no_lua() -> None:
    router = host_config(router_clients={"carol": {"api_key": {"env": "C"}}})
    found = plan_backends.backends(stand_in_plan({"h1": ("10.0.0.1", 8000)},
                                                 {"h1": host_config(vllm_served_model_name=CHAT), "r1": router}))
    text = router_role.render(router_role.config_values(router, "10.0.0.9", found, [], [], {"h1": 4}))
    assert "lua" not in text and token_ledger.config_values(router) is None


def test_a_model_a_client_with_a_share_may_use_is_shared_every_clients_request_asks_the_ledger(
        project: Project, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KEY_TEAM", "team-key-0123456789abcdef")
    shared = {"api_key": {"env": "KEY_TEAM"}, "share": 3, "models": [CODE], "priority": "batch"}
    project.group_vars("routers", f"router_clients: {{'team': {shared!r}}}\n")
    plan = _chat_and_code(project, monkeypatch)
    assert {m.name: (m.metered, m.fair) for m in plan.models.values()} == {CHAT: (False, False), CODE: (False, True)}
    print_table(plan)  # gpufleet plan's table says which model is shared
    assert capsys.readouterr().out.count("fair share") == sum(r.served == CODE for r in plan.replicas) > 0
    router = host_config(router_clients={"team": shared, "carol": {"api_key": {"env": "C"}}})
    found = plan_backends.backends(stand_in_plan({"h1": ("10.0.0.1", 8000), "h2": ("10.0.0.2", 8000)},
                                                 {"h1": host_config(vllm_served_model_name=CHAT),
                                                  "h2": host_config(vllm_served_model_name=CODE), "r1": router}))
    text = router_role.render(router_role.config_values(router, "10.0.0.9", found, [], [], {"h1": 4, "h2": 6}))
    chat, code = (text.split(f"backend model-{model}\n")[1].split("\n\n")[0] for model in (CHAT, CODE))
    assert "http-request lua.gpufleet_reserve model-code if { var(txn.client) -m found }" in code  # every client
    assert "gpufleet_reserve" not in chat
    budgets = json.loads(token_ledger.budgets(router, found, {"h1": 4, "h2": 6}))
    assert (budgets["shares"], budgets["slots"], budgets["clients"]) == ({"team": 3}, {"model-code": 6}, {})
    assert budgets["classes"] == {"team": 2, "carol": 1}  # the fair queue serves a class before the next one
