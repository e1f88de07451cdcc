"""Secrets read on the controller from their references (``{env: NAME}`` or ``{file: PATH}``), never shown."""

from __future__ import annotations

import os
from pathlib import Path

from gpufleet.config.problems import ConfigError, Problem
from gpufleet.config.schema import SecretRef


def read_secret(ref: SecretRef, key: str) -> str:
    """The secret ``ref`` names, stripped; ConfigError naming ``key`` (never the value) when it is unset, unreadable
    or empty."""
    if ref.env is not None:
        value = (os.environ.get(ref.env) or "").strip()
        if not value:
            raise ConfigError([Problem("controller", key, f"expected environment variable {ref.env} to be set,"
                                                       " found it unset or empty")])
        return value
    path = Path(os.path.expanduser(str(ref.file)))
    try:
        value = path.read_text().strip()
    except OSError as exc:
        raise ConfigError([Problem("controller", key, f"expected a readable secret file {path},"
                                                   f" found: {exc.strerror}")]) from None
    except UnicodeDecodeError:
        raise ConfigError([Problem("controller", key, f"expected a text secret in {path},"
                                                   " found binary data")]) from None
    if not value:
        raise ConfigError([Problem("controller", key, f"expected a secret in {path}, found an empty file")])
    return value
