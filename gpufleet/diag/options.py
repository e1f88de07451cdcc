"""``gpufleet diag``'s options, judged before any host is contacted: the window (``--since``) and the archive's path
(``--out``). Each refusal is one line naming the option, what it expects and what it found."""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from gpufleet.values import grammar
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


class OutReplaced(OSError):
    """The file ``--out`` made was replaced (or removed) before the archive was written into it."""


@dataclass(frozen=True)
class OutFile:
    """The file ``--out`` made (empty, 0600), known by its device, inode and change time (an inode number is reused
    at once by a file made in its place): the archive goes into that file only, and only that file is removed when
    the command fails."""

    path: Path
    device: int
    inode: int
    changed_ns: int

    def _same(self, info: os.stat_result, untouched: bool = True) -> bool:
        """Whether ``info`` is this file's (``untouched``: and unchanged since it was made)."""
        return stat.S_ISREG(info.st_mode) and (info.st_dev, info.st_ino) == (self.device, self.inode) and (
            not untouched or info.st_ctime_ns == self.changed_ns)

    def open(self) -> int:
        """The file, emptied, open for writing; :class:`OutReplaced` when it is no longer the one made."""
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_NOFOLLOW)
        except OSError as exc:
            raise OutReplaced(f"{show(str(self.path))} is no longer the file made for it: {exc.strerror}") from None
        if not self._same(os.fstat(fd)):
            os.close(fd)
            raise OutReplaced(f"{show(str(self.path))} was replaced by another file")
        os.ftruncate(fd, 0)
        os.fchmod(fd, 0o600)
        return fd

    def remove(self) -> None:
        """Remove the file made, if it is still the one at its path."""
        try:
            if self._same(os.lstat(self.path), untouched=False):  # written into by now, or not
                self.path.unlink()
        except OSError:
            pass


def out_path(text: str) -> OutFile:
    """``--out``: a new file, made here (empty, 0600) so that a path that cannot be written is refused before any
    host is contacted; the archive is written into it."""
    if not text.strip() or grammar.control_char(text):
        raise OptionError(f"--out: expected a file name of printable characters, found {show(text)}")
    path = Path(text)
    if os.path.lexists(path):
        raise OptionError(f"--out: expected a path where no file is yet, found {show(text)} already there")
    if not path.parent.is_dir():
        raise OptionError(f"--out: expected a file in a directory that exists, found {show(text)}")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise OptionError(f"--out: expected a file this user may create, found {show(text)}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
    finally:
        os.close(fd)
    return OutFile(path, info.st_dev, info.st_ino, info.st_ctime_ns)
