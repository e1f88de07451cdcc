"""The lab's own certificate authority: a CA and a server certificate for the routers' addresses, made with the
``openssl`` command (no Python dependency), for TLS at the lab's edge (``router_tls_certificate``,
``router_tls_key``) and for clients that trust the CA.

Files in the folder given (0700): ``ca.crt`` (what clients trust), ``ca.key``, ``router.crt`` (the server
certificate, then the CA's, as HAProxy serves the chain) and ``router.key``; keys 0600. P-256 keys, SHA-256
signatures; the server certificate names every router address and name as a subject alternative name.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from gpufleet_lab.errors import LabError

DAYS = 825  # the longest validity clients accept for a server certificate
_DNS_NAME = re.compile(r"^(?=.{1,253}$)(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*$")


@dataclass(frozen=True)
class LabTls:
    """Where the lab CA's files are."""

    ca_certificate: Path
    ca_key: Path
    certificate: Path  # the server's, its CA's after it
    key: Path


def subject_alt_names(names: list[str]) -> str:
    """OpenSSL's ``subjectAltName`` value for addresses and DNS names; LabError for anything else."""
    entries = []
    for name in names:
        try:
            entries.append(f"IP:{ipaddress.ip_address(name)}")
        except ValueError:
            if not _DNS_NAME.match(name):
                raise LabError(f"Lab TLS: expected an IP address or a DNS name, found {name!r}.") from None
            entries.append(f"DNS:{name}")
    if not entries:
        raise LabError("Lab TLS: expected at least one router address or name, found none.")
    return ",".join(entries)


def _openssl(*args: str, cwd: Path) -> None:
    program = shutil.which("openssl")
    if program is None:
        raise LabError("Lab TLS: the openssl command is not installed (apt-get install openssl).")
    result = subprocess.run([program, *args], cwd=cwd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        lines = (result.stderr or result.stdout).strip().splitlines()
        raise LabError(f"Lab TLS: openssl {args[0]} failed: {lines[-1] if lines else result.returncode}.")


def make_lab_tls(folder: Path, names: list[str]) -> LabTls:
    """A new CA and a server certificate for ``names`` (the routers' addresses and host names) in ``folder``."""
    san = subject_alt_names(names)
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    files = LabTls(folder / "ca.crt", folder / "ca.key", folder / "router.crt", folder / "router.key")
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", *ec, "-keyout", files.ca_key.name, "-out", files.ca_certificate.name, "-sha256",
             "-days", str(DAYS), "-subj", "/CN=gpufleet lab CA",
             "-addext", "basicConstraints=critical,CA:TRUE,pathlen:0",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=folder)
    (folder / "router.ext").write_text(f"subjectAltName={san}\nbasicConstraints=critical,CA:FALSE\n"
                                       "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n")
    _openssl("req", "-new", *ec, "-keyout", files.key.name, "-out", "router.csr", "-subj", "/CN=gpufleet router",
             cwd=folder)
    _openssl("x509", "-req", "-in", "router.csr", "-CA", files.ca_certificate.name, "-CAkey", files.ca_key.name,
             "-CAcreateserial", "-out", "router.leaf.crt", "-days", str(DAYS), "-sha256", "-extfile", "router.ext",
             cwd=folder)
    files.certificate.write_text((folder / "router.leaf.crt").read_text() + files.ca_certificate.read_text())
    for leftover in ("router.csr", "router.ext", "router.leaf.crt", "ca.srl"):
        (folder / leftover).unlink(missing_ok=True)
    for key in (files.ca_key, files.key):
        os.chmod(key, 0o600)
    return files


NAMES_FILE = "names"  # the names the certificate was made for, one per line


def ensure_lab_tls(folder: Path, names: list[str]) -> LabTls:
    """The lab CA's files in ``folder``, made by :func:`make_lab_tls` when one is missing or the certificate was
    made for other names (a lab keeps its CA and certificate while its routers keep their addresses)."""
    files = LabTls(folder / "ca.crt", folder / "ca.key", folder / "router.crt", folder / "router.key")
    recorded = folder / NAMES_FILE
    wanted = "".join(f"{name}\n" for name in names)
    complete = all(path.is_file() for path in (files.ca_certificate, files.ca_key, files.certificate, files.key))
    if complete and recorded.is_file() and recorded.read_text() == wanted:
        return files
    made = make_lab_tls(folder, names)
    recorded.write_text(wanted)
    return made
