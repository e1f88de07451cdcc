"""scripts/run_tiers.py reads each tier's JUnit report: outcomes, times, and why a test failed, which the run's
last lines repeat (a CI log cut to its tail still says why)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import ROOT

REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
<testcase classname="tests.lab.test_upgrade" name="test_up" time="312.5">
  <failure message="AssertionError: [{'status': 502}]&#10;assert 1 == 0">long traceback</failure></testcase>
<testcase classname="tests.lab.test_upgrade" name="test_down" time="1.0">
  <error message="">setup broke</error></testcase>
<testcase classname="tests.unit.plan.test_plan" name="test_ok" time="0.2"/>
<testcase classname="tests.unit.plan.test_plan" name="test_skip" time="0.0"><skipped message="no promtool"/></testcase>
</testsuite></testsuites>
"""


@pytest.fixture(scope="module")
def run_tiers() -> ModuleType:
    spec = importlib.util.spec_from_file_location("run_tiers", ROOT / "scripts" / "run_tiers.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["run_tiers"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_each_case_has_its_outcome_time_and_why(run_tiers: ModuleType, tmp_path: Path) -> None:
    report = tmp_path / "report.xml"
    report.write_text(REPORT)
    found = {case.name: case for case in run_tiers.cases(report)}
    assert {name: (case.outcome, case.seconds) for name, case in found.items()} == {
        "tests.lab.test_upgrade::test_up": ("failed", 312.5),
        "tests.lab.test_upgrade::test_down": ("failed", 1.0),
        "tests.unit.plan.test_plan::test_ok": ("passed", 0.2),
        "tests.unit.plan.test_plan::test_skip": ("skipped", 0.0),
    }
    assert found["tests.lab.test_upgrade::test_up"].why.splitlines() == ["AssertionError: [{'status': 502}]",
                                                                         "assert 1 == 0"]
    assert found["tests.lab.test_upgrade::test_down"].why == "setup broke"  # no message: the element's text
    assert found["tests.unit.plan.test_plan::test_ok"].why == ""


def test_a_missing_report_has_no_cases(run_tiers: ModuleType, tmp_path: Path) -> None:
    assert run_tiers.cases(tmp_path / "absent.xml") == [] and run_tiers.cases(None) == []


def test_a_tier_waits_for_its_start_and_counts_only_its_own_time(run_tiers: ModuleType, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(run_tiers, "WAITS_POLL_S", 0.2)
    signal, ran = tmp_path / "lab-waits", tmp_path / "ran"
    tier = run_tiers.Tier("unit+tools", [["touch", str(ran)]])
    waited = []

    def after() -> bool:  # the lab touches the signal on the third look
        waited.append(signal.exists())
        if len(waited) == 3:
            signal.touch()
        return signal.exists()

    tier.run(stream=False, after=after)
    assert waited == [False, False, False] and ran.exists() and tier.status == 0
    assert tier.seconds < 0.3  # the 0.4 s of waiting is not the tier's


def _autogroup_of_a_command(run_tiers: ModuleType, yields: bool) -> tuple[str, bool]:
    """What a tier's command finds: its autogroup line, and whether it leads a session of its own."""
    # the tier lowers the share once the command runs: a busy machine may run the command first, so a yielding
    # tier's command looks again for up to 5 s (a share never lowered still shows nice 0 then)
    wait = (f"for _ in $(seq 50); do grep -q 'nice {run_tiers.AUTOGROUP_NICE}$' /proc/self/autogroup && break;"
            " sleep 0.1; done; ") if yields else ""
    probe = wait + ("cat /proc/self/autogroup;"
                    " [ \"$(ps -o sid= -p $$ | tr -d ' ')\" = \"$$\" ] && echo leader || echo member")
    tier = run_tiers.Tier("unit+tools", [["sh", "-c", probe]], yields=yields)
    tier.run(stream=False)
    assert tier.status == 0, tier.output
    group, role = tier.output[0].splitlines()[1:3]
    return group, role == "leader"


@pytest.mark.skipif(not Path("/proc/self/autogroup").exists(), reason="this kernel groups no sessions (autogroup)")
def test_a_tier_beside_the_lab_runs_in_a_session_of_its_own_at_a_lower_share(run_tiers: ModuleType) -> None:
    """The lab's vLLMs are services, each a session: only a session of its own, its share lowered, lets them
    have the cores first (a plain nice only orders processes within one session)."""
    ours = Path("/proc/self/autogroup").read_text().split()[0]
    group, leader = _autogroup_of_a_command(run_tiers, yields=True)
    assert leader and group.split()[0] != ours and group.endswith(f"nice {run_tiers.AUTOGROUP_NICE}"), group
    group, leader = _autogroup_of_a_command(run_tiers, yields=False)
    assert not leader and group.split()[0] == ours, group


def test_the_reports_are_kept_where_they_can_be_and_nothing_breaks_where_they_cannot(
        run_tiers: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    report = tmp_path / "run" / "lab.xml"
    report.parent.mkdir()
    report.write_text(REPORT)
    tiers = [run_tiers.Tier("lab", [], report=report), run_tiers.Tier("lint", [])]
    monkeypatch.setattr(run_tiers, "REPORTS", tmp_path / "kept")
    run_tiers.keep_reports(tiers)
    assert (tmp_path / "kept" / "lab.xml").read_text() == REPORT
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setattr(run_tiers, "REPORTS", blocked / "kept")  # a folder that cannot be made
    run_tiers.keep_reports(tiers)
    assert not (blocked / "kept").exists()
