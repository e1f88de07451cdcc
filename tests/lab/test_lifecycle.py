"""A node's place in the lab fleet (role node_lifecycle): admission by the quick burn-in (scenario ``serving``), and an
Xid 79 under load (scenario ``faults``): the node leaves every router within seconds, is quarantined with its evidence,
stays out while dcgmi reports a failed test with exit status 0, and serves again after clean full passes.

The lab's doubles: the burn-in's kernels run on the CPU, dcgmi answers from the NVML simulator's profile, and the
kernel log is a file the test writes the driver's Xid line into (gpufleet_lab.kernel_log).
"""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from gpufleet_lab.kernel_log import append_command, xid_line
from gpufleet_lab.sim_profile import write_sim_profile

from gpufleet import node_paths
from tests.lab.fleet import (
    INVENTORY,
    PIPELINE,
    ROUTER_ADMIN,
    SIM_PROFILE,
    node_captures,
    node_record,
    record_figure,
    requests_to,
    single,
    wait_capture,
    wait_serving,
)
from tests.lab.harness import LAB_VARS, PYINFRA, Completed, Lab, run
from tests.lab.prometheus import Prometheus, wait_for

pytestmark = pytest.mark.filterwarnings("ignore:Unknown ssh-ed25519 host key:UserWarning")

DRAINED_WITHIN_S = 5.0  # the bound: from the finding to no new request at any router


def _at(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def test_every_node_passed_the_quick_burn_in_before_a_replica_landed_on_it(
        lab: Lab, serving: Completed | None, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The deploy from bare nodes admitted each node (no record: the quick burn-in, NVML gate, dcgmi -r 1 and -r 2,
    the CPU's kernels) before it started any replica, and each replica then served."""
    assert serving is not None and serving.rc == 0
    output = serving.output
    admitted = output.index("Admit the node: the quick burn-in before a replica lands on it")
    assert admitted < output.index(f"start vllm@{single(lab)}") and admitted < output.index(f"start vllm@{PIPELINE}")
    monitoring = lab.host(lab.nodes[0])  # the inventory's monitoring group
    for node in lab.nodes:
        record = node_record(lab, node)
        assert record["state"] == "serving", record
        # the deploy kept each node's record, as its admission left it, on the monitoring hosts
        kept = json.loads(monitoring.check_output(f"cat /var/lib/gpufleet/nodes/{node.address}.json"))
        assert kept["state"] == "serving" and kept["history"] == record["history"], kept
        moves = [(h["from"], h["to"]) for h in record["history"]]
        assert moves == [("new", "burn-in"), ("burn-in", "serving")], moves
        last = record["last_burn_in"]
        assert (last["tier"], last["passed"], last["failed"]) == ("quick", True, [])
        unit = f"vllm@{single(lab)}" if node == lab.nodes[0] else f"vllm@{PIPELINE}"
        started = lab.host(node).check_output(f"systemctl show -p ActiveEnterTimestamp --value {unit}")
        assert started.strip(), f"{unit} never started on {node.name}"
        record_figure(tmp_path_factory, {"figure": "quick burn-in", "node": node.name, "seconds": last["seconds"]})


def _router_view(lab: Lab, server: str) -> list[dict[str, Any]]:
    """The replica's server as each router's HAProxy shows it."""
    views = []
    for router in lab.nodes[:2]:
        shown = json.loads(lab.host(router).check_output(f"{ROUTER_ADMIN} show"))
        views.append(next(s for s in shown["servers"] if s["server"] == server))
    return views


def _taking_requests(view: dict[str, Any]) -> bool:
    return str(view["status"]).startswith("UP") and int(view["weight"]) > 0


def test_an_xid_79_under_load_drains_quarantines_and_readmits_the_node(
        lab: Lab, faults: Completed | None, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """lab1 serves under load through the routers; its GPU 3 fails a DCGM memory test (dcgmi exits 0) and then throws
    an Xid 79. Within 5 s no router sends lab1's replica another request, and no request fails on the pipeline
    replica; lab1 is quarantined with its evidence, its replica stopped; its full burn-in fails on dcgmi's result
    (exit status 0) and keeps it out; with dcgmi clean again, after its cool-off, two clean full passes bring it back
    and its replica serves again."""
    node, server = lab.nodes[0], single(lab)
    host = lab.host(node)
    assert node_record(lab, node)["state"] == "serving"
    captures = node_captures(lab, node)
    gpu = json.loads(host.check_output("python3 /opt/gpufleet/node/nvml_probe.py"))["gpus"][3]
    profile = tmp_path / "profile"
    write_sim_profile(profile, node.profile, [("dcgm_fail", 3, 50)], hostname=node.name)
    host.check_output(f"cp {SIM_PROFILE} {SIM_PROFILE}.saved")
    host.check_output(f"cat > {SIM_PROFILE} <<'EOF'\n{profile.read_text()}EOF")
    load = requests_to(lab, None, streams=2, pause_s=0.5, limit_s=240, limit=400).start()
    try:
        time.sleep(3)
        assert all(_taking_requests(v) for v in _router_view(lab, server))
        line = xid_line(gpu["pci_bus_id"], 79, "GPU has fallen off the bus.")
        found_at = time.monotonic()
        host.check_output(append_command(line))
        drained_at = None
        while time.monotonic() - found_at < 30:
            views = _router_view(lab, server)
            if not any(_taking_requests(v) for v in views):
                drained_at = time.monotonic()
                sent = [int(v["req_tot"]) for v in views]
                break
            time.sleep(0.1)
        assert drained_at is not None, f"{server} still takes requests at a router 30 s after the Xid"
        drained_s = drained_at - found_at
        time.sleep(3)  # no new request reaches it once drained, at either router
        assert [int(v["req_tot"]) for v in _router_view(lab, server)] == sent
        after = load.sent
        time.sleep(4)
        assert load.sent > after  # the other replica answers meanwhile
    finally:
        load.stop()
    record_figure(tmp_path_factory, {"figure": "finding to drained at every router", "node": node.name,
                                     "seconds": round(drained_s, 2)})
    assert drained_s <= DRAINED_WITHIN_S, f"drained {drained_s:.1f} s after the finding"
    assert load.failures == []  # lab1's requests in flight finished before it stopped; the pipeline failed none

    end = time.monotonic() + 60
    record = node_record(lab, node)
    while time.monotonic() < end and (record.get("last_burn_in") or {}).get("tier") != "full":
        time.sleep(1)
        record = node_record(lab, node)
    assert record["state"] == "quarantined", record["state"]
    move = next(h for h in record["history"] if h["to"] == "quarantined")
    assert move["why"] == f"Xid 79 on {gpu['pci_bus_id'].lower().split('.')[0][4:]}" and move["evidence"]["bucket"] \
        == "RESTART_BM"
    evidence = record["evidence"][-1]
    listed = host.check_output(f"ls {evidence}").split()
    assert {"record.json", "kernel.log", "gpus.json", "units.txt", "journal.txt"} <= set(listed), listed
    assert line in host.check_output(f"cat {evidence}/kernel.log")
    # and the last hour kept as a capture on lab1 itself (the node watch started its capture unit): Xid 79's line
    captured = wait_capture(lab, node, "node-quarantined", captures)
    assert "Xid" in host.check_output(f"tar -xzOf {node_paths.DIAG_CAPTURES_DIR}/{captured} kernel.log")
    assert not host.service(f"vllm@{server}").is_running
    failed = record["last_burn_in"]["failed"]  # dcgmi said Fail for GPU 3's memory test and exited 0
    assert [(c["check"], c["gpu"], c["evidence"]["test"], c["evidence"]["exit_status"]) for c in failed] == [
        ("dcgm-r3", 3, "memory", 0)]
    assert record["state"] == "quarantined"

    host.check_output(f"mv {SIM_PROFILE}.saved {SIM_PROFILE}")
    readmitted_by = _at(record["since"]).timestamp() + LAB_VARS["node_cool_off_s"] + 60
    while time.time() < readmitted_by and record["state"] != "serving":
        time.sleep(2)
        record = node_record(lab, node)
    assert record["state"] == "serving", record["history"][-3:]
    moves = [(h["from"], h["to"]) for h in record["history"]][-3:]
    assert moves == [("serving", "quarantined"), ("quarantined", "burn-in"), ("burn-in", "serving")], moves
    assert record["clean_passes"] >= 2 and record["last_burn_in"] == {**record["last_burn_in"], "tier": "full",
                                                                      "passed": True}
    wait_serving(lab, node, timeout=300)
    end = time.monotonic() + 60
    while time.monotonic() < end and not all(_taking_requests(v) for v in _router_view(lab, server)):
        time.sleep(1)
    assert all(_taking_requests(v) for v in _router_view(lab, server))


def gpufleet_nodes(lab: Lab, *args: str) -> Completed:
    """``gpufleet nodes`` on the lab's inventory, as an operator runs it."""
    return run([str(PYINFRA.with_name("gpufleet")), "nodes", INVENTORY, *args], lab.env, 300)


def test_three_quarantines_retire_a_node_and_a_suspect_last_replica_keeps_serving(
        lab: Lab, faults: Completed | None) -> None:
    """People's moves through ``gpufleet nodes``: bad input is refused with one line before any node changes; lab1's
    quarantines (the Xid test's, then two by hand, each readmitted in between) retire it, with a note for the vendor.
    With lab1 out, the pipeline replica is the model's last: an Xid 92 (a high single-bit ECC rate: non-critical) on
    its first node makes that node suspect, and it keeps serving while NodeSuspect alerts. Both come back."""
    node, leader = lab.nodes[0], lab.nodes[1]
    for args, line in (
            (("quarantine", "10.0.0.99", "--why", "x"), f"{INVENTORY}: HOST: expected a host of the inventory"),
            (("quarantine", node.address, "--why", "a\tb"), "gpufleet nodes quarantine: --why: expected 1 to 200"),
            (("readmit", node.address, "--why", "fixed"), f"gpufleet nodes readmit: {node.address}: cannot readmit a"
                                                          " node that is serving")):
        refused = gpufleet_nodes(lab, *args)
        assert (refused.rc, refused.err.splitlines()[-1][:len(line)]) == (2, line), refused.err
        assert "Traceback" not in refused.err
    assert node_record(lab, node)["state"] == "serving"
    for turn in range(2):
        done = gpufleet_nodes(lab, "quarantine", node.address, "--why", f"fan noise {turn}")
        assert done.rc == 0, done.err
        if turn == 0:
            done = gpufleet_nodes(lab, "readmit", node.address, "--why", "fan replaced")
            assert done.rc == 0, done.err
            end = time.monotonic() + 60
            while node_record(lab, node)["state"] != "serving" and time.monotonic() < end:
                time.sleep(1)
            assert node_record(lab, node)["state"] == "serving", "not readmitted within 60 s"
    record = node_record(lab, node)
    assert record["state"] == "retired", [(h["to"], h["why"]) for h in record["history"]]
    note = record["history"][-1]["evidence"]["vendor_note"]
    assert "after 3 quarantines" in note and "fan noise 1" in note and "Xid 79" in note, note
    listed = gpufleet_nodes(lab)
    assert listed.rc == 0 and f"{node.address}: retired since" in listed.out, listed.out + listed.err
    kept = json.loads(lab.host(node).check_output(f"cat /var/lib/gpufleet/nodes/{node.address}.json"))
    assert kept["state"] == "retired" and kept["history"] == record["history"]  # the monitoring host's copy

    gpu = json.loads(lab.host(leader).check_output("python3 /opt/gpufleet/node/nvml_probe.py"))["gpus"][0]
    load = requests_to(lab, None, streams=1, pause_s=1.0, limit_s=120, limit=60).start()
    try:
        lab.host(leader).check_output(append_command(xid_line(gpu["pci_bus_id"], 92, "High single-bit ECC error rate")))
        prometheus = Prometheus(lab.nodes[0])
        fired, _ = wait_for("NodeSuspect", lambda: prometheus.firing().get("NodeSuspect"), timeout=60, every=2)
        assert [a["node"] for a in fired] in ([leader.name], [leader.address]), fired
        assert node_record(lab, leader)["state"] == "suspect"
        sent = load.sent
        time.sleep(3)
        assert load.sent > sent  # the model's last replica still answers
    finally:
        load.stop()
    assert load.failures == [], load.failures[:3]
    done = gpufleet_nodes(lab, "readmit", leader.address, "--why", "ECC rate checked")  # suspect: cleared
    assert done.rc == 0 and node_record(lab, leader)["state"] == "serving", done.err
    done = gpufleet_nodes(lab, "readmit", node.address, "--why", "repaired", "--force")
    assert done.rc == 0, done.err
    end = time.monotonic() + 60
    while node_record(lab, node)["state"] != "serving" and time.monotonic() < end:
        time.sleep(1)
    assert node_record(lab, node)["state"] == "serving"
    wait_serving(lab, node, timeout=300)  # the faults that follow start from a serving fleet
