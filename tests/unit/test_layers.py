"""gpufleet's layers run one way, and a folder is a layer: each module imports only modules of its own folder's layer
or of the layers below it, no two folders import each other (directly or around a loop), and no import cycle joins
gpufleet's modules. Each check fails on a violating import added to a throwaway copy of the tree.

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
from typing import Any

import pytest

# The layers, bottom first: a folder is a layer (a folder not listed takes its nearest listed parent's: roles/<role>/
# are roles/), and a module may import its own folder's modules and those of the layers before it. A layer's
# folders may import each other one way only (no cycle between folders: test_no_folder_cycle).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("node", ("gpufleet/node",)),  # the node tools: shipped to the GPU nodes, run by their python3, stdlib only
    ("base", ("gpufleet", "gpufleet/units", "gpufleet/gpu")),  # paths and unit names on a node, addresses, files,
    # units' text, GPU documents and profiles: what every layer shares
    ("values", ("gpufleet/values",)),  # what an input value may be: grammar, bounds, types, vLLM's flags, refusals
    ("settings", ("gpufleet/config/settings",)),  # each role's settings: one record per variable
    ("config", ("gpufleet/config",)),  # one host's settings composed (the schema), their layers and checks, the fleet
    ("plan", ("gpufleet/plan",)),  # replicas, memory, commands, the routers' backends, allow lists, virtual address
    ("measure", ("gpufleet/measure",)),  # gpufleet bench: the ceiling's ramp, client, records, capacity; start times
    ("monitoring", ("gpufleet/monitoring",)),  # Prometheus's rules and scrape configuration, dashboards, from the plan
    ("inventory", ("gpufleet/inventory",)),  # an inventory file read as a fleet, checked by config's and plan's rules
    ("facts", ("gpufleet/facts",)),  # pyinfra facts: what a node has
    ("run", ("gpufleet/run",)),  # one deploy run's state: the fleet, probed GPUs, the plan, lost nodes, op order
    ("operations", ("gpufleet/operations",)),  # pyinfra operations: what a node is made to have
    ("remote", ("gpufleet/remote",)),  # the controller on inventory hosts outside a deploy: commands, the GPU probe,
    # the bench records' store
    ("rollout", ("gpufleet/rollout",)),  # a rolling upgrade or rollback: batches, routers, the canary
    ("diag", ("gpufleet/diag",)),  # gpufleet diag: the failure-signature catalog and what it finds
    ("cli", ("gpufleet/cli",)),  # the gpufleet command: an entry point, imported by no other layer
    ("lab", ("lab/gpufleet_lab",)),  # gpufleet_lab, its own distribution: imports the product, imported by none of it
    ("roles", ("roles",)),  # roles/<role>/: each role's operations, settings and helpers; roles/site.py, their order
    ("deploys", ("deploys",)),  # deploys/: the files pyinfra runs
)
ENTRY_LAYERS = {"cli", "lab"}  # only their own layer imports them
LAYER_NAMES = tuple(name for name, _ in LAYERS)
FOLDER_LAYER = {folder: name for name, folders in LAYERS for folder in folders}
NODE_THIRD_PARTY = {"pynvml"}  # the node tools' one import beyond the standard library (the node's NVML bindings)
# the node tools run with a release's own Python (its vLLM virtualenv), which may import its torch (and a Ray
# replica's, its Ray)
RELEASE_TOOLS = {"gpufleet.node.burn_in": {"torch"}, "gpufleet.node.fabric_check": {"torch"},
                 "gpufleet.node.ray_join_wait": {"ray"}}

ROOT = Path(os.environ.get("GPUFLEET_LAYERS_ROOT", Path(__file__).resolve().parents[2]))
SOURCES = {"gpufleet": "gpufleet", "gpufleet_lab": "lab/gpufleet_lab", "roles": "roles", "deploys": "deploys"}
_ENTRY = re.compile(r"((?:gpufleet|gpufleet_lab|roles|deploys)(?:\.\w+)*):\w+")


@dataclass(frozen=True)
class Import:
    """One import of a module of the tree: where it is written, what it names, and both modules' folders."""

    path: Path
    line: int
    importer: str
    imported: str  # the module itself (``from package import module`` names the module)
    importer_folder: str
    imported_folder: str
    root: Path

    def where(self) -> str:
        return f"{self.path.relative_to(self.root)}:{self.line}"


def _module_name(root: Path, package: str, path: Path) -> str:
    parts = (package, *path.relative_to(root / SOURCES[package]).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(root: Path = ROOT) -> dict[str, Path]:
    return {_module_name(root, package, path): path
            for package, folder in SOURCES.items() for path in sorted((root / folder).rglob("*.py"))}


def _folder(path: Path, root: Path) -> str:
    return path.parent.relative_to(root).as_posix()


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


def _imports(root: Path = ROOT) -> list[Import]:
    modules = _modules(root)
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
                    found.append(Import(path, getattr(node, "lineno", 0), importer, target, _folder(path, root),
                                        _folder(modules[target], root), root))
    return found


def layer_of(folder: str) -> str:
    """The layer of a folder of the tree: its own, else its nearest listed parent's (roles/<role>/: roles)."""
    at = folder
    while at not in FOLDER_LAYER:
        if "/" not in at:
            raise AssertionError(f"{folder}/: in no layer: add it to LAYERS in {Path(__file__).name}")
        at = at.rsplit("/", 1)[0]
    return FOLDER_LAYER[at]


def violations(imports: list[Import]) -> list[str]:
    """Each import against the order: of a layer above its own, or of an entry layer from another layer."""
    found = []
    for one in imports:
        low, high = layer_of(one.imported_folder), layer_of(one.importer_folder)
        if LAYER_NAMES.index(low) > LAYER_NAMES.index(high):
            why = "a layer above it"
        elif low in ENTRY_LAYERS and low != high:
            why = "an entry layer"
        else:
            continue
        found.append(f"{one.where()}: {one.importer} ({one.importer_folder}/, layer {high}) imports {one.imported}"
                     f" ({one.imported_folder}/, layer {low}): {why}")
    return found


def cycle(edges: dict[str, dict[str, Import]]) -> list[str]:
    """The first cycle of a graph of imports (its nodes modules or folders), each step with where it is written;
    empty without one."""
    state: dict[str, int] = {}  # 1: on the path being walked, 2: done
    path: list[str] = []

    def cycle_from(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for imported in sorted(edges.get(node, {})):
            if state.get(imported) == 1:
                return [*path[path.index(imported):], imported]
            if imported not in state and (found := cycle_from(imported)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := cycle_from(node)) is not None:
            return [" -> ".join(found)] + [f"  {edges[a][b].where()}: {a} imports {b}"
                                            for a, b in itertools.pairwise(found)]
    return []


def module_cycle(imports: list[Import]) -> list[str]:
    edges: dict[str, dict[str, Import]] = {}
    for one in imports:
        edges.setdefault(one.importer, {}).setdefault(one.imported, one)
    return cycle(edges)


def folder_cycle(imports: list[Import]) -> list[str]:
    edges: dict[str, dict[str, Import]] = {}
    for one in imports:
        if one.importer_folder != one.imported_folder:
            edges.setdefault(one.importer_folder, {}).setdefault(one.imported_folder, one)
    return cycle(edges)


@pytest.fixture(scope="module")
def imports() -> list[Import]:
    assert "gpufleet.plan.planner" in _modules(), f"no gpufleet source under {ROOT}"
    return _imports()


def test_every_folder_is_a_layer() -> None:
    """Every folder that holds a module is in a layer; under gpufleet/ each is listed itself (a new folder is placed
    on purpose), and every listed folder exists."""
    folders = {_folder(path, ROOT) for path in _modules().values()}
    missing = []
    for folder in sorted(folders):
        try:
            layer_of(folder)
        except AssertionError as exc:
            missing.append(str(exc))
        if folder.startswith("gpufleet") and folder not in FOLDER_LAYER:
            missing.append(f"{folder}/: a folder of gpufleet/ not listed in LAYERS itself")
    assert not missing, "\n".join(missing)
    assert set(FOLDER_LAYER) <= folders, set(FOLDER_LAYER) - folders


def test_every_import_goes_down_the_layers(imports: list[Import]) -> None:
    order = " < ".join(LAYER_NAMES)
    assert not (found := violations(imports)), f"imports against the layer order ({order}):\n" + "\n".join(found)


def test_no_import_cycle(imports: list[Import]) -> None:
    assert not (found := module_cycle(imports)), "an import cycle: " + "\n".join(found)


def test_no_folder_cycle(imports: list[Import]) -> None:
    """Two folders of one layer import each other one way only: each folder can be read after those it imports."""
    assert not (found := folder_cycle(imports)), "folders that import each other: " + "\n".join(found)


# A throwaway copy of the tree with one import added: each check must fail on it, naming the import.
BREAKS = [
    ("gpufleet/plan/planner.py", "from gpufleet.rollout import batches", violations,
     "gpufleet.plan.planner (gpufleet/plan/, layer plan) imports gpufleet.rollout.batches"),
    ("gpufleet/config/schema.py", "from gpufleet.cli import main", violations, "imports gpufleet.cli.main"),
    ("gpufleet/plan/layout.py", "from gpufleet.plan import planner", module_cycle,
     "gpufleet.plan.layout -> gpufleet.plan.planner"),
    ("gpufleet/netaddr.py", "from gpufleet.gpu import profiles", folder_cycle, "gpufleet -> gpufleet/gpu -> gpufleet"),
]


@pytest.mark.parametrize(("file", "line", "check", "expected"), BREAKS, ids=[b[2].__name__ for b in BREAKS])
def test_each_check_fails_on_a_violating_import_in_a_copy(
        tmp_path: Path, file: str, line: str, check: Any, expected: str) -> None:
    for folder in SOURCES.values():
        for path in (ROOT / folder).rglob("*.py"):
            copy = tmp_path / path.relative_to(ROOT)
            copy.parent.mkdir(parents=True, exist_ok=True)
            copy.write_text(path.read_text())
    assert not check(_imports(tmp_path))  # the copy as it is passes
    broken = tmp_path / file
    broken.write_text(broken.read_text() + f"\n{line}\n")
    found = "\n".join(check(_imports(tmp_path)))
    assert expected in found and f"{file}:" in found, found


def test_the_node_tools_import_the_standard_library_only() -> None:
    found = []
    for module, path in _modules().items():
        if layer_of(_folder(path, ROOT)) != "node":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            found += [f"{path.relative_to(ROOT)}:{node.lineno}: {module} imports {name}" for name in names
                      if name.split(".")[0] not in {*sys.stdlib_module_names, *NODE_THIRD_PARTY}
                      and name.split(".")[0] not in RELEASE_TOOLS.get(module, set())]
    assert not found, "\n".join(found)
