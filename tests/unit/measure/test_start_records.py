"""Each replica's start and each release's start record (gpufleet.measure.starts), and how the roles carry them: the
readiness wait on a replica's first node times its start (tests/unit/node/test_vllm_ready.py), the vllm role reads it
back into the deploy's context, and the monitoring hosts keep the fastest of each release on each shape, last in the
site sequence. The operations themselves are data: tests/data/operations/vllm.start_seen/ and vllm.start_records/."""

from __future__ import annotations

import json
import shlex
from typing import Any

import pytest

import roles.monitoring as monitoring_role
import roles.vllm as vllm_role
from gpufleet import node_paths
from gpufleet.cli.inputs import fleet_facts
from gpufleet.config.fleet import Fleet
from gpufleet.measure.starts import (
    START_RECORDS_DIR,
    Start,
    StartKey,
    fastest,
    measured_start,
    read_record,
    record_text,
    records_textfile,
    start_key,
)
from gpufleet.plan.planner import plan_fleet
from gpufleet.run.context import DeployContext
from tests.recorded_ops import Recorder
from tests.unit.vllm_role_run import planned_shape, run_vllm_role

KEY = StartKey("tiny llama $HOME 100%", "0.31.0", "tp1-pp1", "probed")
PHASES = {"weights_loaded": 23.36, "kv_cache_sized": 40.13, "ready": 52.5, "first_completion": 53.75}


def _start(total: float, key: StartKey = KEY, replica: str = "lab_single-10-213-0-11") -> Start:
    return Start(key, replica, "10.213.0.11", 1795410588.412, {**PHASES, "first_completion": total})


def _observed(start: dict[str, Any] | None) -> str:
    return json.dumps({"kv_cache_tokens": 2097152, **({"start": start} if start is not None else {})})


# --- starts and records ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("shape", "key"), [
    ("a_single_node_70b", StartKey("llama-3.1-70b", "0.33.0", "tp4-pp1", "8xH100-SXM")),
    ("b_two_nodes_mp", StartKey("llama-3.1-405b", "0.33.0", "tp8-pp2", "8xH100-SXM")),
])
def test_a_start_is_keyed_by_model_release_layout_and_gpu_profile(shape: str, key: StartKey) -> None:
    fleet, replicas = planned_shape(shape)
    assert {start_key(replica) for replica in replicas} == {key}
    undeclared = Fleet(fleet.inventory, fleet.hosts, {host: cfg.model_copy(update={"gpu_profile": None})
                                                      for host, cfg in fleet.configs.items()}, fleet.pools)
    probed = plan_fleet(undeclared, fleet_facts(fleet, None))  # the same GPUs, as the probe finds them
    assert start_key(probed.replicas[0]).gpu_profile == "probed"


def test_the_wait_s_start_is_read_from_observed_json_with_its_node() -> None:
    doc = {"labels": {"replica": "lab_single-10-213-0-11", **KEY.labels()}, "started": 1795410588.412,
           "phases": PHASES}
    found = measured_start(_observed(doc), "10.213.0.11")
    assert found == _start(53.75)
    assert found.line() == ("first completion 53.8 s after its process started (weights 23.4 s, KV cache 40.1 s,"
                            " /health 52.5 s)")
    # nothing timed, an older observed.json, a start without its first completion or process start, no file
    assert measured_start(_observed(None), "n") is None
    assert measured_start(_observed({**doc, "phases": {**PHASES, "first_completion": None}}), "n") is None
    assert measured_start(_observed({**doc, "started": None}), "n") is None
    assert measured_start(_observed({**doc, "labels": {"replica": "r"}}), "n") is None
    assert measured_start(None, "n") is None and measured_start("{", "n") is None


def test_a_record_is_the_fastest_start_and_a_tie_keeps_it() -> None:
    record = _start(53.75)
    assert fastest(None, []) is None
    assert fastest(None, [_start(60.0), _start(55.0)]) == _start(55.0)
    assert fastest(record, [_start(60.0)]) is record
    assert fastest(record, [_start(53.75)]) is record  # nothing to write
    assert fastest(record, [_start(41.0), _start(45.0)]) == _start(41.0)


def test_a_record_file_reads_back_and_anything_else_is_no_record() -> None:
    record = _start(53.75)
    text = record_text(record)
    assert text.endswith("\n") and text.count("\n") == 1
    assert read_record(text) == record
    assert json.loads(text)["date"] == "2026-11-23T05:09:48Z"
    for bad in (None, "", "{", "[]", json.dumps({**json.loads(text), "schema": 2}),
                json.dumps({**json.loads(text), "phases": {}})):
        assert read_record(bad) is None
    # the file's name depends on the key alone
    assert KEY.file_name() == StartKey(**KEY.labels()).file_name() != StartKey(
        KEY.model, "0.32.0", KEY.layout, KEY.gpu_profile).file_name()


def test_the_records_textfile_serves_each_phase_by_key() -> None:
    other = StartKey("chat", "0.32.0", "tp1-pp2", "h100-sxm")
    text = records_textfile([_start(53.75), _start(63.1, other, "lab_pipeline-0")])
    samples = [line for line in text.splitlines() if not line.startswith("#")]
    assert samples[0] == ('gpufleet_replica_start_record_seconds{model="chat",release="0.32.0",layout="tp1-pp2",'
                          'gpu_profile="h100-sxm",phase="weights_loaded"} 23.36')
    assert samples[-1] == ('gpufleet_replica_start_record_seconds{model="tiny llama $HOME 100%",release="0.31.0",'
                           'layout="tp1-pp1",gpu_profile="probed",phase="first_completion"} 53.75')
    assert len(samples) == 8
    assert records_textfile([]).count("\n") == 2  # its HELP and TYPE: no series before the first record


# --- the roles --------------------------------------------------------------------------------------------------

def test_the_wait_times_the_start_and_the_role_reads_it_back_for_the_records(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the replica's first node the readiness wait writes the start for node_exporter, labelled with the
    replica's key; the start is read back after the KV cache report, into the context the monitoring hosts read.
    A retired replica loses its textfile. The other ranks do neither."""
    _, (replica, *_) = planned_shape("b_two_nodes_mp")
    first, follower = replica.nodes
    ops, ctx = run_vllm_role(monkeypatch, "b_two_nodes_mp", first)
    (wait,) = [c for c in ops.named("server.script") if "vllm_ready.py" in c.kwargs["script"]]
    words = wait.kwargs["script"].split(" ")
    textfile = node_paths.start_textfile(replica.name)
    assert words[words.index("--start-textfile") + 1] == textfile
    assert textfile.startswith(node_paths.TEXTFILE_DIR + "/") and textfile.endswith(".prom")
    (seen,) = ops.named("vllm.start_seen", replica=replica.name)
    (report,) = ops.named("vllm.kv_report")
    assert ops.calls.index(seen) == ops.calls.index(report) + 1
    assert seen.kwargs["observed"] == node_paths.observed_file(replica.name) and seen.kwargs["starts"] is ctx.starts
    assert not seen.kwargs["fresh"]()
    wait.changed = True
    assert seen.kwargs["fresh"]()
    (retired,) = ops.named("systemd.retired")
    assert node_paths.start_textfile("{name}") in retired.kwargs["paths"]
    ops, _ = run_vllm_role(monkeypatch, "b_two_nodes_mp", follower)
    assert not ops.named("vllm.start_seen")


def test_the_start_labels_reach_the_wait_literally() -> None:
    timed = vllm_role.StartCheck("/x.prom", {"replica": "r", **KEY.labels()})
    command = vllm_role.ready_command("tiny llama $HOME 100%", "http://10.0.0.5:8000", "vllm@r.service",
                                      node_paths.restart_marker("r"), None, 900, None, timed)
    words = shlex.split(command)
    assert json.loads(words[words.index("--start-labels") + 1]) == {"replica": "r", **KEY.labels()}
    assert words[-2:] == ["--timeout", "900"]


def _records_role(monkeypatch: pytest.MonkeyPatch, monitoring_host: bool) -> tuple[Recorder, DeployContext]:
    fleet, replicas = planned_shape("b_two_nodes_mp")
    ctx = DeployContext(fleet=fleet)
    ctx.plan.replicas.extend(replicas)
    recorder = Recorder()
    for name in ("node", "vllm"):
        monkeypatch.setattr(monitoring_role, name, recorder.module(name))
    monkeypatch.setattr(monitoring_role, "context", lambda *_: ctx)
    monkeypatch.setattr(monitoring_role, "is_monitoring", lambda: monitoring_host)
    monitoring_role.start_records.__wrapped__()  # type: ignore[attr-defined]
    return recorder, ctx


def test_the_monitoring_hosts_keep_the_records_of_the_keys_the_plan_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    ops, ctx = _records_role(monkeypatch, monitoring_host=True)
    keys = sorted({start_key(r) for r in ctx.plan.replicas})
    paths = [f"{START_RECORDS_DIR}/{k.file_name()}" for k in keys]
    (observed,) = ops.named("node.observe")
    assert observed.kwargs["texts"] == paths
    assert observed.kwargs["paths"] == [*paths, node_paths.START_RECORDS_TEXTFILE]
    (kept,) = ops.named("vllm.start_records")
    assert kept.kwargs["planned"] == [k.labels() for k in keys] and kept.kwargs["starts"] is ctx.starts
    assert (kept.kwargs["directory"], kept.kwargs["textfile"]) == (START_RECORDS_DIR, node_paths.START_RECORDS_TEXTFILE)
    assert kept.kwargs["_if"]() is True


def test_every_other_host_adds_the_operation_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """The operation is on every host, so that pyinfra runs it after every host's earlier ones; only a monitoring
    host reads or writes anything."""
    ops, _ = _records_role(monkeypatch, monitoring_host=False)
    assert not ops.named("node.observe")
    (kept,) = ops.named("vllm.start_records")
    assert kept.kwargs["_if"]() is False
