"""The one error the lab raises for anything an operator can fix: its message is a complete sentence."""

from __future__ import annotations


class LabError(RuntimeError):
    """A lab operation that cannot go on; the CLI prints the message as one line and exits non-zero."""
