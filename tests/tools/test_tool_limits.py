"""The limits ``gpufleet check`` holds values to (:mod:`gpufleet.values.limits`) are the tools' own: systemd-analyze,
promtool, amtool and haproxy accept a value at the limit and refuse one past it, and gpufleet agrees with them on names
and zero intervals."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from gpufleet.values import limits
from tests.conftest import host_tool


def _ok(argv: list[str]) -> bool:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60).returncode == 0


def test_systemd_parses_the_longest_time_span_and_refuses_one_second_more() -> None:
    analyze = host_tool("systemd-analyze", "systemd")
    assert _ok([analyze, "timespan", f"{limits.SYSTEMD_MAX_SECONDS}s"])
    assert not _ok([analyze, "timespan", f"{limits.SYSTEMD_MAX_SECONDS + 1}s"])
    assert limits.systemd_seconds(limits.SYSTEMD_MAX_SECONDS) is None
    assert limits.systemd_seconds(limits.SYSTEMD_MAX_SECONDS, 1) is not None


@pytest.mark.parametrize(("length", "ok"), [(limits.UNIT_NAME_MAX, True), (limits.UNIT_NAME_MAX + 1, False)])
def test_systemd_takes_a_unit_name_up_to_the_limit(tmp_path: Path, length: int, ok: bool) -> None:
    analyze = host_tool("systemd-analyze", "systemd")
    name = "a" * (length - len(".service")) + ".service"
    try:
        (tmp_path / name).write_text("[Service]\nExecStart=/bin/true\n")
    except OSError:  # the file system's own name limit: systemd never sees it
        assert not ok
        return
    assert _ok([analyze, "verify", str(tmp_path / name)]) is ok


@pytest.mark.parametrize(("number", "ok"), [(limits.PROMQL_MAX_INT, True), (10**400, False)])
def test_promtool_reads_an_alert_threshold_up_to_the_limit(tmp_path: Path, number: int, ok: bool) -> None:
    promtool = host_tool("promtool", "prometheus")
    rules = tmp_path / "rules.yml"
    rules.write_text(f"groups:\n- name: g\n  rules:\n  - alert: A\n    expr: vector(1) > {number}\n")
    assert _ok([promtool, "check", "rules", str(rules)]) is ok
    assert (limits.promql_int(number) is None) is ok


@pytest.mark.parametrize("pool", ["pool", "Pool_2", "a.b", "a:b", "pööl", "p\u0430ol", "pool$"])
def test_haproxy_and_gpufleet_agree_on_a_pool_name(tmp_path: Path, pool: str) -> None:
    haproxy = host_tool("haproxy", "haproxy")
    server = f"{pool}-gpu-a01-0"
    config = tmp_path / "haproxy.cfg"
    config.write_text("defaults\n    mode http\n    timeout connect 1s\n    timeout client 1s\n    timeout server 1s\n"
                      f"frontend f\n    bind 127.0.0.1:18080\n    default_backend b\nbackend b\n"
                      f"    server {server} 127.0.0.1:9\n")
    accepted = _ok([haproxy, "-c", "-q", "-f", str(config)])
    assert (limits.replica_name(pool, server) is None) is accepted


def _alertmanager_yml(path: Path, wait: int, interval: int, repeat: int) -> Path:
    path.write_text(f"route:\n  receiver: r\n  group_wait: {wait}s\n  group_interval: {interval}s\n"
                    f"  repeat_interval: {repeat}s\nreceivers:\n- name: r\n")
    return path


@pytest.mark.parametrize(("seconds", "ok"), [(limits.DURATION_MAX_SECONDS, True),
                                             (limits.DURATION_MAX_SECONDS + 1, False)])
def test_amtool_takes_durations_up_to_the_limit(tmp_path: Path, seconds: int, ok: bool) -> None:
    amtool = host_tool("amtool", "prometheus-alertmanager")
    for wait, interval, repeat in ((seconds, 1, 1), (0, seconds, seconds)):
        config = _alertmanager_yml(tmp_path / "alertmanager.yml", wait, interval, repeat)
        assert _ok([amtool, "check-config", str(config)]) is ok
    assert (limits.alertmanager_wait(seconds) is None) is ok
    assert (limits.alertmanager_interval(seconds) is None) is ok


@pytest.mark.parametrize(("wait", "interval", "repeat", "ok"), [
    (0, 1, 1, True), (0, 0, 60, False), (0, 60, 0, False), (30, 86400, 60, True),  # repeat below interval: taken
])
def test_amtool_refuses_a_zero_interval_and_gpufleet_too(tmp_path: Path, wait: int, interval: int, repeat: int,
                                                         ok: bool) -> None:
    amtool = host_tool("amtool", "prometheus-alertmanager")
    config = _alertmanager_yml(tmp_path / "alertmanager.yml", wait, interval, repeat)
    assert _ok([amtool, "check-config", str(config)]) is ok
    found = [limits.alertmanager_wait(wait), *map(limits.alertmanager_interval, (interval, repeat))]
    assert (found == [None, None, None]) is ok
