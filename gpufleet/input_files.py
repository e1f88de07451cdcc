"""Reading what a user hands gpufleet as a file or as JSON text, without hanging or recursing on it.

A named pipe, a device, a socket or a directory where a file is expected is refused from its type, before a byte
is read (opening a FIFO for reading blocks until a writer comes; here it is opened non-blocking and only its
type is looked at). JSON nested deeper than :data:`MAX_JSON_DEPTH` is refused from its text, before a parser
recurses into it. A model directory pushed to the nodes holds directories, regular files and links that stay
inside it, nothing else. A file a command is to write once its work is done (a report, a plot) is checked before
the work starts: somewhere a regular file can be written.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path

MAX_FILE_BYTES = 16 * 2**20
"""The largest variables or facts file read (gpufleet's own are a few KiB)."""

MAX_JSON_DEPTH = 64
"""The deepest nesting of arrays and objects read from JSON (gpufleet's own values nest a few levels)."""


class InputFileError(ValueError):
    """A file or text that cannot be read as one: ``message`` says what was expected and found, ``found`` the
    latter alone."""

    def __init__(self, message: str, found: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.found = found


def kind(mode: int) -> str:
    """What a file's mode says it is, as a message names it."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a link")):
        if test(mode):
            return name
    return "a regular file"


def found_at(path: str) -> str:
    """What is at ``path``, links followed, as a message names it: :func:`kind`'s word, ``a link loop``, ``a link to
    nothing`` or ``no such file``."""
    try:
        return kind(os.stat(path).st_mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "a link loop"
        return "a link to nothing" if os.path.lexists(path) else "no such file"


def read_regular(path: Path, what: str = "a file", limit: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of a regular file (links followed), at most ``limit`` of them; raises :class:`InputFileError`
    (``what``: how its message names the file expected)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise InputFileError(f"expected a readable file, found {exc.strerror}", str(exc.strerror)) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise InputFileError(f"expected {what}, found {kind(mode)}", kind(mode))
    with os.fdopen(fd, "rb") as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise InputFileError(f"expected {what} of at most {limit:,} bytes, found more", f"more than {limit:,} bytes")
    return data


def output_file_problem(path: Path) -> str | None:
    """Why a command could not write ``path`` once its work is done: a directory, a named pipe, a device or a socket
    there, no such directory, or one this user may not write; None when it can."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        return f"expected a file to write, found {str(path)!r} unreadable ({exc.strerror})"
    if mode is not None and not stat.S_ISREG(mode):
        return f"expected a regular file to write, found {kind(mode)} at {str(path)!r}"
    if mode is None and not path.parent.is_dir():
        return f"expected a file in a directory that exists, found no directory {str(path.parent)!r}"
    try:  # tried, not read from modes: the superuser passes every mode check, never a read-only file system
        if mode is not None:
            os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK))
        else:
            tempfile.TemporaryFile(dir=path.parent).close()
    except OSError as exc:
        return f"expected a file this user may write, found {str(path)!r} not writable ({exc.strerror})"
    return None


def json_depth_problem(text: str, limit: int = MAX_JSON_DEPTH) -> str | None:
    """Whether JSON text nests arrays and objects deeper than ``limit`` (brackets inside strings not counted)."""
    depth, in_string, escaped = 0, False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                return f"expected JSON nested at most {limit} levels deep, found deeper"
        elif ch in "]}":
            depth -= 1
    return None


def tree_problem(root: Path) -> str | None:
    """Whether a directory to push holds anything but directories, regular files and links that stay inside it."""
    top = root.resolve()
    for folder, dirs, files in os.walk(top):
        for name in sorted([*dirs, *files]):
            path = Path(folder) / name
            relative = path.relative_to(top)
            try:
                mode = path.lstat().st_mode
            except FileNotFoundError:  # gone since the walk listed it: nothing of it would be pushed
                continue
            if stat.S_ISLNK(mode):
                try:
                    target = path.resolve(strict=False)
                except (RuntimeError, OSError):  # a loop of links (RuntimeError up to Python 3.12, OSError since)
                    return f"expected links that stay inside the directory, found {str(relative)!r} in a loop of links"
                if target != top and top not in target.parents:
                    return f"expected links that stay inside the directory, found {str(relative)!r} pointing outside it"
                mode = target.stat().st_mode if target.exists() else mode
                if not target.exists():
                    return f"expected links that stay inside the directory, found {str(relative)!r} pointing nowhere"
            if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                return f"expected directories and regular files only, found {kind(mode)} at {str(relative)!r}"
    return None
