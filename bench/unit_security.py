"""How exposed gpufleet's services are on the lab's nodes, by ``systemd-analyze security``.

    python bench/unit_security.py                  # every node of the running lab ($GPUFLEET_LAB_DIR)
    python bench/unit_security.py lab1 10.213.0.12 # some nodes, by name or address
    python bench/unit_security.py --unit ssh.service
    python bench/unit_security.py --offline            # no lab: every template rendered as the roles render it

Prints JSON: per node, per unit gpufleet writes (vllm@*.service and vllm-watchdog@*.service instances,
gpufleet-ray-*.service heads and workers, node_exporter.service, prometheus-node-exporter.service,
dcgm-exporter.service, gpufleet-gpu-watch.service, and any --unit), either
``{"present": true, "exposure": 1.7, "level": "OK"}`` (0.0 confined .. 10.0 exposed) or
``{"present": false}``; then ``worst`` (the highest exposure seen, per unit across nodes), ``bound``
(gpufleet's limit, 2.0) and ``within_bound``. Exits 0 when every present unit is within the bound, else 3.
Talks to the nodes over SSH as root with the lab's key, checking their host keys.

``--offline`` rates every unit gpufleet writes without a node: each template rendered by the roles' own
functions from the role defaults and sample addresses (both Ray kinds, both node_exporter methods: Debian's
unit from the lab mirror's .deb with gpufleet's drop-in), with this machine's
``systemd-analyze security --offline=yes --root=DIR``; the same JSON with one node named ``offline``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import paramiko
from gpufleet_lab.state import LabState, cache_dir, load_state

from gpufleet.units.security import EXPOSURE_BOUND, UNITS, exposure, node_report

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the roles, when run as a script

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


def rendered_units() -> dict[str, str]:
    """Every unit file (and drop-in) gpufleet writes, path below / -> text, rendered by the roles' own functions
    for a sample node 10.0.0.5 of a Ray replica with 10.0.0.6, monitored from 10.0.9.0/24."""
    from gpufleet.config.layers import HostLayers, Layer, role_default_layers
    from gpufleet.config.validate import validate_host
    from gpufleet.node_paths import capture_unit, ray_env_file, ray_token_file
    from gpufleet.plan import access
    from gpufleet.plan.commands import ray_start_argv
    from gpufleet.templates import render
    from gpufleet.units.escape import exec_line
    from roles import common, dcgm_exporter, gpu_watch, monitoring, node_exporter, node_lifecycle, ray, vllm

    layers, _ = role_default_layers()
    cfg, problems = validate_host(HostLayers("10.0.0.5", [*layers, Layer("bench", {
        "vllm_model": "org/model", "fleet_address": "10.0.0.5", "monitoring_addresses": ["10.0.9.0/24"],
        "vllm_api_allowed_from": ["10.0.8.0/24"], "ray_auth_token": {"env": "RAY_AUTH_TOKEN"}})]), "bench")
    if cfg is None:
        raise SystemExit("unit_security: " + "; ".join(p.line() for p in problems))

    nodes = ["10.0.0.5", "10.0.0.6"]
    system = "etc/systemd/system"
    found = {f"{system}/vllm@pool-0.service": render(
        "vllm/vllm@.service.j2", **vllm.unit_values(access.vllm_sources(cfg, nodes[0], nodes)))}
    found[f"{system}/vllm-watchdog@pool-0.service"] = render("vllm/vllm-watchdog@.service.j2",
                                                              **vllm.watchdog_unit_values(nodes[0]))
    for kind, head in (("head", None), ("worker", nodes[0])):
        found[f"{system}/{ray.unit_name(f'{kind}-0')}"] = render(
            "ray/ray.service.j2", kind=kind, replica=f"{kind}-0", env_file=ray_env_file(f"{kind}-0"),
            token_file=ray_token_file(f"{kind}-0"), ray=f"/opt/vllm/{cfg.vllm_version}/bin/ray",
            exec_start=exec_line(ray_start_argv(cfg, nodes[0] if head is None else nodes[1], head)),
            ip_access=access.unit_lines(access.ray_sources(cfg, nodes)))
    found[f"{system}/{node_exporter.UNIT}"] = render(
        "node_exporter/" + node_exporter.template_name(cfg), **node_exporter.unit_context(cfg, "n1"))
    package = cfg.model_copy(update={"node_exporter_install": "package"})
    found[node_exporter.DROP_IN.lstrip("/")] = render(
        "node_exporter/" + node_exporter.template_name(package), **node_exporter.unit_context(package, "n1"))
    found[f"{system}/{dcgm_exporter.SERVICE}"] = render(
        "dcgm_exporter/dcgm-exporter.service.j2",
        **dcgm_exporter.unit_values(cfg.dcgm_exporter_port, nodes[0], access.exporter_sources(cfg, nodes[0]),
                                        cfg.dcgm_exporter_xid_window_s))
    found[gpu_watch.SERVICE_FILE.lstrip("/")] = render("gpu_watch/gpufleet-gpu-watch.service.j2",
                                                       **gpu_watch.service_values())
    found[monitoring.ALERT_LOG_FILE.lstrip("/")] = monitoring.alert_log_unit(cfg)
    found[node_lifecycle.SERVICE_FILE.lstrip("/")] = render(
        "node_lifecycle/gpufleet-node-watch.service.j2", **node_lifecycle.service_values(cfg, ["10.0.0.7"]))
    for tier, path in node_lifecycle.BURN_IN_FILES.items():
        found[path.lstrip("/")] = render("node_lifecycle/gpufleet-burn-in.service.j2",
                                         **node_lifecycle.burn_in_values(cfg, tier))
    found[f"{system}/{capture_unit('node-quarantined')}"] = render("common/gpufleet-capture@.service.j2",
                                                                   **common.capture_values())
    return found


def measure_offline() -> dict[str, Any]:
    """:func:`rendered_units` rated by this machine's systemd-analyze (Debian's node_exporter unit, for the
    drop-in, from the lab mirror's .deb when it was built)."""
    import subprocess
    import tempfile

    from roles import node_exporter

    report: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for path, text in rendered_units().items():
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_text(text)
        deb = next((cache_dir() / "debian-debs").glob(f"{node_exporter.PACKAGE}_*.deb"), None)
        if deb is not None:
            subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
        names = [Path(p).name for p in rendered_units() if p.endswith(".service")]
        names += [node_exporter.PACKAGE_UNIT] if deb is not None else []
        for name in names:
            done = subprocess.run(["systemd-analyze", "security", "--offline=yes", f"--root={root}", "--no-pager",
                                   name], capture_output=True, text=True)
            rated = exposure(done.stdout)
            report[name] = {"present": True, "exposure": rated.score, "level": rated.level}
        if deb is None:
            report[node_exporter.PACKAGE_UNIT] = {"present": False}
    return report


def measure(state: LabState, wanted: list[str], units: tuple[str, ...]) -> dict[str, Any]:
    nodes = [n for n in state.nodes if not wanted or n.name in wanted or n.address in wanted]
    unknown = [w for w in wanted if w not in {n.name for n in nodes} | {n.address for n in nodes}]
    if unknown:
        raise SystemExit(f"unit_security: no lab node {', '.join(unknown)}")
    report: list[dict[str, Any]] = []
    for node in nodes:
        started = time.monotonic()
        shell = NodeShell(node.address, state.ssh_key, state.known_hosts)
        try:
            found = node_report(shell, units)
        finally:
            shell.close()
        report.append({"name": node.name, "address": node.address, "units": found,
                       "seconds": round(time.monotonic() - started, 2)})
    return summary(report)


def summary(report: list[dict[str, Any]]) -> dict[str, Any]:
    """The nodes' reports with the worst exposure per unit and whether all are within the bound."""
    worst: dict[str, float] = {}
    for node in report:
        for unit, rated in node["units"].items():
            if "exposure" in rated:
                # instances of one template or pattern are one unit file: vllm@<replica>, gpufleet-ray-<replica>
                name = re.sub(r"^(vllm@|vllm-watchdog@|gpufleet-ray-|gpufleet-capture@).+\.service$", r"\1*.service",
                              unit)
                worst[name] = max(worst.get(name, 0.0), float(rated["exposure"]))
            elif rated.get("present"):
                worst[unit] = 10.0  # present but not rated: count it as exposed
    return {"nodes": report, "worst": worst, "bound": EXPOSURE_BOUND,
            "within_bound": all(score <= EXPOSURE_BOUND for score in worst.values())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("nodes", nargs="*", help="node names or addresses (default: every node of the lab)")
    parser.add_argument("--lab-dir", type=Path,
                        help="the lab's directory (default: $GPUFLEET_LAB_DIR or the default lab)")
    parser.add_argument("--unit", action="append", default=[], help="another unit or pattern to rate (repeatable)")
    parser.add_argument("--offline", action="store_true", help="rate the rendered templates here, without a lab")
    args = parser.parse_args(argv)
    if args.offline:
        found = summary([{"name": "offline", "address": None, "units": measure_offline()}])
        print(json.dumps(found, indent=2))
        return 0 if found["within_bound"] else 3
    state = load_state(args.lab_dir)
    if state is None or not state.nodes:
        print("unit_security: no lab is up", file=sys.stderr)
        return 1
    found = measure(state, args.nodes, UNITS + tuple(args.unit))
    print(json.dumps(found, indent=2))
    return 0 if found["within_bound"] else 3


if __name__ == "__main__":
    sys.exit(main())
