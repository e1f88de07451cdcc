"""The routers' peers (HAProxy's ``peers`` section): the stick tables every router keeps (the clients' counters,
the prefix policy's conversations) are pushed to the other routers as they change, and handed from the old process
to the new one at a reload (the local peer), so that a reload, a failover to another router or a router that
restarts finds them as they were. Where several routers take requests at once, a counter holds the last value
pushed (peers copy, they do not add): behind a virtual address one router counts at a time.

Peers speak TLS only: each side shows the routers' one certificate and verifies the other's against it
(``verify required``), so a connection without it is refused before it reaches a table. The certificate and its
key are drawn on the controller (self-signed, ECDSA P-256, :func:`draw_pem`) in the run that finds the routers
without one or disagreeing (gpufleet.operations.shared_secrets), and kept in :data:`PEM` (root:haproxy, 0640).
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from gpufleet.config.router_wide import own_address
from gpufleet.config.schema import HostConfig
from gpufleet.netaddr import host_port

SECTION = "gpufleet-routers"  # the peers section's name, which every stick table names
PEM = "/etc/haproxy/gpufleet-peers.pem"  # the routers' certificate and key, root:haproxy 0640
WHAT = "the routers' peer certificate"
VALID_YEARS = 100  # a certificate that expired would end the peers' sync without a word; the key is what is secret


@dataclass(frozen=True)
class Peers:
    """One router's peers section: where it listens, its own name, and every router (its own with no address)."""

    listen: str  # ADDRESS:PORT of this router's peer port
    local: str  # this router's name among the peers
    servers: tuple[tuple[str, str | None], ...]  # (name, ADDRESS:PORT; None: this router), in the group's order
    pem: str = PEM
    section: str = SECTION


def router_host(router: str, cfg: HostConfig) -> str:
    """Where the other routers reach ``router``: its own IP address, else its fleet address or name."""
    return own_address(router, cfg) or cfg.fleet_address or router


def peer_address(router: str, cfg: HostConfig) -> str:
    """Where the other routers reach ``router``'s peer port."""
    return host_port(router_host(router, cfg), cfg.router_peer_port)


def peers(router: str, routers: Sequence[str], configs: Mapping[str, HostConfig]) -> Peers:
    """``router``'s peers section among ``routers`` (the group ``routers``, each named by its inventory name)."""
    return Peers(listen=peer_address(router, configs[router]), local=router,
                 servers=tuple((name, None if name == router else peer_address(name, configs[name]))
                               for name in routers))


def draw_pem() -> str:
    """A new certificate and key for the routers' peers (PEM: the certificate, then the key in PKCS #8)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gpufleet routers' peers")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=365 * VALID_YEARS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(key, hashes.SHA256()))
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return (cert.public_bytes(serialization.Encoding.PEM) + key_pem).decode()
