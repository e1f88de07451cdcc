"""The one way gpufleet takes a file's digest: SHA-256, in lowercase hex, as ``sha256sum`` prints it."""

from __future__ import annotations

import hashlib
import os

_known: dict[tuple[str, int, int, int, int], str] = {}  # (path, device, inode, size, mtime ns) -> digest


def file_sha256(path: str | os.PathLike[str]) -> str:
    """Hex SHA-256 of a file's bytes, read in blocks (large files are never held in memory). Kept for the
    process by path, device, inode, size and modification time, so a file the deploy compares on every host
    (a pushed model, a tarball) is read once per run, not once per host."""
    found = os.stat(path)
    key = (os.path.abspath(path), found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns)
    if key not in _known:
        with open(path, "rb") as handle:
            _known[key] = hashlib.file_digest(handle, "sha256").hexdigest()
    return _known[key]
