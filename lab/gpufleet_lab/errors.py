"""The one error the lab raises for anything an operator can fix: its message is a complete sentence."""

from __future__ import annotations


class LabError(RuntimeError):
    """A lab operation that cannot go on; the CLI prints the message as one line and exits non-zero."""


class LabInputError(LabError):
    """A lab command's bad input (an option, the inventory it reads): one line, exit 2, as gpufleet's own commands."""
