"""A node's series from the monitoring hosts' Prometheus (gpufleet/diag/series.py): the query asked, the first
Prometheus that answers, a silent one asked once, the byte cap, a refusal; and the series in the archive, redacted.
Prometheus's answer is one recorded from the lab's (tests/data/diag_series/query_range.json); only the HTTP GET is
replaced."""

from __future__ import annotations

import json
import tarfile
import urllib.error
import urllib.parse
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpufleet.diag.archive import write_archive
from gpufleet.diag.collect import NodeRun
from gpufleet.diag.options import out_path
from gpufleet.diag.redact import fleet_secrets
from gpufleet.diag.series import MIN_STEP_S, POINTS, Snapshot, selector, snapshots, step_s
from gpufleet.values.types import SecretRef

DATA = Path(__file__).parents[2] / "data" / "diag_series"
RECORDED = (DATA / "query_range.json").read_bytes()
NODE = "lab1"
END = 1_795_872_000.0


class Prometheuses:
    """The GETs asked, answered by base URL: bytes, or an exception raised."""

    def __init__(self, answers: dict[str, bytes | Exception]) -> None:
        self.answers = answers
        self.asked: list[tuple[str, dict[str, str]]] = []

    def __call__(self, url: str, timeout_s: float, max_bytes: int) -> bytes:
        base, _, query = url.partition("/api/v1/query_range?")
        self.asked.append((base, dict(urllib.parse.parse_qsl(query))))
        answer = self.answers[base]
        if isinstance(answer, Exception):
            raise answer
        return answer[:max_bytes]


def test_the_query_asks_the_nodes_series_without_buckets_over_the_window() -> None:
    prometheus = Prometheuses({"http://m1:9090": RECORDED})
    found = snapshots(["http://m1:9090"], [NODE], 3600, END, 1 << 20, prometheus)
    ((base, asked),) = prometheus.asked
    assert base == "http://m1:9090"
    assert asked == {"query": selector(NODE), "start": f"{END - 3600:.3f}", "end": f"{END:.3f}", "step": "15"}
    assert asked["query"].startswith('{node="lab1", __name__=~"up|ALERTS|')
    assert '__name__!~".+_bucket"' in asked["query"]
    kept = json.loads(found[NODE].data or b"")
    assert found[NODE].problem is None and kept["series"] == json.loads(RECORDED)["data"]["result"]
    assert {s["metric"]["node"] for s in kept["series"]} == {NODE} and len(kept["series"]) > 10


def test_a_node_name_is_quoted_as_a_promql_string() -> None:
    assert selector('a"b\\c').startswith('{node="a\\"b\\\\c", ')


@pytest.mark.parametrize(("since_s", "step"), [(60, MIN_STEP_S), (3600, MIN_STEP_S), (6 * 3600, 90),
                                               (30 * 86400, 30 * 86400 // POINTS)])
def test_a_window_has_at_most_its_points(since_s: int, step: int) -> None:
    assert step_s(since_s) == step and since_s / step <= POINTS


def test_the_next_prometheus_answers_and_a_silent_one_is_asked_once() -> None:
    prometheus = Prometheuses({"http://m1:9090": urllib.error.URLError("Connection refused"),
                               "http://m2:9090": RECORDED})
    found = snapshots(["http://m1:9090", "http://m2:9090"], [NODE, "lab2"], 3600, END, 1 << 20, prometheus)
    assert [base for base, _ in prometheus.asked] == ["http://m1:9090", "http://m2:9090", "http://m2:9090"]
    assert all(snap.data is not None and snap.problem is None for snap in found.values())
    assert json.loads(found["lab2"].data or b"")["prometheus"] == "http://m2:9090"


@pytest.mark.parametrize(("answers", "why"), [
    ({"http://m1:9090": OSError("timed out")}, "http://m1:9090 did not answer (OSError: timed out)"),
    ({"http://m1:9090": b'{"status":"error","errorType":"bad_data","error":"parse error"}'},
     "http://m1:9090 refused the query"),
    ({"http://m1:9090": b"<html>a proxy's page</html>"}, "http://m1:9090 refused the query"),
    ({"http://m1:9090": RECORDED}, "http://m1:9090: the node's series are more than the cap of 1,000 bytes"),
], ids=["silent", "refused", "not-json", "over-the-cap"])
def test_why_there_are_no_series_is_one_line(answers: dict[str, bytes | Exception], why: str) -> None:
    found = snapshots(list(answers), [NODE], 3600, END, 1000, Prometheuses(answers))
    assert found[NODE] == Snapshot(None, why)


def test_without_a_monitoring_host_the_series_are_named_missing() -> None:
    assert snapshots([], [NODE], 3600, END, 1 << 20)[NODE].problem == (
        "no monitoring host: no Prometheus to read the node's series from")


def test_the_series_go_into_the_archive_redacted_and_indexed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = "vk-" + "5eed" * 8
    monkeypatch.setenv("T_SERIES_KEY", key)
    secrets = fleet_secrets([SimpleNamespace(vllm_api_key=SecretRef(env="T_SERIES_KEY"))])
    doc = json.loads(RECORDED)
    doc["data"]["result"][0]["metric"]["note"] = f"a label that holds {key}"  # a secret a label should never hold
    series = {NODE: Snapshot(json.dumps(doc).encode()), "lab2": Snapshot(None, "http://m1:9090 refused the query")}
    runs = {host: NodeRun(host, 1.0, problem="not collected in this test") for host in series}
    written = write_archive(out_path(str(tmp_path / "d.tar.gz")), runs, secrets, {}, 1 << 20, None, series)
    with tarfile.open(written.path) as tar:
        kept = tar.extractfile(f"series/{NODE}.json").read()  # type: ignore[union-attr]
        assert "series/lab2.json" not in tar.getnames()
    assert key.encode() not in kept and b"[redacted]" in kept and written.index["redacted"]["vllm_api_key"] == 1
    nodes = written.index["nodes"]
    assert nodes[NODE]["members"] == [{"name": f"series/{NODE}.json", "bytes": len(kept)}]
    assert nodes["lab2"]["unread"] == [{"what": "its series in Prometheus", "why": "http://m1:9090 refused the query"}]
