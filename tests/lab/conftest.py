"""The lab tier's fixtures: one 3-node lab per test session, its scenarios, and the run's order.

Tests that need the lab take the ``lab`` fixture and their scenario's (tests/lab/scenarios.py); where this machine
cannot run a lab they skip, or fail where every tier is required (the policy of tests/conftest.py). Lab tests run
in their scenarios' order, and the test that takes the lab down runs last, whatever its file.
"""

from __future__ import annotations

import os
from collections.abc import Generator, Iterator
from pathlib import Path

import paramiko
import pytest
from gpufleet_lab import network, ssh
from gpufleet_lab.state import LAB_DIR_ENV, NodeRecord, load_state

from tests.conftest import skip_or_fail
from tests.lab.fleet import OLD_MODULE, SIM_PROFILE
from tests.lab.harness import LAB_CLI, LAB_NODES, LAB_PROFILES, Completed, Lab, cannot_run_lab, run
from tests.lab.scenarios import AFTER_FAILURE, BY_NAME, RANK, LabStates, scenario_of

LAB_TEARDOWN_TESTS = {"test_down_leaves_nothing_behind"}
# Start limits and restart counters of gpufleet's replica units, zero again.
RESET_FAILED = "systemctl reset-failed 'vllm@*' 'vllm-watchdog@*'"
# What a failed lab test's report shows of each node: how it runs, and the last lines of gpufleet's units.
# uvicorn's access lines (the routers' health checks, every 2 s) are left out: they would fill the tail.
NODE_STORY = ("uptime; systemctl --failed --no-legend --plain; journalctl -q -o short-precise --no-pager"
              " --since=-15min -u 'vllm*' -u 'ray*' -u 'gpufleet-*'"
              " | grep -v -E '\"(GET|POST) /[^ ]* HTTP/1\\.[01]\" [0-9]{3}' | tail -n 60")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--waits-signal", metavar="PATH", help="create PATH when the first lab test marked `waits` starts"
                     " (scripts/run_tiers.py starts the unit and tools tiers then)")


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test marked ``waits`` mostly waits on timers: the lab's CPUs are free from it on. It is the wedged engine's
    (the watchdog's stall wait, a node's reboot): the tests before it keep both cores busy (the alert round, the
    bench, the capacity load, the first restarts: 0 to 3% idle, with the unit and tools tiers beside them), the
    tests from it on leave 46% of them idle, about 1,170 CPU-seconds over 1,280 s (a run of ``.ci/run``, sampled
    every 5 s). The healthy watch is not one: with the unit tiers started beside it, a scrape
    of a replica came late enough for ModelReplicasBelowMinimum to be pending (seen on this machine), and the watch
    asks for none."""
    signal = item.config.getoption("--waits-signal", default=None)
    if signal and item.get_closest_marker("waits"):
        Path(signal).touch()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The session has one lab: lab tests go in their scenarios' order (a test that takes none goes with the
    first), the test that takes the lab down after every other; pytest's order stays within a scenario."""

    def place(item: pytest.Item) -> tuple[bool, int]:
        if "lab" not in getattr(item, "fixturenames", ()):
            return False, -1
        scenario = scenario_of(list(getattr(item, "fixturenames", ())))
        teardown = getattr(item, "originalname", item.name) in LAB_TEARDOWN_TESTS
        return teardown, RANK[scenario.name] if scenario else 0

    items.sort(key=place)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item,
                              call: pytest.CallInfo[None]) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A lab test that failed carries each node's story (NODE_STORY): what CI printed is then enough to see why. One
    that failed in a scenario sharing the fleet, in its fixtures or its body, may have left it broken (a fault not
    healed yet): the next test's scenario deploys again, and waits as after any deploy, rather than fail on what
    this one left (seen: a GPU fault round that failed halfway left lab1's replica restarting, and the four tests
    after it failed on that). A deploy that failed is not run again (LabStates.reach)."""
    report = yield
    funcargs = getattr(item, "funcargs", {})
    lab = funcargs.get("lab")
    states = funcargs.get("lab_states")
    if report.failed and isinstance(states, LabStates) and states.current != "bare":  # setup and teardown too
        states.changed(AFTER_FAILURE)
    if report.failed and isinstance(lab, Lab):
        for node in lab.nodes:
            try:
                _, told = ssh.run(node.address, Path(lab.state.ssh_key), Path(lab.state.known_hosts), NODE_STORY,
                                  timeout=20)
            except (OSError, EOFError, paramiko.SSHException) as exc:
                told = f"no answer over SSH: {exc}"
            report.sections.append((f"lab node {node.name} ({node.address})", told))
    return report


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
        skip_or_fail(f"the lab cannot run here: {reason}")
    directory = tmp_path_factory.mktemp("lab")
    env = {**os.environ, LAB_DIR_ENV: str(directory)}
    last = ""
    for subnet, bridge in _candidates():
        profiles = [arg for profile in LAB_PROFILES for arg in ("--profile", profile)]
        done = run([*LAB_CLI, "up", "--nodes", str(LAB_NODES), *profiles, "--subnet", subnet, "--bridge", bridge],
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


@pytest.fixture(scope="session")
def lab_states(lab: Lab) -> LabStates:
    """Where the session's lab is: it starts as booted (``bare``)."""
    return LabStates(lab)


# One fixture per scenario (tests/lab/scenarios.py): the lab in that scenario's state, and the deploy that
# brought it there (None while the lab is bare).
@pytest.fixture
def bare(lab_states: LabStates) -> Completed | None:
    return lab_states.reach(BY_NAME["bare"])


@pytest.fixture
def serving(lab_states: LabStates) -> Completed | None:
    """The read-only checks also open the healthy watch: it starts once every target is up."""
    done = lab_states.reach(BY_NAME["serving"])
    if done is not None and done.rc == 0:
        lab_states.healthy_since()
    return done


@pytest.fixture
def watched(lab_states: LabStates) -> Completed | None:
    return lab_states.reach(BY_NAME["watched"])


@pytest.fixture
def faults(lab: Lab, lab_states: LabStates) -> Completed | None:
    """Each fault starts on a fleet whose units have no recent failures: systemd gives a unit up after 5 starts in
    300 s, and faults injected back to back (each restarts a replica once) would add up to that limit. Run alone,
    a fault waits as the read-only checks do for every target up (its alerts need scraped series)."""
    done = lab_states.reach(BY_NAME["faults"])
    if done is not None and done.rc == 0:
        lab_states.healthy_since()
    for node in lab.nodes:
        lab.host(node).check_output(RESET_FAILED)
    return done


@pytest.fixture
def changed(lab_states: LabStates) -> Completed | None:
    return lab_states.reach(BY_NAME["changed"])


@pytest.fixture
def ray(lab_states: LabStates) -> Completed | None:
    return lab_states.reach(BY_NAME["ray"])


@pytest.fixture
def old_module_loaded(lab: Lab) -> Iterator[NodeRecord]:
    """lab3's NVML reports driver OLD_MODULE (the module of an older driver is loaded) until it reboots."""
    node = lab.nodes[-1]
    host = lab.host(node)
    host.run_expect([0], f"sed 's/^driver_version .*/driver_version {OLD_MODULE}/' {SIM_PROFILE} > /run/old-module"
                         f" && mount --bind /run/old-module {SIM_PROFILE}")
    try:
        yield node
    finally:
        host.run(f"mountpoint -q {SIM_PROFILE} && umount {SIM_PROFILE}")
