"""The routers' certificate and private key, parsed on the controller before any host: what HAProxy would serve
to every client of the edge, checked as a client and an operator would (nothing of a key is ever shown).

The certificate file holds the server's certificate, then its chain, and no key; it is valid now and names the
address clients reach the routers at in its subjectAltName (an IP address there, or a DNS name the controller
cannot resolve and takes as given). The key file holds one unencrypted PEM key (PKCS#1, PKCS#8 or SEC1: HAProxy
asks no passphrase), RSA of at least :data:`MIN_RSA_BITS` bits or ECDSA on one of :data:`CURVES`, and it is the
certificate's own. A file that is something else (an OpenSSH key, an encrypted key, a certificate that carries
its CA's key) is refused, so that it never reaches a router.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import re
from collections.abc import Iterator, Sequence

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.types import PublicKeyTypes

MIN_RSA_BITS = 2048
"""The smallest RSA key served: NIST's floor since 2014, and what public CAs issue."""

CURVES = ("secp256r1", "secp384r1", "secp521r1")
"""The ECDSA curves served (P-256, P-384, P-521): what clients of TLS 1.2 and 1.3 all take."""

CERTIFICATE = "router_tls_certificate"
KEY = "router_tls_key"
_PEM_KEY = "PRIVATE KEY-----"
_PEM_BLOCK = re.compile(r"-----BEGIN ([A-Z0-9 ]+)-----\r?\n.*?-----END \1-----", re.DOTALL)
WEAK_HASHES = ("md5", "sha1")
"""Signature hashes no current client accepts in a server's chain (a root's own signature is not checked)."""


def is_ip_address(text: str) -> bool:
    """Whether ``text`` is an IP address as written (a DNS name that is one is no name)."""
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def pair_problems(certificate_pem: str, key_pem: str, addresses: Sequence[str],
                  now: datetime.datetime | None = None) -> list[tuple[str, str]]:
    """(variable, problem) for the routers' certificate and key; ``addresses``: what the certificate must name
    (the routers' virtual address, or each router's address), IP addresses only; ``now``: when (UTC)."""
    leaf, found = _leaf(certificate_pem, addresses, now or datetime.datetime.now(datetime.UTC))
    problems = [(CERTIFICATE, problem) for problem in found]
    key, problem = _key(key_pem)
    if problem is not None:
        problems.append((KEY, problem))
    if leaf is not None and key is not None and _public(leaf.public_key()) != _public(key.public_key()):
        problems.append((KEY, f"expected the key {CERTIFICATE} was made with, found another key (not shown)"))
    return problems


def _blocks_problem(pem: str) -> str | None:
    """Anything in the certificate file besides certificate blocks and blanks (never shown)."""
    labels: list[str] = _PEM_BLOCK.findall(pem)
    other = next((label for label in labels if label != "CERTIFICATE"), None)
    if other is not None:
        return (f"expected certificates only (the server's, then its chain), found a PEM block labelled {other!r}"
                " (not shown: a key belongs in router_tls_key, and a CA's key on no router)")
    if _PEM_BLOCK.sub("", pem).strip():
        return "expected certificates only (the server's, then its chain), found text outside them (not shown)"
    return None


def _leaf(pem: str, addresses: Sequence[str],
          now: datetime.datetime) -> tuple[x509.Certificate | None, list[str]]:
    """The server's certificate (the file's first) and the problems of the file."""
    if _PEM_KEY in pem:
        return None, [f"expected certificates only (the server's, then its chain), found a private key in it (not"
                      f" shown: it belongs in {KEY}, and a CA's key on no router)"]
    if problem := _blocks_problem(pem):
        return None, [problem]
    try:
        chain = x509.load_pem_x509_certificates(pem.encode())
    except ValueError:
        return None, ["expected PEM certificates that parse, found one that does not"]
    leaf = chain[0]
    weak = next((c for c in chain if c.issuer != c.subject and c.signature_hash_algorithm is not None
                 and c.signature_hash_algorithm.name in WEAK_HASHES), None)
    if weak is not None:
        algorithm = weak.signature_hash_algorithm.name.upper() if weak.signature_hash_algorithm else ""
        which = "the server's certificate" if weak is leaf else "a certificate of its chain"
        return None, [f"expected certificates signed with SHA-256 or stronger (clients refuse {algorithm}), found"
                      f" {which} signed with {algorithm}"]
    with contextlib.suppress(x509.ExtensionNotFound):
        if leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca:
            return None, ["expected the server's certificate first, then its chain, found a CA's (basicConstraints"
                          " CA:TRUE) first"]
    problems = []
    if not leaf.not_valid_before_utc <= now <= leaf.not_valid_after_utc:
        problems.append(f"expected a certificate valid now, found one valid from {leaf.not_valid_before_utc:%Y-%m-%d}"
                        f" to {leaf.not_valid_after_utc:%Y-%m-%d}")
    problems += list(_name_problems(leaf, addresses))
    return leaf, problems


def _name_problems(leaf: x509.Certificate, addresses: Sequence[str]) -> Iterator[str]:
    try:
        names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        yield ("expected a certificate that names the routers in its subjectAltName (clients ignore the common"
               " name), found none")
        return
    dns = names.get_values_for_type(x509.DNSName)
    ips = set(names.get_values_for_type(x509.IPAddress))
    for name in dns:
        if is_ip_address(name) or name == "*" or (name.startswith("*.") and name.count(".") < 2):
            yield (f"expected DNS names in the certificate's subjectAltName that clients match (an IP address goes in"
                   f" an IP entry; a wildcard covers one label of a domain), found the DNS name {name!r}")
            return
    wanted = [ipaddress.ip_address(a) for a in addresses]
    missing = [str(a) for a in wanted if a not in ips]
    if missing and not dns:
        shown = ", ".join(sorted(map(str, ips))) or "no address"
        yield (f"expected a certificate that names {', '.join(missing)} (where clients reach the routers) in its"
               f" subjectAltName, found {shown}")


def _key(pem: str) -> tuple[rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey | None, str | None]:
    """The private key, or why the file is not one the routers can serve with (never its text)."""
    if "BEGIN OPENSSH PRIVATE KEY" in pem:
        return None, ("expected a PEM key in PKCS#1, PKCS#8 or SEC1 form, found an OpenSSH private key (not shown:"
                      " an SSH key is no TLS key)")
    if "ENCRYPTED" in pem:
        return None, "expected an unencrypted private key (HAProxy asks no passphrase), found an encrypted one"
    if "-----BEGIN CERTIFICATE-----" in pem:
        return None, f"expected the private key alone, found a certificate in it too (certificates: {CERTIFICATE})"
    if pem.count("-----BEGIN ") != 1:
        return None, f"expected one private key, found {pem.count('-----BEGIN ')} PEM blocks (not shown)"
    try:
        key = serialization.load_pem_private_key(pem.encode(), password=None)
    except (TypeError, ValueError, UnsupportedAlgorithm):
        return None, "expected a PEM private key that parses, found one that does not (not shown)"
    if isinstance(key, rsa.RSAPrivateKey):
        if key.key_size < MIN_RSA_BITS:
            return None, f"expected an RSA key of at least {MIN_RSA_BITS} bits, found {key.key_size} bits"
        return key, None
    if isinstance(key, ec.EllipticCurvePrivateKey):
        if key.curve.name not in CURVES:
            return None, f"expected an ECDSA key on P-256, P-384 or P-521, found one on {key.curve.name}"
        return key, None
    return None, (f"expected an RSA key of at least {MIN_RSA_BITS} bits or an ECDSA key on P-256, P-384 or P-521,"
                  f" found {type(key).__name__.removeprefix('_').replace('PrivateKey', '')}")


def _public(key: PublicKeyTypes) -> bytes:
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
