"""The files that turn a view of the shared base rootfs into one particular lab node."""

from __future__ import annotations

import ipaddress
import uuid
from pathlib import Path

from gpufleet_lab import network, ssh

HOST_NAME = "lab-host"  # the host's name on the lab bridge, in every node's /etc/hosts


def write_node_files(
    root: Path,
    name: str,
    address: ipaddress.IPv4Address,
    net: ipaddress.IPv4Network,
    lab_nodes: dict[str, ipaddress.IPv4Address],
    public_key: str,
) -> str:
    """Identity (hostname, machine id, host key), network config and root's authorized key; the host key."""
    etc = root / "etc"
    (etc / "hostname").write_text(f"{name}\n")
    (etc / "machine-id").write_text(f"{uuid.uuid4().hex}\n")
    (etc / "hosts").write_text(network.hosts_file(lab_nodes, HOST_NAME, network.bridge_address(net)))
    netdir = etc / "systemd" / "network"
    netdir.mkdir(parents=True, exist_ok=True)
    (netdir / "10-lab.network").write_text(network.networkd_config(address, net))
    host_public_key = ssh.host_key(etc / "ssh" / "ssh_host_ed25519_key", f"root@{name}")
    dot_ssh = root / "root" / ".ssh"
    dot_ssh.mkdir(mode=0o700, exist_ok=True)
    dot_ssh.chmod(0o700)
    keys = dot_ssh / "authorized_keys"
    keys.write_text(public_key.strip() + "\n")
    keys.chmod(0o600)
    return host_public_key
