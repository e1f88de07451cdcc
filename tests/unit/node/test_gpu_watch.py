"""The GPU health watch (``gpufleet/node/gpu_watch.py``, role gpu_watch) without a node.

``tests/data/gpu_watch/<case>.json``: the gate's ``failures`` ([]: the node passes), the replica ``units``
systemd reports (name -> [ActiveState, UnitFileState]), the ``marker`` before (null: none) and the verbs systemctl
``refuse``s; then what the watch must do: the ``systemctl`` calls that change something, in order, the
``marker_after``, the ``log`` lines and the exit ``status``. The real gate on the NVML simulator, and the script run
once as the timer runs it: tests/tools/test_gpu_watch_on_the_simulator.py.
"""

from __future__ import annotations

import json
import re
import stat
from pathlib import Path
from typing import Any

import pytest

from gpufleet import node_paths as paths
from gpufleet.node import gpu_watch
from gpufleet.operations import files, node, systemd
from gpufleet.templates import render
from roles import gpu_watch as role
from tests.conftest import DATA
from tests.unit.gpu_watch_run import FakeSystemctl

CASES = sorted((DATA / "gpu_watch").glob("*.json"))


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.stem)
def test_decision(path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    case = json.loads(path.read_text())
    marker = tmp_path / "run" / "gpufleet" / "gpu-gate-failed"
    if case["marker"] is not None:
        marker.parent.mkdir(parents=True)
        marker.write_text(json.dumps(case["marker"]))
    fake = FakeSystemctl(case["units"], tuple(case.get("refuse", ())), marker)
    status = gpu_watch.apply("gpu-a01", case["failures"], gpu_watch.Systemctl(fake.run), marker)
    assert fake.calls == case["systemctl"]
    assert capsys.readouterr().out.splitlines() == case["log"]
    assert status == case["status"]
    if case["marker_after"] is None:
        assert not marker.exists()
    else:
        assert json.loads(marker.read_text()) == case["marker_after"]
        assert stat.S_IMODE(marker.stat().st_mode) == 0o644


def test_an_unreadable_marker_records_no_unit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    marker = tmp_path / "gpu-gate-failed"
    marker.write_text("{not json")
    fake = FakeSystemctl({"vllm@pool-0.service": ["inactive", "enabled"]})
    assert gpu_watch.apply("gpu-a01", [], gpu_watch.Systemctl(fake.run), marker) == 0
    assert fake.calls == [] and not marker.exists()
    assert capsys.readouterr().out.splitlines()[-1] == "gpu-a01: passes its GPU health gate again; starting nothing"


# --- a gate that gives no verdict (the gate on the simulator: tests/tools/test_gpu_watch_on_the_simulator.py) ---

def test_a_probe_that_hangs_fails_the_node(tmp_path: Path) -> None:
    hung = tmp_path / "nvml_probe.py"
    hung.write_text("import time\ntime.sleep(30)\n")
    assert gpu_watch.judge("policy.json", timeout=0.5, probe=hung) == (None, [
        {"rule": "probe", "gpu": None,
         "evidence": "the GPU probe gave no verdict within 0.5 s (NVML can hang on a lost GPU)"}], [])


def test_each_run_keeps_its_sample_and_only_the_last_ones(tmp_path: Path) -> None:
    """The gate's sample (health_rules.link_sample) goes to the samples the node watch's trends read."""
    probe = tmp_path / "nvml_probe.py"
    sample = [{"gpu": 0, "pci": "00000000:18:00.0", "events": ["sw_thermal_slowdown"], "pcie": None, "nvlinks": 0,
               "nvlinks_down": 0}]
    verdict = {"hostname": "gpu-a01", "failures": [], "sample": sample}
    probe.write_text(f"import json\nprint(json.dumps({verdict!r}))\n")
    assert gpu_watch.judge("policy.json", probe=probe) == ("gpu-a01", [], sample)
    kept = tmp_path / "run" / "gpu-samples.json"
    kept.parent.mkdir()
    kept.write_text("{not json")  # unreadable: a new list
    for at in range(5):
        gpu_watch.keep_sample(kept, sample, 1000.0 + at, kept=3)
    assert [s["at"] for s in json.loads(kept.read_text())] == [1002.0, 1003.0, 1004.0]
    assert json.loads(kept.read_text())[-1]["gpus"] == sample and stat.S_IMODE(kept.stat().st_mode) == 0o644


@pytest.mark.parametrize(("script", "status", "message"), [
    ("raise SystemExit(2)", 2, "the GPU gate gave no verdict (exit 2)"),  # a policy it cannot read
    ("raise RuntimeError('boom')", 1, "RuntimeError: boom"),  # a crash is no verdict on the GPUs
    ("print('{}')\nraise SystemExit(1)", 1, "the GPU gate printed no verdict"),
    ("print('{\"failures\": []}')\nraise SystemExit(1)", 1, "exit status 1 contradicts its verdict"),
])
def test_a_probe_without_a_verdict_changes_nothing(tmp_path: Path, script: str, status: int, message: str) -> None:
    broken = tmp_path / "nvml_probe.py"
    broken.write_text(script + "\n")
    with pytest.raises(gpu_watch.Unjudged, match=re.escape(message)) as raised:
        gpu_watch.judge("policy.json", probe=broken)
    assert raised.value.status == status


# --- the units and the role ----------------------------------------------------------------------------------------

def _directives(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]


def test_the_service_runs_the_watch_as_root_once_per_timer_tick() -> None:
    lines = _directives(render("gpu_watch/gpufleet-gpu-watch.service.j2", **role.service_values()))
    start = (f"/usr/bin/python3 {paths.node_tool('gpu_watch.py')} --policy {paths.GATE_POLICY}"
             f" --marker {paths.GPU_WATCH_MARKER} --samples {paths.GPU_SAMPLES}")
    assert f"ExecStart={start}" in lines
    for wanted in ("Type=oneshot", f"EnvironmentFile=-{paths.NODE_ENV}",
                   "RuntimeDirectory=gpufleet", "RuntimeDirectoryMode=0755", "RuntimeDirectoryPreserve=yes",
                   "IPAddressDeny=any", "IPAddressAllow=localhost", "DeviceAllow=char-nvidia-frontend rw"):
        assert wanted in lines, wanted
    assert paths.GPU_WATCH_MARKER == "/run/gpufleet/gpu-gate-failed"  # inside its RuntimeDirectory=, as are
    assert paths.GPU_SAMPLES == "/run/gpufleet/gpu-samples.json"  # its samples
    assert not any(line.startswith(("User=", "Restart=", "WantedBy=", "[Install]")) for line in lines)


@pytest.mark.parametrize("interval", [5, 30, 86400])
def test_the_timer_fires_every_interval(interval: int) -> None:
    lines = _directives(render("gpu_watch/gpufleet-gpu-watch.timer.j2", **role.timer_values(interval)))
    assert lines[lines.index("[Timer]"):] == [
        "[Timer]", f"Unit={paths.GPU_WATCH_SERVICE}", f"OnActiveSec={interval}s", f"OnUnitActiveSec={interval}s",
        "AccuracySec=1s", "[Install]", "WantedBy=timers.target"]


class _Meta:
    def did_change(self) -> bool:
        return False


@pytest.mark.parametrize(("interval", "expected"), [
    (30, [("files.file", role.SERVICE_FILE), ("files.file", role.TIMER_FILE), ("systemd.daemon_reload", None),
          ("systemd.restart", paths.GPU_WATCH_TIMER), ("systemd.service", (paths.GPU_WATCH_TIMER, True, True))]),
    (0, [("files.file", role.SERVICE_FILE), ("systemd.service", (paths.GPU_WATCH_TIMER, False, False)),
         ("files.absent", role.TIMER_FILE), ("files.absent", paths.GPU_WATCH_MARKER),
         ("files.absent", paths.GPU_SAMPLES), ("systemd.daemon_reload", None)]),
])
def test_the_role_turns_the_timer_on_or_off(monkeypatch: pytest.MonkeyPatch, interval: int,
                                            expected: list[tuple[str, object]]) -> None:
    added: list[tuple[str, object]] = []

    def operation(kind: str) -> Any:
        def add(name: str, **kwargs: Any) -> _Meta:
            what = kwargs.get("dest") or kwargs.get("path")
            if kind == "systemd.service":
                what = (kwargs["unit"], kwargs["running"], kwargs["enabled"])
            elif kind == "systemd.restart":
                what = kwargs["unit"]
            added.append((kind, what))
            return _Meta()
        return add

    monkeypatch.setattr(role, "host_config", lambda: type("Cfg", (), {"gpu_watch_interval_s": interval})())
    monkeypatch.setattr(node, "observe", lambda **kwargs: None)
    for kind in ("files.file", "files.absent", "systemd.daemon_reload", "systemd.restart", "systemd.service"):
        module, name = kind.split(".")
        monkeypatch.setattr({"files": files, "systemd": systemd}[module], name, operation(kind))
    role.gpu_watch.__wrapped__()  # type: ignore[attr-defined]
    assert added == expected
