"""The site sequence (roles/site.py) calls each role from a line of its own.

pyinfra names an operation by the line numbers of its call stack alone, not by its file: roles called from one
line (a loop) give operations of different roles at the same line of their files one name, and a fleet whose
hosts add different operations (a PCIe node has no fabric manager) then stops on a cycle in pyinfra's operation
order. The lab's mixed nodes showed it; this keeps it from coming back.
"""

from __future__ import annotations

import ast
import inspect

from roles import site


def _site_function() -> ast.FunctionDef:
    tree = ast.parse(inspect.getsource(site))
    return next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "site")


def test_every_role_is_called_from_a_line_of_its_own() -> None:
    function = _site_function()
    assert not [node for node in ast.walk(function) if isinstance(node, (ast.For, ast.While, ast.comprehension))]
    calls = [node for node in ast.walk(function) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
             and not node.args and not node.keywords]
    roles = [call for call in calls if call.func.id != "fleet"]  # type: ignore[union-attr]
    assert len(roles) >= 10
    lines = [call.lineno for call in roles]
    assert len(lines) == len(set(lines)), lines
