"""Role defaults are parsed once per version of each file (gpufleet.config.layers): a changed file is read again,
and each caller gets values of its own to change."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from gpufleet.config import layers
from tests.conftest import ROOT


@pytest.fixture
def roles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the project's roles/ that role_default_layers reads instead."""
    copy = tmp_path / "roles"
    shutil.copytree(ROOT / "roles", copy, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    monkeypatch.setattr(layers, "ROLES_DIR", copy)
    return copy


def _defaults(role: str) -> dict[str, object]:
    found, problems = layers.role_default_layers()
    assert problems == []
    return next(layer.values for layer in found if layer.source.endswith(f"/{role}/defaults.yml"))


def test_a_changed_defaults_file_is_read_again(roles: Path) -> None:
    path = roles / "vllm" / "defaults.yml"
    assert _defaults("vllm")["vllm_port"] == 8000
    text = path.read_text()
    path.write_text(text.replace("\nvllm_port: 8000\n", "\nvllm_port: 8001\n"))
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # a later version, whatever the clock
    assert _defaults("vllm")["vllm_port"] == 8001


def test_each_caller_gets_values_of_its_own(roles: Path) -> None:
    first = _defaults("vllm")
    first["vllm_port"] = 1
    env = first["vllm_env"]
    assert isinstance(env, dict)
    env["CHANGED_BY_A_CALLER"] = "1"
    second = _defaults("vllm")
    assert second["vllm_port"] == 8000
    assert "CHANGED_BY_A_CALLER" not in (second["vllm_env"] or {})
