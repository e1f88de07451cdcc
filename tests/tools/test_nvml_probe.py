"""The NVML probe against the NVML simulator: real nvidia-ml-py in a subprocess, only the driver library simulated."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
from gpufleet_lab.nvml_sim import build_library, sim_environ
from gpufleet_lab.sim_profile import FAULTS, FaultError, apply_fault, sim_profile_text, write_sim_profile

from gpufleet.gpu.profiles import profile_facts
from gpufleet.gpu.report import NodeFacts, parse_facts
from gpufleet.gpu.topology import nvlink_islands
from tests.nvml_probe_run import run_probe

ROOT = Path(__file__).resolve().parents[2]
PROFILES = ["8xH100-SXM", "8xH200-SXM", "8xA100-SXM", "8xL40S-PCIe", "4xA100-PCIe-pairs", "2xRTX4090"]


def probe_profile(sim_lib: Path, tmp_path: Path, name: str,
                  faults: Sequence[tuple[str, int]] = ()) -> tuple[NodeFacts, NodeFacts]:
    """(what the probe printed, what the profile says) for a simulated node."""
    profile = tmp_path / "nvml-sim-profile"
    expected = write_sim_profile(profile, name, faults)
    result = run_probe(sim_environ(sim_lib, profile))
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    return parse_facts(json.loads(result.stdout), "probe"), expected


@pytest.mark.parametrize("name", PROFILES)
def test_probe_reports_exactly_what_the_profile_declares(sim_lib: Path, tmp_path: Path, name: str) -> None:
    got, expected = probe_profile(sim_lib, tmp_path, name)
    assert got == expected
    assert got == profile_facts(name, got.hostname)  # the declared profile, not only the simulator's file


@pytest.mark.parametrize(("name", "islands"), [
    ("8xH100-SXM", [list(range(8))]),
    ("8xA100-SXM", [list(range(8))]),
    ("4xA100-PCIe-pairs", [[0, 1], [2, 3]]),
    ("8xL40S-PCIe", [[i] for i in range(8)]),
    ("2xRTX4090", [[0], [1]]),
])
def test_nvlink_islands_from_probed_facts(sim_lib: Path, tmp_path: Path, name: str, islands: list[list[int]]) -> None:
    got, _ = probe_profile(sim_lib, tmp_path, name)
    assert nvlink_islands(got) == islands


def test_hgx_h100_shape(sim_lib: Path, tmp_path: Path) -> None:
    got, _ = probe_profile(sim_lib, tmp_path, "8xH100-SXM")
    gpu = got.gpus[0]
    assert (got.driver_version, got.cuda_driver_version, got.nvml_version) == ("580.95.05", "13.0", "13.580.95.05")
    assert gpu.name == "NVIDIA H100 80GB HBM3" and gpu.compute_capability == "9.0"
    assert gpu.memory_total_bytes == 85520809984
    assert len(gpu.nvlinks or []) == 18
    assert all(link.active and link.remote_device_type == "switch" for link in gpu.nvlinks or [])
    assert gpu.fabric is not None and (gpu.fabric.state, gpu.fabric.status) == ("completed", "success")
    assert gpu.clock_event_reasons is not None and gpu.clock_event_reasons.active == ["gpu_idle"]
    numa = (gpu.numa_node, gpu.cpu_affinity, got.gpus[7].numa_node, got.gpus[7].cpu_affinity)
    assert numa == (0, "0-63", 1, "64-127")
    assert got.topology[0] == ["X"] + ["NV18"] * 7
    assert gpu.unsupported == [] and got.errors == []


def test_unsupported_queries_are_null_and_named(sim_lib: Path, tmp_path: Path) -> None:
    a100, _ = probe_profile(sim_lib, tmp_path, "8xA100-SXM")
    assert a100.gpus[0].fabric is None and a100.gpus[0].unsupported == ["fabric"]
    assert a100.topology[0][1] == "NV12"
    l40s, _ = probe_profile(sim_lib, tmp_path, "8xL40S-PCIe")
    assert l40s.gpus[0].nvlinks is None and l40s.gpus[0].mig is None
    assert l40s.gpus[0].unsupported == ["fabric", "mig", "nvlinks"]
    assert l40s.topology[0] == ["X", "NODE", "NODE", "NODE", "SYS", "SYS", "SYS", "SYS"]
    rtx, _ = probe_profile(sim_lib, tmp_path, "2xRTX4090")
    assert rtx.gpus[0].ecc is None and rtx.gpus[0].remapped_rows is None
    assert {"ecc", "remapped_rows"} <= set(rtx.gpus[0].unsupported)


def test_bridged_pairs_topology(sim_lib: Path, tmp_path: Path) -> None:
    got, _ = probe_profile(sim_lib, tmp_path, "4xA100-PCIe-pairs")
    assert got.topology == [["X", "NV12", "SYS", "SYS"], ["NV12", "X", "SYS", "SYS"],
                            ["SYS", "SYS", "X", "NV12"], ["SYS", "SYS", "NV12", "X"]]
    assert {link.remote_pci_bus_id for link in got.gpus[0].nvlinks or []} == {got.gpus[1].pci_bus_id}


def _link_down(f: NodeFacts) -> None:
    links = f.gpus[2].nvlinks or []
    assert [link.link for link in links if not link.active] == [17]
    assert f.topology[2] == ["NV17", "NV17", "X"] + ["NV17"] * 5


def _fabric_in_progress(f: NodeFacts) -> None:
    assert f.gpus[2].fabric is not None and f.gpus[2].fabric.state == "in_progress" and f.gpus[2].fabric.status is None
    assert nvlink_islands(f) == [[0, 1, 3, 4, 5, 6, 7], [2]]
    assert f.topology[2] == ["NODE", "NODE", "X", "NODE", "SYS", "SYS", "SYS", "SYS"]


def _pending_row_remap(f: NodeFacts) -> None:
    rows = f.gpus[2].remapped_rows
    assert rows is not None and rows.pending and rows.correctable == 1 and not rows.failure


def _pcie_x8(f: NodeFacts) -> None:
    pcie = f.gpus[2].pcie
    assert pcie is not None and (pcie.width_current, pcie.width_max) == (8, 16)


def _persistence_off(f: NodeFacts) -> None:
    assert [g.persistence_mode for g in f.gpus] == [True, True, False] + [True] * 5


def _gpu_missing(f: NodeFacts) -> None:
    assert [g.index for g in f.gpus] == list(range(7)) and len(f.topology) == 7
    assert f.gpus[2].pci_bus_id == "00000000:48:00.0"  # GPU 3's bus: the rest renumbered
    assert f.errors == []


def _gpu_lost(f: NodeFacts) -> None:
    assert [g.index for g in f.gpus] == [0, 1, 3, 4, 5, 6, 7]
    assert [(e.gpu, e.query, e.error) for e in f.errors] == [(2, "nvmlDeviceGetHandleByIndex", "GPU is lost")]


FAULT_CHECKS = {"link_down": _link_down, "fabric_in_progress": _fabric_in_progress,
                "pending_row_remap": _pending_row_remap, "pcie_x8": _pcie_x8, "persistence_off": _persistence_off,
                "gpu_missing": _gpu_missing, "gpu_lost": _gpu_lost}


def test_every_fault_has_a_check() -> None:
    assert set(FAULT_CHECKS) == set(FAULTS)


@pytest.mark.parametrize("fault", sorted(FAULT_CHECKS))
def test_probe_shows_each_fault(sim_lib: Path, tmp_path: Path, fault: str) -> None:
    got, expected = probe_profile(sim_lib, tmp_path, "8xH100-SXM", [(fault, 2)])
    assert got == expected
    FAULT_CHECKS[fault](got)


def test_link_down_on_a_bridged_pair_downs_both_ends(sim_lib: Path, tmp_path: Path) -> None:
    got, expected = probe_profile(sim_lib, tmp_path, "4xA100-PCIe-pairs", [("link_down", 1)])
    assert got == expected
    assert [link.active for link in got.gpus[0].nvlinks or []].count(False) == 1
    assert got.topology[0][1] == got.topology[1][0] == "NV11"
    assert nvlink_islands(got) == [[0, 1], [2, 3]]


def test_faults_that_do_not_apply_are_refused() -> None:
    l40s, rtx, a100 = (profile_facts(n, "h") for n in ("8xL40S-PCIe", "2xRTX4090", "8xA100-SXM"))
    with pytest.raises(FaultError, match="no active NVLink"):
        apply_fault(l40s, "link_down")
    with pytest.raises(FaultError, match="no row remapping"):
        apply_fault(rtx, "pending_row_remap")
    with pytest.raises(FaultError, match="no fabric info"):
        apply_fault(a100, "fabric_in_progress")
    with pytest.raises(FaultError, match="no GPU 9"):
        apply_fault(a100, "pcie_x8", 9)
    with pytest.raises(FaultError, match="unknown fault 'melted'"):
        apply_fault(a100, "melted")


def test_profile_text_is_marked_as_a_lab_double() -> None:
    text = sim_profile_text(profile_facts("2xRTX4090", "h"))
    assert text.startswith("# NVML simulator profile: a LAB DOUBLE")
    assert "device_count 2\n" in text and "unsupported ecc fabric mig nvlinks remapped_rows\n" in text


def _assert_no_nvml(result: subprocess.CompletedProcess[str], reason: str) -> None:
    assert result.returncode == 0
    assert "Traceback" not in result.stderr
    doc = json.loads(result.stdout)
    facts = parse_facts(doc, "probe")
    assert not facts.nvml.available and facts.gpus == []
    assert facts.nvml.error is not None and facts.nvml.error.startswith("no NVML on this node: ")
    assert reason in facts.nvml.error


def test_no_driver_library(tmp_path: Path) -> None:
    # An unloadable libnvidia-ml.so.1 first on the path hides any real one, as a missing driver would.
    (tmp_path / "libnvidia-ml.so.1").write_bytes(b"")
    result = run_probe(sim_environ(tmp_path / "libnvidia-ml.so.1", tmp_path / "none"))
    _assert_no_nvml(result, "NVML Shared Library Not Found")


def test_driver_not_loaded(sim_lib: Path, tmp_path: Path) -> None:
    result = run_probe(sim_environ(sim_lib, tmp_path / "no-such-profile"))
    _assert_no_nvml(result, "nvmlInit: Driver Not Loaded")
    assert "cannot open profile" in result.stderr  # the simulator says why


def test_no_pynvml(sim_lib: Path, tmp_path: Path) -> None:
    result = run_probe(sim_environ(sim_lib, tmp_path / "p"), python=(sys.executable, "-S"))  # -S: no site-packages
    _assert_no_nvml(result, "pynvml (nvidia-ml-py) is not installed")


def test_malformed_profile_fails_init_with_the_line(sim_lib: Path, tmp_path: Path) -> None:
    profile = tmp_path / "p"
    profile.write_text(sim_profile_text(profile_facts("2xRTX4090", "h")).replace("pcie 4 4 16 16", "pcie 4 four"))
    result = run_probe(sim_environ(sim_lib, profile))
    _assert_no_nvml(result, "nvmlInit: Unknown Error")
    assert "cannot read: pcie 4 four" in result.stderr


def test_compact_output_is_one_line(sim_lib: Path, tmp_path: Path) -> None:
    profile = tmp_path / "p"
    expected = write_sim_profile(profile, "2xRTX4090")
    result = run_probe(sim_environ(sim_lib, profile), "--compact")
    assert result.stdout.count("\n") == 1
    assert parse_facts(json.loads(result.stdout)) == expected


def test_library_is_cached_by_source_hash(sim_lib: Path) -> None:
    before = sim_lib.stat().st_mtime_ns
    assert build_library(sim_lib.parent) == sim_lib
    assert sim_lib.stat().st_mtime_ns == before


@pytest.mark.parametrize(("name", "beyond"), [("nvml_probe.py", {"pynvml"}), ("health_rules.py", set()),
                                              ("ray_join_wait.py", {"ray"}), ("__init__.py", set())])
def test_node_files_import_only_stdlib_and_pynvml(name: str, beyond: set[str]) -> None:
    """The node's Python runs them: the standard library, NVML's bindings, and for the Ray join wait (run with a Ray
    replica's release), its Ray."""
    tree = ast.parse((ROOT / "gpufleet" / "node" / name).read_text())
    imported = {alias.name.split(".")[0]
                for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
    assert imported - set(sys.stdlib_module_names) <= beyond


def _bindings_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, node_copy: bytes | None) -> str:
    """Which ``pynvml`` the deploy's probe command imports on a node whose Python has none (``-S``: no
    site-packages), with ``node_copy`` (or nothing) at the node tools' pynvml.py."""
    from gpufleet.facts import gpu as facts
    tools = tmp_path / "tools"
    tools.mkdir()
    if node_copy is not None:
        (tools / "pynvml.py").write_bytes(node_copy)
    monkeypatch.setattr(facts, "NODE_PYNVML", str(tools / "pynvml.py"))
    code = facts.probe_command_line().bits[2].obj
    head = code.rsplit("exec(compile(_unpack(", 1)[0]  # everything before the probe itself runs
    done = subprocess.run([sys.executable, "-S", "-c", head + "print(sys.modules['pynvml'].__file__)\n"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_probe_imports_the_node_copy_of_the_controllers_bindings(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from gpufleet.facts.gpu import controller_pynvml
    ours = controller_pynvml().read_bytes()
    assert _bindings_used(tmp_path, monkeypatch, ours) == str(tmp_path / "tools" / "pynvml.py")


@pytest.mark.parametrize("copy", [None, b"raise SystemError('a damaged copy')\n", b"# another version\n"])
def test_without_a_faithful_node_copy_the_probe_brings_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               copy: bytes | None) -> None:
    assert _bindings_used(tmp_path, monkeypatch, copy) == "pynvml.py"  # the copy inside the command
