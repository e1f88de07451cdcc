"""``gpufleet diag``'s options, judged before any host is contacted: the window (``--since``) and the archive's path
(``--out``). Each refusal is one line naming the option, what it expects and what it found."""

from __future__ import annotations

import os
import re
from pathlib import Path

from gpufleet.values.grammar import show

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_SINCE_S = 30 * 86400
DEFAULT_SINCE = "6h"
_SINCE = re.compile(r"([0-9]{1,7})([smhd])")


class OptionError(ValueError):
    """An option refused: one line."""


def since_seconds(text: str) -> int:
    """``--since``: a whole number and one unit (``90s``, ``30m``, ``2h``, ``1d``), above 0 and at most 30 days."""
    match = _SINCE.fullmatch(text)
    seconds = int(match[1]) * UNITS[match[2]] if match else 0
    if not 0 < seconds <= MAX_SINCE_S:
        raise OptionError(f"--since: expected a window from 1s to 30d, a whole number and one unit s, m, h or d"
                          f" (e.g. 30m, 2h, 1d), found {show(text)}")
    return seconds


def out_path(text: str) -> Path:
    """``--out``: a new file, made here (empty, 0600) so that a path that cannot be written is refused before any
    host is contacted; the archive is written into it."""
    path = Path(text)
    if os.path.lexists(path):
        raise OptionError(f"--out: expected a path where no file is yet, found {show(text)} already there")
    if not path.parent.is_dir():
        raise OptionError(f"--out: expected a file in a directory that exists, found {show(text)}")
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    except OSError as exc:
        raise OptionError(f"--out: expected a file this user may create, found {show(text)}: {exc.strerror}") from None
    return path
