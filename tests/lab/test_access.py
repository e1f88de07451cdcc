"""Who can reach what on the serving lab (scenario ``serving``): the pipeline replica's rendezvous and API, and
how confined every unit gpufleet writes is. Ray's reach is tests/lab/test_ray.py's.

lab1 and lab2 run the routers (their requests reach the replicas' APIs); lab1 stands for any other machine on the
fleet network, while the controller's side of the lab (the bridge address) is the monitoring host and API client
(``monitoring_addresses``, ``vllm_api_allowed_from`` in inventories/lab/inventory.py).
"""

from __future__ import annotations

import ipaddress
import json
import re
import socket
import ssl
import time
import uuid

import pytest
import yaml
from gpufleet_lab.state import NodeRecord

import roles.router as router_role
from gpufleet.units.security import EXPOSURE_BOUND
from roles import ray as ray_role
from tests.conftest import DATA
from tests.lab import fleet
from tests.lab.fleet import PIPELINE, PORT, RENDEZVOUS, controller_reaches, exposures, reach
from tests.lab.harness import ROOT, Completed, Lab
from tests.loopback_http import raw_request

ROUTES = yaml.safe_load((DATA / "router" / "routes.yaml").read_text())
ROUTER_DEFAULTS = yaml.safe_load((ROOT / "roles" / "router" / "defaults.yml").read_text())
ACCESS_LINE = re.compile(r'"([A-Z]+) (\S+) HTTP/1\.[01]"')  # uvicorn's access log, in the replicas' journal

pytestmark = pytest.mark.filterwarnings("ignore:Unknown ssh-ed25519 host key:UserWarning")


@pytest.fixture
def mp_replica(lab: Lab, serving: Completed | None) -> tuple[NodeRecord, NodeRecord]:
    """The pipeline replica on vLLM's mp backend (the lab's default), serving: rank 0 and rank 1."""
    return lab.nodes[1], lab.nodes[2]


def test_only_the_replicas_nodes_reach_its_rendezvous(lab: Lab, mp_replica: tuple[NodeRecord, ...]) -> None:
    """The replica's nodes reach its rendezvous; the router (lab1) and vllm_api_allowed_from reach its API (and,
    in the same unit, the rendezvous); an address none of them lists reaches neither. The outsider is a second
    address given to lab1 for this test, on the lab's own bridge network."""
    rank0, rank1 = mp_replica
    router = lab.nodes[0]
    rendezvous, api = f"{rank0.address}:{RENDEZVOUS}", f"{rank0.address}:{PORT}"
    assert reach(lab, rank1, [rendezvous]) == {rendezvous: True}
    assert reach(lab, router, [api]) == {api: True}  # the routers group: its requests come from there
    outsider = str(ipaddress.ip_network(lab.state.subnet)[250])
    lab.host(router).check_output(f"ip address add {outsider}/32 dev host0")
    try:
        assert reach(lab, router, [rendezvous, api], source=outsider) == {rendezvous: False, api: False}
    finally:
        lab.host(router).run(f"ip address del {outsider}/32 dev host0")
    assert controller_reaches(api)  # vllm_api_allowed_from: the controller's side of the lab
    assert not lab.host(rank0).file(f"/etc/systemd/system/{ray_role.unit_name(PIPELINE)}").exists


# The units of the serving edge on a router node (Debian's haproxy and keepalived with gpufleet's drop-ins).
EDGE_UNITS = ("haproxy.service", "keepalived.service", "gpufleet-router-health.service",
              "gpufleet-router-clients.service", "gpufleet-router-clients.timer")


def test_every_unit_gpufleet_writes_is_confined(lab: Lab, mp_replica: tuple[NodeRecord, ...]) -> None:
    """Every unit gpufleet writes or changes is rated within the exposure bound on the nodes (the edge's included,
    present on both routers), and systemd-analyze verify accepts the edge's units as a router node loads them."""
    worst = exposures(lab)
    for unit in ("vllm@*.service", "node_exporter.service", "dcgm-exporter.service",
                 *(name for name in EDGE_UNITS if name.endswith(".service"))):
        assert worst.get(unit, 10.0) <= EXPOSURE_BOUND, worst
    for router in lab.nodes[:2]:
        verified = lab.host(router).run(f"systemd-analyze verify --man=no {' '.join(EDGE_UNITS)}")
        assert verified.rc == 0, verified.stdout + verified.stderr


def _ask(lab: Lab, method: str, path: str, key: str | None, marker: str) -> int:
    """One request to the routers' virtual address over HTTPS, as sent, the served model in it and ``marker`` in
    its query (the router routes on the path alone; vLLM's access log shows the query)."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    asked = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    body = json.dumps({"model": fleet.served_name("lab"), **asked, "max_tokens": 1}).encode()
    status, _ = raw_request(fleet.router_address(lab), fleet.ROUTER_PORT, method,
                            f"{path}{'&' if '?' in path else '?'}{marker}", body, headers, tls=fleet.tls(lab))
    return status


def _handshake(address: str, name: str, context: ssl.SSLContext) -> tuple[str, list[str]]:
    """The cipher a TLS client with ``context`` gets at the routers' ``address`` asking for ``name``, and the IP
    addresses the certificate it was shown names."""
    with socket.create_connection((address, fleet.ROUTER_PORT), timeout=10) as raw, \
            context.wrap_socket(raw, server_hostname=name) as conn:
        cipher, certificate = conn.cipher(), conn.getpeercert()
    assert cipher is not None and certificate is not None
    return cipher[0], [str(value) for kind, value in certificate.get("subjectAltName", ()) if kind == "IP Address"]


def test_the_edge_at_the_virtual_address_verifies_and_refuses_what_it_must(lab: Lab, serving: Completed | None) -> None:
    """At the routers' virtual address: a client that verifies the chain (the lab CA) and the name (the virtual
    address, in the certificate's names) is served, one that trusts another CA or asks for another name is refused;
    TLS 1.2 offering only ciphers without forward secrecy (static RSA) or without AEAD (CBC) is refused, an ECDHE
    AEAD one is chosen; a chunked body over router_max_request_bytes gets 413 while the same request at half the
    limit is served."""
    address, limit = fleet.router_address(lab), ROUTER_DEFAULTS["router_max_request_bytes"]
    cipher, names = _handshake(address, address, fleet.tls(lab))
    assert address in names and cipher in router_role.TLS13_SUITES
    for context, name in ((ssl.create_default_context(), address), (fleet.tls(lab), "router.example.net")):
        with pytest.raises(ssl.SSLCertVerificationError):
            _handshake(address, name, context)
    for offered in ("AES128-GCM-SHA256:AES256-GCM-SHA384:AES128-SHA", "ECDHE-ECDSA-AES128-SHA:ECDHE-RSA-AES128-SHA"):
        weak = fleet.tls(lab)
        weak.maximum_version = ssl.TLSVersion.TLSv1_2
        weak.set_ciphers(offered)
        with pytest.raises(ssl.SSLError):
            _handshake(address, address, weak)
    strong = fleet.tls(lab)
    strong.maximum_version = ssl.TLSVersion.TLSv1_2
    assert _handshake(address, address, strong)[0] in router_role.TLS12_CIPHERS
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {fleet.client_key(lab)}"}
    for size, expected in ((limit + 4096, 413), (limit // 2, 200)):  # JSON's blanks: a body of any size, one prompt
        request = json.dumps({"model": fleet.served_name("lab"), "prompt": "The fleet", "max_tokens": 1})
        body = (request[:-1] + " " * (size - len(request)) + "}").encode()
        chunks = iter([body[i:i + 4096] for i in range(0, len(body), 4096)])  # no length: chunked
        status, answer = raw_request(address, fleet.ROUTER_PORT, "POST", "/v1/completions", chunks, headers,
                                     tls=fleet.tls(lab))
        assert status == expected, (size, answer[:300])


def test_the_router_passes_only_the_routes_of_the_models_task(lab: Lab, serving: Completed | None) -> None:
    """Each route of tests/data/router/routes.yaml through the routers' virtual address (HTTPS), with no key, a
    wrong key, the replicas' own key and the client's key: without the client's key every route but the routers'
    own GET /health is refused 401 (the replicas' key is no client's); with it, a route the router refuses is
    answered 404 and a generation route is served. The replicas' access logs (vLLM's, in the journal of lab1's and
    lab2's replicas) show exactly the generation routes arriving, with the client's key only (each request carries
    a marker in its query: Prometheus's own scrapes of /metrics do not count). A replica port asked straight from
    an address that is no router's, with the replicas' key, refuses the connection (its IP filter)."""
    since = lab.host(lab.nodes[0]).check_output("date +%s")
    marker = f"route-matrix={uuid.uuid4().hex}"
    found: dict[tuple[str, str, str], int] = {}
    keys = (("no key", None), ("wrong key", "not-the-key"), ("replicas' key", fleet.api_key(lab)),
            ("client's key", fleet.client_key(lab)))
    for label, key in keys:
        for route in ROUTES:
            found[(label, route["method"], route["path"])] = _ask(lab, route["method"], route["path"], key, marker)
    health = ("GET", "/health")
    expected = {(label, r["method"], r["path"]): r["status"] if label == "client's key" or (r["method"], r["path"])
                == health else 401 for label, _ in keys for r in ROUTES}
    assert {k: (v, expected[k]) for k, v in found.items() if v != expected[k]} == {}
    served = {(r["method"], r["path"]) for r in ROUTES if r["reaches"]}
    time.sleep(1)  # the journal has the last access lines
    arrived: set[tuple[str, str]] = set()
    for node in lab.nodes[:2]:
        log = lab.host(node).check_output(f"journalctl -q -o cat --no-pager --since @{since} -u 'vllm@*'")
        arrived |= {(method, re.sub(rf"[?&]{marker}$", "", path)) for method, path in ACCESS_LINE.findall(log)
                    if marker in path}
    assert arrived == served
    # straight to a replica, past the routers, from a lab address that is none of the routers'
    outsider = str(ipaddress.ip_network(lab.state.subnet)[249])
    api = f"{lab.nodes[1].address}:{PORT}"
    lab.host(lab.nodes[2]).check_output(f"ip address add {outsider}/32 dev host0")
    try:
        assert reach(lab, lab.nodes[2], [api], source=outsider) == {api: False}
    finally:
        lab.host(lab.nodes[2]).run(f"ip address del {outsider}/32 dev host0")
