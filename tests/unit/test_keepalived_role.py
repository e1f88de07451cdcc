"""Role keepalived without a node: the VRRP group from the inventory (gpufleet.plan.virtual_address), the
keepalived.conf it renders (cases: tests/data/keepalived/configs.yaml), its units, and the routers' HAProxy bind.

keepalived's own check of the configuration, the units under systemd-analyze and the address moving between two
keepalived processes: tests/tools/test_keepalived_role.py. Bad input: tests/data/corpus/vip.yaml.
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml

import roles.keepalived as role
import roles.router as router_role
from gpufleet.config.problems import ConfigError
from gpufleet.deploy.access import ROUTERS_GROUP
from gpufleet.node_paths import ROUTER_HEALTH_STATE
from gpufleet.plan import virtual_address
from gpufleet.plan.virtual_address import VirtualAddress
from gpufleet.systemd_text import exec_line
from tests.conftest import DATA
from tests.unit.test_hostile_templates import unit_settings
from tests.unit.test_vllm_role import _config

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
    configs = {name: _config(fleet_address=address, router_virtual_address="10.0.0.100",
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
    caps = "CAP_NET_ADMIN CAP_NET_RAW CAP_NET_BROADCAST"
    assert settings["CapabilityBoundingSet"] == [caps] and settings["AmbientCapabilities"] == [caps]
    assert settings["RestrictAddressFamilies"] == ["AF_UNIX AF_INET AF_INET6 AF_NETLINK AF_PACKET"]
    assert settings["IPAddressAllow"] == ["localhost 10.0.0.1/32 10.0.0.2/32 10.0.0.3/32"]
    assert settings["Wants"] == settings["After"] == ["gpufleet-router-health.service"]


def test_the_check_asks_haproxy_on_the_routers_own_address_only() -> None:
    cfg = _config(router_metrics_port=8405)
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
    cfg = _config(router_port=8080, **values)
    assert router_role.virtual_listen(cfg) == expected
    text = router_role.render(router_role.config_values(cfg, "10.0.0.1", [], [], [], {}))
    binds = [line.strip() for line in text.splitlines() if line.strip().startswith("bind ")]
    assert binds == [f"bind {router_role.host_port(values.get('router_listen_address') or '10.0.0.1', 8080)}",
                     *([f"bind {expected} transparent"] if expected else []), "bind 10.0.0.1:8405"]
