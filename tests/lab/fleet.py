"""The lab fleet as the lab tests drive it: its deploys, its replicas and routers, requests, and fault figures.

inventories/lab/inventory.py: lab1 (pool lab_single) serves the tiny model on its own and holds a router and Prometheus;
lab2 and lab3 (pool lab_pipeline) serve one replica with pipeline parallel 2 (lab2 is rank 0, the API); lab2 holds
the other router. Clients reach the routers through their virtual address over HTTPS (the lab's CA) with the
client key; the replicas' own key is for the routers, and for the tests that ask a replica directly.
"""

from __future__ import annotations

import ipaddress
import json
import shlex
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from gpufleet_lab.hooks import SIM_PROFILE_PATH
from gpufleet_lab.mirror import ADAPTERS_DIR
from gpufleet_lab.network import virtual_address
from gpufleet_lab.nodes import API_KEY_FILE, CLIENT_KEY_FILE, TLS_DIR
from gpufleet_lab.request_load import RequestLoad
from gpufleet_lab.state import NodeRecord, cache_dir
from gpufleet_lab.tiny_adapters import LAB_ADAPTERS, TinyAdapter, declared

from gpufleet.node.router_admin import parse_table
from tests.lab.checks import main_pid, metrics
from tests.lab.harness import LAB_FLEET, PYINFRA, ROOT, Completed, Lab, run

INVENTORY = "inventories/lab/inventory.py"
DEPLOY = "deploys/vllm.py"
PROVISION = "deploys/provision.py"
# A kernel module that does not match the driver package: a copy of the node's NVML simulator profile that reports
# OLD_MODULE, bind-mounted over it (tests/lab/conftest.py's old_module_loaded); a reboot drops the mount, as it would
# load the installed module.
SIM_PROFILE = "/" + SIM_PROFILE_PATH
OLD_MODULE = "580.65.06"
PORT = 8000
SINGLE = "lab_single-{}"
PIPELINE = "lab_pipeline-0"
ROUTER_PORT = 8080
ROUTER_METRICS_PORT = 8405
ROUTER_ADMIN = "python3 /opt/gpufleet/node/router_admin.py"
NODE_WATCH = "python3 /opt/gpufleet/node/node_watch.py"
DIAG_COLLECT = "python3 -I /opt/gpufleet/node/diag_collect.py"
LIFECYCLE_CONFIG = "/etc/gpufleet/lifecycle.json"
RAY_PORT, NODE_EXPORTER, DCGM_EXPORTER, RENDEZVOUS = 6379, 9100, 9400, 29501
# ``show table <name>`` on a router's runtime API, with the node tool's own client
SHOW_TABLE = ("import sys; sys.path.insert(0, '/opt/gpufleet/node'); from router_admin import DEFAULT_SOCKET, Runtime;"
              " print(Runtime(DEFAULT_SOCKET).ask('show', 'table', sys.argv[1]), end='')")
CONNECT_TIMEOUT = 3.0
# Every target at once from one node: "address:port" -> whether a TCP connection was accepted.
PROBE = """
import json, socket, sys
from concurrent.futures import ThreadPoolExecutor
source = (sys.argv[2], 0) if sys.argv[2] else None
def reach(target):
    address, port = target.rsplit(":", 1)
    try:
        socket.create_connection((address, int(port)), timeout=float(sys.argv[1]), source_address=source).close()
        return True
    except OSError:
        return False
print(json.dumps(dict(zip(sys.argv[3:], ThreadPoolExecutor(16).map(reach, sys.argv[3:])))))
"""
RAY = ("--data", "vllm_distributed_backend=ray", "--data", "vllm_start=false", "--limit", "lab_pipeline")
"""The pipeline pool on Ray: the CPU build refuses vLLM's Ray executor, so vLLM is staged, not started. Only the
pool's nodes are deployed: lab1 stands for any other machine (in a full run, the last ``changed`` test leaves it
a dedicated router host, its replica retired)."""


def served_name(group: str) -> str:
    """The model name a pool serves under, as its group_vars give it (lab_single's may be hostile text)."""
    for name in (group, "lab"):
        data = yaml.safe_load((LAB_FLEET / "group_vars" / f"{name}.yml").read_text()) or {}
        if data.get("vllm_served_model_name"):
            return str(data["vllm_served_model_name"])
    raise AssertionError(f"no vllm_served_model_name for {group}")


def deploy(lab: Lab, *options: str, playbook: str = DEPLOY, inventory: str = INVENTORY,
           timeout: float = 1800) -> Completed:
    """``pyinfra INVENTORY PLAYBOOK -y OPTIONS`` against the lab."""
    return run([str(PYINFRA), inventory, playbook, "-y", *options], lab.env, timeout)


def lab_copy(directory: Path, extra: dict[str, str]) -> str:
    """The lab inventory and group_vars copied into ``directory``, each group file named in ``extra`` (by group)
    with that YAML text added; the copy's inventory path."""
    copy = directory / LAB_FLEET.name  # a fleet's directory works wherever it is: its group_vars are beside it
    shutil.copytree(LAB_FLEET, copy)
    for group, text in extra.items():
        with (copy / "group_vars" / f"{group}.yml").open("a") as handle:
            handle.write(text)
    return str(copy / "inventory.py")


def lab_adapters(more: tuple[TinyAdapter, ...] = ()) -> dict[str, dict[str, str]]:
    """The LoRA adapters lab_single declares (inventories/lab/inventory.py), and ``more`` of those the lab's mirror
    made: ``vllm_lora_adapters`` as the inventory declares them."""
    return declared(cache_dir() / ADAPTERS_DIR, (*LAB_ADAPTERS, *more))


def single(lab: Lab) -> str:
    """lab1's replica (pool lab_single): named after its node's address."""
    return SINGLE.format(lab.nodes[0].address.replace(".", "-"))


def api_key(lab: Lab) -> str:
    """The replicas' key: what the routers send upstream, and what a request straight to a replica needs."""
    return (lab.directory / API_KEY_FILE).read_text().strip()


def client_key(lab: Lab) -> str:
    """The key of the routers' client ``lab``: what a request through the routers needs."""
    return (lab.directory / CLIENT_KEY_FILE).read_text().strip()


def lab_ca(lab: Lab) -> str:
    """The lab CA's certificate (the routers' certificate chains to it)."""
    return str(lab.directory / TLS_DIR / "ca.crt")


def router_address(lab: Lab) -> str:
    """Where clients reach the routers: their virtual address on the lab bridge (lab1's own with one node)."""
    if len(lab.nodes) < 2:
        return lab.nodes[0].address
    return str(virtual_address(ipaddress.ip_network(lab.state.subnet)))


def router_url(lab: Lab) -> str:
    return f"https://{router_address(lab)}:{ROUTER_PORT}"


def holds_address(lab: Lab, router: NodeRecord) -> bool:
    """Whether ``router``'s interface holds the routers' virtual address now."""
    return f" {router_address(lab)}/" in lab.host(router).run("ip -4 -o address show dev host0").stdout


def address_holder(lab: Lab) -> NodeRecord | None:
    """The router whose interface holds the virtual address now (None: no router does)."""
    return next((node for node in lab.nodes[:2] if holds_address(lab, node)), None)


def tls(lab: Lab) -> ssl.SSLContext:
    """A client context that trusts the lab CA only."""
    return ssl.create_default_context(cafile=lab_ca(lab))


def http(url: str, body: dict[str, Any] | None = None, key: str | None = None,
         timeout: float = 120, context: ssl.SSLContext | None = None) -> tuple[int, str]:
    """A GET (or, with ``body``, a JSON POST): status and text, an HTTP error's included; ``context`` for https."""
    request = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                     method="GET" if body is None else "POST")
    request.add_header("Content-Type", "application/json")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def model_of(lab: Lab, node: NodeRecord) -> str:
    """The name the replica on ``node`` serves under: lab1 is in lab_single, the others in lab_pipeline."""
    return served_name("lab_single" if node == lab.nodes[0] else "lab_pipeline")


def completion_tokens(lab: Lab, node: NodeRecord) -> int:
    """One completion straight from the replica whose API is on ``node``: its token count."""
    status, body = http(f"http://{node.address}:{PORT}/v1/completions",
                        {"model": model_of(lab, node), "prompt": "The fleet is", "max_tokens": 8, "temperature": 0},
                        api_key(lab))
    assert status == 200, body
    return int(json.loads(body)["usage"]["completion_tokens"])


def router_completion_tokens(lab: Lab) -> int:
    """One completion through the routers' virtual address (the ``routers`` group of inventories/lab/inventory.py)."""
    status, body = http(f"{router_url(lab)}/v1/completions",
                        {"model": served_name("lab"), "prompt": "The fleet is", "max_tokens": 8,
                         "temperature": 0}, client_key(lab), context=tls(lab))
    assert status == 200, body
    return int(json.loads(body)["usage"]["completion_tokens"])


def router_servers(lab: Lab) -> dict[str, dict[str, object]]:
    """The router's servers (replicas) as its runtime API shows them, read on lab1 with router_admin.py."""
    shown = json.loads(lab.host(lab.nodes[0]).check_output(f"{ROUTER_ADMIN} show"))
    return {entry["server"]: entry for entry in shown["servers"]}


def router_table(lab: Lab, router: NodeRecord, table: str) -> dict[str, dict[str, int]]:
    """One of ``router``'s stick tables as its runtime API shows it: each entry's data by its key."""
    shown = lab.host(router).check_output(f"python3 -I -c {shlex.quote(SHOW_TABLE)} {shlex.quote(table)}")
    return parse_table(shown)


def wait_router_status(lab: Lab, server: str, status: str, timeout: float) -> None:
    end = time.monotonic() + timeout
    found: object = None
    while time.monotonic() < end:
        found = router_servers(lab)[server]["status"]
        if found == status:
            return
        time.sleep(0.5)
    pytest.fail(f"the router shows {server} {found}, not {status}, after {timeout} s")


def router_counter(lab: Lab, name: str) -> float:
    """The sum of one of HAProxy's Prometheus counters over its backends and both routers (clients reach the one
    that holds the virtual address), read from the bridge."""
    return sum(float(line.rsplit(" ", 1)[1]) for router in lab.nodes[:2]
               for line in metrics(router, ROUTER_METRICS_PORT).splitlines() if line.startswith(name + "{"))


def router_retries(lab: Lab) -> float:
    """Requests the router sent again (to the same replica, or redispatched to another), over every backend."""
    return sum(router_counter(lab, f"haproxy_backend_{kind}_warnings_total") for kind in ("retry", "redispatch"))


def wait_serving(lab: Lab, node: NodeRecord, timeout: float = 600) -> None:
    """Until the replica whose API is on ``node`` answers a completion."""
    end = time.monotonic() + timeout
    last = ""
    while time.monotonic() < end:
        try:
            if completion_tokens(lab, node) > 0:
                return
        except (OSError, AssertionError) as exc:
            last = str(exc)
        time.sleep(3)
    pytest.fail(f"{node.name} did not serve again within {timeout} s: {last}")


def node_record(lab: Lab, node: NodeRecord) -> dict[str, Any]:
    """``node``'s lifecycle record, as its watch keeps it."""
    return dict(json.loads(lab.host(node).check_output(f"{NODE_WATCH} show --config {LIFECYCLE_CONFIG}")))


def node_captures(lab: Lab, node: NodeRecord) -> list[str]:
    """The captures kept on ``node`` (its own, or a rollout's on a monitoring host), newest first."""
    return [c["name"] for c in json.loads(lab.host(node).check_output(f"{DIAG_COLLECT} captures"))]


def wait_capture(lab: Lab, node: NodeRecord, reason: str, before: list[str], timeout: float = 90) -> str:
    """The capture for ``reason`` (its name's words) that ``node`` kept after ``before`` (its captures then), once
    there."""
    suffix = f"-{reason}.tar.gz"
    end = time.monotonic() + timeout
    while True:
        new = [name for name in node_captures(lab, node) if name not in before and name.endswith(suffix)]
        if new or time.monotonic() > end:
            break
        time.sleep(2)
    assert new, f"no capture *{suffix} on {node.name} within {timeout:g} s: {node_captures(lab, node)}"
    return new[0]


def restore_nodes(lab: Lab, timeout: float = 300) -> None:
    """After a failed test: every node's NVML simulator profile as booted (a lifecycle test saves it as ``.saved``)
    and every node back in service the way a person brings it back: a suspect one cleared, one out of service sent
    to burn-in with --force, whose clean passes readmit it. A deploy leaves a node's state alone, so a test that
    failed with lab1 quarantined would otherwise leave NodeQuarantined firing for every later test."""
    why = "--why 'lab: after a failed test'"
    for node in lab.nodes:
        host = lab.host(node)
        host.run(f"test -e {SIM_PROFILE}.saved && mv -- {SIM_PROFILE}.saved {SIM_PROFILE}")
        shown = host.run(f"{NODE_WATCH} show --config {LIFECYCLE_CONFIG}")
        if shown.rc != 0:
            continue  # no lifecycle on the node (not deployed yet)
        state = json.loads(shown.stdout)["state"]
        if state == "suspect":
            host.check_output(f"{NODE_WATCH} move --config {LIFECYCLE_CONFIG} --to serving {why}")
        elif state in ("quarantined", "retired"):
            host.check_output(f"{NODE_WATCH} move --config {LIFECYCLE_CONFIG} --to burn-in --force {why}")
    def out(node: NodeRecord) -> bool:
        shown = lab.host(node).run(f"{NODE_WATCH} show --config {LIFECYCLE_CONFIG}")
        return shown.rc == 0 and json.loads(shown.stdout)["state"] not in ("serving", "new")

    end = time.monotonic() + timeout
    left = [n.name for n in lab.nodes]
    while left and time.monotonic() < end:
        left = [n.name for n in lab.nodes if out(n)]
        if left:
            time.sleep(2)
    assert not left, f"not back in service {timeout} s after a failed test: {left}"


def vllm_child(lab: Lab, node: NodeRecord, unit: str) -> int:
    """The vLLM process replica_rank.py runs for ``unit`` on ``node`` (0: none yet)."""
    supervisor = main_pid(lab, node, unit)
    found = lab.host(node).run(f"pgrep -P {supervisor} -f 'vllm serve'").stdout.split()
    return int(found[0]) if supervisor and found else 0


def requests_to(lab: Lab, node: NodeRecord | None, **options: Any) -> RequestLoad:
    """Completions against the replica on ``node`` (or, with ``node`` None, through the router), one every 3 s
    unless ``pause_s`` says otherwise: what must keep answering while another replica fails. Spaced out because
    the lab's CPU vLLMs share this machine's two cores: a replica kept busy starves the one restarting."""
    if node is None:
        return RequestLoad(router_url(lab), served_name("lab"), client_key(lab), ca_file=lab_ca(lab), **options)
    return RequestLoad(f"http://{node.address}:{PORT}", model_of(lab, node), api_key(lab), **options)


def record_figure(tmp_path_factory: pytest.TempPathFactory, figure: dict[str, object]) -> None:
    """Add one fault's figure to the session's lab-fault-figures.jsonl, beside its temporary files."""
    with (tmp_path_factory.getbasetemp() / "lab-fault-figures.jsonl").open("a") as figures:
        figures.write(json.dumps(figure) + "\n")


def reach(lab: Lab, node: NodeRecord, targets: list[str], source: str = "") -> dict[str, bool]:
    """From ``node`` (from its address ``source``, when given): which of ``targets`` (address:port) accept a TCP
    connection."""
    out = lab.host(node).check_output(f"python3 -c {shlex.quote(PROBE)} {CONNECT_TIMEOUT} {shlex.quote(source)}"
                                      f" {' '.join(shlex.quote(t) for t in targets)}")
    return json.loads(out)


def controller_reaches(target: str) -> bool:
    address, port = target.rsplit(":", 1)
    try:
        socket.create_connection((address, int(port)), timeout=CONNECT_TIMEOUT).close()
        return True
    except OSError:
        return False


def exposures(lab: Lab) -> dict[str, float]:
    """bench/unit_security.py's worst exposure per unit; it exits non-zero when one is above the bound."""
    done = subprocess.run([sys.executable, "bench/unit_security.py"], cwd=ROOT, env=lab.env,
                          capture_output=True, text=True, timeout=300)
    print(done.stdout)  # the measured scores, for the record (pytest -s)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr
    return json.loads(done.stdout)["worst"]


# One prompt, greedy and seeded: the same weights give the same text (tests/lab/test_adapters.py, test_faults.py).
SEEDED_PROMPT = {"prompt": "The fleet serves", "max_tokens": 8, "temperature": 0, "seed": 1}


def seeded_completion(lab: Lab, model: str) -> tuple[int, str]:
    """The status and body of SEEDED_PROMPT's completion for ``model`` (a model or an adapter) through the routers."""
    return http(f"{router_url(lab)}/v1/completions", {"model": model, **SEEDED_PROMPT}, client_key(lab),
                context=tls(lab))


def completion_text(body: str) -> str:
    """The text of a completion's first choice."""
    return str(json.loads(body)["choices"][0]["text"])
