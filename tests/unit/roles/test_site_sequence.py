"""The site sequence (roles/site.py) calls each role from a line of its own.

pyinfra names an operation by the line numbers of its call stack alone, not by its file: roles called from one
line (a loop) give operations of different roles at the same line of their files one name, and a fleet whose
hosts add different operations (a PCIe node has no fabric manager) then stops on a cycle in pyinfra's operation
order. The lab's mixed nodes showed it; this keeps it from coming back.
"""

from __future__ import annotations

import ast
import inspect
from types import SimpleNamespace

import pytest

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


def _called_roles(monkeypatch: pytest.MonkeyPatch, serves: bool) -> list[str]:
    """The roles ``site()`` calls, in order, for a host that serves in a pool or in none."""
    called: list[str] = []
    for name, value in vars(site).items():
        if getattr(value, "__module__", "").startswith("roles.") and callable(value) and name != "site":
            monkeypatch.setattr(site, name, lambda name=name: called.append(name))
    monkeypatch.setattr(site, "fleet", lambda: SimpleNamespace(serves=lambda _: serves))
    monkeypatch.setattr(site, "host", SimpleNamespace(name="router-1"))
    site.site()
    return called


def test_a_host_in_no_pool_gets_the_edge_and_monitoring_and_loses_what_it_served() -> None:
    """A dedicated router or monitoring host: no driver, GPU gate or vLLM install, but the replicas and Ray units
    it ran while it served are retired; a serving host gets every role."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        dedicated = _called_roles(monkeypatch, serves=False)
    assert dedicated == ["common", "node_exporter", "vllm_retire", "ray", "router", "keepalived", "monitoring",
                         "start_records", "node_records"]
    with pytest.MonkeyPatch.context() as monkeypatch:
        serving = _called_roles(monkeypatch, serves=True)
    assert serving == ["common", "nvidia_driver", "dcgm", "gpu_gate", "node_exporter", "dcgm_exporter",
                       "vllm_install", "node_lifecycle", "ray", "vllm_serve", "gpu_watch", "router", "keepalived",
                       "monitoring", "start_records", "node_records"]
