"""Golden plans: every deploy shape the guide shows, planned offline as ``gpufleet plan`` plans it.

Each ``tests/data/plans/<shape>/`` holds an inventory, its ``group_vars/`` and ``expected.json``: the
``gpufleet plan --json`` output (``replicas``), its warnings, the line ``gpufleet plan`` prints for every process
(``lines``), and for every vLLM process its ``config.yaml`` text and ``vllm.env`` values (``files``, by replica
and host). The blocks of docs/guide/deploy-shapes.md are checked against them, so the guide cannot drift from the
code.

After a deliberate change, rewrite the expected files and review their diff::

    GPUFLEET_REGOLD=1 .venv/bin/pytest -q tests/unit/plan/test_golden_plans.py
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpufleet.cli.inputs import fleet_facts
from gpufleet.config.schema import SECRET_KEYS
from gpufleet.inventory.load import load_fleet
from gpufleet.plan.planner import plan_fleet
from gpufleet.units.escape import env_file
from roles.vllm import replica_files as vf
from tests.conftest import DATA, ROOT

PLANS = DATA / "plans"
PROJECT_GROUP_VARS = (ROOT / "group_vars", ROOT / "inventories" / "lab" / "group_vars")  # the example's, the lab's
SHAPES = sorted(path.parent.name for path in PLANS.glob("*/inventory.py"))
REGOLD = os.environ.get("GPUFLEET_REGOLD") == "1"

DEPLOY_SHAPES = ROOT / "docs" / "guide" / "deploy-shapes.md"
# The guide's plan blocks, in order, and the shape each shows; the shape its (a) and (b) inputs describe.
GUIDE_PLAN_BLOCKS = ["a_single_node_70b", "b_two_nodes_mp", "b_two_nodes_ray"]
GUIDE_SECTIONS = {"(a)": "a_single_node_70b", "(b)": "b_two_nodes_mp"}
# The replica whose config.yaml and vllm.env the guide shows, in shape (a).
GUIDE_FILES_OF = ("a_single_node_70b", "llama_70b-gpu-a01-0", "gpu-a01.dc1.example.net")


def render(shape: str) -> dict[str, Any]:
    """Everything a shape's plan gives, as expected.json holds it."""
    fleet = load_fleet(str(PLANS / shape / "inventory.py"))
    plan = plan_fleet(fleet, fleet_facts(fleet, None))
    assert [p.line() for p in plan.problems] == [], shape
    files: dict[str, dict[str, dict[str, Any]]] = {}
    for replica in plan.replicas:
        for role in replica.roles:
            for process in role.processes:
                if process.unit == "vllm":
                    files.setdefault(replica.name, {})[role.host] = {
                        "config.yaml": process.config_yaml(),
                        "vllm.env": vf.replica_env(fleet.configs[role.host], process.env),
                    }
    rendered = {
        "replicas": [r.to_json() for r in plan.replicas],
        "warnings": plan.warnings,
        "lines": [r.process_line(role, p) for r in plan.replicas for role in r.roles for p in role.processes],
        "files": files,
    }
    return dict(json.loads(json.dumps(rendered)))  # as read back from JSON: tuples are lists


def expected(shape: str) -> dict[str, Any]:
    return dict(json.loads((PLANS / shape / "expected.json").read_text()))


@pytest.fixture
def no_secrets(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No secret the group_vars refer to can be read: the planner never reads them."""
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("HF_TOKEN", "RAY_AUTH_TOKEN"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.usefixtures("no_secrets")
@pytest.mark.parametrize("shape", SHAPES)
def test_golden_plan(shape: str) -> None:
    found = render(shape)
    path = PLANS / shape / "expected.json"
    if REGOLD:
        path.write_text(json.dumps(found, indent=2, ensure_ascii=False) + "\n")
    assert found == expected(shape), f"{shape}: the plan changed; if on purpose, regold (see this module's doc)"


def test_every_readme_shape_has_a_golden_plan() -> None:
    assert {*GUIDE_PLAN_BLOCKS, *GUIDE_SECTIONS.values(), "lab_single", "lab_pipeline"} <= set(SHAPES)


@pytest.mark.parametrize("shape", SHAPES)
def test_golden_inputs_are_the_projects(shape: str) -> None:
    """A group_vars file the project has (the production example's, the lab's) is copied as is; secrets are
    references only."""
    for path in sorted((PLANS / shape / "group_vars").glob("*.yml")):
        project = next((d / path.name for d in PROJECT_GROUP_VARS if (d / path.name).is_file()), None)
        if project is not None:
            assert path.read_text() == project.read_text(), f"copy {project} to {path} and regold"
        for key, value in (yaml.safe_load(path.read_text()) or {}).items():
            if key in SECRET_KEYS and value is not None:
                assert set(value) <= {"env", "file"}, (path, key)


def test_the_tiny_model_is_the_labs() -> None:
    tiny = pytest.importorskip("gpufleet_lab.tiny_model")
    arch = tiny.TinyLlama()
    assert json.loads((PLANS / "tiny-llama" / "config.json").read_text()) == arch.config()
    index = json.loads((PLANS / "tiny-llama" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 2 * sum(math.prod(s) for s in arch.tensor_shapes().values())  # bf16


# --- the guide's "Deploy shapes" -------------------------------------------------------------------------------

def _deploy_shapes() -> str:
    return DEPLOY_SHAPES.read_text()


def _blocks(text: str) -> list[tuple[str, list[str]]]:
    """Fenced code blocks: (language, lines)."""
    return [(lang, body.splitlines()) for lang, body in re.findall(r"^```(\w*)\n(.*?)^```$", text, re.M | re.S)]


def _sections() -> dict[str, str]:
    """Deploy-shape sections by their mark: ``(a)``, ``(b)``, ..."""
    parts = re.split(r"^## ", _deploy_shapes(), flags=re.M)[1:]
    return {part.split()[0]: part for part in parts}


def _pattern(line: str) -> re.Pattern[str]:
    """A guide line as a pattern: ``…`` stands for whatever the guide leaves out."""
    return re.compile(".*".join(re.escape(piece) for piece in line.split("…")))


def test_guide_plan_lines_are_what_the_golden_plans_print() -> None:
    blocks = [lines for lang, lines in _blocks(_deploy_shapes()) if lang == ""]
    assert len(blocks) == len(GUIDE_PLAN_BLOCKS)
    for shape, lines in zip(GUIDE_PLAN_BLOCKS, blocks, strict=True):
        printed = expected(shape)["lines"]
        at = -1
        for line in lines:
            if line.startswith("…"):  # a note: "… (the same for ...)"
                continue
            pattern = _pattern(line)
            found = [i for i, p in enumerate(printed) if i > at and pattern.fullmatch(p)]
            assert found, f"{DEPLOY_SHAPES.name} ({shape}): no printed line after line {at} matches:\n{line}"
            at = found[0]


def test_guide_config_yaml_and_vllm_env_are_what_the_role_writes() -> None:
    shape, replica, host = GUIDE_FILES_OF
    files = expected(shape)["files"][replica][host]
    shown = {lines[0]: lines[1:] for _, lines in _blocks(_sections()["(a)"]) if lines and lines[0].startswith("# ")}
    config = [line for line in files["config.yaml"].splitlines() if not line.startswith("#")]
    assert shown["# config.yaml"] == config
    env = [line for line in env_file(files["vllm.env"], "vllm.env").splitlines() if not line.startswith("#")]
    assert shown["# vllm.env"] == env


@pytest.mark.parametrize("mark", sorted(GUIDE_SECTIONS))
def test_guide_inputs_are_the_golden_plans(mark: str) -> None:
    """The inventory lines and group_vars values a section shows are those its golden plan is made from."""
    shape = PLANS / GUIDE_SECTIONS[mark]
    inventory = {line.strip() for line in (shape / "inventory.py").read_text().splitlines()}
    for lang, lines in _blocks(_sections()[mark]):
        if lang == "python":
            assert {line.strip() for line in lines if line.strip() and not line.startswith("#")} <= inventory
        if lang == "yaml":
            for name, values in _group_vars_excerpts(lines).items():
                golden = yaml.safe_load((shape / "group_vars" / f"{name}.yml").read_text())
                assert values.items() <= golden.items(), (mark, name)


def _group_vars_excerpts(lines: list[str]) -> dict[str, dict[str, Any]]:
    """``# group_vars/<name>.yml`` headed parts of a YAML block, loaded (config.yaml blocks have none)."""
    found: dict[str, list[str]] = {}
    name = None
    for line in lines:
        if head := re.match(r"# group_vars/(\w+)\.yml", line):
            name = head[1]
            found[name] = []
        elif name is not None:
            found[name].append(line)
    return {name: yaml.safe_load("\n".join(body)) or {} for name, body in found.items()}
