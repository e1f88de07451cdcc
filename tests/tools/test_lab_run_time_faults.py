"""Faults raised and cleared on a running simulated node, as monitoring sees them through the dcgm-exporter double.

The compiled NVML simulator answers; the double runs as a process on a loopback port while the node's profile is
replaced under it, as a lab test replaces /etc/gpufleet/nvml-sim-profile on a lab node.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from gpufleet_lab import nvml_sim
from gpufleet_lab.double_programs import dcgm_exporter
from gpufleet_lab.sim_profile import NVLINK_ERRORS, Fault, FaultError, apply_fault, write_sim_profile

from gpufleet import templates
from gpufleet.gpu.profiles import profile_facts
from gpufleet.gpu.report import parse_facts
from tests.loopback_http import free_port, http_get
from tests.nvml_probe_run import run_probe
from tests.polling import wait_for_port

PROFILE, HOST = "8xH100-SXM", "lab1"
EXPORTER = Path(dcgm_exporter.__file__)
NVLINK_FIELDS = [f"DCGM_FI_DEV_NVLINK_{kind}_ERROR_COUNT_TOTAL" for kind in ("CRC_FLIT", "CRC_DATA", "REPLAY",
                                                                           "RECOVERY")]
WINDOW_MS = 3000  # the double's XID window: long enough for the scrapes between raising and clearing a fault

Scrape = dict[str, dict[tuple[str, str], float]]  # metric -> (gpu, xid label or "") -> value


@contextmanager
def _exporter(sim_lib: Path, profile: Path, tmp_path: Path) -> Iterator[str]:
    """The exporter double with gpufleet's counters (NVLink on) reading the simulated node; yields its metrics URL."""
    counters = tmp_path / "counters.csv"
    counters.write_text(templates.render("dcgm_exporter/counters.csv.j2", nvlink=True))
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(EXPORTER), "-f", str(counters), "-a", f"127.0.0.1:{port}",
                             "-x", str(WINDOW_MS)], env=nvml_sim.sim_environ(sim_lib, profile),
                            stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port)
        yield f"http://127.0.0.1:{port}/metrics"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _scrape(url: str) -> Scrape:
    found: Scrape = {}
    for line in http_get(url).decode().splitlines():
        if line.startswith("DCGM_"):
            name, rest = line.split("{", 1)
            labels_text, value = rest.rsplit("} ", 1)
            labels = dict(re.findall(r'(\w+)="([^"]*)"', labels_text))
            found.setdefault(name, {})[labels["gpu"], labels.get("xid", "")] = float(value)
    return found


def _gpus(scrape: Scrape) -> list[int]:
    """The GPUs the node reports, as recording rule node:dcgm_gpus:count counts them."""
    return sorted(int(gpu) for gpu, _ in scrape["DCGM_FI_DEV_GPU_TEMP"])


def _xids(scrape: Scrape) -> dict[tuple[int, int], float]:
    """(gpu, xid) -> count within the window, as alert GpuCriticalXid reads them."""
    return {(int(gpu), int(xid)): n for (gpu, xid), n in scrape["DCGM_EXP_XID_ERRORS_COUNT"].items() if xid}


def _nvlink_errors(scrape: Scrape) -> dict[int, list[float]]:
    """gpu -> its four NVLink error counters (CRC flit, CRC data, replay, recovery), for GPUs with any."""
    errors = {int(gpu): [scrape[field][gpu, ""] for field in NVLINK_FIELDS] for gpu, _ in scrape[NVLINK_FIELDS[0]]}
    return {gpu: counts for gpu, counts in errors.items() if any(counts)}


def test_faults_raised_at_run_time_show_in_the_exporter_and_clear(sim_lib: Path, tmp_path: Path) -> None:
    profile = tmp_path / "nvml-sim-profile"
    write_sim_profile(profile, PROFILE, hostname=HOST)
    with _exporter(sim_lib, profile, tmp_path) as url:
        healthy = _scrape(url)
        assert _gpus(healthy) == list(range(8))
        assert _xids(healthy) == {} and _nvlink_errors(healthy) == {}
        assert list(healthy["DCGM_EXP_XID_ERRORS_COUNT"].values()) == [0] * 8

        raised = time.monotonic()
        write_sim_profile(profile, PROFILE, [("xid", 2, 79), ("nvlink_errors", 1), ("gpu_lost", 5)], hostname=HOST)
        faulty = _scrape(url)
        assert _gpus(faulty) == [0, 1, 2, 3, 4, 6, 7]  # the lost GPU: one fewer
        assert not any(gpu == "5" for samples in faulty.values() for gpu, _ in samples)
        assert _xids(faulty) == {(2, 79): 1}
        assert faulty["DCGM_FI_DEV_XID_ERRORS"]["2", ""] == 79
        assert _nvlink_errors(faulty) == {1: [18 * NVLINK_ERRORS] * 4}  # 18 active links
        assert _xids(_scrape(url)) == {(2, 79): 1}  # an XID is delivered once

        write_sim_profile(profile, PROFILE, hostname=HOST)
        restored = _scrape(url)
        assert time.monotonic() - raised < WINDOW_MS / 1000, "too slow to see the XID within its window"
        assert _gpus(restored) == list(range(8)) and _nvlink_errors(restored) == {}
        assert _xids(restored) == {(2, 79): 1}  # counted until the window passes
        while _xids(cleared := _scrape(url)):
            assert time.monotonic() - raised < WINDOW_MS / 1000 + 10, "the XID never left the window"
            time.sleep(0.2)
        assert time.monotonic() - raised >= WINDOW_MS / 1000
        assert list(cleared["DCGM_EXP_XID_ERRORS_COUNT"].values()) == [0] * 8

        write_sim_profile(profile, PROFILE, [("xid", 2, 79), ("xid", 2, 48)], hostname=HOST)
        assert _xids(_scrape(url)) == {(2, 48): 1, (2, 79): 1}  # raised again after it was cleared: counted again


def test_a_gpu_lost_before_the_exporter_starts_is_left_out(sim_lib: Path, tmp_path: Path) -> None:
    profile = tmp_path / "nvml-sim-profile"
    write_sim_profile(profile, PROFILE, [("gpu_lost", 0), ("xid", 3, 79)], hostname=HOST)
    with _exporter(sim_lib, profile, tmp_path) as url:
        scrape = _scrape(url)
    assert _gpus(scrape) == list(range(1, 8))
    assert _xids(scrape) == {}  # XIDs from before the exporter started are history, not events


def test_faults_seen_only_by_monitoring_leave_the_probed_facts_alone(sim_lib: Path, tmp_path: Path) -> None:
    profile = tmp_path / "nvml-sim-profile"
    facts = write_sim_profile(profile, PROFILE, [("xid", 2, 79), ("xid", 2, 48), ("nvlink_errors", 2, 5)])
    assert facts == profile_facts(PROFILE, facts.hostname)
    text = profile.read_text()
    gpu2 = text[text.index("gpu 2\n"):text.index("gpu 3\n")]
    assert "xids 79 48\n" in gpu2 and "nvlink_errors 17 5 5 5 5\n" in gpu2 and gpu2.count("nvlink_errors") == 18
    assert text.count("xids") == 1 and text.count("nvlink_errors") == 18
    result = run_probe(nvml_sim.sim_environ(sim_lib, profile))
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert parse_facts(json.loads(result.stdout), "probe") == facts


SIM_EVENTS = """
import os, sys, time
import pynvml as nv
from tests.conftest import DATA
nv.nvmlInit()
handle = nv.nvmlDeviceGetHandleByIndex(2)
assert nv.nvmlDeviceGetSupportedEventTypes(handle) == nv.nvmlEventTypeXidCriticalError
events = nv.nvmlEventSetCreate()
nv.nvmlDeviceRegisterEvents(handle, nv.nvmlEventTypeXidCriticalError, events)
started = time.monotonic()
try:
    nv.nvmlEventSetWait_v2(events, 300)
    raise SystemExit("an event from a healthy profile")
except nv.NVMLError_Timeout:
    assert time.monotonic() - started >= 0.29
os.replace(sys.argv[1], os.environ["GPUFLEET_NVML_SIM_PROFILE"])
event = nv.nvmlEventSetWait_v2(events, 5000)
assert nv.nvmlDeviceGetIndex(event.device) == 2, event
assert (event.eventType, event.eventData) == (nv.nvmlEventTypeXidCriticalError, 94), event
assert nv.nvmlDeviceGetNvLinkErrorCounter(handle, 0, nv.NVML_NVLINK_ERROR_DL_REPLAY) == 0
try:
    nv.nvmlDeviceGetNvLinkErrorCounter(handle, 0, nv.NVML_NVLINK_ERROR_DL_ECC_DATA)
    raise SystemExit("an NVLink ECC counter")
except nv.NVMLError_NotSupported:
    pass
nv.nvmlEventSetFree(events)
nv.nvmlShutdown()
print("ok")
"""


def test_the_simulator_delivers_xid_events_as_nvml_does(sim_lib: Path, tmp_path: Path) -> None:
    """Through nvidia-ml-py: a wait times out, then returns the XID of a profile replaced meanwhile."""
    profile, raised = tmp_path / "nvml-sim-profile", tmp_path / "raised"
    write_sim_profile(profile, PROFILE, hostname=HOST)
    write_sim_profile(raised, PROFILE, [("xid", 2, 94)], hostname=HOST)
    done = subprocess.run([sys.executable, "-c", SIM_EVENTS, str(raised)], env=nvml_sim.sim_environ(sim_lib, profile),
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (0, "ok\n", "")


@pytest.mark.parametrize(("profile", "fault", "message"), [
    (PROFILE, ("xid", 2), r"xid: give the XID \(1-999\) after the GPU, e\.g\. \('xid', 2, 79\)"),
    (PROFILE, ("xid", 2, 1000), r"xid: give the XID \(1-999\)"),
    (PROFILE, ("xid", 9, 79), r"no GPU 9 on h"),
    (PROFILE, ("nvlink_errors", 1, 0), r"nvlink_errors: the error count must be positive, got 0"),
    ("8xL40S-PCIe", ("nvlink_errors", 0), r"nvlink_errors: GPU 0 has no active NVLink"),
    (PROFILE, ("link_down", 2, 5), r"link_down takes no value after the GPU, got 5"),
    (PROFILE, "xids", r"unknown fault 'xids'; known: .*gpu_lost, xid, nvlink_errors"),
])
def test_faults_that_cannot_be_raised_are_refused(tmp_path: Path, profile: str, fault: Fault, message: str) -> None:
    with pytest.raises(FaultError, match=message):
        write_sim_profile(tmp_path / "p", profile, [fault], hostname="h")
    assert list(tmp_path.iterdir()) == []


def test_faults_seen_only_by_monitoring_have_no_facts_to_apply() -> None:
    with pytest.raises(FaultError, match="xid leaves the facts alone: raise it with write_sim_profile"):
        apply_fault(profile_facts(PROFILE, "h"), "xid", 2)
