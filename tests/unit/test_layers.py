"""gpufleet's layers run one way: each module imports only modules of its own layer or of the layers below it, and
no import cycle joins gpufleet's modules.

Every import counts, wherever it sits: at the top of a module, inside a function (a lazy import), under
``if TYPE_CHECKING:``, an ``importlib.import_module("...")`` of a literal name and a ``"module:attribute"`` entry
string (how the CLI loads its slow commands). The source is read with ``ast``, nothing is imported: set
``GPUFLEET_LAYERS_ROOT`` to check another copy of the tree.
"""

from __future__ import annotations

import ast
import itertools
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

# The layers, bottom first: a module may import its own layer and those before it. A module belongs to the
# longest prefix of its name listed in LAYER_OF.
LAYERS = (
    "node",  # the node tools: shipped to the GPU nodes and run by their own python3, standard library only
    "base",  # what every layer shares: paths and unit names on a node, addresses, files, units' text, GPU documents
    "config",  # one host's settings: the schema, their layers and their checks, the fleet they make
    "plan",  # replicas, their memory and commands, the models' maths, the routers' backends and virtual address
    "inventory",  # an inventory file read as a fleet, checked with the config's and the plan's rules
    "deploy",  # what a deploy adds: pyinfra facts and operations, deploy helpers, monitoring's files, live probes
    "rollout",  # a rolling upgrade or rollback: SSH to the nodes and routers, batches, the canary
    "cli",  # the gpufleet command: an entry point, imported by no other layer
    "lab",  # gpufleet_lab, its own distribution (lab/): may import the product, imported by nothing of it
    "roles",  # roles/: each role's operations, and the site sequence that calls them in order
    "deploys",  # deploys/: the files pyinfra runs
)
ENTRY_LAYERS = {"cli", "lab"}  # only their own layer imports them (ALLOWED aside)

# A module belongs to the layer of the longest prefix of its name listed here.
LAYER_OF = {
    "gpufleet.node": "node",
    "gpufleet": "base",  # the package's own __init__ and the modules at its top: node_paths, netaddr, digest, ...
    "gpufleet.units": "base",
    "gpufleet.gpu": "base",
    "gpufleet.pyinfra_seam": "base",  # every private surface of pyinfra, its CLI and paramiko: no gpufleet import
    "gpufleet.config": "config",
    "gpufleet.plan": "plan",
    "gpufleet.bench": "plan",  # the measured ceiling: a ramp, its client, its records and what they say of the plan
    "gpufleet.config.inventory": "inventory",
    "gpufleet.deploy": "deploy",
    "gpufleet.operations": "deploy",
    "gpufleet.facts": "deploy",
    "gpufleet.monitoring": "deploy",
    "gpufleet.gpu.live_probe": "deploy",  # runs the GPU fact (gpufleet.facts.gpu) on an inventory's hosts
    "gpufleet.rollout": "rollout",
    "gpufleet.bench.store": "rollout",  # the records on the monitoring hosts, over the rollout's SSH commands
    "gpufleet.cli": "cli",
    "gpufleet_lab": "lab",
    "roles": "roles",
    "deploys": "deploys",
}
# Imports allowed across the order, each with why.
ALLOWED: dict[tuple[str, str], str] = {}
NODE_THIRD_PARTY = {"pynvml"}  # the node tools' one import beyond the standard library (the node's NVML bindings)

ROOT = Path(os.environ.get("GPUFLEET_LAYERS_ROOT", Path(__file__).resolve().parents[2]))
SOURCES = {"gpufleet": "gpufleet", "gpufleet_lab": "lab/gpufleet_lab", "roles": "roles", "deploys": "deploys"}
_ENTRY = re.compile(r"((?:gpufleet|gpufleet_lab|roles|deploys)(?:\.\w+)*):\w+")


@dataclass(frozen=True)
class Import:
    """One import of a module of the tree: where it is written and what it names."""

    path: Path
    line: int
    importer: str
    imported: str  # the module itself (``from package import module`` names the module)

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _module_name(package: str, path: Path) -> str:
    parts = (package, *path.relative_to(ROOT / SOURCES[package]).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(package, path): path
            for package, folder in SOURCES.items() for path in sorted((ROOT / folder).rglob("*.py"))}


def _named(node: ast.AST, importer: str, is_package: bool) -> list[str]:
    """The modules an AST node imports, as written (a ``from`` import's names may be modules or attributes)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = importer.split(".")[: len(importer.split(".")) - node.level + (1 if is_package else 0)]
            module = ".".join([*base, *([node.module] if node.module else [])])
        else:
            module = node.module or ""
        return [module, *(f"{module}.{alias.name}" for alias in node.names)]
    if (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name)) and node.args
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
            in ("import_module", "__import__") and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)):
        return [node.args[0].value]
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and (match := _ENTRY.fullmatch(node.value)):
        return [match.group(1)]
    return []


def _imports(modules: dict[str, Path]) -> list[Import]:
    found: list[Import] = []
    for importer, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            named = _named(node, importer, path.name == "__init__.py")
            # `from a import b`: module a.b where it is one, else a (b is an attribute of a)
            targets = [name for name in named[1:] if name in modules] or named[:1] if isinstance(
                node, ast.ImportFrom) else named
            for target in targets:
                while target and target not in modules and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in modules and target != importer:
                    found.append(Import(path, getattr(node, "lineno", 0), importer, target))
    return found


def layer_of(module: str) -> str:
    """The layer of a module of the tree: that of the longest prefix of its name in LAYER_OF."""
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        if (prefix := ".".join(parts[:end])) in LAYER_OF:
            return LAYER_OF[prefix]
    raise AssertionError(f"{module}: in no layer: add it to LAYER_OF in {Path(__file__).name}")


def _violation(found: Import) -> str | None:
    low, high = layer_of(found.imported), layer_of(found.importer)
    if (found.importer, found.imported) in ALLOWED:
        return None
    if LAYERS.index(low) > LAYERS.index(high):
        why = "a layer above it"
    elif low in ENTRY_LAYERS and low != high:
        why = "an entry layer"
    else:
        return None
    return f"{found.where()}: {found.importer} (layer {high}) imports {found.imported} (layer {low}): {why}"


@pytest.fixture(scope="module")
def imports() -> list[Import]:
    modules = _modules()
    assert "gpufleet.plan.planner" in modules, f"no gpufleet source under {ROOT}"
    return _imports(modules)


def test_every_module_is_in_a_layer() -> None:
    missing = []
    for module in _modules():
        try:
            layer_of(module)
        except AssertionError as exc:
            missing.append(str(exc))
    assert not missing, "\n".join(missing)
    assert set(LAYER_OF.values()) <= set(LAYERS)


def test_every_import_goes_down_the_layers(imports: list[Import]) -> None:
    violations = [line for found in imports if (line := _violation(found)) is not None]
    order = " < ".join(LAYERS)
    assert not violations, f"imports against the layer order ({order}):\n" + "\n".join(violations)


def test_no_import_cycle(imports: list[Import]) -> None:
    edges: dict[str, dict[str, Import]] = {}
    for found in imports:
        edges.setdefault(found.importer, {}).setdefault(found.imported, found)
    state: dict[str, int] = {}  # 1: on the path being walked, 2: done
    path: list[str] = []

    def cycle_from(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for imported in sorted(edges.get(module, {})):
            if state.get(imported) == 1:
                return [*path[path.index(imported):], imported]
            if imported not in state and (cycle := cycle_from(imported)) is not None:
                return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(edges):
        if module not in state and (cycle := cycle_from(module)) is not None:
            steps = [f"  {edges[a][b].where()}: {a} imports {b}" for a, b in itertools.pairwise(cycle)]
            pytest.fail("an import cycle: " + " -> ".join(cycle) + "\n" + "\n".join(steps))


def test_the_node_tools_import_the_standard_library_only() -> None:
    found = []
    for module, path in _modules().items():
        if layer_of(module) != "node":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            found += [f"{path.relative_to(ROOT)}:{node.lineno}: {module} imports {name}" for name in names
                      if name.split(".")[0] not in {*sys.stdlib_module_names, *NODE_THIRD_PARTY}]
    assert not found, "\n".join(found)
