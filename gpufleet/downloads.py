"""Files a deploy fetches on the controller, once, and checks against a pinned SHA-256 before any node sees them.

A release tarball is downloaded by the machine running pyinfra, not by every node: nodes of an air-gapped fleet
reach no release server, and a file checked once on the controller is the same file on every node. Files are
kept in ``$GPUFLEET_DOWNLOADS`` (default ``$XDG_CACHE_HOME/gpufleet/downloads``, else
``~/.cache/gpufleet/downloads``) under their digest, so a later deploy checks the kept copy instead of
downloading again.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from pyinfra.api.exceptions import DeployError

from gpufleet.digest import file_sha256

DOWNLOADS_ENV = "GPUFLEET_DOWNLOADS"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_checked: dict[tuple[str, str, Path], Path] = {}  # (url, sha256, cache) -> checked file, for this process


class DownloadError(DeployError):
    """A file could not be fetched, or is not the file its pinned digest names; the message says which."""


def downloads_dir() -> Path:
    """Where fetched files are kept on the controller."""
    if os.environ.get(DOWNLOADS_ENV):
        return Path(os.environ[DOWNLOADS_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gpufleet" / "downloads"


def fetch_verified(url: str, sha256: str, cache: Path | None = None, timeout: float = 60) -> Path:
    """The file at ``url``, whose SHA-256 must be ``sha256``: fetched once, kept at ``<cache>/<sha256>/<name>``.

    Raises :class:`DownloadError` naming the URL when it cannot be fetched, and naming the URL, the expected and
    the found digest when the file is another one (nothing is kept then).
    """
    expected = sha256.lower()
    if not _SHA256.match(expected):
        raise DownloadError(f"{url}: expected a SHA-256 of 64 hex digits to check it against, found {sha256!r}")
    cache = (cache or downloads_dir()).absolute()
    key = (url, expected, cache)
    if key in _checked and _checked[key].is_file():
        return _checked[key]
    name = Path(urllib.parse.unquote(urllib.parse.urlsplit(url).path)).name or "download"
    target = cache / expected / name
    if target.is_file():
        if file_sha256(target) == expected:
            _checked[key] = target
            return target
        target.unlink()  # damaged since it was checked: fetch it again
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, prefix=f".{name}.", delete=False) as tmp:
        digest = hashlib.sha256()
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response:
                for block in iter(lambda: response.read(1 << 20), b""):
                    digest.update(block)
                    tmp.write(block)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            os.unlink(tmp.name)
            reason = getattr(exc, "reason", None) or exc
            raise DownloadError(f"cannot fetch {url}: {reason}") from None
    found = digest.hexdigest()
    if found != expected:
        os.unlink(tmp.name)
        raise DownloadError(
            f"{url}: expected sha256 {expected}, found {found}; the file is not the one pinned"
            " (a new release, a wrong URL, or tampering): nothing was pushed to any node"
        )
    os.chmod(tmp.name, 0o644)
    os.replace(tmp.name, target)
    _checked[key] = target
    return target
