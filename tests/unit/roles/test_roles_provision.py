"""Roles nvidia_driver, dcgm and dcgm_exporter without a node: their templates, pins, counters and decisions.

Templates are rendered by :func:`gpufleet.templates.render` (what the roles write) from the values the
roles pass. The counters file served by the exporter double against the NVML simulator, and the repository key
pinned by its fingerprint: tests/tools/test_roles_provision.py.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest
from gpufleet_lab import standin_debs
from gpufleet_lab.double_programs import dcgm_exporter as exporter_double
from gpufleet_lab.sim_profile import apply_fault

from gpufleet.facts.apt import AptCandidate
from gpufleet.gpu.profiles import profile_facts
from gpufleet.gpu.report import SCHEMA, NodeFacts, NvmlStatus
from gpufleet.operations.nvidia import (
    LoadedModule,
    reboot_action,
    reboot_required_message,
    upstream_version,
)
from gpufleet.templates import render
from roles.dcgm import dcgm_package
from roles.dcgm_exporter import COUNTERS_FILE, has_nvlink, unit_values
from roles.nvidia_driver import cuda_toolkit_package, driver_package, fabricmanager_package, has_nvswitch, keyring_path
from tests.conftest import ROOT, Project, run_cli
from tests.unit.nvidia_driver_defaults import DEFAULTS

TEMPLATES = ROOT / "templates"


# --- nvidia_driver: repository, pin, unattended-upgrades ---------------------------------------------------

def test_repository_line_is_flat_and_trusts_only_its_own_keyring() -> None:
    keyring = keyring_path(DEFAULTS["nvidia_repo_keyring_url"])
    text = render("nvidia_driver/gpufleet-nvidia.list.j2", repo_url=DEFAULTS["nvidia_repo_url"], keyring=keyring)
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert lines == [
        "deb [signed-by=/etc/apt/keyrings/gpufleet-nvidia.asc]"
        " https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64/ /"
    ]


@pytest.mark.parametrize(
    ("url", "path"),
    [
        ("https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64/3bf863cc.pub",
         "/etc/apt/keyrings/gpufleet-nvidia.asc"),
        ("http://10.213.0.1:8080/keys/gpufleet-lab.gpg", "/etc/apt/keyrings/gpufleet-nvidia.gpg"),
        ("https://mirror.example/keys/nvidia.asc", "/etc/apt/keyrings/gpufleet-nvidia.asc"),
    ],
)
def test_keyring_format_follows_the_url(url: str, path: str) -> None:
    assert keyring_path(url) == path


def _pin_stanza(text: str) -> dict[str, str]:
    fields = [line.split(":", 1) for line in text.splitlines() if line and not line.startswith("#")]
    return {key.strip(): value.strip() for key, value in fields}


def test_pin_holds_every_driver_package_on_its_branch() -> None:
    stanza = _pin_stanza(render("nvidia_driver/gpufleet-nvidia-driver.pref.j2", branch=580))
    assert stanza["Pin"] == "version 580.*"
    assert int(stanza["Pin-Priority"]) >= 1000  # outranks any other version, downgrades included
    patterns = stanza["Package"].split()
    pinned = [driver_package(580, "open"), driver_package(580, "proprietary"), fabricmanager_package(580),
              "nvidia-persistenced", "cuda-drivers-580", "nvidia-driver-pinning-580", "libnvidia-compute-580"]
    for package in pinned:
        assert any(re.fullmatch(p.replace("*", ".*"), package) for p in patterns), package
    for other in ("datacenter-gpu-manager-4-cuda13", "datacenter-gpu-manager-exporter", "python3"):
        assert not any(re.fullmatch(p.replace("*", ".*"), other) for p in patterns), other


def test_pin_follows_the_configured_branch() -> None:
    assert _pin_stanza(render("nvidia_driver/gpufleet-nvidia-driver.pref.j2", branch=590))["Pin"] == "version 590.*"


def test_unattended_upgrades_skip_driver_packages_and_nothing_else() -> None:
    text = render("nvidia_driver/51gpufleet-nvidia-driver.conf.j2")
    assert "Unattended-Upgrade::Package-Blacklist {" in text
    patterns = re.findall(r'^\s*"([^"]+)";', text, re.MULTILINE)
    skipped = lambda name: any(re.match(p, name) for p in patterns)  # noqa: E731 (unattended-upgrades uses re.match)
    assert all(skipped(p) for p in ("nvidia-driver-580-open", "nvidia-fabricmanager-580", "nvidia-persistenced",
                                    "libnvidia-compute-580", "cuda-drivers-580"))
    assert not any(skipped(p) for p in ("datacenter-gpu-manager-4-cuda13", "openssh-server", "libc6"))


def test_package_names() -> None:
    assert driver_package(580, "open") == "nvidia-driver-580-open"
    assert driver_package(580, "proprietary") == "nvidia-driver-580"
    assert fabricmanager_package(580) == "nvidia-fabricmanager-580"
    assert dcgm_package("4", "13.0") == "datacenter-gpu-manager-4-cuda13"
    assert dcgm_package("4", "12.8") == "datacenter-gpu-manager-4-cuda12"
    assert cuda_toolkit_package("13.0") == "cuda-toolkit-13-0"
    assert cuda_toolkit_package("12.10") == "cuda-toolkit-12-10"
    lab_packages = {d.name for d in standin_debs.lab_doubles(nvml_library=b"")}
    assert {driver_package(580, "open"), driver_package(580, "proprietary"), fabricmanager_package(580),
            "nvidia-persistenced", dcgm_package("4", "13.0"), "datacenter-gpu-manager-exporter",
            cuda_toolkit_package(DEFAULTS["cuda_version"])} <= lab_packages


def test_apt_candidate_fact_reads_apt_cache_policy() -> None:
    fact = AptCandidate()
    assert fact.process(["580.95.05-1"]) == "580.95.05-1"
    assert fact.process(["(none)"]) is None
    assert fact.process([]) is None
    assert fact.command("nvidia-driver-580-open").startswith("apt-cache policy nvidia-driver-580-open ")
    assert fact.command("a b; c").startswith("apt-cache policy 'a b; c' ")


# --- nvidia_driver: fabric manager only on NVSwitch systems ------------------------------------------------

@pytest.mark.parametrize(
    ("profile", "expected"),
    [("8xH100-SXM", True), ("8xH200-SXM", True), ("8xA100-SXM", True), ("8xL40S-PCIe", False),
     ("8xH100NVL-PCIe", False), ("4xA100-PCIe-pairs", False), ("2xRTX4090", False)],
)
def test_nvswitch_is_read_from_the_probed_facts(profile: str, expected: bool) -> None:
    # a declared profile that says otherwise is ignored when NVML answered
    declared = "8xL40S-PCIe" if expected else "8xH100-SXM"
    assert has_nvswitch(profile_facts(profile, "n1"), declared) is expected


def test_nvswitch_counts_a_fabric_that_is_still_registering() -> None:
    facts = apply_fault(profile_facts("8xH100-SXM", "n1"), "fabric_in_progress")
    assert facts.gpus[0].fabric is not None and facts.gpus[0].fabric.state == "in_progress"
    assert has_nvswitch(facts, None)


def test_without_nvml_the_declared_profile_decides() -> None:
    bare = NodeFacts(schema=SCHEMA, hostname="n1", nvml=NvmlStatus(available=False, error="Driver Not Loaded"))
    assert has_nvswitch(bare, "8xH100-SXM") is True
    assert has_nvswitch(bare, "8xL40S-PCIe") is False
    assert has_nvswitch(None, "8xA100-SXM") is True
    assert has_nvswitch(None, None) is False
    assert has_nvswitch(None, "not-a-profile") is False


# --- nvidia_driver: the reboot decision --------------------------------------------------------------------

@pytest.mark.parametrize(
    ("installed", "loaded", "policy", "changed_now", "action"),
    [
        ("580.95.05-1", "580.95.05", "never", False, "none"),
        ("580.95.05-1", "580.95.05", "allowed", True, "none"),
        ("1:580.95.05-1", "580.95.05", "never", False, "none"),  # an epoch is not part of the driver version
        ("580.95.05-1", "580.65.06", "never", True, "stop"),
        ("580.95.05-1", "580.65.06", "never", False, "stop"),
        ("580.95.05-1", "580.65.06", "if-needed", True, "reboot"),
        ("580.95.05-1", "580.65.06", "if-needed", False, "stop"),  # a difference this deploy did not cause
        ("580.95.05-1", "580.65.06", "allowed", False, "reboot"),
        ("580.95.05-1", None, "never", True, "stop"),  # fresh install: no module loaded yet
        ("580.95.05-1", None, "if-bare", True, "reboot"),  # the node had no driver: nothing served there
        ("580.95.05-1", None, "if-bare", False, "stop"),  # not this deploy's install
        ("580.95.05-1", "580.65.06", "if-bare", True, "stop"),  # an upgrade of a node that had a driver
        ("580.95.05-1", "580.95.05", "if-bare", False, "none"),
        ("580.95.05-1", None, "if-needed", True, "reboot"),
        ("580.95.05-1", None, "allowed", False, "reboot"),
        ("580.95.05-1", "580.95.0", "never", False, "stop"),  # no prefix matching
    ],
)
def test_reboot_action(installed: str, loaded: str | None, policy: Any, changed_now: bool, action: str) -> None:
    assert reboot_action(installed, loaded, policy, changed_now) == action


def test_upstream_version() -> None:
    assert upstream_version("580.95.05-1") == "580.95.05"
    assert upstream_version("1:580.95.05-0ubuntu1") == "580.95.05"
    assert upstream_version("580.95.05") == "580.95.05"


def test_reboot_required_message_names_package_and_module() -> None:
    loaded = LoadedModule.of(profile_facts("8xH100-SXM", "n1", driver_version="580.65.06"))
    assert loaded.version == "580.65.06"
    assert reboot_required_message("nvidia-driver-580-open", "580.95.05-1", loaded, "never") == (
        "reboot required: driver package nvidia-driver-580-open 580.95.05-1 installed,"
        " kernel module 580.65.06 loaded (nvidia_driver_reboot: never)"
    )


def test_a_module_nvml_cannot_reach_says_why() -> None:
    mismatch = NodeFacts(schema=SCHEMA, hostname="n1",
                         nvml=NvmlStatus(available=False, error="Driver/library version mismatch"))
    assert str(LoadedModule.of(mismatch)) == "no kernel module loaded (NVML: Driver/library version mismatch)"
    assert LoadedModule.of(mismatch).version is None
    assert str(LoadedModule.of(None)) == "no kernel module loaded (the node could not be probed)"


# --- dcgm_exporter: counters and unit ----------------------------------------------------------------------

def _counters(nvlink: bool, tmp_path: Path) -> list[tuple[str, str, str]]:
    path = tmp_path / f"counters-{nvlink}.csv"
    path.write_text(render("dcgm_exporter/counters.csv.j2", nvlink=nvlink))
    return exporter_double.read_counters(str(path))


SERVING_FIELDS = {
    "DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
    "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", "DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "DCGM_FI_DEV_POWER_VIOLATION",
    "DCGM_FI_DEV_THERMAL_VIOLATION", "DCGM_FI_DEV_ROW_REMAP_PENDING", "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
    "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_POWER_USAGE",
}
NVLINK_FIELDS = {
    "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL",
    "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",
}


def test_counters_turn_on_what_the_defaults_leave_off(tmp_path: Path) -> None:
    rows = _counters(True, tmp_path)
    fields = [field for field, _, _ in rows]
    assert len(fields) == len(set(fields))
    assert set(fields) >= SERVING_FIELDS | NVLINK_FIELDS
    assert {kind for _, kind, _ in rows} <= {"gauge", "counter", "label"}
    assert all(help_text for _, _, help_text in rows)
    commented_in_defaults = set(re.findall(r"^# (DCGM_FI_\w+),", standin_debs.DEFAULT_COUNTERS, re.MULTILINE))
    assert {"DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "DCGM_FI_DEV_POWER_VIOLATION"} <= commented_in_defaults
    assert commented_in_defaults - set(fields) == set()  # every counter NVIDIA leaves off is on here


def test_counters_leave_nvlink_out_where_gpus_have_none(tmp_path: Path) -> None:
    fields = {field for field, _, _ in _counters(False, tmp_path)}
    assert fields >= SERVING_FIELDS and not fields & NVLINK_FIELDS
    assert has_nvlink(profile_facts("8xH100-SXM", "n1")) and has_nvlink(profile_facts("4xA100-PCIe-pairs", "n1"))
    assert not has_nvlink(profile_facts("8xL40S-PCIe", "n1"))
    assert has_nvlink(None)  # not probed: the fields cost nothing where there is no NVLink


def test_counters_name_only_fields_the_exporter_double_serves(tmp_path: Path) -> None:
    served = set(exporter_double.FIELDS) | set(exporter_double.LABEL_FIELDS) | {exporter_double.XID_FIELD,
                                                                                 exporter_double.XID_COUNT_FIELD}
    assert {field for field, _, _ in _counters(True, tmp_path)} <= served


def _unit(port: int = 9400, address: str = "10.40.0.11",
          allowed: list[str] | None = ["10.40.0.11", "10.40.9.0/24"]) -> dict[str, list[str]]:  # noqa: B006
    text = render("dcgm_exporter/dcgm-exporter.service.j2", **unit_values(port, address, allowed, 300))
    entries: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            entries.setdefault(key, []).append(value)
    return entries


def test_unit_runs_the_exporter_against_the_host_engine_as_its_own_user() -> None:
    unit = _unit(9555)
    assert unit["ExecStart"] == [
        f"/usr/bin/dcgm-exporter -f {COUNTERS_FILE} -a 10.40.0.11:9555 -r localhost:5555 -x 300000"]
    assert _unit(address="fd00::5")["ExecStart"][0].split()[4] == "[fd00::5]:9400"
    assert unit["User"] == unit["Group"] == ["dcgm-exporter"]
    assert unit["Requires"] == unit["After"] == ["nvidia-dcgm.service"]
    assert unit["WantedBy"] == ["multi-user.target"]


def test_unit_is_sandboxed() -> None:
    unit = _unit()
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp", "ProtectKernelTunables", "ProtectKernelModules",
                "ProtectControlGroups", "RestrictNamespaces", "RestrictSUIDSGID", "LockPersonality",
                "MemoryDenyWriteExecute", "RestrictRealtime"):
        assert unit[key] == ["yes"], key
    assert unit["ProtectSystem"] == ["strict"]
    assert unit["CapabilityBoundingSet"] == [""] and unit["AmbientCapabilities"] == [""]
    assert unit["DevicePolicy"] == ["closed"]
    allowed, denied = unit["SystemCallFilter"]
    assert allowed == "@system-service" and denied.startswith("~")
    assert {"@privileged", "@resources"} <= set(denied[1:].split())
    assert unit["SystemCallErrorNumber"] == ["EPERM"]
    assert set(unit["RestrictAddressFamilies"][0].split()) == {"AF_INET", "AF_INET6", "AF_UNIX"}


def test_unit_is_reachable_from_the_node_and_the_monitoring_hosts_only() -> None:
    unit = _unit()
    assert unit["IPAddressDeny"] == ["any"]
    assert unit["IPAddressAllow"] == ["localhost 10.40.0.11 10.40.9.0/24"]


def test_exporter_double_counts_each_xid_within_the_window() -> None:
    """As dcgm-exporter's DCGM_EXP_XID_ERRORS_COUNT: a sample per XID seen within the window, else one 0."""
    collector = object.__new__(exporter_double.Collector)
    now = time.monotonic()
    collector.last_xid, collector.events = {"GPU-0": 48, "GPU-1": 79}, None
    collector.xid_window_ms = 300000
    collector.xids_seen = [(now - 400, "GPU-1", 79), (now - 10, "GPU-0", 79), (now - 5, "GPU-0", 79),
                           (now, "GPU-0", 48)]
    collector._drain_xid_events()  # drops what left the window
    window = 'window_size_in_ms="300000"'
    assert collector._xid_counts("GPU-0", 'gpu="0"') == [
        f'DCGM_EXP_XID_ERRORS_COUNT{{gpu="0",{window},xid="48"}} 1',
        f'DCGM_EXP_XID_ERRORS_COUNT{{gpu="0",{window},xid="79"}} 2']
    assert collector._xid_counts("GPU-1", 'gpu="1"') == [f'DCGM_EXP_XID_ERRORS_COUNT{{gpu="1",{window}}} 0']
    collector.last_xid = {}  # XID events unavailable: left out
    assert collector._xid_counts("GPU-0", 'gpu="0"') == []


# --- configuration ------------------------------------------------------------------------------------------

def test_repository_urls_are_checked(project: Project) -> None:
    project.group_vars("all", "vllm_model: meta-llama/Llama-3.1-8B-Instruct\ngpu_profile: 8xH100-SXM\n"
                              "vllm_max_model_len: 8192\nnvidia_repo_url: developer.download.nvidia.com/repo\n")
    done = run_cli("check", str(project.inventory('fleet = ["n1"]')))
    assert done.rc == 2, done.err
    assert re.search(r"group_vars/all\.yml: nvidia_repo_url: .*developer\.download\.nvidia\.com/repo",
                     done.err), done.err
