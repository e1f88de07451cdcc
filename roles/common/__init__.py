"""Role ``common``: what every gpufleet node has before any other role runs.

After it, the node has ``/etc/gpufleet/`` (root, 0755) holding ``node.env`` (root, 0644) with the node's
name and its declared hardware profile; gpufleet's node tools in ``/opt/gpufleet/node/`` (the NVML probe
and health gate, which units run as ``ExecStartPre``, and the vLLM readiness check); and the base tools
the other roles call (``ps``, CA certificates). It reads one variable, ``gpu_profile`` (see roles/fleet/defaults.yml); the node's
name is its hostname as the node reports it.
"""

from __future__ import annotations

from pathlib import Path

from pyinfra.api.deploy import deploy
from pyinfra.context import host
from pyinfra.facts.server import Hostname
from pyinfra.operations import apt, files

from gpufleet.systemd_text import env_value

CONFIG_DIR = "/etc/gpufleet"
NODE_TOOLS_DIR = "/opt/gpufleet/node"
NODE_TOOLS = ("nvml_probe.py", "health_rules.py", "vllm_ready.py")  # standard library (+ pynvml) only
NODE_SOURCES = Path(__file__).resolve().parents[2] / "gpufleet" / "node"
BASE_PACKAGES = ["procps", "ca-certificates"]
TEMPLATES = Path(__file__).resolve().parents[2] / "templates" / "common"


def node_env_values(node_name: str, gpu_profile: str) -> dict[str, str]:
    """What templates/common/node.env.j2 is rendered with: each value quoted for an EnvironmentFile."""
    return {"node_name": env_value(node_name), "gpu_profile": env_value(gpu_profile)}


@deploy("Common node setup")
def common() -> None:
    """Converge the node's gpufleet directory, identity file and base tools."""
    files.directory(
        name="Create gpufleet's configuration directory /etc/gpufleet",
        path=CONFIG_DIR,
        user="root",
        group="root",
        mode="0755",
    )
    files.template(
        name="Write the node's name and hardware profile to /etc/gpufleet/node.env",
        src=str(TEMPLATES / "node.env.j2"),
        dest=f"{CONFIG_DIR}/node.env",
        user="root",
        group="root",
        mode="0644",
        **node_env_values(host.get_fact(Hostname), host.data.get("gpu_profile") or ""),
    )
    files.directory(
        name=f"Create {NODE_TOOLS_DIR}",
        path=NODE_TOOLS_DIR,
        user="root",
        group="root",
        mode="0755",
    )
    for tool in NODE_TOOLS:
        files.put(
            name=f"Install node tool {tool}",
            src=str(NODE_SOURCES / tool),
            dest=f"{NODE_TOOLS_DIR}/{tool}",
            user="root",
            group="root",
            mode="0755",
        )
    apt.packages(
        name="Ensure the base tools are installed",
        packages=BASE_PACKAGES,
        update=False,  # they come with the image; nothing to fetch
    )
