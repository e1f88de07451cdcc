"""The one way gpufleet takes a file's digest: SHA-256, in lowercase hex, as ``sha256sum`` prints it."""

from __future__ import annotations

import hashlib
import os


def file_sha256(path: str | os.PathLike[str]) -> str:
    """Hex SHA-256 of a file's bytes, read in blocks (large files are never held in memory)."""
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()
