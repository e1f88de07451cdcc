"""The lab's package mirror: a signed apt repository, a wheelhouse and the lab's keyring, served over HTTP.

Lab nodes reach no registry; they install everything from here through the same code paths an air-gapped fleet
uses (repository URL, keyring, pip find-links are configuration). Layout of the cache dir
(``$GPUFLEET_LAB_CACHE``, default ``/var/cache/gpufleet-lab``)::

    gnupg/                    the lab's signing key (private: never served, never committed)
    mirror/ADDR_PORT.json     a running server's PID, address and port; ADDR_PORT.log its log
    models/tiny-llama/        the tiny model (pushed to nodes by the deployment, not served)
    adapters/<name>/          its LoRA adapters, and adapters/sha256sums.txt (pushed by the deployment)
    www/                      the only directory served:
      apt/                    flat repository: Packages, Release, InRelease, Release.gpg, pool/*.deb
      debian/                 flat repository of Debian's packages the nodes need (prometheus-node-exporter, haproxy,
                              keepalived, prometheus, prometheus-alertmanager)
      node_exporter/v<ver>/   node_exporter-<ver>.linux-<arch>.tar.gz and sha256sums.txt: a lab repackaging of
                              Debian's node_exporter binary in the upstream release layout (gpufleet_lab.debian_extras)
      wheels/                 wheels, index.html (flat find-links page), requirements-<vllm version>.lock each
      keys/gpufleet-lab.gpg   the binary keyring for ``signed-by=``

A node's apt source is ``deb [signed-by=/usr/share/keyrings/gpufleet-lab.gpg] http://HOST:PORT/apt/ /``, the same
shape as NVIDIA's flat CUDA repository.
"""

from __future__ import annotations

import contextlib
import gzip
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gpufleet_lab import rootfs, state
from gpufleet_lab.debian_extras import (
    NODE_EXPORTER_DIR,
    NODE_EXPORTER_PACKAGE,
    Tarball,
    build_node_exporter_tarball,
    built_tarball,
    fetch_debs,
)
from gpufleet_lab.errors import LabError
from gpufleet_lab.standin_debs import build_debs
from gpufleet_lab.tiny_adapters import LAB_ADAPTERS, LATER_ADAPTER, declared, make_lab_adapters
from gpufleet_lab.tiny_model import make_tiny_model
from gpufleet_lab.wheelhouse import build_wheelhouse, lock_name

WWW = "www"
ADAPTERS_DIR = "adapters"  # the tiny model's LoRA adapters (gpufleet_lab.tiny_adapters), pushed by the deployment
KEYRING_NAME = "gpufleet-lab.gpg"
KEY_UID = "gpufleet lab package mirror <lab-mirror@gpufleet.invalid>"
RELEASE_FIELDS = {
    "Origin": "gpufleet-lab",
    "Label": "gpufleet lab doubles of NVIDIA packages",
    "Suite": "lab",
    "Codename": "lab",
    "Architectures": "amd64 all",
    "Description": "gpufleet lab: lab doubles of NVIDIA's CUDA repository packages",
}
DEBIAN_RELEASE_FIELDS = {
    **RELEASE_FIELDS,
    "Label": "gpufleet lab copy of Debian packages",
    "Description": "gpufleet lab: Debian's own packages (unchanged) that lab nodes install",
}


def default_cache_dir() -> Path:
    """``$GPUFLEET_LAB_CACHE`` or ``/var/cache/gpufleet-lab``."""
    return state.cache_dir()


@dataclass(frozen=True)
class MirrorUrls:
    """Where a node finds each part of the mirror, given the mirror's base URL (``http://HOST:PORT/``)."""

    base: str

    @property
    def apt(self) -> str:
        return self.base + "apt/"

    @property
    def debian(self) -> str:
        return self.base + "debian/"

    @property
    def wheels(self) -> str:
        return self.base + "wheels/"

    def wheel_lock(self, version: str) -> str:
        """vLLM ``version``'s lock; ``"{version}"`` gives the template ``vllm_requirements_url`` fills."""
        return self.wheels + lock_name(version)

    @property
    def keyring(self) -> str:
        return self.base + f"keys/{KEYRING_NAME}"

    def apt_source(self, keyring_path: str = f"/usr/share/keyrings/{KEYRING_NAME}") -> str:
        """The one-line apt source of the repository, trusting only the given keyring."""
        return f"deb [signed-by={keyring_path}] {self.apt} /"

    def debian_source(self, keyring_path: str = f"/usr/share/keyrings/{KEYRING_NAME}") -> str:
        """The one-line apt source of the repository of Debian's packages, trusting only the given keyring."""
        return f"deb [signed-by={keyring_path}] {self.debian} /"

    @classmethod
    def at(cls, address: str, port: int) -> MirrorUrls:
        host = f"[{address}]" if ":" in address else address
        return cls(f"http://{host}:{port}/")


@dataclass(frozen=True)
class AptRepo:
    """A signed flat apt repository."""

    path: Path
    keyring: Path
    packages: dict[str, str]  # name -> version


@dataclass(frozen=True)
class MirrorContents:
    """Everything :func:`prepare` built, by path on the controller."""

    cache_dir: Path
    www: Path
    apt: AptRepo
    wheelhouse: Path | None
    wheel_locks: dict[str, Path]  # vLLM version -> its lock (none without the wheelhouse)
    model: Path
    debian: AptRepo | None = None
    node_exporter: Tarball | None = None

    @property
    def keyring(self) -> Path:
        return self.apt.keyring


def prepare(
    cache_dir: Path | str | None = None,
    *,
    wheels: bool = True,
    debian: bool = True,
    find_links: Sequence[str] = (),
    extra_index_urls: Sequence[str] = (),
) -> MirrorContents:
    """Build, or reuse what is already built: the lab doubles, the signed repositories, the wheelhouse, the model,
    and node_exporter's release tarball repackaged from Debian's binary.

    The wheelhouse (every release of ``LAB_VLLM_VERSIONS``, a lock each: about 1 GB of downloads) is fetched once
    and topped up when a release is added; ``wheels=False`` skips it. ``find_links`` and ``extra_index_urls`` say
    where pip finds ``torch==2.13.0+cpu`` (see :mod:`gpufleet_lab.wheelhouse`). Debian's packages (about 4 MB)
    are downloaded with this machine's apt once and kept; ``debian=False`` skips them.
    """
    cache = _cache(cache_dir)
    www = cache / WWW
    repo = build_apt_repo(www / "apt", gnupg_home=cache / "gnupg")
    debian_repo, tarball = _build_debian(cache) if debian else (None, None)
    house = (build_wheelhouse(www / "wheels", find_links=find_links, extra_index_urls=extra_index_urls)
             if wheels else None)
    model = make_tiny_model(cache / "models" / "tiny-llama")
    make_lab_adapters(cache / ADAPTERS_DIR)
    return MirrorContents(cache, www, repo, house.path if house else None, house.locks if house else {}, model,
                          debian_repo, tarball)


def _build_debian(cache: Path) -> tuple[AptRepo, Tarball]:
    """Debian's packages the nodes need (and the dependencies the lab's base rootfs lacks) in ``www/debian/``;
    node_exporter's release tarball rebuilt from Debian's package in ``www/node_exporter/``."""
    base = next((p for p in (rootfs.base_path(cache), rootfs.base_path(default_cache_dir())) if p.is_dir()), None)
    debs = fetch_debs(cache / "debian-debs", base)
    repo = build_apt_repo(cache / WWW / "debian", debs=debs, gnupg_home=cache / "gnupg",
                          release_fields=DEBIAN_RELEASE_FIELDS)
    exporter = next(d for d in debs if d.name.startswith(f"{NODE_EXPORTER_PACKAGE}_"))
    return repo, build_node_exporter_tarball(exporter, cache / WWW / NODE_EXPORTER_DIR)


def adapter_sources(more: str = "", cache_dir: Path | str | None = None) -> dict[str, object]:
    """The lab's ``vllm_lora_adapters``, for its inventory: the adapters the mirror made for the tiny model, each
    pushed from its directory here and pinned by its weights' digest (none before :func:`prepare` made them).
    ``more``, comma-separated: the name of one it made besides that is declared too (LATER_ADAPTER's), or
    ``NAME=MADE``: adapter NAME declared with the files made for MADE (a new revision of NAME)."""
    items = [item for item in more.split(",") if item]
    revised = dict(item.split("=", 1) for item in items if "=" in item)
    made = declared(_cache(cache_dir) / ADAPTERS_DIR, (*LAB_ADAPTERS, LATER_ADAPTER))
    found = {a.name: made[a.name] for a in (*LAB_ADAPTERS, LATER_ADAPTER)
             if a.name in made and (a in LAB_ADAPTERS or a.name in items)}
    found |= {name: made[files] for name, files in revised.items() if name in found and files in made}
    return {"vllm_lora_adapters": found} if found else {}


def node_exporter_sources(base_url: str, cache_dir: Path | str | None = None) -> dict[str, str]:
    """Role node_exporter's variables that point a lab node at this mirror, for the lab's inventory.

    The tarball's URL (``{version}`` left for the role to fill in) and the sha256 read from the built
    ``sha256sums.txt`` (both absent until :func:`prepare` built the tarball); the Debian repository's apt source and
    the keyring it is signed with (a path on this machine, which the role copies to the nodes).
    """
    cache = _cache(cache_dir)
    urls = MirrorUrls(base_url)
    found: dict[str, str] = {
        "node_exporter_apt_source": urls.debian_source(),
        "node_exporter_apt_keyring": str(keyring_file(cache)),
    }
    tarball = built_tarball(cache / WWW / NODE_EXPORTER_DIR)
    if tarball is not None:
        found["node_exporter_tarball_url"] = urls.base + tarball.relative_url.replace(tarball.version, "{version}")
        found["node_exporter_tarball_sha256"] = tarball.sha256
    return found


def bench_client_find_links(cache_dir: Path | str | None = None) -> str:
    """``gpufleet bench-client --find-links`` on this machine: the wheelhouse, where pip finds torch's CPU build
    (guidellm needs torch, the package index has only its CUDA builds; the client's lock pins the wheelhouse's
    ``EXTRA_REQUIREMENTS`` torch by its sha256)."""
    return str(_cache(cache_dir) / WWW / "wheels")


def keyring_file(cache_dir: Path | str | None = None) -> Path:
    """The mirror's published keyring (``keys/gpufleet-lab.gpg``), which signs its repositories."""
    return _cache(cache_dir) / WWW / "keys" / KEYRING_NAME


def keyring_fingerprint(cache_dir: Path | str | None = None) -> str | None:
    """The fingerprint of the key in the mirror's published keyring (``keys/gpufleet-lab.gpg``), as
    ``nvidia_repo_key_fingerprint`` names it; None until :func:`prepare` exported it. Read with a throwaway
    gpg home: nothing is generated or imported."""
    keyring = keyring_file(cache_dir)
    if not keyring.is_file():
        return None
    with tempfile.TemporaryDirectory() as home:
        listing = _run(["gpg", "--homedir", home, "--batch", "--with-colons", "--show-keys", str(keyring)])
    lines = listing.splitlines()
    found = [line.split(":")[9] for prev, line in itertools.pairwise(lines) if prev.startswith("pub:")
             and line.startswith("fpr:")]
    return found[0] if len(found) == 1 else None


def build_apt_repo(
    out_dir: Path | str,
    *,
    debs: Sequence[Path] | None = None,
    gnupg_home: Path | str | None = None,
    keyring: Path | str | None = None,
    release_fields: dict[str, str] | None = None,
) -> AptRepo:
    """Write a signed flat apt repository of ``debs`` (default: the lab doubles) into ``out_dir``.

    Packages are copied or built into ``out_dir/pool``; the index is signed (InRelease and Release.gpg) with the
    lab's key in ``gnupg_home`` (default ``<cache>/gnupg``, generated on first use) and the public keyring is
    exported to ``keyring`` (default ``out_dir/../keys/gpufleet-lab.gpg``). An unchanged index that verifies with
    that keyring is not signed again. ``release_fields`` replace the Release file's fields (default: the lab
    doubles' ones).
    """
    out = Path(out_dir)
    pool = out / "pool"
    home = Path(gnupg_home) if gnupg_home is not None else default_cache_dir() / "gnupg"
    keyring_path = Path(keyring) if keyring is not None else out.parent / "keys" / KEYRING_NAME
    if debs is None:
        debs = build_debs(pool)
    else:
        pool.mkdir(parents=True, exist_ok=True)
        for deb in debs:
            if deb.parent != pool:
                _write_if_changed(pool / deb.name, deb.read_bytes())
    for stale in set(pool.glob("*.deb")) - {pool / deb.name for deb in debs}:
        stale.unlink()
    packages = _run(["apt-ftparchive", "packages", "pool"], cwd=out)
    changed = _write_if_changed(out / "Packages", packages.encode())
    try:
        fingerprint = signing_key(home)
        export_keyring(home, keyring_path, fingerprint)
        if changed or not _verifies(out / "InRelease", keyring_path):
            _sign_index(out, home, fingerprint, release_fields or RELEASE_FIELDS)
    finally:
        _stop_agent(home)
    return AptRepo(out, keyring_path, _package_versions(packages))


def _verifies(signed: Path, keyring: Path) -> bool:
    """True when ``signed`` exists and its signature verifies with ``keyring`` (what apt will check)."""
    if not signed.exists():
        return False
    return subprocess.run(["gpgv", "--keyring", str(keyring), str(signed)], capture_output=True).returncode == 0


def _sign_index(out: Path, home: Path, fingerprint: str, fields: dict[str, str]) -> None:
    _write_if_changed(out / "Packages.gz", gzip.compress((out / "Packages").read_bytes(), 9, mtime=0))
    options = [a for k, v in fields.items() for a in ("-o", f"APT::FTPArchive::Release::{k}={v}")]
    release = _run(["apt-ftparchive", *options, "release", "."], cwd=out)
    _write_if_changed(out / "Release", release.encode())
    gpg = [*_gpg(home), "--yes", "--local-user", fingerprint, "--digest-algo", "SHA512"]
    _run([*gpg, "--clearsign", "--output", "InRelease.new", "Release"], cwd=out)
    _run([*gpg, "--armor", "--detach-sign", "--output", "Release.gpg.new", "Release"], cwd=out)
    os.replace(out / "InRelease.new", out / "InRelease")
    os.replace(out / "Release.gpg.new", out / "Release.gpg")


def signing_key(gnupg_home: Path) -> str:
    """The fingerprint of the lab's signing key, generated (ed25519, no passphrase) on first use."""
    gnupg_home.mkdir(parents=True, exist_ok=True, mode=0o700)
    gnupg_home.chmod(0o700)
    found = _fingerprints(gnupg_home)
    if not found:
        _run([*_gpg(gnupg_home), "--passphrase", "", "--quick-generate-key", KEY_UID, "ed25519", "sign", "never"])
        found = _fingerprints(gnupg_home)
    if len(found) != 1:
        raise LabError(
            f"expected one secret key in {gnupg_home}, found {len(found)}: remove the directory to start over"
        )
    return found[0]


def export_keyring(gnupg_home: Path, dest: Path, fingerprint: str | None = None) -> Path:
    """Export the lab's public key as a binary keyring (for apt's ``signed-by=``) to ``dest``."""
    fingerprint = fingerprint or signing_key(gnupg_home)
    key = subprocess.run([*_gpg(gnupg_home), "--export", fingerprint], capture_output=True, check=True)
    if not key.stdout:
        raise LabError(f"gpg exported an empty keyring from {gnupg_home}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    _write_if_changed(dest, key.stdout)
    return dest


@dataclass(frozen=True)
class MirrorHandle:
    """A running mirror server."""

    bind_address: str
    port: int
    pid: int
    cache_dir: Path

    @property
    def urls(self) -> MirrorUrls:
        return MirrorUrls.at(self.bind_address, self.port)

    @property
    def url(self) -> str:
        return self.urls.base

    def stop(self) -> None:
        stop(self.cache_dir, bind_address=self.bind_address, port=self.port)


def start(bind_address: str, port: int = 8080, *, cache_dir: Path | str | None = None) -> MirrorHandle:
    """Serve ``<cache>/www`` over HTTP on ``bind_address:port`` only, in a background process (its own session).

    ``bind_address`` is the lab bridge's host-side address, or 127.0.0.1; a wildcard address is refused. A mirror
    of this cache dir already serving that address and port is reused; mirrors on other addresses are left alone.
    """
    cache = _cache(cache_dir)
    if bind_address in ("", "0.0.0.0", "::"):
        raise LabError("the lab mirror binds one address (the lab bridge or 127.0.0.1), not every interface")
    for handle in running(cache):
        if (handle.bind_address, handle.port) == (bind_address, port):
            return handle
    (cache / WWW).mkdir(parents=True, exist_ok=True)
    record = _state_file(cache, bind_address, port)
    record.parent.mkdir(parents=True, exist_ok=True)
    log_path = record.with_suffix(".log")
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", bind_address, "--directory", str(cache / WWW)]
    with log_path.open("ab") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    handle = MirrorHandle(bind_address, port, proc.pid, cache)
    record.write_text(json.dumps({"pid": proc.pid, "bind_address": bind_address, "port": port}) + "\n")
    deadline = time.monotonic() + 10
    while True:
        if proc.poll() is not None:
            record.unlink(missing_ok=True)
            tail = log_path.read_text(errors="replace").strip().splitlines()[-1:]
            raise LabError(f"the lab mirror could not serve on {bind_address}:{port}: {' '.join(tail)}")
        try:
            socket.create_connection((bind_address, port), timeout=1).close()
            return handle
        except OSError:
            if time.monotonic() > deadline:
                handle.stop()
                raise LabError(f"the lab mirror did not start listening on {bind_address}:{port} within 10 s") from None
            time.sleep(0.05)


def running(cache_dir: Path | str | None = None) -> list[MirrorHandle]:
    """The mirrors of this cache dir that are running (stale state files are removed)."""
    cache = _cache(cache_dir)
    handles = []
    for record in sorted((cache / "mirror").glob("*.json")):
        try:
            raw = json.loads(record.read_text())
            handle = MirrorHandle(raw["bind_address"], raw["port"], raw["pid"], cache)
        except (OSError, ValueError, KeyError):
            continue
        if _is_our_server(handle):
            handles.append(handle)
        else:
            record.unlink(missing_ok=True)
    return handles


def stop(cache_dir: Path | str | None = None, *, bind_address: str | None = None, port: int | None = None) -> None:
    """Stop this cache dir's mirrors (only the one on ``bind_address``/``port`` when given) that we started."""
    for handle in running(cache_dir):
        if bind_address not in (None, handle.bind_address) or port not in (None, handle.port):
            continue
        os.kill(handle.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while not _exited(handle) and time.monotonic() < deadline:
            _reap(handle.pid)
            time.sleep(0.05)
        if _is_our_server(handle):
            os.kill(handle.pid, signal.SIGKILL)
        while not _exited(handle) and time.monotonic() < deadline + 5:
            _reap(handle.pid)
            time.sleep(0.05)
        _state_file(handle.cache_dir, handle.bind_address, handle.port).unlink(missing_ok=True)


def _cache(cache_dir: Path | str | None) -> Path:
    return (Path(cache_dir) if cache_dir is not None else default_cache_dir()).absolute()


def _state_file(cache: Path, bind_address: str, port: int) -> Path:
    return cache / "mirror" / f"{bind_address}_{port}.json"


def _process(pid: int) -> tuple[list[str], str] | None:
    """A PID's argv and state letter (``R``, ``S``, ``Z``…); None once it is gone."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return [a for a in raw.decode(errors="replace").split("\0") if a], stat.rsplit(")", 1)[1].split()[0]


def _serves(handle: MirrorHandle, argv: list[str]) -> bool:
    return "http.server" in argv and str(handle.cache_dir / WWW) in argv


def _is_our_server(handle: MirrorHandle) -> bool:
    """True while the PID still runs our http.server for this cache dir (PIDs are reused)."""
    found = _process(handle.pid)
    return found is not None and found[1] != "Z" and _serves(handle, found[0])


def _exited(handle: MirrorHandle) -> bool:
    """True once the server's PID is gone, a zombie, or another program's; an exiting process, whose
    command line already reads empty, is not gone yet."""
    found = _process(handle.pid)
    return found is None or found[1] == "Z" or (bool(found[0]) and not _serves(handle, found[0]))


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def _gpg(home: Path) -> list[str]:
    return ["gpg", "--homedir", str(home), "--batch", "--quiet", "--pinentry-mode", "loopback"]


def _stop_agent(home: Path) -> None:
    subprocess.run(["gpgconf", "--homedir", str(home), "--kill", "gpg-agent"], capture_output=True)


def _fingerprints(home: Path) -> list[str]:
    listing = _run([*_gpg(home), "--with-colons", "--list-secret-keys"])
    lines = listing.splitlines()
    return [line.split(":")[9] for prev, line in itertools.pairwise(lines)
            if prev.startswith("sec:") and line.startswith("fpr:")]


def _package_versions(packages_index: str) -> dict[str, str]:
    versions, name = {}, ""
    for line in packages_index.splitlines():
        if line.startswith("Package: "):
            name = line.split(": ", 1)[1]
        elif line.startswith("Version: "):
            versions[name] = line.split(": ", 1)[1]
    return versions


def _write_if_changed(path: Path, data: bytes) -> bool:
    """Write ``data`` atomically unless ``path`` already holds it; True when the file changed."""
    if path.exists() and path.read_bytes() == data:
        return False
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False) as tmp:
        tmp.write(data)
    os.chmod(tmp.name, 0o644)
    os.replace(tmp.name, path)
    return True


def _run(argv: list[str], cwd: Path | None = None) -> str:
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise LabError(f"{argv[0]} failed ({' '.join(argv[1:4])} ...): {proc.stderr.strip()[-500:]}")
    return proc.stdout
