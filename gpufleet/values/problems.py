"""Configuration problems: one line each, ``file: key.path: what was expected, what was found``."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from typing import NoReturn

from gpufleet.values.grammar import secret_like

EXIT_BAD_INPUT = 2


@dataclass(frozen=True)
class Problem:
    """One bad value, where it came from, and the hosts it affects."""

    source: str
    key: str
    message: str
    hosts: tuple[str, ...] = field(default=(), compare=False)

    def line(self) -> str:
        where = f"{self.source}: {self.key}: " if self.key else f"{self.source}: "
        suffix = f" (host{'s' if len(self.hosts) > 1 else ''} {', '.join(self.hosts)})" if self.hosts else ""
        return one_line(f"{where}{self.message}{suffix}")


def one_line(text: str) -> str:
    """``text`` with every control character written as its escape (``\\n``, ``\\x1b``): a file or key name that
    holds one can neither split a problem into two lines nor reach the terminal as a command."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


_PLAIN_KEY = re.compile(r"^[^\s'\"\\\[\]]+$")


HIDDEN_KEY = "<a key that looks like a credential>"
"""What a message shows for a key that looks like a credential (a token pasted where a name was meant)."""


def shown_key(name: str) -> str:
    """One key of a key path as a message names it: as written, quoted when it holds a blank, a quote, a bracket
    or another character that would blur where the path's parts begin and end (``vllm_env.'A B'``), and
    :data:`HIDDEN_KEY` when it looks like a credential."""
    if name == HIDDEN_KEY or secret_like(name):
        return HIDDEN_KEY
    return name if _PLAIN_KEY.match(name) and name.isprintable() else repr(name)


class KeyedError(ValueError):
    """A validator's complaint about a key below the field it checks (``gpu_health.expected_gpu_count``)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key, self.message = key, message


class ConfigError(Exception):
    """Raised with every problem found; the CLI and the deploys print them and exit 2."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = merge_problems(problems)
        super().__init__("\n".join(p.line() for p in self.problems))


def merge_problems(problems: list[Problem]) -> list[Problem]:
    """Fold identical problems of several hosts into one line, keeping first-seen order."""
    merged: dict[tuple[str, str, str], list[str]] = {}
    for p in problems:
        hosts = merged.setdefault((p.source, p.key, p.message), [])
        hosts.extend(h for h in p.hosts if h not in hosts)
    return [Problem(s, k, m, tuple(h)) for (s, k, m), h in merged.items()]


def exit_with(error: ConfigError) -> NoReturn:
    """Print each problem on its own line to stderr and exit 2 (no traceback)."""
    for p in error.problems:
        print(p.line(), file=sys.stderr)
    raise SystemExit(EXIT_BAD_INPUT)
