"""How exposed gpufleet's services are on the lab's nodes, by ``systemd-analyze security``.

    python bench/unit_security.py                  # every node of the running lab ($GPUFLEET_LAB_DIR)
    python bench/unit_security.py lab1 10.213.0.12 # some nodes, by name or address
    python bench/unit_security.py --unit ssh.service

Prints JSON: per node, per unit (vllm@*.service instances, node_exporter.service,
prometheus-node-exporter.service, dcgm-exporter.service, and any --unit), either
``{"present": true, "exposure": 1.7, "level": "OK"}`` (0.0 confined .. 10.0 exposed) or
``{"present": false}``. Talks to the nodes over SSH as root with the lab's key, checking their host keys.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import paramiko

from gpufleet.lab.state import LabState, load_state
from gpufleet.unit_security import UNITS, node_report

COMMAND_TIMEOUT_S = 60.0


class NodeShell:
    """One SSH connection to a lab node, running commands as root (the node's host key must be the lab's)."""

    def __init__(self, address: str, key: str, known_hosts: str) -> None:
        self.client = paramiko.SSHClient()
        self.client.load_host_keys(known_hosts)
        self.client.set_missing_host_key_policy(paramiko.RejectPolicy())
        self.client.connect(address, username="root", key_filename=key, look_for_keys=False,
                            allow_agent=False, timeout=10, banner_timeout=10, auth_timeout=10)

    def __call__(self, command: str) -> tuple[int, str]:
        _, stdout, _ = self.client.exec_command(command, timeout=COMMAND_TIMEOUT_S)
        out = stdout.read().decode(errors="replace")
        return stdout.channel.recv_exit_status(), out

    def close(self) -> None:
        self.client.close()


def measure(state: LabState, wanted: list[str], units: tuple[str, ...]) -> dict[str, Any]:
    nodes = [n for n in state.nodes if not wanted or n.name in wanted or n.address in wanted]
    unknown = [w for w in wanted if w not in {n.name for n in nodes} | {n.address for n in nodes}]
    if unknown:
        raise SystemExit(f"unit_security: no lab node {', '.join(unknown)}")
    report = []
    for node in nodes:
        started = time.monotonic()
        shell = NodeShell(node.address, state.ssh_key, state.known_hosts)
        try:
            found = node_report(shell, units)
        finally:
            shell.close()
        report.append({"name": node.name, "address": node.address, "units": found,
                       "seconds": round(time.monotonic() - started, 2)})
    return {"nodes": report}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("nodes", nargs="*", help="node names or addresses (default: every node of the lab)")
    parser.add_argument("--lab-dir", type=Path, help="the lab's directory (default: $GPUFLEET_LAB_DIR or the default lab)")
    parser.add_argument("--unit", action="append", default=[], help="another unit or pattern to rate (repeatable)")
    args = parser.parse_args(argv)
    state = load_state(args.lab_dir)
    if state is None or not state.nodes:
        print("unit_security: no lab is up", file=sys.stderr)
        return 1
    print(json.dumps(measure(state, args.nodes, UNITS + tuple(args.unit)), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
