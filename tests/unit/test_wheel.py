"""gpufleet's wheel holds the product only: its package and data, nothing of the lab (``lab/``, ``gpufleet_lab``).

The wheel is built from a copy of the checkout, as ``pip wheel`` would build it, with the setuptools the ``test``
extra installs, and its file list read back.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import ROOT

_NOT_SOURCE = (".git", ".venv", "*.egg-info", "build", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache",
               ".lab", ".cache", ".whl")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """gpufleet's wheel, built from a copy of the checkout."""
    tree = tmp_path_factory.mktemp("checkout") / "gpufleet"
    shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(*_NOT_SOURCE))
    out = tree / "dist"
    done = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta;"
                           " print(build_meta.build_wheel(sys.argv[1]))", str(out)],
                          cwd=tree, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return out / done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def wheel_files(wheel: Path) -> list[str]:
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


def test_outside_a_checkout_the_wheel_says_in_one_line_that_gpufleet_runs_from_its_checkout(
        wheel: Path, tmp_path: Path) -> None:
    """Installed from its wheel (here: unpacked, beside the dependencies' site-packages, without the checkout's
    editable install), gpufleet checks an inventory in an empty directory with one line and exit 2, not a line per
    variable whose role default it cannot find."""
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    fleet = tmp_path / "fleet"
    fleet.mkdir()
    shutil.copy(ROOT / "inventories" / "prod.py", fleet / "inventory.py")
    shutil.copytree(ROOT / "group_vars", fleet / "group_vars")
    packages = next(p for p in sys.path if p.endswith("site-packages"))
    code = (f"import sys; sys.path[:0] = [{str(site)!r}, {packages!r}]; from gpufleet.cli.main import main;"
            " sys.argv = ['gpufleet', 'check', 'inventory.py']; main()")
    done = subprocess.run([sys.executable, "-S", "-c", code], cwd=fleet, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and "gpufleet runs from its checkout" in lines[0], done.stderr
    assert str(site) in lines[0], lines[0]  # where it looked
