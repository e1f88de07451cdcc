"""Where each value of a host's configuration comes from, lowest precedence first.

role defaults (roles/*/defaults.yml) < group_vars/all.yml < group_vars/<group>.yml (groups in the
order the inventory defines them; the later wins) < data written in the inventory file for a
group < host data < ``pyinfra --data``.
"""

from __future__ import annotations

import copy
import functools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpufleet.config.yaml_strict import YamlProblem, load_yaml
from gpufleet.input_files import InputFileError, read_regular
from gpufleet.values.grammar import show
from gpufleet.values.problems import Problem

PROJECT_ROOT = Path(__file__).resolve().parents[2]
ROLES_DIR = PROJECT_ROOT / "roles"


@dataclass(frozen=True)
class Layer:
    """One source of values: a YAML file, the inventory, or the command line."""

    source: str
    values: dict[str, Any]


@dataclass
class HostLayers:
    """The layers that make up one host's configuration."""

    name: str
    layers: list[Layer] = field(default_factory=list)

    def merged(self) -> tuple[dict[str, Any], dict[str, str]]:
        """The merged values and, per key, the source that set it."""
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for layer in self.layers:
            for key, value in layer.values.items():
                values[key] = value
                sources[key] = layer.source
        return values, sources


def display_path(path: Path) -> str:
    """A path relative to the working directory, or to the project, when it is below it."""
    try:
        target = path.resolve()
    except (OSError, RuntimeError):  # a link loop: its own path only
        target = Path(os.path.abspath(path))
    for base in (Path.cwd().resolve(), PROJECT_ROOT):
        for candidate in (Path(os.path.abspath(path)), target):  # a link's own path first, then its target's
            try:
                return str(candidate.relative_to(base))
            except ValueError:
                continue
    return str(path)


def is_role_default(source: str) -> bool:
    """Whether a value's source is a role's defaults.yml."""
    return source.startswith("roles/") and source.endswith("/defaults.yml")


def read_yaml_mapping(path: Path) -> tuple[dict[str, Any], list[Problem]]:
    """Read a YAML file whose top level must be a mapping (an empty file is an empty mapping)."""
    shown = display_path(path)
    try:
        doc = load_yaml(read_regular(path, "a YAML file"))
    except InputFileError as exc:
        return {}, [Problem(shown, "", exc.message)]
    except YamlProblem as exc:
        return {}, [Problem(shown + exc.where, "", exc.message)]
    if doc is None:
        return {}, []
    if not isinstance(doc, dict):
        kind = {"list": "a list", "str": "a scalar (text)"}.get(type(doc).__name__, f"a scalar ({type(doc).__name__})")
        return {}, [Problem(shown, "", f"expected a mapping of variables, found {kind}")]
    bad = [k for k in doc if not isinstance(k, str)]
    if bad:
        return {}, [Problem(shown, show(bad[0]), "expected a variable name, found a non-text key")]
    return doc, []


@functools.lru_cache(maxsize=64)
def _read_role_defaults(path: Path, shown: str, version: tuple[int, int, int]) -> tuple[dict[str, Any], list[Problem]]:
    """:func:`read_yaml_mapping` of a role's defaults.yml, once per version of the file (``version``: its inode,
    size and mtime) and the way it is shown: every inventory a process loads reads the same files, and the pure-Python
    YAML parser took 93% of an inventory's check (the bad-input corpus loads hundreds)."""
    return read_yaml_mapping(path)


def role_default_layers() -> tuple[list[Layer], list[Problem]]:
    """One layer per role's defaults.yml, in role-name order (each caller gets values of its own to change)."""
    layers, problems = [], []
    found_files = sorted(ROLES_DIR.glob("*/defaults.yml"))
    if not found_files:  # gpufleet installed from its wheel: the library alone
        return [], [Problem(str(ROLES_DIR), "", "expected the roles' defaults (roles/*/defaults.yml) of a"
                            " gpufleet checkout, found none: gpufleet runs from its checkout (git clone); its wheel"
                            " holds the library alone, not the roles, templates and deploys")]
    for path in found_files:
        shown = display_path(path)
        try:
            stat = path.stat()
        except OSError:
            values, read = read_yaml_mapping(path)  # gone since the glob: named as any unreadable file is
        else:
            values, read = _read_role_defaults(path, shown, (stat.st_ino, stat.st_size, stat.st_mtime_ns))
        layers.append(Layer(shown, copy.deepcopy(values)))
        problems += read
    return layers, problems
