"""``gpufleet diag`` (gpufleet/cli/diag.py) on a real inventory (tests/data/rollout_fleet) whose nodes are fake nodes
running the real node tool (tests/unit/diag_nodes.py): bad input refused with one line before any host is contacted
(cases as data: tests/data/diag_cli/bad_input.yml), the findings printed first, then the archive, then each node."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from gpufleet.cli import diag as cli_diag
from gpufleet.cli.main import main
from tests.conftest import DATA
from tests.unit.diag_nodes import FakeNode, LocalNodes

FLEET = str(DATA / "rollout_fleet" / "inventory.py")
A01, A02 = "gpu-a01.dc1.example.net", "gpu-a02.dc1.example.net"
HF_TOKEN = "hf_" + secrets.token_hex(16)


@pytest.fixture
def nodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> LocalNodes:
    fleet = {host: FakeNode(tmp_path / host, ["vllm@llama_70b-0.service"]) for host in (A01, A02)}
    fleet[A01].journal("vllm@llama_70b-0.service",
                       "2026-11-20T10:00:01+0000 gpu-a01 python[900]: torch.OutOfMemoryError: CUDA out of memory."
                       " Tried to allocate 2.00 GiB\n")
    (fleet[A02].journals / "kernel.log").write_text(
        "2026-11-21T03:12:09+00:00 gpu-a02 kernel: NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus\n")
    found = LocalNodes(fleet)
    monkeypatch.setattr(cli_diag, "PyinfraRemote", lambda inventory: found)
    return found


def _arg(text: str, tmp_path: Path) -> str:
    (tmp_path / "existing.tar.gz").touch()
    return {"FLEET": FLEET, "OUT": str(tmp_path / "new.tar.gz"), "EXISTING": str(tmp_path / "existing.tar.gz"),
            "NO_DIR": str(tmp_path / "none" / "d.tar.gz")}.get(text, text.replace("HF_TOKEN", HF_TOKEN))


BAD_INPUT: list[dict[str, Any]] = yaml.safe_load((DATA / "diag_cli" / "bad_input.yml").read_text())


@pytest.mark.parametrize("case", BAD_INPUT, ids=[case["id"] for case in BAD_INPUT])
def test_bad_input_is_one_line_before_any_host(nodes: LocalNodes, tmp_path: Path, case: dict[str, Any]) -> None:
    result = CliRunner().invoke(main, ["diag", FLEET, *(_arg(a, tmp_path) for a in case["args"])])
    assert result.exit_code == 2, result.output
    assert len(result.output.splitlines()) == 1 and case["line"].replace("FLEET", FLEET) in result.output, \
        result.output
    assert "Traceback" not in result.output
    assert case.get("never_shown", "\0").replace("HF_TOKEN", HF_TOKEN) not in result.output
    assert nodes.calls == []
    assert not (tmp_path / "new.tar.gz").exists()


def test_the_findings_come_first_then_the_archive_then_each_node(nodes: LocalNodes, tmp_path: Path) -> None:
    out = tmp_path / "diag.tar.gz"
    result = CliRunner().invoke(main, ["diag", FLEET, "--host", A01, "--host", A02, "--since", "2h",
                                       "--out", str(out)])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == "findings: 2"
    assert lines[1].startswith(f"  {A01}: ") and "vllm@llama_70b-0.service since 2026-11-20T10:00:01+0000" in lines[1]
    assert lines[2].startswith(f"  {A02}: Xid 79 on the GPU at PCI 0000:3b:00")
    assert lines[2].endswith("read docs/guide/when-things-fail.md#xid")
    assert lines[3].startswith(f"archive: {out} (") and out.stat().st_mode & 0o777 == 0o600
    assert lines[4].startswith(f"{A01}: ") and "bytes of the last 2h (cap 64 MiB)" in lines[4]
    assert lines[5].startswith(f"{A02}: ") and len(lines) == 6
    assert {host for host, _ in nodes.calls} == {A01, A02}


def test_a_node_that_gives_nothing_is_said_and_exits_1(nodes: LocalNodes, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    nodes.silent = {A02}
    monkeypatch.setattr(cli_diag, "collect", _bounded(cli_diag.collect, 4))
    result = CliRunner().invoke(main, ["diag", FLEET, "--host", A01, "--host", A02, "--out",
                                       str(tmp_path / "d.tar.gz")])
    nodes.release.set()
    assert result.exit_code == 1, result.output
    assert result.stdout.splitlines()[-1].startswith(f"{A02}: 4.0 s, nothing collected: no answer within the bound")


def _bounded(collect: Any, bound_s: float) -> Any:
    return lambda *args, **kwargs: collect(*args, **kwargs, bound_s=bound_s)
