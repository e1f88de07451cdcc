"""The node watch (``gpufleet/node/node_watch.py``) without a node: the routers' agent answer, the kernel log read as
it grows, findings moving the record, people's moves refused with one line, and what Prometheus is given. Its whole
life on a node (drain, stop, evidence, burn-in, readmission): tests/lab/test_lifecycle.py."""

from __future__ import annotations

import json
import os
import socket
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from gpufleet.config.settings.node_lifecycle import repository_catalog
from gpufleet.node import findings, node_state, node_watch
from gpufleet.node_paths import QUARANTINE_CAPTURE
from gpufleet.operations.lifecycle import needs_admission
from tests.unit.lifecycle_configs import node_watch_config as _config

CATALOG = repository_catalog()
NOW = datetime(2026, 11, 27, 12, 0, tzinfo=UTC)


def _serving(config: node_watch.Config) -> None:
    with node_watch.locked(config) as record:
        new = node_state.move(record, "burn-in", "first seen", NOW)
        new = node_state.move(new, "serving", "1 clean burn-in pass(es)", NOW)
        node_watch.replace(record, new)


@pytest.mark.parametrize(("state", "age_s", "reply"), [
    ("serving", 60, "up\n"), ("serving", 2, "up 100%\n"), ("suspect", 60, "up\n"), ("new", 60, "0% down\n"),
    ("burn-in", 60, "0% down\n"), ("quarantined", 60, "0% down\n"), ("retired", 60, "0% down\n")])
def test_the_agent_tells_the_routers_whether_the_node_takes_requests(state: str, age_s: int, reply: str) -> None:
    record = {"state": state, "since": node_state.now_text(NOW - timedelta(seconds=age_s))}
    assert node_watch.agent_reply(record, NOW) == reply
    assert node_watch.agent_reply(None, NOW) == "0% down\n"


def _ask(agent: node_watch.Agent, router: str) -> str:
    """One agent check, as HAProxy makes it, from the router's own address."""
    port = agent.server.server_address[1]
    with socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(router, 0)) as conn:
        return conn.recv(64).decode()


def test_a_drain_waits_for_every_asking_router_to_hear_down_then_for_empty_engines(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request was lost when the replica stopped while a router, not yet told "down", sent it one more."""
    config = _config(tmp_path, agent={"address": "127.0.0.1", "port": 0}, drain_timeout_s=30)
    _serving(config)
    agent = node_watch.Agent(config)
    agent.start()
    try:
        agent.set(node_watch.read_record(config))
        assert [_ask(agent, r) for r in ("127.0.0.2", "127.0.0.3")] == ["up\n", "up\n"]
        assert not agent.all_heard_down()  # it serves: nothing to hear
        with node_watch.locked(config) as record:
            node_watch.replace(record, node_state.quarantine(record, "Xid 79 on 3", NOW, config.policy))
        agent.set(node_watch.read_record(config))
        assert _ask(agent, "127.0.0.2") == "0% down\n" and not agent.all_heard_down()  # .3 has not heard it
        engines = iter([2.0, 0.0, 1.0, 0.0, 0.0, 0.0, 9.0])  # a request the engine counts late resets the count
        reads: list[float] = []
        monkeypatch.setattr(node_watch, "requests_running", lambda urls: reads.append(next(engines)) or reads[-1])
        waits: list[float] = []

        def sleep(seconds: float) -> None:
            waits.append(seconds)
            if len(waits) == 3:
                _ask(agent, "127.0.0.3")  # the other router's next check

        monkeypatch.setattr(node_watch.time, "sleep", sleep)
        node_watch.drain(config, agent)
        assert agent.all_heard_down() and waits[:3] == [0.2, 0.2, 0.2]  # waited for .3's check, and no longer
        assert reads == [2.0, 0.0, 1.0, 0.0, 0.0, 0.0]  # then three empty reads in a row
    finally:
        agent.server.shutdown()
        agent.server.server_close()


def test_the_kernel_log_gives_only_new_whole_lines(tmp_path: Path) -> None:
    log = tmp_path / "kmsg"
    log.write_text("NVRM: Xid (PCI:0000:18:00): 79, old news\n")
    kernel = node_watch.KernelLog(log)
    assert kernel.lines() == []  # what was there before the watch started was acted on then
    with log.open("a") as out:
        out.write("NVRM: Xid (PCI:0000:18:00): 48, pid=1, DBE\nhalf a li")
    assert kernel.lines() == ["NVRM: Xid (PCI:0000:18:00): 48, pid=1, DBE"]
    with log.open("a") as out:
        out.write("ne\n")
    assert kernel.lines() == ["half a line"]
    log.write_text("after a rotation\n")  # truncated: read from its start
    assert kernel.lines() == ["after a rotation"]
    assert list(kernel.recent)[-1] == "after a rotation"


def test_a_kernel_log_that_appears_later_is_read_from_its_start(tmp_path: Path) -> None:
    kernel = node_watch.KernelLog(tmp_path / "kmsg")
    assert kernel.lines() == []
    (tmp_path / "kmsg").write_text("NVRM: Xid (PCI:0000:18:00): 79, first\n")
    assert kernel.lines() == ["NVRM: Xid (PCI:0000:18:00): 79, first"]


def _finding(code: int) -> findings.Finding:
    xid = findings.Xid("0000:18:00", code, "text")
    found = findings.Bursts(CATALOG).see(xid, 0.0)
    assert found is not None
    return found


def test_findings_move_the_record_as_the_catalog_says(tmp_path: Path) -> None:
    config = _config(tmp_path)
    _serving(config)
    node_watch.apply_finding(config, _finding(13))  # recorded
    assert node_watch.read_record(config)["state"] == "serving"
    node_watch.apply_finding(config, _finding(92))  # suspect, still serving
    assert node_watch.read_record(config)["state"] == "suspect"
    node_watch.apply_finding(config, _finding(79))
    record = node_watch.read_record(config)
    assert record["state"] == "quarantined" and record["history"][-1]["why"] == "Xid 79 on 0000:18:00"
    assert [f["code"] for f in record["findings"]] == [13, 92, 79]
    node_watch.apply_finding(config, _finding(48))  # already out: kept, no second quarantine
    assert len(node_watch.read_record(config)["quarantines"]) == 1
    assert (tmp_path / "state" / "state.json").stat().st_mode & 0o777 == 0o644
    assert json.loads((tmp_path / "state" / "summary.json").read_text()) == {"state": "quarantined", "quarantines": 1,
                                                                                 "requested": False}


def test_people_move_the_node_through_the_same_rules(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _config(tmp_path)
    _serving(config)
    args = ["--config", str(tmp_path / "lifecycle.json")]
    why = b"fan noise".hex()
    assert node_watch.main(["move", *args, "--to", "retired", "--why-hex", why, "--by", "ops"]) == 0
    assert json.loads(capsys.readouterr().out)["history"][-1]["by"] == "ops"
    assert node_watch.main(["move", *args, "--to", "burn-in", "--why", "repaired"]) == 2
    assert capsys.readouterr().err == ("node watch: gpu-a01: cannot move from retired to burn-in: from retired the"
                                       " moves are none (with --force: burn-in)\n")
    assert node_watch.main(["move", *args, "--to", "burn-in", "--why", "repaired", "--force"]) == 0
    capsys.readouterr()
    assert node_watch.main(["move", *args, "--to", "serving", "--why", "a\nb"]) == 2
    assert "1 to 200 printable characters" in capsys.readouterr().err
    assert node_watch.main(["move", *args, "--to", "serving", "--why-hex", "zz"]) == 2


def test_a_full_burn_in_on_request_stops_the_replicas_runs_full_and_brings_the_node_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = _config(tmp_path)
    _serving(config)
    ran: list[list[str]] = []
    tiers: list[str] = []
    stopping = ["vllm@lab_single-0.service"]  # still deactivating once, when the burn-in is due

    def units(states: str = "active") -> list[str]:
        if "deactivating" in states:
            return [stopping.pop()] if stopping else []
        return ["vllm@lab_single-0.service"]

    monkeypatch.setattr(node_watch, "replica_units", units)
    monkeypatch.setattr(node_watch.time, "sleep", lambda s: None)
    monkeypatch.setattr(node_watch, "requests_running", lambda urls: 0.0)
    monkeypatch.setattr(node_watch, "_run", lambda argv, timeout: (ran.append(argv), (0, "", ""))[1])
    monkeypatch.setattr(node_watch, "keep_evidence", lambda *args: str(tmp_path / "evidence" / "1"))
    monkeypatch.setattr(node_watch, "run_burn_in", lambda config, tier: (
        tiers.append(tier), {"tier": tier, "passed": True, "seconds": 1.0, "checks": []})[1])
    assert node_watch.main(["move", "--config", str(tmp_path / "lifecycle.json"), "--to", "burn-in",
                            "--why", "after the BMC update"]) == 0
    assert node_watch.agent_reply(node_watch.read_record(config), NOW) == "0% down\n"
    node_watch.reconcile(config, None)
    assert ["systemctl", "stop", "--no-block", "--", "vllm@lab_single-0.service"] in ran and tiers == ["full"]
    assert stopping == []  # the burn-in waited for the stopping unit to end
    record = node_watch.read_record(config)
    assert (record["state"], record["requested"], record["quarantines"]) == ("serving", False, [])
    node_watch.reconcile(config, None)  # serving again: its units start, and no other burn-in runs
    assert ["systemctl", "start", "--no-block", "--", "vllm@lab_single-0.service"] in ran and tiers == ["full"]
    assert not [argv for argv in ran if "gpufleet-capture@node-quarantined.service" in argv]  # not a quarantine


def _stand_ins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, passed: bool) -> tuple[list[list[str]], list[str]]:
    """systemctl as the watch runs it (a stop stops the one replica unit), no drain wait, evidence kept in one
    folder, and each burn-in's verdict ``passed``: the commands run, and the tiers burnt in."""
    running = ["vllm@lab_single-0.service"]
    ran: list[list[str]] = []
    tiers: list[str] = []

    def run(argv: list[str], timeout: float) -> tuple[int, str, str]:
        ran.append(argv)
        if argv[:2] == ["systemctl", "stop"]:
            running.clear()
        return 0, "", ""

    monkeypatch.setattr(node_watch, "replica_units", lambda states="active": list(running))
    monkeypatch.setattr(node_watch, "STOP_WAIT_S", 0.0)  # the burn-in's wait for the units to end: not here
    monkeypatch.setattr(node_watch.time, "sleep", lambda s: None)
    monkeypatch.setattr(node_watch, "requests_running", lambda urls: 0.0)
    monkeypatch.setattr(node_watch, "_run", run)
    monkeypatch.setattr(node_watch, "keep_evidence", lambda *args: str(tmp_path / "evidence" / "1"))
    monkeypatch.setattr(node_watch, "run_burn_in", lambda config, tier: (
        tiers.append(tier), {"tier": tier, "passed": passed, "seconds": 1.0, "checks": []})[1])
    return ran, tiers


@pytest.mark.parametrize(("unit", "started"), [(QUARANTINE_CAPTURE, True), ("vllm@x.service; reboot", False),
                                               (None, False)])
def test_a_quarantined_node_starts_its_capture_with_its_evidence(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, unit: str | None, started: bool) -> None:
    """What the node logged over the last hour is kept on it when it is quarantined (the capture unit, a node
    tool's archive), beside the evidence folder; a configured name that is not a capture unit is never started."""
    config = _config(tmp_path, capture_unit=unit)
    _serving(config)
    ran, _ = _stand_ins(monkeypatch, tmp_path, passed=False)
    assert node_watch.main(["move", "--config", str(tmp_path / "lifecycle.json"), "--to", "quarantined",
                            "--why", "fans"]) == 0
    node_watch.reconcile(config, None)
    captured = ["systemctl", "start", "--no-block", "--", QUARANTINE_CAPTURE]
    assert (captured in ran) == started, ran
    if started:
        assert ran.index(captured) < ran.index(["systemctl", "stop", "--no-block", "--", "vllm@lab_single-0.service"])


def test_the_burn_in_runs_as_its_unit_and_is_judged_by_the_verdict_it_wrote(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = _config(tmp_path)
    (tmp_path / "burn-in").mkdir()
    stale = tmp_path / "burn-in" / "full.json"
    stale.write_text(json.dumps({"tier": "full", "passed": True}))  # the last run's: never read again (the watch
    os.utime(stale, (0, 0))  # cannot remove it: its sandbox has the folder read-only; it reads only what is newer)
    started: list[list[str]] = []

    def unit_writes(verdict: dict[str, Any] | None) -> Any:
        def run(argv: list[str], timeout: float) -> tuple[int, str, str]:
            started.append(argv)
            if argv[:2] == ["systemctl", "start"] and verdict is not None:
                stale.write_text(json.dumps(verdict))
            return (0, "", "") if verdict is not None else (1, "", "Job failed. See journalctl -xeu ...")
        return run

    failed = {"tier": "full", "passed": False, "checks": [{"check": "dcgm-r3", "status": "fail", "gpu": 3}]}
    monkeypatch.setattr(node_watch, "_run", unit_writes(failed))
    assert node_watch.run_burn_in(config, "full") == failed
    assert started[0] == ["systemctl", "start", "--", "gpufleet-burn-in-full.service"]
    os.utime(stale, (0, 0))
    monkeypatch.setattr(node_watch, "_run", unit_writes(None))  # the unit wrote nothing: a failed verdict says so
    verdict = node_watch.run_burn_in(config, "full")
    assert verdict["passed"] is False and verdict["checks"][0]["evidence"]["unit"] == "gpufleet-burn-in-full.service"


def test_prometheus_gets_the_state_and_the_failed_checks(tmp_path: Path) -> None:
    config = _config(tmp_path)
    _serving(config)
    verdict = {"tier": "quick", "passed": False, "seconds": 3.0,
               "checks": [{"check": "dcgm-r2", "status": "fail", "gpu": 3, "evidence": {"test": "memory"}}]}
    with node_watch.locked(config) as record:
        node_watch.replace(record, node_state.after_burn_in(record, verdict, NOW, config.policy))
    node_watch.export(config, node_watch.read_record(config))
    text = (tmp_path / "textfile" / "gpufleet-node.prom").read_text()
    assert 'gpufleet_node_state{state="quarantined"} 1\n' in text and 'gpufleet_node_state{state="serving"} 0\n' in text
    assert 'gpufleet_burn_in_passed{tier="quick"} 0\n' in text
    assert 'gpufleet_burn_in_failed_check{check="dcgm-r2",gpu="3"} 1\n' in text
    assert "gpufleet_node_quarantines 1\n" in text


@pytest.mark.parametrize(("text", "needed"), [
    (None, True), ("", False), ("not json", False),
    ('{"state": "new"}', True), ('{"state": "burn-in", "quarantines": []}', True),
    ('{"state": "burn-in", "quarantines": ["2026-11-27T12:00:00Z"]}', False),
    ('{"state": "burn-in", "quarantines": 0, "requested": true}', False),
    ('{"state": "serving"}', False), ('{"state": "suspect"}', False), ('{"state": "quarantined"}', False),
    ('{"state": "retired"}', False)])
def test_a_node_is_admitted_once_by_the_deploy(text: str | None, needed: bool) -> None:
    """From the record's summary, which stays small (the record itself grows past what a deploy reads of a file)."""
    assert needs_admission(text) is needed


def test_the_gpu_watchs_samples_make_a_throttled_gpu_suspect(tmp_path: Path) -> None:
    """The samples gpu_watch.py keeps (``gpu_samples``), read as the watch reads them every 30 s: the finding names the
    GPU, and the node stays in service (suspect); a node with no samples yet finds nothing."""
    config = _config(tmp_path, gpu_samples=str(tmp_path / "run" / "gpu-samples.json"))
    _serving(config)
    trends = findings.Trends(config.catalog)
    assert node_watch.gpu_samples(config) == [] and trends.see(node_watch.gpu_samples(config), 1000.0) == []
    throttled = {"gpu": 2, "pci": "00000000:2A:00.0", "events": ["hw_thermal_slowdown"], "pcie": None, "nvlinks": 0,
                 "nvlinks_down": 0}
    config.gpu_samples.parent.mkdir()
    config.gpu_samples.write_text(json.dumps([{"at": 1000.0 + 30 * i, "gpus": [throttled]} for i in range(5)]))
    for finding in trends.see(node_watch.gpu_samples(config), 1130.0):
        node_watch.apply_finding(config, finding)
    record = node_watch.read_record(config)
    assert record["state"] == "suspect" and record["history"][-1]["why"] == "throttle_trend on 00000000:2A:00.0"
    assert record["findings"][-1]["evidence"] == {"samples": 5, "showing": 5, "window_s": 600.0}


def test_a_quarantine_and_readmission_faster_than_the_watch_still_stops_the_replicas_before_the_burn_in(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Seen on the lab: ``gpufleet nodes quarantine`` then ``readmit`` within a second, the watch first saw the node in
    burn-in with its replica running; it waited for the unit to stop, and nobody stopped it."""
    config = _config(tmp_path)
    _serving(config)
    ran, tiers = _stand_ins(monkeypatch, tmp_path, passed=True)
    args = ["--config", str(tmp_path / "lifecycle.json")]
    assert node_watch.main(["move", *args, "--to", "quarantined", "--why", "fans"]) == 0
    assert node_watch.main(["move", *args, "--to", "burn-in", "--why", "fans replaced"]) == 0
    node_watch.reconcile(config, None)
    assert ["systemctl", "stop", "--no-block", "--", "vllm@lab_single-0.service"] in ran and tiers == ["full"]
    assert node_watch.read_record(config)["stopped_units"] == ["vllm@lab_single-0.service"]


def test_a_node_that_lost_its_record_gets_the_fleets_copy_back_and_never_a_shorter_one(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``restore`` takes only a whole, well-typed record of this node (one line and exit 2 otherwise, the record
    unchanged), replaces only a shorter history or one that cannot be read, and removes the file it was given."""
    config = _config(tmp_path)
    kept = node_state.move(node_state.new_record("gpu-a01", NOW), "burn-in", "first seen", NOW)
    kept = node_state.quarantine(node_state.move(kept, "serving", "passed", NOW), "Xid 79 on 3b:00", NOW,
                                 config.policy)
    given = tmp_path / "restore.json"
    args = ["restore", "--config", str(tmp_path / "lifecycle.json"), "--record-file", str(given)]
    last = kept["history"][-1]
    for bad in ("{not json", "[" * 100000 + "]" * 100000, json.dumps({**kept, "host": "gpu-a02"}),
                json.dumps({**kept, "state": "lost"}), json.dumps({**kept, "since": "not-a-time"}),
                json.dumps({**kept, "quarantines": "abc"}), json.dumps({**kept, "clean_passes": True}),
                json.dumps({**kept, "history": [1, 2, 3, 4]}), json.dumps({**kept, "gpus": "x"}),
                json.dumps({**kept, "history": [*kept["history"], {**last, "why": "a\u202eb"}]}),
                json.dumps({**kept, "history": [*kept["history"], {**last, "at": "~~~~"}]}),
                json.dumps(kept).replace('"clean_passes": 0', '"clean_passes": NaN')):
        given.write_text(bad)
        assert node_watch.main(args) == 2, bad[:80]
        assert capsys.readouterr().err.startswith("node watch: ") and not given.exists()
        assert node_watch.read_record(config)["state"] == "new"
    os.mkfifo(given)
    assert node_watch.main(args) == 2 and "expected a regular file" in capsys.readouterr().err
    given.unlink()  # a FIFO is never removed by the tool: only the regular file it was given
    given.write_text(json.dumps(kept))
    assert node_watch.main(args) == 0 and not given.exists()
    assert node_watch.read_record(config) == kept and "restored from the fleet's copy: quarantined" in \
        capsys.readouterr().out
    shorter = node_state.move(node_state.new_record("gpu-a01", NOW), "burn-in", "first seen", NOW)
    given.write_text(json.dumps(shorter))
    assert node_watch.main(args) == 0
    assert node_watch.read_record(config) == kept  # the node's own holds more: kept
    config.state_file.write_text("{torn")  # its own cannot be read: the copy replaces it, the torn one kept aside
    assert node_watch.main(["show", *args[1:3]]) == 2 and "node watch: " in capsys.readouterr().err
    given.write_text(json.dumps(kept))
    assert node_watch.main(args) == 0 and node_watch.read_record(config) == kept
    assert config.state_file.with_name("state.json.corrupt").read_text() == "{torn"
