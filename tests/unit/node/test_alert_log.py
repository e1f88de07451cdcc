"""The alert log (gpufleet/node/alert_log.py): Alertmanager's notifications as one journal line per alert.

Data: tests/data/alert_log/notification.json (a webhook notification as Alertmanager sends it, with a resolved alert and
labels that try to break or forge a line) and expected.txt (its lines). The tool itself runs as the unit runs it,
on 127.0.0.1, and is posted to over HTTP.
"""

from __future__ import annotations

import http.client
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from gpufleet import node_paths
from gpufleet.node import alert_log
from tests.conftest import DATA, ROOT
from tests.loopback_http import free_port

DATA = DATA / "alert_log"
TOOL = ROOT / "gpufleet" / "node" / "alert_log.py"


def test_each_alert_of_a_notification_is_one_line_that_no_label_can_break_or_forge() -> None:
    lines = alert_log.notification_lines((DATA / "notification.json").read_bytes())
    assert lines == (DATA / "expected.txt").read_text().splitlines()
    assert all("\n" not in line and "\r" not in line for line in lines)


@pytest.mark.parametrize(("body", "why"), [
    (b"{not json", "not JSON"),
    (b"\xff\xfe", "not JSON"),
    (b"[]", "no list of alerts"),
    (b'{"alerts": {"labels": {}}}', "no list of alerts"),
    (b'{"alerts": [{"status": "firing"}]}', "an alert without a labels object"),
])
def test_a_body_that_is_not_a_notification_is_refused_with_its_reason(body: bytes, why: str) -> None:
    with pytest.raises(alert_log.NotANotification, match=why):
        alert_log.notification_lines(body)


def _post(port: int, body: bytes) -> int:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as error:
        return error.code


def _announce_only(port: int, length: int) -> int:
    """POST only the headers of a body of ``length`` bytes; the answer's status."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.putrequest("POST", "/")
        connection.putheader("Content-Length", str(length))
        connection.endheaders()
        return connection.getresponse().status
    finally:
        connection.close()


def test_the_tool_logs_what_alertmanager_posts_and_refuses_the_rest() -> None:
    """The tool as its unit runs it: the lines on stdout (the journal), 200 for a notification, 400 and one line
    for anything else, 413 for a body over its limit."""
    port = free_port()
    tool = subprocess.Popen([sys.executable, "-I", str(TOOL), "--port", str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert tool.stdout is not None
        assert tool.stdout.readline().strip() == f"alert log: taking Alertmanager's notifications on 127.0.0.1 " \
                                                 f"port {port}"
        assert _post(port, (DATA / "notification.json").read_bytes()) == 200
        expected = (DATA / "expected.txt").read_text().splitlines()
        assert [tool.stdout.readline().rstrip("\n") for _ in expected] == expected
        assert _post(port, b'{"alerts": 7}') == 400
        assert tool.stdout.readline().strip() == "refused a notification: no list of alerts"
        assert _announce_only(port, alert_log.MAX_BODY + 1) == 413
        assert tool.stdout.readline().startswith("refused a notification: expected a Content-Length of 0 to ")
        assert tool.poll() is None  # still serving
    finally:
        tool.terminate()
        tool.wait(timeout=10)
    assert tool.stderr is not None and tool.stderr.read() == ""  # no access log, no traceback


def test_role_common_installs_the_tool_where_the_unit_runs_it() -> None:
    assert "alert_log.py" in node_paths.NODE_TOOL_FILES
