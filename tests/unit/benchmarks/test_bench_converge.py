"""bench/converge.py's reading of pyinfra 3.10's output (captured from ``pyinfra -y -vv --json`` runs)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location("bench_converge", Path(__file__).parents[3] / "bench" / "converge.py")
assert _SPEC is not None and _SPEC.loader is not None
converge = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(converge)

LOG = """\
--> Loading config...
--> Loading inventory...
--> Connecting to hosts...
    [10.213.150.11] Connected
    [10.213.150.12] Connected

--> Preparing operation files...
    Loading: deploys/vllm.py
[10.213.150.11] >>> sh -c 'uname -n'
[10.213.150.12] >>> sh -c 'uname -n'
    [10.213.150.11] Loaded fact server.Hostname
    [10.213.150.12] Loaded fact server.Hostname

--> Beginning operation run...
--> Starting operation: ok op\x20
\x1b[0m[\x1b[1m10.213.150.11\x1b[0m] >>> sh -c true
[10.213.150.11] >>> sh -c 'echo a
echo b'
    [10.213.150.11] Success
[10.213.150.12] >>> sh -c true
    [10.213.150.12] Success on retry 1

--> Starting operation: dir\x20
[10.213.150.11] >>> sh -c 'test -d /x'
    [10.213.150.11] Loaded fact files.Directory (path=/x)
    [10.213.150.11] No changes
    [10.213.150.12] No changes

--> Starting operation: bad op\x20
[10.213.150.12] >>> sh -c 'echo boom >&2; false'
    [10.213.150.12] boom
    [10.213.150.12] Error: executed 0 commands
    [10.213.150.11] nested Success

--> Disconnecting from hosts...
"""

RESULTS = {
    "operations": [
        {"name": "ok op", "success": ["10.213.150.11", "10.213.150.12"], "error": [], "no_change": []},
        {"name": "dir", "success": [], "error": [], "no_change": ["10.213.150.11", "10.213.150.12"]},
        {"name": "bad op", "success": [], "error": ["10.213.150.12"], "no_change": []},
    ],
    "totals": {},
    "failed_hosts": ["10.213.150.12"],
}


def test_commands_are_counted_per_host_and_phase() -> None:
    assert converge.count_commands(LOG) == {
        "10.213.150.11": {"prepare": 1, "execute": 3, "total": 4},
        "10.213.150.12": {"prepare": 1, "execute": 2, "total": 3},
    }


def test_results_are_the_last_json_line_of_stdout() -> None:
    stdout = "something the deploy printed\n" + json.dumps({"plan": [], "results": RESULTS}) + "\n"
    assert converge.results_json(stdout) == RESULTS
    assert converge.results_json("--> no json\n") is None
    assert converge.results_json(json.dumps({"plan": [], "results": None})) is None


def test_operations_per_host_from_results_and_from_log() -> None:
    from_results = converge.ops_from_results(RESULTS)
    assert from_results == {
        "10.213.150.11": {"changed": 1, "unchanged": 1, "error": 0},
        "10.213.150.12": {"changed": 1, "unchanged": 1, "error": 1},
    }
    from_log = converge.ops_from_log(LOG)
    assert from_log["10.213.150.12"] == from_results["10.213.150.12"]
    assert from_log["10.213.150.11"] == {"changed": 2, "unchanged": 1, "error": 0}  # the nested one counts


def test_failed_operation_and_its_output() -> None:
    assert converge.failed_operations(LOG, None) == [
        {"host": "10.213.150.12", "operation": "bad op", "output": ["boom"]}]
    assert converge.failed_operations(LOG, RESULTS) == converge.failed_operations(LOG, None)


def test_summary_of_a_run() -> None:
    report = converge.summarize_run(0, 12.34, json.dumps({"plan": [], "results": RESULTS}), LOG)
    assert report["seconds"] == 12.3
    assert report["commands_per_host"] == {"10.213.150.11": 4, "10.213.150.12": 3}
    assert report["changed_ops_per_host"] == {"10.213.150.11": 1, "10.213.150.12": 1}
    assert report["ops_source"] == "json"
    assert "stderr_tail" not in report
