"""The readiness wait (gpufleet/node/vllm_ready.py) as the deploy runs it on a node: against a small HTTP stand-in
for vLLM, a stand-in ``systemctl`` whose answers are each case's data (one ``systemctl show`` answer per look,
the last one repeated) and a stand-in ``journalctl`` that prints the unit's journal from tests/data/vllm_ready/.
Once ready, it records what vLLM reports of its KV cache: the stand-in's ``/metrics`` is a file of
tests/data/vllm_ready/ (``*.metrics``, as vLLM's CPU build 0.31 answers on the lab, and variants of it)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import DATA
from tests.loopback_http import QuietHandler, loopback_server

TOOL = Path(__file__).resolve().parents[3] / "gpufleet" / "node" / "vllm_ready.py"
UNIT = "vllm@pool-0.service"

JOURNALS = DATA / "vllm_ready"
# (replica serves, the unit as systemctl shows it at each look, exit, what the verdict says[, the unit's journal])
CASES: dict[str, tuple[bool, list[str], int, str] | tuple[bool, list[str], int, str, str]] = {
    "serving_is_ready": (True, ["ActiveState=active\nNRestarts=4"], 0, "/v1/completions returned 1 tokens"),
    "a_unit_systemd_gave_up_on_is_not_waited_for": (
        False, ["ActiveState=activating\nNRestarts=0", "ActiveState=failed\nNRestarts=2"], 1,
        f"{UNIT} failed (/health answered 503)"),
    "a_unit_that_crashes_at_every_start_is_named_after_3_restarts": (
        False, [f"ActiveState=activating\nNRestarts={n}" for n in (7, 7, 8, 9, 10)], 1,
        f"{UNIT} restarted 3 times while waiting (/health answered 503)"),
    "restarts_from_before_the_wait_do_not_count": (
        False, [f"ActiveState=activating\nNRestarts={n}" for n in (5, 5, 6)], 1, "/health answered 503"),
    "an_engine_refusing_its_configuration_is_named_at_once": (
        False, ["ActiveState=activating\nNRestarts=0"], 1,
        f"{UNIT} did not start: ValueError: Available memory on node 0 (18.35/23.54 GiB) on kv cache allocation is "
        "less than requested memory for kv (4096.0 GiB).", "kv_cache_refused.journal"),
    "an_engine_failing_otherwise_is_left_to_its_restarts": (
        False, ["ActiveState=activating\nNRestarts=0"], 1, "/health answered 503", "nccl_timeout.journal"),
    # with the restart record the deploy touched before it stopped the replica (--restart-record): the journal is
    # read from systemd's first "Starting" line after it; since the wait began, the next start has logged nothing
    "a_start_refused_after_the_deploys_stop_and_before_the_wait_is_named_at_once": (
        False, ["ActiveState=activating\nNRestarts=1"], 1,
        f"{UNIT} did not start: ValueError: Available memory on node 0 (18.35/23.54 GiB)"),
    "what_the_stopped_release_logged_does_not_count": (
        False, ["ActiveState=activating\nNRestarts=0"], 1, "/health answered 503",),
}
# The unit's journal from the restart record's time (its mtime: RECORDED), for the cases that pass --restart-record.
RECORDED = 1000
FROM_RECORD = {
    "a_start_refused_after_the_deploys_stop_and_before_the_wait_is_named_at_once":
        "refused_after_the_deploys_stop.journal",
    "what_the_stopped_release_logged_does_not_count": "refused_by_the_stopped_release.journal",
}


def _serving(ready: bool, metrics: bytes = b"") -> type[QuietHandler]:
    class Handler(QuietHandler):
        def do_GET(self) -> None:
            if self.path == "/metrics":
                self.answer(200, metrics)
            elif self.path == "/version":
                self.answer(200, b'{"version": "0.31.0+cpu"}')
            else:
                self.answer(200 if ready else 503, b"")

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.answer(200, json.dumps({"usage": {"completion_tokens": 1}}).encode())

    return Handler


def _stand_ins(tmp_path: Path, shows: list[str], journal: str | None, from_record: str | None = None) -> Path:
    """The stand-in ``systemctl`` and ``journalctl`` (``from_record``: what it prints from RECORDED on); the
    directory to put first on PATH."""
    bin_dir, answers, looks = tmp_path / "bin", tmp_path / "answers", tmp_path / "looks"
    bin_dir.mkdir()
    answers.mkdir()
    for n, show in enumerate(shows):
        (answers / str(n)).write_text(show + "\n")
    looks.write_text("0")
    # each look prints the next answer (the last one again once they run out)
    (bin_dir / "systemctl").write_text(
        f'#!/bin/sh\n[ "$1 $2 $3" = "show --property=ActiveState,NRestarts {UNIT}" ] || exit 9\n'
        f'n=$(cat {looks}); [ "$n" -lt {len(shows) - 1} ] && echo $((n + 1)) > {looks}\n'
        f'cat {answers}/$n\n')
    (bin_dir / "systemctl").chmod(0o755)
    (bin_dir / "journalctl").write_text(  # the wait reads the unit's journal since it began (or the record's time)
        f'#!/bin/sh\n[ "$1 $2 $3 ${{4%%=*}} $5 $6" = "-q -o cat --since -u {UNIT}" ] || exit 9\n'
        + (f'[ "$4" = "--since=@{RECORDED}" ] && exec cat {JOURNALS / from_record}\n' if from_record else "")
        + (f"cat {JOURNALS / journal}\n" if journal else ""))
    (bin_dir / "journalctl").chmod(0o755)
    return bin_dir


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_readiness_wait(case: str, tmp_path: Path) -> None:
    ready, shows, code, seen, *journal = CASES[case]
    bin_dir = _stand_ins(tmp_path, shows, journal[0] if journal else None, FROM_RECORD.get(case))
    record = []
    if case in FROM_RECORD:
        (tmp_path / "restart-pending").touch()
        os.utime(tmp_path / "restart-pending", (RECORDED, RECORDED))
        record = ["--restart-record", str(tmp_path / "restart-pending")]
    # the timeout lets the wait see every answer: restarts that began before it must not end it early
    timeout = str(2 * len(shows) + 1)
    with loopback_server(_serving(ready)) as url:
        done = subprocess.run([sys.executable, "-I", str(TOOL), "--url", url, "--model", "tiny", "--unit", UNIT,
                               *record, "--timeout", timeout], capture_output=True, text=True, timeout=60,
                              env={"PATH": f"{bin_dir}:/usr/bin:/bin"})
    verdict = json.loads(done.stdout)
    assert (done.returncode, verdict["ready"]) == (code, code == 0), done.stderr
    assert verdict["seen"].startswith(seen), verdict
    assert set(verdict) == {"ready", "url", "seconds", "seen"}  # without --observed: nothing recorded
    if case in ("restarts_from_before_the_wait_do_not_count", "an_engine_failing_otherwise_is_left_to_its_restarts",
                "what_the_stopped_release_logged_does_not_count"):
        assert verdict["seconds"] > float(timeout)  # waited the whole timeout
    if case.endswith("_is_named_at_once"):
        assert verdict["seconds"] < 2


# What vLLM reports, once the replica serves: (its /metrics, its journal, the plan's KV cache tokens, what
# observed.json holds besides the plan's figures, the warning of the JSON line). The lab's replica of lab_single: the
# tiny Llama at max_model_len 256, 1 GiB of KV cache in blocks of 128 tokens.
PLANNED, MAX_MODEL_LEN = 2_097_152, 256
VLLM_0_31 = {"kv_cache_tokens": 2_097_152, "block_size": 128, "num_blocks": 16_384, "max_concurrency": 8192.0,
             "source": "vllm:cache_config_info", "enable_prefix_caching": True, "prefix_caching_hash_algo": "sha256"}
NOT_REPORTED = {"enable_prefix_caching": None, "prefix_caching_hash_algo": None}
OFF = ("KV cache planned 2,400,000 tokens, vLLM reports 2,097,152 (ratio 0.874): more than 5% off the plan"
       " (vllm_plan_tolerance)")
OBSERVED: dict[str, tuple[str, str | None, int, dict[str, object], str | None]] = {
    "figures_recorded": ("cache_config_0.31.metrics", None, PLANNED, {**VLLM_0_31, "ratio": 1.0}, None),
    "a_warning_when_off_by_more_than_the_tolerance": (
        "cache_config_0.31.metrics", None, 2_400_000, {**VLLM_0_31, "ratio": 0.8738}, OFF),
    "no_warning_within_the_tolerance": (
        "cache_config_0.31.metrics", None, 2_150_000, {**VLLM_0_31, "ratio": 0.9754}, None),
    "blocks_times_block_size_without_vllms_own_figure": (
        "blocks_only.metrics", None, PLANNED, {"kv_cache_tokens": 2_097_152, "block_size": 16, "num_blocks": 131_072,
                                               "max_concurrency": 8192.0, "ratio": 1.0,
                                               "enable_prefix_caching": True, "prefix_caching_hash_algo": "sha256"},
        None),
    "a_missing_metric_is_tolerated": (
        "without_cache_config.metrics", None, PLANNED, {"kv_cache_tokens": None, "block_size": None,
                                                        "num_blocks": None, "max_concurrency": None, "ratio": None,
                                                        "source": None, **NOT_REPORTED}, None),
    "a_missing_metric_is_read_from_the_start_up_lines": (
        "without_cache_config.metrics", "kv_cache_size.journal", PLANNED,
        {"kv_cache_tokens": 2_097_152, "block_size": None, "max_concurrency": 8192.0, "ratio": 1.0,
         "source": "journal", **NOT_REPORTED}, None),
    # prefix caching turned off (vllm_extra_args enable-prefix-caching: false): vLLM still names its default hash
    "prefix_caching_off_recorded": (
        "prefix_caching_off.metrics", None, PLANNED, {"kv_cache_tokens": 2_097_152, "block_size": 16, "ratio": 1.0,
                                                      "enable_prefix_caching": False,
                                                      "prefix_caching_hash_algo": "sha256"}, None),
    "prefix_caching_unknown_without_its_labels": (
        "without_prefix_labels.metrics", None, PLANNED, {"kv_cache_tokens": 2_097_152, "block_size": 16,
                                                         "ratio": 1.0, **NOT_REPORTED}, None),
}


@pytest.mark.parametrize("case", sorted(OBSERVED))
def test_what_vllm_reports_is_recorded_beside_the_plan(case: str, tmp_path: Path) -> None:
    metrics, journal, planned, recorded, warning = OBSERVED[case]
    bin_dir = _stand_ins(tmp_path, ["ActiveState=active\nNRestarts=0"], journal)
    replica_dir = tmp_path / "replica"
    replica_dir.mkdir()
    observed = replica_dir / "observed.json"
    observed.write_text('{"kv_cache_tokens": 1}\n')  # an earlier start's: replaced whole
    with loopback_server(_serving(True, (JOURNALS / metrics).read_bytes())) as url:
        done = subprocess.run([sys.executable, "-I", str(TOOL), "--url", url, "--model", "tiny", "--unit", UNIT,
                               "--timeout", "10", "--observed", str(observed), "--planned-kv-tokens", str(planned),
                               "--max-model-len", str(MAX_MODEL_LEN), "--tolerance", "0.05"],
                              capture_output=True, text=True, timeout=60, env={"PATH": f"{bin_dir}:/usr/bin:/bin"})
    verdict = json.loads(done.stdout)
    assert (done.returncode, verdict["ready"]) == (0, True), done.stderr  # ready, whatever vLLM reports
    doc = json.loads(observed.read_text())
    assert {key: doc[key] for key in recorded} == recorded
    assert (doc["planned_kv_cache_tokens"], doc["max_model_len"], doc["tolerance"]) == (planned, MAX_MODEL_LEN, 0.05)
    assert doc["vllm_version"] == "0.31.0+cpu" and re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", doc["time"])
    assert verdict["kv_cache_tokens"] == {"planned": planned, "observed": recorded["kv_cache_tokens"],
                                          "ratio": recorded["ratio"]}
    assert verdict.get("warning") == warning
    assert observed.stat().st_mode & 0o777 == 0o644 and [p.name for p in replica_dir.iterdir()] == ["observed.json"]


def test_an_observation_that_cannot_be_written_is_a_warning_not_a_failure(tmp_path: Path) -> None:
    bin_dir = _stand_ins(tmp_path, ["ActiveState=active\nNRestarts=0"], None)
    with loopback_server(_serving(True, (JOURNALS / "cache_config_0.31.metrics").read_bytes())) as url:
        done = subprocess.run([sys.executable, "-I", str(TOOL), "--url", url, "--model", "tiny", "--unit", UNIT,
                               "--observed", str(tmp_path / "gone" / "observed.json"), "--planned-kv-tokens",
                               str(PLANNED), "--max-model-len", str(MAX_MODEL_LEN)],
                              capture_output=True, text=True, timeout=60, env={"PATH": f"{bin_dir}:/usr/bin:/bin"})
    verdict = json.loads(done.stdout)
    assert (done.returncode, verdict["ready"]) == (0, True), done.stderr
    assert verdict["warning"].startswith(f"cannot write {tmp_path / 'gone' / 'observed.json'}: ")


# --- the start's phases -------------------------------------------------------------------------------------------
# A start of each lab shape on its first node, as ``journalctl -o json`` gives it: lab1's one-node replica and rank 0
# of the pipeline replica (lab2), vLLM 0.31's CPU build. The messages are the lab's (kv_cache_size.journal and the
# refused_*.journal above: systemd's, replica_rank's, the API server's and the engine's lines), with vLLM's loader
# line as its default loader writes it ("Loading weights took %.2f seconds"); an earlier process's lines come before
# the start, and the one-node journal ends with a message journald keeps as bytes (not UTF-8).
STARTED = 1795410588.412345  # systemd's "Started vllm@<replica>.service" entry: the unit's main process start
STARTS = {  # journal, when /health first answered 200 and the first completion came (seconds after the start),
    # the phases
    "one_node": ("start_one_node.journal.json", 52.5, 53.75,
                 {"weights_loaded": 23.36, "kv_cache_sized": 40.13, "ready": 52.5, "first_completion": 53.75}),
    "pipeline_rank0": ("start_pipeline_rank0.journal.json", 62.0, 63.1,
                       {"weights_loaded": 32.14, "kv_cache_sized": 49.86, "ready": 62.0, "first_completion": 63.1}),
}


def _ready_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("vllm_ready", TOOL)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("case", sorted(STARTS))
def test_a_starts_phases_from_its_journal_and_what_the_wait_saw(case: str) -> None:
    tool = _ready_tool()
    journal, ready, completed, phases = STARTS[case]
    entries = tool.parse_journal((JOURNALS / journal).read_text())
    assert tool.start_phases(STARTED, entries, STARTED + ready, STARTED + completed) == phases


def test_only_what_came_since_the_start_counts_and_nothing_is_guessed() -> None:
    tool = _ready_tool()
    entries = tool.parse_journal((JOURNALS / "start_one_node.journal.json").read_text())
    before = [(at, message) for at, message in entries if at < STARTED]
    assert before and tool.start_phases(STARTED, before, STARTED + 52.5, None) == {
        "weights_loaded": None, "kv_cache_sized": None, "ready": 52.5, "first_completion": None}
    # a /health seen before the start (the process before it), no process start at all
    assert tool.start_phases(STARTED, entries, STARTED - 1, STARTED + 3)["ready"] is None
    assert set(tool.start_phases(None, entries, STARTED + 52.5, STARTED + 53.75).values()) == {None}


def test_vllms_gpu_lines_and_the_journals_bytes() -> None:
    """On GPUs the runner's "Model loading took" line follows the loader's: the weights are in place at the later;
    "GPU KV cache size" sizes the cache. A message journald keeps as bytes is decoded, a line that is no entry
    skipped."""
    tool = _ready_tool()
    lines = [(3.0, "(EngineCore_DP0 pid=90) INFO [default_loader.py:267] Loading weights took 41.87 seconds"),
             (44.5, "(EngineCore_DP0 pid=90) INFO [gpu_model_runner.py:2653] Model loading took 14.99 GiB memory and"
                    " 43.012 seconds"),
             (97.25, "(EngineCore_DP0 pid=90) INFO [kv_cache_utils.py:1087] GPU KV cache size: 476,016 tokens")]
    text = "\n".join(json.dumps({"__REALTIME_TIMESTAMP": str(int((STARTED + at) * 1e6)), "MESSAGE": message})
                     for at, message in lines) + "\nnot json\n"
    phases = tool.start_phases(STARTED, tool.parse_journal(text), None, None)
    assert (phases["weights_loaded"], phases["kv_cache_sized"]) == (44.5, 97.25)
    (_, decoded), = [e for e in tool.parse_journal((JOURNALS / "start_one_node.journal.json").read_text())
                     if "Received request" in e[1]]
    assert decoded.endswith("The fleet is \ufffd'")


def test_the_textfile_holds_the_phases_known_and_escapes_the_labels() -> None:
    tool = _ready_tool()
    labels = {"replica": "lab_single-10-213-0-11", "model": 'tiny llama $HOME 100% "x" \\', "release": "0.31.0",
              "layout": "tp1-pp1", "gpu_profile": "lab-pcie"}
    text = tool.start_textfile(labels, STARTED, {"weights_loaded": None, "kv_cache_sized": 40.13, "ready": 52.5,
                                                 "first_completion": 53.75})
    shown = ('replica="lab_single-10-213-0-11",model="tiny llama $HOME 100% \\"x\\" \\\\",release="0.31.0",'
             'layout="tp1-pp1",gpu_profile="lab-pcie"')
    samples = [line for line in text.splitlines() if not line.startswith("#")]
    assert samples == [f'gpufleet_replica_start_seconds{{{shown},phase="kv_cache_sized"}} 40.13',
                       f'gpufleet_replica_start_seconds{{{shown},phase="ready"}} 52.5',
                       f'gpufleet_replica_start_seconds{{{shown},phase="first_completion"}} 53.75',
                       f"gpufleet_replica_start_time_seconds{{{shown}}} 1795410588.412"]
    assert "# TYPE gpufleet_replica_start_seconds gauge" in text.splitlines()


def _timing_stand_ins(tmp_path: Path, ago: float) -> Path:
    """A ``systemctl`` whose unit runs, its main process started ``ago`` seconds before this call, and a
    ``journalctl`` that gives the one-node start's journal (``-o json``) moved to that start; the directory to put
    first on PATH. Both stand-ins hold the same start, taken here: each computing its own when it runs would move
    the journal by the time between their two runs (seen: 2.3 s with the cores busy)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    started_monotonic, shift = time.monotonic() - ago, time.time() - ago - STARTED
    (bin_dir / "systemctl").write_text(
        f"#!{sys.executable}\nimport sys\n"
        f"if sys.argv[1:] == ['show', '--property=ExecMainStartTimestampMonotonic', {UNIT!r}]:\n"
        f"    print('ExecMainStartTimestampMonotonic={int(started_monotonic * 1e6)}')\n"
        f"elif sys.argv[1:] == ['show', '--property=ActiveState,NRestarts', {UNIT!r}]:\n"
        "    print('ActiveState=active\\nNRestarts=0')\n"
        "else:\n    sys.exit(9)\n")
    (bin_dir / "journalctl").write_text(
        f"#!{sys.executable}\nimport json, sys\n"
        f"if sys.argv[1:5] != ['-q', '-o', 'json', '--output-fields=MESSAGE'] or sys.argv[-2:] != ['-u', {UNIT!r}]:\n"
        "    sys.exit(0)\n"
        f"shift = {shift!r}\n"
        f"for line in open({str(JOURNALS / 'start_one_node.journal.json')!r}):\n"
        "    entry = json.loads(line)\n"
        "    entry['__REALTIME_TIMESTAMP'] = str(int(int(entry['__REALTIME_TIMESTAMP']) + shift * 1e6))\n"
        "    print(json.dumps(entry))\n")
    for tool in ("systemctl", "journalctl"):
        (bin_dir / tool).chmod(0o755)
    return bin_dir


def test_the_wait_times_the_start_it_saw_through(tmp_path: Path) -> None:
    """Run as the deploy runs it: the start's phases go to the textfile (0644), the JSON line and observed.json."""
    bin_dir = _timing_stand_ins(tmp_path, ago=60)
    textfile, observed = tmp_path / "gpufleet-replica-start-pool-0.prom", tmp_path / "observed.json"
    labels = {"replica": "pool-0", "model": "tiny", "release": "0.31.0", "layout": "tp1-pp1", "gpu_profile": "probed"}
    with loopback_server(_serving(True, (JOURNALS / "cache_config_0.31.metrics").read_bytes())) as url:
        done = subprocess.run([sys.executable, "-I", str(TOOL), "--url", url, "--model", "tiny", "--unit", UNIT,
                               "--start-textfile", str(textfile), "--start-labels", json.dumps(labels),
                               "--timeout", "10", "--observed", str(observed), "--planned-kv-tokens", str(PLANNED),
                               "--max-model-len", str(MAX_MODEL_LEN)],
                              capture_output=True, text=True, timeout=60, env={"PATH": f"{bin_dir}:/usr/bin:/bin"})
    verdict = json.loads(done.stdout)
    assert (done.returncode, verdict["ready"], verdict.get("warning")) == (0, True, None), done.stderr
    start = verdict["start"]
    assert start == json.loads(observed.read_text())["start"]
    assert start["labels"] == labels and abs(start["started"] + 60 - time.time()) < 10
    phases = start["phases"]
    # the journal's lines, 23.36 and 40.13 s after the start (both stand-ins hold the same start); the wait saw
    # /health and the completion at once, 60 s after it
    assert phases["weights_loaded"] == pytest.approx(23.36, abs=2)
    assert phases["kv_cache_sized"] == pytest.approx(40.13, abs=2)
    assert 59 < phases["ready"] <= phases["first_completion"] < 70
    text = textfile.read_text()
    assert [line.split("{")[0] for line in text.splitlines() if not line.startswith("#")] == [
        "gpufleet_replica_start_seconds"] * 4 + ["gpufleet_replica_start_time_seconds"]
    assert textfile.stat().st_mode & 0o777 == 0o644


def test_a_start_that_cannot_be_written_is_a_warning_and_without_a_start_nothing_is_guessed(tmp_path: Path) -> None:
    bin_dir = _stand_ins(tmp_path, ["ActiveState=active\nNRestarts=0"], None)  # answers no ExecMainStart...
    with loopback_server(_serving(True)) as url:
        done = subprocess.run([sys.executable, "-I", str(TOOL), "--url", url, "--model", "tiny", "--unit", UNIT,
                               "--start-textfile", str(tmp_path / "gone" / "start.prom"), "--timeout", "10"],
                              capture_output=True, text=True, timeout=60, env={"PATH": f"{bin_dir}:/usr/bin:/bin"})
    verdict = json.loads(done.stdout)
    assert (done.returncode, verdict["ready"]) == (0, True), done.stderr
    assert verdict["start"] == {"labels": {}, "started": None, "phases": dict.fromkeys(
        ("weights_loaded", "kv_cache_sized", "ready", "first_completion"))}
    assert verdict["warning"].startswith(f"cannot write {tmp_path / 'gone' / 'start.prom'}: ")


def _serving_adapters(served: set[str]) -> type[QuietHandler]:
    """A ready replica that answers a completion for the models in ``served`` and 404, as vLLM does, otherwise."""
    class Handler(QuietHandler):
        def do_GET(self) -> None:
            self.answer(200, b"")

        def do_POST(self) -> None:
            model = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["model"]
            if model in served:
                self.answer(200, json.dumps({"usage": {"completion_tokens": 1}}).encode())
            else:
                self.answer(404, json.dumps({"error": {"message": f"The model `{model}` does not exist."}}).encode())

    return Handler


@pytest.mark.parametrize(("served", "code", "seen"), [
    ({"tiny", "poet", "chef"}, 0, "/v1/completions returned 1 tokens"),
    ({"tiny", "poet"}, 1, "LoRA adapter chef: /v1/completions answered 404"),
])
def test_each_adapter_must_answer_once_the_replica_is_ready(served: set[str], code: int, seen: str) -> None:
    """With --adapter, the wait asks each adapter for a completion once the model answers (vLLM loads it then):
    one that does not answer fails the wait and is named."""
    with loopback_server(_serving_adapters(served)) as url:
        done = subprocess.run([sys.executable, "-I", str(TOOL), "--url", url, "--model", "tiny", "--adapter", "poet",
                               "--adapter", "chef", "--timeout", "5"], capture_output=True, text=True, timeout=60)
    verdict = json.loads(done.stdout)
    assert (done.returncode, verdict["ready"]) == (code, code == 0), done.stderr
    assert verdict["seen"].startswith(seen), verdict
