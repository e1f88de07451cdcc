"""TLS files made for the run, by kind (no key is kept in the repository): a CA, the routers' certificate for
127.0.0.1, 127.0.0.2 and the address 127.0.0.100 with its chain, its key in each PEM form, and the wrong files an
operator may give instead."""

from __future__ import annotations

import datetime
import functools
import ipaddress
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.hazmat.primitives.asymmetric.types import CertificateIssuerPrivateKeyTypes, PrivateKeyTypes
from cryptography.x509.oid import NameOID

NAMED = ("127.0.0.1", "127.0.0.2", "127.0.0.100")
DAY = datetime.timedelta(days=1)
_PKCS8 = serialization.PrivateFormat.PKCS8
_PEM = serialization.Encoding.PEM


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _day(year: int, month: int, day: int) -> datetime.datetime:
    return datetime.datetime(year, month, day, tzinfo=datetime.UTC)


@functools.cache
def _ca() -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gpufleet test CA")])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(_now() - DAY)
            .not_valid_after(_now() + 30 * DAY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def _leaf(key: PrivateKeyTypes, names: tuple[str, ...] | None = NAMED,
          valid: tuple[datetime.datetime, datetime.datetime] | None = None,
          dns: tuple[str, ...] = ()) -> x509.Certificate:
    """A server certificate for ``key`` signed by the CA, naming ``names`` (None: no subjectAltName) and the DNS
    names ``dns``, valid over ``valid`` (default: from yesterday for 30 days)."""
    start, end = valid or (_now() - DAY, _now() + 30 * DAY)
    ca_key, ca = _ca()
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gpufleet router")]))
               .issuer_name(ca.subject).public_key(key.public_key())  # type: ignore[arg-type]
               .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end))
    if names is not None:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(n)) for n in names]
                                        + [x509.DNSName(n) for n in dns]), critical=False)
    signer: CertificateIssuerPrivateKeyTypes = ca_key
    return builder.sign(signer, hashes.SHA256())


def _sha1_chain() -> str:
    """The server's certificate for the test key signed by the CA with SHA-1, which the cryptography package no
    longer signs with: OpenSSL's command line does, from the same CA and key, then the CA."""
    with tempfile.TemporaryDirectory() as folder:
        where = Path(folder)
        (where / "ca.key").write_text(_key_pem(_ca()[0]))
        (where / "ca.crt").write_text(_cert_pem(_ca()[1]))
        (where / "leaf.key").write_text(_key_pem(_ec_key()))
        (where / "san.cnf").write_text(f"subjectAltName={','.join(f'IP:{n}' for n in NAMED)}\n")
        subprocess.run(["openssl", "req", "-new", "-key", "leaf.key", "-subj", "/CN=gpufleet router", "-out",
                        "leaf.csr"], cwd=where, check=True, capture_output=True)
        subprocess.run(["openssl", "x509", "-req", "-in", "leaf.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-sha1",
                        "-days", "30", "-extfile", "san.cnf", "-out", "leaf.crt"], cwd=where, check=True,
                       capture_output=True)
        return (where / "leaf.crt").read_text() + _cert_pem(_ca()[1])


@functools.cache
def _ec_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


@functools.cache
def _rsa_key(bits: int) -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=bits)


def _key_pem(key: PrivateKeyTypes, form: serialization.PrivateFormat = _PKCS8,
             encryption: serialization.KeySerializationEncryption | None = None) -> str:
    return key.private_bytes(_PEM, form, encryption or serialization.NoEncryption()).decode()


def _cert_pem(*certs: x509.Certificate) -> str:
    return "".join(c.public_bytes(_PEM).decode() for c in certs)


def _chain(cert: x509.Certificate) -> str:
    return _cert_pem(cert, _ca()[1])


@functools.cache
def _good_leaf() -> x509.Certificate:
    return _leaf(_ec_key())


KINDS: dict[str, Callable[[], str]] = {
    "ca": lambda: _cert_pem(_ca()[1]),
    "certificate": lambda: _chain(_good_leaf()),
    "key": lambda: _key_pem(_ec_key()),
    "key-sec1": lambda: _key_pem(_ec_key(), serialization.PrivateFormat.TraditionalOpenSSL),
    "rsa-certificate": lambda: _chain(_leaf(_rsa_key(2048))),
    "rsa-key-pkcs1": lambda: _key_pem(_rsa_key(2048), serialization.PrivateFormat.TraditionalOpenSSL),
    "key-other": lambda: _key_pem(ec.generate_private_key(ec.SECP256R1())),
    "key-encrypted": lambda: _key_pem(_ec_key(), encryption=serialization.BestAvailableEncryption(b"passphrase")),
    "key-openssh": lambda: _key_pem(_ec_key(), serialization.PrivateFormat.OpenSSH),
    "rsa-1024-certificate": lambda: _chain(_leaf(_rsa_key(1024))),
    "rsa-1024-key": lambda: _key_pem(_rsa_key(1024)),
    "ed25519-key": lambda: _key_pem(ed25519.Ed25519PrivateKey.generate()),
    "secp256k1-key": lambda: _key_pem(ec.generate_private_key(ec.SECP256K1())),
    "key-twice": lambda: _key_pem(_ec_key()) + _key_pem(_ec_key()),
    "key-with-certificate": lambda: _chain(_good_leaf()) + _key_pem(_ec_key()),
    "certificate-expired": lambda: _chain(_leaf(_ec_key(), valid=(_day(2024, 1, 1), _day(2025, 1, 1)))),
    "certificate-not-yet-valid": lambda: _chain(_leaf(_ec_key(), valid=(_day(2099, 1, 1), _day(2099, 12, 31)))),
    "certificate-with-its-key": lambda: _chain(_good_leaf()) + _key_pem(_ec_key()),
    "certificate-with-the-cas-key": lambda: _chain(_good_leaf()) + _key_pem(_ca()[0]),
    "certificate-without-names": lambda: _chain(_leaf(_ec_key(), names=None)),
    "certificate-for-other-addresses": lambda: _chain(_leaf(_ec_key(), names=("10.1.2.3",))),
    "certificate-garbled": lambda: _chain(_good_leaf()).replace("M", "*", 3),
    "certificate-sha1": lambda: _sha1_chain(),
    "certificate-dns-an-address": lambda: _chain(_leaf(_ec_key(), names=(), dns=("127.0.0.1",))),
    "certificate-dns-any-name": lambda: _chain(_leaf(_ec_key(), names=(), dns=("*",))),
    "certificate-dns-a-name": lambda: _chain(_leaf(_ec_key(), names=(), dns=("router.example.net",))),
    "certificate-with-a-relabelled-key": lambda: _chain(_good_leaf()) + _key_pem(_ca()[0]).replace(
        "PRIVATE KEY", "FOO KEY"),
    "certificate-with-text-after": lambda: _chain(_good_leaf()) + "trailing junk\n",
}


def pem(kind: str) -> str:
    """The PEM text of ``kind`` (a key of :data:`KINDS`), the same within one run."""
    return _made(kind)


@functools.cache
def _made(kind: str) -> str:
    return KINDS[kind]()
