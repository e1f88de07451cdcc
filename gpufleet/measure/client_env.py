"""The bench client's virtual environment on the controller, installed only from a hash-pinned lock.

The lock, ``gpufleet/data/guidellm/requirements-<version>.lock`` (:func:`lock_path`), pins guidellm and every wheel
it needs (torch: its CPU build, the one the lab's wheelhouse holds), each ``name==version --hash=sha256:HEX``, as
the lab's vLLM locks do; its ``# target:`` line names the interpreter and platform its wheels are for
(``cp311-manylinux_2_36_x86_64``). ``scripts/gen_bench_client_lock.py`` (``make bench-client-lock``) writes it.

``gpufleet bench-client`` (``make bench-client``) installs it into ``~/.cache/gpufleet/guidellm-<version>`` with
``pip install --no-deps --require-hashes --only-binary=:all: -r LOCK``: from the package index (and any
``--find-links``), or offline from a wheelhouse alone (``--no-index --find-links DIR``). Nothing unpinned is
installed: a requirement without its hash is refused by pip in that mode. The environment's stamp (:data:`STAMP`),
written last, holds the lock's sha256; a client whose stamp is missing or holds another digest is refused by
``gpufleet bench`` (:func:`check`), which installs nothing itself.

A client already there (``--force``, or one from another lock) is kept aside (:func:`previous_path`) while its
replacement is built at the environment's own path (an environment cannot be moved once made), and is removed only
once the new one is stamped; a failed install puts it back as it was, stamp and all (:func:`recover` does so after
an install that was killed).
"""

from __future__ import annotations

import errno
import json
import os
import platform
import re
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpufleet.digest import file_sha256

LOCK_DIR = Path(__file__).resolve().parents[1] / "data" / "guidellm"
LOCK_TEMPLATE = "requirements-{version}.lock"
STAMP = ".installed"
"""The environment's stamp: JSON, the lock's file name and sha256 (written once the install is complete)."""

INSTALL_COMMAND = "gpufleet bench-client (make bench-client in a checkout)"
"""What a refusal names as the way to install the client."""

TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
"""PyTorch's index of its CPU builds (the lock's torch is one; PyPI has its CUDA builds only)."""

_PIN = re.compile(r"(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[^\s;#]+)(?P<options>(?:\s+--hash=\S+)*)")
_HASH = re.compile(r"--hash=sha256:(?P<hex>[0-9a-f]{64})")
_TARGET = re.compile(r"cp3(?P<minor>\d+)-manylinux_2_(?P<glibc>\d+)_(?P<arch>x86_64|aarch64)")


class LockError(ValueError):
    """The lock cannot be used (message: one line naming it)."""


@dataclass(frozen=True)
class Pin:
    """One distribution of the lock: its exact version and the sha256 of the files it may be installed from."""

    name: str  # canonical: lowercase, runs of ``-_.`` as one ``-``
    version: str
    hashes: tuple[str, ...]


@dataclass(frozen=True)
class Lock:
    """A parsed lock: its pins, in the lock's order, and the wheels' target (``cp311-manylinux_2_36_x86_64``)."""

    pins: tuple[Pin, ...]
    target: str

    def pin(self, name: str) -> Pin | None:
        return next((p for p in self.pins if p.name == canonical(name)), None)

    @property
    def python(self) -> str:
        """The target's Python version: ``3.11``."""
        return f"3.{_target(self.target)[0]}"


def canonical(name: str) -> str:
    """A distribution's name as pip compares it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_path(version: str) -> Path:
    """The lock of guidellm ``version`` gpufleet ships."""
    return LOCK_DIR / LOCK_TEMPLATE.replace("{version}", version)


def parse_lock(text: str, source: str) -> Lock:
    """The pins and target of a lock's text; :class:`LockError` names ``source`` and the first line that is not
    ``name==version --hash=sha256:HEX`` (more hashes allowed), a name pinned twice, or a missing ``# target:``."""
    pins: list[Pin] = []
    target = None
    for number, line in enumerate(re.sub(r"\\\r?\n", " ", text).splitlines(), start=1):
        stripped = line.strip()
        if stripped.startswith("#"):
            if found := re.fullmatch(r"#\s*target:\s*(\S+)", stripped):
                target = found[1]
            continue
        if not stripped:
            continue
        found = _PIN.fullmatch(stripped)
        hashes = tuple(h["hex"] for h in _HASH.finditer(found["options"])) if found else ()
        if found is None or not hashes or len(hashes) != found["options"].count("--hash="):
            raise LockError(f"{source}: line {number}: expected name==version --hash=sha256:<64 hex digits>,"
                            f" found {stripped[:160]!r}")
        name = canonical(found["name"])
        if any(p.name == name for p in pins):
            raise LockError(f"{source}: line {number}: {name} is pinned twice")
        pins.append(Pin(name, found["version"], hashes))
    if target is None:
        raise LockError(f"{source}: expected a '# target: cp3XX-manylinux_2_NN_ARCH' line, found none")
    if _TARGET.fullmatch(target) is None:
        raise LockError(f"{source}: target: expected cp3XX-manylinux_2_NN_ARCH, found {target!r}")
    if not pins:
        raise LockError(f"{source}: expected pinned wheels, found none")
    return Lock(tuple(pins), target)


def read_lock(path: Path) -> Lock:
    """The lock at ``path`` (:class:`LockError` when it cannot be read or parsed)."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise LockError(f"cannot read the bench client's lock {path}: {exc}") from None
    return parse_lock(text, path.name)


def _target(target: str) -> tuple[int, int, str]:
    found = _TARGET.fullmatch(target)
    if found is None:
        raise LockError(f"target: expected cp3XX-manylinux_2_NN_ARCH, found {target!r}")
    return int(found["minor"]), int(found["glibc"]), found["arch"]


def target_args(target: str) -> list[str]:
    """pip's options that pick the wheels of ``target`` on any machine: its Python, CPython's ABIs and every
    manylinux tag its glibc accepts (pip does not widen an explicit ``--platform`` to older glibc tags)."""
    minor, glibc, arch = _target(target)
    platforms = [f"manylinux_2_{m}_{arch}" for m in range(glibc, 4, -1)]
    legacy = [("manylinux2014", 17), *((("manylinux2010", 12), ("manylinux1", 5)) if arch == "x86_64" else ())]
    platforms += [f"{name}_{arch}" for name, least in legacy if glibc >= least]
    return ["--python-version", f"3.{minor}", "--implementation", "cp", "--abi", f"cp3{minor}", "--abi", "abi3",
            "--abi", "none", *(a for p in platforms for a in ("--platform", p))]


def interpreter_problem(target: str) -> str | None:
    """Why this interpreter cannot run the wheels of ``target`` (None: it can)."""
    minor, _, arch = _target(target)
    here = (f"{sys.implementation.name} {sys.version_info.major}.{sys.version_info.minor} on {sys.platform}"
            f" {platform.machine()}")
    if (sys.implementation.name, sys.version_info[:2], sys.platform, platform.machine()) != (
            "cpython", (3, minor), "linux", arch):
        return f"the lock's wheels are for CPython 3.{minor} on Linux {arch} ({target}), this is {here}"
    return None


def stamp_text(lock_file: Path) -> str:
    """What the stamp of an environment installed from ``lock_file`` holds."""
    return json.dumps({"lock": lock_file.name, "sha256": file_sha256(lock_file)}, sort_keys=True) + "\n"


def check(venv: Path, lock_file: Path, client: str) -> str | None:
    """Why the environment ``venv`` is not one installed from ``lock_file`` with ``bin/<client>`` in it (one line
    naming :data:`INSTALL_COMMAND`), or None when it is."""
    try:
        digest = file_sha256(lock_file)
    except OSError as exc:
        return f"cannot read the bench client's lock {lock_file}: {exc.strerror or exc}"
    stamp = venv / STAMP
    if not stamp.is_file() or not os.access(venv / "bin" / client, os.X_OK):
        return f"the bench client is not installed in {venv}: install it with {INSTALL_COMMAND}"
    try:
        recorded = json.loads(stamp.read_text()).get("sha256")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        recorded = None
    if recorded != digest:
        was = f"sha256 {str(recorded)[:12]}" if isinstance(recorded, str) and recorded else "no recorded lock"
        return (f"the bench client in {venv} was not installed from the current lock {lock_file.name}"
                f" (sha256 {digest[:12]}; installed: {was}): reinstall it with {INSTALL_COMMAND}")
    return None


class InstallError(RuntimeError):
    """pip, or the installed client, failed (message: one line)."""


def _sources(wheelhouse: str | None, find_links: Sequence[str]) -> list[str]:
    """Where pip looks: a wheelhouse alone (offline), or the index and any ``find_links``."""
    if wheelhouse is not None:
        return ["--no-index", "--find-links", wheelhouse]
    return [a for link in find_links for a in ("--find-links", link)]


def _run(argv: list[str], what: str, timeout: float) -> None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    except subprocess.TimeoutExpired:
        raise InstallError(f"{what}: no end within {timeout:g} s") from None
    if done.returncode != 0:
        raise InstallError(f"{what} failed (exit {done.returncode}): {output_problem(done.stdout + done.stderr)}")


def output_problem(output: str) -> str:
    """One line of what a failed pip (or client) printed: the wheels that do not match their hash in the lock when
    that is why, else its last ``ERROR:`` line, else its last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    if any("DO NOT MATCH THE HASHES" in line for line in lines):
        wheels = [f"{m[1]} ({m[2]})" for line in lines if (m := re.match(r"(\S+==\S+) from (\S+?)(?: \(|:$|$)", line))]
        if wheels:
            return f"not the wheel the lock pins (its sha256 differs): {', '.join(wheels)}"
    errors = [line for line in lines if line.startswith("ERROR:")]
    last = (errors or lines or ["no output"])[-1]
    if re.fullmatch(r"ERROR: No matching distribution found for torch==\S+\+cpu", last):
        return (f"{last} (torch's CPU build is not on PyPI: give --find-links DIR holding its wheel, or"
                f" PIP_EXTRA_INDEX_URL={TORCH_CPU_INDEX})")
    return last


def previous_path(venv: Path) -> Path:
    """Where an install keeps the client it replaces until the new one is stamped: ``.<name>.previous`` beside it."""
    return venv.with_name(f".{venv.name}.previous")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()


def recover(venv: Path) -> str | None:
    """Finish an install that was killed before it ended: the client it had kept aside (:func:`previous_path`) is put
    back in place of an environment without its stamp (the new one, cut short), or removed when the new one was
    stamped. What was put back (one line), or None."""
    aside = previous_path(venv)
    if not os.path.lexists(aside):
        return None
    if (venv / STAMP).is_file():
        _remove(aside)
        return None
    _remove(venv)
    os.replace(aside, venv)
    return f"put back the client {venv} an install that did not end had kept aside"


def install(venv: Path, lock_file: Path, client: str, *, wheelhouse: str | None = None,
            find_links: Sequence[str] = (), say: Callable[[str], None] = lambda line: None) -> None:
    """Make ``venv`` anew with this interpreter and install exactly ``lock_file`` into it (pip's hash-checking mode,
    no dependency resolution, wheels only), from ``wheelhouse`` alone or the index and ``find_links``; check that
    ``bin/<client> --help`` runs; write the stamp last. A client already at ``venv`` is kept aside meanwhile and
    removed only then. :class:`InstallError` when a step fails: ``venv`` is then as it was (the client kept aside
    back in place, with its stamp; nothing when there was none)."""
    say(f"installing {lock_file.name} into {venv}"
        + (f" from the wheelhouse {wheelhouse} (offline)" if wheelhouse else ""))
    venv.parent.mkdir(parents=True, exist_ok=True)
    if put_back := recover(venv):
        say(put_back)
    aside = previous_path(venv)
    kept = os.path.lexists(venv)
    if kept:
        os.replace(venv, aside)
    try:
        _run([sys.executable, "-m", "venv", str(venv)], f"python -m venv {venv}", 300)
        _run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-input", "--no-deps",
              "--require-hashes", "--only-binary=:all:", *_sources(wheelhouse, find_links), "-r", str(lock_file)],
             f"pip install -r {lock_file.name}", 3600)
        _run([str(venv / "bin" / client), "--help"], f"{client} --help", 300)
        partial = venv / f"{STAMP}.new"
        partial.write_text(stamp_text(lock_file))
        partial.replace(venv / STAMP)
    except BaseException as failed:
        try:
            _remove(venv)
            if kept:
                os.replace(aside, venv)
        except OSError as exc:
            raise InstallError(f"{failed}; the client it replaces is kept in {aside} ({exc.strerror or exc}): the"
                               f" next {INSTALL_COMMAND} puts it back") from None
        raise
    if kept:
        _remove(aside)


def _kind(path: str) -> str:
    """What ``path``, which is not a directory, is."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "a symlink loop"
        return "a symlink to nothing" if os.path.islink(path) else exc.strerror or str(exc)
    kinds = [(stat.S_ISREG, "a regular file"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")]
    return next((name for test, name in kinds if test(mode)), "not a directory")


def directory_problem(path: Path, shown: Path | None = None) -> str | None:
    """Why ``path`` cannot be a directory this user writes in, made with its parents when missing: a few words on
    what it is, or on which of its parents is what, when it is not ``shown`` (default: ``path``). None when it can."""
    existing = path
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not os.path.isdir(existing):
        what = _kind(str(existing))
    elif not os.access(existing, os.W_OK | os.X_OK):
        what = "a directory this user cannot write in"
    else:
        return None
    return what if existing == (shown or path) else f"{str(existing)!r} is {what}"


def download(lock_file: Path, lock: Lock, dest: Path, find_links: Sequence[str] = ()) -> list[Path]:
    """Download the wheels ``lock`` pins, checked against its hashes, into ``dest`` for a wheelhouse (the lock's
    target's wheels, whatever this machine is); the wheels ``dest`` then holds."""
    dest.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-input", "--no-deps", "--require-hashes",
          "--only-binary=:all:", *target_args(lock.target), *_sources(None, find_links), "--dest", str(dest),
          "-r", str(lock_file)], f"pip download -r {lock_file.name}", 3600)
    return sorted(dest.glob("*.whl"))
