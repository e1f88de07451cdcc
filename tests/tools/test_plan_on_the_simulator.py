"""The planner on facts the real NVML probe printed for a simulated node (the NVML simulator, which gcc builds).
The planner's rules: tests/unit/plan/test_plan.py.
"""

from __future__ import annotations

import pytest

from tests.conftest import Project, host_tool
from tests.unit.project_plans import cli_plan


@pytest.mark.parametrize(
    ("profile", "tp", "expected_sets"),
    [("4xA100-PCIe-pairs", 2, [[0, 1], [2, 3]]), ("8xH100-SXM", 8, [[0, 1, 2, 3, 4, 5, 6, 7]])],
)
def test_plan_from_probe_output_of_the_simulator(
    project: Project, tmp_path_factory: pytest.TempPathFactory, profile: str, tp: int, expected_sets: list[list[int]]
) -> None:
    """Real probe (real nvidia-ml-py, simulated driver library) -> saved facts -> plan --facts."""
    import subprocess
    import sys

    from gpufleet_lab.nvml_sim import build_library, sim_environ
    from gpufleet_lab.sim_profile import write_sim_profile

    from tests.conftest import ROOT

    host_tool("gcc", "gcc")
    lib = build_library(tmp_path_factory.getbasetemp() / "nvml-sim")
    sim_profile = project.root / "sim-profile"
    write_sim_profile(sim_profile, profile, hostname="h1")
    probe = subprocess.run([sys.executable, str(ROOT / "gpufleet/node/nvml_probe.py")], capture_output=True,
                           text=True, env=sim_environ(lib, sim_profile), timeout=60)
    assert probe.returncode == 0, probe.stderr
    facts = project.root / "facts"
    facts.mkdir()
    (facts / "h1.json").write_text(probe.stdout)
    rc, replicas, err = cli_plan(project, f"""
        vllm_model: meta-llama/Llama-3.1-70B-Instruct
        vllm_tensor_parallel_size: {tp}
        vllm_max_model_len: 4096
    """, 'a = ["h1"]', "--facts", str(facts))
    assert rc == 0, err
    assert [r["gpus"]["h1"] for r in replicas] == expected_sets
    assert "without NVLink" not in err
