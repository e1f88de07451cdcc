"""The replica watchdog (gpufleet/node/replica_watchdog.py) and how the vllm role runs it, without a node.

The stall rules are cases as data (tests/data/watchdog/*.json): a replica's samples in time, the completion the watchdog
asks for where it asks for one, and the verdict expected at each. The loop runs on a fake clock against a fake
replica; the tool itself runs against a small HTTP stand-in for vLLM and a stand-in ``systemctl``; the role's
operations are recorded instead of run.
"""

from __future__ import annotations

import ast
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import roles.vllm as vllm_role
from gpufleet import node_paths, templates
from gpufleet.config.layers import HostLayers, Layer, role_default_layers
from gpufleet.config.validate import validate_host
from gpufleet.node import replica_watchdog as wd
from gpufleet.plan import access
from gpufleet.plan.commands import secret_env_names
from roles.vllm import replica_files as vf
from tests.conftest import DATA, ROOT
from tests.loopback_http import QuietHandler, loopback_server
from tests.unit.configs import https_host_config
from tests.unit.unit_files import exec_argv, unit_settings
from tests.unit.vllm_role_run import first_node, planned_shape, run_vllm_role

TOOL = ROOT / "gpufleet" / "node" / "replica_watchdog.py"
CASES = sorted((DATA / "watchdog").glob("*.json"))
SAMPLE_KEYS = ("at", "health", "running", "waiting", "tokens", "prompt", "completed")


# --- the stall rules, as data ----------------------------------------------------------------------------------

@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_verdicts(path: Path) -> None:
    case = json.loads(path.read_text())
    dog = wd.Watchdog(case["stall_s"], case["grace_s"], 0.0)
    for step in case["steps"]:
        where = f"{path.name} at {step['at']}"
        verdict = dog.judge(wd.Sample(**{key: step[key] for key in SAMPLE_KEYS if key in step}))
        done = step["at"]
        if verdict.action == wd.PROBE:
            assert "probe" in step, f"{where}: asked for a completion ({verdict.why}); the case gives none"
            done = step.get("probe_at", step["at"])
            verdict = dog.probed(done, *step["probe"])
        else:
            assert "probe" not in step, f"{where}: asked for no completion ({verdict.action}: {verdict.why})"
        assert verdict.action == step["expect"], f"{where}: {verdict.why}"
        assert step.get("why", "") in verdict.why, where
        if "notes" in step:
            assert dog.notes == step["notes"], where
        dog.notes.clear()
        if verdict.action == wd.RESTART:
            dog.started(done)


def test_the_cases_cover_every_verdict_and_both_stall_rules() -> None:
    steps = [step for path in CASES for step in json.loads(path.read_text())["steps"]]
    assert {step["expect"] for step in steps} == {wd.WAIT, wd.OK, wd.RESTART}
    whys = " ".join(step.get("why", "") for step in steps)
    assert "no token processed" in whys and "a real completion failed" in whys
    assert "no completion succeeded" in whys


# --- /metrics ----------------------------------------------------------------------------------------------------

METRICS = '''# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny-llama"} 2.0
vllm:num_requests_running{engine="1",model_name="tiny-llama"} 1.0
vllm:num_requests_waiting{engine="0",model_name="tiny-llama"} 0.0
vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 9.0
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{engine="0",model_name="tiny-llama"} 1234.0
vllm:generation_tokens_created{engine="0",model_name="tiny-llama"} 1.7e+09
vllm:prompt_tokens_total{engine="0",model_name="a \\"quoted\\" name, with } and spaces"} 56.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny-llama"} 3.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny-llama"} 4.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="tiny-llama"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny-llama"} NaN
vllm:num_requests_running{engine="2",model_name="tiny-llama"} NaN
process_cpu_seconds_total 12.5
'''


def test_metrics_are_summed_over_engines_and_reasons() -> None:
    assert wd.parse_metrics(METRICS) == {"running": 3.0, "waiting": 0.0, "tokens": 1234.0, "prompt": 56.0,
                                         "completed": 7.0}


def test_aborted_requests_are_no_progress() -> None:
    """A client that gives up on a stopped engine aborts its request: that is not the engine finishing one."""
    text = 'vllm:request_success_total{finished_reason="abort",model_name="m"} 5\n'
    assert wd.parse_metrics(text) == {}


def test_a_metrics_page_without_vllms_names_gives_nothing() -> None:
    assert wd.parse_metrics("") == {}
    assert wd.parse_metrics("<html>Not Found</html>\nvllm:num_requests_running\nvllm:num_requests_waiting{} x\n") == {}


# --- the loop: a fake clock and a fake replica ----------------------------------------------------------------

@dataclass
class FakeReplica:
    """A replica that serves until ``wedged_at`` (its engine then stops: completions time out after
    ``timeout`` seconds of the fake clock), answers no /health while ``down`` says so, and whose restart answers
    ``restart_answer``."""

    clock: list[float]
    wedged_at: float = 1e9
    timeout: float = 60
    down: Callable[[float], bool] = lambda now: False
    restart_answer: tuple[bool, str] = (True, "")
    restarts: list[float] = field(default_factory=list)
    completions: list[float] = field(default_factory=list)

    def health(self) -> int | None:
        return None if self.down(self.clock[0]) else 200

    def metrics(self) -> dict[str, float]:
        done = len([t for t in self.completions if t < self.wedged_at])
        return {"running": 0.0, "waiting": 0.0, "tokens": float(done), "prompt": float(done), "completed": float(done)}

    def complete(self) -> tuple[int | None, int, str]:
        self.completions.append(self.clock[0])
        if self.clock[0] >= self.wedged_at:
            self.clock[0] += self.timeout
            return None, 0, "not answering: timed out"
        return 200, 1, "/v1/completions returned 1 tokens"

    def restart(self) -> tuple[bool, str]:
        self.restarts.append(self.clock[0])
        return self.restart_answer


def _run(replica: FakeReplica, seconds: float, stall_s: float = 60, grace_s: float = 300) -> list[str]:
    clock = replica.clock
    logged: list[str] = []

    def sleep(seconds: float) -> None:
        clock[0] += seconds

    dog = wd.Watchdog(stall_s, grace_s, clock[0])
    while clock[0] < seconds:
        wd.watch(replica, dog, "vllm@r.service", 5, lambda: clock[0], sleep, logged.append, rounds=1)
    return logged


def test_a_stopped_engine_is_restarted_once_with_one_line_saying_why() -> None:
    replica = FakeReplica([0.0], wedged_at=100, down=lambda now: 190 <= now < 250)
    logged = _run(replica, 400)
    # its own completion at 65 shows in the metrics at 70; asked again at 130 (stall_s 60), timed out at 190
    assert replica.restarts == [190.0]
    assert logged[0] == "vllm@r.service: serving: /health answers 200, /v1/completions returned 1 tokens"
    assert logged[1] == ("restarting vllm@r.service: /health answers 200 but nothing progressed for 120 s and a real"
                         " completion failed: not answering: timed out")
    assert len(logged) == 2  # restarted: not judged without /health, then the new engine times out within its grace


def test_a_restart_systemd_refuses_is_logged_and_tried_again_only_after_another_stall() -> None:
    replica = FakeReplica([0.0], wedged_at=100, restart_answer=(False, "Access denied"))
    logged = _run(replica, 1000)
    assert logged[2] == "could not restart vllm@r.service: Access denied"
    assert replica.restarts[0] == 190.0 and len(replica.restarts) == 3
    assert all(b - a >= 300 for a, b in zip(replica.restarts, replica.restarts[1:], strict=False))  # its grace


def test_a_serving_replica_is_never_restarted() -> None:
    replica = FakeReplica([0.0])
    assert _run(replica, 3600) == ["vllm@r.service: serving: /health answers 200, /v1/completions returned 1 tokens"]
    assert replica.restarts == []
    assert len(replica.completions) <= 3600 / 60 + 1  # idle: one completion of 1 token per stall_s


# --- the tool on a node: vLLM's API over HTTP, systemctl, the key from the environment ------------------------

@dataclass
class FakeVllm:
    """What the stand-in answers; ``stopped`` makes completions hang, as with the engine process stopped."""

    key: str
    stopped: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)
    auth: list[str | None] = field(default_factory=list)
    completed: int = 0


@pytest.fixture
def fake_vllm() -> Iterator[tuple[str, FakeVllm]]:
    state = FakeVllm(key='sk-"lab"$HOME')

    class Handler(QuietHandler):
        def do_GET(self) -> None:
            if self.path == "/health":
                self.answer(200, b"")
            elif self.path == "/metrics":
                self.answer(200, (f'vllm:num_requests_running{{engine="0"}} 0\n'
                                   f'vllm:request_success_total{{finished_reason="length"}} {state.completed}\n'
                                   ).encode())
            else:
                self.answer(404, b"")

        def do_POST(self) -> None:
            state.auth.append(self.headers.get("Authorization"))
            self.rfile.read(int(self.headers["Content-Length"]))
            if state.stopped.is_set():
                state.released.wait(30)  # the engine does not answer; the API holds the request
                return
            state.completed += 1
            self.answer(200, json.dumps({"usage": {"completion_tokens": 1}}).encode())

    with loopback_server(Handler) as url:
        try:
            yield url, state
        finally:
            state.released.set()  # before the server waits for its handlers


def _wait_for(check: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_the_tool_restarts_a_stopped_engine_through_systemctl(fake_vllm: tuple[str, FakeVllm],
                                                              tmp_path: Path) -> None:
    url, state = fake_vllm
    config = tmp_path / "watchdog.json"
    config.write_text(json.dumps({"unit": "vllm@pool-0.service", "url": url, "model": "tiny", "stall_s": 1,
                                  "grace_s": 30, "interval_s": 0.1}))
    bin_dir, called = tmp_path / "bin", tmp_path / "systemctl.args"
    bin_dir.mkdir()
    # systemd stops the watchdog as part of the restart it queues: the stand-in does the same
    (bin_dir / "systemctl").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {called}\nkill -TERM "$PPID"\n')
    (bin_dir / "systemctl").chmod(0o755)
    log = tmp_path / "journal"
    with log.open("w") as out:
        tool = subprocess.Popen([sys.executable, "-I", str(TOOL), str(config)], stdout=out, stderr=subprocess.STDOUT,
                                env={"PATH": f"{bin_dir}:/usr/bin:/bin", "VLLM_API_KEY": state.key})
    try:
        _wait_for(lambda: "serving:" in log.read_text(), 15, "the watchdog never saw the replica serve")
        assert state.key not in Path(f"/proc/{tool.pid}/cmdline").read_text()
        state.stopped.set()
        assert tool.wait(30) == -signal.SIGTERM
    finally:
        if tool.poll() is None:
            tool.kill()
            tool.wait()
    assert called.read_text().split() == ["restart", "--no-block", "vllm@pool-0.service"]
    lines = log.read_text().splitlines()
    assert lines[0].startswith(f"watching vllm@pool-0.service at {url}: restart after 1 s without progress")
    assert lines[-1].startswith("restarting vllm@pool-0.service: /health answers 200 but nothing progressed for")
    assert lines[-1].endswith("and a real completion failed: not answering: timed out")
    assert set(state.auth) == {f"Bearer {state.key}"}  # the key from the environment, on completions only
    assert state.key not in log.read_text()


@pytest.mark.parametrize(("doc", "problem"), [
    ({"unit": "vllm@r.service", "url": "http://x", "model": "m", "stall_s": 1, "grace_s": 1, "interval_s": 0},
     "interval_s: expected a number > 0"),
    ({"unit": "ssh.service", "url": "http://x", "model": "m", "stall_s": 1, "grace_s": 1, "interval_s": 1},
     "unit: expected vllm@<replica>.service"),
    ({"unit": "vllm@r.service", "url": "http://x", "model": 7, "stall_s": True, "grace_s": 1, "interval_s": 1},
     "stall_s: expected a number > 0; model: expected text"),
    ([], "stall_s: expected a number > 0"),
])
def test_a_bad_config_is_one_line_and_exit_2(tmp_path: Path, doc: object, problem: str) -> None:
    path = tmp_path / "watchdog.json"
    path.write_text(json.dumps(doc))
    done = subprocess.run([sys.executable, "-I", str(TOOL), str(path)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1
    assert done.stderr.startswith(f"replica_watchdog: {path}: ") and problem in done.stderr


def test_config_as_the_role_writes_it_loads(tmp_path: Path) -> None:
    path = tmp_path / "watchdog.json"
    config = https_host_config(vllm_served_model_name="tiny")
    path.write_text(vf.watchdog_json(config, "pool-0", "http://[fd00::5]:8000"))
    assert wd.load_config(str(path)) == wd.Config("vllm@pool-0.service", "http://[fd00::5]:8000", "tiny", 120.0,
                                                  900.0, 5.0)


# --- configuration ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("value", "problem"), [
    (0, None), (10, None), (120, None), (86400, None),
    (9, "expected 0 (off) or seconds from 10 to 86400, found 9"),
    (-1, "expected 0 (off) or seconds from 10 to 86400, found -1"),
    ("120", "expected an integer, found '120'"),
    (True, "expected an integer, found True"),
])
def test_stall_s_is_off_or_at_least_10_seconds(value: object, problem: str | None) -> None:
    layers, _ = role_default_layers()
    config, found = validate_host(HostLayers("10.0.0.5", [*layers, Layer("test", {
        "vllm_model": "org/model", "vllm_watchdog_stall_s": value})]), "test")
    assert [p.line() for p in found] == ([] if problem is None else
                                         [f"test: vllm_watchdog_stall_s: {problem} (host 10.0.0.5)"])
    assert (config is not None and config.vllm_watchdog_stall_s == value) is (problem is None)


def test_the_default_is_on() -> None:
    assert https_host_config().vllm_watchdog_stall_s == 120


# --- the unit -----------------------------------------------------------------------------------------------------

def _unit(address: str = "10.0.0.5") -> dict[tuple[str, str], list[str]]:
    text = templates.render("vllm/vllm-watchdog@.service.j2", **vllm_role.watchdog_unit_values(address))
    found: dict[tuple[str, str], list[str]] = {}
    for section, key, value in unit_settings(text):
        found.setdefault((section, key), []).append(value)
    return found


def test_the_unit_starts_after_its_replica_is_pulled_in_by_it_and_stops_with_it() -> None:
    unit = _unit()
    assert unit[("Unit", "After")] == unit[("Unit", "BindsTo")] == ["vllm@%i.service"]
    assert unit[("Install", "WantedBy")] == ["vllm@%i.service"]
    assert node_paths.watchdog_enabled_link("r") == "/etc/systemd/system/vllm@r.service.wants/vllm-watchdog@r.service"


def test_the_unit_runs_the_tool_with_the_replicas_file_and_its_key_from_the_secrets_file() -> None:
    unit = _unit()
    (start,) = unit[("Service", "ExecStart")]
    assert exec_argv(start, "pool-0") == [f"{node_paths.replica_dir('pool-0')}/venv/bin/python", "-I",
                                          node_paths.node_tool("replica_watchdog.py"),
                                          node_paths.watchdog_config("pool-0")]
    assert "replica_watchdog.py" in node_paths.NODE_TOOL_FILES  # role common installs it where the unit looks
    assert unit[("Service", "EnvironmentFile")] == [f"-{node_paths.SECRETS_DIR}/%i.env"]  # the vllm unit's
    every_secret = secret_env_names(https_host_config(vllm_api_key={"env": "K"}, vllm_hf_token={"env": "T"},
                                                      vllm_distributed_backend="ray", ray_auth_token={"env": "R"},
                                                      vllm_extra_args={"speculative-config": {"model": "org/draft"}}))
    assert "HF_TOKEN" in every_secret  # a vLLM that fetches a draft model itself holds the hub token
    (unset,) = unit[("Service", "UnsetEnvironment")]
    assert sorted(unset.split()) == sorted(set(every_secret) - {"VLLM_API_KEY"})  # the key, and no other secret


def test_the_unit_runs_as_root_without_any_capability_and_reaches_its_node_only() -> None:
    unit = _unit()
    assert ("Service", "User") not in unit  # root, for systemctl; nothing else of root's
    assert unit[("Service", "CapabilityBoundingSet")] == [""] and unit[("Service", "NoNewPrivileges")] == ["yes"]
    assert unit[("Service", "ProtectSystem")] == ["strict"] and unit[("Service", "PrivateDevices")] == ["yes"]
    assert unit[("Service", "IPAddressDeny")] == ["any"]
    assert unit[("Service", "IPAddressAllow")] == ["localhost 10.0.0.5/32"]
    assert _unit("fd00::5")[("Service", "IPAddressAllow")] == ["localhost fd00::5/128"]
    assert ("Service", "IPAddressDeny") not in _unit("gpu-a01.dc1.example.net")  # systemd filters addresses only
    assert access.watchdog_sources("gpu-a01.dc1.example.net") is None


# --- the role: files on the first node, the unit started there, restarts of its own ---------------------------

def test_the_first_node_writes_the_watchdogs_file_and_runs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    replica, host = first_node("a_single_node_70b")
    ops, _ = run_vllm_role(monkeypatch, "a_single_node_70b", host)
    (written,) = ops.named("files.file", dest=node_paths.watchdog_config(replica.name))
    doc = json.loads(written.kwargs["content"])
    address = replica.roles[0].address
    assert doc == {"unit": f"vllm@{replica.name}.service", "url": f"http://{address}:{replica.port}",
                   "model": doc["model"], "stall_s": 120, "grace_s": 900, "interval_s": 5}
    (unit,) = ops.named("files.file", dest=node_paths.unit_path(node_paths.WATCHDOG_UNIT_TEMPLATE))
    assert "IPAddressAllow=localhost" in unit.kwargs["content"]
    watchdog = node_paths.watchdog_unit(replica.name)
    (runs,) = ops.named("systemd.service", unit=watchdog)
    assert runs.kwargs["running"] is True and runs.kwargs["enabled"] is True
    (observed,) = [o for o in ops.named("node.observe") if "units" in o.kwargs]
    assert watchdog in observed.kwargs["units"]
    order = [c.kwargs.get("unit") for c in ops.calls if c.op.startswith("systemd.")]
    assert order.index(f"vllm@{replica.name}.service") < order.index(watchdog)  # after the replica started


def test_a_change_of_the_watchdog_restarts_the_watchdog_never_the_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    replica, host = first_node("a_single_node_70b")
    ops, _ = run_vllm_role(monkeypatch, "a_single_node_70b", host)
    (written,) = ops.named("files.file", dest=node_paths.watchdog_config(replica.name))
    (unit,) = ops.named("files.file", dest=node_paths.unit_path(node_paths.WATCHDOG_UNIT_TEMPLATE))
    (record,) = ops.named("vllm.restart_record", marker=node_paths.restart_marker(replica.name))
    (restart,) = ops.named("systemd.restart", unit=node_paths.watchdog_unit(replica.name))
    (reload,) = ops.named("systemd.daemon_reload")
    assert not restart.kwargs["_if"]() and not reload.kwargs["_if"]()
    written.changed = True
    assert restart.kwargs["_if"]() and not record.kwargs["changed"]()
    written.changed, unit.changed = False, True
    assert restart.kwargs["_if"]() and reload.kwargs["_if"]() and not record.kwargs["changed"]()
    (retired,) = ops.named("systemd.retired")
    assert node_paths.watchdog_enabled_link("{name}") in retired.kwargs["paths"]


@pytest.mark.parametrize("values", [{"vllm_watchdog_stall_s": 0}, {"vllm_start": False}])
def test_no_watchdog_runs_when_off_or_stopped(monkeypatch: pytest.MonkeyPatch, values: dict[str, object]) -> None:
    replica, host = first_node("a_single_node_70b")
    ops, _ = run_vllm_role(monkeypatch, "a_single_node_70b", host, **values)
    (stopped,) = ops.named("systemd.service", unit=node_paths.watchdog_unit(replica.name))
    assert stopped.kwargs["running"] is False and stopped.kwargs["enabled"] is False
    assert not ops.named("systemd.restart", unit=node_paths.watchdog_unit(replica.name))
    written = ops.named("files.file", dest=node_paths.watchdog_config(replica.name))
    absent = ops.named("files.absent", path=node_paths.watchdog_config(replica.name))
    assert (written, absent) == (([], absent) if values.get("vllm_watchdog_stall_s") == 0 else (written, []))


def test_the_other_ranks_of_a_multi_node_replica_run_no_watchdog(monkeypatch: pytest.MonkeyPatch) -> None:
    _, replicas = planned_shape("b_two_nodes_mp")
    replica = replicas[0]
    follower = replica.nodes[1]
    ops, _ = run_vllm_role(monkeypatch, "b_two_nodes_mp", follower)
    assert ops.named("files.absent", path=node_paths.watchdog_config(replica.name))
    (stopped,) = ops.named("systemd.service", unit=node_paths.watchdog_unit(replica.name))
    assert stopped.kwargs["running"] is False and stopped.kwargs["enabled"] is False
    leader, _ = run_vllm_role(monkeypatch, "b_two_nodes_mp", replica.nodes[0])
    (runs,) = leader.named("systemd.service", unit=node_paths.watchdog_unit(replica.name))
    assert runs.kwargs["running"] is True


def test_the_watchdog_asks_the_name_the_readiness_check_asks(monkeypatch: pytest.MonkeyPatch) -> None:
    replica, host = first_node("a_single_node_70b")
    ops, _ = run_vllm_role(monkeypatch, "a_single_node_70b", host)
    (written,) = ops.named("files.file", dest=node_paths.watchdog_config(replica.name))
    (wait,) = [c for c in ops.named("server.script")
               if f"--unit vllm@{replica.name}.service" in str(c.kwargs.get("script"))]
    doc = json.loads(written.kwargs["content"])
    assert f"--model {doc['model']}" in wait.kwargs["script"] and f"--url {doc['url']}" in wait.kwargs["script"]


def test_the_tool_parses_as_the_oldest_python_a_node_may_run() -> None:
    ast.parse(TOOL.read_text(), feature_version=(3, 8))
