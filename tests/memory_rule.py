"""A program run here under the memory rule of the unit that runs it on a node: ``MemoryDenyWriteExecute=yes`` as
the kernel's own ``PR_SET_MDWE`` (Linux 6.3 and later: no mapping both writable and executable, and none made
executable later), the refusal systemd's filter makes. A program that JIT-compiles fails here as it would there."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable

PR_SET_MDWE = 65
PR_MDWE_REFUSE_EXEC_GAIN = 1
RULE = "\nMemoryDenyWriteExecute=yes"


def _deny_write_execute() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_MDWE): {os.strerror(errno)}")


def memory_rule(unit_text: str) -> Callable[[], None] | None:
    """What a child process runs before its program (``preexec_fn``) to live under ``unit_text``'s memory rule;
    None when the unit sets none."""
    return _deny_write_execute if RULE in unit_text else None


def deny_write_execute() -> Callable[[], None]:
    """The rule itself, for a test that shows a program fails under it."""
    return _deny_write_execute
