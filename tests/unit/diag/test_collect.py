"""``gpufleet diag``'s collection (gpufleet/diag/collect.py) over fake nodes (tests/unit/diag_nodes.py: the real node
tool on a folder standing for each node): every node at once, each within its bound, a node that hangs reported
after the bound while the others complete, and the archive fetched then removed from the node."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpufleet.diag import collect as diag_collect
from gpufleet.diag.collect import TOOL, NodeRun, collect
from gpufleet.remote.commands import RemoteResult
from tests.unit.diag_nodes import FakeNode, LocalNodes

HOSTS = ("gpu-a01", "gpu-a02", "gpu-a03")


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[LocalNodes]:
    fleet = {}
    for host in HOSTS:
        fleet[host] = FakeNode(tmp_path / host, ["haproxy.service"])
        fleet[host].journal("haproxy.service", f"2026-11-20T10:00:00+0000 {host} haproxy[1]: Proxy started.\n")
    found = LocalNodes(fleet)
    yield found
    found.release.set()


def test_every_node_gives_its_archive_and_it_is_removed_from_the_node(nodes: LocalNodes) -> None:
    runs = collect(HOSTS, lambda host: nodes, 3600, 100000)
    assert list(runs) == list(HOSTS)
    for host, run in runs.items():
        assert run.problem is None and run.archive.startswith(b"\x1f\x8b"), run.problem
        fetched = [words[1] for h, words in nodes.calls if h == host and words[0] == "get"]
        removed = [words[-1] for h, words in nodes.calls if h == host and words[:len(TOOL) + 1] == [*TOOL, "remove"]]
        assert len(fetched) == 1 and removed == [str(Path(fetched[0]).parent)]
        assert not Path(fetched[0]).exists()
    assert nodes.closed == len(HOSTS)


def test_a_node_that_hangs_is_reported_after_the_bound_while_the_others_complete(nodes: LocalNodes) -> None:
    nodes.silent = {"gpu-a02"}
    started = time.monotonic()
    runs = collect(HOSTS, lambda host: nodes, 3600, 100000, bound_s=4)
    took = time.monotonic() - started
    assert 4 <= took < 8, took
    assert runs["gpu-a02"] == NodeRun("gpu-a02", 4, problem="no answer within the bound of 4 s")
    assert all(runs[h].archive and runs[h].problem is None for h in ("gpu-a01", "gpu-a03"))


def test_the_nodes_are_collected_at_once(nodes: LocalNodes, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three nodes that each wait 2 s wait at once: every node's wait began before any ended (judged by when each
    began and ended, not by the run's length: the collection's own work is slower on a busy machine; seen: 5.06 s
    for the three, beside the lab tier)."""
    real = diag_collect.collect_node
    waits: list[tuple[float, float]] = []

    def slow(*args: object, **kwargs: object) -> NodeRun:
        began = time.monotonic()
        time.sleep(2)
        waits.append((began, time.monotonic()))
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(diag_collect, "collect_node", slow)
    runs = collect(HOSTS, lambda host: nodes, 3600, 100000, bound_s=30)
    assert len(waits) == len(HOSTS) and all(run.archive for run in runs.values())
    assert max(began for began, _ in waits) < min(ended for _, ended in waits), waits


def test_a_host_of_a_local_connector_is_collected_in_the_main_thread(nodes: LocalNodes,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """pyinfra's local connectors run gevent's subprocesses, which work in the main thread alone."""
    nodes.nodes["@local"] = nodes.nodes["gpu-a01"]
    real, seen = diag_collect.collect_node, {}

    def where(remote: LocalNodes, host: str, *args: object) -> NodeRun:
        seen[host] = threading.current_thread() is threading.main_thread()
        return real(remote, host, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(diag_collect, "collect_node", where)
    runs = collect(["@local", "gpu-a02"], lambda host: nodes, 3600, 100000)
    assert seen == {"@local": True, "gpu-a02": False} and all(run.archive for run in runs.values())
    assert list(runs) == ["@local", "gpu-a02"]


class Answers(LocalNodes):
    """Nodes whose node tool answers as given (its stdout), its archive never fetched."""

    def __init__(self, answer: RemoteResult) -> None:
        super().__init__({})
        self.answer = answer

    def run(self, host: str, words: object, *, timeout_s: float, ok_status: object = (0,)) -> RemoteResult:
        self.calls.append((host, list(words)))  # type: ignore[call-overload]
        return self.answer


@pytest.mark.parametrize(("answer", "problem"), [
    (RemoteResult(False, "", "/usr/bin/python3: can't open file '/opt/gpufleet/node/diag_collect.py': [Errno 2]"),
     "the node tool diag_collect.py failed: /usr/bin/python3: can't open file"),
    (RemoteResult(True, "not json\n", ""), "the node tool diag_collect.py printed no archive: not json"),
    (RemoteResult(True, '{"archive": "/etc/shadow"}\n', ""),
     "the node tool diag_collect.py named an archive outside /var/tmp/gpufleet-diag-*"),
])
def test_a_node_that_gives_no_archive_says_why_and_nothing_is_fetched(answer: RemoteResult, problem: str) -> None:
    nodes = Answers(answer)
    run = collect(["gpu-a01"], lambda host: nodes, 60, 1000)["gpu-a01"]
    assert run.archive == b"" and run.problem is not None and run.problem.startswith(problem), run.problem
    assert [words[0] for _, words in nodes.calls] == [TOOL[0]]  # the tool once, nothing fetched or removed
