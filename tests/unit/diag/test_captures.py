"""Captures (gpufleet/diag/captures.py): an archive of the failed replica's nodes, kept 0600 on every monitoring
host in the captures' 0700 folder, the newest KEEP of them; listed newest first. Fake nodes run the real node tool
(tests/unit/diag_nodes.py); the monitoring host is one of them."""

from __future__ import annotations

import tarfile
from collections.abc import Collection, Sequence
from datetime import UTC, datetime
from pathlib import Path

import pytest

from gpufleet.diag import captures
from gpufleet.diag.collect import TOOL
from gpufleet.diag.redact import Secrets
from gpufleet.node_paths import DIAG_CAPTURES_DIR
from gpufleet.remote.commands import RemoteResult
from tests.unit.diag_nodes import FakeNode, LocalNodes

NODE, MONITOR = "gpu-a01", "mon-1"
WHEN = datetime(2026, 11, 28, 10, 15, 0, tzinfo=UTC)


class Store(LocalNodes):
    """The monitoring host: the node tool on its fake node, install and chmod below its root, files written there."""

    def run(self, host: str, words: Sequence[str], *, timeout_s: float,
            ok_status: Collection[int] = (0,)) -> RemoteResult:
        root = self.nodes[host].root
        if words[0] == "install":  # install -d -m MODE DIR
            folder = root / words[-1].lstrip("/")
            folder.mkdir(parents=True, exist_ok=True)
            folder.chmod(int(words[3], 8))
            return RemoteResult(True, "", "")
        if words[0] == "chmod":
            (root / words[2].lstrip("/")).chmod(int(words[1], 8))
            return RemoteResult(True, "", "")
        return super().run(host, words, timeout_s=timeout_s, ok_status=ok_status)

    def put_bytes(self, host: str, path: str, data: bytes) -> RemoteResult:
        (self.nodes[host].root / path.lstrip("/")).write_bytes(data)
        return RemoteResult(True, "", "")


@pytest.fixture
def fleet(tmp_path: Path) -> dict[str, FakeNode]:
    found = {NODE: FakeNode(tmp_path / NODE, ["vllm@llama_70b-0.service"]), MONITOR: FakeNode(tmp_path / MONITOR)}
    found[NODE].journal("vllm@llama_70b-0.service", "2026-11-28T10:14:00+0000 gpu-a01 python[9]: RuntimeError: Engine"
                                                    " core initialization failed. See root cause above.\n")
    return found


def _take(fleet: dict[str, FakeNode], tmp_path: Path, when: datetime = WHEN) -> tuple[str, list[str]]:
    nodes = LocalNodes(fleet)
    return captures.take([NODE], lambda host: nodes, Store(fleet), [MONITOR], [], Secrets(),
                         "upgrade rolled back llama_70b-0", when, tmp_path)


def test_a_capture_is_kept_root_only_on_the_monitoring_host_and_listed(fleet: dict[str, FakeNode],
                                                                      tmp_path: Path) -> None:
    name, problems = _take(fleet, tmp_path)
    assert problems == []
    assert name == "20261128T101500Z-upgrade-rolled-back-llama-70b-0.tar.gz"
    kept = fleet[MONITOR].root / DIAG_CAPTURES_DIR.lstrip("/") / name
    assert kept.stat().st_mode & 0o777 == 0o600 and kept.parent.stat().st_mode & 0o777 == 0o700
    with tarfile.open(kept) as tar:
        assert f"nodes/{NODE}/journal/vllm@llama_70b-0.service.log" in tar.getnames()
        assert b"engine_core_died" in tar.extractfile("findings.txt").read()  # type: ignore[union-attr]
    assert list(tmp_path.glob("*.tar.gz")) == []  # the local copy is gone
    found, unlisted = captures.listed(Store(fleet), [MONITOR])
    assert unlisted == [] and [(c.host, c.name, c.bytes) for c in found] == [(MONITOR, name, kept.stat().st_size)]


def test_only_the_newest_captures_are_kept(fleet: dict[str, FakeNode], tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(captures, "KEEP", 2)
    names = [_take(fleet, tmp_path, WHEN.replace(minute=minute))[0] for minute in (1, 3, 2)]
    found, _ = captures.listed(Store(fleet), [MONITOR])
    assert [c.name for c in found] == sorted(names, reverse=True)[:2]  # newest first; the oldest removed


def test_a_monitoring_host_that_cannot_keep_it_is_named(fleet: dict[str, FakeNode], tmp_path: Path) -> None:
    nodes = LocalNodes(fleet)
    _, problems = captures.take([NODE], lambda host: nodes, LocalNodes(fleet), [MONITOR], [], Secrets(), "x",
                                WHEN, tmp_path)  # plain LocalNodes: runs the node tool only, so `install` fails
    assert [p.split(":")[0] for p in problems] == [MONITOR], problems


def test_a_reason_becomes_a_plain_name() -> None:
    assert captures.capture_name(WHEN, "  Rollback rolled back a/b; c$(x)  ") == (
        "20261128T101500Z-rollback-rolled-back-a-b-c-x.tar.gz")
    assert captures.capture_name(WHEN, "!!!") == "20261128T101500Z-capture.tar.gz"
    assert list(TOOL)[-1].endswith("diag_collect.py")
