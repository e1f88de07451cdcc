"""LoRA adapters in the plan: which replicas serve each (its pools' vllm_lora_adapters), the slots' memory `gpufleet
plan` shows for them, and names the routers could not route. An adapter's own files: tests/unit/config/
test_lora_files.py; bad adapters one line each: tests/data/corpus/lora.yaml."""

from __future__ import annotations

from pathlib import Path

from gpufleet_lab.tiny_adapters import WEIGHTS_FILE, TinyAdapter, make_tiny_adapter

from gpufleet.digest import file_sha256
from tests.conftest import Project, run_cli

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def _adapter(root: Path, name: str) -> str:
    """``name`` declared as YAML flow: one of the lab's tiny adapters, made for MODEL."""
    folder = make_tiny_adapter(root / "adapters" / name, TinyAdapter(name, 8, 7), base=MODEL)
    return f"{name}: {{source: {folder}, sha256: {file_sha256(folder / WEIGHTS_FILE)}}}"


def _fleet(project: Project, lora: str, other: str) -> None:
    """Two pools of MODEL under one name: ``lora`` declares the adapters given, ``other`` those given."""
    project.group_vars("all", f"""
        vllm_model: {MODEL}
        vllm_served_model_name: chat
        gpu_profile: 8xH100-SXM
        vllm_max_model_len: 8192
        vllm_replicas_per_node: 1
    """)
    project.group_vars("lora", f"vllm_lora_adapters: {{{lora}}}\nvllm_extra_args: {{max-loras: 4}}\n")
    project.group_vars("plain", f"vllm_lora_adapters: {{{other}}}\n")
    project.inventory('lora = ["g1"]\nplain = ["g2"]')


def test_an_adapter_is_served_by_the_replicas_of_the_pools_that_declare_it_with_its_slots(project: Project) -> None:
    _fleet(project, ", ".join(_adapter(project.root, n) for n in ("support", "legal")), "")
    shown = run_cli("plan", "inventories/fleet.py", cwd=project.root)
    assert shown.rc == 0, shown.err
    lines = sorted(line for line in shown.out.splitlines() if "LoRA adapter" in line)
    assert [line.split(" GiB/GPU")[0].rsplit(" ", 1)[0] for line in lines] == [
        f'model "chat": LoRA adapter {name} on lora-g1' for name in ("legal", "support")], lines
    assert all(float(line.split(" GiB/GPU")[0].rsplit(" ", 1)[1]) > 0 for line in lines), lines  # counted on GPUs


def test_an_adapter_named_as_another_pools_adapter_of_another_model_is_refused(project: Project) -> None:
    _fleet(project, _adapter(project.root, "support"), "")
    again = _adapter(project.root, "support")
    project.group_vars("plain", f"vllm_served_model_name: other\nvllm_lora_adapters: {{{again}}}\n")
    refused = run_cli("check", "inventories/fleet.py", cwd=project.root)
    assert refused.rc == 2, refused.err
    assert "vllm_lora_adapters.support: expected a name no other model or adapter has" in refused.err, refused.err
