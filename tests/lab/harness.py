"""The lab under test and how the tests drive it: its CLI, pyinfra against it, SSH (testinfra), reboots.

The lab under test is its own: its own lab directory, bridge and subnet (10.213.200.0/24 and up, the first
free one), so it never touches a lab an operator has up. Its nodes mix hardware: lab1 is a PCIe H100
NVL box (no NVLink, no NVSwitch), lab2 and lab3 HGX H100 boards (NVSwitch).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paramiko
import yaml
from gpufleet_lab import preflight, ssh
from gpufleet_lab.nodes import power_on
from gpufleet_lab.state import LAB_DIR_ENV, LabState, NodeRecord, load_state

ROOT = Path(__file__).resolve().parents[2]
PYINFRA = Path(sys.executable).parent / "pyinfra"
LAB_CLI = [sys.executable, "-m", "gpufleet_lab.cli"]
LAB_NODES = 3
LAB_PROFILES = ("8xH100NVL-PCIe", "8xH100-SXM", "8xH100-SXM")  # one per node
# The values every lab node gets (the lab's group_vars/lab.yml): its vLLM release, its alerts' short waits, ...
LAB_FLEET = ROOT / "inventories" / "lab"  # the lab's fleet directory: its inventory and its group_vars
LAB_VARS: dict[str, Any] = yaml.safe_load((LAB_FLEET / "group_vars" / "lab.yml").read_text())
# The vLLM release the lab deploys: its virtualenv is /opt/vllm/<version> on every node.
LAB_VLLM_VERSION: str = LAB_VARS["vllm_version"]
LAB_VENV = f"/opt/vllm/{LAB_VLLM_VERSION}"


def cannot_run_lab() -> str | None:
    """Why this machine cannot run the lab, or None."""
    found = preflight.problems()
    return "; ".join(found) if found else None


@dataclass
class Completed:
    rc: int
    out: str
    err: str

    @property
    def output(self) -> str:
        """stdout and stderr together (pyinfra prints its progress and results on stderr)."""
        return self.out + self.err


@dataclass
class Lab:
    """The running test lab, and how to drive its CLI and pyinfra against it."""

    directory: Path
    bridge: str
    state: LabState

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, LAB_DIR_ENV: str(self.directory)}

    @property
    def nodes(self) -> list[NodeRecord]:
        return self.state.nodes

    def cli(self, *args: str, timeout: float = 180) -> Completed:
        return run([*LAB_CLI, *args], self.env, timeout)

    def pyinfra(self, inventory: str, deploy: str, *options: str, timeout: float = 300) -> Completed:
        return run([str(PYINFRA), inventory, deploy, "-y", *options], self.env, timeout)

    def host(self, node: NodeRecord):  # -> testinfra.host.Host
        import testinfra  # type: ignore[import-untyped]

        return testinfra.get_host(f"paramiko://root@{node.address}", ssh_identity_file=self.state.ssh_key)

    def forget_connections(self) -> None:
        """Drop testinfra's cached connections: after a node rebooted or lost power, its old one is dead."""
        import testinfra.host  # type: ignore[import-untyped]

        testinfra.host.Host._host_cache.clear()

    def power_on(self, node: NodeRecord) -> None:
        """Boot a node the test powered off (gpufleet_lab.nodes.power_off) and reload the lab's state."""
        power_on(node.name, self.directory)
        self.state = load_state(self.directory) or self.state
        self.forget_connections()

    def boot_id(self, node: NodeRecord) -> str:
        """The node's boot id over a fresh connection ("" while it does not answer)."""
        try:
            _, out = ssh.run(node.address, Path(self.state.ssh_key), Path(self.state.known_hosts),
                             "cat /proc/sys/kernel/random/boot_id")
        except (OSError, EOFError, paramiko.SSHException):
            return ""
        return out.strip()

    def reboot(self, *nodes: NodeRecord, timeout: float = 300) -> None:
        """Reboot ``nodes`` at once and wait until each has booted again (a new boot id) and answers."""
        before = {n.name: self.boot_id(n) for n in nodes}
        for node in nodes:
            self.host(node).run("systemctl reboot")
        end = time.monotonic() + timeout
        left = list(nodes)
        while left and time.monotonic() < end:
            time.sleep(2)
            left = [n for n in left if self.boot_id(n) in ("", before[n.name])]
        self.forget_connections()
        assert not left, f"{', '.join(n.name for n in left)} did not boot again within {timeout:.0f} s"


def run(argv: list[str], env: dict[str, str], timeout: float) -> Completed:
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return Completed(done.returncode, done.stdout, done.stderr)


