"""Where each value of a host's configuration comes from, lowest precedence first.

role defaults (roles/*/defaults.yml) < group_vars/all.yml < group_vars/<group>.yml (groups in the
order the inventory defines them; the later wins) < data written in the inventory file for a
group < host data < ``pyinfra --data``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gpufleet.config.problems import Problem

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
    for base in (Path.cwd().resolve(), PROJECT_ROOT):
        try:
            return str(path.resolve().relative_to(base))
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
        doc = yaml.safe_load(path.read_text())
    except OSError as exc:
        return {}, [Problem(shown, "", f"cannot read: {exc.strerror}")]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{shown}:{mark.line + 1}:{mark.column + 1}" if mark else shown
        what = getattr(exc, "problem", None) or str(exc)
        return {}, [Problem(where, "", f"YAML syntax error: {what}")]
    if doc is None:
        return {}, []
    if not isinstance(doc, dict):
        return {}, [Problem(shown, "", f"expected a mapping of variables, found {type(doc).__name__}")]
    bad = [k for k in doc if not isinstance(k, str)]
    if bad:
        return {}, [Problem(shown, str(bad[0]), "expected a variable name, found a non-text key")]
    return doc, []


def role_default_layers() -> tuple[list[Layer], list[Problem]]:
    """One layer per role's defaults.yml, in role-name order."""
    layers, problems = [], []
    for path in sorted(ROLES_DIR.glob("*/defaults.yml")):
        values, found = read_yaml_mapping(path)
        layers.append(Layer(display_path(path), values))
        problems += found
    return layers, problems
