"""A replica's vLLM killed (``kill -9``) under load on the running lab: what clients see, what was in flight on it,
and whether it takes requests again once systemd has restarted it.

    GPUFLEET_LAB_LAYOUT=singles make lab          # three replicas of one shape, router_policy prefix
    python bench/replica_kill.py                  # 4 client streams, the busiest replica at the kill
    python bench/replica_kill.py --streams 2,4 --after-s 60

Needs the lab up and deployed (``$GPUFLEET_LAB_DIR`` picks another). For each size (client streams through the
routers' virtual address, over TLS with the lab client's key, each a completion and a turn of its multi-turn
conversation in turn, one request a second: ``gpufleet_lab.request_load``) it loads the fleet for ``--before-s``,
reads on the routers how many requests each replica holds, kills the busiest one's vLLM main process, waits until
systemd has restarted it and the router shows it UP again, then loads the fleet for ``--after-s`` more. Prints
JSON per size: the requests sent and failed, and why; the requests in flight on the replica at the kill (the
routers' count on lab1 and lab2, read just before it); seconds until the router took it out and until it was UP
again; and the requests the replica answered after it was back (its ``vllm:request_success_total``) against the
mean of the others.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from gpufleet_lab.network import virtual_address
from gpufleet_lab.nodes import CLIENT_KEY_FILE, TLS_DIR
from gpufleet_lab.request_load import RequestLoad
from gpufleet_lab.state import NodeRecord, lab_dir, load_state, ssh_config_path

ROOT = Path(__file__).resolve().parents[1]
ROUTER_PORT, REPLICA_PORT = 8080, 8000  # roles/router/defaults.yml, the lab's replicas
ROUTER_ADMIN = "python3 /opt/gpufleet/node/router_admin.py"  # the node tool, as the router role installs it
SUCCESS = "vllm:request_success_total"
LIMIT_S = 900  # one size, at most: a restart of the CPU build takes a minute or two


def ssh(node: NodeRecord, command: str) -> str:
    """``command``'s output on ``node``, over the lab's SSH configuration."""
    return subprocess.run(["ssh", "-F", str(ssh_config_path()), node.name, command], check=True,
                          capture_output=True, text=True, timeout=60).stdout


def replica_unit(node: NodeRecord) -> str:
    """The one vLLM replica unit on ``node`` (``vllm@<replica>.service``)."""
    units = ssh(node, "systemctl list-units --plain --no-legend --type=service 'vllm@*'").split()
    found = [word for word in units if word.startswith("vllm@")]
    if len(found) != 1:
        sys.exit(f"{node.name}: expected one vLLM replica unit, found {found}")
    return found[0]


def router_servers(router: NodeRecord) -> dict[str, dict[str, Any]]:
    """Every server as ``router`` shows it (status, admin, scur: requests in flight), by name."""
    return {entry["server"]: entry for entry in json.loads(ssh(router, f"{ROUTER_ADMIN} show"))["servers"]}


def in_flight(routers: list[NodeRecord]) -> dict[str, int]:
    """The requests each server holds, over every router (the one with the virtual address has them): one
    ``show`` per router."""
    held: dict[str, int] = {}
    for router in routers:
        for name, entry in router_servers(router).items():
            held[name] = held.get(name, 0) + int(entry["scur"])
    return held


def wait_status(router: NodeRecord, server: str, status: str, limit_s: float) -> float | None:
    """Seconds until the router shows ``server`` with ``status`` (None: not within ``limit_s``)."""
    started = time.monotonic()
    while time.monotonic() - started < limit_s:
        if router_servers(router)[server]["status"] == status:
            return time.monotonic() - started
        time.sleep(0.5)
    return None


def answered(address: str) -> float:
    """The requests the replica on ``address`` answered since it started."""
    with urllib.request.urlopen(f"http://{address}:{REPLICA_PORT}/metrics", timeout=20) as answer:
        text = answer.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(SUCCESS + "{"))


def kill_run(streams: int, nodes: list[NodeRecord], chosen: NodeRecord | None, routers: list[NodeRecord],
             load: RequestLoad, before_s: float, after_s: float) -> dict[str, Any]:
    """One kill under ``load``, of ``chosen``'s replica or else of the one that holds the most requests at that
    moment: its figures (the replica's status read on the first router)."""
    router = routers[0]
    units = {node.name: replica_unit(node) for node in nodes}
    servers = {node.name: units[node.name].removeprefix("vllm@").removesuffix(".service") for node in nodes}
    load.start()
    try:
        time.sleep(before_s)
        counts = in_flight(routers)
        held = {node.name: counts.get(servers[node.name], 0) for node in nodes}
        victim = chosen or max(nodes, key=lambda node: held[node.name])
        pid = int(ssh(victim, f"systemctl show -p MainPID --value {units[victim.name]}").strip())
        ssh(victim, f"kill -{int(signal.SIGKILL)} {pid}")
        killed = time.monotonic()
        taken_out_s = wait_status(router, servers[victim.name], "DOWN", 60)
        back_s = wait_status(router, servers[victim.name], "UP", LIMIT_S)
        back = time.monotonic()
        counted = {node.address: answered(node.address) for node in nodes}
        time.sleep(after_s)
        since = {address: answered(address) - count for address, count in counted.items()}
    finally:
        load.stop()
    others = [node for node in nodes if node is not victim]
    mean_others = sum(since[node.address] for node in others) / len(others) if others else 0
    return {"streams": streams, "replica": servers[victim.name], **load.figures(),
            "in_flight_at_kill": held[victim.name], "in_flight_elsewhere": sum(held.values()) - held[victim.name],
            "failed_after_kill": len(load.failures_sent_after(killed)),
            "failed_after_back": len(load.failures_sent_after(back)), "failures": load.failures[:5],
            "taken_out_s": None if taken_out_s is None else round(taken_out_s, 1),
            "back_up_s": None if back_s is None else round(back - killed, 1),
            "answered_after_back": int(since[victim.address]), "others_mean_after_back": round(mean_others, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", default="4", help="client stream counts, comma-separated (default 4)")
    parser.add_argument("--node", help="the node whose replica is killed (default: the one with the most requests"
                                       " in flight when the kill comes)")
    parser.add_argument("--before-s", type=float, default=20, help="load before the kill (default 20 s)")
    parser.add_argument("--after-s", type=float, default=45, help="load once it is back (default 45 s)")
    args = parser.parse_args()
    directory = lab_dir()
    state = load_state(directory)
    if state is None or len(state.nodes) < 2:
        print(f"bench/replica_kill.py: no lab of two nodes or more in {directory} (make lab)", file=sys.stderr)
        return 2
    chosen = next((n for n in state.nodes if n.name == args.node), None) if args.node else None
    if args.node and chosen is None:
        parser.error(f"--node: no lab node {args.node!r}")
    edge = str(virtual_address(ipaddress.IPv4Network(state.subnet)))
    lab_vars = yaml.safe_load((ROOT / "inventories" / "lab" / "group_vars" / "lab.yml").read_text())
    model, key = lab_vars["vllm_served_model_name"], (directory / CLIENT_KEY_FILE).read_text().strip()
    runs = []
    for streams in (int(n) for n in args.streams.split(",")):
        load = RequestLoad(f"https://{edge}:{ROUTER_PORT}", model, key, streams=streams, pause_s=1.0, chat=True,
                           limit_s=LIMIT_S, limit=10 * LIMIT_S, ca_file=str(directory / TLS_DIR / "ca.crt"))
        runs.append(kill_run(streams, state.nodes, chosen, state.nodes[:2], load, args.before_s, args.after_s))
        print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"lab": {"nodes": len(state.nodes)}, "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
