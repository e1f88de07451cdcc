"""One node reading per deploy while nothing changes: the first covers every role's items; a change makes each
later role read its own again."""

from __future__ import annotations

from typing import Any

import pytest
from pyinfra.context import ctx_host, ctx_state

from gpufleet.operations import files, node
from gpufleet.run.context import deploy_state
from tests.unit.fake_hosts import FakeHost, FakeState


class CountingHost(FakeHost):
    """A FakeHost that keeps what each NodeState reading asked for."""

    def __init__(self, facts: dict[str, Any]) -> None:
        super().__init__(facts)
        self.readings: list[dict[str, list[str]]] = []

    def get_fact(self, fact: type, *args: Any, **kwargs: Any) -> Any:
        if fact.__name__ == "NodeState":
            self.readings.append(kwargs)
        return super().get_fact(fact, *args, **kwargs)


ROLES = [  # what three roles observe, in site order
    {"paths": ["/etc/gpufleet"], "packages": ["curl"]},
    {"paths": ["/etc/gpufleet", "/var/lib/node_exporter"], "units": ["node_exporter.service"]},
    {"paths": ["/opt/vllm"], "users": ["vllm"]},
]


def _add_roles(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, list[str]]]:
    """What ``node.observe`` hands to ``read_state`` for each role (pyinfra's operation call stubbed)."""
    added: list[dict[str, list[str]]] = []
    monkeypatch.setattr(node, "read_state", lambda name, **what: added.append(what))
    for role in ROLES:
        node.observe(name="Read", **role)
    monkeypatch.undo()
    return added


def _read(what: dict[str, list[str]]) -> None:
    assert list(node.read_state._inner(**what)) == []


def test_one_reading_while_nothing_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = CountingHost({"NodeState": {"paths": {"/etc/gpufleet": {"type": "directory", "mode": "755",
                                                                    "user": "root", "group": "root"}}}})
    with ctx_host.use(fake), ctx_state.use(FakeState()):
        added = _add_roles(monkeypatch)
        for what in added:
            _read(what)
    assert fake.readings == [{"paths": ["/etc/gpufleet", "/opt/vllm", "/var/lib/node_exporter"],
                              "units": ["node_exporter.service"], "packages": ["curl"], "users": ["vllm"]}]
    assert fake.noops[1:] == ["nothing it asks for is unknown: read earlier in this deploy, and nothing has run"
                              " on the node since"] * 2


def test_after_a_command_each_role_reads_its_items_again(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = CountingHost({"NodeState": {"paths": {"/etc/gpufleet": {"type": "directory", "mode": "755",
                                                                    "user": "root", "group": "root"}}}})
    with ctx_host.use(fake), ctx_state.use(FakeState()):
        added = _add_roles(monkeypatch)
        _read(added[0])
        assert list(files.directory._inner(path="/var/lib/node_exporter")), "the directory is missing: it runs"
        _read(added[1])
        _read(added[2])
    assert len(fake.readings) == 3
    assert fake.readings[1] == {"paths": ["/etc/gpufleet", "/var/lib/node_exporter"],
                                "units": ["node_exporter.service"]}
    assert fake.readings[2] == {"paths": ["/opt/vllm"], "users": ["vllm"]}


def test_read_only_reads_again_only_what_an_operation_forgot(monkeypatch: pytest.MonkeyPatch) -> None:
    fake, fake_state = CountingHost({}), FakeState()
    deploy_state(fake_state).read_only = True  # type: ignore[arg-type]
    with ctx_host.use(fake), ctx_state.use(fake_state):
        added = _add_roles(monkeypatch)
        _read(added[0])
        assert list(files.directory._inner(path="/var/lib/node_exporter")) == []  # drift, not a command
        _read(added[1])
        _read(added[2])
    assert fake.readings[1:] == [{"paths": ["/var/lib/node_exporter"]}]  # the directory it would have made
