"""ray_join_wait.py, the vLLM unit's wait on a Ray head until every node of the replica has joined.

``tests/data/ray_join_wait/<case>.json``: ``nodes`` and ``timeout`` (the tool's arguments), ``answers`` (what
``ray status`` prints at each poll, a list of lines, or null when it fails; the last one repeats), with ``fabric``
the verdicts of the fabric check in turn (the last one repeats; the check itself runs in tests/lab/test_ray.py), and
what must come of it: the ``exit`` status, how many ``polls`` and ``fabric_checks``, and the ``log`` lines (after
the tool's prefix). Time is a fake clock that each sleep moves on. The command line itself runs once against a
stand-in ``ray`` program.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from gpufleet.node import ray_join_wait
from tests.conftest import DATA, ROOT

CASES = sorted((DATA / "ray_join_wait").glob("*.json"))
TOOL = ROOT / "gpufleet" / "node" / "ray_join_wait.py"
ADDRESS = "10.0.0.5:6379"


class FakeRay:
    """``ray status`` answering from a case, on a clock that only sleeping moves."""

    def __init__(self, answers: list[list[str] | None]) -> None:
        self.answers = answers
        self.now = 0.0
        self.calls: list[tuple[str, str]] = []

    def count(self, ray: str, address: str) -> int | None:
        self.calls.append((ray, address))
        answer = self.answers[min(len(self.calls), len(self.answers)) - 1]
        return None if answer is None else ray_join_wait.count_alive("\n".join(answer))

    def sleep(self, seconds: float) -> None:
        self.now += seconds


FABRIC_ARGS = ["--fabric-port", "29589", "--fabric-backend", "gloo", "--fabric-iface", "host0", "--fabric-bytes",
               "1024", "--fabric-floor-gbps", "0.02", "--fabric-timeout", "10"]


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_case(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    case: dict[str, Any] = json.loads(path.read_text())
    ray = FakeRay(case["answers"])
    argv = ["--ray", "/etc/gpufleet/vllm/r/venv/bin/ray", "--address", ADDRESS, "--nodes", str(case["nodes"]),
            "--timeout", str(case["timeout"]), *(FABRIC_ARGS if "fabric" in case else [])]
    checked: list[tuple[str, dict[str, Any]]] = []

    def fabric(address: str, settings: dict[str, Any]) -> dict[str, Any]:
        checked.append((address, settings))
        return dict(case["fabric"][min(len(checked), len(case["fabric"])) - 1])

    assert ray_join_wait.main(argv, count=ray.count, clock=lambda: ray.now, sleep=ray.sleep,
                              fabric=fabric) == case["exit"]
    assert len(ray.calls) == case["polls"] and len(checked) == case.get("fabric_checks", 0)
    assert all(c == (ADDRESS, {"port": 29589, "backend": "gloo", "iface": "host0", "bytes": 1024, "floor_gbps": 0.02,
                                "timeout_s": 10.0}) for c in checked)
    assert set(ray.calls) == {("/etc/gpufleet/vllm/r/venv/bin/ray", ADDRESS)}
    prefix = f"ray_join_wait: Ray at {ADDRESS}: "
    logged = capsys.readouterr().err.splitlines()
    assert all(line.startswith(prefix) for line in logged), logged
    assert [line.removeprefix(prefix) for line in logged] == case["log"]


@pytest.mark.parametrize(("lines", "alive"), [
    (["Active:", " 1 node_a", "Idle:", " 2 node_b", "Pending:", " 1 node_c", "Recent failures:", " 1 node_d"], 3),
    (["Pending:", " 1 node_c", "Active:", " (no active nodes)", "Idle:", " 1 node_b"], 1),
    (["Active:", " 1 node_a launching", " node_b", " 1 worker_type", " x node_c"], 0),
])
def test_only_count_node_lines_of_the_node_sections_count(lines: list[str], alive: int) -> None:
    assert ray_join_wait.count_alive("\n".join(lines)) == alive


def test_there_are_cases_for_success_and_for_failure() -> None:
    exits = {json.loads(path.read_text())["exit"] for path in CASES}
    assert exits == {0, 1}


def _stand_in_ray(tmp_path: Path, nodes_alive: int) -> Path:
    """A ``ray`` program that records its argv and whether it got the token, and prints a status."""
    program = tmp_path / "ray"
    listing = "\\n".join(f" 1 node_{i:032x}" for i in range(nodes_alive))
    program.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        f"open({str(tmp_path / 'seen.json')!r}, 'w').write(json.dumps({{'argv': sys.argv[1:],"
        " 'token': os.environ.get('RAY_AUTH_TOKEN'), 'mode': os.environ.get('RAY_AUTH_MODE')}))\n"
        f"print('Node status\\nActive:\\n{listing}\\nPending:\\n (no pending nodes)')\n")
    program.chmod(0o755)
    return program


@pytest.mark.parametrize(("alive", "exit_status"), [(2, 0), (1, 1)])
def test_the_command_line_asks_ray_status_with_the_token_from_the_environment(tmp_path: Path, alive: int,
                                                                           exit_status: int) -> None:
    ray = _stand_in_ray(tmp_path, alive)
    env = {"PATH": os.environ["PATH"], "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "t0ken-of-the-cluster"}
    argv = [sys.executable, str(TOOL), "--ray", str(ray), "--address", "[fd00::5]:6379", "--nodes", "2",
            "--timeout", "0"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == exit_status, done.stderr
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen == {"argv": ["status", "--address=[fd00::5]:6379"], "token": "t0ken-of-the-cluster",
                    "mode": "token"}
    assert "t0ken" not in " ".join(argv) + done.stderr
    assert f"{alive} of 2 nodes joined" in done.stderr


def test_a_ray_status_that_fails_or_is_missing_is_no_answer(tmp_path: Path) -> None:
    failing = tmp_path / "ray"
    failing.write_text("#!/bin/sh\necho 'Active:\n 1 node_x\nPending:'\nexit 1\n")
    failing.chmod(0o755)
    assert ray_join_wait.ray_status(str(failing), ADDRESS) is None
    assert ray_join_wait.ray_status(str(tmp_path / "absent"), ADDRESS) is None


class _Remote:
    """Ray's remote function as ray_fabric uses it, run in this process, each call on the node it is pinned to."""

    def __init__(self, calls: list[tuple[str, list[str]]], function: Any) -> None:
        self.calls, self.function, self.node = calls, function, ""

    def options(self, scheduling_strategy: Any) -> _Remote:
        self.node = scheduling_strategy.node_id
        return self

    def remote(self, argv: list[str], timeout: float) -> Any:
        self.calls.append((self.node, argv))
        rank = int(argv[argv.index("--rank") + 1])
        return (0, json.dumps({"passed": True, "busbw_gbps": 0.4, "seconds": 2.0}) if rank == 0 else "", "")


def test_the_ray_check_runs_one_rank_on_each_live_node_the_head_first(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, list[str]]] = []
    fake = types.ModuleType("ray")
    fake.is_initialized = lambda: True  # type: ignore[attr-defined]
    fake.nodes = lambda: [{"NodeID": "w", "NodeManagerAddress": "fd00::6", "Alive": True},  # type: ignore[attr-defined]
                          {"NodeID": "gone", "NodeManagerAddress": "fd00::7", "Alive": False},
                          {"NodeID": "h", "NodeManagerAddress": "fd00::5", "Alive": True}]
    fake.remote = lambda num_cpus: lambda function: _Remote(calls, function)  # type: ignore[attr-defined]
    fake.get = lambda refs, timeout: refs  # type: ignore[attr-defined]
    strategies = types.ModuleType("ray.util.scheduling_strategies")
    strategies.NodeAffinitySchedulingStrategy = lambda node_id, soft: types.SimpleNamespace(  # type: ignore[attr-defined]
        node_id=node_id, soft=soft)
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.setitem(sys.modules, "ray.util", types.ModuleType("ray.util"))
    monkeypatch.setitem(sys.modules, "ray.util.scheduling_strategies", strategies)
    settings = {"port": 29589, "backend": "gloo", "iface": "host0", "bytes": 1024, "floor_gbps": 0.02, "timeout_s": 10}
    verdict = ray_join_wait.ray_fabric("[fd00::5]:6379", settings)
    assert verdict == {"passed": True, "busbw_gbps": 0.4, "seconds": 2.0}
    assert [(node, argv[argv.index("--rank") + 1], argv[argv.index("--world") + 1]) for node, argv in calls] == [
        ("h", "0", "2"), ("w", "1", "2")]  # the head leads; the dead node is no rank
    assert {argv[argv.index("--leader") + 1] for _, argv in calls} == {"fd00::5:29589"}
    assert all(argv[1] == ray_join_wait.FABRIC_TOOL for _, argv in calls)


@pytest.mark.parametrize(("bad", "line"), [
    (["--fabric-port", "0"], "--fabric-port: expected a port 1 to 65535, found '0'"),
    (["--fabric-port", "70000"], "--fabric-port: expected a port 1 to 65535, found '70000'"),
    (["--fabric-port", "29589", "--fabric-bytes", "2"], "--fabric-bytes: expected 4 bytes to 16 GiB, found '2'"),
    (["--fabric-port", "29589", "--fabric-floor-gbps", "-1"], "--fabric-floor-gbps: expected a floor above 0 GB/s"),
    (["--fabric-port", "29589", "--fabric-floor-gbps", "nan"], "--fabric-floor-gbps: expected a floor above 0 GB/s"),
    (["--fabric-port", "29589", "--fabric-floor-gbps", "inf"], "--fabric-floor-gbps: expected a floor above 0 GB/s"),
    (["--fabric-port", "29589", "--fabric-timeout", "0"], "--fabric-timeout: expected 0 to 3600 seconds"),
    (["--fabric-port", "29589", "--fabric-iface", "eth0;rm -rf /"], "--fabric-iface: expected an interface name"),
    (["--nodes", "0"], "--nodes: expected 1 to 4096 nodes, found '0'"),
    (["--timeout", "nan"], "--timeout: expected 0 to 86400 seconds, found 'nan'"),
])
def test_bad_arguments_are_refused_before_any_wait(bad: list[str], line: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    ray = FakeRay([[]])
    with pytest.raises(SystemExit) as exited:
        ray_join_wait.main(["--ray", "ray", "--address", ADDRESS, "--nodes", "2", *bad], count=ray.count)
    assert exited.value.code == 2 and ray.calls == []
    assert line in capsys.readouterr().err
