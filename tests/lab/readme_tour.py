"""The README's tour as the lab tests run it: each command of its code blocks as written (``sh`` blocks: commands,
a ``#`` comment after; ``console`` blocks: ``$ command`` and the lines it prints, ``…`` standing for lines or the
rest of a line left out), run from the repository's root with the project's virtual environment first on the path,
so that the tour cannot drift from the code."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.lab.harness import ROOT, Lab

ELIDED = "…"
_BLOCK = re.compile(r"^```(sh|console)\n(.*?)^```$", re.S | re.M)


@dataclass(frozen=True)
class TourCommand:
    """One command of the tour as written, and for a console block what it prints (None: an ``sh`` block's)."""

    line: str
    shown: tuple[str, ...] | None

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.line, comments=True)


def tour(readme: Path = ROOT / "README.md") -> list[TourCommand]:
    """The commands of the README's "A five-minute tour", in order."""
    text = readme.read_text()
    start = text.index("## A five-minute tour")
    section = text[start:text.index("\n## ", start + 1)]
    found: list[TourCommand] = []
    for kind, body in _BLOCK.findall(section):
        if kind == "sh":
            found += [TourCommand(line, None) for line in body.splitlines() if line.strip()]
            continue
        for chunk in re.split(r"^\$ ", body, flags=re.M)[1:]:
            line, *shown = chunk.rstrip("\n").split("\n")
            found.append(TourCommand(line, tuple(shown)))
    return found


def starting(words: str) -> TourCommand:
    """The tour's one command that starts with ``words``."""
    matching = [command for command in tour() if command.line == words or command.line.startswith(words + " ")]
    assert len(matching) == 1, (words, [c.line for c in tour()])
    return matching[0]


def shows(expected: tuple[str, ...], printed: str) -> bool:
    """Whether ``printed`` is what a console block shows: line by line, a line ``…`` any lines, ``…`` within a
    line any text."""
    pattern = "".join(
        r"(?:.*\n)*?" if line == ELIDED else ".*".join(map(re.escape, line.split(ELIDED))) + r"\n"
        for line in expected)
    return re.fullmatch(pattern, printed if printed.endswith("\n") else printed + "\n") is not None


def run(lab: Lab, command: TourCommand, timeout: float) -> subprocess.CompletedProcess[str]:
    """``command`` as written, against the session's lab, its programs from the project's virtual environment."""
    path = f"{ROOT / '.venv' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
    return subprocess.run(command.argv, cwd=ROOT, env={**lab.env, "PATH": path}, capture_output=True, text=True,
                          timeout=timeout)
