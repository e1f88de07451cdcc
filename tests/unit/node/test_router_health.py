"""The node tool router_health.py (gpufleet/node/router_health.py): HAProxy's health as keepalived reads it.

The verdicts are data (tests/data/router_health/verdicts.yaml); the checks ask real loopback HTTP servers, and the
tool itself runs as a process against one that is stopped under it.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpufleet import node_paths
from gpufleet.node import router_health
from tests.conftest import DATA, ROOT
from tests.loopback_http import QuietHandler, loopback_server
from tests.polling import until

CASES = yaml.safe_load((DATA / "router_health" / "verdicts.yaml").read_text())


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_verdicts(case: dict[str, Any]) -> None:
    verdict = router_health.Verdict(case.get("fall", 2), case.get("rise", 2))
    seen = []
    for result in case["checks"]:
        before = verdict.healthy
        assert verdict.add(result) == (verdict.healthy != before)
        seen.append(verdict.healthy)
    assert seen == case["healthy"]


def _handler(status: int, delay_s: float = 0.0) -> type[BaseHTTPRequestHandler]:
    class Handler(QuietHandler):
        def do_GET(self) -> None:
            time.sleep(delay_s)
            self.answer(status if self.path == "/health" else 404, b"{}")

    return Handler


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])  # closed again: nothing listens there


@pytest.mark.parametrize(("status", "delay_s", "expected"), [
    (200, 0.0, router_health.PASSED), (503, 0.0, router_health.FAILED), (200, 1.5, router_health.FAILED)])
def test_a_check_reads_the_answer_and_its_time(status: int, delay_s: float, expected: str) -> None:
    with loopback_server(_handler(status, delay_s)) as url:
        assert router_health.check(f"{url}/health", timeout_s=0.5) == expected


def test_nothing_listening_is_refused() -> None:
    assert router_health.check(f"http://127.0.0.1:{_closed_port()}/health", 0.5) == router_health.REFUSED


def test_the_state_file_is_replaced_whole(tmp_path: Path) -> None:
    state = tmp_path / "healthy"
    router_health.write_state(str(state), True)
    assert state.read_text() == "1\n" and state.stat().st_mode & 0o777 == 0o644
    router_health.write_state(str(state), False)
    assert state.read_text() == "0\n" and not (tmp_path / "healthy.new").exists()


def test_the_tool_follows_haproxy_and_fails_at_once_when_it_goes(tmp_path: Path) -> None:
    state = tmp_path / "healthy"
    with loopback_server(_handler(200)) as url:
        proc = subprocess.Popen([sys.executable, str(ROOT / "gpufleet" / "node" / "router_health.py"),
                                 "--url", f"{url}/health", "--state", str(state), "--interval", "0.2"],
                                stdout=subprocess.PIPE, text=True)
        try:
            until(lambda: state.exists() and state.read_text() == "1\n", "healthy")
        except BaseException:
            proc.kill()
            raise
    try:
        # the server is gone: the next check is refused, and the file says so within an interval or a few (a
        # loaded machine schedules the tool late)
        gone = until(lambda: state.read_text() == "0\n", "unhealthy")
        assert gone < 2.0
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=10)
    assert proc.returncode == 0 and state.read_text() == "0\n"
    assert "passes" in out and "fails" in out


@pytest.mark.parametrize("argv", [["--url", "https://127.0.0.1:1/health"], ["--interval", "0"], ["--fall", "0"],
                                  ["--rise", "x"]])
def test_bad_arguments_are_refused(tmp_path: Path, argv: list[str]) -> None:
    base = {"--url": "http://127.0.0.1:1/health", "--state": str(tmp_path / "s")}
    for flag, value in zip(argv[::2], argv[1::2], strict=True):
        base[flag] = value
    with pytest.raises(SystemExit) as raised:
        router_health.main([word for pair in base.items() for word in pair])
    assert raised.value.code == 2 and not (tmp_path / "s").exists()


def test_role_common_installs_it() -> None:
    assert "router_health.py" in node_paths.NODE_TOOL_FILES
