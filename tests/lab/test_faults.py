"""Faults on the serving lab (scenario ``faults``): each heals, by itself or with one deploy, while the other
replica answers; then (scenario ``changed``) tests that leave the fleet changed for the next scenario's deploy.

Every fault's figures go to the session's lab-fault-figures.jsonl, beside its temporary files. An interrupted restart
(drift for the check, performed by the next deploy) is the heal of tests/lab/test_start_times.py's slowed start.
"""

from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from gpufleet_lab.nodes import VRRP_PASSWORD_FILE, power_off
from gpufleet_lab.sim_profile import write_sim_profile
from gpufleet_lab.state import NodeRecord
from gpufleet_lab.tiny_adapters import LAB_ADAPTERS, LATER_ADAPTER

from gpufleet import node_paths
from tests.lab.checks import assert_no_errors, assert_nothing_changed, main_pid
from tests.lab.fleet import (
    DEPLOY,
    INVENTORY,
    PIPELINE,
    PORT,
    PROVISION,
    ROUTER_PORT,
    SIM_PROFILE,
    address_holder,
    client_key,
    completion_text,
    deploy,
    holds_address,
    http,
    lab_copy,
    node_captures,
    record_figure,
    requests_to,
    router_address,
    router_retries,
    router_servers,
    seeded_completion,
    served_name,
    single,
    tls,
    vllm_child,
    wait_capture,
    wait_router_status,
    wait_serving,
)
from tests.lab.harness import LAB_VARS, LAB_VENV, LAB_VLLM_VERSION, PYINFRA, ROOT, Completed, Lab, run
from tests.lab.prometheus import wait_for
from tests.lab.scenarios import GROUP_CHANGED, LabStates

pytestmark = pytest.mark.filterwarnings("ignore:Unknown ssh-ed25519 host key:UserWarning")

LAB_IFACE = "host0"  # a lab node's interface on the lab bridge (fleet_interface)
IMPAIRED_LINK = "tbf rate 1mbit burst 32kbit latency 100ms"  # a link that moves 8 MiB in about a minute
DRIVER_PACKAGES = "nvidia-driver-580-open libnvidia-compute-580 nvidia-persistenced"
NVML_INIT = "python3 -c 'import ctypes; print(ctypes.CDLL(\"libnvidia-ml.so.1\").nvmlInit_v2())'"


def test_kill_9_of_haproxy_moves_the_virtual_address_to_the_other_router(
        lab: Lab, faults: Completed | None, tmp_path_factory: pytest.TempPathFactory) -> None:
    """HAProxy killed (-9) on the router that holds the virtual address, under load through it (completions and
    streamed chats): that router's health check fails, keepalived gives the address up and the other router takes
    it within 5 s; every request sent after the move succeeds (only those the dead HAProxy held or that reached the
    address before it moved may fail). systemd starts HAProxy again, and the address stays where it went (no
    preemption: no second move)."""
    holder = address_holder(lab)
    assert holder is not None, "no router holds the virtual address"
    other = next(node for node in lab.nodes[:2] if node != holder)
    load = requests_to(lab, None, streams=2, pause_s=0.5, chat=True, timeout_s=30).start()
    try:
        time.sleep(3)  # requests in flight through the address
        before = main_pid(lab, holder, "haproxy")
        killed = time.monotonic()  # at or before the kill
        lab.host(holder).check_output(f"pkill -{int(signal.SIGKILL)} -x haproxy")
        moved_at = _wait_for_holder(lab, other)
        moved_s = None if moved_at is None else moved_at - killed
        time.sleep(5)  # requests sent after the move
    finally:
        load.stop()
    assert moved_s is not None and moved_s <= 5, f"the address moved after {moved_s} s"
    after_the_move = [a for a in load.answers if a.sent >= killed + moved_s]
    assert len(after_the_move) >= 4 and [a.failure for a in after_the_move if a.failure] == []
    end = time.monotonic() + 60
    while time.monotonic() < end and main_pid(lab, holder, "haproxy") in (0, before):
        time.sleep(1)
    assert main_pid(lab, holder, "haproxy") not in (0, before), "systemd did not start HAProxy again"
    time.sleep(3)  # its health check passes again: keepalived backs up, and the address stays
    assert address_holder(lab) == other
    record_figure(tmp_path_factory, {
        "fault": "kill -9 of HAProxy on the router holding the virtual address", "router": holder.name,
        "address_moved_s": round(moved_s, 1), **load.figures(),
        "failed_before_the_move": len(load.failures), "sent_after_the_move": len(after_the_move)})


# A VRRP 2 advertisement (RFC 3768) as a node that is no router sends it to a router's own address: the group's id,
# priority 255 (the owner's: a master that accepts it gives the address up), the virtual address and the group's
# password, in clear as on the wire, with TTL 255 as VRRP requires. Run with the node's Python, as root (a raw socket).
_FORGED_ADVERT = """import socket, struct, sys, time
vrid, address, target, password, count = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
body = struct.pack("!BBBBBBH4s8s", 0x21, vrid, 255, 1, 1, 1, 0, socket.inet_aton(address), password.encode())
total = sum(struct.unpack("!%dH" % (len(body) // 2), body))
total = (total & 0xFFFF) + (total >> 16)
checksum = ~((total & 0xFFFF) + (total >> 16)) & 0xFFFF
packet = body[:6] + struct.pack("!H", checksum) + body[8:]
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, 112)
s.setsockopt(socket.IPPROTO_IP, socket.IP_TTL, 255)
for _ in range(count):
    s.sendto(packet, (target, 0))
    time.sleep(1)
"""


def test_vrrp_from_an_address_that_is_no_routers_is_dropped(lab: Lab, faults: Completed | None) -> None:
    """lab3, a node but no router, sends the routers' VRRP group a higher priority's advertisements with the right
    group id and password (the password travels in clear: anyone on the segment can read it): keepalived's IP
    filter admits VRRP from the other routers only, so the router holding the address keeps it, and neither
    router's keepalived logs the advertisement. (The address still moves between the routers: the failover tests
    beside this one.)"""
    holder = address_holder(lab)
    assert holder is not None, "no router holds the virtual address"
    config = lab.host(holder).check_output("cat /etc/keepalived/keepalived.conf")
    found = re.search(r"^\s*virtual_router_id (\d+)$", config, re.M)
    assert found, config
    password = (lab.directory / VRRP_PASSWORD_FILE).read_text().strip()[:8]
    assert f"auth_pass {password}" in config  # the group's own password: only the sender's address is wrong
    began = int(lab.host(holder).check_output("date +%s"))
    forger, count = lab.nodes[2], 6  # over twice keepalived's master-down interval (3 adverts and its skew)
    argv = [node_paths.NODE_PYTHON, "-c", _FORGED_ADVERT, found[1], router_address(lab), holder.address, password,
            str(count)]
    forged = lab.host(forger).run(" ".join(shlex.quote(a) for a in argv))
    assert forged.rc == 0, forged.stderr
    time.sleep(1)  # the last advertisement's master-down interval has begun
    assert address_holder(lab) == holder, "a VRRP advertisement from a node that is no router moved the address"
    for router in lab.nodes[:2]:
        journal = lab.host(router).check_output(f"journalctl -q -o cat -u keepalived --since=@{began}")
        assert forger.address not in journal and "higher prio" not in journal.lower(), journal[-2000:]


def _wait_for_holder(lab: Lab, router: NodeRecord, timeout: float = 30) -> float | None:
    """The monotonic clock's reading once ``router`` holds the virtual address (None: not within ``timeout``); asks
    ``router`` alone (the other one may be off)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if holds_address(lab, router):
            return time.monotonic()
        time.sleep(0.2)
    return None


def test_kill_9_of_vllm_is_restarted_and_serves_again(
        lab: Lab, faults: Completed | None, tmp_path_factory: pytest.TempPathFactory) -> None:
    """systemd restarts a killed vLLM; meanwhile the router takes the replica out and the clients' requests, in
    flight included, go to the other replica: none fails."""
    node, unit = lab.nodes[0], f"vllm@{single(lab)}"
    retried_before = router_retries(lab)
    # Load through the router from before the kill until the router has taken the replica out and the other one
    # carried it alone for a while; not during the restart, which the lab's two cores could not also carry.
    load = requests_to(lab, None, streams=2, pause_s=1.0).start()
    try:
        time.sleep(5)  # requests in flight on both replicas
        before = main_pid(lab, node, unit)
        lab.host(node).check_output(f"kill -{int(signal.SIGKILL)} {before}")
        killed = time.monotonic()
        wait_router_status(lab, single(lab), "DOWN", timeout=60)
        taken_out = time.monotonic() - killed
        time.sleep(15)
    finally:
        load.stop()
    end = time.monotonic() + 120
    after = 0
    while time.monotonic() < end:
        after = main_pid(lab, node, unit)
        if after and after != before:
            break
        time.sleep(2)
    assert after and after != before, f"systemd did not restart {unit}"
    wait_serving(lab, node)
    wait_router_status(lab, single(lab), "UP", timeout=60)
    back = time.monotonic() - killed
    figures = load.figures()
    assert figures["requests"] > 0 and load.failures == [], load.failures[:3]
    record_figure(tmp_path_factory, {
        "fault": "kill -9 of a replica behind the router", "replica": single(lab), **figures,
        "retried": router_retries(lab) - retried_before, "taken_out_s": round(taken_out, 1),
        "back_in_router_s": round(back, 1)})


# What keeps lab1's replica from starting, one fault at a time: (what gpufleet diag names it, how it is injected, how
# mended, what vLLM's journal says). A flag the release removed (vLLM 0.31 has no --disable-log-requests) written
# into the replica's config.yaml by hand, as a deploy would refuse it; the model's files moved away; the replica's
# port taken by another process before it starts.
_CONFIG_SAVED = "/run/gpufleet-lab-config.yaml"
_PORT_TAKER = "gpufleet-lab-port-taker"
# the port is bound as vLLM binds it (SO_REUSEADDR: the stopped replica's connections may still be in TIME_WAIT)
_TAKE_PORT = ("import socket, sys, time; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1);"
              " s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(); time.sleep(600)")


def _start_faults(lab: Lab) -> list[tuple[str, str, str, str]]:
    config = f"{node_paths.replica_dir(single(lab))}/config.yaml"
    model = str(LAB_VARS["vllm_model"])
    return [
        ("flag_removed", f"cp {config} {_CONFIG_SAVED} && printf '\\ndisable-log-requests: true\\n' >> {config}",
         f"cp {_CONFIG_SAVED} {config}", "unrecognized arguments: --disable-log-requests"),
        ("model_missing", f"mv {model} {model}.away", f"mv {model}.away {model}",
         "HFValidationError: Repo id must be in the form"),
        ("port_taken", f"systemd-run --quiet --collect --unit={_PORT_TAKER} python3 -c '{_TAKE_PORT}'"
                       f" {lab.nodes[0].address} {PORT} && sleep 1 && systemctl is-active --quiet {_PORT_TAKER}",
         f"systemctl stop {_PORT_TAKER}", "[Errno 98]"),
    ]


def _journal_says(lab: Lab, node: NodeRecord, unit: str, since: str, said: str) -> Callable[[], str | None]:
    """A probe for wait_for: the first line of ``unit``'s journal since ``since`` (Unix time) holding ``said``."""
    def probe() -> str | None:
        lines = lab.host(node).check_output(f"journalctl -q -o cat --since=@{since} -u {unit}").splitlines()
        return next((line for line in lines if said in line), None)
    return probe


def test_a_replica_that_cannot_start_says_why_and_starts_once_mended(
        lab: Lab, faults: Completed | None, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Three faults that keep lab1's replica from starting, one start each, each in its journal in the words
    gpufleet diag's catalog reads (tests/lab/test_when_things_fail.py names them on lab1): a flag the release
    removed, the model's files gone, its port taken. Each start fails within seconds, with the other replica
    serving; once the last is mended the next start serves, with no deploy."""
    node, unit = lab.nodes[0], f"vllm@{single(lab)}"
    host = lab.host(node)
    seen, started = {}, time.monotonic()
    for name, inject, mend, said in _start_faults(lab):
        since = host.check_output("date +%s").strip()
        host.check_output(f"systemctl stop {unit} && {inject} && systemctl start --no-block {unit}")
        try:
            failed = time.monotonic()
            wait_for(f"{unit} to fail on {name}", _journal_says(lab, node, unit, since, said), timeout=120, every=1)
            seen[name] = round(time.monotonic() - failed, 1)
        finally:
            host.check_output(f"systemctl stop {unit}; {mend}")
    # four starts in a few minutes: systemd's start limit (5 in 300 s) counts them, the watchdog's too
    host.check_output(f"systemctl reset-failed {unit} {unit.replace('vllm@', 'vllm-watchdog@')};"
                      f" systemctl start --no-block {unit}")
    wait_serving(lab, node)
    wait_router_status(lab, single(lab), "UP", timeout=60)
    record_figure(tmp_path_factory, {"fault": "three starts that fail (a removed flag, the model's files gone, the"
                                              " port taken), one after another", "replica": single(lab),
                                     "failed_after_s": seen, "serving_again_s": round(time.monotonic() - started, 1)})


@pytest.mark.parametrize("rank", [0, 1])
def test_kill_9_of_any_rank_restarts_the_whole_pipeline_replica_once(lab: Lab, faults: Completed | None, rank: int,
                                                                     tmp_path_factory: pytest.TempPathFactory) -> None:
    """Killing either rank's vLLM stops the other rank too; both start again as one new generation and the
    replica serves, without an operator; lab1's replica answers throughout. With rank 1 killed, lab3's link is
    impaired first (its interface held to 1 Mbit/s by a token bucket that queues, then drops: delay and loss; this
    kernel has no netem): the new generation's fabric check fails within 60 s and names lab3, and no vLLM starts on
    either rank until the link is mended; then the same generation starts, with no restart spent on the check."""
    unit = f"vllm@{PIPELINE}"
    ranks = lab.nodes[1:]  # lab2 is rank 0 (the API), lab3 rank 1
    wait_serving(lab, ranks[0])
    before = {n.name: vllm_child(lab, n, unit) for n in ranks}
    assert all(before.values()), before
    since = lab.host(ranks[0]).check_output("date +%s").strip()
    impaired = ranks[1] if rank == 1 else None
    loop = requests_to(lab, lab.nodes[0])
    loop.start()
    try:
        if impaired is not None:
            lab.host(impaired).check_output(f"tc qdisc add dev {LAB_IFACE} root {IMPAIRED_LINK}")
        killed = time.monotonic()
        lab.host(ranks[rank]).check_output(f"kill -{int(signal.SIGKILL)} {before[ranks[rank].name]}")
        # rank 0 may answer a moment longer (through the killed rank's engine processes, until its unit's cgroup is
        # stopped): serving again counts once rank 0's vLLM was replaced too
        wait_for(f"{unit}'s rank 0 stopped with the killed rank", lambda: True if vllm_child(
            lab, ranks[0], unit) != before[ranks[0].name] else None, timeout=120, every=1)
        if impaired is not None:
            named, _ = wait_for("the fabric check to name the impaired node", lambda: re.search(
                r"the replica does not start: its fabric check failed on ([^\s;]+)", lab.host(ranks[0]).check_output(
                    f"journalctl -q -o cat --since=@{since} -u {unit}")), timeout=90, every=1)
            failed_after = time.monotonic() - killed
            assert named.group(1) == impaired.name, named.group(0)
            assert failed_after <= 60 + 5, f"the fabric check named {impaired.name} {failed_after:.0f} s after the kill"
            assert [vllm_child(lab, n, unit) for n in ranks] == [0, 0]  # the replica did not start on it
            lab.host(impaired).check_output(f"tc qdisc del dev {LAB_IFACE} root")
            impaired = None
        wait_serving(lab, ranks[0], timeout=600)
        recovered = time.monotonic() - killed
    finally:
        if impaired is not None:
            lab.host(impaired).run(f"tc qdisc del dev {LAB_IFACE} root")
        loop.stop()
    after = {n.name: vllm_child(lab, n, unit) for n in ranks}
    assert all(after.values()) and set(after.values()).isdisjoint(before.values()), (before, after)
    # one new generation, the same on both ranks, and each rank started vLLM once in it: no storm (counted from
    # replica_rank's own lines: systemd's NRestarts also counts a start the lab's nspawn cgroups made fail before
    # vLLM ran, "219/CGROUP")
    started = {n.name: re.findall(r"generation (\w+), starting vLLM", lab.host(n).check_output(
        f"journalctl -q -o cat --since=@{since} -u {unit}")) for n in ranks}
    generations = {g for found in started.values() for g in found}
    assert [len(g) for g in started.values()] == [1, 1] and len(generations) == 1, started
    assert loop.sent > 0 and loop.failures == [], loop.failures[:3]
    record_figure(tmp_path_factory, {
        "fault": f"kill -9 of rank {rank}'s vLLM" + (", lab3's link impaired until the fabric check named it"
                                                     if rank == 1 else ""),
        "replica": PIPELINE, "serving_again_s": round(recovered, 1), "other_replica_requests": loop.sent,
        "other_replica_failures": 0, **({"fabric_check_named_s": round(failed_after, 1)} if rank == 1 else {})})


def test_one_deploy_heals_a_node_without_a_driver_and_a_follower_systemd_gave_up_on(
        lab: Lab, faults: Completed | None, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Two faults at once, on both replicas, healed by one deploy:

    - lab1 loses its driver and its replica (purged, stopped): the deploy plans it from its gpu_profile, installs
      the driver, gates it on a fresh probe and serves;
    - lab3's rank fails to start until systemd stops restarting it (``failed`` after its restarts) while lab2's
      waits: the deploy resets and starts it and waits until the replica serves.
    """
    node, unit = lab.nodes[0], f"vllm@{single(lab)}"
    host = lab.host(node)
    pipeline, leader, follower = f"vllm@{PIPELINE}", lab.nodes[1], lab.nodes[2]
    failing = lab.host(follower)
    drop_in = f"/run/systemd/system/{pipeline}.service.d"
    captures = node_captures(lab, follower)
    # each start fails at once and the next follows 0.2 s later (the unit's own RestartSec is 5 s): systemd gives up
    # after its StartLimitBurst in a second or two instead of half a minute
    failing.check_output(f"mkdir -p {drop_in} && printf '[Service]\\nExecStartPre=/bin/false\\nRestartSec=200ms\\n'"
                         f" > {drop_in}/fail.conf"
                         f" && systemctl daemon-reload && systemctl restart {pipeline} || true")
    host.check_output(f"systemctl stop {unit} && apt-get purge -y -q {DRIVER_PACKAGES} >/dev/null 2>&1")
    assert host.run(NVML_INIT).rc != 0  # bare: no NVML

    def show(prop: str) -> str:
        return failing.run(f"systemctl show -p {prop} --value {pipeline}").stdout.strip()

    try:
        end = time.monotonic() + 240
        while time.monotonic() < end and show("ActiveState") != "failed":
            time.sleep(3)
        assert show("ActiveState") == "failed" and int(show("NRestarts")) >= 4  # systemd gave up on it
        # its OnFailure= kept the last hour on lab3, the unit failed in it
        captured = wait_capture(lab, follower, f"restart-loop-vllm-{PIPELINE.replace('_', '-')}", captures)
        units = json.loads(failing.check_output(f"tar -xzOf {node_paths.DIAG_CAPTURES_DIR}/{captured} units.json"))
        assert units[f"{pipeline}.service"]["ActiveState"] == "failed", units.keys()
    finally:  # the next deploy heals the follower only once its starts can succeed (and the next tests need it)
        failing.check_output(f"rm -rf {drop_in} && systemctl daemon-reload")
    started = time.monotonic()
    done = deploy(lab)
    assert_no_errors(done)  # no node stopped at the gate or anywhere else
    wait_serving(lab, node, timeout=60)  # the deploy waited for both: each answers at once
    wait_serving(lab, leader, timeout=60)
    healed = time.monotonic() - started
    assert host.run(NVML_INIT).stdout.strip() == "0"
    assert host.service(unit).is_running and failing.service(pipeline).is_running
    assert_nothing_changed(deploy(lab))  # and it is converged: the next run changes nothing
    record_figure(tmp_path_factory, {
        "fault": "a node without a driver (driver purged, replica stopped) and the follower's unit failed (systemd"
                 " gave up restarting it), one deploy", "node": node.name, "replica": PIPELINE,
        "serving_after_s": round(healed, 1)})


@pytest.mark.waits
def test_a_wedged_engine_is_restarted_by_the_watchdog_while_a_provision_reboots_the_followers_node(
        lab: Lab, faults: Completed | None, old_module_loaded: NodeRecord,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Two faults at once, on both replicas, each healed without an operator:

    - SIGSTOP of lab1's engine process: /health may still answer, completions do not; the watchdog on the replica's
      node restarts the replica after vllm_watchdog_stall_s (30 s on the lab) and says why in the journal;
    - lab3 (rank 1) runs an older driver's kernel module: deploys/provision.py with nvidia_driver_reboot=allowed
      reboots it, and after the boot it runs the installed driver with its services. Rank 0 stops its vLLM and
      waits; lab3's unit starts at boot and both ranks start together again, without a vLLM deploy.
    """
    node, unit = lab.nodes[0], f"vllm@{single(lab)}"
    host = lab.host(node)
    leader, follower = lab.nodes[1], old_module_loaded
    wait_serving(lab, node)
    wait_serving(lab, leader)
    boot = lab.boot_id(follower)
    engine = host.check_output("pgrep -f 'VLLM::EngineCore'").split()
    assert len(engine) == 1, engine
    since = host.check_output("date +%s").strip()
    stopped = time.monotonic()
    host.check_output(f"kill -STOP {engine[0]}")
    with ThreadPoolExecutor(1) as provisioning:  # leaving it waits for the deploy's end
        provisioned = provisioning.submit(lab.pyinfra, INVENTORY, PROVISION, "--data", "nvidia_driver_reboot=allowed")
        try:  # a figure, not a verdict: the watchdog must act whichever way /health answers
            health: int | str = http(f"http://{node.address}:{PORT}/health", timeout=10)[0]
        except OSError as exc:
            health = f"no answer: {exc}"
        end = time.monotonic() + 300
        said = ""
        while time.monotonic() < end and not said:
            time.sleep(3)
            said = host.run(f"journalctl -q -o cat --since=@{since} -u vllm-watchdog@{single(lab)}"
                            f" | grep 'restarting {unit}.service'").stdout.strip()
        assert said, "the watchdog did not restart the replica"
        detected = time.monotonic() - stopped
        wait_serving(lab, node)
        recovered = time.monotonic() - stopped
    rows = assert_no_errors(provisioned.result())
    assert rows["NVIDIA driver | Check that the loaded kernel module is the installed driver's"][0] == "1"
    lab.forget_connections()
    assert lab.boot_id(follower) not in ("", boot)  # rebooted by the deploy
    rebooted = lab.host(follower)
    assert rebooted.run(f"mountpoint -q {SIM_PROFILE}").rc != 0  # the installed driver's module is the one loaded
    for service in ("nvidia-persistenced", "nvidia-fabricmanager", "nvidia-dcgm"):
        assert rebooted.service(service).is_running, service
    wait_serving(lab, leader, timeout=600)  # the replica could not serve before lab3 booted again
    pipeline_back = time.monotonic() - stopped
    assert host.check_output("pgrep -f 'VLLM::EngineCore'").split() != engine
    record_figure(tmp_path_factory, {
        "fault": "SIGSTOP of the engine process", "replica": single(lab), "health_while_stopped": health,
        "watchdog_restart_after_s": round(detected, 1), "serving_again_s": round(recovered, 1),
        "watchdog_said": said.splitlines()[0][:300]})
    record_figure(tmp_path_factory, {
        "fault": "reboot of the follower's node by deploys/provision.py (beside the stalled engine)",
        "replica": PIPELINE, "serving_again_s": round(pipeline_back, 1)})


def test_a_router_node_lost_halfway_through_a_deploy_moves_the_address_is_named_and_a_rerun_finishes(
        lab: Lab, faults: Completed | None, tmp_path_factory: pytest.TempPathFactory) -> None:
    """lab2 (a router, holding the virtual address, and the pipeline's rank 0) loses power while a deploy has work
    to do on it, under load through the virtual address (completions and streamed chats):

    - keepalived on lab1 takes the address within 5 s, and every request sent after the move succeeds (lab1's
      HAProxy sends it to lab1's replica); only those in flight on lab2 may fail;
    - the deploy goes on with the other nodes, names lab2 and exits non-zero; once lab2 is back, a rerun converges
      it and the pipeline replica serves again, the address staying on lab1 (no preemption).
    """
    survivor, lost = lab.nodes[0], lab.nodes[1]
    if not holds_address(lab, lost):  # lab2 takes the address: lab1's keepalived leaves and comes back a backup
        lab.host(survivor).check_output("systemctl restart keepalived")
        assert _wait_for_holder(lab, lost) is not None, "lab2 did not take the address"
    lab.host(lost).check_output("rm /etc/gpufleet/node.env")  # work for the deploy on lab2
    load = requests_to(lab, None, streams=2, pause_s=1.0, chat=True, timeout_s=30).start()
    argv = [str(PYINFRA), INVENTORY, DEPLOY, "-y"]
    off = False
    try:
        with subprocess.Popen(argv, cwd=ROOT, env=lab.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) as running:
            assert running.stdout is not None
            output = []
            for line in running.stdout:  # power off lab2 as the deploy starts its first change there
                output.append(line)
                if "Starting operation" in line and "node.env" in line:
                    break
            with ThreadPoolExecutor(1) as watching:  # lab1 watched from before the cut: power_off takes seconds
                moved = watching.submit(_wait_for_holder, lab, survivor)
                cut = power_off(lost.name, lab.directory)  # when its link went down
                off = True
                moved_at = moved.result()
            moved_s = None if moved_at is None else moved_at - cut
            output.extend(running.stdout)
            rc = running.wait(timeout=600)
        reported = time.monotonic() - cut
        text = "".join(output)
        assert moved_s is not None and 0 < moved_s <= 5, f"the address moved after {moved_s} s"
        assert rc != 0, text[-6000:]
        assert f"gpufleet: [{lost.address}] lost during the deploy" in text, text[-6000:]
        assert "An internal exception occurred" not in text, text[-6000:]
        errors = {line.split("]", 1)[0].strip(" [") for line in text.splitlines() if "] Error" in line}
        assert errors <= {lost.address}, text[-6000:]  # no other node failed
        lab.power_on(lost)
        off = False
        assert_no_errors(deploy(lab))
        assert lab.host(lost).file("/etc/gpufleet/node.env").contains(f'^GPUFLEET_NODE="{lost.name}"$')
        wait_serving(lab, lost, timeout=600)
        recovered = time.monotonic() - cut
        assert holds_address(lab, survivor)
    finally:
        load.stop()
        if off:  # the other tests need lab2
            lab.power_on(lost)
    after_the_move = [a for a in load.answers if a.sent >= cut + moved_s]
    assert len(after_the_move) >= 10 and load.failures_sent_after(cut + moved_s) == []
    record_figure(tmp_path_factory, {
        "fault": "a router node (holding the virtual address, and the pipeline's rank 0) powered off halfway through"
                 " a deploy under load, then started and the deploy rerun", "node": lost.name,
        "address_moved_s": round(moved_s, 1), "deploy_ended_after_s": round(reported, 1),
        "serving_again_s": round(recovered, 1), **load.figures(), "failed_before_the_move": len(load.failures),
        "sent_after_the_move": len(after_the_move)})


def test_a_deploy_interrupted_halfway_converges_on_rerun(lab: Lab, faults: Completed | None) -> None:
    """An install interrupted halfway leaves the working virtualenv in place and serving; the rerun finishes it."""
    node = lab.nodes[0]
    host, unit = lab.host(node), f"vllm@{single(lab)}"
    marker = f"{LAB_VENV}/.gpufleet-installed"
    working = host.check_output(f"readlink -f {LAB_VENV}").strip()
    host.check_output(f"echo stale > {marker}")  # the next run reinstalls
    # from an empty cache: with uv's cache warm, the install is a few seconds of hardlinks, too quick to interrupt
    host.check_output("rm -rf /var/cache/gpufleet/uv")
    process = subprocess.Popen([str(PYINFRA), INVENTORY, DEPLOY, "-y"], cwd=ROOT, env=lab.env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # the new build's interpreter exists once its virtualenv is made, before any package goes in
    builds = f"/opt/vllm/.build-{LAB_VLLM_VERSION}-*"
    new_build = f"find /opt/vllm -maxdepth 3 -path '{builds}/bin/python' ! -path '{working}/*'"
    end = time.monotonic() + 600
    while time.monotonic() < end and not host.run(new_build).stdout.strip():
        time.sleep(0.5)
    time.sleep(2)  # the installer is now filling the new build, beside the one in use
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    assert host.check_output(f"readlink -f {LAB_VENV}").strip() == working  # never swapped half-built
    assert host.file(marker).content_string.strip() == "stale"
    assert host.run(f"{LAB_VENV}/bin/python -c 'import vllm'").rc == 0  # the working one is intact
    assert host.service(unit).is_running
    assert_no_errors(deploy(lab))
    rebuilt = host.check_output(f"readlink -f {LAB_VENV}").strip()
    assert rebuilt != working
    # the replaced build stays (until the next install), the half-built one is gone
    assert sorted(host.check_output(f"ls -d {builds}").split()) == sorted([rebuilt, working])
    assert host.file(marker).content_string.strip() != "stale"
    wait_serving(lab, node)


def _adapter_text(lab: Lab, adapter: str) -> str:
    """What an adapter answers through the routers to one prompt, greedy and seeded: the same weights, the same text.
    A replica just restarted is the routers' 503 until their health checks see it up (a few seconds)."""
    end = time.monotonic() + 60
    while True:
        status, body = seeded_completion(lab, adapter)
        if status != 503 or time.monotonic() > end:
            break
        time.sleep(1)
    assert status == 200, body
    return completion_text(body)


def test_changing_one_groups_setting_restarts_only_that_groups_replicas(
        lab: Lab, changed: Completed | None, lab_states: LabStates, tmp_path: Path) -> None:
    """lab_single's group_vars change, and one of its adapters, loaded in lab1's engine, is declared with other weights
    (a new revision of tiny-poet: the files made for tiny-critic, declared beside it): the deploy restarts lab1's
    replica only, which then answers for tiny-poet what tiny-critic answers (the fleet is left so: the next
    scenario's deploy puts the repository's values back). That the new weights alone restart a replica:
    tests/data/operations/vllm.adapters_replaced."""
    pipeline = {n.name: main_pid(lab, n, f"vllm@{PIPELINE}") for n in lab.nodes[1:]}
    single_pid = main_pid(lab, lab.nodes[0], f"vllm@{single(lab)}")
    poet, critic = LAB_ADAPTERS[0].name, LATER_ADAPTER.name
    before = _adapter_text(lab, poet)  # loaded in lab1's engine, if it was not
    inventory = lab_copy(tmp_path, {"lab_single": "vllm_extra_args:\n  enforce-eager: true\n  max-num-seqs: 16\n"})
    lab_states.changed(GROUP_CHANGED)
    assert_no_errors(run([str(PYINFRA), inventory, DEPLOY, "-y"],
                         {**lab.env, "GPUFLEET_LAB_ADAPTERS": f"{critic},{poet}={critic}"}, 1800))
    assert main_pid(lab, lab.nodes[0], f"vllm@{single(lab)}") != single_pid
    assert {n.name: main_pid(lab, n, f"vllm@{PIPELINE}") for n in lab.nodes[1:]} == pipeline
    config = lab.host(lab.nodes[0]).file(f"/etc/gpufleet/vllm/{single(lab)}/config.yaml").content_string
    assert "max-num-seqs: 16" in config
    after = _adapter_text(lab, poet)
    assert after == _adapter_text(lab, critic) and after != before, (before, after)


def test_a_node_failing_the_gpu_gate_is_not_started_and_is_named(
        lab: Lab, changed: Completed | None, lab_states: LabStates, tmp_path: Path) -> None:
    """lab1 loses a GPU: the deploy names it and does not start its replica, nor does the unit's own gate; the
    pipeline replica runs on. It runs as well on the fleet the group-setting test left (lab1's replica on other
    settings, which this deploy would put back): no deploy first. The fleet is left with lab1's replica stopped: the
    next test retires it."""
    node, unit = lab.nodes[0], f"vllm@{single(lab)}"
    host = lab.host(node)
    lab_states.changed()
    host.check_output(f"systemctl stop {unit}")
    profile = "/etc/gpufleet/nvml-sim-profile"
    host.check_output(f"cp {profile} {profile}.saved")
    try:
        faulty = tmp_path / "profile"
        write_sim_profile(faulty, node.profile, ["gpu_missing"], hostname=node.name)  # 7 GPUs left
        host.check_output(f"cat > {profile} <<'EOF'\n{faulty.read_text()}EOF")
        done = deploy(lab)
        assert done.rc != 0
        assert re.search(rf"\[{re.escape(node.address)}\].*GPU health gate failed", done.output), done.output[-4000:]
        assert not host.service(unit).is_running
        # the unit's own gate (ExecStartPre) refuses too
        assert host.run(f"systemctl start {unit}").rc != 0
        assert not host.service(unit).is_running
        for other in lab.nodes[1:]:
            assert lab.host(other).service(f"vllm@{PIPELINE}").is_running
    finally:
        host.check_output(f"mv {profile}.saved {profile}")
        host.run(f"systemctl reset-failed {unit}")



def test_a_dedicated_router_host_converges_next_to_the_serving_nodes(
        lab: Lab, changed: Completed | None, lab_states: LabStates) -> None:
    """lab1 leaves every serving pool (the lab's inventory with GPUFLEET_LAB_LAYOUT=dedicated): in ``routers`` and
    ``monitoring`` only, with no model, one deploy converges it as a dedicated router host. Its replica (stopped by
    the GPU-gate test) is retired, the pipeline replica runs on untouched, lab1's router sends requests to it alone,
    and a second run changes nothing. The fleet is left so: the ray scenario deploys the pipeline pair only."""
    node, replica = lab.nodes[0], single(lab)
    host = lab.host(node)
    pipeline = {n.name: main_pid(lab, n, f"vllm@{PIPELINE}") for n in lab.nodes[1:]}
    lab_states.changed()
    dedicated = {**lab.env, "GPUFLEET_LAB_LAYOUT": "dedicated"}
    done = run([str(PYINFRA), INVENTORY, DEPLOY, "-y"], dedicated, 1800)
    assert_no_errors(done)
    assert not re.search(rf"\[{re.escape(node.address)}\].*GPU health gate", done.output), done.output[-4000:]
    assert not host.file(f"/etc/gpufleet/vllm/{replica}").exists
    assert host.run(f"systemctl is-enabled vllm@{replica}").stdout.strip() != "enabled"
    assert not host.service(f"vllm@{replica}").is_running
    assert {n.name: main_pid(lab, n, f"vllm@{PIPELINE}") for n in lab.nodes[1:]} == pipeline
    assert host.service("haproxy").is_running
    assert [name.split("/")[-1] for name in router_servers(lab)] == [PIPELINE], router_servers(lab)
    status, body = http(f"https://{node.address}:{ROUTER_PORT}/v1/completions",
                        {"model": served_name("lab"), "prompt": "The fleet is", "max_tokens": 4},
                        client_key(lab), context=tls(lab))
    assert status == 200, body
    assert_nothing_changed(run([str(PYINFRA), INVENTORY, DEPLOY, "-y"], dedicated, 600))
