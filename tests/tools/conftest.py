"""What the ``tools`` tier's modules share: the NVML simulator, compiled once a session."""

from __future__ import annotations

from pathlib import Path

import pytest
from gpufleet_lab.nvml_sim import build_library

from tests.conftest import host_tool


@pytest.fixture(scope="session")
def sim_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The NVML simulator's library (lab/gpufleet_lab/nvml_sim), built with this machine's gcc."""
    host_tool("gcc", "gcc")
    return build_library(tmp_path_factory.getbasetemp() / "nvml-sim")
