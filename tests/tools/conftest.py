"""What the ``tools`` tier's modules share: the NVML simulator, compiled once a session; and a test's own HAProxy
with its replicas (tests/tools/router_admin_haproxy.py's)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from gpufleet_lab.nvml_sim import build_library

from tests.conftest import host_tool
from tests.tools.router_admin_haproxy import Router, running_router


@pytest.fixture(scope="session")
def sim_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The NVML simulator's library (lab/gpufleet_lab/nvml_sim), built with this machine's gcc."""
    host_tool("gcc", "gcc")
    return build_library(tmp_path_factory.getbasetemp() / "nvml-sim")


@pytest.fixture
def router(tmp_path: Path) -> Iterator[Router]:
    """A router of the test's own (router_admin_haproxy's HAProxy and replicas), for a test that changes it; a module
    that needs another router defines its own ``router``."""
    with running_router(tmp_path) as started:
        yield started
