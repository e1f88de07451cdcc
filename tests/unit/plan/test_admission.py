"""Admission: the requests a replica takes at once at the router (HAProxy's ``maxconn``) and in vLLM itself
(``--max-num-queued-reqs``), from the plan's KV budget to ``gpufleet plan``, the vLLM flags and the router's
configuration. HAProxy running that configuration: tests/tools/test_router_admission.py."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from click.testing import CliRunner

import roles.router as router_role
from gpufleet.cli.main import main
from gpufleet.gpu.profiles import profile_facts
from gpufleet.inventory.load import load_fleet
from gpufleet.plan import backends as plan_backends
from gpufleet.plan.admission import (
    QUEUED_REQS_FLAG,
    Admission,
    TypicalLengthError,
    UnsupportedLimitError,
    admission,
    planned_concurrency,
)
from gpufleet.plan.model_memory import KvBudget, kv_space_budget
from gpufleet.plan.planner import FleetPlan, plan_fleet
from gpufleet.values.vllm_flags import SUPPORTED_VLLM_VERSIONS, FlagCatalog, load_catalog
from tests.conftest import DATA, Project
from tests.unit.configs import host_config

SHAPE_A = DATA / "plans" / "a_single_node_70b" / "inventory.py"


def _budget(sequences: float) -> KvBudget:
    """A KV budget that holds ``sequences`` full-length sequences (of 100 tokens, 1 byte each)."""
    return kv_space_budget(round(sequences * 100), 0, 1, 100, block_size=1)


# (sequences at max_model_len per rank, vLLM's max_num_seqs per rank, DP ranks) -> requests the replica takes
PLANNED = [
    ((13.57, 256, 1), 13),  # whole sequences: a request the cache holds at full length is never preempted
    ((8192.0, 128, 1), 128),  # the batch bounds it: more would wait in vLLM's queue, not the router's
    ((5.57, 1024, 2), 10),  # one router server stands for both ranks, each holding its own
    ((36.48, 16, 2), 32),
    ((1.0, 1024, 4), 4),
]


@pytest.mark.parametrize(("given", "expected"), PLANNED)
def test_planned_concurrency(given: tuple[float, int, int], expected: int) -> None:
    sequences, seqs, dp = given
    assert _budget(sequences).full_sequences == int(sequences)
    assert planned_concurrency(_budget(sequences), seqs, dp) == expected


def test_sequences_of_a_typical_length_are_counted_in_whole_blocks() -> None:
    budget = _budget(13.57)  # 1,357 tokens, sequences of 100 at most
    assert [budget.sequences_at(tokens) for tokens in (100, 25, 1, 1357, 0)] == [13, 54, 1357, 1, 0]
    blocks = kv_space_budget(1600, 0, 1, 100, block_size=16)  # 100 blocks of 16 tokens
    assert [blocks.sequences_at(tokens) for tokens in (16, 17, 100)] == [100, 50, 14]
    assert blocks.sequences_at(blocks.tokens_per_sequence) == blocks.full_sequences


# (variables) -> (planned, router maxconn, vLLM's --max-num-queued-reqs, what maxconn is from); the budget: 13.57
# sequences at max_model_len (100 tokens)
ADMISSION = [
    ({}, (13, 13, 26, "at max_model_len")),
    ({"router_server_maxconn": 4}, (13, 4, 8, "set (router_server_maxconn)")),  # vLLM's limit follows maxconn
    ({"vllm_max_num_queued_reqs": 100}, (13, 13, 100, "at max_model_len")),
    ({"router_server_maxconn": 40, "vllm_max_num_queued_reqs": 50}, (13, 40, 50, "set (router_server_maxconn)")),
    ({"router_typical_request_tokens": 25}, (54, 54, 108, "at 25 tokens")),  # four times as many at a quarter
    ({"router_typical_request_tokens": 1}, (256, 256, 512, "at 1 tokens")),  # vLLM's batch bounds it still
    ({"router_typical_request_tokens": 25, "router_server_maxconn": 4}, (54, 4, 8, "set (router_server_maxconn)")),
]


@pytest.mark.parametrize(("values", "expected"), ADMISSION)
def test_admission_from_the_plan_and_its_variables(values: dict[str, Any],
                                                   expected: tuple[int, int, int, str]) -> None:
    found = admission(host_config(**values), _budget(13.57), 256, 1, load_catalog("0.33.0"))
    assert (found.planned, found.maxconn, found.queued_reqs, found.basis) == expected


def test_a_typical_request_longer_than_max_model_len_is_refused() -> None:
    with pytest.raises(TypicalLengthError, match=r"^expected at most max_model_len, 100 tokens, found 101$"):
        admission(host_config(router_typical_request_tokens=101), _budget(13.57), 256, 1, load_catalog("0.33.0"))


def _without_the_flag() -> FlagCatalog:
    """0.33.0's catalog less --max-num-queued-reqs: a release that does not have it."""
    real = load_catalog("0.33.0")
    specs = [spec for name in real.names if name != QUEUED_REQS_FLAG and (spec := real.spec(name)) is not None]
    return FlagCatalog("0.33.0-without", specs, {}, real.config_classes)


def test_a_release_without_the_flag_gets_none_and_refuses_a_set_limit() -> None:
    catalog = _without_the_flag()
    assert admission(host_config(), _budget(13.57), 256, 1, catalog) == Admission(13, 13, None)
    with pytest.raises(UnsupportedLimitError, match=r"^expected null with vLLM 0.33.0-without \(it has no"
                                                    r" --max-num-queued-reqs\), found 64$"):
        admission(host_config(vllm_max_num_queued_reqs=64), _budget(13.57), 256, 1, catalog)


def test_every_supported_release_has_the_flag() -> None:
    assert [v for v in SUPPORTED_VLLM_VERSIONS if not load_catalog(v).has(QUEUED_REQS_FLAG)] == []


# --- the planner -----------------------------------------------------------------------------------------------

BASE = """\
vllm_model: meta-llama/Llama-3.1-8B-Instruct
gpu_profile: 8xH100-SXM
vllm_max_model_len: 8192
vllm_tensor_parallel_size: 1
"""


def _fleet_plan(project: Project, all_yml: str) -> FleetPlan:
    """Llama-3.1-8B on one 8xH100 node, TP 1, with ``all_yml`` (lines of group_vars/all.yml)."""
    project.group_vars("all", BASE + all_yml)
    fleet = load_fleet(str(project.inventory('small = ["h1"]')))
    plan = plan_fleet(fleet, {h: profile_facts("8xH100-SXM", h) for h in fleet.hosts})
    assert [p.line() for p in plan.problems] == []
    return plan


def _queued_flag(plan: FleetPlan) -> set[int]:
    """The --max-num-queued-reqs of every replica's vLLM, as its command line and its config.yaml have it."""
    found = set()
    for replica in plan.replicas:
        for role in replica.roles:
            (process,) = role.processes
            argv = process.argv
            found.add(int(argv[argv.index(QUEUED_REQS_FLAG) + 1]))
            assert f"\nmax-num-queued-reqs: {argv[argv.index(QUEUED_REQS_FLAG) + 1]}\n" in process.config_yaml()
    return found


def test_a_data_parallel_replica_takes_each_ranks_share(project: Project) -> None:
    single = _fleet_plan(project, "")
    double = _fleet_plan(project, "vllm_data_parallel_size: 2\n")
    one, two = single.replicas[0], double.replicas[0]
    assert one.budget.full_sequences == two.budget.full_sequences >= 8  # the same GPUs per rank
    assert one.admission.maxconn == one.budget.full_sequences
    assert two.admission.maxconn == 2 * two.budget.full_sequences
    assert _queued_flag(double) == {4 * two.budget.full_sequences}
    assert two.to_json()["router_maxconn"] == two.admission.maxconn


def test_max_num_seqs_bounds_the_maxconn(project: Project) -> None:
    plan = _fleet_plan(project, "vllm_extra_args: {max-num-seqs: 4}\n")
    assert {r.admission for r in plan.replicas} == {Admission(4, 4, 8)}
    assert _queued_flag(plan) == {8}


def test_a_pools_typical_request_sizes_its_replicas_admission(project: Project) -> None:
    full = _fleet_plan(project, "")
    typical = _fleet_plan(project, "router_typical_request_tokens: 2048\n")
    one, short = full.replicas[0], typical.replicas[0]
    assert short.admission.maxconn == min(short.budget.sequences_at(2048), 1024) > one.admission.maxconn
    assert short.admission.sized_at == 2048 and "at 2,048 tokens" in short.admission.cell()
    assert _queued_flag(typical) == {2 * short.admission.maxconn}


def test_the_variables_replace_the_planned_figures(project: Project) -> None:
    plan = _fleet_plan(project, "router_server_maxconn: 3\n")
    assert {(r.admission.maxconn, r.admission.queued_reqs) for r in plan.replicas} == {(3, 6)}
    assert plan.warnings == []
    plan = _fleet_plan(project, "vllm_max_num_queued_reqs: 2\n")
    assert _queued_flag(plan) == {2}
    (maxconn,) = {r.admission.maxconn for r in plan.replicas}
    assert plan.warnings == [f"pool small: vllm_max_num_queued_reqs 2 is below the router's maxconn {maxconn} of each"
                             " replica: vLLM answers 503 to requests the router admitted"]


# --- gpufleet plan -----------------------------------------------------------------------------------------------

def test_gpufleet_plan_shows_the_figures_of_every_replica() -> None:
    as_json = CliRunner().invoke(main, ["plan", str(SHAPE_A), "--json"], catch_exceptions=False)
    assert as_json.exit_code == 0, as_json.output
    replicas = json.loads(as_json.stdout)
    assert {(r["router_maxconn"], r["max_num_queued_reqs"]) for r in replicas} == {(13, 26)}
    table = CliRunner().invoke(main, ["plan", str(SHAPE_A)], catch_exceptions=False)
    assert table.exit_code == 0, table.output
    cells = re.findall(r"│ (maxconn \d+|at max_model_len|queued \d+) +│$", table.stdout, re.M)  # the last column
    assert cells == ["maxconn 13", "at max_model_len", "queued 26"] * len(replicas)


# --- the router's configuration ----------------------------------------------------------------------------------

def _router_config(queue_timeout_s: float = 5) -> tuple[str, FleetPlan]:
    fleet = load_fleet(str(SHAPE_A))
    plan = plan_fleet(fleet, {h: profile_facts("8xH100-SXM", h) for h in fleet.hosts})
    cfg = host_config(router_queue_timeout_s=queue_timeout_s)
    values = router_role.config_values(cfg, "10.40.0.5", plan_backends.backends(plan),
                                       router_role.model_lists({None: ["llama-3.1-70b"]}), [],
                                       router_role.replica_maxconn(plan.replicas))
    return router_role.render(values), plan


def test_each_replicas_server_gets_its_planned_maxconn() -> None:
    text, plan = _router_config()
    servers = re.findall(r"^    server (\S+) (\S+) maxconn (\d+)$", text, re.M)
    assert servers == [(r.name, f"{r.roles[0].address}:{r.port}", str(r.admission.maxconn))
                       for r in sorted(plan.replicas, key=lambda r: r.name)]
    assert len(re.findall(r"^    server ", text, re.M)) == len(servers) == 8


# router_queue_timeout_s -> (HAProxy's timeout queue, the Retry-After of its own 503s)
QUEUE_TIMEOUTS = [
    (5, ("5000ms", "5")),
    (2.5, ("2500ms", "3")),  # whole seconds, rounded up
    (0.25, ("250ms", "1")),
    (0.0001, ("1ms", "1")),  # at least a millisecond and a second
    (3600, ("3600000ms", "3600")),
]


@pytest.mark.parametrize(("seconds", "expected"), QUEUE_TIMEOUTS)
def test_the_queue_timeout_and_the_retry_after(seconds: float, expected: tuple[str, str]) -> None:
    text, _ = _router_config(seconds)
    queue, retry_after = expected
    assert re.findall(r"^    timeout queue (\S+)$", text, re.M) == [queue]
    (error,) = re.findall(r"^    http-error (.*)$", text, re.M)
    assert error == (f"status 503 content-type application/json hdr Retry-After {retry_after} string"
                     f" '{router_role.UNAVAILABLE}'")
    assert "'" not in router_role.UNAVAILABLE and json.loads(router_role.UNAVAILABLE)["error"]["code"] == 503
