"""Every systemd unit gpufleet writes, rendered with hostile values that pass validation, accepted by
``systemd-analyze verify`` (Debian's ``systemd``) from a throwaway root with stub programs at the paths the units run
(systemd checks that they are executable) and stub targets for their dependencies; each ``ExecStart=`` reads back as
the literal argv. The units, the hostile values and the strict reader of systemd's rules: tests/unit/unit_files.py;
the throwaway root and the verification: tests/tools/systemd_verify.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest

import roles.router as router_role
from gpufleet import node_paths
from gpufleet.cli.inputs import fleet_facts
from gpufleet.inventory.load import load_fleet
from gpufleet.plan.planner import plan_fleet
from gpufleet.units import escape as systemd_text
from roles.vllm import ray_drop_in
from roles.vllm.replica_files import fabric_check
from tests.conftest import ROOT, host_tool
from tests.tools.systemd_verify import stub_root, verify_unit
from tests.unit.configs import host_config
from tests.unit.unit_files import HOSTILE, UNIT_CASES, Unit, exec_argv, ray_head_unit, unit_settings, vllm_service_unit


@pytest.mark.parametrize("address", ["10.0.0.5", "fd00::5"])
@pytest.mark.parametrize(("case", "make"), UNIT_CASES, ids=[c for c, _ in UNIT_CASES])
def test_units_pass_systemd_analyze_and_run_the_literal_argv(tmp_path: Path, case: str,
                                                             make: Callable[[str], Unit], address: str) -> None:
    unit = make(address)
    stub_root(tmp_path, [unit])
    instance_name = unit.name.replace("@.", f"@{unit.instance}.") if unit.instance else unit.name
    verify_unit(tmp_path, unit.drop_in_for or instance_name)
    for name in unit.extra:
        verify_unit(tmp_path, name)
    exec_starts = [value for section, key, value in unit_settings(unit.text) if key == "ExecStart" and value]
    assert len(exec_starts) == 1, exec_starts
    assert exec_argv(exec_starts[0], unit.instance, unit.env) == unit.argv


DEBIAN_HAPROXY_UNIT = Path("/lib/systemd/system/haproxy.service")


def test_the_router_drop_in_passes_systemd_analyze_on_debians_unit(tmp_path: Path) -> None:
    """Debian's haproxy.service (as the package installs it) with the router's drop-in: systemd accepts both."""
    host_tool("haproxy", "haproxy")
    assert DEBIAN_HAPROXY_UNIT.is_file(), "Debian's haproxy package is needed (scripts/install-lab-deps.sh)"
    cfg = host_config()
    drop_in = Unit(f"{router_role.DROP_IN.removeprefix(node_paths.SYSTEMD_DIR + '/')}", router_role.drop_in(cfg),
                   ["/usr/sbin/haproxy", "/bin/kill"], extra={"haproxy.service": DEBIAN_HAPROXY_UNIT.read_text()})
    stub_root(tmp_path, [drop_in])
    verify_unit(tmp_path, "haproxy.service")
    settings = {key: value for _, key, value in unit_settings(drop_in.text)}
    assert settings["User"] == "haproxy" and settings["LimitNOFILE"] == str(2 * cfg.router_max_connections + 1024)


@pytest.mark.parametrize("address", ["10.0.0.5", "fd00::5"])
def test_the_ray_drop_in_passes_systemd_analyze_with_its_units_and_runs_the_literal_wait(tmp_path: Path,
                                                                                        address: str) -> None:
    """vllm@<replica> with the Ray head's drop-in, beside the Ray head's unit it requires and is ordered after."""
    fleet = load_fleet(str(ROOT / "tests" / "data" / "plans" / "b_two_nodes_ray" / "inventory.py"))
    (replica,) = plan_fleet(fleet, fleet_facts(fleet, None)).replicas
    replica = dataclasses.replace(replica, name="pool-0")  # the replica vllm_service_unit and ray_head_unit render for
    head = dataclasses.replace(replica.roles[0], address=address)
    cfg = fleet.configs[head.host]
    text = ray_drop_in.drop_in(cfg, replica, head)
    assert text is not None
    vllm_unit, ray_unit = vllm_service_unit(address), ray_head_unit(address)
    assert ray_unit.name == node_paths.ray_unit(replica.name)
    drop_in = Unit(node_paths.vllm_ray_drop_in(replica.name).removeprefix(node_paths.SYSTEMD_DIR + "/"), text,
                   vllm_unit.programs)
    stub_root(tmp_path, [vllm_unit, ray_unit, drop_in])
    verify_unit(tmp_path, f"vllm@{replica.name}.service")
    (wait,) = [value for _, key, value in unit_settings(text) if key == "ExecStartPre"]
    assert exec_argv(wait, replica.name) == ray_drop_in.join_wait_argv(replica, head, cfg.ray_port,
                                                                       cfg.ray_ready_timeout, fabric_check(cfg))


def test_hostile_words_pass_systemd_analyze_and_read_back_literally(tmp_path: Path) -> None:
    """exec_line, where any free text would go: systemd accepts the line, and it splits into the same words."""
    argv = ["/usr/local/bin/program", *HOSTILE, "--flag=a b", "%i", ";", "rm", "-rf", "/"]  # no 2nd command
    line = systemd_text.exec_line(argv)
    unit = Unit("hostile@.service", f"[Unit]\nDescription={systemd_text.unit_value('100% $HOME')}\n"
                                    f"[Service]\nExecStart={line}\n", [argv[0]], instance="x")
    stub_root(tmp_path, [unit])
    verify_unit(tmp_path, "hostile@x.service")
    assert exec_argv(line, "x") == argv
