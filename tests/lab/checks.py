"""Checks the lab tests share: pyinfra's results table, a deploy with no error or no change, a unit's
main PID, and an exporter's /metrics (retried while the exporter starts)."""

from __future__ import annotations

import re
import time
import urllib.request

from gpufleet_lab.state import NodeRecord

from tests.lab.harness import Completed, Lab


def results(output: str) -> dict[str, tuple[str, str, str]]:
    """pyinfra's results table: operation -> (success, error, no change) columns."""
    rows = {}
    for line in output.splitlines():
        match = re.match(r"^\s+(.+?)\s{2,}(\d+)\s+(\S+)\s+(\S+)\s+(\S+)\s*$", line)
        if match:
            rows[match[1]] = (match[3], match[4], match[5])
    return rows


def assert_no_errors(done: Completed) -> dict[str, tuple[str, str, str]]:
    """The run exited 0 and no operation failed on any host; returns the results table."""
    assert done.rc == 0, done.output[-6000:]
    rows = results(done.output)
    assert rows["Grand total"][1] == "-", done.output[-6000:]
    return rows


def assert_nothing_changed(done: Completed) -> None:
    """As assert_no_errors, and no operation changed anything on any host."""
    rows = assert_no_errors(done)
    changed = {name: row for name, row in rows.items() if row[0] != "-"}
    assert changed == {}, done.output[-6000:]


def main_pid(lab: Lab, node: NodeRecord, unit: str) -> int:
    return int(lab.host(node).check_output(f"systemctl show -p MainPID --value {unit}").strip())


def metrics(node: NodeRecord, port: int, timeout: float = 20.0) -> str:
    """An exporter's /metrics on the node's lab address."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://{node.address}:{port}/metrics", timeout=5) as answer:
                return answer.read().decode()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
