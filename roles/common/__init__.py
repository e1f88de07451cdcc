"""Role ``common``: what every gpufleet node has before any other role runs.

After it, the node has ``/etc/gpufleet/`` (root, 0755) holding ``node.env`` (root, 0644) with the node's
name and its declared hardware profile; gpufleet's node tools in ``/opt/gpufleet/node/`` (the NVML probe
and health gate, which units run as ``ExecStartPre``, the GPU health watch, and the vLLM readiness check) with
the controller's NVML bindings, which the deploy's GPU probe imports when the node's Python has none; the base
tools the other roles call (``ps``, CA certificates); and ``gpufleet-capture@.service``, which keeps a capture of the
node's evidence on the node when something fails with no controller there (a replica's restart loop, a quarantine).
It reads one variable, ``gpu_profile`` (see roles/fleet/defaults.yml); the node's name is its hostname as the node
reports it (in its GPU facts).
"""

from __future__ import annotations

from pathlib import Path

from pyinfra.api.deploy import deploy
from pyinfra.context import host
from pyinfra.facts.server import Hostname
from pyinfra.operations.util import any_changed

from gpufleet.facts.gpu import controller_pynvml
from gpufleet.node import diag_collect
from gpufleet.node_paths import (
    CAPTURE_UNIT_TEMPLATE,
    CONFIG_DIR,
    DIAG_CAPTURES_DIR,
    NODE_ENV,
    NODE_PYNVML,
    NODE_PYTHON,
    NODE_TOOL_FILES,
    NODE_TOOLS_DIR,
    node_tool,
    unit_path,
)
from gpufleet.operations import apt, files, node, systemd
from gpufleet.plan import access
from gpufleet.run.context import gpu_facts, host_config
from gpufleet.templates import render
from gpufleet.units.escape import env_value, exec_line

NODE_SOURCES = Path(__file__).resolve().parents[2] / "gpufleet" / "node"
BASE_PACKAGES = ["procps", "ca-certificates"]


def node_env_values(node_name: str, gpu_profile: str) -> dict[str, str]:
    """What templates/common/node.env.j2 is rendered with: each value quoted for an EnvironmentFile."""
    return {"node_name": env_value(node_name), "gpu_profile": env_value(gpu_profile)}


def capture_values() -> dict[str, object]:
    """What templates/common/gpufleet-capture@.service.j2 is rendered with."""
    argv = [NODE_PYTHON, "-I", node_tool("diag_collect.py"), "capture"]
    return {"node_tools": NODE_TOOLS_DIR, "exec_start": exec_line(argv), "captures_dir": DIAG_CAPTURES_DIR,
            "keep": diag_collect.CAPTURE_KEEP, "timeout_s": int(diag_collect.CAPTURE_BUDGET_S) + 60,
            "state_dir": DIAG_CAPTURES_DIR.removeprefix("/var/lib/"), "ip_access": access.unit_lines([])}


@deploy("Common node setup")
def common() -> None:
    """Converge the node's gpufleet directory, identity file and base tools."""
    facts = gpu_facts()
    name = facts.hostname if facts is not None and facts.hostname else host.get_fact(Hostname)
    node.observe(
        name="Read gpufleet's base files and tools",
        paths=[CONFIG_DIR, NODE_ENV, NODE_TOOLS_DIR, *(node_tool(t) for t in NODE_TOOL_FILES), NODE_PYNVML,
               unit_path(CAPTURE_UNIT_TEMPLATE)],
        packages=BASE_PACKAGES,
    )
    files.directory(name=f"Create gpufleet's configuration directory {CONFIG_DIR}", path=CONFIG_DIR)
    files.file(
        name=f"Write the node's name and hardware profile to {NODE_ENV}", dest=NODE_ENV,
        content=render("common/node.env.j2", **node_env_values(name, host_config().gpu_profile or "")),
    )
    files.directory(name=f"Create {NODE_TOOLS_DIR}", path=NODE_TOOLS_DIR)
    for tool in NODE_TOOL_FILES:
        files.file(name=f"Install node tool {tool}", src=str(NODE_SOURCES / tool), dest=node_tool(tool), mode="0755")
    files.file(name=f"Install the controller's NVML bindings (nvidia-ml-py) for the GPU probe to {NODE_PYNVML}",
               src=str(controller_pynvml()), dest=NODE_PYNVML, mode="0644")
    apt.packages(name="Ensure the base tools are installed", packages=BASE_PACKAGES)
    unit = files.file(name=f"Install the capture unit {CAPTURE_UNIT_TEMPLATE}", dest=unit_path(CAPTURE_UNIT_TEMPLATE),
                      content=render("common/gpufleet-capture@.service.j2", **capture_values()))
    systemd.daemon_reload(name="Reload systemd: the capture unit changed", _if=any_changed(unit))
