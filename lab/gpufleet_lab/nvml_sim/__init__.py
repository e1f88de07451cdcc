"""NVML simulator, a LAB DOUBLE: a ``libnvidia-ml.so.1`` that answers NVML from a hardware profile file.

Put the built library's directory first on ``LD_LIBRARY_PATH`` and nvidia-ml-py (which loads
``libnvidia-ml.so.1`` by name) talks to it instead of a driver. The answers come from the profile
named by ``GPUFLEET_NVML_SIM_PROFILE`` (default ``/etc/gpufleet/nvml-sim-profile``), written by
:mod:`gpufleet_lab.sim_profile`. The C source documents the profile format and the calls it answers.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

LIBRARY_NAME = "libnvidia-ml.so.1"
PROFILE_ENV = "GPUFLEET_NVML_SIM_PROFILE"
DEFAULT_PROFILE_PATH = Path("/etc/gpufleet/nvml-sim-profile")
SOURCE = Path(__file__).with_name("nvml_sim.c")
CFLAGS = ("-std=c11", "-D_DEFAULT_SOURCE", "-DNVML_NO_UNVERSIONED_FUNC_DEFS", "-O2", "-pthread", "-Wall", "-Wextra",
          "-Wno-deprecated-declarations", "-fPIC", "-fvisibility=hidden", "-shared",
          f"-Wl,-soname,{LIBRARY_NAME}")


def library_dir() -> str:
    """Where Debian keeps this machine's libraries, as NVIDIA's packages install ``libnvidia-ml.so.1``
    (``usr/lib/x86_64-linux-gnu``)."""
    machine = platform.machine()
    triplet = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu"}.get(machine, f"{machine}-linux-gnu")
    return f"usr/lib/{triplet}"


class SimBuildError(RuntimeError):
    """The simulator library could not be built; the message says what is missing."""


def nvml_header() -> Path:
    """NVIDIA's ``nvml.h`` from the installed nvidia-nvml-dev package."""
    for entry in sys.path:
        for header in sorted(Path(entry or ".").glob("nvidia/*/include/nvml.h"), reverse=True):
            return header
    raise SimBuildError("nvml.h not found: install the nvidia-nvml-dev package (pip install nvidia-nvml-dev)")


def build_library(out_dir: Path) -> Path:
    """Compile the simulator into ``out_dir/libnvidia-ml.so.1`` unless the same source is built there.

    The build is keyed by a hash of the C source, the header and the flags (kept beside the library
    as ``libnvidia-ml.so.1.sha256``) and replaced atomically, so concurrent callers are safe.
    """
    header = nvml_header()
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), header.read_bytes(), " ".join(CFLAGS).encode()):
        digest.update(part)
    key = digest.hexdigest()
    out_dir.mkdir(parents=True, exist_ok=True)
    library, stamp = out_dir / LIBRARY_NAME, out_dir / f"{LIBRARY_NAME}.sha256"
    if library.exists() and stamp.exists() and stamp.read_text().strip() == key:
        return library
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise SimBuildError("no C compiler: install gcc to build the NVML simulator")
    fd, tmp_name = tempfile.mkstemp(prefix=".nvml-sim-", suffix=".so", dir=out_dir)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        result = subprocess.run([compiler, *CFLAGS, f"-I{header.parent}", "-o", str(tmp), str(SOURCE)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise SimBuildError(f"{compiler} failed to build the NVML simulator:\n{result.stderr}")
        os.replace(tmp, library)
    finally:
        tmp.unlink(missing_ok=True)
    stamp.write_text(key + "\n")
    return library


def sim_environ(library: Path, profile: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """An environment in which processes load the simulator and answer from ``profile``."""
    env = dict(os.environ if base is None else base)
    search = [str(library.parent)] + [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p]
    env["LD_LIBRARY_PATH"] = ":".join(search)
    env[PROFILE_ENV] = str(profile)
    return env
