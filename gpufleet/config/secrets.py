"""Secrets read on the controller from their references (``{env: NAME}`` or ``{file: PATH}``), never shown.

Each secret is read once per process: one pyinfra run (a deploy, each wave of a rollout) or one ``gpufleet`` command.
The inventory's checks, every role and every replica of the run get that one value, so a key rotated while a deploy
runs reaches the replicas and the routers as the same key, and the next run reads the new one. :data:`READS` counts
the reads by source; :func:`forget` starts over (a process that runs several deploys, and the tests).
"""

from __future__ import annotations

import os
import stat
import unicodedata
from collections import Counter
from pathlib import Path

from gpufleet.config.schema import keys
from gpufleet.input_files import InputFileError, read_regular
from gpufleet.values import grammar
from gpufleet.values.problems import ConfigError, Problem
from gpufleet.values.types import SecretRef

ENV_FILE_SECRETS = keys(secret="env_file")
"""Secrets that reach a node in a systemd EnvironmentFile (one ``NAME="value"`` line each)."""

SECRET_MAX_BYTES = 1 << 20
"""The largest secret file read (a key, a token or a TLS pair with its chain is a few KiB)."""


def _where(ref: SecretRef) -> str:
    return f"environment variable {ref.env}" if ref.env is not None else f"{Path(os.path.expanduser(str(ref.file)))}"


READS: Counter[str] = Counter()
"""How many times each source (an environment variable's name, a file's path) was read by this process."""

_KEPT: dict[str, str] = {}


def forget() -> None:
    """Forget what was read: the next read of each secret reads its source again."""
    _KEPT.clear()
    READS.clear()


def _read(ref: SecretRef, key: str) -> str:
    """The referenced text, stripped, as first read by this process; ConfigError naming ``key`` (never the value)
    when unset, unreadable or empty (read again next time)."""
    source = _where(ref)
    if source not in _KEPT:
        _KEPT[source] = _read_source(ref, key)
        READS[source] += 1
    return _KEPT[source]


def _named(name: str) -> str:
    """An environment variable's name or a file's path as a message shows it: never one that holds what looks like a
    credential (a key pasted where its variable's name was meant)."""
    return "(a name that looks like a credential, not shown)" if grammar.secret_like(name) else name


def _read_source(ref: SecretRef, key: str) -> str:
    if ref.env is not None:
        value = (os.environ.get(ref.env) or "").strip()
        if not value:
            raise ConfigError([Problem("controller", key, f"expected environment variable {_named(ref.env)} to be"
                                                       " set, found it unset or empty")])
        return value
    path = Path(os.path.expanduser(str(ref.file)))
    try:
        value = read_regular(path, "a regular file", SECRET_MAX_BYTES).decode().strip()
    except InputFileError as exc:
        raise ConfigError([Problem("controller", key, f"expected a readable secret file {_named(str(path))},"
                                                   f" found: {exc.found}")]) from None
    except UnicodeDecodeError:
        raise ConfigError([Problem("controller", key, f"expected a text secret in {_named(str(path))},"
                                                   " found binary data")]) from None
    if not value:
        raise ConfigError([Problem("controller", key,
                                   f"expected a secret in {_named(str(path))}, found an empty file")])
    return value


def line_problem(value: str, ref: SecretRef, into: str = "an environment file") -> str | None:
    """Why ``value`` cannot be one line of ``into`` (a line break, NUL or another control or format character
    inside it), naming the character's kind, never the value; None when it can."""
    for ch in value:
        if unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp"):
            kind = {"\n": "a line break", "\r": "a carriage return", "\x00": "a NUL byte"}.get(ch) or {
                "Cf": "a format character", "Zl": "a line separator", "Zp": "a paragraph separator"}.get(
                unicodedata.category(ch), "a control character") + f" (U+{ord(ch):04X})"
            return (f"expected a secret that fits one line of {into}, found {kind} inside the one in"
                    f" {_where(ref)} (not shown)")
    return None


def read_secret(ref: SecretRef, key: str, one_line: bool = True, into: str = "an environment file") -> str:
    """The secret ``ref`` names, stripped; ConfigError naming ``key`` (never the value) when it is unset,
    unreadable, empty, or (``one_line``: bound for one line of ``into``, an environment file or a configuration)
    holds a line break or another control character."""
    value = _read(ref, key)
    if one_line and (problem := line_problem(value, ref, into)):
        raise ConfigError([Problem("controller", key, problem)])
    return value


def unfit_secret(ref: SecretRef) -> str | None:
    """Why the secret ``ref`` names cannot go into an environment file, when the controller can read it now or
    names something that is not a regular file (a pipe, a directory, a device: it never will be); None when it
    can, or cannot be read now (the deploy reads it and says why)."""
    try:
        value = _read(ref, "")
    except ConfigError as error:
        return error.problems[0].message if _not_a_file(ref) else None
    return line_problem(value, ref)


def _not_a_file(ref: SecretRef) -> bool:
    """Whether ``ref`` names a path that exists as something other than a regular file."""
    if ref.file is None:
        return False
    try:
        return not stat.S_ISREG(Path(os.path.expanduser(str(ref.file))).stat().st_mode)
    except (OSError, ValueError):
        return False
