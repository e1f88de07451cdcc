"""The lab's SSH key and the probes that tell a node answers over SSH."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import paramiko

from gpufleet.lab.errors import LabError


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


def host_key(path: Path, comment: str) -> None:
    """Generate a node's own ed25519 host key at ``path`` (sshd reads only that one)."""
    path.unlink(missing_ok=True)
    path.with_suffix(".pub").unlink(missing_ok=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
                   check=True, capture_output=True)


def port_answers(address: str, port: int = 22, timeout: float = 1.0) -> bool:
    """True when something on ``address:port`` accepts a connection and speaks SSH."""
    try:
        with socket.create_connection((address, port), timeout=timeout) as conn:
            conn.settimeout(timeout)
            return conn.recv(4).startswith(b"SSH-")
    except OSError:
        return False


def run(address: str, key: Path, command: str, timeout: float = 5.0) -> tuple[int, str]:
    """Run ``command`` as root on a node; the exit status and stdout. Raises OSError/SSHException if unreachable."""
    client = paramiko.SSHClient()
    client.set_missing_host_key_policy(paramiko.AutoAddPolicy())  # lab nodes get fresh host keys each up
    try:
        client.connect(address, username="root", key_filename=str(key), look_for_keys=False,
                       allow_agent=False, timeout=timeout, banner_timeout=timeout, auth_timeout=timeout)
        _, stdout, _ = client.exec_command(command, timeout=timeout)
        out = stdout.read().decode(errors="replace")
        return stdout.channel.recv_exit_status(), out
    finally:
        client.close()
