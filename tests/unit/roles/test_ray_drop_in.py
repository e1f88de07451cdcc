"""Ray replicas after a reboot of every node: the drop-in that orders a Ray head's vLLM after its Ray cluster
(templates/vllm/ray.conf.j2, :mod:`roles.vllm.ray_drop_in`), the Ray units' own retry, and the vllm role
writing the drop-in.

Every golden plan shape (``tests/data/plans/``) is rendered for every node of every replica: only a Ray head gets the
drop-in; ``tests/data/ray_drop_in/b_two_nodes_ray.conf`` is the text the Ray shape of docs/guide/deploy-shapes.md
writes.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import pytest

import roles.ray as ray_role
import roles.vllm as vllm_role
from gpufleet import node_paths, templates
from gpufleet.config.schema import HostConfig
from gpufleet.plan import access
from gpufleet.plan.commands import NodeRole, ray_start_argv
from gpufleet.plan.planner import Replica
from gpufleet.run.context import DeployContext
from gpufleet.units.escape import exec_line
from roles.vllm import ray_drop_in
from roles.vllm import replica_files as vf
from tests.conftest import DATA
from tests.recorded_ops import Recorder
from tests.unit.unit_files import exec_argv, unit_settings
from tests.unit.vllm_role_run import planned_shape

SHAPES = sorted(path.parent.name for path in (DATA / "plans").glob("*/inventory.py"))
RAY_SHAPE = "b_two_nodes_ray"


def _settings(text: str) -> dict[tuple[str, str], list[str]]:
    found: dict[tuple[str, str], list[str]] = {}
    for section, key, value in unit_settings(text):
        found.setdefault((section, key), []).append(value)
    return found


def _ray_head(shape: str = RAY_SHAPE) -> tuple[HostConfig, Replica, NodeRole]:
    fleet, replicas = planned_shape(shape)
    replica = replicas[0]
    return fleet.configs[replica.roles[0].host], replica, replica.roles[0]


# --- the drop-in: only on a Ray head, ordering, binding, the join wait ------------------------------------------

@pytest.mark.parametrize("shape", SHAPES)
def test_only_a_ray_head_gets_the_drop_in(shape: str) -> None:
    fleet, replicas = planned_shape(shape)
    for replica in replicas:
        for role in replica.roles:
            text = ray_drop_in.drop_in(fleet.configs[role.host], replica, role)
            assert (text is not None) is (role.role == "ray-head"), (replica.name, role.host, role.role)
            if text is None:
                continue
            settings = _settings(text)
            cfg = fleet.configs[role.host]
            unit = node_paths.ray_unit(replica.name)
            assert settings[("Unit", "After")] == [unit] and settings[("Unit", "Requires")] == [unit]
            assert ("Unit", "BindsTo") not in settings
            (pre,) = settings[("Service", "ExecStartPre")]
            venv = f"{node_paths.replica_dir(replica.name)}/venv/bin"
            fabric = ["--fabric-port", str(cfg.node_fabric_port), "--fabric-backend",
                      "gloo" if cfg.vllm_platform == "cpu" else "nccl", "--fabric-bytes", str(vf.FABRIC_BYTES),
                      "--fabric-floor-gbps", str(cfg.node_fabric_floor_gbps), "--fabric-timeout",
                      str(cfg.node_fabric_timeout_s), *(["--fabric-iface", cfg.fleet_interface]
                                                        if cfg.fleet_interface else [])]
            assert exec_argv(pre) == [f"{venv}/python", node_paths.node_tool("ray_join_wait.py"), "--ray",
                                      f"{venv}/ray", "--address", f"{role.address}:{cfg.ray_port}",
                                      "--nodes", str(len(replica.roles)), "--timeout", str(cfg.ray_ready_timeout),
                                      *(fabric if cfg.node_lifecycle_enabled and cfg.node_fabric_check else [])]
            assert settings[("Service", "TimeoutStartSec")] == [str(cfg.ray_ready_timeout + ray_drop_in.GATE_S)]
            assert set(settings) == {("Unit", "After"), ("Unit", "Requires"), ("Service", "ExecStartPre"),
                                     ("Service", "TimeoutStartSec")}


def test_there_is_a_ray_shape_among_the_golden_plans() -> None:
    _, replicas = planned_shape(RAY_SHAPE)
    assert [r.backend for r in replicas] == ["ray"] and len(replicas[0].roles) == 2


def test_the_drop_in_of_the_readmes_ray_shape() -> None:
    cfg, replica, role = _ray_head()
    assert ray_drop_in.drop_in(cfg, replica, role) == (DATA / "ray_drop_in" / f"{RAY_SHAPE}.conf").read_text()


@pytest.mark.parametrize(("values", "address", "nodes", "timeout"), [
    ({}, "10.40.2.11:6379", 2, 300),
    ({"ray_port": 7000, "ray_ready_timeout": 900}, "10.40.2.11:7000", 2, 900),
    ({"ray_ready_timeout": 10}, "10.40.2.11:6379", 2, ray_drop_in.JOIN_WAIT_MIN_S),  # rounds never too short
    ({"fleet_address": "fd00::11"}, "[fd00::11]:6379", 2, 300),
    ({"third_node": True}, "10.40.2.11:6379", 3, 300),
])
def test_the_join_wait_follows_the_config_and_the_plan(values: dict[str, Any], address: str, nodes: int,
                                                       timeout: int) -> None:
    cfg, replica, role = _ray_head()
    if values.pop("third_node", False):
        third = replace(replica.roles[1], host="gpu-c03.dc1.example.net", address="10.40.2.13")
        replica = replace(replica, roles=[*replica.roles, third])
    if "fleet_address" in values:
        role = replace(role, address=values.pop("fleet_address"))
    text = ray_drop_in.drop_in(cfg.model_copy(update=values), replica, role)
    assert text is not None
    settings = _settings(text)
    argv = exec_argv(settings[("Service", "ExecStartPre")][0])
    assert argv[argv.index("--address") + 1] == address
    assert argv[argv.index("--nodes") + 1] == str(nodes)
    assert argv[argv.index("--timeout") + 1] == str(timeout)
    assert int(settings[("Service", "TimeoutStartSec")][0]) == timeout + ray_drop_in.GATE_S


def _template_settings(name: str, **values: object) -> dict[tuple[str, str], list[str]]:
    return _settings(templates.render(name, **values))


def test_rounds_of_the_join_wait_never_use_up_the_vllm_units_start_limit() -> None:
    """After a round times out the unit fails and Restart= starts it again: however long the workers take, the
    starts of rounds of the shortest wait never fill the start limit's window, so the unit never gives up."""
    unit = _template_settings("vllm/vllm@.service.j2", **vllm_role.unit_values())
    window = int(unit[("Unit", "StartLimitIntervalSec")][0])
    burst = int(unit[("Unit", "StartLimitBurst")][0])
    restart_sec = int(unit[("Service", "RestartSec")][0])
    assert unit[("Service", "Restart")] == ["on-failure"]
    assert burst * (ray_drop_in.JOIN_WAIT_MIN_S + restart_sec) > window
    # ... and the vLLM unit waits for the wait: systemd's start timeout covers the GPU gate and one round
    assert ("Service", "TimeoutStartSec") not in unit and ray_drop_in.GATE_S >= 90  # the default it replaces


def test_the_drop_in_carries_no_secret_and_leaves_the_sandbox_alone() -> None:
    cfg, replica, role = _ray_head()
    text = ray_drop_in.drop_in(cfg, replica, role)
    assert text is not None and "RAY_AUTH_TOKEN" not in text and "EnvironmentFile" not in text
    # the token reaches the wait as it reaches vLLM: the unit's secrets file, which systemd reads as root
    assert "RAY_AUTH_TOKEN" in replica.secret_env
    unit = _template_settings("vllm/vllm@.service.j2", **vllm_role.unit_values())
    assert f"-{node_paths.SECRETS_DIR}/%i.env" in unit[("Service", "EnvironmentFile")]
    assert unit[("Service", "User")] == ["vllm"]


# --- the Ray units: a worker joins by itself once the head answers ---------------------------------------------

@pytest.mark.parametrize("kind", ["head", "worker"])
def test_a_ray_unit_starts_after_the_network_and_tries_again_until_it_joins(kind: str) -> None:
    """A worker's ``ray start --address=HEAD`` fails (exit 1, "Failed to connect to GCS") while the head does not
    answer; Restart= tries again. Without a StartLimit of its own, systemd's default (5 starts in 10 s) can never
    be reached 5 s apart, so the worker keeps trying until the head is up."""
    fleet, replicas = planned_shape(RAY_SHAPE)
    head = replicas[0].roles[0]
    config = fleet.configs[head.host]
    argv = ray_start_argv(config, head.address if kind == "head" else "10.40.2.12",
                          None if kind == "head" else head.address)
    unit = _template_settings("ray/ray.service.j2", kind=kind, replica="r", env_file=node_paths.ray_env_file("r"),
                              token_file=node_paths.ray_token_file("r"), exec_start=exec_line(argv),
                              ray=f"{vf.venv_dir(config)}/bin/ray", ip_access=access.unit_lines(["10.40.2.0/24"]))
    assert unit[("Unit", "After")] == ["network-online.target"] and unit[("Unit", "Wants")] == ["network-online.target"]
    assert unit[("Service", "Restart")] == ["on-failure"]
    restart_sec = int(unit[("Service", "RestartSec")][0])
    assert not [key for _, key in unit if key.startswith("StartLimit")]
    assert 5 * restart_sec > 10  # systemd's DefaultStartLimitBurst in DefaultStartLimitIntervalSec
    assert unit[("Install", "WantedBy")] == ["multi-user.target"]


# --- role vllm: writes the drop-in on the head, reads it first, restarts and reloads for it ---------------------

def _run_vllm_install(monkeypatch: pytest.MonkeyPatch, shape: str, host: str) -> Recorder:
    """``vllm_install`` of one host of a shape, every operation recorded instead of run."""
    fleet, replicas = planned_shape(shape)
    ctx = DeployContext(fleet=fleet)
    recorder = Recorder()
    for name in ("apt", "files", "node", "server", "shared_secrets", "systemd", "vllm"):
        monkeypatch.setattr(vllm_role, name, recorder.module(name))
    monkeypatch.setattr(vllm_role, "host_config", lambda *_: fleet.configs[host])
    monkeypatch.setattr(vllm_role, "context", lambda *_: ctx)
    monkeypatch.setattr(vllm_role, "assignments",
                        lambda *_: [(r, role) for r in replicas for role in r.roles if role.host == host])
    monkeypatch.setattr(access, "deploy_group", lambda group="monitoring": [])
    monkeypatch.setattr(vf, "_read_secret", lambda ref, key: f"{key} value")  # the controller's secrets
    vllm_role.vllm_install.__wrapped__()  # type: ignore[attr-defined]
    return recorder


def test_the_vllm_role_writes_the_drop_in_on_the_ray_head_and_restarts_and_reloads_for_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _, replicas = planned_shape(RAY_SHAPE)
    replica, head = replicas[0], replicas[0].roles[0]
    path = node_paths.vllm_ray_drop_in(replica.name)
    ops = _run_vllm_install(monkeypatch, RAY_SHAPE, head.host)
    (written,) = ops.named("files.file", dest=path)
    assert written.kwargs["content"] == (DATA / "ray_drop_in" / f"{RAY_SHAPE}.conf").read_text()
    (observed,) = ops.named("node.observe")
    assert path in observed.kwargs["paths"]  # read with the node's first reading, like the replica's other files
    (record,) = ops.named("vllm.restart_record")
    assert not record.kwargs["changed"]()
    written.changed = True
    assert record.kwargs["changed"]()  # a new or changed drop-in restarts the replica
    (reload,) = ops.named("systemd.daemon_reload")
    assert reload.kwargs["_if"]()  # ... after systemd has read it
    written.changed = False
    assert not reload.kwargs["_if"]()
    (retired,) = ops.named("systemd.retired")
    assert node_paths.vllm_ray_drop_in("{name}") in retired.kwargs["paths"]


@pytest.mark.parametrize("shape", ["b_two_nodes_mp", "a_single_node_70b"])
def test_the_vllm_role_removes_a_drop_in_where_the_replica_is_not_ray(monkeypatch: pytest.MonkeyPatch,
                                                                      shape: str) -> None:
    _, replicas = planned_shape(shape)
    host = replicas[0].roles[0].host
    ops = _run_vllm_install(monkeypatch, shape, host)
    mine = [r for r in replicas if host in r.nodes]
    assert not [c for c in ops.named("files.file") if re.search(r"\.service\.d/", str(c.kwargs.get("dest")))]
    absent = {c.kwargs["path"] for c in ops.named("files.absent")}
    assert {node_paths.vllm_ray_drop_in(r.name) for r in mine} <= absent


def test_a_started_or_restarted_ray_head_is_a_start_of_its_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM follows its Ray head (Requires=): when the ray role starts or restarts the head, vllm_serve's readiness
    wait on the head must run, as for a start of vLLM itself."""
    fleet, replicas = planned_shape(RAY_SHAPE)
    replica, head = replicas[0], replicas[0].roles[0]
    ctx = DeployContext(fleet=fleet)
    recorder = Recorder()
    for name in ("files", "node", "systemd", "ray_ops"):
        monkeypatch.setattr(ray_role, name, recorder.module(name))
    monkeypatch.setattr(ray_role, "host_config", lambda *_: fleet.configs[head.host])
    monkeypatch.setattr(ray_role, "context", lambda *_: ctx)
    monkeypatch.setattr(ray_role, "assignments", lambda *_: [(replica, head)])
    monkeypatch.setattr(access, "deploy_group", lambda group="monitoring": [])
    monkeypatch.setattr(vf, "_read_secret", lambda ref, key: f"{key} value")
    ray_role.ray.__wrapped__()  # type: ignore[attr-defined]
    unit = node_paths.ray_unit(replica.name)
    (started,) = recorder.named("systemd.service", unit=unit)
    (restarted,) = recorder.named("systemd.restart", unit=unit)
    assert ctx.replica_starts[replica.name] == [started, restarted]
    assert not vllm_role._changed(ctx.replica_starts[replica.name])()
    restarted.changed = True
    assert vllm_role._changed(ctx.replica_starts[replica.name])()
