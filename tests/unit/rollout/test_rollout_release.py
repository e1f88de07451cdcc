"""A replica's release record (gpufleet/rollout/release.py): what it holds, its text, its way back through
pyinfra's ``--data``, and the vllm role writing it on every node of a replica without restarting it."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from gpufleet import node_paths
from gpufleet.config.schema import SECRET_KEYS, HostConfig
from gpufleet.inventory.load import data_value
from gpufleet.rollout import release as rel
from tests.unit.configs import host_config
from tests.unit.vllm_role_run import planned_shape, run_vllm_role

# Values a release can hold, the awkward ones above all: text that reads as a number, a boolean or JSON.
SAMPLES: list[Any] = ["0123", "1.10", "true", "False", "null", "", "12", "-3", "1e3", "a=b", "with space", '"q"',
                      "ü ∑", "main; touch /tmp/x", "$(id)", 0, -3, 8192, 0.92, 1.0, True, False, None, [],
                      ["a", 1, None], {}, {"max-num-seqs": 256, "override": {"temperature": 0.5}}]


def test_a_release_holds_no_secret_and_only_configuration_keys() -> None:
    assert not SECRET_KEYS & set(rel.RELEASE_KEYS)
    assert set(rel.RELEASE_KEYS) <= set(HostConfig.model_fields)
    assert {"vllm_version", "vllm_package", "vllm_model", "vllm_model_revision", "vllm_served_model_name",
            "vllm_extra_args", "vllm_env", "vllm_max_model_len", "vllm_dtype", "vllm_kv_cache_dtype",
            "vllm_quantization"} <= set(rel.RELEASE_KEYS)


def test_the_record_is_stable_sorted_json_that_reads_back() -> None:
    cfg = host_config(vllm_version="0.32.0", vllm_extra_args={"max-num-seqs": 8, "enable-prefix-caching": True},
                      vllm_env={"VLLM_CPU_KVCACHE_SPACE": "4"}, vllm_model_revision="0123")
    release = rel.release_of(cfg)
    text = rel.release_json(release)
    assert text == rel.release_json(rel.release_of(cfg)) and text.endswith("}\n") and text.isascii()
    assert list(json.loads(text)) == sorted(rel.RELEASE_KEYS)
    assert rel.parse_release(text, "n:r") == release
    assert release["vllm_model_revision"] == "0123" and release["vllm_extra_args"]["max-num-seqs"] == 8


@pytest.mark.parametrize(("text", "line"), [
    ("{", "n:/p: expected a release record (JSON), found invalid JSON"),
    ("[1]", "n:/p: expected a release record (a JSON object), found list"),
])
def test_a_record_that_is_none_is_one_line(text: str, line: str) -> None:
    with pytest.raises(rel.ReleaseError, match="^" + line.replace("(", r"\(").replace(")", r"\)")):
        rel.parse_release(text, "n:/p")


def test_keys_this_gpufleet_does_not_know_never_come_back() -> None:
    assert rel.parse_release('{"vllm_version": "0.31.0", "vllm_api_key": "x", "other": 1}', "w") == {
        "vllm_version": "0.31.0"}


def test_every_value_comes_back_through_data_as_itself() -> None:
    texts = [rel.data_value(value) for value in SAMPLES]
    assert [data_value(text) for text in texts] == SAMPLES  # gpufleet's reading of --data
    assert all(text.isascii() and "\n" not in text for text in texts)
    # pyinfra's own, in a child process (importing pyinfra's CLI monkey-patches the process with gevent)
    code = ("import json, sys; from pyinfra_cli.util import parse_cli_arg;"
            "print(json.dumps([parse_cli_arg(a) for a in json.loads(sys.argv[1])]))")
    theirs = subprocess.run([sys.executable, "-c", code, json.dumps(texts)], capture_output=True, text=True,
                            check=True).stdout
    assert json.loads(theirs) == SAMPLES


def test_data_items_and_overrides_give_only_what_differs() -> None:
    inventory = {"vllm_version": "0.32.0", "vllm_model_revision": "b", "vllm_env": {}}
    target = {"vllm_env": {}, "vllm_model_revision": "a", "vllm_version": "0.31.0"}
    assert rel.overrides(target, inventory) == {"vllm_version": "0.31.0", "vllm_model_revision": "a"}
    assert rel.data_items(rel.overrides(target, inventory)) == ['vllm_version="0.31.0"', 'vllm_model_revision="a"']
    assert rel.overrides(inventory, inventory) == {}
    assert rel.changes(inventory, target) == 'vllm_version "0.32.0" -> "0.31.0"; vllm_model_revision "b" -> "a"'
    assert rel.changes(inventory, inventory) == "unchanged"
    assert rel.changes(None, inventory) == 'unknown -> vllm_version "0.32.0", vllm_model_revision "b"'


@pytest.mark.parametrize("shape", ["a_single_node_70b", "b_two_nodes_mp", "b_two_nodes_ray"])
def test_the_role_writes_the_record_where_the_replica_runs_vllm_and_it_restarts_nothing(
        monkeypatch: pytest.MonkeyPatch, shape: str) -> None:
    fleet, replicas = planned_shape(shape)
    for replica in replicas:
        for role in replica.roles:
            ops, ctx = run_vllm_role(monkeypatch, shape, role.host)
            path = node_paths.release_file(replica.name)
            written = ops.named("files.file", dest=path)
            if role.role == "ray-worker":  # no vLLM process, no replica directory
                assert written == []
                continue
            (record,) = written
            assert record.kwargs["content"] == rel.release_json(rel.release_of(fleet.configs[role.host]))
            assert all(op is not record for op in ctx.replica_changes[replica.name])  # type: ignore[comparison-overlap]
            (observed,) = [o for o in ops.named("node.observe") if path in o.kwargs.get("paths", [])]
            (restart,) = ops.named("vllm.restart_record", marker=node_paths.restart_marker(replica.name))
            record.changed = True  # a new release.json alone
            assert not restart.kwargs["changed"]()
            assert observed.kwargs["paths"].count(path) == 1


def test_the_records_live_in_the_replicas_directory() -> None:
    assert node_paths.release_file("pool-0") == "/etc/gpufleet/vllm/pool-0/release.json"
    assert node_paths.previous_release_file("pool-0") == "/etc/gpufleet/vllm/pool-0/release.previous.json"
