"""A pyinfra operation for secret files: compared by digest, never shown in a diff or a log, never readable by
another user at any moment, also when the SSH user is not root and pyinfra runs with ``_sudo``.

``files.put`` prints the old and new contents under ``pyinfra --diff``; a secret must not. With ``_sudo``,
pyinfra uploads a file over SFTP as the SSH user into its temporary directory (``/tmp/pyinfra-<sha1>``,
created with that user's umask: often world-readable), copies it into place with sudo and then deletes it,
and leaves it behind when the copy fails. :func:`secret_file` therefore first creates, as the SSH user, a
fresh directory of its own (0700, a random name; ``mkdir`` fails rather than reuse one) and has pyinfra upload
into it; the destination exists as an empty root file with its final mode before any content arrives (``cp``
into an existing file keeps its mode), and the directory is removed at the end. A failed step can leave the
upload only inside that 0700 directory.
"""

from __future__ import annotations

import hashlib
from io import StringIO
from uuid import uuid4

from pyinfra import host
from pyinfra.api import FileUploadCommand, StringCommand, operation
from pyinfra.api.command import QuoteString
from pyinfra.facts.files import File, Sha256File

# What runs as the SSH user itself, whatever the operation's privilege arguments say.
AS_SSH_USER = {"_sudo": False, "_su_user": None, "_doas": False}


@operation()
def secret_file(dest: str, content: str, mode: str = "600"):
    """
    Keep ``dest`` (root-owned, in a 0700 root directory) holding ``content`` with ``mode``.

    + dest: remote path
    + content: the secret text (never logged)
    + mode: octal mode, default 600
    """
    digest = hashlib.sha256(content.encode()).hexdigest()
    if host.get_fact(Sha256File, path=dest) != digest:
        staging = host.get_temp_filename(f"gpufleet-secret-{uuid4()}")
        yield StringCommand("mkdir", "-m", "700", QuoteString(staging), **AS_SSH_USER)
        yield StringCommand("touch", QuoteString(dest))
        yield StringCommand("chown", "root:root", QuoteString(dest))
        yield StringCommand("chmod", mode, QuoteString(dest))
        yield FileUploadCommand(StringIO(content), dest, remote_temp_filename=f"{staging}/upload")
        yield StringCommand("rm", "-rf", QuoteString(staging), **AS_SSH_USER)
        return
    info = host.get_fact(File, path=dest) or {}
    if info.get("user") != "root" or info.get("group") != "root":
        yield StringCommand("chown", "root:root", QuoteString(dest))
    if f"{info.get('mode', '')}" != mode.lstrip("0"):
        yield StringCommand("chmod", mode, QuoteString(dest))
