"""Priority classes (gpufleet.plan.priority): the models a client of a class beside standard may use are served with
``--scheduling-policy priority``, shown in the plan, and the router sets each request's X-Vllm-Priority from its
client's class there, 0 elsewhere, never the client's. The refusals as users see them: tests/data/corpus/edge.yaml
(a class that is none), extra_args.yaml (the flag is gpufleet's). vLLM reading the header: its release's source
(0.31 and 0.32 read ``X-Vllm-Priority`` before the body's ``priority``)."""

from __future__ import annotations

from typing import Any

import pytest

import roles.router as router_role
from gpufleet.plan import backends as plan_backends
from gpufleet.plan import planner
from gpufleet.plan.priority import PRIORITY_CLASSES, schedules_by_priority
from gpufleet.values.vllm_flags import load_catalog
from tests.conftest import Project
from tests.stand_in_plan import stand_in_plan
from tests.unit.configs import host_config
from tests.unit.project_plans import fleet_plan

CHAT, CODE = "chat", "code"
ALL_YML = "vllm_model: meta-llama/Llama-3.1-8B-Instruct\nvllm_max_model_len: 8192\n"


def _clients(**priorities: str | None) -> dict[str, Any]:
    """Clients by name, each of the class given (None: none), allowed every model."""
    return {name: {"api_key": {"env": f"KEY_{name.upper()}"}, **({"priority": p} if p else {})}
            for name, p in priorities.items()}


# (the routers' clients, the model asked about) -> scheduled by priority
SCHEDULED = [
    ({}, CHAT, False),
    (_clients(alice=None), CHAT, False),
    (_clients(alice=None, batch="batch"), CHAT, True),
    (_clients(alice="standard"), CHAT, False),  # written or left out, standard is one class
    (_clients(alice="standard", bob=None), CHAT, False),
    (_clients(alice="interactive"), CHAT, True),
    ({"batch": {"api_key": {"env": "K"}, "priority": "batch", "models": [CODE]}}, CHAT, False),  # not its model
    ({"batch": {"api_key": {"env": "K"}, "priority": "batch", "models": [CODE]}}, CODE, True),
]


@pytest.mark.parametrize(("clients", "model", "expected"), SCHEDULED)
def test_a_model_is_scheduled_by_priority_when_a_client_of_a_class_beside_standard_may_use_it(
        clients: dict[str, Any], model: str, expected: bool) -> None:
    configs = [host_config(vllm_served_model_name=CHAT), host_config(router_clients=clients)]
    assert schedules_by_priority(model, configs) is expected


def _plan(project: Project, monkeypatch: pytest.MonkeyPatch, clients: dict[str, Any]) -> planner.FleetPlan:
    """Pools chat (10.0.0.1) and code (10.0.0.2) behind the router 10.0.0.1 with ``clients`` (keys from the
    environment)."""
    monkeypatch.setenv("KEY_REPLICAS", "replicas-key-0123456789")
    for client in clients.values():
        monkeypatch.setenv(client["api_key"]["env"], f"{client['api_key']['env'].lower()}-0123456789abcdef")
    project.group_vars("routers", f"router_clients: {clients!r}\n")
    return fleet_plan(project, ALL_YML + "vllm_api_key: {env: KEY_REPLICAS}\n",
                      f'chat = [("10.0.0.1", {{"vllm_served_model_name": "{CHAT}"}})]\n'
                      f'code = [("10.0.0.2", {{"vllm_served_model_name": "{CODE}"}})]\nrouters = ["10.0.0.1"]\n')


def test_the_planner_schedules_only_the_models_of_classed_clients_and_shows_it(
        project: Project, monkeypatch: pytest.MonkeyPatch) -> None:
    plan = _plan(project, monkeypatch, {"batch": {"api_key": {"env": "KEY_BATCH"}, "priority": "batch",
                                                  "models": [CODE]}})
    assert plan.problems == []
    argv = {r.served: r.roles[0].processes[-1].argv for r in plan.replicas}
    assert argv[CODE][argv[CODE].index("--scheduling-policy") + 1] == "priority"
    assert "--scheduling-policy" not in argv[CHAT]
    cells = {r.served: r.admission.cell() for r in plan.replicas}
    assert cells[CODE].endswith("\nby priority") and "priority" not in cells[CHAT]
    assert {m.name: m.priority for m in plan.models.values()} == {CHAT: False, CODE: True}


def test_a_release_that_cannot_schedule_by_priority_is_refused(
        project: Project, monkeypatch: pytest.MonkeyPatch) -> None:
    real = load_catalog

    def without_the_flag(version: str) -> Any:
        catalog = real(version)
        monkeypatch.setattr(catalog, "has", lambda flag: flag != "--scheduling-policy")
        return catalog

    monkeypatch.setattr(planner, "load_catalog", without_the_flag)
    plan = _plan(project, monkeypatch, {"batch": {"api_key": {"env": "KEY_BATCH"}, "priority": "batch",
                                                  "models": [CODE]}})
    lines = [problem.line() for problem in plan.problems]
    assert len(lines) == 1 and lines[0].startswith("pool code: router_clients: expected a vLLM release that schedules"
                                                   " by priority for 'code'"), lines
    assert "has no --scheduling-policy" in lines[0] and {r.served for r in plan.replicas} == {CHAT}


def _render(clients: dict[str, Any]) -> tuple[str, dict[str, str]]:
    """The router's configuration and edge maps for one replica of CHAT (h1) and one of CODE (h2)."""
    router = host_config(router_clients=clients)
    configs = {"h1": host_config(vllm_served_model_name=CHAT), "h2": host_config(vllm_served_model_name=CODE),
               "r1": router}
    plan = stand_in_plan({"h1": ("10.0.0.1", 8000), "h2": ("10.0.0.2", 8000)}, configs)
    found = plan_backends.backends(plan)
    values = router_role.config_values(router, "10.0.0.9", found, router_role.model_lists({None: [CHAT, CODE]}),
                                       [], dict.fromkeys(("h1", "h2"), 4))
    keys = {name: f"{name}-key-0123456789abcdef" for name in clients}
    return router_role.render(values), router_role.edge_maps(router.router_clients, keys, found, {})


def _backend(text: str, model: str) -> str:
    return text.split(f"backend model-{model}\n")[1].split("\n\n")[0]


def test_the_router_sets_the_priority_of_the_clients_class_never_the_clients_own() -> None:
    text, maps = _render({"alice": {"api_key": {"env": "A"}, "priority": "interactive"},
                          "bulk": {"api_key": {"env": "B"}, "priority": "batch", "models": [CODE]},
                          "carol": {"api_key": {"env": "C"}}})
    entries = [line for line in maps["priorities"].splitlines() if not line.startswith("#")]
    assert entries == [f"alice {PRIORITY_CLASSES['interactive']}", f"bulk {PRIORITY_CLASSES['batch']}",
                       f"carol {PRIORITY_CLASSES['standard']}"]
    frontend = text.split("frontend gpufleet-api\n")[1].split("\n\n")[0]
    assert "    http-request del-header X-Vllm-Priority\n" in frontend  # before any backend sets it
    for model in (CHAT, CODE):  # alice (interactive) may use both: both are scheduled by priority
        assert ("    http-request set-header X-Vllm-Priority %[var(txn.client),map_str_int(/etc/haproxy/gpufleet-edge/"
                f"priorities.map,{PRIORITY_CLASSES['standard']})]\n") in _backend(text, model)


def test_a_model_no_classed_client_may_use_gets_priority_0() -> None:
    text, _ = _render({"bulk": {"api_key": {"env": "B"}, "priority": "batch", "models": [CODE]},
                       "carol": {"api_key": {"env": "C"}}})
    assert "    http-request set-header X-Vllm-Priority 0\n" in _backend(text, CHAT)
    assert "map_str_int(/etc/haproxy/gpufleet-edge/priorities.map" in _backend(text, CODE)
