"""Findings (``gpufleet/node/findings.py``) as data: kernel logs read against the repository's catalog
(``tests/data/findings/kernel_logs.yml``) and catalogs the rules refuse (``tests/data/findings/bad_catalogs.yml``)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from gpufleet.config.settings.node_lifecycle import repository_catalog
from gpufleet.node import findings
from tests.conftest import DATA

CATALOG: dict[str, Any] = repository_catalog()
LOGS: dict[str, dict[str, Any]] = yaml.safe_load((DATA / "findings" / "kernel_logs.yml").read_text())
BAD: list[dict[str, Any]] = yaml.safe_load((DATA / "findings" / "bad_catalogs.yml").read_text())


def test_the_repository_catalog_is_sound_and_names_its_source() -> None:
    assert findings.catalog_problems(CATALOG) == []
    assert CATALOG["source"].startswith("NVIDIA Xid catalog")
    for code in (48, 63, 64, 74, 79, 94, 95, 119, 120):  # the codes a serving node must never keep running on
        assert CATALOG["xid"][code]["action"] == "quarantine", code


@pytest.mark.parametrize("name", sorted(LOGS))
def test_a_kernel_log(name: str) -> None:
    case = LOGS[name]
    bursts = findings.Bursts(CATALOG)
    found = []
    for at, line in case["log"]:
        xid = findings.parse_xid(line)
        if xid is not None and (finding := bursts.see(xid, float(at))) is not None:
            found.append([finding.action, finding.code, finding.gpu])
    assert found == case["findings"]
    for gpu, code, lines in case.get("lines", []):
        assert bursts.lines_in(findings.Xid(gpu, code, "")) == lines


def test_a_finding_carries_the_drivers_words_and_the_catalogs_name() -> None:
    xid = findings.parse_xid("NVRM: Xid (PCI:0000:3b:00): 79, pid=1912, name=python3, GPU has fallen off the bus.")
    assert xid == findings.Xid("0000:3b:00", 79, "pid=1912, name=python3, GPU has fallen off the bus.")
    finding = findings.Bursts(CATALOG).see(xid, 0.0)
    assert finding is not None and finding.evidence == {"line": xid.text, "name": "GPU has fallen off the bus",
                                                        "bucket": "RESTART_BM"}


@pytest.mark.parametrize("case", BAD, ids=lambda c: c["problems"][0].split(":")[0])
def test_a_bad_catalog_is_refused_line_by_line(case: dict[str, Any]) -> None:
    assert findings.catalog_problems(case["doc"], "node_findings", frozenset(CATALOG["checks"])) == case["problems"]


def test_an_override_replaces_whole_entries_and_keeps_the_rest() -> None:
    out = findings.merged(CATALOG, {"xid": {13: {"action": "suspect"}}})
    assert findings.action_of(out, "xid", 13) == "suspect" and findings.action_of(out, "xid", 79) == "quarantine"
    assert findings.action_of(CATALOG, "xid", 13) == "record"  # the catalog itself is left alone
    assert findings.action_of(out, "gate_failed") == "quarantine" and findings.action_of(out, "nothing") == "record"
    assert findings.worst([]) == "record"
    # one code however it is spelt: the override's "79" replaces the catalog's 79
    assert findings.action_of(findings.merged(CATALOG, {"xid": {"79": {"action": "record"}}}), "xid", 79) == "record"


def test_three_watchdog_restarts_within_the_window_are_one_finding_and_older_ones_do_not_count() -> None:
    stalls = findings.Stalls(CATALOG)
    restarts = [(1000.0, "restarting vllm@a.service: stalled"), (2000.0, "restarting vllm@a.service: stalled")]
    assert stalls.see(restarts, 2100.0) is None  # two: the process's
    restarts.append((3000.0, "restarting vllm@a.service: stalled"))
    finding = stalls.see(restarts, 3100.0)
    assert finding is not None and (finding.kind, finding.action) == ("watchdog_stalls", "suspect")
    assert finding.evidence["restarts"] == [line for _, line in restarts]
    assert stalls.see(restarts, 3200.0) is None  # once: those restarts made their finding
    later = [*restarts, (5000.0, "x"), (5100.0, "y"), (9000.0, "z")]
    assert stalls.see(later, 9100.0) is None  # 5000 and 5100 are older than the hour before 9100


TRENDS: dict[str, Any] = yaml.safe_load((DATA / "findings" / "gpu_trends.yml").read_text())


@pytest.mark.parametrize("name", sorted(TRENDS["cases"]))
def test_gpu_trends(name: str) -> None:
    case = TRENDS["cases"][name]
    samples = [{"at": float(at), "gpus": [{"gpu": i, "pci": pci, **TRENDS["shapes"][shape]} for i, (pci, shape)
                                          in enumerate((case["gpus"] if run == "all" else run).items())]}
               for at, run in case["runs"]]
    trends = findings.Trends(CATALOG)
    for at, expected in case["reads"]:
        seen = [s for s in samples if s["at"] <= at]
        assert [[f.kind, f.action, f.gpu] for f in trends.see(seen, float(at))] == expected, at


def test_trends_read_past_what_is_not_a_sample() -> None:
    """Samples no GPU watch wrote (the review's cases): nothing raises, and nothing is found from them."""
    trends = findings.Trends(CATALOG, min_samples=1)
    link = {"gen_current": 5, "gen_max": 5, "width_max": 16}
    junk: list[Any] = ["x", {"at": "now"}, {"at": 5.0, "gpus": 5}, {"at": 10**400, "gpus": []},
                       {"at": True, "gpus": []},
                       {"at": 5.0, "gpus": ["x", {"pci": "a", "events": "hw_slowdown"}, {"pci": "b", "events": [["x"]]},
                                              {"pci": "c", "events": [{}]}, {"pci": ["x"], "events": ["hw_slowdown"]},
                                              {"pci": "d", "events": [], "pcie": {**link, "width_current": -1}},
                                              {"pci": "e", "events": [], "pcie": {**link, "width_current": True}},
                                              {"pci": "f", "events": [], "pcie": {**link, "width_current": 15.9}},
                                              {"pci": "g", "events": [], "pcie": {**link, "width_current": "1"}},
                                              {"pci": "h", "events": [], "pcie": {**link,
                                                                                  "width_current": float("inf")}},
                                              {"pci": "i", "events": [], "nvlinks_down": True}]}]
    assert trends.see(junk, 10.0) == [] and trends.see("not a list", 10.0) == []  # type: ignore[arg-type]
    once = {"pci": "0000:18:00.0", "events": ["hw_slowdown"]}
    repeated = [{"at": 5.0, "gpus": [once] * 5}] * 5  # one reading, listed many times: one sample
    assert findings.Trends(CATALOG).see(repeated, 10.0) == []
