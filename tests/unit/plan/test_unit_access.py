"""Who may connect to gpufleet's units (gpufleet.plan.access), without a node.

The allow lists are computed from the config and the plan's addresses; every unit template, rendered as the
roles render it, filters by IP. How exposed each unit is, rated by ``systemd-analyze security --offline`` on this
machine (``bench/unit_security.py --offline``; without ``--offline`` it rates the lab's deployed units):
tests/tools/test_unit_access.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pyinfra.api import Inventory

from gpufleet.plan import access
from gpufleet.values.problems import ConfigError
from tests.unit.configs import https_host_config
from tests.unit.unit_security_bench import bench


def test_exporters_admit_the_node_and_the_monitoring_hosts() -> None:
    cfg = https_host_config(monitoring_addresses=["10.9.0.0/24", "10.9.0.7"])
    assert access.exporter_sources(cfg, "10.0.0.5", ["10.8.0.2"]) == [
        "10.0.0.5/32", "10.8.0.2/32", "10.9.0.0/24", "10.9.0.7/32"]
    assert access.exporter_sources(https_host_config(), "10.0.0.5") == ["10.0.0.5/32"]  # no monitoring: the node alone


def test_ray_admits_its_replicas_nodes_and_the_monitoring_hosts_only() -> None:
    cfg = https_host_config(monitoring_addresses=["10.9.0.1"], vllm_api_allowed_from=["0.0.0.0/0"])
    assert access.ray_sources(cfg, ["10.0.0.6", "10.0.0.5"]) == ["10.0.0.5/32", "10.0.0.6/32", "10.9.0.1/32"]


def test_vllm_is_open_until_allowed_from_is_set_or_routers_exist() -> None:
    assert access.vllm_sources(https_host_config(), "10.0.0.5", ["10.0.0.5", "10.0.0.6"]) is None
    # with routers, clients go through them: the replica admits its nodes, monitoring and the routers only
    cfg = https_host_config(monitoring_addresses=["10.9.0.1"])
    assert access.vllm_sources(cfg, "10.0.0.5", ["10.0.0.5", "10.0.0.6"], routers=["10.8.0.2"]) == [
        "10.0.0.5/32", "10.0.0.6/32", "10.8.0.2/32", "10.9.0.1/32"]
    cfg = https_host_config(monitoring_addresses=["10.9.0.1"], vllm_api_allowed_from=["192.168.7.0/24", "fd00::/64"])
    assert access.vllm_sources(cfg, "10.0.0.5", ["10.0.0.5", "10.0.0.6"]) == [
        "10.0.0.5/32", "10.0.0.6/32", "10.9.0.1/32", "192.168.7.0/24", "fd00::/64"]


def test_unit_lines_deny_everything_else() -> None:
    assert access.unit_lines(None) == ""
    lines = [line for line in access.unit_lines(["10.0.0.5/32"]).splitlines() if not line.startswith("#")]
    assert lines == ["IPAddressDeny=any", "IPAddressAllow=localhost 10.0.0.5/32"]


def test_a_host_name_cannot_be_filtered_on() -> None:
    with pytest.raises(ConfigError) as raised:
        access.exporter_sources(https_host_config(), "gpu-a01.dc1.example.net")
    assert "give the node a fleet_address" in raised.value.problems[0].line()


def test_the_monitoring_group_is_read_from_the_inventory() -> None:
    hosts = [("prom1", {"fleet_address": "10.9.0.3"}), ("10.9.0.4", {}), ("10.0.0.5", {})]
    inventory = Inventory((hosts, {}), monitoring=(hosts[:2], {}), pool=(hosts[2:], {}))
    assert access.group_addresses(inventory) == ["10.9.0.3", "10.9.0.4"]
    assert access.group_addresses(Inventory((hosts[2:], {}), pool=(hosts[2:], {}))) == []
    with pytest.raises(ConfigError):
        access.group_addresses(Inventory(([("prom.example.net", {})], {}), monitoring=(["prom.example.net"], {})))


# --- every unit gpufleet writes, as bench/unit_security.py renders it ----------------------------------------

def test_every_unit_gpufleet_writes_is_rendered_with_an_ip_filter() -> None:
    units = bench.rendered_units()
    names = {Path(path).name for path in units}
    assert {"vllm@pool-0.service", "gpufleet-ray-head-0.service", "gpufleet-ray-worker-0.service",
            "node_exporter.service", "gpufleet.conf", "dcgm-exporter.service", "gpufleet-alert-log.service"} <= names
    for path, text in units.items():
        assert "IPAddressDeny=any" in text.splitlines(), path
