"""Debian's own packages for the lab, and node_exporter's release tarball rebuilt from one of them.

Lab nodes reach no Debian mirror, so what a role installs from Debian must come from the lab's mirror:

- :func:`fetch_debs` downloads Debian's real packages (``apt-get download`` on this machine, from the apt
  sources it is configured with) together with every runtime dependency the lab's base rootfs lacks; the lab's
  mirror publishes them as a signed flat repository (``www/debian/``, see :mod:`gpufleet_lab.mirror`).
- :func:`build_node_exporter_tarball` repackages the binary of Debian's ``prometheus-node-exporter`` in the
  layout of node_exporter's upstream release tarball (``node_exporter-<version>.linux-<arch>/node_exporter``,
  beside the package's ``NOTICE`` and ``copyright``), with a ``sha256sums.txt`` as upstream publishes, under
  ``www/node_exporter/v<version>/``. This is a lab repackaging, not the upstream release: the binary is
  Debian's build, the version is Debian's upstream version (bookworm: 1.5.0), the digest is not upstream's,
  and the tarball carries a ``LAB-REPACKAGED`` note saying so. It exists so the lab exercises the tarball
  install path (fetch on the controller, check the sha256, push, unpack) that air-gapped sites use.

Builds are reproducible: the same .deb gives a byte-identical tarball, so its sha256 is stable across builds.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import re
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from gpufleet.digest import file_sha256
from gpufleet_lab.errors import LabError
from gpufleet_lab.state import cache_dir

NODE_EXPORTER_PACKAGE = "prometheus-node-exporter"
ROUTER_PACKAGE = "haproxy"  # the router role's HAProxy
VIRTUAL_ADDRESS_PACKAGE = "keepalived"  # the keepalived role's, which moves the routers' virtual address
MONITORING_PACKAGES = ("prometheus", "prometheus-alertmanager")  # the monitoring role's Prometheus and Alertmanager
DEBIAN_PACKAGES: tuple[str, ...] = (NODE_EXPORTER_PACKAGE, ROUTER_PACKAGE, VIRTUAL_ADDRESS_PACKAGE,
                                    *MONITORING_PACKAGES)
NODE_EXPORTER_DIR = "node_exporter"  # below www/
SUMS_NAME = "sha256sums.txt"
STAMP_NAME = ".built-from"  # the .deb's sha256 and BUILD_LAYOUT: a tarball built from them is not built again
BUILD_LAYOUT = 1  # bump when the tarball's content changes for the same .deb
EPOCH = 1700000000  # mtime of every member of the rebuilt tarball (reproducible builds)
_DOCS = ("NOTICE", "LICENSE", "copyright")  # taken from the package's /usr/share/doc/<package>/ when present
_APT_QUIET = ["-o", "APT::Sandbox::User=root", "-q"]


@dataclass(frozen=True)
class Tarball:
    """A node_exporter release tarball on this machine and what an inventory needs to fetch it."""

    path: Path
    version: str  # upstream version, e.g. 1.5.0
    sha256: str

    @property
    def relative_url(self) -> str:
        """Its URL below the mirror's base URL."""
        return f"{NODE_EXPORTER_DIR}/v{self.version}/{self.path.name}"


# --- Debian packages --------------------------------------------------------------------------------------------

def installed_packages(root: Path) -> dict[str, str] | None:
    """Packages installed in a Debian rootfs, and the virtual names they provide: name -> version.

    Read from ``<root>/var/lib/dpkg/status``; None when ``root`` holds no dpkg database.
    """
    status = root / "var/lib/dpkg/status"
    if not status.is_file():
        return None
    found: dict[str, str] = {}
    for paragraph in status.read_text(errors="replace").split("\n\n"):
        fields = _fields(paragraph)
        if not fields.get("Status", "").endswith(" installed"):
            continue
        version = fields.get("Version", "")
        found[fields["Package"]] = version
        for provided in _names(fields.get("Provides", "")):
            found.setdefault(provided, "")  # a virtual name satisfies unversioned dependencies only
    return found


def dependency_groups(fields: dict[str, str]) -> list[list[tuple[str, str]]]:
    """A package's Pre-Depends and Depends: one list of alternatives ``(name, version constraint)`` per group."""
    groups = []
    for key in ("Pre-Depends", "Depends"):
        for group in filter(None, (g.strip() for g in fields.get(key, "").split(","))):
            alternatives = []
            for alternative in group.split("|"):
                match = re.match(r"^\s*([a-z0-9][a-z0-9+.-]*)(?::\S+)?\s*(?:\((.+?)\))?", alternative)
                if match:
                    alternatives.append((match[1], (match[2] or "").strip()))
            groups.append(alternatives)
    return groups


def missing_dependencies(
    package: str, installed: dict[str, str], records: dict[str, dict[str, str]] | None = None
) -> list[str]:
    """Packages (``package`` included) that installing ``package`` on a rootfs holding ``installed`` would add.

    Each dependency group is satisfied by an installed alternative whose version fits; otherwise its first
    alternative that this machine's apt knows is added, and its own dependencies are followed. ``records`` (apt's
    candidate records by name) is filled as apt is asked: one ``apt-cache`` call per level of dependencies.
    """
    records = {} if records is None else records
    wanted: list[str] = []
    level = [package]
    while level:
        _apt_records(level, records)
        unmet: list[tuple[str, list[tuple[str, str]]]] = []
        for name in level:
            if name not in records:
                raise LabError(f"apt on this machine knows no package {name}")
            wanted.append(name)
            unmet += [(name, group) for group in dependency_groups(records[name])
                      if not any(_satisfied(alt, constraint, installed) for alt, constraint in group)]
        _apt_records([alt for _, group in unmet for alt, _ in group], records)
        level = []
        for name, group in unmet:
            if any(alt in wanted or alt in level for alt, _ in group):
                continue
            chosen = next((alt for alt, _ in group if alt in records), None)
            if chosen is None:
                raise LabError(f"{name} needs one of {', '.join(a for a, _ in group)}:"
                               " none is in this machine's apt sources")
            level.append(chosen)
    return wanted


def fetch_debs(dest: Path, base_root: Path | None, packages: tuple[str, ...] = DEBIAN_PACKAGES) -> list[Path]:
    """Download Debian's ``packages`` and the dependencies ``base_root`` lacks into ``dest``; the .deb files.

    Uses this machine's apt sources (``apt-get update`` runs once when apt does not know a package yet). A .deb
    already in ``dest`` with the candidate's sha256 is reused without a download; when apt knows none of them
    (no package lists) and ``dest`` already holds a .deb of each package, those are used as they are. Without
    a base rootfs to compare with, only ``packages`` themselves are fetched.
    """
    dest.mkdir(parents=True, exist_ok=True)
    records: dict[str, dict[str, str]] = {}
    if len(_apt_records(packages, records)) < len(packages):
        kept = sorted(dest.glob("*.deb"))
        if kept and all(any(deb.name.startswith(f"{p}_") for deb in kept) for p in packages):
            return kept
        _run(["apt-get", *_APT_QUIET, "update"])
        records.clear()
    installed = installed_packages(base_root) if base_root is not None else None
    names: list[str] = []
    for package in packages:
        for name in missing_dependencies(package, installed, records) if installed is not None else [package]:
            if name not in names:
                names.append(name)
    _apt_records(names, records)
    missing = [name for name in names if name not in records]
    if missing:
        raise LabError(f"apt on this machine knows no package {', '.join(missing)}")
    debs = _download([records[name] for name in names], dest)
    for stale in set(dest.glob("*.deb")) - set(debs):
        stale.unlink()
    return debs


def _download(wanted: list[dict[str, str]], dest: Path) -> list[Path]:
    """Each of apt's records in ``wanted`` as a .deb in ``dest``, in that order: one already there with the record's
    sha256 is kept; the others come in one ``apt-get download`` (one apt start, its downloads pipelined: a call per
    package took 2.4 s each here), each checked against the index's sha256 before it goes into place."""
    targets = [dest / Path(fields["Filename"]).name for fields in wanted]
    fetch = [(fields, target) for fields, target in zip(wanted, targets, strict=True)
             if not (target.is_file() and file_sha256(target) == fields.get("SHA256"))]
    if fetch:
        with tempfile.TemporaryDirectory(dir=dest, prefix=".download.") as tmp:
            _run(["apt-get", *_APT_QUIET, "download", *(f"{f['Package']}={f['Version']}" for f, _ in fetch)],
                 cwd=Path(tmp))
            got = {_deb_field(deb, "Package"): deb for deb in Path(tmp).glob("*.deb")}
            for fields, target in fetch:
                deb = got.get(fields["Package"])
                if deb is None:
                    raise LabError(f"apt-get download gave no .deb of {fields['Package']}")
                digest = file_sha256(deb)
                if fields.get("SHA256") and digest != fields["SHA256"]:
                    raise LabError(f"{deb.name}: expected sha256 {fields['SHA256']} from apt's index, found {digest}")
                os.replace(deb, target)
                target.chmod(0o644)
    return targets


def _satisfied(name: str, constraint: str, installed: dict[str, str]) -> bool:
    if name not in installed:
        return False
    if not constraint:
        return True
    version = installed[name]
    if not version:
        return False
    match = re.fullmatch(r"(<<|<=|>=|>>|=|<|>)\s*(\S+)", constraint)
    if match is None:
        return False
    relation = {"<<": "lt", "<=": "le", "=": "eq", ">=": "ge", ">>": "gt", "<": "le", ">": "ge"}[match[1]]
    return subprocess.run(["dpkg", "--compare-versions", version, relation, match[2]]).returncode == 0


def _apt_records(names: list[str] | tuple[str, ...], records: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """Add apt's candidate records of ``names`` not yet in ``records`` (one ``apt-cache show`` call); ``records``.

    A name apt does not know (or only as a virtual package) stays absent.
    """
    ask = [name for name in dict.fromkeys(names) if name not in records]
    if ask:
        proc = subprocess.run(["apt-cache", *_apt_cache_kept(), "show", "--no-all-versions", *ask], capture_output=True,
                              text=True)
        for paragraph in proc.stdout.split("\n\n"):
            fields = _fields(paragraph)
            if fields.get("Package") in ask and "Filename" in fields:
                records.setdefault(fields["Package"], fields)
    return records


def _apt_cache_kept() -> list[str]:
    """apt-cache's options that keep its binary package cache in the lab's cache: hosts (container images among
    them) that configure none make apt build it again on every call, 4 times slower (0.58 s against 0.15 s here).
    apt builds it again by itself when the package lists change."""
    kept = cache_dir() / "apt-pkgcache"
    try:
        kept.mkdir(parents=True, exist_ok=True)
    except OSError:  # a cache this user cannot write: apt's own settings
        return []
    return [option for name in ("pkgcache", "srcpkgcache")
            for option in ("-o", f"Dir::Cache::{name}={kept / (name + '.bin')}")]


def _fields(paragraph: str) -> dict[str, str]:
    """An RFC 822 style control paragraph; continuation lines are kept, joined by newlines."""
    fields: dict[str, str] = {}
    key = ""
    for line in paragraph.splitlines():
        if line.startswith((" ", "\t")) and key:
            fields[key] += "\n" + line.strip()
        elif ":" in line:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


def _names(relation: str) -> list[str]:
    return [m[1] for m in re.finditer(r"(?:^|[,|])\s*([a-z0-9][a-z0-9+.-]*)", relation)]


# --- the node_exporter tarball ----------------------------------------------------------------------------------

def upstream_version(debian_version: str) -> str:
    """``1.5.0`` from ``1.5.0-1+b6`` (no epoch, no Debian revision)."""
    return debian_version.split(":", 1)[-1].rsplit("-", 1)[0]


def build_node_exporter_tarball(deb: Path, out_dir: Path) -> Tarball:
    """Repackage the binary of Debian's prometheus-node-exporter ``deb`` as an upstream-layout release tarball.

    Writes ``out_dir/v<version>/node_exporter-<version>.linux-<arch>.tar.gz`` and its ``sha256sums.txt`` (older
    versions are removed). A tarball already built from the same .deb is kept as it is.
    """
    control = {k: _deb_field(deb, k) for k in ("Package", "Version", "Architecture")}
    if control["Package"] != NODE_EXPORTER_PACKAGE:
        raise LabError(f"{deb.name}: expected the {NODE_EXPORTER_PACKAGE} package, found {control['Package']}")
    version = upstream_version(control["Version"])
    stem = f"node_exporter-{version}.linux-{control['Architecture']}"
    release = out_dir / f"v{version}"
    source = f"{file_sha256(deb)} {BUILD_LAYOUT}\n"
    built = built_tarball(out_dir)
    stamp = release / STAMP_NAME
    if built is not None and built.path.name == f"{stem}.tar.gz" and stamp.is_file() and stamp.read_text() == source:
        return built
    members = _package_members(deb)
    binary = members.get(f"usr/bin/{NODE_EXPORTER_PACKAGE}")
    if binary is None:
        raise LabError(f"{deb.name} has no /usr/bin/{NODE_EXPORTER_PACKAGE}")
    note = (
        f"LAB REPACKAGING (gpufleet lab), not a node_exporter release.\n\n"
        f"node_exporter below is the binary of Debian's {NODE_EXPORTER_PACKAGE} {control['Version']}"
        f" ({control['Architecture']}),\nrepackaged in the layout of node_exporter's upstream release tarball so that"
        f" the lab can\nexercise a tarball install. Its version is Debian's upstream version ({version}); its sha256\n"
        f"is not the one upstream publishes for {stem}.tar.gz.\n"
    ).encode()
    files = {"node_exporter": (binary, 0o755), "LAB-REPACKAGED": (note, 0o644)}
    for doc in _DOCS:
        content = members.get(f"usr/share/doc/{NODE_EXPORTER_PACKAGE}/{doc}")
        if content is not None:
            files[doc] = (content, 0o644)
    data = _tar_gz(stem, files)
    release.mkdir(parents=True, exist_ok=True)
    tarball = release / f"{stem}.tar.gz"
    digest = hashlib.sha256(data).hexdigest()
    _write_if_changed(tarball, data)
    _write_if_changed(release / SUMS_NAME, f"{digest}  {tarball.name}\n".encode())
    _write_if_changed(stamp, source.encode())
    for old in out_dir.glob("v*"):
        if old != release and old.is_dir():
            for entry in old.iterdir():
                entry.unlink()
            old.rmdir()
    return Tarball(tarball, version, digest)


def built_tarball(out_dir: Path) -> Tarball | None:
    """The tarball :func:`build_node_exporter_tarball` left in ``out_dir``, read back from its sha256sums.txt."""
    for sums in sorted(out_dir.glob(f"v*/{SUMS_NAME}")):
        digest, _, name = sums.read_text().strip().partition("  ")
        path = sums.parent / name
        if re.fullmatch(r"[0-9a-f]{64}", digest) and path.is_file():
            return Tarball(path, sums.parent.name[1:], digest)
    return None


def _tar_gz(stem: str, files: dict[str, tuple[bytes, int]]) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.GNU_FORMAT) as tar:
        tar.addfile(_member(f"{stem}/", tarfile.DIRTYPE, 0o755, 0))
        for name in sorted(files):
            content, mode = files[name]
            tar.addfile(_member(f"{stem}/{name}", tarfile.REGTYPE, mode, len(content)), io.BytesIO(content))
    return gzip.compress(raw.getvalue(), 9, mtime=0)


def _member(name: str, kind: bytes, mode: int, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.size, info.mtime = kind, mode, size, EPOCH
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def _package_members(deb: Path) -> dict[str, bytes]:
    """The regular files of a .deb's data archive: path without leading ``./`` -> content."""
    proc = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], capture_output=True)
    if proc.returncode != 0:
        raise LabError(f"dpkg-deb cannot read {deb}: {proc.stderr.decode(errors='replace').strip()}")
    found = {}
    with tarfile.open(fileobj=io.BytesIO(proc.stdout)) as tar:
        for member in tar:
            if member.isfile():
                handle = tar.extractfile(member)
                if handle is not None:
                    found[member.name.removeprefix("./")] = handle.read()
    return found


def _deb_field(deb: Path, name: str) -> str:
    return _run(["dpkg-deb", "-f", str(deb), name]).strip()


def _write_if_changed(path: Path, data: bytes) -> None:
    if path.exists() and path.read_bytes() == data:
        return
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False) as tmp:
        tmp.write(data)
    os.chmod(tmp.name, 0o644)
    os.replace(tmp.name, path)


def _run(argv: list[str], cwd: Path | None = None) -> str:
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise LabError(f"{argv[0]} failed ({' '.join(argv[1:5])} ...): {proc.stderr.strip()[-500:]}")
    return proc.stdout
