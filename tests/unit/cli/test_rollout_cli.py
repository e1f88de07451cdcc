"""``gpufleet upgrade`` and ``gpufleet rollback`` (gpufleet/cli/rollout.py) on a real inventory and plan
(tests/data/rollout_fleet: two routers, three nodes of two replicas each), with the hosts and the pyinfra runs
replaced by a recorded fleet (tests/rollout_world.py): what is refused before anything runs, and what runs."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner, Result
from pyinfra.api.host import Host as PyinfraHost

import gpufleet.inventory.load as gpufleet_inventory
from gpufleet.cli import rollout as cli_rollout
from gpufleet.cli.inputs import fleet_facts
from gpufleet.cli.main import main
from gpufleet.inventory.load import load_fleet
from gpufleet.measure.client_env import INSTALL_COMMAND
from gpufleet.measure.guidellm_client import CLIENT_ENV, client_venv
from gpufleet.plan import backends as plan_backends
from gpufleet.plan.planner import plan_fleet
from gpufleet.remote.commands import RemoteResult
from gpufleet.rollout.pyinfra_run import DEPLOY, PROJECT_ROOT, PyinfraDeploy
from gpufleet.rollout.release import Release, release_of
from gpufleet.rollout.runner import Options, Rollout
from tests.conftest import DATA
from tests.rollout_world import Behaviour, World

FLEET = str(DATA / "rollout_fleet" / "inventory.py")
ROUTERS = ["router1.dc1.example.net", "router2.dc1.example.net"]
A01, A02, A03 = (f"gpu-a0{n}.dc1.example.net" for n in (1, 2, 3))


class _Fleet(World):
    """The recorded fleet as the CLI's remote (closed at the end) and deployer (built with pyinfra's argv)."""

    closed = False

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> _Fleet:
    """The rollout fleet's replicas behind both routers, every node on vLLM 0.31.0; the inventory says 0.32.0."""
    fleet = load_fleet(FLEET)
    plan = plan_fleet(fleet, fleet_facts(fleet, None))
    backends = {server: b.name for b in plan_backends.backends(plan) for server, _ in b.servers}
    new = release_of(fleet.configs[A01])
    releases = {"old": {**new, "vllm_version": "0.31.0"}, "new": new, "bad": {**new, "vllm_version": "0.1"}}
    found = _Fleet(routers=list(ROUTERS), replicas={r.name: (backends[r.name], tuple(r.nodes)) for r in plan.replicas},
                   releases=releases, inventory="new")
    for name in found.replicas:
        found.record(name, "old")
    monkeypatch.setattr(cli_rollout, "PyinfraRemote", lambda inventory: found)
    monkeypatch.setattr(cli_rollout, "PyinfraDeploy", lambda program, inventory, data: found)
    return found


def _run(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def _deploys(world: World) -> list[str]:
    return [event for event in world.events if event.startswith("deploy ")]


def test_upgrade_rolls_each_node_as_one_unit_canary_first(world: _Fleet, tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    done = _run("upgrade", FLEET, "--canary-s", "0", "--report", str(report))
    assert done.exit_code == 0, done.output + done.stderr
    assert _deploys(world) == [f"deploy {A01}", f"deploy {A02}", f"deploy {A03}"]
    first = world.events[:world.events.index(f"deploy {A01}")]
    assert first == [f"drain {r} llama_70b-gpu-a01-{k}" for k in (0, 1) for r in ROUTERS] + [
        f"wait-drained {r} llama_70b-gpu-a01-{k}" for r in ROUTERS for k in (0, 1)] + [
        f"stage-previous {A01} llama_70b-gpu-a01-{k}" for k in (0, 1)]
    assert all((world.running(name) or {}).get("vllm_version") == "0.32.0" for name in world.replicas)
    assert "gpufleet upgrade: done: 6 rolled" in done.output and world.closed
    doc = json.loads(report.read_text())
    assert doc["status"] == 0 and {r["state"] for r in doc["replicas"]} == {"rolled"}
    assert doc["replicas"][0]["change"] == 'vllm_version "0.31.0" -> "0.32.0"'


def test_without_a_routers_group_it_is_one_line_and_no_host_is_touched(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(*args: object) -> None:
        raise AssertionError("connected to a host")

    monkeypatch.setattr(cli_rollout, "PyinfraRemote", never)
    for command in ("upgrade", "rollback"):
        done = _run(command, str(DATA / "plans" / "a_single_node_70b" / "inventory.py"))
        assert done.exit_code == 2 and done.stdout == ""
        (line,) = done.stderr.splitlines()
        assert "no `routers` group: a rolling " + command + " takes each replica out of the routers" in line


def test_a_limit_the_fleet_cannot_keep_is_refused_before_anything_runs(world: _Fleet) -> None:
    world.up["llama_70b-gpu-a01-0"] = world.up["llama_70b-gpu-a01-1"] = False  # one unit of three serves nothing
    done = _run("upgrade", FLEET, "--min-available", "2")
    assert done.exit_code == 2 and world.events == []
    assert done.stderr.splitlines() == [
        "model model-llama-3.1-70b: 2 of 3 replicas ready and min_available 2: taking one out leaves 1, so it"
        " cannot roll without losing capacity"]
    assert _run("upgrade", FLEET, "--batches", "1,0").stderr.splitlines() == [
        "--batches: expected batch sizes of at least 1, found 0"]
    assert world.events == []


def test_a_replica_the_routers_do_not_route_to_is_refused(world: _Fleet) -> None:
    del world.replicas["llama_70b-gpu-a03-1"]
    done = _run("upgrade", FLEET)
    assert done.exit_code == 2 and world.events == []
    assert done.stderr.splitlines() == [
        f"replica llama_70b-gpu-a03-1: router {r} does not route to it: deploy the routers first (pyinfra INVENTORY"
        " deploys/vllm.py --limit routers)" for r in ROUTERS]


def test_a_router_that_does_not_answer_stops_before_anything_runs(world: _Fleet,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    answer = world.run

    def run(host: str, words: Sequence[str], **kwargs: object) -> object:
        if host == ROUTERS[1]:
            return RemoteResult(False, "", f"{host}: cannot connect: timed out")
        return answer(host, words, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(world, "run", run)
    done = _run("upgrade", FLEET)
    assert done.exit_code == 1 and world.events == []
    assert done.stderr.splitlines() == [
        f"gpufleet upgrade: router {ROUTERS[1]}: show: {ROUTERS[1]}: cannot connect: timed out"]


def test_rollback_gives_each_replica_its_previous_release_and_says_the_inventory_differs(world: _Fleet) -> None:
    for name in world.replicas:
        world.record(name, "new", "old")
    done = _run("rollback", FLEET, "--batches", "1,100%", "--canary-s", "0", "--max-unavailable", "100%",
                "--min-available", "0")
    assert done.exit_code == 0, done.output + done.stderr
    assert _deploys(world) == [f'deploy {A01} vllm_version="0.31.0"', f'deploy {A02},{A03} vllm_version="0.31.0"']
    assert all((world.running(name) or {}).get("vllm_version") == "0.31.0" for name in world.replicas)
    assert all(world.files[(A01, n)]["previous"] == world.releases["new"] for n in world.replicas if A01 in n)
    assert done.output.splitlines()[-1].startswith(f"gpufleet rollback: {FLEET} still says otherwise")


def test_rollback_to_a_release_the_inventory_refuses_stops_before_anything_runs(world: _Fleet) -> None:
    for name in world.replicas:
        world.record(name, "new", "bad")
    done = _run("rollback", FLEET)
    assert done.exit_code == 2 and world.events == []
    lines = done.stderr.splitlines()
    assert lines[0].startswith("--data: vllm_version: expected one of")
    assert lines[-1] == ('replica llama_70b-gpu-a01-0: its previous release (vllm_version "0.32.0" -> "0.1") does'
                         " not pass the inventory's validation")


def test_nothing_to_roll_back_is_refused(world: _Fleet) -> None:
    done = _run("rollback", FLEET)
    assert done.exit_code == 2 and world.events == []
    assert done.stderr.splitlines() == [
        "no replica has a previous release (release.previous.json): nothing to roll back"]


def test_a_failed_deploy_rolls_back_and_exits_1_with_the_report(world: _Fleet) -> None:
    world.behaviour["new"] = Behaviour(deploy=3)
    done = _run("upgrade", FLEET, "--canary-s", "0")
    assert done.exit_code == 1
    assert _deploys(world) == [f"deploy {A01}", f'deploy {A01} vllm_version="0.31.0"']
    assert "llama_70b-gpu-a01-0: rolled back" in done.output and "llama_70b-gpu-a02-0: untouched" in done.output
    assert done.output.splitlines()[-1] == ("gpufleet upgrade: stopped: 2 rolled back, 4 untouched; the deploy of"
                                            " llama_70b-gpu-a01-0, llama_70b-gpu-a01-1 exited 3")


def test_sigterm_during_a_deploy_puts_the_drained_replicas_back_and_exits_130(world: _Fleet,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    deploy = world.deploy

    def terminated(hosts: Sequence[str], data: Release) -> int:
        status = deploy(hosts, data)
        os.kill(os.getpid(), signal.SIGTERM)  # the CLI's handler turns it into an interrupt
        return status

    monkeypatch.setattr(world, "deploy", terminated)
    before = signal.getsignal(signal.SIGTERM)
    done = _run("upgrade", FLEET)
    assert done.exit_code == 130
    assert world.events[-4:] == [f"ready {r} llama_70b-gpu-a01-{k}" for k in (0, 1) for r in ROUTERS]
    assert set(world.admin.values()) == {"ready"}
    assert "llama_70b-gpu-a01-0: interrupted" in done.output and signal.getsignal(signal.SIGTERM) is before


def test_the_deploy_is_pyinfras_command_limited_to_the_units_nodes() -> None:
    deployer = PyinfraDeploy("/venv/bin/pyinfra", Path(FLEET), ("vllm_version=0.32.0", "vllm_ready_timeout=1200"))
    assert deployer.root == PROJECT_ROOT and (PROJECT_ROOT / DEPLOY).is_file()
    assert deployer.argv([A01, A02], {}) == [
        "/venv/bin/pyinfra", FLEET, DEPLOY, "-y", "--limit", A01, "--limit", A02,
        "--data", "vllm_version=0.32.0", "--data", "vllm_ready_timeout=1200"]
    assert deployer.argv([A01], {"vllm_version": "0.31.0", "vllm_env": {"A": "1"}})[4:] == [
        "--limit", A01, "--data", "vllm_ready_timeout=1200", "--data", 'vllm_version="0.31.0"',
        "--data", 'vllm_env={"A":"1"}']


def _fake_pyinfra(tmp_path: Path, body: str) -> str:
    """A stand-in for pyinfra's command: writes its arguments to argv.txt, then runs ``body`` (sh)."""
    program = tmp_path / "pyinfra"
    program.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path}/argv.txt\n{body}\n')
    program.chmod(0o755)
    return str(program)


def test_the_deploy_runs_in_the_projects_root_and_returns_pyinfras_status(tmp_path: Path) -> None:
    program = _fake_pyinfra(tmp_path, f'pwd > {tmp_path}/cwd.txt; exit 3')
    status = PyinfraDeploy(program, Path(FLEET)).deploy([A01], {"vllm_version": "0.31.0"})
    assert status == 3 and (tmp_path / "cwd.txt").read_text().strip() == str(PROJECT_ROOT)
    assert (tmp_path / "argv.txt").read_text().splitlines() == [
        FLEET, DEPLOY, "-y", "--limit", A01, "--data", 'vllm_version="0.31.0"']


def test_an_interrupted_deploy_passes_the_interrupt_on_and_waits_for_pyinfra(tmp_path: Path) -> None:
    """The interrupt reaches a thread other than the one waiting on pyinfra, as the kernel may deliver a Ctrl-C to
    any thread (paramiko's, say): the wait still sees it at once. (The stand-in ends by itself after 60 s, so a
    wait that never sees the interrupt fails here instead of hanging.) The interrupt is sent only once the stand-in
    has set its trap: sent after a fixed wait, it once reached a stand-in not started yet on a loaded machine (the
    CI's unit tier beside the lab), which then died of it without writing signal.txt."""
    program = _fake_pyinfra(tmp_path, f"trap 'echo stopped > {tmp_path}/signal.txt; exit 0' INT\n"
                                      f"touch {tmp_path}/started\nfor i in $(seq 1200); do sleep 0.05; done")

    def interrupt_once_started() -> None:
        deadline = time.monotonic() + 60
        while not (tmp_path / "started").exists():
            if time.monotonic() > deadline:
                return  # never started: no interrupt, and the deploy's own end fails the test
            time.sleep(0.02)
        # Ctrl-C (the CLI's SIGTERM handler raises the same interrupt), received by this thread
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)

    # Python's own Ctrl-C handler, whatever this process inherited (a job started in the background by a shell
    # without job control starts with SIGINT ignored)
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=interrupt_once_started, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            PyinfraDeploy(program, Path(FLEET)).deploy([A01], {})
    finally:
        signal.signal(signal.SIGINT, inherited)
    assert (tmp_path / "signal.txt").read_text() == "stopped\n"  # it got SIGINT and had stopped when deploy returned


def test_a_change_of_the_served_model_name_is_left_to_the_plain_deploy(world: _Fleet) -> None:
    done = _run("upgrade", FLEET, "--data", "vllm_served_model_name=llama-next")
    assert done.exit_code == 2 and world.events == []
    lines = done.stderr.splitlines()
    assert len(lines) == 6 * 3  # each replica: in another backend on both routers, and a new served name
    assert lines[:3] == [
        f"replica llama_70b-gpu-a01-0: router {r} has it in backend model-llama-3.1-70b, the inventory in"
        " model-llama-next (another served model name): change that with the plain deploy" for r in ROUTERS] + [
        "replica llama_70b-gpu-a01-0: vllm_served_model_name would change from 'llama-3.1-70b' to 'llama-next': the"
        " routers route by it; change it with the plain deploy (routers and replicas together)"]
    world.releases["renamed"] = {**world.releases["old"], "vllm_served_model_name": None}
    for name in world.replicas:
        world.record(name, "new", "renamed")  # served as the model's id before
    done = _run("rollback", FLEET)
    assert done.exit_code == 2 and world.events == [] and len(done.stderr.splitlines()) == 6
    assert "would change from 'llama-3.1-70b' to 'meta-llama/Llama-3.1-70B-Instruct'" in done.stderr


def test_a_rollback_to_what_the_inventory_says_does_not_say_it_differs(world: _Fleet) -> None:
    for name in world.replicas:
        world.record(name, "old", "new")  # upgraded with --data to 0.31.0 once, the inventory says 0.32.0
    done = _run("rollback", FLEET, "--canary-s", "0")
    assert done.exit_code == 0 and _deploys(world) == [f"deploy {A01}", f"deploy {A02}", f"deploy {A03}"]
    assert "still says otherwise" not in done.output


OPTION_CASES = yaml.safe_load((DATA / "rollout_options" / "cases.yaml").read_text())


@pytest.mark.parametrize("command", ["upgrade", "rollback"])
@pytest.mark.parametrize("case", OPTION_CASES, ids=[" ".join(c["args"]) for c in OPTION_CASES])
def test_bad_options_are_one_line_each_before_the_inventory_or_any_host_is_read(
        command: str, case: dict[str, list[str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("read the inventory or connected to a host")

    for name in ("cli_fleet", "load_inventory", "PyinfraRemote", "PyinfraDeploy", "RouterControl"):
        monkeypatch.setattr(cli_rollout, name, never)
    done = CliRunner().invoke(main, [command, FLEET, *(a.replace("{tmp}", str(tmp_path)) for a in case["args"])])
    assert done.exit_code == 2 and done.stdout == "", done.output
    assert done.stderr.splitlines() == [line.replace("{tmp}", str(tmp_path)) for line in case["expect"]]


WATCH_CASES = yaml.safe_load((DATA / "rollout_options" / "watch_bounds.yaml").read_text())


class _Started(Exception):
    """The rollout was about to start (its options are what the test reads)."""


@pytest.mark.parametrize("case", WATCH_CASES, ids=[" ".join(c["args"]) or "defaults" for c in WATCH_CASES])
def test_the_watch_and_its_bound_are_the_options_or_their_defaults(world: _Fleet, case: dict[str, Any],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    got: list[Options] = []

    def rollout(*args: Any, **kwargs: Any) -> Rollout:
        got.append(args[6])
        raise _Started

    monkeypatch.setattr(cli_rollout, "Rollout", rollout)
    done = CliRunner().invoke(main, ["upgrade", FLEET, *case["args"]])
    assert isinstance(done.exception, _Started), done.output + done.stderr
    (options,) = got
    assert (options.canary_s, options.watch_bound(options.canary_s)) == (case["watch_s"], case["bound_s"])
    assert world.closed


def _never(*args: object, **kwargs: object) -> None:
    raise AssertionError("connected to a host")


def _no_host_contacted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any connection (the routers, the nodes' release records, the bench records, pyinfra itself) fails the test."""
    for name in ("PyinfraRemote", "PyinfraDeploy", "RouterControl", "read_records", "read_bench_records"):
        monkeypatch.setattr(cli_rollout, name, _never)
    monkeypatch.setattr(PyinfraHost, "connect", _never)


def _with_monitoring(tmp_path: Path) -> str:
    """The rollout fleet with a monitoring host, where the bench records are kept."""
    folder = shutil.copytree(DATA / "rollout_fleet", tmp_path / "fleet")
    inventory = folder / "inventory.py"
    inventory.write_text(inventory.read_text().replace(
        "apply_group_vars(globals())",
        'monitoring = [("mon1.dc1.example.net", {"fleet_address": "10.40.9.3"})]\napply_group_vars(globals())'))
    return str(inventory)


@pytest.mark.parametrize("command", ["upgrade", "rollback"])
def test_canary_bench_without_a_monitoring_group_is_refused_before_any_host_is_contacted(
        command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _no_host_contacted(monkeypatch)
    done = _run(command, FLEET, "--canary-bench")
    assert done.exit_code == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        "--canary-bench: expected a monitoring group (where the bench records are kept), found none"]


@pytest.mark.parametrize("command", ["upgrade", "rollback"])
def test_canary_bench_without_its_client_is_refused_before_any_host_is_contacted(
        command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _no_host_contacted(monkeypatch)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # nothing installed there
    monkeypatch.delenv(CLIENT_ENV, raising=False)
    done = _run(command, _with_monitoring(tmp_path), "--canary-bench")
    assert done.exit_code == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        f"--canary-bench: the bench client is not installed in {client_venv()}: install it with {INSTALL_COMMAND}"]
    assert str(client_venv()).startswith(str(tmp_path / "cache"))


@pytest.mark.parametrize("command", ["upgrade", "rollback"])
def test_canary_bench_with_an_unreadable_api_key_is_refused_before_any_host_is_contacted(
        command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _no_host_contacted(monkeypatch)
    monkeypatch.setattr(gpufleet_inventory, "_DATA_OVERRIDE", None)  # the command's --data goes with the test
    monkeypatch.setenv(CLIENT_ENV, shutil.which("true") or "/bin/true")  # a client, were it asked for
    missing = tmp_path / "no-such-key"
    done = _run(command, _with_monitoring(tmp_path), "--canary-bench", "--data",
                f'vllm_api_key={{"file": "{missing}"}}')
    assert done.exit_code == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        f"controller: vllm_api_key: expected a readable secret file {missing}, found: No such file or directory"]


def test_behind_a_virtual_address_a_rollout_still_drains_on_every_router(world: _Fleet,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpufleet_inventory, "_DATA_OVERRIDE", None)  # the command's --data goes with the test
    monkeypatch.setenv("GPUFLEET_TEST_VRRP", "s3cret-8")
    done = _run("upgrade", FLEET, "--canary-s", "0", "--data", "router_virtual_address=10.40.9.100",
                "--data", 'router_vrrp_password={"env": "GPUFLEET_TEST_VRRP"}')
    assert done.exit_code == 0, done.output + done.stderr
    assert done.output.splitlines()[0] == (
        "gpufleet upgrade: endpoint: http://10.40.9.100:8080 (router_virtual_address: one of the routers"
        f" {', '.join(ROUTERS)} at a time, moved by keepalived); each replica is drained on every router, through"
        f" its own HAProxy: {', '.join(ROUTERS)}")
    first = world.events[:world.events.index(f"deploy {A01}")]
    assert [e for e in first if e.startswith("drain ")] == [f"drain {r} llama_70b-gpu-a01-{k}" for k in (0, 1)
                                                          for r in ROUTERS]
    assert "s3cret" not in done.output + done.stderr


def _on_the_worlds_clock(world: _Fleet, monkeypatch: pytest.MonkeyPatch) -> None:
    """The command's rollout on the recorded fleet's clock: its watch takes no time."""
    real = cli_rollout.Rollout

    def rollout(*args: Any, **kwargs: Any) -> Rollout:
        return real(*args, **kwargs, clock=world.now, sleep=world.sleep)

    monkeypatch.setattr(cli_rollout, "Rollout", rollout)


def test_a_canary_short_of_requests_is_watched_on_up_to_canary_max_s(world: _Fleet,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The new release gets 0.2 requests a second from each router: 4 after the 10 s watch, 6 at 15 s."""
    _on_the_worlds_clock(world, monkeypatch)
    world.behaviour["new"] = Behaviour(rps=0.2)
    done = _run("upgrade", FLEET, "--batches", "1", "--canary-s", "10", "--canary-min-requests", "6",
                "--canary-max-s", "25")
    assert done.exit_code == 0, done.output + done.stderr
    assert "fewer than 6 requests after 10 s (--canary-min-requests); watching on, up to 25 s" in done.output
    assert done.output.count("canary: judged after extending the watch to 15 s (6 requests)") == 2  # gpu-a01's two


def test_a_canary_never_given_enough_requests_fails_and_says_why(world: _Fleet,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    _on_the_worlds_clock(world, monkeypatch)
    world.behaviour["new"] = Behaviour(rps=0.2)
    done = _run("upgrade", FLEET, "--canary-s", "10", "--canary-max-s", "25")
    assert done.exit_code == 1, done.output + done.stderr
    assert done.output.splitlines()[-1] == (
        "gpufleet upgrade: stopped: 2 rolled back, 4 untouched; replica llama_70b-gpu-a01-0: canary: not judged:"
        " only 10 requests after 25 s (fewer than 20, --canary-min-requests); --canary-bench gives it a load of its"
        " own (with a monitoring group, where the bench records are)")
    assert all((world.running(name) or {}).get("vllm_version") == "0.31.0" for name in world.replicas)
