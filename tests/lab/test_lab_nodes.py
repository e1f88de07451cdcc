"""The lab fleet end to end: real systemd nodes, real SSH, a real pyinfra deploy, and a clean ``down``.

Network traffic goes only to the lab nodes' own addresses; what lies beyond the lab is checked in the
nodes' routing tables, never by sending anything there.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import paramiko
import pytest
from gpufleet_lab import container, rootfs, ssh

from tests.lab.checks import results
from tests.lab.harness import Completed, Lab
from tests.lab.scenarios import LabStates

# testinfra's paramiko backend warns about every host key it has not seen; pyinfra checks them strictly.
pytestmark = pytest.mark.filterwarnings("ignore:Unknown ssh-ed25519 host key:UserWarning")

NON_LAB_V4 = "203.0.113.7"  # TEST-NET-3: only looked up in the routing table
NON_LAB_V6 = "2001:db8::7"  # documentation prefix: idem


def test_every_node_boots_with_systemd_as_pid1(lab: Lab) -> None:
    for node in lab.nodes:
        host = lab.host(node)
        assert host.run("systemctl is-system-running").stdout.strip() in ("running", "degraded"), node.name
        assert host.check_output("ps -o comm= -p 1") == "systemd"
        assert host.check_output("hostname") == node.name
        assert host.service("systemd-networkd").is_running


def test_sshd_listens_and_accepts_only_keys(lab: Lab) -> None:
    for node in lab.nodes:
        host = lab.host(node)
        assert host.service("ssh").is_running and host.service("ssh").is_enabled
        assert host.socket("tcp://0.0.0.0:22").is_listening
        assert node.address in host.interface("host0").addresses
        effective = host.check_output("sshd -T")
        assert "passwordauthentication no" in effective
        assert "permitrootlogin without-password" in effective
        keys = host.file("/root/.ssh/authorized_keys")
        assert keys.user == "root" and keys.mode == 0o600


def test_nodes_reach_each_other(lab: Lab) -> None:
    first, *others = lab.nodes
    host = lab.host(first)
    for other in others:
        assert host.run(f"ping -c 1 -W 2 {other.address}").rc == 0, other.name
        assert host.run(f"ping -c 1 -W 2 {other.name}").rc == 0, f"{other.name} by name"
        assert host.run(f"timeout 3 bash -c '</dev/tcp/{other.address}/22'").rc == 0, f"{other.name}:22"


def test_nodes_have_no_route_beyond_the_lab(lab: Lab) -> None:
    for node in lab.nodes:
        host = lab.host(node)
        assert host.check_output("ip -4 route show default") == ""
        assert host.check_output("ip -6 route show default") == ""
        lookup = host.run(f"ip route get {NON_LAB_V4}")
        assert lookup.rc != 0 and "unreachable" in lookup.stderr.lower()
        assert host.run(f"ip -6 route get {NON_LAB_V6}").rc != 0
        routes = host.check_output("ip -4 route show")
        assert [line.strip() for line in routes.splitlines()] == [
            f"{lab.state.subnet} dev host0 proto kernel scope link src {node.address}"]


def test_bare_nodes_have_simulated_gpus_and_no_nvml_until_the_driver(lab: Lab, bare: Completed | None) -> None:
    """A bare node: the hardware (the simulator's profile) is there, NVML is not; the lab's driver package brings
    the simulated libnvidia-ml.so.1 (tests/lab/test_provision.py)."""
    for node in lab.nodes:
        host = lab.host(node)
        assert host.file("/etc/gpufleet/nvml-sim-profile").contains(f"for host {node.name}")
        init = host.run("python3 -c 'import ctypes; print(ctypes.CDLL(\"libnvidia-ml.so.1\").nvmlInit_v2())'")
        assert init.rc != 0 and "libnvidia-ml.so.1: cannot open shared object file" in init.stderr, init.stderr


def test_status_lists_every_node_up(lab: Lab) -> None:
    done = lab.cli("status", "--json")
    assert done.rc == 0, done.err
    report = json.loads(done.out)
    assert [(n["name"], n["address"], n["profile"], n["up"]) for n in report["nodes"]] == [
        (n.name, n.address, n.profile, True) for n in lab.nodes
    ]



def test_deploy_converges_and_a_second_run_changes_nothing(lab: Lab, bare: Completed | None,
                                                          lab_states: LabStates) -> None:
    """deploys/common.py on the bare nodes (the lab is no longer as booted after it)."""
    lab_states.changed()
    first = lab.pyinfra("inventories/lab/inventory.py", "deploys/common.py")
    assert first.rc == 0, first.output
    totals = results(first.output)["Grand total"]
    assert totals[1] == "-", first.output  # no errors
    for node in lab.nodes:
        env_file = lab.host(node).file("/etc/gpufleet/node.env")
        assert (env_file.user, env_file.group, env_file.mode) == ("root", "root", 0o644)
        assert env_file.contains(f'^GPUFLEET_NODE="{node.name}"$')
        assert env_file.contains(f'^GPUFLEET_GPU_PROFILE="{node.profile}"$')
        assert lab.host(node).file("/etc/gpufleet").mode == 0o755

    second = lab.pyinfra("inventories/lab/inventory.py", "deploys/common.py")
    assert second.rc == 0, second.output
    rows = results(second.output)
    assert rows["Grand total"][0] == "-" and rows["Grand total"][1] == "-", second.output
    operations = [name for name in rows if name != "Grand total"]
    assert operations and all(rows[name][2] == str(len(lab.nodes)) for name in operations), second.output
    unchanged = [line for line in second.output.splitlines() if line.strip().endswith("] No changes")]
    assert len(unchanged) == len(operations) * len(lab.nodes), second.output


def test_a_node_that_reboots_comes_back(lab: Lab) -> None:
    node = lab.nodes[-1]
    host = lab.host(node)
    host.run("touch /run/gpufleet-before-reboot")  # /run is a fresh tmpfs on every boot
    host.run("systemctl reboot")
    key, known_hosts = Path(lab.state.ssh_key), Path(lab.state.known_hosts)
    check = "test ! -e /run/gpufleet-before-reboot && systemctl is-system-running"
    deadline = time.monotonic() + 60
    answer = ""
    while time.monotonic() < deadline:
        time.sleep(0.5)
        try:  # a new connection each time: the reboot dropped the old ones
            _, answer = ssh.run(node.address, key, known_hosts, check)
        except (OSError, paramiko.SSHException):
            continue
        if answer.strip() in ("running", "degraded"):
            break
    else:
        pytest.fail(f"{node.name} did not come back after a reboot (last answer {answer!r})")
    assert container.alive(node.process)  # the same supervisor started it again


def test_down_leaves_nothing_behind(lab: Lab) -> None:
    """Last: takes the session's lab down and looks for anything left."""
    recorded = [n.process for n in lab.nodes if n.process is not None]
    done = lab.cli("down")
    assert done.rc == 0, done.err
    assert "stopped" in done.out
    assert not [p.pid for p in recorded if container.alive(p)]
    deadline = time.monotonic() + 5
    while _nspawn_processes(lab) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _nspawn_processes(lab) == []
    links = os.listdir("/sys/class/net")
    assert lab.bridge not in links
    assert [link for link in links if link.startswith(f"vb-{lab.bridge}")] == []
    assert rootfs.mounts_under(lab.directory) == []
    assert not (lab.directory / "nodes").exists()
    assert not (lab.directory / "state.json").exists()
    assert lab.cli("status").out.strip() == "no lab is up"


def _nspawn_processes(lab: Lab) -> list[int]:
    """Running (not zombie) systemd-nspawn processes booting a root inside the test lab's directory."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if "systemd-nspawn" in argv and str(lab.directory) in argv and state != "Z":
            found.append(int(entry.name))
    return found
