"""The vllm role's unit environment against this machine's systemd (``systemd-path``): the PATH a toolkit's bin/
is put before is systemd's own. The rest of the role: tests/unit/roles/test_vllm_role.py.
"""

from __future__ import annotations

import subprocess

from gpufleet import node_paths
from tests.conftest import host_tool
from tests.unit.unit_files import UNIT_PATH


def test_unit_default_path_is_what_systemd_gives_a_unit() -> None:
    """The PATH a toolkit's bin/ is put before: systemd's own for units that set none (Debian 12's systemd)."""
    systemd_path = host_tool("systemd-path", "systemd")
    done = subprocess.run([systemd_path, "search-binaries-default"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == node_paths.UNIT_DEFAULT_PATH == UNIT_PATH
