"""Values written into systemd unit files and EnvironmentFiles, escaped so that systemd reads back the literal value.

The one home for this escaping: every role renders node-specific values into units and environment files
through these functions, never by pasting them into a template.

- :func:`exec_line` / :func:`exec_arg`: words of ``ExecStart=`` (systemd.service(5), "Command lines"). systemd
  splits on whitespace, unquotes ``"..."`` with C-style backslash escapes, expands ``%`` specifiers when it
  loads the unit and ``$VAR``/``${VAR}`` when it starts the command: a word is double-quoted when it holds
  anything beyond a safe set, with ``\\`` and ``"`` backslash-escaped, ``%`` written ``%%`` and ``$`` ``$$``.
- :func:`unit_value`: a plain setting such as ``Description=`` (``%`` specifiers only).
- :func:`env_file` / :func:`env_value`: ``NAME="value"`` lines of an ``EnvironmentFile=`` (systemd.exec(5)).
  Inside double quotes systemd removes the backslash before ``"``, ``\\``, `````` and ``$`` and keeps every
  other character as is; a POSIX shell that sources the file (``set -a; . FILE``) reads the same value, since
  its double quotes treat exactly those four characters specially.

No value may hold a line break or NUL (a second line would be a directive of its own): such a value raises
:class:`UnitValueError` before anything reaches a node.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

_SAFE_WORD = re.compile(r"^[A-Za-z0-9_./:=,@+\[\]-]+$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_ENV_SPECIAL = re.compile(r'([\\"`$])')


class UnitValueError(ValueError):
    """A value that cannot be written into a unit or environment file (a line break, NUL, a bad name)."""


def _one_line(value: str, what: str) -> str:
    if any(c in value for c in "\n\r\0"):
        raise UnitValueError(f"{what}: expected a value on one line, found a line break or NUL in {value!r}")
    return value


def exec_arg(value: str) -> str:
    """One ``ExecStart=`` word that systemd passes to the program as exactly ``value``."""
    _one_line(value, "command-line argument")
    if _SAFE_WORD.match(value):
        return value
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%").replace("$", "$$")
    return f'"{escaped}"'


def exec_line(argv: Iterable[str]) -> str:
    """An ``ExecStart=`` command line: the absolute program path and its arguments, each escaped."""
    words = list(argv)
    if not words or not words[0].startswith("/"):
        raise UnitValueError(f"expected an absolute program path first, found {words[:1]}")
    return " ".join(exec_arg(word) for word in words)


def unit_value(value: str) -> str:
    """A plain unit setting (``Description=``): ``%`` escaped, one line, no trailing backslash (continuation)."""
    _one_line(value, "unit setting")
    if value.endswith("\\"):
        raise UnitValueError(f"unit setting: expected no trailing backslash, found {value!r}")
    return value.replace("%", "%%")


def env_value(value: str) -> str:
    """``"value"`` for an EnvironmentFile line, read back literally by systemd and by a sourcing shell."""
    _one_line(value, "environment value")
    return '"' + _ENV_SPECIAL.sub(r"\\\1", value) + '"'


def env_file(env: Mapping[str, str], header: str) -> str:
    """A systemd EnvironmentFile: a ``# header`` comment, then one ``NAME="value"`` a line."""
    lines = [f"# {_one_line(header, 'header')}"]
    for name, value in env.items():
        if not _ENV_NAME.match(name):
            raise UnitValueError(f"expected an environment variable name, found {name!r}")
        lines.append(f"{name}={env_value(value)}")
    return "\n".join(lines) + "\n"

