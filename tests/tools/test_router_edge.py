"""The edge (client keys, limits, TLS), run by a real HAProxy (Debian's) on loopback with the configuration and
edge files the router role renders, in front of fake replicas that take the replicas' own key only.

HAProxy runs as systemd runs it (master-worker), so a reload here is the unit's: SIGUSR2 to the master.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import os
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
from gpufleet_lab.tls import ensure_lab_tls, make_lab_tls

import roles.router as router_role
from gpufleet.config import secrets
from gpufleet.node import router_admin
from gpufleet.plan import backends as plan_backends
from gpufleet.plan.priority import PRIORITY_CLASSES
from roles.router import peers
from roles.router.peers import Peers
from tests.conftest import host_tool
from tests.loopback_http import free_port
from tests.memory_rule import deny_write_execute
from tests.tools.edge_run import CLIENTS, CLOSED, KEYS, OPEN, RATE, REPLICA_KEY, Edge, start_edge, write_edge
from tests.tools.haproxy_run import wait
from tests.unit.configs import host_config


@pytest.fixture
def edge(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Edge]:
    yield from start_edge(tmp_path, monkeypatch, tls=False)


@pytest.fixture
def tls_edge(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Edge]:
    yield from start_edge(tmp_path, monkeypatch, tls=True, plain=True)


@pytest.fixture
def edge_pair(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Edge, Edge, Path]]:
    """Two routers of one fleet (a and b), peers of each other on loopback with one certificate drawn as the deploy
    draws it; and that certificate's file."""
    pem = tmp_path / "peers.pem"
    pem.touch(mode=0o600)
    pem.write_text(peers.draw_pem())
    ports = {"a": free_port(), "b": free_port()}
    servers = {name: tuple((other, None if other == name else f"127.0.0.1:{ports[other]}") for other in ports)
               for name in ports}
    with ExitStack() as stack:
        a, b = (stack.enter_context(contextmanager(start_edge)(
                    tmp_path / name, monkeypatch, tls=False,
                    peers=Peers(f"127.0.0.1:{ports[name]}", name, servers[name], pem=str(pem))))
                for name in ports)
        yield a, b, pem


def _clients_table(edge: Edge) -> dict[str, dict[str, int]]:
    return router_admin.parse_table(router_admin.Runtime(str(edge.socket)).ask("show", "table",
                                                                               router_role.CLIENT_TABLE))


def test_the_routers_share_the_clients_counters_and_a_reload_keeps_them_with_no_other_router_up(
        edge_pair: tuple[Edge, Edge, Path]) -> None:
    """What a client did at one router is in the other's table as it happens (peers), and a reload hands the table
    to the new process (the local peer), also when the other router is down and cannot give it back."""
    a, b, _ = edge_pair
    for _ in range(3):
        assert a.post(KEYS["alice"]).status == 200
    wait(lambda: _clients_table(b).get("alice", {}).get("gpc1") == 3, "alice's 3 requests in b's table")
    b.proc.terminate()
    b.proc.wait(10)
    # A process hands its tables on at a reload once its own start's resync is over (HAProxy gives it 5 s when no
    # peer teaches it sooner): routers reload minutes apart; this one started a moment ago.
    wait(lambda: "resync_timeout=<PAST>" in router_admin.Runtime(str(a.socket)).ask("show", "peers"),
         "a's resync at its start over")
    a.reload()
    wait(lambda: _clients_table(a).get("alice", {}).get("gpc1") == 3, "alice's 3 requests in the new process's table")
    assert a.post(KEYS["alice"]).status == 200
    assert _clients_table(a)["alice"]["gpc1"] == 4


def test_a_peer_connection_without_the_routers_certificate_is_refused(
        edge_pair: tuple[Edge, Edge, Path], tmp_path: Path) -> None:
    """The peer port speaks TLS only and asks for the routers' own certificate: a client with none, or with another
    one drawn the same way, is refused in the handshake; with the routers' own, the peers protocol answers."""
    a, _, pem = edge_pair
    port = int(a.config.read_text().split("peers gpufleet-routers\n    bind 127.0.0.1:", 1)[1].split()[0])
    other = tmp_path / "other.pem"
    other.write_text(peers.draw_pem())

    def hello(certificate: Path | None) -> bytes | None:
        """The peer's answer to a peer's hello (router b's, to router a) over TLS with ``certificate``; None when
        the TLS handshake fails (TLS 1.3 tells a client its certificate was refused at its first read)."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        if certificate is not None:
            context.load_cert_chain(certificate)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
            try:
                with context.wrap_socket(raw) as conn:
                    conn.sendall(b"HAProxyS 2.1\na\nb 1 1\n")
                    return conn.recv(64)
            except (ssl.SSLError, ConnectionResetError):
                return None

    assert hello(None) is None
    assert hello(other) is None
    assert (hello(pem) or b"").startswith(b"200")  # the peers protocol's "welcome"


def test_the_config_and_its_files_hold_no_key_and_the_files_are_not_world_readable(edge: Edge) -> None:
    secrets = [*KEYS.values(), REPLICA_KEY]
    assert not any(key in edge.config.read_text() for key in secrets)
    written = {path.name: path for path in edge.edge_dir.iterdir()}
    assert not any(key in path.read_text() for path in written.values() for key in KEYS.values())
    assert REPLICA_KEY in written["upstream.map"].read_text()  # the one file that holds a key, 0640
    assert all(path.stat().st_mode & 0o007 == 0 for path in written.values())


def test_no_key_or_a_wrong_one_gets_401_and_a_known_one_reaches_the_replica_with_the_replicas_key(
        edge: Edge) -> None:
    for key in (None, "wrong-key-0123456789abcdef", REPLICA_KEY):  # the replicas' own key is no client's
        answer = edge.post(key)
        assert answer.status == 401 and answer.headers.get("www-authenticate") == "Bearer", answer
    assert edge.request("GET", "/v1/models").status == 401
    assert edge.replicas[OPEN].authorizations == []  # none of them reached a replica
    assert edge.post(KEYS["alice"]).body["replica"] == f"{OPEN}-0"
    assert edge.post(KEYS["alice"], CLOSED).status == 200
    assert edge.replicas[OPEN].authorizations == [f"Bearer {REPLICA_KEY}"]
    assert edge.request("GET", "/health").status == 200  # the routers' own check needs no key


def test_a_model_the_client_may_not_use_gets_403_and_its_model_list_leaves_it_out(edge: Edge) -> None:
    assert edge.post(KEYS["bob"], OPEN).status == 200
    answer = edge.post(KEYS["bob"], CLOSED)
    assert answer.status == 403 and answer.body["error"]["code"] == 403, answer
    assert edge.replicas[CLOSED].authorizations == []

    def ids(key: str) -> list[str]:
        answer = edge.request("GET", "/v1/models", key)
        assert answer.status == 200, answer
        return [entry["id"] for entry in answer.body["data"]]

    assert ids(KEYS["bob"]) == [OPEN]
    assert ids(KEYS["alice"]) == sorted([OPEN, CLOSED])


def test_the_replica_gets_the_priority_of_the_clients_class_never_the_clients_own(edge: Edge) -> None:
    """OPEN is scheduled by priority (bob, batch, may use it): bob's requests carry batch's priority, alice's (no
    class) standard's; CLOSED, which no client with a class may use, gets 0. What the client sent never passes
    (vLLM reads the header before the body's field)."""
    sent = [("bob", OPEN), ("alice", OPEN), ("alice", CLOSED)]
    for name, model in sent:
        assert edge.post(KEYS[name], model, priority=-7).status == 200
    got = edge.replicas[OPEN].priorities + edge.replicas[CLOSED].priorities
    assert got == [str(PRIORITY_CLASSES["batch"]), str(PRIORITY_CLASSES["standard"]), "0"], got


def test_over_the_rate_limit_gets_429_with_retry_after(edge: Edge) -> None:
    answers = [edge.post(KEYS["carol"]) for _ in range(2 * RATE)]
    assert [a.status for a in answers[:RATE]] == [200] * RATE, answers
    limited = [a for a in answers if a.status == 429]
    assert len(limited) == RATE, answers
    assert all(a.headers.get("retry-after") == "1" and a.body["error"]["code"] == 429 for a in limited)
    assert edge.post(KEYS["alice"]).status == 200  # another client's limit is its own
    time.sleep(2.1)  # the rate of admitted requests is back under the limit
    assert edge.post(KEYS["carol"]).status == 200


def test_over_the_concurrency_limit_gets_429_and_a_finished_request_frees_its_place(edge: Edge) -> None:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        slow = pool.submit(edge.post, KEYS["dave"], OPEN, "sleep:2")
        wait(lambda: len(edge.replicas[OPEN].authorizations) == 1, "the slow request at the replica")
        second = edge.post(KEYS["dave"])
        assert second.status == 429 and second.headers.get("retry-after") == "1", second
        assert edge.post(KEYS["alice"]).status == 200  # others are not held back
        assert slow.result().status == 200
    assert edge.post(KEYS["dave"]).status == 200


def test_a_key_rotated_by_a_reload_keeps_the_request_in_flight_and_the_old_key_gets_401(
        edge: Edge, monkeypatch: pytest.MonkeyPatch) -> None:
    config_before = edge.config.read_text()
    new_key = "alice-rotated-0123456789abcdef"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        in_flight = pool.submit(edge.post, KEYS["alice"], OPEN, "sleep:3")
        wait(lambda: len(edge.replicas[OPEN].authorizations) == 1, "the request in flight at the replica")
        monkeypatch.setenv("EDGE_ALICE_KEY", new_key)
        secrets.forget()  # the deploy after the rotation (a run reads each secret once)
        cfg = host_config(router_clients=CLIENTS)
        plan_models = {OPEN: REPLICA_KEY, CLOSED: REPLICA_KEY}
        found = [plan_backends.Backend(f"model-{m}", m, ()) for m in sorted(plan_models)]
        written = router_role.edge_files(cfg, found, plan_models)
        changed = {name for name, text in written.items() if (edge.edge_dir / name).read_text() != text}
        assert changed == {"clients.map"}  # a rotation changes one map, not the configuration
        write_edge(edge.edge_dir, written)
        edge.reload()
        assert edge.post(KEYS["alice"]).status == 401
        assert edge.post(new_key).status == 200
        assert in_flight.result().status == 200  # finished by the old worker
    assert edge.config.read_text() == config_before


def test_a_lab_keeps_its_ca_until_its_routers_names_change(tmp_path: Path) -> None:
    """The lab inventory asks for its CA at every load: made once, kept while the names are the same, made again
    (a new CA) for other names, and again when a file is missing."""
    folder = tmp_path / "tls"
    first = ensure_lab_tls(folder, ["10.213.0.10", "10.213.0.11"])
    ca = first.ca_certificate.read_text()
    assert ensure_lab_tls(folder, ["10.213.0.10", "10.213.0.11"]).ca_certificate.read_text() == ca
    moved = ensure_lab_tls(folder, ["10.213.0.10", "10.213.0.12"])
    assert moved.ca_certificate.read_text() != ca
    shown = subprocess.run(["openssl", "x509", "-in", str(moved.certificate), "-noout", "-ext", "subjectAltName"],
                           capture_output=True, text=True, check=True).stdout
    assert "IP Address:10.213.0.12" in shown and "10.213.0.11" not in shown
    moved.key.unlink()
    assert ensure_lab_tls(folder, ["10.213.0.10", "10.213.0.12"]).key.is_file()
    assert moved.ca_key.stat().st_mode & 0o077 == 0 and folder.stat().st_mode & 0o077 == 0


def test_https_with_the_lab_ca_works_and_plain_http_on_the_router_port_gets_no_answer(tls_edge: Edge) -> None:
    assert tls_edge.post(KEYS["alice"]).status == 200
    with pytest.raises((ConnectionError, http.client.HTTPException, OSError)):
        tls_edge.request("POST", "/v1/completions", KEYS["alice"], tls=False)
    with pytest.raises(ssl.SSLCertVerificationError):  # a client that does not trust the lab CA
        conn = http.client.HTTPSConnection("127.0.0.1", tls_edge.port, timeout=10,
                                           context=ssl.create_default_context())
        try:
            conn.request("GET", "/health")
        finally:
            conn.close()
    assert tls_edge.request("GET", "/health", port=tls_edge.plain_port, tls=False).status == 200  # the plain port


def _handshake(edge: Edge, version: ssl.TLSVersion, ciphers: str | None = None) -> str:
    """The cipher a client trusting the lab CA gets at TLS ``version`` offering ``ciphers`` (OpenSSL's names)."""
    assert edge.tls is not None
    context = ssl.create_default_context(cafile=str(edge.tls.ca_certificate))
    context.minimum_version = context.maximum_version = version
    if ciphers:
        context.set_ciphers(ciphers)
    with socket.create_connection(("127.0.0.1", edge.port), timeout=10) as raw, \
            context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        found = tls.cipher()
        assert found is not None
        return found[0]


def test_tls_offers_forward_secret_aead_ciphers_only(tls_edge: Edge) -> None:
    """The lab's certificate is ECDSA: a TLS 1.2 client offering only CBC (with SHA-1 or SHA-256, ECDHE or not) is
    refused, one offering an ECDHE AEAD cipher gets it; TLS 1.3 gets one of its suites."""
    for cbc in ("ECDHE-ECDSA-AES128-SHA", "ECDHE-ECDSA-AES256-SHA384", "AES128-SHA:AES256-GCM-SHA384"):
        with pytest.raises(ssl.SSLError):
            _handshake(tls_edge, ssl.TLSVersion.TLSv1_2, cbc)
    assert _handshake(tls_edge, ssl.TLSVersion.TLSv1_2, "ECDHE-ECDSA-AES128-GCM-SHA256:ECDHE-ECDSA-AES128-SHA") \
        == "ECDHE-ECDSA-AES128-GCM-SHA256"
    assert _handshake(tls_edge, ssl.TLSVersion.TLSv1_2) in router_role.TLS12_CIPHERS
    assert _handshake(tls_edge, ssl.TLSVersion.TLSv1_3) in router_role.TLS13_SUITES


def test_the_clients_counters_reach_a_textfile(edge: Edge, tmp_path: Path) -> None:
    for _ in range(2 * RATE):
        edge.post(KEYS["carol"])
    edge.post(KEYS["bob"], CLOSED)
    textfile = tmp_path / "router_clients.prom"
    assert router_admin.main(["client-metrics", "--socket", str(edge.socket), "--textfile", str(textfile),
                              "--edge-dir", str(edge.edge_dir)]) == 0
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
               for line in textfile.read_text().splitlines() if line and not line.startswith("#")}
    assert samples['gpufleet_router_client_requests_total{client="carol"}'] == 2 * RATE
    assert samples['gpufleet_router_client_limited_total{client="carol"}'] == RATE
    assert samples['gpufleet_router_client_errors_4xx_total{client="carol"}'] >= RATE
    assert samples['gpufleet_router_client_errors_4xx_total{client="bob"}'] == 1
    assert samples['gpufleet_router_client_requests_in_flight{client="carol"}'] == 0
    assert samples['gpufleet_router_client_rate_limit{client="carol"}'] == RATE
    assert samples['gpufleet_router_client_concurrency_limit{client="dave"}'] == 1
    assert os.stat(textfile).st_mode & 0o777 == 0o644


def test_a_renewed_certificate_is_served_after_a_reload_and_the_request_in_flight_finishes(
        tls_edge: Edge, tmp_path: Path) -> None:
    renewed = make_lab_tls(tmp_path / "renewed", ["127.0.0.1"])
    cfg = host_config(router_clients=CLIENTS, router_tls_certificate={"file": str(renewed.certificate)},
                      router_tls_key={"file": str(renewed.key)})
    found = [plan_backends.Backend(f"model-{m}", m, ()) for m in (CLOSED, OPEN)]
    written = router_role.edge_files(cfg, found, {OPEN: REPLICA_KEY, CLOSED: REPLICA_KEY})
    assert {name for name, text in written.items()
            if (tls_edge.edge_dir / name).read_text() != text} == {router_role.TLS_PEM}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        in_flight = pool.submit(tls_edge.post, KEYS["alice"], OPEN, "sleep:3")
        wait(lambda: len(tls_edge.replicas[OPEN].authorizations) == 1, "the request in flight at the replica")
        write_edge(tls_edge.edge_dir, written)
        tls_edge.reload()
        with pytest.raises(ssl.SSLCertVerificationError):  # the old CA no longer verifies the router
            tls_edge.post(KEYS["alice"])
        tls_edge.tls = renewed
        assert tls_edge.post(KEYS["alice"]).status == 200
        assert in_flight.result().status == 200


def test_the_body_checks_start_under_the_units_memory_rule_and_need_it_lifted(edge: Edge) -> None:
    """HAProxy JIT-compiles the body checks' regular expressions: it starts under its drop-in (as the edge fixture
    ran it), and the same configuration is refused under MemoryDenyWriteExecute=yes, which the drop-in therefore
    leaves out (a router that refused to start it passed ``haproxy -c``, run outside the unit)."""
    haproxy = host_tool("haproxy", "haproxy")
    assert "req.body -m reg" in edge.config.read_text()
    denied = subprocess.run([haproxy, "-c", "-f", str(edge.config)], capture_output=True, text=True,
                            preexec_fn=deny_write_execute())
    assert denied.returncode != 0 and "jit compilation failed" in denied.stdout + denied.stderr, denied.stderr


def test_edge_files_haproxy_refuses_never_reach_the_edge_directory(tls_edge: Edge, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The deploy's install script (roles/router edge_install) on this host: the edge's candidate files are checked
    with the configuration by a real ``haproxy -c`` (the candidate directory mounted over the edge's, for the check
    alone), then moved into place with the configuration; a candidate HAProxy refuses (a certificate file cut
    short) leaves the edge directory and the configuration as they were, and the script fails."""
    candidates, installed = tmp_path / "candidates", tmp_path / "installed.cfg"
    monkeypatch.setattr(router_role, "EDGE_DIR", str(tls_edge.edge_dir))
    monkeypatch.setattr(router_role, "EDGE_CANDIDATE_DIR", str(candidates))
    monkeypatch.setattr(router_role, "CANDIDATE", str(tls_edge.config))
    monkeypatch.setattr(router_role, "CONFIG", str(installed))
    names = sorted(path.name for path in tls_edge.edge_dir.iterdir())
    before = {name: (tls_edge.edge_dir / name).read_bytes() for name in names}
    candidates.mkdir()
    for name in names:
        (candidates / name).write_bytes(before[name] if name != router_role.TLS_PEM else before[name][:200])
    script = router_role.edge_install(names, [])
    env = {**os.environ, "PATH": f"{Path(host_tool('haproxy', 'haproxy')).parent}:{os.environ['PATH']}"}
    refused = subprocess.run(["sh", "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert refused.returncode != 0
    assert {name: (tls_edge.edge_dir / name).read_bytes() for name in names} == before and not installed.exists()
    (candidates / "clients.map").write_text(before["clients.map"].decode() + "# rotated\n")
    (candidates / router_role.TLS_PEM).write_bytes(before[router_role.TLS_PEM])
    accepted = subprocess.run(["sh", "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert accepted.returncode == 0, accepted.stderr
    assert (tls_edge.edge_dir / "clients.map").read_text().endswith("# rotated\n")
    assert installed.read_text() == tls_edge.config.read_text()
