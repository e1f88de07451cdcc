"""gpufleet.digest: a file's digest is read once while the file stays the same, and again once it changes."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from gpufleet.digest import file_sha256


def test_a_changed_file_is_hashed_again(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"first")
    assert file_sha256(path) == hashlib.sha256(b"first").hexdigest()
    assert file_sha256(str(path)) == hashlib.sha256(b"first").hexdigest()
    path.write_bytes(b"second, longer")
    assert file_sha256(path) == hashlib.sha256(b"second, longer").hexdigest()
    path.write_bytes(b"third!")  # the first one's size: the modification time tells them apart
    os.utime(path, ns=(1, 1))
    assert file_sha256(path) == hashlib.sha256(b"third!").hexdigest()
