"""A pyinfra operation for secret files: compared by digest, never shown in a diff or a log.

``files.put`` prints the old and new contents under ``pyinfra --diff``; a secret must not. The file is
uploaded straight into a root-only (0700) directory and then set to 0600, so no other user can open it
at any moment.
"""

from __future__ import annotations

import hashlib
from io import StringIO

from pyinfra import host
from pyinfra.api import FileUploadCommand, StringCommand, operation
from pyinfra.api.command import QuoteString
from pyinfra.facts.files import File, Sha256File


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
        yield FileUploadCommand(StringIO(content), dest)
        yield StringCommand("chown", "root:root", QuoteString(dest))
        yield StringCommand("chmod", mode, QuoteString(dest))
        return
    info = host.get_fact(File, path=dest) or {}
    if info.get("user") != "root" or info.get("group") != "root":
        yield StringCommand("chown", "root:root", QuoteString(dest))
    if f"{info.get('mode', '')}" != mode.lstrip("0"):
        yield StringCommand("chmod", mode, QuoteString(dest))
