"""The lab's SSH key and the probes that tell a node answers over SSH."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import paramiko

from gpufleet_lab.errors import LabError


def ensure_key(path: Path) -> Path:
    """The lab's ed25519 key pair at ``path`` / ``path.pub``, generated the first time (kept across labs)."""
    if path.exists() and path.with_suffix(".pub").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.unlink(missing_ok=True)
    done = subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "gpufleet-lab", "-f", str(path)],
        capture_output=True, text=True, check=False,
    )
    if done.returncode != 0:
        raise LabError(f"ssh-keygen could not create the lab key {path}: {done.stderr.strip()}")
    return path


def host_key(path: Path, comment: str) -> str:
    """Generate a node's own ed25519 host key at ``path`` (sshd reads only that one); its public line."""
    path.unlink(missing_ok=True)
    path.with_suffix(".pub").unlink(missing_ok=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
                   check=True, capture_output=True)
    return path.with_suffix(".pub").read_text().strip()


def write_known_hosts(path: Path, host_keys: dict[tuple[str, str], str]) -> None:
    """known_hosts lines for every node, under its address and its name: ``{(name, address): public key}``."""
    lines = []
    for (name, address), public in host_keys.items():
        key_type, key_data = public.split()[:2]
        lines.append(f"{address},{name} {key_type} {key_data}")
    path.write_text("\n".join(lines) + "\n")


def write_client_config(path: Path, nodes: dict[str, str], key: Path, known_hosts: Path) -> None:
    """An OpenSSH client config naming every node (``ssh -F PATH lab1``), checking host keys strictly."""
    blocks = []
    for name, address in nodes.items():
        blocks.append(
            f"Host {name} {address}\n"
            f"    HostName {address}\n"
            "    User root\n"
            f"    IdentityFile {key}\n"
            "    IdentitiesOnly yes\n"
            f"    UserKnownHostsFile {known_hosts}\n"
            "    StrictHostKeyChecking yes\n"
        )
    path.write_text("# The running gpufleet lab's nodes.\n\n" + "\n".join(blocks))


def port_answers(address: str, port: int = 22, timeout: float = 1.0) -> bool:
    """True when something on ``address:port`` accepts a connection and speaks SSH."""
    try:
        with socket.create_connection((address, port), timeout=timeout) as conn:
            conn.settimeout(timeout)
            return conn.recv(4).startswith(b"SSH-")
    except OSError:
        return False


def run(address: str, key: Path, known_hosts: Path, command: str, timeout: float = 5.0) -> tuple[int, str]:
    """Run ``command`` as root on a node; the exit status and stdout. Raises OSError/SSHException if unreachable.

    The node must present the host key the lab generated for it (``known_hosts``).
    """
    client = paramiko.SSHClient()
    client.load_host_keys(str(known_hosts))
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    try:
        client.connect(address, username="root", key_filename=str(key), look_for_keys=False,
                       allow_agent=False, timeout=timeout, banner_timeout=timeout, auth_timeout=timeout)
        _, stdout, _ = client.exec_command(command, timeout=timeout)
        out = stdout.read().decode(errors="replace")
        return stdout.channel.recv_exit_status(), out
    finally:
        client.close()
