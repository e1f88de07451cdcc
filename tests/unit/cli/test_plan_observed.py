"""``gpufleet plan --observed``: each replica's plan beside the KV cache vLLM reported at its last start, read from
the ``observed.json`` the readiness wait left on its first node (gpufleet/plan/kv_observed.py), over a stand-in for the
connections (one ``head`` per node, as on a node)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner, Result

from gpufleet.cli.main import main
from gpufleet.node_paths import observed_file
from gpufleet.plan.kv_observed import observed_line
from gpufleet.remote import commands as remote_module
from tests.conftest import DATA
from tests.unit.node_files import NodeFiles

FLEET = str(DATA / "plans" / "a_single_node_70b" / "inventory.py")
A01, A02 = "gpu-a01.dc1.example.net", "gpu-a02.dc1.example.net"


def _plan(monkeypatch: pytest.MonkeyPatch, nodes: NodeFiles | None, *args: str) -> Result:
    def connect(inventory: object) -> NodeFiles:
        assert nodes is not None, "connected to a node"
        return nodes

    monkeypatch.setattr(remote_module, "PyinfraRemote", connect)
    return CliRunner().invoke(main, ["plan", FLEET, *args], catch_exceptions=False)


def _planned() -> dict[str, int]:
    done = CliRunner().invoke(main, ["plan", FLEET, "--json"], catch_exceptions=False)
    return {r["name"]: r["kv_tokens_per_gpu"] for r in json.loads(done.stdout)}


def _doc(tokens: int | None, planned: int) -> str:
    """An observed.json as vllm_ready.py writes it."""
    return json.dumps({"kv_cache_tokens": tokens, "block_size": 16,
                       "num_blocks": None if tokens is None else tokens // 16,
                       "max_concurrency": None if tokens is None else round(tokens / 32768, 2),
                       "max_model_len": 32768, "planned_kv_cache_tokens": planned,
                       "ratio": None if tokens is None else round(tokens / planned, 4), "tolerance": 0.05,
                       "source": "vllm:cache_config_info", "vllm_version": "0.33.0", "time": "2026-11-23T05:10:41Z"},
                      indent=2) + "\n"


@pytest.fixture
def nodes() -> NodeFiles:
    """On gpu-a01 both replicas started: one as planned, one with 10% fewer tokens; on gpu-a02 neither has yet."""
    planned = _planned()
    a0, a1 = "llama_70b-gpu-a01-0", "llama_70b-gpu-a01-1"
    return NodeFiles({A01: {observed_file(a0): _doc(planned[a0], planned[a0]),
                            observed_file(a1): _doc(planned[a1] * 9 // 10, planned[a1])}})


def test_json_shows_each_replicas_observation_beside_its_plan(monkeypatch: pytest.MonkeyPatch,
                                                              nodes: NodeFiles) -> None:
    done = _plan(monkeypatch, nodes, "--json", "--observed")
    assert done.exit_code == 0, done.stderr
    replicas = {r["name"]: r for r in json.loads(done.stdout)}
    first = replicas["llama_70b-gpu-a01-0"]
    assert first["observed"] == json.loads(nodes.files[A01][observed_file("llama_70b-gpu-a01-0")])
    assert first["observed"]["kv_cache_tokens"] == first["kv_tokens_per_gpu"]
    assert replicas["llama_70b-gpu-a01-1"]["observed"]["ratio"] == 0.9
    assert {name for name, r in replicas.items() if r["observed"] is None} == {
        name for name in replicas if "gpu-a01" not in name}
    # one command per first node, reading all of its replicas' files; each node's lifecycle record read once; every
    # connection closed
    heads = [host for host, words in nodes.commands if words[:3] == ["env", "LC_ALL=C", "head"]]
    assert sorted(heads) == sorted({r["nodes"][0] for r in replicas.values()})
    shows = [host for host, words in nodes.commands if "show" in words]
    assert sorted(shows) == sorted({n for r in replicas.values() for n in r["nodes"]})
    assert nodes.closed


def test_the_table_shows_planned_and_reported_tokens(monkeypatch: pytest.MonkeyPatch, nodes: NodeFiles) -> None:
    done = _plan(monkeypatch, nodes, "--observed")
    assert done.exit_code == 0, done.stderr
    planned = _planned()["llama_70b-gpu-a01-1"]
    seqs = round(planned * 9 // 10 / 32768, 2)  # the sequences at max length vLLM reported (_doc)
    for text in ("KV tokens", f"{planned:,}", f"vLLM {planned * 9 // 10:,}", "ratio 1.000", "ratio 0.900",
                 "> 5% off", "recorded", f"vLLM {seqs:,.1f}", "llama_70b-gpu-a01-1"):
        assert text in done.stdout, text


def test_a_node_that_cannot_be_read_is_named_and_the_rest_shown(monkeypatch: pytest.MonkeyPatch,
                                                                nodes: NodeFiles) -> None:
    nodes.unreachable.add(A01)
    done = _plan(monkeypatch, nodes, "--json", "--observed")
    assert done.exit_code == 1
    assert all(r["observed"] is None for r in json.loads(done.stdout))
    assert done.stderr.splitlines() == [
        f"gpufleet plan: {A01}: its record could not be read: {A01}: cannot connect: timed out",
        f"gpufleet plan: node {A01}: cannot read the KV cache vLLM reported: {A01}: cannot connect: timed out"]


def test_a_file_that_is_not_an_observation_is_named(monkeypatch: pytest.MonkeyPatch, nodes: NodeFiles) -> None:
    path = observed_file("llama_70b-gpu-a02-0")
    nodes.files[A02] = {path: '{"kv_cache_tokens": "many"}'}
    done = _plan(monkeypatch, nodes, "--json", "--observed")
    assert done.exit_code == 1
    assert done.stderr.splitlines() == [
        f"gpufleet plan: node {A02}: {path}: observed.json holds kv_cache_tokens 'many'"]


def test_without_observed_no_node_is_contacted(monkeypatch: pytest.MonkeyPatch) -> None:
    done = _plan(monkeypatch, None, "--json")
    assert done.exit_code == 0 and all("observed" not in r for r in json.loads(done.stdout))


@pytest.mark.parametrize(("text", "off", "line"), [
    (None, False, "KV cache planned 1,000 tokens; vLLM's figure is not recorded yet (observed.json is written when"
                  " the replica starts)"),
    ('{"kv_cache_tokens": 1049}', False, "KV cache planned 1,000 tokens, vLLM reports 1,049 (ratio 1.049)"),
    ('{"kv_cache_tokens": 1051}', True, "KV cache planned 1,000 tokens, vLLM reports 1,051 (ratio 1.051): more than"
                                        " 5% off the plan (vllm_plan_tolerance)"),
    ('{"kv_cache_tokens": null}', False, "KV cache planned 1,000 tokens, vLLM reported no figure"),
    ('[1]', True, "KV cache planned 1,000 tokens; observed.json is not a JSON object: '[1]'"),
    ('{"kv_cache_tokens": true}', True, "KV cache planned 1,000 tokens; observed.json holds kv_cache_tokens True"),
])
def test_the_deploys_line(text: str | None, off: bool, line: str) -> None:
    assert observed_line(1000, text, 0.05) == (off, line)


KV_LINE = "KV cache planned 1,000 tokens, vLLM reports 1,000 (ratio 1.000)"
CACHING_OFF = ("prefix caching off under router_policy prefix, which sends each request to the replica that has its"
               " prefix cached: turn vLLM's prefix caching on (vllm_extra_args enable-prefix-caching: true) or route"
               " by leastconn")


@pytest.mark.parametrize(("reported", "prefix_routed", "off", "line"), [
    ({"enable_prefix_caching": True, "prefix_caching_hash_algo": "sha256", "block_size": 16}, True, False,
     f"{KV_LINE}; prefix caching on (sha256, block 16)"),
    ({"enable_prefix_caching": True, "prefix_caching_hash_algo": None, "block_size": None}, True, False,
     f"{KV_LINE}; prefix caching on"),
    ({"enable_prefix_caching": False, "prefix_caching_hash_algo": "sha256", "block_size": 16}, False, False,
     f"{KV_LINE}; prefix caching off"),
    ({"enable_prefix_caching": False, "prefix_caching_hash_algo": "sha256", "block_size": 16}, True, True,
     f"{KV_LINE}; {CACHING_OFF}"),
    ({"enable_prefix_caching": None, "prefix_caching_hash_algo": None, "block_size": 16}, True, False, KV_LINE),
    ({"kv_cache_tokens": 1100, "enable_prefix_caching": False}, True, True,
     "KV cache planned 1,000 tokens, vLLM reports 1,100 (ratio 1.100): more than 5% off the plan"
     f" (vllm_plan_tolerance); {CACHING_OFF}"),
], ids=["on", "on_without_details", "off_under_leastconn", "off_under_prefix_is_a_warning", "not_reported",
        "off_the_plan_and_off_under_prefix"])
def test_the_deploys_line_says_what_vllm_reports_of_prefix_caching(reported: dict[str, object], prefix_routed: bool,
                                                                    off: bool, line: str) -> None:
    text = json.dumps({"kv_cache_tokens": 1000, **reported})
    assert observed_line(1000, text, 0.05, prefix_routed=prefix_routed) == (off, line)


@pytest.mark.parametrize(("key", "value"), [("enable_prefix_caching", "True"), ("prefix_caching_hash_algo", 5),
                                            ("block_size", True), ("block_size", "16")])
def test_a_prefix_caching_record_of_another_type_is_named(key: str, value: object) -> None:
    assert observed_line(1000, json.dumps({"kv_cache_tokens": 1000, key: value}), 0.05) == (
        True, f"KV cache planned 1,000 tokens; observed.json holds {key} {value!r}")


def test_a_node_out_of_the_fleet_is_left_out_of_the_plan(monkeypatch: pytest.MonkeyPatch, nodes: NodeFiles) -> None:
    """gpu-a02 is quarantined (its lifecycle record): the plan holds the other nodes' replicas, and says why."""
    from datetime import UTC, datetime

    from gpufleet.node import node_state

    now = datetime(2026, 11, 27, 12, 0, tzinfo=UTC)
    record = node_state.move(node_state.new_record(A02, now), "burn-in", "first seen", now)
    nodes.records[A02] = node_state.quarantine(record, "Xid 79 on 0000:3b:00", now, node_state.Policy())
    done = _plan(monkeypatch, nodes, "--json", "--observed")
    assert done.exit_code == 0, done.stderr
    everyone = {n for r in json.loads(_plan(monkeypatch, nodes, "--json").stdout) for n in r["nodes"]}
    assert A02 in everyone
    assert {n for r in json.loads(done.stdout) for n in r["nodes"]} == everyone - {A02}
    assert ("out of the fleet, not planned: gpu-a02.dc1.example.net: the node is quarantined since"
            " 2026-11-27T12:00:00Z: Xid 79 on 0000:3b:00") in done.stderr
