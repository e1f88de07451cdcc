"""gpufleet's wheel holds the product only: its package and data, nothing of the lab (``lab/``, ``gpufleet_lab``).

The wheel is built from a copy of the checkout, as ``pip wheel`` would build it, with the setuptools the ``test``
extra installs, and its file list read back.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.conftest import ROOT

_NOT_SOURCE = (".git", ".venv", "*.egg-info", "build", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache",
               ".lab", ".cache", ".whl")


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    tree = tmp_path_factory.mktemp("checkout") / "gpufleet"
    shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(*_NOT_SOURCE))
    out = tree / "dist"
    done = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta;"
                           " print(build_meta.build_wheel(sys.argv[1]))", str(out)],
                          cwd=tree, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    wheel = out / done.stdout.strip().splitlines()[-1]
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist()


def test_the_wheel_holds_no_file_of_the_lab(wheel_files: list[str]) -> None:
    lab = [name for name in wheel_files if name.startswith(("gpufleet_lab", "lab/")) or "/lab/" in name
           or "nvml_sim" in name or "double_programs" in name]
    assert not lab, lab


def test_the_wheel_holds_the_product_and_its_data_only(wheel_files: list[str]) -> None:
    tops = {name.split("/", 1)[0] for name in wheel_files}
    assert tops == {"gpufleet", "gpufleet-0.1.0.dist-info"}, tops
    for needed in ("gpufleet/cli/main.py", "gpufleet/plan/planner.py", "gpufleet/node/nvml_probe.py",
                   "gpufleet/data/vllm_memory.yml", "gpufleet/py.typed"):
        assert needed in wheel_files, needed
    entry_points = next(name for name in wheel_files if name.endswith("entry_points.txt"))
    assert entry_points == "gpufleet-0.1.0.dist-info/entry_points.txt"
