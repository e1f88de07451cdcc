"""The tests' tree mirrors the product's: each folder of tests/unit/ holds the tests of one folder of the tree, and
tests share through fixtures and helper modules, never through another test module."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "tests" / "unit"
# a test folder that is not named after a folder of gpufleet/: the folder of the tree it tests
TESTED = {"roles": "roles", "lab": "lab/gpufleet_lab", "benchmarks": "bench", "scripts": "scripts"}
# at the top of tests/unit/: the project-wide checks, and the tests of the modules at the top of gpufleet/
TOP = {"test_layers.py", "test_tree.py", "test_docs.py", "test_wheel.py", "test_digest.py", "test_input_files.py",
       "test_pyinfra_seam.py"}


def _imported(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
            found.append((node.lineno, node.module))
    return found


def test_no_test_module_imports_another_test_module() -> None:
    found = [f"{path.relative_to(ROOT)}:{line}: imports {name}"
             for path in sorted((ROOT / "tests").rglob("*.py")) for line, name in _imported(path)
             if name.startswith("tests.") and any(part.startswith("test_") for part in name.split("."))]
    assert not found, "a test module imports another (share a fixture or a helper module instead):\n" + "\n".join(found)


def test_each_folder_of_the_unit_tests_is_a_folder_of_the_tree() -> None:
    folders = sorted(path.parent for path in UNIT.glob("*/__init__.py"))
    assert folders, f"no test folder under {UNIT}"
    strays = [f"tests/unit/{folder.name}/: tests no folder of the tree" for folder in folders
              if not (ROOT / TESTED.get(folder.name, f"gpufleet/{folder.name}")).is_dir()]
    assert not strays, "\n".join(strays)
    loose = [path.name for path in UNIT.glob("test_*.py") if path.name not in TOP]
    assert not loose, f"tests at the top of tests/unit/ that belong in a folder of it: {loose}"
