"""System accounts, scripts that record what they did, and reboots."""

from __future__ import annotations

import shlex
from time import sleep
from typing import Any

from pyinfra.api.command import FunctionCommand, QuoteString, StringCommand
from pyinfra.context import host

from gpufleet.facts.server import BootId
from gpufleet.operations import node
from gpufleet.operations.node import Commands, gpufleet_operation

REBOOT_TIMEOUT_S = 600


@gpufleet_operation()
def system_account(user: str, home: str = "/nonexistent", shell: str = "/usr/sbin/nologin",
                   comment: str | None = None) -> Commands:
    """
    Keep a system group and a system user of the same name, without login; ``home`` is not created.

    + user: the account's and its group's name
    + home: its home directory
    + shell: its login shell
    + comment: the GECOS field
    """
    changes = []
    gid = node.group_id(user)
    if gid is None:
        changes.append(StringCommand("groupadd", "--system", QuoteString(user)))
    found = node.account(user)
    if found is None:
        changes.append(StringCommand(
            "useradd", "--system", "--gid", QuoteString(user), "--home-dir", QuoteString(home), "--no-create-home",
            "--shell", QuoteString(shell), *(["--comment", QuoteString(comment)] if comment else []),
            QuoteString(user)))
    elif (found["home"], found["shell"]) != (home, shell) or gid is None or found["group"] != str(gid):
        changes.append(StringCommand("usermod", "--gid", QuoteString(user), "--home", QuoteString(home),
                                     "--shell", QuoteString(shell), QuoteString(user)))
    if not changes:
        host.noop(f"system user and group {user} exist")
        return
    node.forget("users", user)
    node.forget("groups", user)
    yield from changes


@gpufleet_operation()
def script(script: str, done_file: str | None = None, done_text: str | None = None,
           done_sha256: str | None = None, pending: bool = False) -> Commands:
    """
    Run a shell script unless ``done_file`` already holds ``done_text`` (a marker the script writes when it
    finished) or has the SHA-256 ``done_sha256`` (a file the script installs); without them, give it an ``_if``
    saying why it runs.

    + script: the shell text (every value in it already quoted)
    + done_file: the marker or file the script leaves
    + done_text: what a finished run wrote there, or
    + done_sha256: the digest of the file a finished run installed
    + pending: run it though ``done_file`` says done (something else it puts in place is not)
    """
    if pending:
        if done_file is not None:
            node.forget("paths" if done_sha256 is not None else "texts", done_file)
        yield StringCommand(script)
        return
    if done_file is not None and done_sha256 is not None:
        if node.path(done_file).get("sha256") == done_sha256:
            host.noop(f"{done_file} is the wanted file")
            return
        node.forget("paths", done_file)
    elif done_file is not None:
        found = node.text(done_file)
        if found is not None and found.strip() == (done_text or "").strip():  # a missing marker: not done
            host.noop(f"{done_file} says it is done")
            return
        node.forget("texts", done_file)
    yield StringCommand(script)


def checked_install(check: str, candidate: str, dest: str, group: str) -> str:
    """The shell text that puts a configuration in place only once its own program accepted it: ``check`` (a
    command, every value quoted, that exits non-zero on a bad file) runs on ``candidate``, which is then installed
    root:``group`` 0640 beside ``dest`` and renamed over it (a reader never sees half a file)."""
    new = shlex.quote(f"{dest}.gpufleet-new")
    return (f"set -e; {check}; install -o root -g {shlex.quote(group)} -m 0640 {shlex.quote(candidate)} {new}; "
            f"mv -fT {new} {shlex.quote(dest)}")


@gpufleet_operation(idempotent=False)
def reboot(timeout: int = REBOOT_TIMEOUT_S) -> Commands:
    """
    Reboot the node and wait until it answers again from a new boot (a new ``/proc/sys/kernel/random/boot_id``,
    set by the kernel at boot and by systemd-nspawn for each container boot, where uptime would not change).

    + timeout: seconds to wait for the node to come back
    """
    before: list[str] = []

    # pyinfra passes state and host only to callbacks whose parameters have exactly these names
    def note_boot(state: Any, host: Any) -> bool:
        before.append(host.get_fact(BootId))
        return True

    def wait_for_new_boot(state: Any, host: Any) -> bool:
        sleep(3)
        host.disconnect()
        for _ in range(timeout):
            host.connect(show_errors=False)
            if host.connected:
                try:
                    if host.get_fact(BootId) not in ("", before[0]):
                        return True
                except Exception:  # noqa: BLE001 - the connection dropped while the node went down
                    pass
                host.disconnect()
            sleep(1)
        raise TimeoutError(f"the node did not come back within {timeout} s of its reboot")

    yield FunctionCommand(note_boot, (), {})
    yield StringCommand("( sleep 1 && systemctl reboot ) </dev/null >/dev/null 2>&1 &")
    yield FunctionCommand(wait_for_new_boot, (), {})

