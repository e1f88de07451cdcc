"""What the plan refuses because vLLM would: a quantization against the checkpoint's, fp8 on GPUs without it; and
what it says of flags that move memory and of a long default context."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpufleet.gpu.profiles import profile_facts
from gpufleet.plan import layout, quantization
from tests.conftest import Project, Result, run_cli


@pytest.mark.parametrize(("asked", "checkpoint", "refused"), [
    ("fp8", None, False), ("FP8", None, False), ("awq", None, True), ("gptq", None, True),
    ("awq", "awq", False), ("awq_marlin", "awq", False), ("gptq_marlin", "gptq", False),
    ("modelopt_fp4", "modelopt", False), ("gptq", "awq", True), ("fp8", "awq", True),
    ("fp8", "compressed_tensors", True), ("compressed-tensors", "compressed_tensors", False),
])
def test_checkpoint_conflict(asked: str, checkpoint: str | None, refused: bool) -> None:
    assert (quantization.checkpoint_conflict(asked, checkpoint) is not None) is refused


def test_capability_reads_major_minor_only() -> None:
    assert quantization.capability("8.6") == (8, 6)
    assert quantization.capability("9.0") == (9, 0)
    assert quantization.capability(None) is None
    assert quantization.capability("sm90") is None


def _facts_dir(tmp: Path, host: str, capability: str | None) -> Path:
    """Probed facts of an 8 x A100 node whose GPUs report ``capability``."""
    facts = json.loads(profile_facts("8xA100-SXM", host).to_json())
    for gpu in facts["gpus"]:
        gpu["compute_capability"] = capability
    folder = tmp / "facts"
    folder.mkdir(exist_ok=True)
    (folder / f"{host}.json").write_text(json.dumps(facts))
    return folder


def _plan_on_probed(project: Project, tmp_path: Path, capability: str | None, setting: str, *more: str) -> Result:
    """``gpufleet plan`` of one pool with ``setting`` on an 8 x A100 node whose probed GPUs report ``capability``."""
    project.group_vars("all", f"""
        vllm_model: meta-llama/Llama-3.1-8B-Instruct
        {setting}
        vllm_max_model_len: 8192
    """)
    project.inventory('pool = ["g1"]')
    return run_cli("plan", "inventories/fleet.py", *more, "--facts", str(_facts_dir(tmp_path, "g1", capability)),
                   cwd=project.root)


@pytest.mark.parametrize(("capability", "rc", "said"), [
    ("7.0", 2, "vllm_quantization: expected weights other than fp8 on NVIDIA A100-SXM4-80GB (compute capability 7.0,"
               " on g1): vLLM runs fp8 weights from compute capability 7.5, found fp8"),
    ("8.6", 0, "warning: pool pool: fp8 weights on NVIDIA A100-SXM4-80GB (compute capability 8.6, on g1) run"
               " weight-only (W8A16, FP8 Marlin): no fp8 compute below compute capability 8.9"),
    ("9.0", 0, ""),
    (None, 0, ""),  # facts without a compute capability: nothing to decide from
])
def test_fp8_weights_by_probed_capability(project: Project, tmp_path: Path, capability: str | None, rc: int,
                                          said: str) -> None:
    result = _plan_on_probed(project, tmp_path, capability, "vllm_quantization: fp8", "--json")
    assert result.rc == rc, result.err
    assert (said in result.err) if said else "fp8" not in result.err


@pytest.mark.parametrize(("capability", "rc", "said"), [
    ("6.1", 2, "vllm_kv_cache_dtype: expected auto, bfloat16 or float16 on NVIDIA A100-SXM4-80GB (compute capability"
               " 6.1, on g1): vLLM keeps an fp8 KV cache from compute capability 7.0, found fp8_e5m2"),
    ("8.6", 0, "warning: pool pool: the fp8 KV cache on NVIDIA A100-SXM4-80GB (compute capability 8.6, on g1) is"
               " converted in software (no fp8 below compute capability 8.9)"),
    ("8.9", 0, ""),
])
def test_fp8_kv_cache_by_probed_capability(project: Project, tmp_path: Path, capability: str, rc: int,
                                           said: str) -> None:
    result = _plan_on_probed(project, tmp_path, capability, "vllm_kv_cache_dtype: fp8_e5m2")
    assert result.rc == rc, result.err
    assert (said in result.err) if said else "fp8" not in result.err


def _json_plan(project: Project, extra_args: str, *more: str) -> tuple[list[dict[str, Any]], str, str]:
    project.group_vars("all", f"""
        vllm_model: meta-llama/Llama-3.1-8B-Instruct
        gpu_profile: 8xH100-SXM
        vllm_max_model_len: 8192
        vllm_replicas_per_node: 1
        vllm_extra_args: {extra_args}
    """)
    project.inventory('pool = ["g1"]')
    result = run_cli("plan", "inventories/fleet.py", "--json", *more, cwd=project.root)
    assert result.rc == 0, result.err
    text = run_cli("plan", "inventories/fleet.py", cwd=project.root)
    assert text.rc == 0, text.err
    return json.loads(result.out), text.out, result.err


def test_kv_cache_memory_bytes_is_the_pool(project: Project) -> None:
    (plain,), _, _ = _json_plan(project, "{}")
    (fixed,), _, _ = _json_plan(project, '{"kv-cache-memory-bytes": "20G"}')
    assert fixed["kv_pool_bytes_per_gpu"] == 20 * 2**30 < plain["kv_pool_bytes_per_gpu"]
    assert fixed["weights_bytes_per_gpu"] == plain["weights_bytes_per_gpu"]
    # 20 GiB / 128 KiB per token, in blocks of 16, without the margin the profiled pool keeps
    assert fixed["kv_tokens_per_gpu"] == 20 * 2**30 // 131_072 // 16 * 16
    assert fixed["budget"][0].startswith("--kv-cache-memory-bytes 20.0 GiB KV pool beside")
    assert "not_modelled" not in fixed


def test_kv_cache_memory_bytes_beyond_the_gpu_is_refused(project: Project) -> None:
    project.group_vars("all", """
        vllm_model: meta-llama/Llama-3.1-8B-Instruct
        gpu_profile: 8xH100-SXM
        vllm_max_model_len: 8192
        vllm_tensor_parallel_size: 1
        vllm_extra_args: {kv-cache-memory-bytes: 80G}
    """)
    project.inventory('pool = ["g1"]')
    result = run_cli("plan", "inventories/fleet.py", cwd=project.root)
    assert result.rc == 2
    assert "no KV pool: weights, reserve and that pool exceed the GPU's memory by" in result.err


def test_cpu_offload_lowers_the_weights_on_each_gpu(project: Project) -> None:
    (plain,), _, _ = _json_plan(project, "{}")
    (offload,), _, _ = _json_plan(project, '{"cpu-offload-gb": 4}')
    assert offload["weights_bytes_per_gpu"] == plain["weights_bytes_per_gpu"] - 4 * 2**30
    assert offload["kv_pool_bytes_per_gpu"] > plain["kv_pool_bytes_per_gpu"]


def test_flags_not_modelled_are_named(project: Project) -> None:
    (replica,), text, _ = _json_plan(project, '{"enable-lora": true, "max-loras": 4, "max-cpu-loras": 8, '
                                              '"speculative-config": {"method": "ngram", "num_speculative_tokens": 3}}')
    assert replica["not_modelled"] == ["--max-cpu-loras", "--speculative-config"]  # the LoRA slots are modelled
    assert ("pool pool: not modelled in the plan's memory: --max-cpu-loras, --speculative-config"
            " (vLLM's KV pool may be smaller than planned)") in text
    (off,), text, _ = _json_plan(project, '{"enable-lora": false}')
    assert "not_modelled" not in off and "not modelled" not in text
    # an architecture or platform whose slots the budget does not count names them
    assert layout.not_modelled({"enable-lora": True, "max-loras": 4}) == ("--enable-lora", "--max-loras")


# Llama-3.1-8B's LoRA slots on one GPU (TP 1), by vLLM 0.31's create_lora_weights: per layer and slot, A's
# columns (q, k, v and gate, up whole: 5 x 4,096; o 4,096; down 14,336) and B's rows (q 4,096, k and v 1,024
# each, gate and up 14,336 each, o and down 4,096 each) at rank 16 over 32 layers; the embedding's and the LM
# head's 128,256 + 4,096 each; 4 slots of bfloat16
LLAMA_8B_LORA_4_SLOTS = 4 * 2 * (16 * (38_912 + 43_008) * 32 + 2 * 16 * (128_256 + 4_096))


def test_lora_slots_are_counted_beside_the_weights(project: Project) -> None:
    (plain,), _, _ = _json_plan(project, "{}")
    (lora,), _, _ = _json_plan(project, '{"enable-lora": true, "max-loras": 4}')
    assert lora["kv_pool_bytes_per_gpu"] == plain["kv_pool_bytes_per_gpu"] - LLAMA_8B_LORA_4_SLOTS
    assert f"LoRA slots {LLAMA_8B_LORA_4_SLOTS / 2**30:,.2f}" in "\n".join(lora["budget"])
    (defaults,), _, _ = _json_plan(project, '{"enable-lora": true}')  # vLLM's: one slot of rank 16
    assert defaults["kv_pool_bytes_per_gpu"] == plain["kv_pool_bytes_per_gpu"] - LLAMA_8B_LORA_4_SLOTS // 4


def _long_context(project: Project, model: str, max_len: str = "") -> tuple[str, str]:
    """(check's stderr, plan's stderr) of one 8 x H100 node serving ``model``."""
    project.group_vars("all", f"""
        vllm_model: {model}
        gpu_profile: 8xH100-SXM
        vllm_tensor_parallel_size: 8
        {max_len}
    """)
    project.inventory('pool = ["g1"]')
    check = run_cli("check", "inventories/fleet.py", cwd=project.root)
    plan = run_cli("plan", "inventories/fleet.py", "--json", cwd=project.root)
    assert check.rc == 0 and plan.rc == 0, (check.err, plan.err)
    assert check.out.endswith("configuration valid\n")
    return check.err, plan.err


def test_long_default_context_is_warned_with_a_table(project: Project) -> None:
    check, plan = _long_context(project, "meta-llama/Llama-3.1-70B-Instruct")
    assert check == plan
    lines = check.splitlines()
    assert lines[0].startswith("warning: pool pool: vllm_max_model_len unset: vLLM takes Llama-3.1-70B's default,"
                               " 131,072 tokens (max_position_embeddings)")
    assert lines[1].split() == ["tokens", "sequences"]
    table = [line.split() for line in lines[2:7]]
    assert [row[0] for row in table] == ["4,096", "8,192", "16,384", "32,768", "131,072"]
    seqs = [float(row[1].replace(",", "")) for row in table]
    assert seqs == sorted(seqs, reverse=True) and seqs[0] == pytest.approx(32 * seqs[4], rel=0.01)
    assert lines[6].endswith("(the model's default)")


def test_no_long_context_warning_when_set_or_short(project: Project) -> None:
    assert _long_context(project, "meta-llama/Llama-3.1-70B-Instruct", "vllm_max_model_len: 131072") == ("", "")
    assert "vllm_max_model_len unset" not in _long_context(project, "meta-llama/Meta-Llama-3-70B")[1]
