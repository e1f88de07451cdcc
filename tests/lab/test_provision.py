"""Provisioning on the lab: what deploys/vllm.py's provisioning left (roles common, nvidia_driver, dcgm), that
deploys/provision.py agrees with it, and role dcgm_exporter. Read-only checks run on the serving lab (scenario
``serving``, inside the healthy watch); those that restart the exporter or fail a node, with the faults (the
reboot that loads the installed driver is one of test_faults.py's: beside a wedged engine).

lab1 is a PCIe box (8xH100NVL-PCIe: no NVLink, no NVSwitch), lab2 and lab3 HGX boards (8xH100-SXM), so
the fabric manager and the NVLink counters must follow the probed hardware. A kernel module that does not
match the driver package: the fixture old_module_loaded (tests/lab/conftest.py).
Traffic goes only to the lab nodes' addresses.
"""

from __future__ import annotations

import re

import pytest
from gpufleet_lab.state import NodeRecord

from gpufleet.gpu.profiles import parse_profile
from tests.lab.checks import assert_no_errors, assert_nothing_changed, main_pid, metrics, results
from tests.lab.fleet import INVENTORY, OLD_MODULE, PROVISION
from tests.lab.harness import Completed, Lab

pytestmark = pytest.mark.filterwarnings("ignore:Unknown ssh-ed25519 host key:UserWarning")

EXPORTER = "tests/lab/deploys/dcgm_exporter.py"
DRIVER, DRIVER_VERSION = "nvidia-driver-580-open", "580.95.05-1"
EXPORTER_PORT = 9400


def _nvswitch(node: NodeRecord) -> bool:
    return parse_profile(node.profile).interconnect == "SXM"




def test_provision_converges_every_node(lab: Lab, serving: Completed) -> None:
    assert_no_errors(serving)
    for node in lab.nodes:
        host = lab.host(node)
        for package in (DRIVER, "nvidia-persistenced"):
            assert host.package(package).version == DRIVER_VERSION, (node.name, package)
        assert host.package("datacenter-gpu-manager-4-cuda13").is_installed, node.name
        assert not host.package("nvidia-driver-580").is_installed  # the proprietary flavour
        assert host.package("libnvidia-compute-580").version == DRIVER_VERSION, node.name  # NVML came with it
        init = host.run("python3 -c 'import ctypes; print(ctypes.CDLL(\"libnvidia-ml.so.1\").nvmlInit_v2())'")
        assert init.stdout.strip() == "0", init.stderr

        # cuda_toolkit (inventories/lab/group_vars/lab.yml): the toolkit's stand-in, where vLLM's CUDA_HOME points
        assert host.package("cuda-toolkit-13-0").is_installed, node.name
        assert "release 13.0," in host.check_output("/usr/local/cuda-13.0/bin/nvcc --version"), node.name

        source = host.file("/etc/apt/sources.list.d/gpufleet-nvidia.list")
        assert source.contains(rf"^deb \[signed-by=/etc/apt/keyrings/gpufleet-nvidia.gpg\] "
                               rf"http://{lab.state.bridge_address}:8080/apt/ /$")
        assert host.file("/etc/apt/keyrings/gpufleet-nvidia.gpg").mode == 0o644
        assert host.file("/etc/apt/preferences.d/gpufleet-nvidia-driver").contains("^Pin: version 580\\.\\*$")
        policy = host.check_output(f"apt-cache policy {DRIVER}")
        assert re.search(rf"\*\*\* {re.escape(DRIVER_VERSION)} 1000$", policy, re.MULTILINE), policy  # pinned
        assert host.file("/etc/apt/apt.conf.d/51gpufleet-nvidia-driver").contains('"nvidia-";')

        for unit in ("nvidia-persistenced", "nvidia-dcgm"):
            assert host.service(unit).is_running and host.service(unit).is_enabled, (node.name, unit)
        assert host.socket("tcp://127.0.0.1:5555").is_listening  # the host engine

        fabric = host.package("nvidia-fabricmanager-580")
        if _nvswitch(node):
            assert fabric.version == DRIVER_VERSION, node.name
            service = host.service("nvidia-fabricmanager")
            assert service.is_running and service.is_enabled, node.name
        else:
            assert not fabric.is_installed, node.name
            assert host.run("systemctl cat nvidia-fabricmanager.service").rc != 0, node.name


def test_second_provision_changes_nothing(lab: Lab, serving: Completed) -> None:
    """deploys/provision.py after deploys/vllm.py: the same roles, the same values, nothing to change."""
    assert_no_errors(serving)
    again = lab.pyinfra(INVENTORY, PROVISION)
    assert_nothing_changed(again)
    rows = results(again.output)
    assert int(rows["Grand total"][2]) == again.output.count("] No changes"), again.output
    # naming the installed version exactly changes nothing either
    assert_nothing_changed(lab.pyinfra(INVENTORY, PROVISION, "--data", f"nvidia_driver_version={DRIVER_VERSION}"))




def test_exporter_serves_the_serving_counters(lab: Lab, serving: Completed) -> None:
    assert_no_errors(serving)
    assert_no_errors(lab.pyinfra(INVENTORY, EXPORTER))
    for node in lab.nodes:
        host = lab.host(node)
        service = host.service("dcgm-exporter")
        assert service.is_running and service.is_enabled, node.name
        assert host.check_output(f"ps -o user= -p {main_pid(lab, node, 'dcgm-exporter')}") == "dcgm-exporter"
        assert host.user("dcgm-exporter").shell == "/usr/sbin/nologin"
        assert host.socket(f"tcp://{node.address}:{EXPORTER_PORT}").is_listening  # the fleet address only
        assert not host.socket(f"tcp://0.0.0.0:{EXPORTER_PORT}").is_listening
        exposure = host.check_output("systemd-analyze security dcgm-exporter.service | tail -1")
        level = float(re.search(r"exposure level for dcgm-exporter\.service: ([\d.]+)", exposure)[1])  # type: ignore[index]
        assert level <= 2.0, exposure

        text = metrics(node, EXPORTER_PORT)
        series = {line.split("{", 1)[0] for line in text.splitlines() if line.startswith("DCGM_FI_")}
        for field in ("DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
                      "DCGM_FI_DEV_POWER_VIOLATION", "DCGM_FI_DEV_THERMAL_VIOLATION",
                      "DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "DCGM_FI_DEV_ROW_REMAP_PENDING"):
            assert field in series, (node.name, field)
        nvlink = "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL" in series
        assert nvlink == _nvswitch(node), node.name  # lab1's PCIe GPUs have no NVLink
        assert f'Hostname="{node.name}"' in text and 'DCGM_FI_DRIVER_VERSION="580.95.05"' in text
        assert text.count("DCGM_FI_DEV_XID_ERRORS{") == 8


def test_a_changed_counters_file_restarts_only_the_exporter(lab: Lab, faults: Completed) -> None:
    assert_no_errors(lab.pyinfra(INVENTORY, EXPORTER))
    assert_nothing_changed(lab.pyinfra(INVENTORY, EXPORTER))
    node = lab.nodes[0]
    before = {unit: main_pid(lab, node, unit) for unit in ("dcgm-exporter", "nvidia-dcgm")}
    lab.host(node).run("echo 'DCGM_FI_DEV_GPU_TEMP, gauge, edited by hand' >> /etc/dcgm-exporter/gpufleet-counters.csv")
    done = lab.pyinfra(INVENTORY, EXPORTER)
    rows = assert_no_errors(done)
    changed = {name.split(" | ", 1)[1] for name, row in rows.items() if row[0] != "-" and name != "Grand total"}
    assert changed == {
        "Write the counters the exporter serves to /etc/dcgm-exporter/gpufleet-counters.csv",
        "Restart the exporter: its package, counters or unit changed",
    }, done.output
    assert rows["Grand total"][0] == "2", done.output  # on that one node only
    assert main_pid(lab, node, "dcgm-exporter") != before["dcgm-exporter"]
    assert main_pid(lab, node, "nvidia-dcgm") == before["nvidia-dcgm"]
    assert "edited by hand" not in lab.host(node).file("/etc/dcgm-exporter/gpufleet-counters.csv").content_string
    assert "DCGM_FI_DEV_XID_ERRORS{" in metrics(node, EXPORTER_PORT)


def test_a_mismatched_kernel_module_stops_only_that_node(lab: Lab, faults: Completed,
                                                         old_module_loaded: NodeRecord) -> None:
    assert_no_errors(faults)
    done = lab.pyinfra(INVENTORY, PROVISION)
    assert done.rc != 0, done.output
    stopped = old_module_loaded.address
    expected = (f"[{stopped}] reboot required: driver package {DRIVER} {DRIVER_VERSION} installed,"
                f" kernel module {OLD_MODULE} loaded")
    assert expected in done.output, done.output
    errors = {line.split("]", 1)[0].strip(" [") for line in done.output.splitlines() if "] Error" in line}
    assert errors == {stopped}, done.output
    rows = results(done.output)
    assert rows["Grand total"][1] != "-"
    # nothing after the check ran on the stopped node: the others' DCGM step ran, its own did not
    dcgm_row = rows["DCGM | Enable and start the DCGM host engine nvidia-dcgm.service"]
    assert dcgm_row[1] == "1" and dcgm_row[2] == str(len(lab.nodes) - 1), done.output
