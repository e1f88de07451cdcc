"""The readiness wait (gpufleet/node/vllm_ready.py) as the deploy runs it on a node: against a small HTTP stand-in
for vLLM, a stand-in ``systemctl`` whose answers are each case's data (one ``systemctl show`` answer per look,
the last one repeated) and a stand-in ``journalctl`` that prints the unit's journal from tests/vllm_ready/."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.loopback_http import QuietHandler, loopback_server

TOOL = Path(__file__).resolve().parent.parent / "gpufleet" / "node" / "vllm_ready.py"
UNIT = "vllm@pool-0.service"

JOURNALS = Path(__file__).resolve().parent / "vllm_ready"
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
        f"{UNIT} did not start: ValueError: Available memory on node 0 (14.15/23.54 GiB) on kv cache allocation is "
        "less than requested memory for kv (4096.0 GiB).", "kv_cache_refused.journal"),
    "an_engine_failing_otherwise_is_left_to_its_restarts": (
        False, ["ActiveState=activating\nNRestarts=0"], 1, "/health answered 503", "nccl_timeout.journal"),
}


def _serving(ready: bool) -> type[QuietHandler]:
    class Handler(QuietHandler):
        def do_GET(self) -> None:
            self.answer(200 if ready else 503, b"")

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.answer(200, json.dumps({"usage": {"completion_tokens": 1}}).encode())

    return Handler


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_readiness_wait(case: str, tmp_path: Path) -> None:
    ready, shows, code, seen, *journal = CASES[case]
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
    (bin_dir / "journalctl").write_text(  # the wait reads the unit's journal since it began
        f'#!/bin/sh\n[ "$1 $2 $3 ${{4%%=*}} $5 $6" = "-q -o cat --since -u {UNIT}" ] || exit 9\n'
        + (f"cat {JOURNALS / journal[0]}\n" if journal else ""))
    (bin_dir / "journalctl").chmod(0o755)
    # the timeout lets the wait see every answer: restarts that began before it must not end it early
    timeout = str(2 * len(shows) + 1)
    with loopback_server(_serving(ready)) as url:
        done = subprocess.run([sys.executable, "-I", str(TOOL), "--url", url, "--model", "tiny", "--unit", UNIT,
                               "--timeout", timeout], capture_output=True, text=True, timeout=60,
                              env={"PATH": f"{bin_dir}:/usr/bin:/bin"})
    verdict = json.loads(done.stdout)
    assert (done.returncode, verdict["ready"]) == (code, code == 0), done.stderr
    assert verdict["seen"].startswith(seen), verdict
    if case in ("restarts_from_before_the_wait_do_not_count", "an_engine_failing_otherwise_is_left_to_its_restarts"):
        assert verdict["seconds"] > float(timeout)  # waited the whole timeout
    if case == "an_engine_refusing_its_configuration_is_named_at_once":
        assert verdict["seconds"] < 2
