"""The routers' peers section as the router role plans it (roles.router.peers): every router lists every router by
its inventory name, itself without an address, the others at their own address and the fleet's peer port; and the
certificate the deploy draws for them. Running it: tests/tools/test_router_edge.py (two HAProxy routers as peers)."""

from __future__ import annotations

import datetime

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from roles.router import peers
from tests.unit.configs import host_config


def test_each_router_lists_every_router_itself_without_an_address() -> None:
    configs = {"10.0.0.5": host_config(), "r2": host_config(fleet_address="fd00::2"),
               "r3": host_config(fleet_address="10.0.0.7")}
    configs = {name: cfg.model_copy(update={"router_peer_port": 9406}) for name, cfg in configs.items()}
    found = peers.peers("r2", list(configs), configs)
    assert found.listen == "[fd00::2]:9406" and found.local == "r2"
    assert found.servers == (("10.0.0.5", "10.0.0.5:9406"), ("r2", None), ("r3", "10.0.0.7:9406"))
    assert peers.peers("10.0.0.5", list(configs), configs).servers[1] == ("r2", "[fd00::2]:9406")


def test_the_drawn_certificate_is_self_signed_holds_its_key_and_lasts() -> None:
    text = peers.draw_pem()
    cert = x509.load_pem_x509_certificate(text.encode())
    key = serialization.load_pem_private_key(text.encode(), password=None)
    assert key.public_key().public_numbers() == cert.public_key().public_numbers()  # type: ignore[union-attr]
    assert cert.issuer == cert.subject
    cert.verify_directly_issued_by(cert)
    assert cert.not_valid_after_utc - datetime.datetime.now(datetime.UTC) > datetime.timedelta(days=365 * 99)
    assert peers.draw_pem() != text  # a new key every time
