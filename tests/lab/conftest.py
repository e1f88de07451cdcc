"""The lab fleet for integration tests: one 3-node lab per test session, taken down at the end.

The lab under test is its own: its own lab directory, bridge and subnet (10.213.200.0/24 and up, the first
free one), so it never touches a lab an operator has up. Its nodes mix hardware: lab1 is a PCIe H100
NVL box (no NVLink, no NVSwitch), lab2 and lab3 HGX H100 boards (NVSwitch). Tests that need the lab use
the ``lab`` fixture; where this machine cannot run a lab they skip, unless ``GPUFLEET_LAB_REQUIRED=1``
(CI), where that skip is a failure. The test that takes the lab down runs last, whatever its file.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import paramiko
import pytest
import yaml

from gpufleet.lab import network, preflight, ssh
from gpufleet.lab.nodes import power_on
from gpufleet.lab.state import LAB_DIR_ENV, LabState, NodeRecord, load_state

ROOT = Path(__file__).resolve().parents[2]
PYINFRA = Path(sys.executable).parent / "pyinfra"
LAB_CLI = [sys.executable, "-m", "gpufleet.cli_lab"]
LAB_NODES = 3
LAB_PROFILES = ("8xH100NVL-PCIe", "8xH100-SXM", "8xH100-SXM")  # one per node
LAB_TEARDOWN_TESTS = {"test_down_leaves_nothing_behind"}
# After the others, in this order: test_access.py builds on the Ray deployment test_serving.py leaves and ends on
# the lab's default deployment, on which test_alerts.py injects faults and clears them, and which test_upgrade.py
# rolls to another vLLM release and back.
LAB_LAST_MODULES = ("test_access.py", "test_alerts.py", "test_upgrade.py")
# The vLLM release the lab deploys (group_vars/lab.yml): its virtualenv is /opt/vllm/<version> on every node.
LAB_VLLM_VERSION: str = yaml.safe_load((ROOT / "group_vars" / "lab.yml").read_text())["vllm_version"]
LAB_VENV = f"/opt/vllm/{LAB_VLLM_VERSION}"
REQUIRED_ENV = "GPUFLEET_LAB_REQUIRED"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The session has one lab: the test that takes it down goes after every test that uses it, and the modules
    of LAB_LAST_MODULES after the others (pytest's order stays within a module)."""
    last = {name: n + 1 for n, name in enumerate(LAB_LAST_MODULES)}
    items.sort(key=lambda item: (getattr(item, "originalname", item.name) in LAB_TEARDOWN_TESTS,
                                 last.get(item.path.name, 0)))


def cannot_run_lab() -> str | None:
    """Why this machine cannot run the lab, or None."""
    found = preflight.problems()
    return "; ".join(found) if found else None


def skip_or_fail(reason: str) -> None:
    """Skip, or fail when the lab is required here (CI)."""
    if os.environ.get(REQUIRED_ENV) == "1":
        pytest.fail(f"{REQUIRED_ENV}=1 but the lab cannot run: {reason}", pytrace=False)
    pytest.skip(f"lab unavailable: {reason}")


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
        return _run([*LAB_CLI, *args], self.env, timeout)

    def pyinfra(self, inventory: str, deploy: str, *options: str, timeout: float = 300) -> Completed:
        return _run([str(PYINFRA), inventory, deploy, "-y", *options], self.env, timeout)

    def host(self, node: NodeRecord):  # -> testinfra.host.Host
        import testinfra  # type: ignore[import-untyped]

        return testinfra.get_host(f"paramiko://root@{node.address}", ssh_identity_file=self.state.ssh_key)

    def forget_connections(self) -> None:
        """Drop testinfra's cached connections: after a node rebooted or lost power, its old one is dead."""
        import testinfra.host  # type: ignore[import-untyped]

        testinfra.host.Host._host_cache.clear()

    def power_on(self, node: NodeRecord) -> None:
        """Boot a node the test powered off (gpufleet.lab.nodes.power_off) and reload the lab's state."""
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


def _run(argv: list[str], env: dict[str, str], timeout: float) -> Completed:
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return Completed(done.returncode, done.stdout, done.stderr)


def _candidates() -> Iterator[tuple[str, str]]:
    """(subnet, bridge) pairs to try: the one from the environment, else free ones from 10.213.200.0/24."""
    subnet = os.environ.get("GPUFLEET_TEST_LAB_SUBNET")
    if subnet:
        yield subnet, os.environ.get("GPUFLEET_TEST_LAB_BRIDGE", "gflabt0")
        return
    for third in range(200 + os.getpid() % 40, 250):
        bridge = f"gflabt{third}"
        if not network.link_exists(bridge):
            yield f"10.213.{third}.0/24", bridge


@pytest.fixture(scope="session")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    """A 3-node lab booted through ``gpufleet lab up`` (warm rootfs cache: seconds)."""
    reason = cannot_run_lab()
    if reason:
        skip_or_fail(reason)
    directory = tmp_path_factory.mktemp("lab")
    env = {**os.environ, LAB_DIR_ENV: str(directory)}
    last = ""
    for subnet, bridge in _candidates():
        profiles = [arg for profile in LAB_PROFILES for arg in ("--profile", profile)]
        done = _run([*LAB_CLI, "up", "--nodes", str(LAB_NODES), *profiles, "--subnet", subnet, "--bridge", bridge],
                    env, 600)
        if done.rc == 0:
            break
        last = (done.err.strip().splitlines() or ["no output"])[-1]
        if "already exists" not in last and "overlaps" not in last:
            pytest.fail(f"gpufleet lab up failed: {last}", pytrace=False)
    else:
        pytest.fail(f"no free lab subnet for the test lab: {last}", pytrace=False)
    state = load_state(directory)
    assert state is not None
    running = Lab(directory, bridge, state)
    try:
        yield running
    finally:
        if load_state(directory) is not None:
            done = running.cli("down")
            assert done.rc == 0, done.err
