"""The router's edge without a node: the map files from router_clients, what the configuration holds with and
without clients or TLS, the fleet-wide checks of the keys (never shown), the lab CA's names. HAProxy running
them: tests/tools/test_router_edge.py."""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import SimpleNamespace

import pytest
from gpufleet_lab.errors import LabError
from gpufleet_lab.tls import subject_alt_names

import roles.router as router_role
from gpufleet import node_paths, templates
from gpufleet.config import secrets
from gpufleet.config.edge import client_keys, edge_problems
from gpufleet.config.layers import HostLayers, Layer
from gpufleet.plan import backends as plan_backends
from gpufleet.values.problems import ConfigError
from roles.router import peers
from tests.recorded_ops import Recorder
from tests.unit.configs import host_config
from tests.unit.unit_files import unit_settings

OPEN, CLOSED = "model open", "model-closed"
ROUTERS = ("10.0.0.5", "10.0.0.6")
FOUND = [plan_backends.Backend("model-a", OPEN, ()), plan_backends.Backend("model-b", CLOSED, ())]


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _entries(text: str) -> list[str]:
    return [line for line in text.splitlines() if not line.startswith("#")]


def test_the_maps_hold_hashes_grants_limits_and_the_replicas_key() -> None:
    cfg = host_config(router_clients={
        "alice": {"api_key": {"env": "A"}},
        "bob": {"api_key": {"env": "B"}, "models": [OPEN], "requests_per_s": 5, "concurrent_requests": 2}})
    maps = router_role.edge_maps(cfg.router_clients, {"alice": "alice-key", "bob": "bob-key"}, FOUND,
                                 {OPEN: "replica-key", CLOSED: None})
    assert _entries(maps["clients"]) == [f"{_sha('Bearer alice-key')} alice", f"{_sha('Bearer bob-key')} bob"]
    assert sorted(_entries(maps["grants"])) == sorted([f"alice/{_sha(OPEN)} 1", f"alice/{_sha(CLOSED)} 1",
                                                       f"bob/{_sha(OPEN)} 1"])
    assert _entries(maps["rates"]) == ["bob 5"] and _entries(maps["concurrency"]) == ["bob 2"]
    assert _entries(maps["upstream"]) == [f"{_sha(OPEN)} Bearer replica-key"]  # CLOSED's replicas take no key
    assert _entries(maps["models"])[1] == 'bob {"object":"list","data":[{"id":"model open","object":"model",' \
                                          '"owned_by":"gpufleet"}]}'
    assert not any("alice-key" in text or "bob-key" in text for text in maps.values())


def test_without_clients_or_tls_the_configuration_is_todays() -> None:
    values = router_role.config_values(host_config(), "10.0.0.5", FOUND, router_role.model_lists({None: [OPEN]}), [],
                                       {})
    text = router_role.render(values)
    assert values["edge"] is None and values["tls_pem"] is None and values["plain_listen"] is None
    for absent in ("gpufleet-edge", "track-sc0", " ssl ", "del-header authorization", "gpufleet-clients"):
        assert absent not in text


def test_with_clients_and_tls_the_configuration_names_files_and_holds_no_client() -> None:
    cfg = host_config(router_clients={"alice": {"api_key": {"env": "A"}}}, router_tls_certificate={"file": "c.pem"},
                      router_tls_key={"file": "k.pem"}, router_plain_http_port=8081)
    text = router_role.render(router_role.config_values(cfg, "10.0.0.5", FOUND, [], [], {}))
    assert "bind 10.0.0.5:8080 ssl crt /etc/haproxy/gpufleet-edge/router.pem" in text
    assert "bind 10.0.0.5:8081\n" in text
    assert "map_str(/etc/haproxy/gpufleet-edge/clients.map)" in text
    assert "alice" not in text  # adding, removing or rotating a client changes only the maps


def test_the_clients_counters_reach_the_runtime_api_through_haproxys_group() -> None:
    """The counters' service is root with no capability (its sandbox): it cannot pass the owner of a 0600 socket,
    so the socket is 0660 for HAProxy's group, which the service joins (the lab found every run refused)."""
    text = router_role.render(router_role.config_values(host_config(), "10.0.0.5", FOUND, [], [], {}))
    # no "group": HAProxy runs as its account, which may not chown, and the reload that asked it failed
    assert f"stats socket {node_paths.ROUTER_ADMIN_SOCKET} mode 660 level admin\n" in text
    values = router_role.clients_service_values(host_config())
    service = templates.render("router/gpufleet-router-clients.service.j2", **values)
    settings = [(key, value) for _, key, value in unit_settings(service)]
    assert ("SupplementaryGroups", "haproxy") in settings and ("CapabilityBoundingSet", "") in settings
    assert not any(key == "User" for key, _ in settings)


def test_with_a_client_with_a_token_budget_the_counters_take_the_token_ledgers_too() -> None:
    metered = {"api_key": {"env": "ALICE_KEY"}, "tokens_per_day": 10**6}
    assert "--ledger" not in str(router_role.clients_service_values(host_config())["exec_start"])
    values = router_role.clients_service_values(host_config(router_clients={"alice": metered}))
    assert str(values["exec_start"]).endswith(" --ledger 8407")


def test_two_clients_with_one_key_from_two_references_are_refused_without_showing_it(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    key = "shared-key-0123456789abcdef"
    monkeypatch.setenv("ALICE_KEY", key)
    (tmp_path / "bob.key").write_text(key + "\n")
    clients = {"alice": {"api_key": {"env": "ALICE_KEY"}}, "bob": {"api_key": {"file": str(tmp_path / "bob.key")}}}
    cfg = host_config(router_clients=clients)
    layers = {"h": HostLayers("h", [Layer("group_vars/routers.yml", {"router_clients": clients})])}
    problems = edge_problems(layers, [], {"h": cfg}, routers=["h"])  # a router that serves nothing
    assert [p.line() for p in problems] == [
        "group_vars/routers.yml: router_clients.bob.api_key: expected a key of its own per client, found client"
        " alice's key (not shown) (host h)"]
    with pytest.raises(ConfigError) as raised:
        client_keys(cfg)
    assert key not in str(raised.value)
    monkeypatch.setenv("ALICE_KEY", "alice-own-key-0123456789")
    secrets.forget()  # the next run reads the changed key (a run keeps the value it first read)
    assert client_keys(cfg) == {"alice": "alice-own-key-0123456789", "bob": key}


def test_a_client_model_must_be_served_by_a_pool_not_by_a_router_only_host() -> None:
    clients = {"alice": {"api_key": {"env": "A"}, "models": [CLOSED]}}
    cfg = host_config(router_clients=clients)
    served = host_config(vllm_served_model_name=CLOSED)
    layers = {h: HostLayers(h, [Layer("group_vars/all.yml", {"router_clients": clients})]) for h in ("gpu", "r")}
    router_only = host_config(router_clients=clients, vllm_served_model_name=CLOSED)
    found = edge_problems(layers, ["gpu"], {"gpu": served, "r": router_only})
    assert all("models" not in p.key for p in found)  # served by the pool of "gpu"
    found = edge_problems(layers, ["gpu"], {"gpu": host_config(vllm_served_model_name=OPEN), "r": cfg})
    assert [p.key for p in found if "models" in p.key] == ["router_clients.alice.models[0]"]


@pytest.mark.parametrize(("names", "expected"), [
    (["10.213.0.11", "fd00::1", "lab1"], "IP:10.213.0.11,IP:fd00::1,DNS:lab1"),
    (["router.example.org"], "DNS:router.example.org"),
])
def test_the_lab_certificate_names_every_router(names: list[str], expected: str) -> None:
    assert subject_alt_names(names) == expected


@pytest.mark.parametrize("names", [[], ["a,b"], ["-lab"], ["lab one"]])
def test_the_lab_ca_refuses_what_is_no_address_or_name(names: list[str]) -> None:
    with pytest.raises(LabError):
        subject_alt_names(names)


def _run_role(monkeypatch: pytest.MonkeyPatch, cfg: object, written: dict[str, str],
              in_place: bool = True) -> Recorder:
    """The role's operations for ``cfg`` with the edge files ``written``; ``in_place``: whether the node's edge
    directory held them already as the deploy began."""
    recorder = Recorder()
    for name in ("apt", "files", "node", "server", "shared_secrets", "systemd"):
        monkeypatch.setattr(router_role, name, recorder.module(name))
    monkeypatch.setattr(router_role, "is_router", lambda: True)
    monkeypatch.setattr(router_role, "fleet_routers", lambda: list(ROUTERS))
    shared = SimpleNamespace(shared_secrets_seen={}, shared_secrets={})
    monkeypatch.setattr(router_role, "context", lambda: shared)
    monkeypatch.setattr(router_role, "host_config", lambda *_: cfg)
    monkeypatch.setattr(router_role, "fleet_values",
                        lambda c, a: router_role.config_values(c, a, FOUND, [], [], {}))
    monkeypatch.setattr(router_role, "fleet_edge_files", lambda *_: written)
    monkeypatch.setattr(router_role, "_edge_in_place", lambda wanted: in_place)
    monkeypatch.setattr(router_role, "_stale_edge_files", lambda wanted: [])
    router_role.router.__wrapped__()  # type: ignore[attr-defined]
    return recorder


def test_the_deploy_writes_the_edge_files_as_candidates_checks_them_with_the_config_and_a_rotation_reloads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = host_config(fleet_address="10.0.0.5", router_clients={"alice": {"api_key": {"env": "A"}}})
    written = {"clients.map": "x alice\n", "upstream.map": "y Bearer replica-key\n"}
    ops = _run_role(monkeypatch, cfg, written)
    position = {id(c): i for i, c in enumerate(ops.calls)}
    secrets = ops.named("files.secret_file")
    assert {c.kwargs["dest"]: c.kwargs["content"] for c in secrets} == {
        f"{router_role.EDGE_CANDIDATE_DIR}/{name}": text for name, text in written.items()}
    assert all((c.kwargs["group"], c.kwargs["mode"]) == ("haproxy", "0640") for c in secrets)
    for folder in (router_role.EDGE_DIR, router_role.EDGE_CANDIDATE_DIR):
        (directory,) = ops.named("files.directory", path=folder)
        assert (directory.kwargs["group"], directory.kwargs["mode"]) == ("haproxy", "0750")
    assert not any("replica-key" in repr(c.kwargs) for c in ops.calls if c not in secrets)
    (install,) = ops.named("server.script")
    assert install.kwargs["script"] == router_role.edge_install(sorted(written), [])
    assert (install.kwargs["done_file"], install.kwargs["pending"]) == (router_role.CONFIG, False)
    (reload,) = ops.named("systemd.reload", unit=router_role.SERVICE)
    (restart,) = ops.named("systemd.restart", unit=router_role.SERVICE)
    assert max(position[id(c)] for c in secrets) < position[id(install)] < position[id(reload)]
    assert not reload.kwargs["_if"]()
    install.changed = True  # a key added, removed or rotated: checked, put in place and reloaded, never restarted
    assert reload.kwargs["_if"]() and not restart.kwargs["_if"]()
    (timer,) = ops.named("systemd.service", unit=router_role.CLIENTS_TIMER)
    assert (timer.kwargs["running"], timer.kwargs["enabled"]) == (True, True)
    (rotated,) = _run_role(monkeypatch, cfg, written, in_place=False).named("server.script")
    assert rotated.kwargs["pending"]  # the edge directory differs: installed though the configuration did not


def test_every_router_reads_the_peer_certificate_before_any_keeps_it_and_a_new_one_reloads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The routers' peer certificate (roles.router.peers): its digest read, then kept or drawn for every router of
    the group (root:haproxy, 0640, drawn by the peers module), both before the configuration that names it is
    checked; a new one reloads HAProxy, as a new configuration does."""
    ops = _run_role(monkeypatch, host_config(fleet_address="10.0.0.5"), {})
    position = {id(c): i for i, c in enumerate(ops.calls)}
    (seen,) = ops.named("shared_secrets.seen", path=peers.PEM)
    (kept,) = ops.named("shared_secrets.kept", path=peers.PEM)
    (install,) = ops.named("server.script")
    assert position[id(seen)] < position[id(kept)] < position[id(install)]
    assert kept.kwargs["found"] is seen.kwargs["found"] and kept.kwargs["holders"] == list(ROUTERS)
    assert (kept.kwargs["group"], kept.kwargs["mode"], kept.kwargs["draw"]) == ("haproxy", "0640", peers.draw_pem)
    (reload,) = ops.named("systemd.reload", unit=router_role.SERVICE)
    assert not reload.kwargs["_if"]()
    kept.changed = True
    assert reload.kwargs["_if"]()


def test_without_clients_or_tls_the_deploy_removes_the_edge_and_its_counters(
        monkeypatch: pytest.MonkeyPatch) -> None:
    ops = _run_role(monkeypatch, host_config(fleet_address="10.0.0.5"), {})
    assert ops.named("files.secret_file") == []
    assert ops.named("files.absent", path=router_role.EDGE_CANDIDATE_DIR)
    (install,) = ops.named("server.script")
    assert install.kwargs["script"].endswith(f"rm -rf -- {router_role.EDGE_DIR}")  # once the config no longer uses it
    assert ops.named("files.absent", path=router_role.CLIENTS_TEXTFILE)
    (timer,) = ops.named("systemd.service", unit=router_role.CLIENTS_TIMER)
    assert (timer.kwargs["running"], timer.kwargs["enabled"]) == (False, False)
