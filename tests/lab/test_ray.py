"""The pipeline pool on Ray (scenario ``ray``, the last: the lab is not taken back to vLLM's mp backend).

``deploys/vllm.py --data vllm_distributed_backend=ray --data vllm_start=false --limit lab_pipeline`` leaves the
pipeline pool's Ray units running: the head on lab2, a worker on lab3, vLLM staged but not started (the CPU build
refuses Ray's executor). lab1 is not deployed: it stands for any other machine on the fleet network, while the
controller's side of the lab (the bridge address) is the monitoring host (``monitoring_addresses`` in
inventories/lab/inventory.py).
"""

from __future__ import annotations

import ipaddress
import json
import re
import shlex
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml
from gpufleet_lab.nodes import RAY_TOKEN_FILE
from gpufleet_lab.state import NodeRecord

from gpufleet import node_paths
from gpufleet.units.security import EXPOSURE_BOUND
from roles import ray as ray_role
from tests.lab.checks import assert_no_errors, metrics
from tests.lab.fleet import DCGM_EXPORTER, NODE_EXPORTER, PIPELINE, RAY_PORT, exposures, reach
from tests.lab.harness import LAB_VARS, LAB_VENV, Completed, Lab

pytestmark = pytest.mark.filterwarnings("ignore:Unknown ssh-ed25519 host key:UserWarning")


def _as_vllm(script: str, with_token: bool) -> str:
    """A Ray driver run as user vllm on the head, with the replica's token in its environment or without."""
    token = (f"set -a; . {node_paths.ray_token_file(PIPELINE)}; set +a; export RAY_AUTH_MODE=token; " if with_token
             else "unset RAY_AUTH_TOKEN RAY_AUTH_TOKEN_PATH RAY_AUTH_MODE; ")
    return f"{token}cd /tmp && runuser -u vllm -- timeout 120 {LAB_VENV}/bin/python -c {shlex.quote(script)} 2>&1"


@pytest.fixture
def ray_cluster(lab: Lab, ray: Completed | None) -> tuple[NodeRecord, NodeRecord]:
    """The pipeline pool's Ray head (lab2) and worker (lab3), joined with the token."""
    return lab.nodes[1], lab.nodes[2]


def test_ray_units_form_a_cluster_across_two_nodes(lab: Lab, ray: Completed | None) -> None:
    """The deploy that brought the lab to its scenario (the pipeline pool on Ray): the CPU build refuses vLLM's Ray
    executor, so on the lab the Ray replica is staged, not started."""
    assert ray is not None
    assert_no_errors(ray)
    head, worker = lab.nodes[1], lab.nodes[2]
    unit = f"gpufleet-ray-{PIPELINE}"
    assert lab.host(head).service(unit).is_running and lab.host(worker).service(unit).is_running
    status = lab.host(head).check_output(  # Ray asks for its token (refused without: the next test)
        f"set -a; . /etc/gpufleet/secrets/{PIPELINE}.ray.env; set +a; RAY_AUTH_MODE=token"
        f" {LAB_VENV}/bin/ray status --address={head.address}:6379")
    active = status.split("Active:")[1].split("Pending:")[0]
    assert active.count(" node_") == 2, status
    for node in (head, worker):
        unit_text = lab.host(node).file(f"/etc/systemd/system/{unit}.service").content_string
        assert f"--node-ip-address={node.address}" in unit_text
        env = lab.host(node).file(f"/etc/gpufleet/ray/{PIPELINE}.env").content_string
        assert 'NCCL_SOCKET_IFNAME="host0"' in env and f'RAY_ADDRESS="{head.address}:6379"' in env
    head_unit = lab.host(head).file(f"/etc/systemd/system/{unit}.service").content_string
    assert "--include-dashboard=false" in head_unit
    listening = lab.host(head).check_output("ss -ltnH")
    assert ":8265 " not in listening and ":6386 " not in listening  # no dashboard
    # vLLM is staged on the head with the Ray executor; the worker node runs no vLLM of its own
    config = yaml.safe_load(lab.host(head).file(f"/etc/gpufleet/vllm/{PIPELINE}/config.yaml").content_string)
    assert config["distributed-executor-backend"] == "ray" and "nnodes" not in config
    assert not lab.host(head).service(f"vllm@{PIPELINE}").is_running
    assert not lab.host(worker).file(f"/etc/gpufleet/vllm/{PIPELINE}").exists


def test_ray_refuses_a_driver_and_a_node_without_the_token(lab: Lab, ray_cluster: tuple[NodeRecord, ...]) -> None:
    head, worker = ray_cluster
    gcs = f"{head.address}:{RAY_PORT}"
    # Ray retries a refused connection once a second, 20 times unless RAY_gcs_server_port_wait_time_s says how many
    # (its node.py): each refused party here tries 3 times (4 to 6 s, not 20); a refusal is one either way
    retries = "export RAY_gcs_server_port_wait_time_s=3; "
    driver = retries + _as_vllm(f"import ray; ray.init(address={gcs!r}); print('JOINED')", with_token=False)
    # a second Ray node on the worker's machine (a member's address: the IP filter lets it through)
    join = (f"{retries}cd /tmp && timeout 90 {LAB_VENV}/bin/ray start --address={gcs}"
            f" --node-ip-address={worker.address} --temp-dir=/tmp/gpufleet-no-token --disable-usage-stats --block 2>&1;"
            " echo rc=$?; rm -rf /tmp/gpufleet-no-token")
    with ThreadPoolExecutor(2) as pool:  # each is refused after its retries: at once
        refused_driver = pool.submit(lab.host(head).run, driver)
        refused_node = pool.submit(lab.host(worker).run, join)
        driven, joined = refused_driver.result(), refused_node.result()
    assert driven.rc != 0 and "JOINED" not in driven.stdout, driven.stdout[-2000:]
    assert "InvalidAuthToken" in driven.stdout, driven.stdout[-2000:]
    assert "rc=0" not in joined.stdout and "InvalidAuthToken" in joined.stdout, joined.stdout[-2000:]
    # still the two nodes of the replica, and no Ray process left behind by the refused one
    status = lab.host(head).check_output(
        f"set -a; . {node_paths.ray_token_file(PIPELINE)}; set +a; RAY_AUTH_MODE=token {LAB_VENV}/bin/ray status"
        f" --address={gcs}")
    assert status.split("Active:")[1].split("Pending:")[0].count(" node_") == 2, status
    assert "gpufleet-no-token" not in lab.host(worker).check_output("ps -eo args")


def test_ray_runs_a_driver_with_the_token(lab: Lab, ray_cluster: tuple[NodeRecord, ...]) -> None:
    head, _ = ray_cluster
    script = (f"import ray; ray.init(address='{head.address}:{RAY_PORT}', log_to_driver=False);"
              " print('ALIVE', sum(n['Alive'] for n in ray.nodes()), 'ANSWER', ray.get(ray.remote(lambda: 6 * 7)"
              ".remote()))")
    done = lab.host(head).run(_as_vllm(script, with_token=True))
    assert done.rc == 0 and "ALIVE 2 ANSWER 42" in done.stdout, done.stdout[-2000:]


def test_the_ray_token_is_root_only_and_the_client_server_off(lab: Lab, ray_cluster: tuple[NodeRecord, ...]) -> None:
    token = (lab.directory / RAY_TOKEN_FILE).read_text().strip()
    for node in ray_cluster:
        host = lab.host(node)
        secret = host.file(node_paths.ray_token_file(PIPELINE))
        assert (secret.user, secret.group, secret.mode) == ("root", "root", 0o600)
        assert host.run(f"runuser -u vllm -- cat {node_paths.ray_token_file(PIPELINE)}").rc != 0
        assert token not in host.check_output("ps -eo args")
        unit = f"/etc/systemd/system/{ray_role.unit_name(PIPELINE)}"
        visible = host.run(f"grep -rl -- {shlex.quote(token)} {unit} /etc/gpufleet/ray /var/log 2>/dev/null")
        assert visible.stdout.strip() == "", visible.stdout
    listening = lab.host(ray_cluster[0]).check_output("ss -ltnH")
    for port in (RAY_PORT + 8, 10001):  # gpufleet's client server port, Ray's default one
        assert f":{port} " not in listening, listening


def test_only_the_replicas_nodes_reach_ray(lab: Lab, ray_cluster: tuple[NodeRecord, ...]) -> None:
    """A member reaches the Ray ports; an address no list names does not. lab1 is a monitoring host (its
    Prometheus scrapes Ray's metrics, and a unit's IP filter covers all its ports), so the outsider is a second
    address given to lab1 for this test."""
    head, worker = ray_cluster
    # GCS, node manager and object manager of the head; the worker's node manager and object manager
    ray_ports = [f"{head.address}:{p}" for p in (RAY_PORT, RAY_PORT + 1, RAY_PORT + 2)] + [
        f"{worker.address}:{p}" for p in (RAY_PORT + 1, RAY_PORT + 2)]
    assert reach(lab, worker, ray_ports[:3]) == dict.fromkeys(ray_ports[:3], True)  # a member
    host = lab.nodes[0]
    outsider = str(ipaddress.ip_network(lab.state.subnet)[250])
    lab.host(host).check_output(f"ip address add {outsider}/32 dev host0")
    try:
        assert reach(lab, host, ray_ports, source=outsider) == dict.fromkeys(ray_ports, False)
    finally:
        lab.host(host).run(f"ip address del {outsider}/32 dev host0")


def test_only_the_node_and_the_monitoring_hosts_reach_the_exporters(
    lab: Lab, ray_cluster: tuple[NodeRecord, ...]
) -> None:
    monitoring = lab.nodes[0]  # the inventory's monitoring group: its Prometheus scrapes every node
    exporters = [f"{n.address}:{p}" for n in lab.nodes[1:] for p in (NODE_EXPORTER, DCGM_EXPORTER)]
    assert reach(lab, monitoring, exporters) == dict.fromkeys(exporters, True)
    # a member of the same replica is no monitoring host, nor is a node outside it
    head, worker = ray_cluster
    theirs = [f"{head.address}:{p}" for p in (NODE_EXPORTER, DCGM_EXPORTER)]
    assert reach(lab, worker, theirs) == dict.fromkeys(theirs, False)
    assert monitoring not in ray_cluster
    outside = [f"{monitoring.address}:{p}" for p in (NODE_EXPORTER, DCGM_EXPORTER)]
    assert reach(lab, worker, outside) == dict.fromkeys(outside, False)
    for node in lab.nodes:  # so does this machine, on the lab bridge (monitoring_addresses)
        assert "node_load1" in metrics(node, NODE_EXPORTER) and "DCGM_FI_" in metrics(node, DCGM_EXPORTER)
        listening = lab.host(node).check_output("ss -ltnH")
        assert f"{node.address}:{DCGM_EXPORTER} " in listening and f"*:{DCGM_EXPORTER} " not in listening


def _ray_nodes(lab: Lab, head: NodeRecord) -> int:
    """How many nodes the head's ``ray status`` counts active (0: it does not answer)."""
    status = lab.host(head).run(
        f"set -a; . {node_paths.ray_token_file(PIPELINE)}; set +a; RAY_AUTH_MODE=token timeout 60 {LAB_VENV}/bin/ray"
        f" status --address={head.address}:{RAY_PORT}")
    if status.rc != 0 or "Active:" not in status.stdout:
        return 0
    return status.stdout.split("Active:")[1].split("Pending:")[0].count(" node_")


def test_after_a_reboot_of_every_node_the_ray_cluster_forms_and_vllms_join_wait_passes(
        lab: Lab, ray_cluster: tuple[NodeRecord, ...], tmp_path_factory: pytest.TempPathFactory) -> None:
    """Both nodes of the Ray replica reboot at once, no deploy: the head comes up, the worker's unit retries until
    it joins, and the head's vLLM unit, ordered after the Ray head, passes its join wait (ExecStartPre) and the
    replica's fabric check that follows it, run through Ray on both nodes."""
    head, worker = ray_cluster
    drop_in = lab.host(head).file(node_paths.vllm_ray_drop_in(PIPELINE)).content_string
    assert f"Requires={ray_role.unit_name(PIPELINE)}" in drop_in and f"After={ray_role.unit_name(PIPELINE)}" in drop_in
    rebooted = time.monotonic()
    lab.reboot(worker, head)  # both at once, until both booted again
    end, joined = time.monotonic() + 300, 0
    while time.monotonic() < end and joined < 2:
        time.sleep(3)
        try:
            joined = _ray_nodes(lab, head)
        except Exception:  # noqa: BLE001 - the node is still rebooting: no SSH yet
            joined = 0
    formed = time.monotonic() - rebooted
    assert joined == 2, "the Ray cluster did not form again after the reboot"
    wait = next(line.split("=", 1)[1] for line in drop_in.splitlines() if line.startswith("ExecStartPre="))
    env = f"{node_paths.replica_dir(PIPELINE)}/vllm.env"
    done = lab.host(head).run(f"set -a; . {env}; . {node_paths.replica_secrets(PIPELINE)}; set +a;"
                              f" cd /tmp && runuser -u vllm -- {wait}")
    assert done.rc == 0, done.stdout + done.stderr
    # then the replica's fabric check, one rank in a Ray task on each node, the head leading: it passed, over both
    checked = re.search(r"fabric check passed, bus bandwidth ([\d.]+) GB/s in ([\d.]+) s over (\S+), (\S+) \(",
                        done.stderr)
    assert checked is not None and {checked[3], checked[4]} == {head.name, worker.name}, done.stderr
    assert float(checked[1]) >= LAB_VARS["node_fabric_floor_gbps"]
    figure = {"fault": "reboot of every node of a Ray replica (vLLM staged: the CPU build refuses Ray)",
              "replica": PIPELINE, "cluster_formed_again_s": round(formed, 1), "join_wait": "passed",
              "fabric_check_s": float(checked[2]), "fabric_busbw_gbps": float(checked[1])}
    with (tmp_path_factory.getbasetemp() / "lab-fault-figures.jsonl").open("a") as figures:
        figures.write(json.dumps(figure) + "\n")


def test_ray_units_are_confined(lab: Lab, ray_cluster: tuple[NodeRecord, ...]) -> None:
    worst = exposures(lab)
    assert worst.get("gpufleet-ray-*.service", 10.0) <= EXPOSURE_BOUND, worst

