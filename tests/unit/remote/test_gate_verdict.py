"""The GPU gate's verdict when it runs: a node planned from its declared profile, or changed by the driver role,
is judged on a fresh probe; a node planned from a profile must report that profile's GPUs."""

from __future__ import annotations

from typing import Any

import pytest

from gpufleet.config.fleet import Fleet
from gpufleet.config.layers import role_default_layers
from gpufleet.config.schema import HostConfig
from gpufleet.config.validate import validate_host
from gpufleet.gpu.profiles import profile_facts
from gpufleet.gpu.report import NodeFacts
from gpufleet.inventory.load import HostLayers, Layer
from gpufleet.run import context as context_module
from gpufleet.run.context import DeployContext, gate_verdict, profile_mismatch
from tests.recorded_ops import RecordedOp

HOST = "10.0.0.5"
NO_DRIVER = {"schema": "gpufleet.gpu-facts/1", "hostname": "gpu-a01",
             "nvml": {"available": False, "error": "no NVML on this node: nvmlInit: Driver Not Loaded"}}


def _doc(facts: NodeFacts) -> dict[str, Any]:
    return facts.model_dump(mode="json", by_alias=True)


def _config(profile: str | None) -> HostConfig:
    layers, problems = role_default_layers()
    assert problems == []
    config, found = validate_host(HostLayers(HOST, [*layers, Layer("test", {
        "vllm_model": "org/model", "gpu_profile": profile,
        "gpu_health": {"expected_gpu_count": 8, "expected_gpu_model": "H100"}})]), "test")
    assert found == [], [p.line() for p in found]
    assert config is not None
    return config


class _Host:
    name = HOST


def _meta(changed: bool) -> RecordedOp:
    """A driver role operation's outcome, as the gate reads it."""
    return RecordedOp("driver", {}, changed=changed)


def _verdict(monkeypatch: pytest.MonkeyPatch, ctx: DeployContext, now: dict[str, Any] | None) -> list[str]:
    probes: list[str] = []

    def probe(target: Any) -> tuple[dict[str, Any] | None, NodeFacts | None, str | None]:
        probes.append(target.name)
        if now is None:
            return None, None, "the NVML probe failed: ssh: connection refused"
        return now, context_module.parse_facts(now), None

    monkeypatch.setattr(context_module, "context", lambda: ctx)
    monkeypatch.setattr(context_module, "_probe", probe)
    found = gate_verdict(_Host())()  # type: ignore[arg-type]
    ctx.probes = probes  # type: ignore[attr-defined]
    return found


def _ctx(profile: str | None) -> DeployContext:
    return DeployContext(Fleet("inventory.py", [HOST], {HOST: _config(profile)}, {}))


def test_identical_profiles_match() -> None:
    planned = profile_facts("8xH100-SXM", "gpu-a01")
    assert profile_mismatch("8xH100-SXM", planned, profile_facts("8xH100-SXM", "gpu-a01")) == []


@pytest.mark.parametrize(("probed", "reported"), [
    ("8xH100NVL-PCIe", "8 x NVIDIA H100 NVL, 95830 MiB each, NVLink islands 1/1/1/1/1/1/1/1, NUMA 0,0,0,0,1,1,1,1"),
    ("4xH100-SXM", "4 x NVIDIA H100 80GB HBM3, 81559 MiB each, NVLink islands 4, NUMA 0,0,1,1"),
])
def test_other_gpus_than_the_profile_are_named(probed: str, reported: str) -> None:
    found = profile_mismatch("8xH100-SXM", profile_facts("8xH100-SXM", "a"), profile_facts(probed, "a"))
    assert found == [
        "gpu_profile: planned as 8xH100-SXM (8 x NVIDIA H100 80GB HBM3, 81559 MiB each, NVLink islands 8,"
        f" NUMA 0,0,0,0,1,1,1,1), NVML reports {reported}; the next deploy plans from the probed GPUs"]


def test_an_unchanged_probed_node_keeps_its_verdict_without_probing(monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = _ctx(None)
    ctx.facts[HOST] = profile_facts("8xH100-SXM", "gpu-a01")
    ctx.driver_changes[HOST] = [_meta(False)]  # type: ignore[list-item]
    assert _verdict(monkeypatch, ctx, None) == []
    assert ctx.probes == []  # type: ignore[attr-defined]


def test_a_node_planned_from_its_profile_passes_on_the_profiles_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = _ctx("8xH100-SXM")
    ctx.provisional[HOST] = profile_facts("8xH100-SXM", "gpu-a01")
    fresh = profile_facts("8xH100-SXM", "gpu-a01")
    assert _verdict(monkeypatch, ctx, _doc(fresh)) == []
    assert ctx.facts[HOST] == fresh  # later operations see what the node reports now


def test_a_node_planned_from_its_profile_fails_on_other_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = _ctx("8xH100-SXM")
    ctx.provisional[HOST] = profile_facts("8xH100-SXM", "gpu-a01")
    found = _verdict(monkeypatch, ctx, _doc(profile_facts("8xH100NVL-PCIe", "gpu-a01")))
    assert len(found) == 1 and found[0].startswith("gpu_profile: planned as 8xH100-SXM"), found


def test_a_node_whose_driver_still_does_not_answer_fails_with_the_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = _ctx("8xH100-SXM")
    ctx.provisional[HOST] = profile_facts("8xH100-SXM", "gpu-a01")
    assert _verdict(monkeypatch, ctx, NO_DRIVER) == [
        "nvml (node): no NVML on this node: nvmlInit: Driver Not Loaded"]
    assert _verdict(monkeypatch, ctx, None) == ["probe: the NVML probe failed: ssh: connection refused"]


def test_a_changed_node_is_judged_on_the_fresh_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = _ctx(None)
    ctx.facts[HOST] = profile_facts("8xH100-SXM", "gpu-a01")
    ctx.driver_changes[HOST] = [_meta(False), _meta(True)]  # type: ignore[list-item]
    lost = _doc(profile_facts("8xH100-SXM", "gpu-a01"))
    lost["gpus"] = lost["gpus"][:7]
    found = _verdict(monkeypatch, ctx, lost)
    assert ctx.probes == [HOST] and found and found[0].startswith("gpu_count (node): found 7 GPUs"), found  # type: ignore[attr-defined]


def test_a_node_left_out_of_the_plan_that_passes_now_says_the_next_deploy_plans_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = _ctx(None)  # no gpu_profile: it could not be planned without NVML
    ctx.facts[HOST] = context_module.parse_facts(NO_DRIVER)
    ctx.gate_failures[HOST] = ["nvml (node): no NVML on this node: nvmlInit: Driver Not Loaded"]
    ctx.driver_changes[HOST] = [_meta(True)]  # type: ignore[list-item]
    found = _verdict(monkeypatch, ctx, _doc(profile_facts("8xH100-SXM", "gpu-a01")))
    assert found == ["not planned in this deploy (nvml (node): no NVML on this node: nvmlInit: Driver Not Loaded); it"
                     " passes its gate now: the next deploy plans it (a declared gpu_profile lets one deploy"
                     " converge a node without a driver)"]
