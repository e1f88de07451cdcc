"""What a rollout runs on hosts: the command words (gpufleet/remote/commands.py) over pyinfra's own connection layer
(here its ``@local`` connector, running real programs), and the release records on a node
(gpufleet/rollout/node_releases.py: real ``head``, ``cp``, ``mv``). The routers, through the real ``router_admin.py``
against a real HAProxy: tests/tools/test_rollout_router_control.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from pyinfra.api.inventory import Inventory

from gpufleet.remote.commands import PyinfraRemote, RemoteError, RemoteResult, command_line
from gpufleet.rollout import node_releases
from gpufleet.rollout.release import release_json


@pytest.fixture
def local() -> Iterator[PyinfraRemote]:
    remote = PyinfraRemote(Inventory((["@local"], {})))
    yield remote
    remote.close()


@pytest.mark.parametrize("word", ["a b", "a;b", "$(id)", "`id`", "", "a\nb", "'q'", "*", "a|b", "~root", "a>b"])
def test_a_word_with_anything_but_plain_characters_is_never_run(word: str) -> None:
    with pytest.raises(RemoteError, match="refusing to run"):
        command_line(["echo", word])


def test_plain_words_are_quoted_and_reach_the_program_as_they_are(local: PyinfraRemote) -> None:
    words = ["/etc/gpufleet/vllm/p-0/release.json", "KEY=VALUE", "model-x:8000", "a,b", "50%", "-c", "1048576"]
    assert command_line(["printf", "%s@", *words]) == "printf %s@ " + " ".join(words)
    done = local.run("@local", ["printf", "%s@", *words], timeout_s=10)
    assert done == RemoteResult(True, "@".join(words) + "@", "")


def test_an_exit_status_is_accepted_only_when_asked_and_a_hang_is_a_failure(local: PyinfraRemote) -> None:
    assert not local.run("@local", ["false"], timeout_s=10).ok
    assert local.run("@local", ["false"], timeout_s=10, ok_status=(0, 1)).ok
    hung = local.run("@local", ["sleep", "5"], timeout_s=1)
    assert not hung.ok and hung.line() == "@local: the command did not end within 1 s"


def test_an_unreachable_host_is_a_failure_with_a_line() -> None:
    remote = PyinfraRemote(Inventory((["nohost.invalid"], {"ssh_connect_retries": 0})))
    done = remote.run("nohost.invalid", ["true"], timeout_s=5)
    assert not done.ok and done.line().startswith("nohost.invalid: cannot connect")


def test_a_files_bytes_are_fetched_whole_within_a_bound(local: PyinfraRemote, tmp_path: Path) -> None:
    path = tmp_path / "node.tar.gz"
    path.write_bytes(b"\x1f\x8b\x00binary\nbytes")
    assert local.get_bytes("@local", str(path), 100) == (RemoteResult(True, "", ""), path.read_bytes())
    over, data = local.get_bytes("@local", str(path), 5)
    assert not over.ok and data == b"" and over.line().endswith("holds 15 bytes, over 5")
    missing, data = local.get_bytes("@local", str(tmp_path / "none"), 100)
    assert not missing.ok and data == b"" and missing.line().startswith("@local: ")


# --- release records on a node ---------------------------------------------------------------------------------

@pytest.fixture
def records_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The node's replica directories below ``tmp_path`` instead of /etc/gpufleet/vllm."""
    monkeypatch.setattr(node_releases, "release_file", lambda r: f"{tmp_path}/{r}/release.json")
    monkeypatch.setattr(node_releases, "previous_release_file", lambda r: f"{tmp_path}/{r}/release.previous.json")
    return tmp_path


def test_records_are_read_in_one_command_missing_ones_as_none(local: PyinfraRemote, records_dir: Path) -> None:
    written: list[tuple[str, dict[str, object]]] = [
        ("p-0", {"vllm_version": "0.32.0", "vllm_env": {"A": "==> x <=="}}), ("p-1", {"vllm_version": "0.31.0"})]
    for replica, release in written:
        (records_dir / replica).mkdir()
        (records_dir / replica / "release.json").write_text(release_json(release))
    (records_dir / "p-1" / "release.previous.json").write_text(release_json({"vllm_version": "0.30.0"}))
    found = node_releases.read_records(local, "@local", ["p-0", "p-1", "p-2"])
    assert found == {
        "p-0": node_releases.NodeRecords({"vllm_version": "0.32.0", "vllm_env": {"A": "==> x <=="}}, None),
        "p-1": node_releases.NodeRecords({"vllm_version": "0.31.0"}, {"vllm_version": "0.30.0"}),
        "p-2": node_releases.NodeRecords(None, None)}


def test_a_record_that_cannot_be_read_stops_with_a_line(local: PyinfraRemote, records_dir: Path) -> None:
    (records_dir / "p-0").mkdir()
    (records_dir / "p-0" / "release.json").write_text("not json\n")
    with pytest.raises(node_releases.RecordFailure, match=r"^@local:.*release\.json: expected a release record"):
        node_releases.read_records(local, "@local", ["p-0"])
    (records_dir / "p-1").write_text("")  # a file where the replica's directory should be: not "missing"
    with pytest.raises(node_releases.RecordFailure, match=r"^node @local: cannot read .*p-1/release\.json: head: "):
        node_releases.read_records(local, "@local", ["p-1"])


def test_keeping_the_previous_release_replaces_it_whole(local: PyinfraRemote, records_dir: Path) -> None:
    """Staged before the change, the copy replaces release.previous.json once the change held, or goes when it was
    rolled back (release.previous.json then as it was)."""
    (records_dir / "p-0").mkdir()
    (records_dir / "p-0" / "release.json").write_text(release_json({"vllm_version": "0.32.0"}))
    (records_dir / "p-0" / "release.previous.json").write_text(release_json({"vllm_version": "0.30.0"}))
    node_releases.stage_previous(local, "@local", "p-0")
    node_releases.drop_staged(local, "@local", "p-0")
    assert sorted(p.name for p in (records_dir / "p-0").iterdir()) == ["release.json", "release.previous.json"]
    assert node_releases.read_records(local, "@local", ["p-0"])["p-0"].previous == {"vllm_version": "0.30.0"}
    node_releases.stage_previous(local, "@local", "p-0")
    node_releases.keep_previous(local, "@local", "p-0")
    assert sorted(p.name for p in (records_dir / "p-0").iterdir()) == ["release.json", "release.previous.json"]
    assert node_releases.read_records(local, "@local", ["p-0"])["p-0"].previous == {"vllm_version": "0.32.0"}
    with pytest.raises(node_releases.RecordFailure, match=r"^node @local: cannot keep the release p-1 ran: "):
        node_releases.stage_previous(local, "@local", "p-1")
