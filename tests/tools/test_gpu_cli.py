"""``gpufleet probe`` and ``gpufleet gate`` for real: pyinfra's @local connector, the NVML simulator on
LD_LIBRARY_PATH."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
from click.testing import CliRunner
from gpufleet_lab.nvml_sim import build_library, sim_environ
from gpufleet_lab.sim_profile import apply_fault, write_sim_profile
from pyinfra.api.exceptions import FactProcessError
from pyinfra.context import ctx_host, ctx_state

from gpufleet.cli.gpu import make_gate_command
from gpufleet.facts.gpu import NvmlGpuFacts
from gpufleet.gpu.profiles import profile_facts
from gpufleet.gpu.report import NodeFacts, load_facts, parse_facts
from gpufleet.node.health_rules import HealthPolicy, evaluate
from gpufleet.operations import gates
from gpufleet.remote.gpu_probe import gate_report
from tests.conftest import DATA, host_tool
from tests.unit.fake_hosts import FakeHost, FakeState

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ["--python", sys.executable]  # the nodes' python: here, one that has nvidia-ml-py


@pytest.fixture
def local_inventory(tmp_path: Path) -> Path:
    path = tmp_path / "inventories" / "lab.py"
    path.parent.mkdir()
    path.write_text('hosts = ["@local"]\n')
    return path


def gpufleet(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """The real ``gpufleet`` command in a subprocess (the simulator loads only at process start)."""
    return subprocess.run([sys.executable, "-m", "gpufleet.cli.main", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def simulated(sim_lib: Path, tmp_path: Path, name: str,
              faults: Sequence[tuple[str, int]] = ()) -> tuple[dict[str, str], NodeFacts]:
    profile = tmp_path / "nvml-sim-profile"
    return sim_environ(sim_lib, profile), write_sim_profile(profile, name, faults)


def test_probe_inventory_writes_each_hosts_facts(sim_lib: Path, tmp_path: Path, local_inventory: Path) -> None:
    env, expected = simulated(sim_lib, tmp_path, "8xH100-SXM")
    out = tmp_path / "facts"
    result = gpufleet(env, "probe", str(local_inventory), "--out", str(out), *PYTHON)
    assert result.returncode == 0, result.stdout + result.stderr
    assert load_facts(out / "@local.json") == expected
    assert result.stdout == (f"@local: 8 x NVIDIA H100 80GB HBM3, driver 580.95.05 (CUDA 13.0), "
                             f"NVLink islands [0,1,2,3,4,5,6,7] -> {out / '@local.json'}\n")


def test_probe_inventory_json(sim_lib: Path, tmp_path: Path, local_inventory: Path) -> None:
    env, expected = simulated(sim_lib, tmp_path, "4xA100-PCIe-pairs")
    result = gpufleet(env, "probe", str(local_inventory), "--json", *PYTHON)
    assert result.returncode == 0, result.stderr
    assert parse_facts(json.loads(result.stdout)["@local"]) == expected


def test_probe_without_python_on_the_host_fails(sim_lib: Path, tmp_path: Path, local_inventory: Path) -> None:
    env, _ = simulated(sim_lib, tmp_path, "2xRTX4090")
    result = gpufleet(env, "probe", str(local_inventory), "--python", str(tmp_path / "no-python"))
    assert result.returncode == 1
    assert "@local: no facts: the NVML probe gave no facts: is" in result.stderr
    assert "not found" in result.stderr  # the shell's own words, passed on by pyinfra


def test_probe_local(sim_lib: Path, tmp_path: Path) -> None:
    env, expected = simulated(sim_lib, tmp_path, "8xA100-SXM")
    result = gpufleet(env, "probe", "--local", "--json")
    assert result.returncode == 0, result.stderr
    assert parse_facts(json.loads(result.stdout)) == expected
    text = gpufleet(env, "probe", "--local")
    assert text.stdout.endswith(": 8 x NVIDIA A100-SXM4-80GB, driver 580.95.05 (CUDA 13.0), "
                                "NVLink islands [0,1,2,3,4,5,6,7]\n")


def test_probe_local_without_nvml(tmp_path: Path) -> None:
    (tmp_path / "libnvidia-ml.so.1").write_bytes(b"")
    result = gpufleet(sim_environ(tmp_path / "libnvidia-ml.so.1", tmp_path / "none"), "probe", "--local")
    assert result.returncode == 0 and "Traceback" not in result.stderr
    assert ": no NVML on this node: nvmlInit: NVML Shared Library Not Found" in result.stdout


@pytest.mark.parametrize("args", [[], ["inv.py", "--local"]])
def test_probe_needs_an_inventory_or_local(sim_lib: Path, tmp_path: Path, args: list[str]) -> None:
    result = gpufleet(simulated(sim_lib, tmp_path, "2xRTX4090")[0], "probe", *args)
    assert result.returncode == 2 and "give an INVENTORY or --local (not both)" in result.stderr


def test_gate_live_passes_a_healthy_node(sim_lib: Path, tmp_path: Path, local_inventory: Path) -> None:
    env, _ = simulated(sim_lib, tmp_path, "8xL40S-PCIe")
    result = gpufleet(env, "gate", str(local_inventory), *PYTHON)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == ("@local: PASS (8 x NVIDIA L40S, driver 580.95.05)\n"
                             "gpu gate: 1 of 1 nodes pass\n")


def test_gate_live_names_the_failed_rule(sim_lib: Path, tmp_path: Path, local_inventory: Path) -> None:
    env, _ = simulated(sim_lib, tmp_path, "8xH100-SXM", [("fabric_in_progress", 5), ("pcie_x8", 0)])
    result = gpufleet(env, "gate", str(local_inventory), "--json", *PYTHON)
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert report["passed"] is False
    assert report["hosts"][0]["failures"] == [
        {"rule": "pcie_width", "gpu": 0, "evidence": "PCIe link x8, max x16"},
        {"rule": "fabric_completed", "gpu": 5,
         "evidence": "fabric state in_progress, status None; expected completed with success"},
    ]


def test_gate_live_without_nvml_fails(tmp_path: Path, local_inventory: Path) -> None:
    (tmp_path / "libnvidia-ml.so.1").write_bytes(b"")
    result = gpufleet(sim_environ(tmp_path / "libnvidia-ml.so.1", tmp_path / "none"), "gate", str(local_inventory),
                      *PYTHON)
    assert result.returncode == 1
    assert "  nvml (node): no NVML on this node: nvmlInit: NVML Shared Library Not Found" in result.stdout
    assert result.stdout.endswith("gpu gate: 0 of 1 nodes pass, 1 fail\n")


def test_gate_on_saved_facts(sim_lib: Path, tmp_path: Path, local_inventory: Path) -> None:
    env, _ = simulated(sim_lib, tmp_path, "4xA100-PCIe-pairs", [("link_down", 2)])
    out = tmp_path / "facts"
    assert gpufleet(env, "probe", str(local_inventory), "--out", str(out), *PYTHON).returncode == 0
    result = gpufleet(env, "gate", str(local_inventory), "--facts", str(out))
    assert result.returncode == 1
    assert result.stdout.splitlines() == [
        "@local: FAIL (4 x NVIDIA A100 80GB PCIe, driver 580.95.05)",
        "  nvlinks_active (gpu 2): 1 of 12 NVLinks inactive (links 11); 11 active",
        "  nvlinks_active (gpu 3): 1 of 12 NVLinks inactive (links 11); 11 active",
        "gpu gate: 0 of 1 nodes pass, 1 fail",
    ]


def test_gate_without_saved_facts_for_a_host(sim_lib: Path, tmp_path: Path, local_inventory: Path) -> None:
    (tmp_path / "empty").mkdir()
    result = gpufleet(simulated(sim_lib, tmp_path, "2xRTX4090")[0], "gate", str(local_inventory),
                      "--facts", str(tmp_path / "empty"))
    assert result.returncode == 1
    missing = tmp_path / "empty" / "@local.json"
    assert f"  probe (node): {missing}: expected a readable file, found No such file or directory" in result.stdout


def test_gate_uses_each_hosts_policy(tmp_path: Path, local_inventory: Path) -> None:
    (tmp_path / "facts").mkdir()
    facts = profile_facts("8xH100-SXM", "gpu-a01")
    (tmp_path / "facts" / "@local.json").write_text(facts.to_json())
    asked: list[str] = []

    def policy_for_host(host: str) -> HealthPolicy:
        asked.append(host)
        return HealthPolicy(expected_gpu_model="H200")

    result = CliRunner().invoke(make_gate_command(policy_for_host),
                                [str(local_inventory), "--facts", str(tmp_path / "facts")])
    assert result.exit_code == 1 and asked == ["@local"]
    assert "  gpu_model (gpu 7): 'NVIDIA H100 80GB HBM3' does not contain 'H200'" in result.output


def test_a_gpu_lost_at_run_time_is_named_by_gate_and_by_check(tmp_path: Path, local_inventory: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The NvmlGpuFacts case of a GPU lost at run time: ``gpufleet gate`` names the node and each failed rule, and
    deploys/check.py fails the node with the same lines (the deploy context's gate failures are health_rules' lines,
    which gates.check_report's case prints)."""
    lost = json.loads((DATA / "facts" / "NvmlGpuFacts" / "gpu_lost_at_run_time.json").read_text())["fact"]
    (tmp_path / "facts").mkdir()
    (tmp_path / "facts" / "@local.json").write_text(json.dumps(lost))
    policy = HealthPolicy(expected_gpu_count=2)
    result = CliRunner().invoke(make_gate_command(lambda host: policy),
                                [str(local_inventory), "--facts", str(tmp_path / "facts")])
    assert result.exit_code == 1
    assert result.output.splitlines() == [
        "@local: FAIL (1 x NVIDIA GeForce RTX 4090, driver 580.95.05)",
        "  nvml_errors (gpu 1): nvmlDeviceGetHandleByIndex failed: GPU is lost",
        "  gpu_count (node): found 1 GPUs (indices 0), expected 2",
        "gpu gate: 0 of 1 nodes pass, 1 fail",
    ]
    lines = [failure.line() for failure in evaluate(lost, policy)]
    case = ROOT / "tests" / "data" / "operations" / "gates.check_report" / "gpu_lost_names_the_rule_and_the_gpu.json"
    assert json.loads(case.read_text())["arguments"]["gate_failures"] == lines
    with ctx_host.use(FakeHost({})), ctx_state.use(FakeState()):
        assert list(gates.check_report._inner(gate_failures=lines))  # fails the host, one "gate: <line>" each
    assert "[10.0.0.5] gate: fail; drift: 0 operation(s)" in capsys.readouterr().err


def test_gate_report_mixes_probed_and_unprobed_hosts() -> None:
    healthy = profile_facts("8xH100-SXM", "gpu-a01")
    report = gate_report({"gpu-a01": healthy, "gpu-a02": apply_fault(healthy, "persistence_off", 3)},
                         unprobed={"gpu-a03": "cannot connect"})
    assert [(v["host"], v["passed"]) for v in report.verdicts] == [("gpu-a01", True), ("gpu-a02", False),
                                                                   ("gpu-a03", False)]
    assert report.verdicts[2]["failures"] == [{"rule": "probe", "gpu": None, "evidence": "cannot connect"}]
    assert not report.passed and report.to_json()["passed"] is False
    assert report.text().splitlines()[-1] == "gpu gate: 1 of 3 nodes pass, 2 fail"


def test_fact_ships_the_probe_inside_its_command() -> None:
    command = str(NvmlGpuFacts().command(python="/opt/gpufleet/bin/python3"))
    assert command.startswith("/opt/gpufleet/bin/python3 -c ")
    assert command.endswith(" --compact")
    assert len(command) < 128 * 1024  # one argument of `sh -c` on the node (MAX_ARG_STRLEN)


def test_fact_command_probes_a_node_whose_python_has_no_pynvml(tmp_path: Path) -> None:
    host_tool("gcc", "gcc")
    library = build_library(tmp_path / "sim")
    write_sim_profile(tmp_path / "profile", "2xRTX4090")
    code = NvmlGpuFacts().command(python=sys.executable).bits[2].obj
    # -S: no site-packages, so no pynvml: the copy inside the command answers
    done = subprocess.run([sys.executable, "-S", "-c", code, "--compact"], capture_output=True, text=True,
                          env=sim_environ(library, tmp_path / "profile"), timeout=60)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout.splitlines()[-1])
    assert doc["nvml"]["available"] is True
    assert [g["name"] for g in doc["gpus"]] == ["NVIDIA GeForce RTX 4090"] * 2


def test_fact_parses_the_probe_output() -> None:
    doc = profile_facts("2xRTX4090", "n").model_dump(mode="json", by_alias=True)
    assert NvmlGpuFacts().process([json.dumps(doc)]) == doc
    with pytest.raises(FactProcessError, match="printed no facts JSON"):
        NvmlGpuFacts().process(["Traceback (most recent call last):", "boom"])


def test_importing_the_commands_leaves_the_stdlib_unpatched() -> None:
    # pyinfra_cli's import monkey-patches the process for gevent; the probe must not drag it in.
    code = ("import sys, gpufleet.cli.gpu; from gevent import monkey; "
            "print(monkey.is_module_patched('socket'), 'pyinfra_cli' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.split() == ["False", "False"], result.stderr


def test_inventory_groups_and_host_data(tmp_path: Path) -> None:
    from gpufleet.remote.gpu_probe import load_inventory

    path = tmp_path / "prod.py"
    path.write_text('gpu_a = ([("gpu-a01", {"ssh_port": 2201}), "gpu-a02"], {"ssh_user": "ops"})\n'
                    'gpu_b = ["gpu-b01"]\n_private = ["nope"]\nnot_a_group = 3\n')
    inventory = load_inventory(path)
    assert [h.name for h in inventory] == ["gpu-a01", "gpu-a02", "gpu-b01"]
    assert sorted(g for g in inventory.groups) == ["gpu_a", "gpu_b", "prod"]
    host = inventory.get_host("gpu-a01")
    assert (host.data.ssh_port, host.data.ssh_user) == (2201, "ops")
