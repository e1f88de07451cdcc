"""Role keepalived without a node: the VRRP group from the inventory (gpufleet.plan.virtual_address), the
keepalived.conf it renders (cases: tests/data/keepalived/configs.yaml), its units, and the routers' HAProxy bind.

keepalived's own check of the configuration, the units under systemd-analyze and the address moving between two
keepalived processes: tests/tools/test_keepalived_role.py. Bad input: tests/data/corpus/vip.yaml.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from gpufleet_lab.tls import make_lab_tls

import gpufleet.inventory.load as gpufleet_inventory
import roles.keepalived as role
import roles.router as router_role
from gpufleet.cli.main import main
from gpufleet.config.inventory_shape import ROUTERS_GROUP
from gpufleet.node import router_health
from gpufleet.node_paths import ROUTER_HEALTH_STATE
from gpufleet.plan import virtual_address
from gpufleet.plan.virtual_address import VirtualAddress
from gpufleet.units.escape import exec_line
from gpufleet.values.problems import ConfigError
from tests.conftest import DATA
from tests.recorded_ops import Recorder
from tests.unit.configs import host_config
from tests.unit.unit_files import unit_settings

CASES = yaml.safe_load((DATA / "keepalived" / "configs.yaml").read_text())


def instance_settings(text: str) -> dict[str, list[str]]:
    """The vrrp_instance block of a keepalived.conf: each keyword with its words, each inner block with its lines."""
    settings: dict[str, list[str]] = {}
    block = None
    for raw in text[text.index("vrrp_instance"):].splitlines()[1:]:
        line = raw.split("#", 1)[0].strip()
        if line == "}":
            if block is None:
                break
            block = None
        elif line.endswith("{"):
            block = line.removesuffix("{").strip()
            settings[block] = []
        elif line and block is not None:
            settings[block].append(line)
        elif line:
            keyword, *words = line.split()
            settings[keyword] = words
    return settings


def unit_settings_of(text: str) -> dict[str, list[str]]:
    """A unit's settings by key, each value in order (an empty one resets)."""
    found: dict[str, list[str]] = {}
    for _, key, value in unit_settings(text):
        found.setdefault(key, []).append(value)
    return found


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_each_router_gets_its_part_of_the_group(case: dict[str, Any]) -> None:
    vip = VirtualAddress(case["address"], case.get("prefix", 24), case.get("router_id", 51),
                         tuple((host, address) for host, address in case["routers"]))
    text = role.render_config(role.config_values(vip, case["router"], case["interface"], case["password"]))
    assert instance_settings(text) == case["expect"]
    assert f"file {ROUTER_HEALTH_STATE}" in text and "weight 0 reverse" in text
    assert text.count(case["password"]) == 1  # in auth_pass only


@pytest.mark.parametrize("password", ["nine-char", "a b", "quo\"te", "has#hash", "bang!", "", "tab\tx", "é"])
def test_a_password_keepalived_cannot_hold_is_refused_unshown(password: str) -> None:
    vip = VirtualAddress("10.0.0.100", 24, 51, (("a", "10.0.0.1"), ("b", "10.0.0.2")))
    with pytest.raises(ConfigError) as raised:
        role.config_values(vip, "a", "eth0", password)
    line = raised.value.problems[0].line()
    assert line.startswith("controller: router_vrrp_password: expected 1 to 8 printable ASCII")
    assert not password or password not in line


def test_the_group_follows_the_routers_order() -> None:
    configs = {name: host_config(fleet_address=address, router_virtual_address="10.0.0.100",
                                 router_virtual_router_id=7, router_virtual_prefix=16)
               for name, address in (("r-b", "10.0.1.2"), ("r-a", "10.0.0.1"), ("gpu", "10.0.5.5"))}
    vip = virtual_address.group(["r-b", "r-a"], configs)
    assert vip is not None and vip.routers == (("r-b", "10.0.1.2"), ("r-a", "10.0.0.1"))
    assert (vip.priority("r-b"), vip.priority("r-a")) == (250, 249)
    assert vip.peers("r-a") == ["10.0.1.2"] and vip.endpoint(8080) == "10.0.0.100:8080"
    assert (vip.router_id, vip.prefix, str(vip.network)) == (7, 16, "10.0.0.0/16")
    assert virtual_address.group(["r-b"], configs) is None  # one router: no group
    plain = {name: cfg.model_copy(update={"router_virtual_address": None}) for name, cfg in configs.items()}
    assert virtual_address.group(["r-b", "r-a"], plain) is None
    assert virtual_address.routers_of([("pool", ["gpu"]), (ROUTERS_GROUP, ["r-b", "r-a"])]) == ["r-b", "r-a"]


def test_keepalived_runs_vrrp_only_as_its_account_with_the_network_capabilities_only() -> None:
    vip = VirtualAddress("10.0.0.100", 24, 51, (("a", "10.0.0.1"), ("b", "10.0.0.2"), ("c", "10.0.0.3")))
    settings = unit_settings_of(role.drop_in(vip, "b"))
    assert settings["ExecStart"] == ["", exec_line(role.exec_argv())]
    assert "--vrrp" in role.exec_argv() and "--use-file=/etc/keepalived/keepalived.conf" in role.exec_argv()
    assert settings["User"] == ["keepalived"] and settings["EnvironmentFile"] == [""]
    # not Debian's Type=notify: behind ProtectProc=invisible keepalived never sees systemd as its parent, never
    # says READY, and every start timed out (found on the lab)
    assert settings["Type"] == ["exec"] and settings["ProtectProc"] == ["invisible"]
    caps = "CAP_NET_ADMIN CAP_NET_RAW CAP_NET_BROADCAST"
    assert settings["CapabilityBoundingSet"] == [caps] and settings["AmbientCapabilities"] == [caps]
    assert settings["RestrictAddressFamilies"] == ["AF_UNIX AF_INET AF_INET6 AF_NETLINK AF_PACKET"]
    assert settings["IPAddressAllow"] == ["localhost 10.0.0.1/32 10.0.0.2/32 10.0.0.3/32"]
    assert settings["Wants"] == settings["After"] == ["gpufleet-router-health.service"]


def test_the_check_asks_haproxy_on_the_routers_own_address_only() -> None:
    cfg = host_config(router_metrics_port=8405)
    settings = unit_settings_of(role.health_unit(cfg, "10.0.0.2"))
    assert settings["ExecStart"] == [exec_line(role.health_argv(cfg, "10.0.0.2"))]
    assert role.health_argv(cfg, "10.0.0.2")[3:] == ["--url", "http://10.0.0.2:8405/health",
                                                     "--state", ROUTER_HEALTH_STATE]
    assert settings["User"] == ["gpufleet-router-health"] and settings["CapabilityBoundingSet"] == [""]
    assert settings["IPAddressAllow"] == ["localhost 10.0.0.2/32"]
    assert settings["RuntimeDirectory"] == ["gpufleet-router-health"]


@pytest.mark.parametrize(("values", "expected"), [
    ({}, None),
    ({"router_virtual_address": "10.0.0.100"}, "10.0.0.100:8080"),
    ({"router_virtual_address": "10.0.0.100", "router_listen_address": "0.0.0.0"}, None),  # every address already
    ({"router_virtual_address": "10.0.0.100", "router_listen_address": "10.0.0.1"}, "10.0.0.100:8080"),
])
def test_haproxy_binds_the_virtual_address_on_every_router(values: dict[str, Any], expected: str | None) -> None:
    cfg = host_config(router_port=8080, **values)
    assert router_role.virtual_listen(cfg) == expected
    text = router_role.render(router_role.config_values(cfg, "10.0.0.1", [], [], [], {}))
    binds = [line.strip() for line in text.splitlines() if line.strip().startswith("bind ")]
    assert binds == [f"bind {router_role.host_port(values.get('router_listen_address') or '10.0.0.1', 8080)}",
                     *([f"bind {expected} transparent"] if expected else []), "bind 10.0.0.1:8405"]


@pytest.mark.parametrize("tls", [False, True])
def test_gpufleet_plan_prints_the_virtual_address_as_the_endpoint(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                                 tls: bool) -> None:
    """With TLS on router_port, clients reach the address over HTTPS, and the line says so."""
    fleet = str(DATA / "rollout_fleet" / "inventory.py")  # two routers, 10.40.9.1 and 10.40.9.2
    monkeypatch.setattr(gpufleet_inventory, "_DATA_OVERRIDE", None)  # the command's --data goes with the test
    monkeypatch.setenv("GPUFLEET_TEST_VRRP", "s3cret-8")
    plain = CliRunner().invoke(main, ["plan", fleet], catch_exceptions=False)
    assert plain.exit_code == 0 and "endpoint:" not in plain.output
    data = ["router_virtual_address=10.40.9.100", 'router_vrrp_password={"env": "GPUFLEET_TEST_VRRP"}']
    if tls:
        made = make_lab_tls(tmp_path / "tls", ["10.40.9.100"])  # a throwaway CA and key, made now
        data += [f'router_tls_certificate={{"file": "{made.certificate}"}}',
                 f'router_tls_key={{"file": "{made.key}"}}']
    done = CliRunner().invoke(main, ["plan", fleet, *(a for d in data for a in ("--data", d))],
                              catch_exceptions=False)
    assert done.exit_code == 0, done.output
    assert done.output.splitlines()[-1] == (
        f"endpoint: {'https' if tls else 'http'}://10.40.9.100:8080 (router_virtual_address: one of the routers"
        " router1.dc1.example.net, router2.dc1.example.net at a time, moved by keepalived)")


# --- the role's operations, recorded ------------------------------------------------------------------------------

GROUP = VirtualAddress("10.0.0.100", 24, 51, (("r1", "10.0.0.1"), ("r2", "10.0.0.2")))
PASSWORD = "s3cret-8"


def _run_role(monkeypatch: pytest.MonkeyPatch, host: str, vip: VirtualAddress | None,
              drop_in_there: bool = False) -> Recorder:
    recorder = Recorder()
    for name in ("apt", "files", "server", "systemd"):
        monkeypatch.setattr(role, name, recorder.module(name))
    paths = {role.DROP_IN: {"type": "file" if drop_in_there else "missing"}}
    monkeypatch.setattr(role, "node", SimpleNamespace(observe=recorder.module("node").observe,
                                                      path=lambda path: paths.get(path, {"type": "missing"})))
    monkeypatch.setattr(role, "fleet_group", lambda: vip)
    monkeypatch.setattr(role, "host", SimpleNamespace(name=host, get_fact=lambda fact, address: "bond0"))
    monkeypatch.setattr(role, "host_config", lambda *_: host_config(
        router_virtual_address="10.0.0.100", router_vrrp_password={"env": "GPUFLEET_TEST_VRRP"}))
    monkeypatch.setenv("GPUFLEET_TEST_VRRP", PASSWORD)
    role.keepalived.__wrapped__()  # type: ignore[attr-defined]
    return recorder



def test_a_router_gets_a_checked_configuration_the_password_in_it_only(monkeypatch: pytest.MonkeyPatch) -> None:
    ops = _run_role(monkeypatch, "r2", GROUP)
    position = {id(c): i for i, c in enumerate(ops.calls)}
    assert ops.calls[0].op == "node.observe"
    (installed,) = ops.named("apt.packages", packages=["keepalived"])
    (candidate,) = ops.named("files.secret_file")
    wanted = role.render_config(role.config_values(GROUP, "r2", "bond0", PASSWORD))
    assert candidate.kwargs == {"name": candidate.kwargs["name"], "dest": role.CANDIDATE, "content": wanted,
                                "mode": "0640", "group": "keepalived"}
    (check,) = ops.named("server.script")
    script = check.kwargs["script"]
    assert script.index("/usr/sbin/keepalived -t -f /etc/keepalived/gpufleet-candidate.conf") < script.index(
        "install -o root -g keepalived -m 0640") < script.index("mv -fT")
    assert check.kwargs["done_file"] == role.CONFIG
    assert check.kwargs["done_sha256"] == hashlib.sha256(wanted.encode()).hexdigest()
    accounts = [c.kwargs["user"] for c in ops.named("server.system_account")]
    assert accounts == ["keepalived", "gpufleet-router-health"]
    assert position[id(installed)] < position[id(candidate)] < position[id(check)]
    (health,) = ops.named("systemd.service", unit="gpufleet-router-health.service")
    (running,) = ops.named("systemd.service", unit="keepalived.service")
    assert position[id(health)] < position[id(running)] and running.kwargs["running"] and running.kwargs["enabled"]
    (drop_in,) = ops.named("files.file", dest=role.DROP_IN)
    (restart,) = ops.named("systemd.restart", unit="keepalived.service")
    (reload,) = ops.named("systemd.reload", unit="keepalived.service")
    assert not restart.kwargs["_if"]() and not reload.kwargs["_if"]()
    check.changed = True
    assert reload.kwargs["_if"]() and not restart.kwargs["_if"]()  # the address stays where it is
    drop_in.changed = True
    assert restart.kwargs["_if"]()
    shown = repr([(c.op, {k: v for k, v in c.kwargs.items() if c.op != "files.secret_file" or k != "content"})
                  for c in ops.calls])
    assert PASSWORD not in shown  # only the secret file's content holds it


@pytest.mark.parametrize(("host", "vip"), [("gpu-1", GROUP), ("r1", None)])
def test_a_host_without_the_address_retires_what_gpufleet_set_up(monkeypatch: pytest.MonkeyPatch, host: str,
                                                                 vip: VirtualAddress | None) -> None:
    ops = _run_role(monkeypatch, host, vip, drop_in_there=True)
    assert not ops.named("apt.packages") and not ops.named("files.secret_file")
    stops = ops.named("systemd.service")
    assert {c.kwargs["unit"] for c in stops} == {"keepalived.service", "gpufleet-router-health.service"}
    assert all(c.kwargs["running"] is False and c.kwargs["enabled"] is False and c.kwargs["_if"]() for c in stops)
    removed = [c.kwargs["path"] for c in ops.named("files.absent")]
    assert removed == [role.CONFIG, role.CANDIDATE, role.HEALTH_UNIT, role.DROP_IN]  # the marker last


def test_a_keepalived_gpufleet_did_not_set_up_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    ops = _run_role(monkeypatch, "gpu-1", None, drop_in_there=False)
    guarded = [c for c in ops.calls if c.op in ("systemd.service", "files.absent") and c.kwargs["path" if
               c.op == "files.absent" else "unit"] != role.DROP_IN]
    assert guarded and all(not c.kwargs["_if"]() for c in guarded)


@pytest.mark.parametrize(("values", "fact", "expected"), [
    ({"router_virtual_interface": "vip0", "fleet_interface": "bond0"}, "eth0", "vip0"),
    ({"fleet_interface": "bond0"}, "eth0", "bond0"),
    ({}, "eth0", "eth0"),
])
def test_the_interface_is_the_given_one_else_the_one_holding_the_routers_address(
        monkeypatch: pytest.MonkeyPatch, values: dict[str, str], fact: str, expected: str) -> None:
    asked: list[str] = []
    monkeypatch.setattr(role, "host", SimpleNamespace(name="r1", get_fact=lambda f, address: asked.append(address)
                                                      or fact))
    assert role.interface(host_config(**values), "10.0.0.1") == expected
    assert asked == ([] if values else ["10.0.0.1"])


def test_no_interface_holding_the_address_exits_2_before_any_change(monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(role, "host", SimpleNamespace(name="r1", get_fact=lambda f, address: None))
    with pytest.raises(SystemExit) as raised:
        role.interface(host_config(), "10.0.0.1")
    assert raised.value.code == 2
    assert capsys.readouterr().err == ("r1: router_virtual_interface: expected an interface that holds the router's"
                                       " address 10.0.0.1, found none on the router; set router_virtual_interface\n")


@pytest.mark.parametrize(("values", "restart_sec"), [
    ({}, None),
    ({"router_virtual_address": "10.0.0.100"}, f"{2 * router_health.INTERVAL_S}s"),
])
def test_behind_the_address_a_dead_haproxy_stays_down_for_two_health_checks(values: dict[str, Any],
                                                                              restart_sec: str | None) -> None:
    """A HAProxy that died is started again after two of router_health.py's intervals when a virtual address is in
    use (its check then sees nothing listening and the address moves), at Debian's pace without one."""
    found = [value for _, key, value in unit_settings(router_role.drop_in(host_config(**values)))
             if key == "RestartSec"]
    assert found == ([restart_sec] if restart_sec else [])
