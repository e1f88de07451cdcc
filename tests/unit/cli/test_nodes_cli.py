"""``gpufleet nodes`` (gpufleet/cli/nodes.py) on a real inventory (tests/data/rollout_fleet), with the nodes and the
monitoring hosts replaced by recorded answers: bad input refused with one line before any node changes, a move made
through the node's own tool; the monitoring hosts' copies (gpufleet/remote/node_records.py). On the lab's nodes:
tests/lab/test_lifecycle.py."""

from __future__ import annotations

import json
import secrets
from collections.abc import Collection, Sequence
from datetime import UTC, datetime
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from gpufleet.cli import nodes as cli_nodes
from gpufleet.cli.main import main
from gpufleet.node import node_state
from gpufleet.remote.commands import RemoteResult
from tests.conftest import DATA

FLEET = str(DATA / "rollout_fleet" / "inventory.py")
A01 = "gpu-a01.dc1.example.net"
NOW = datetime(2026, 11, 27, 12, 0, tzinfo=UTC)


class Nodes:
    """Each node's record as its tool shows it, and every command and file the CLI sent."""

    def __init__(self, states: dict[str, str]) -> None:
        self.records: dict[str, dict[str, Any]] = {}
        for host, state in states.items():
            record = node_state.move(node_state.new_record(host, NOW), "burn-in", "first seen", NOW)
            record = node_state.move(record, "serving", "passed", NOW)
            if state != "serving":
                record = node_state.move(record, state, "by hand", NOW)  # type: ignore[arg-type]
            self.records[host] = record
        self.commands: list[tuple[str, list[str]]] = []
        self.written: dict[tuple[str, str], str] = {}

    def run(self, host: str, words: Sequence[str], *, timeout_s: float,
            ok_status: Collection[int] = (0,)) -> RemoteResult:
        self.commands.append((host, list(words)))
        if "show" in words:
            return RemoteResult(True, json.dumps(self.records[host]), "")
        if "move" in words:
            to = words[words.index("--to") + 1]
            why = bytes.fromhex(words[words.index("--why-hex") + 1]).decode()
            by = bytes.fromhex(words[words.index("--by-hex") + 1]).decode()
            self.records[host] = node_state.move(self.records[host], to, why, NOW, by, force="--force" in words)
            return RemoteResult(True, json.dumps(self.records[host]), "")
        return RemoteResult(True, "", "")

    def put_text(self, host: str, path: str, text: str) -> RemoteResult:
        self.written[(host, path)] = text
        return RemoteResult(True, "", "")

    def close(self) -> None:
        pass


@pytest.fixture
def nodes(monkeypatch: pytest.MonkeyPatch) -> Nodes:
    found = Nodes({A01: "serving", "gpu-a02.dc1.example.net": "retired", "gpu-a03.dc1.example.net": "suspect"})
    monkeypatch.setattr(cli_nodes, "PyinfraRemote", lambda inventory: found)
    return found


# tokens of a Hugging Face and a GitHub shape, made for this run: the cases name them, the repository keeps none
TOKENS = {"HF_TOKEN": "hf_" + secrets.token_hex(16), "GITHUB_TOKEN": "ghp_" + secrets.token_hex(18)}


def _arg(text: str) -> str:
    """A case's argument: FLEET and A01 stand for the inventory and its first node, HF_TOKEN and GITHUB_TOKEN for
    :data:`TOKENS`; {'x' * N} for a long one."""
    if text.startswith("{'") and text.endswith("}"):
        char, _, count = text[2:-1].partition("' * ")
        return char * int(count)
    for name, token in TOKENS.items():
        text = text.replace(name, token)
    return {"FLEET": FLEET, "A01": A01}.get(text, text)


BAD_INPUT: list[dict[str, Any]] = yaml.safe_load((DATA / "nodes_cli" / "bad_input.yml").read_text())


@pytest.mark.parametrize("case", BAD_INPUT, ids=[case["id"] for case in BAD_INPUT])
def test_bad_input_is_one_line_before_any_host(nodes: Nodes, case: dict[str, Any]) -> None:
    result = CliRunner().invoke(main, ["nodes", FLEET, *map(_arg, case["args"])])
    assert result.exit_code == 2, result.output
    line = case["line"].replace("FLEET", FLEET)
    assert len(result.output.splitlines()) == 1 and line in result.output, result.output
    assert _arg(case.get("never_shown", "\0")) not in result.output
    asked = [words for _, words in nodes.commands]
    assert (all("show" in words for words in asked) if case.get("reads_record") else asked == []), asked
    assert not nodes.written


def test_a_move_goes_through_the_nodes_own_tool(nodes: Nodes) -> None:
    result = CliRunner().invoke(main, ["nodes", FLEET, "quarantine", A01, "--why", "fans: loud \"rattle\""])
    assert result.exit_code == 0, result.output
    moved = [words for host, words in nodes.commands if host == A01 and "move" in words]
    assert len(moved) == 1 and moved[0][:3] == ["/usr/bin/python3", "/opt/gpufleet/node/node_watch.py", "move"]
    assert bytes.fromhex(moved[0][moved[0].index("--why-hex") + 1]).decode() == "fans: loud \"rattle\""
    assert nodes.records[A01]["state"] == "quarantined"
    assert result.output.startswith(f"{A01}: quarantined since 2026-11-27T12:00:00Z; 1 quarantine(s)")


def test_readmitting_a_suspect_node_clears_it_and_a_retired_one_needs_force(nodes: Nodes) -> None:
    a03, a02 = "gpu-a03.dc1.example.net", "gpu-a02.dc1.example.net"
    assert CliRunner().invoke(main, ["nodes", FLEET, "readmit", a03, "--why", "checked"]).exit_code == 0
    assert nodes.records[a03]["state"] == "serving"
    assert CliRunner().invoke(main, ["nodes", FLEET, "readmit", a02, "--why", "repaired", "--force"]).exit_code == 0
    assert nodes.records[a02]["state"] == "burn-in"


def test_a_full_burn_in_on_request_sends_a_node_in_service_to_burn_in(nodes: Nodes) -> None:
    result = CliRunner().invoke(main, ["nodes", FLEET, "burn-in", A01, "--why", "after the BMC firmware update"])
    assert result.exit_code == 0, result.output
    record = nodes.records[A01]
    assert (record["state"], record["requested"], record["quarantines"]) == ("burn-in", True, [])
    # out of service until its watch's full pass: a deploy places nothing on it, and does not admit it itself
    assert node_state.out_of_service(record) is not None and node_state.full_burn_in_due(record)


def test_the_list_names_every_serving_node(nodes: Nodes) -> None:
    result = CliRunner().invoke(main, ["nodes", FLEET, "--json"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)
    assert {h: r["state"] for h, r in shown.items()} == {A01: "serving", "gpu-a02.dc1.example.net": "retired",
                                                         "gpu-a03.dc1.example.net": "suspect"}


def test_the_longer_history_wins_and_is_kept_on_every_monitoring_host(nodes: Nodes) -> None:
    from gpufleet.remote import node_records

    own = nodes.records[A01]
    longer = node_state.move(own, "suspect", "Xid 92", NOW)
    nodes.records["monitor1"] = {}  # a host with no node tool: only its copies are read
    assert node_records.newer(own, longer) is longer and node_records.newer(None, own) is own
    assert node_records.newer(own, None) is own
    problems = node_records.keep(nodes, ["monitor1", "monitor2"], longer)
    assert problems == []
    for host in ("monitor1", "monitor2"):
        text = nodes.written[(host, f"{node_records.NODES_DIR}/{A01}.json.new")]
        assert json.loads(text) == longer and text.count("\n") == 1
        final = f"{node_records.NODES_DIR}/{A01}.json"
        assert (host, ["mv", "-f", f"{final}.new", final]) in nodes.commands
