"""Memory math against published parameter counts and vLLM's KV-cache rules."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest

from gpufleet.plan.model_arch import ModelConfigError, arch_from_config, load_arch
from gpufleet.plan.model_memory import (
    bytes_per_param,
    kv_budget,
    kv_bytes_per_token,
    kv_space_budget,
    kv_tokens_per_sequence,
    lora_modelled,
    lora_slot_bytes,
    model_info,
    param_count,
    safetensors_total_size,
    stage_layers,
    stage_weights_per_gpu,
    weight_bytes,
)

GIB = 1024**3

# Published parameter counts (Hugging Face model cards / safetensors metadata, and the papers):
# - Llama-3.1-8B: 8.03B (HF safetensors metadata: 8,030,261,248)
# - Llama-3.1-70B: 70.6B (HF safetensors metadata: 70,553,706,496)
# - Llama-3.1-405B: 405B on the model card; the checkpoint holds 405,853,388,800
# - Llama-3-70B: 70.6B, the same shape as Llama-3.1-70B
# - Mistral-7B-v0.1: 7.24B (HF safetensors metadata: 7,241,732,096)
# - Qwen2.5-72B: 72.7B (Qwen2.5 model card: "Number of Parameters: 72.7B")
# - Mixtral-8x7B-v0.1: 46.7B total, 12.9B active (Mistral AI announcement; HF: 46,702,792,704)
# - DeepSeek-V3: 671B total, 37B active (DeepSeek-V3 technical report); the HF checkpoint is 685B
#   because it also holds the 14B multi-token-prediction module.
PUBLISHED = {
    "Llama-3.1-8B": 8.03e9,
    "Llama-3.1-70B": 70.6e9,
    "Llama-3.1-405B": 405.9e9,
    "Llama-3-70B": 70.6e9,
    "Mistral-7B-v0.1": 7.24e9,
    "Qwen2.5-72B": 72.7e9,
    "Mixtral-8x7B-v0.1": 46.7e9,
    "DeepSeek-V3": 671e9,
}

# Exact tensor counts of the checkpoints, which a correct dense/MoE formula reproduces to the parameter.
EXACT = {
    "Llama-3.1-8B": 8_030_261_248,
    "Llama-3.1-70B": 70_553_706_496,
    "Llama-3.1-405B": 405_853_388_800,
    "Mistral-7B-v0.1": 7_241_732_096,
    "Mixtral-8x7B-v0.1": 46_702_792_704,
}


@pytest.mark.parametrize(("name", "published"), sorted(PUBLISHED.items()))
def test_param_count_within_3_percent_of_published(name: str, published: float) -> None:
    estimate = param_count(load_arch(name))
    assert abs(estimate - published) / published < 0.03


@pytest.mark.parametrize(("name", "exact"), sorted(EXACT.items()))
def test_param_count_matches_checkpoint_exactly(name: str, exact: int) -> None:
    assert param_count(load_arch(name)) == exact


def test_deepseek_v3_counts_main_model_not_mtp() -> None:
    count = param_count(load_arch("DeepSeek-V3"))
    assert 665e9 < count < 677e9  # 671B main model
    assert count < 685e9 * 0.985  # clearly below the 685B checkpoint that includes the MTP module


def test_mixtral_moe_count_is_experts_plus_shared_trunk() -> None:
    arch = load_arch("Mixtral-8x7B-v0.1")
    expert_mlp = 3 * 4096 * 14336
    trunk = param_count(arch) - 32 * 8 * expert_mlp
    # everything but the experts: both vocab tables, the final norm, and per layer attention,
    # two norms and the 8-way router
    assert trunk == 2 * 32000 * 4096 + 4096 + 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 2 * 4096 + 8 * 4096)
    assert trunk == 1_605_636_096
    # active per token (2 of 8 experts) is the published 12.9B
    active = trunk + 32 * 2 * expert_mlp
    assert abs(active - 12.9e9) / 12.9e9 < 0.01


def test_tied_embeddings_count_once() -> None:
    cfg = {"num_hidden_layers": 1, "hidden_size": 8, "intermediate_size": 16, "num_attention_heads": 2,
           "vocab_size": 100}
    untied = param_count(arch_from_config(cfg))
    tied = param_count(arch_from_config({**cfg, "tie_word_embeddings": True}))
    assert untied - tied == 100 * 8
    # attention 4*8*8, MLP 3*8*16, two layer norms, final norm, two vocab tables
    assert untied == 4 * 64 + 3 * 128 + 2 * 8 + 8 + 2 * 800


@pytest.mark.parametrize(
    ("dtype", "quantization", "expected"),
    [
        ("bfloat16", None, 2.0),
        ("bf16", None, 2.0),
        ("float16", None, 2.0),
        ("fp16", None, 2.0),
        ("float32", None, 4.0),
        ("fp32", None, 4.0),
        ("fp8", None, 1.0),
        ("int8", None, 1.0),
        ("bfloat16", "fp8", 1.0),
        ("bfloat16", "int8", 1.0),
        ("float16", "awq", 0.5 + 2.5 / 128),
        ("float16", "GPTQ", 0.5 + 2.5 / 128),
        ("bfloat16", "int4", 0.5 + 2.5 / 128),
    ],
)
def test_bytes_per_param(dtype: str, quantization: str | None, expected: float) -> None:
    assert bytes_per_param(dtype, quantization) == pytest.approx(expected)


def test_int4_overhead_is_about_half_a_byte() -> None:
    assert 0.5 < bytes_per_param("float16", "awq") < 0.53


def test_unknown_dtype_and_quantization_name_the_accepted_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown dtype 'float8'; accepted: .*bfloat16.*float32"):
        bytes_per_param("float8", None)
    with pytest.raises(ValueError, match=r"unknown quantization 'squeezellm'; accepted: .*awq.*fp8.*gptq"):
        bytes_per_param("bfloat16", "squeezellm")


def test_weight_bytes_bf16_is_two_bytes_per_param() -> None:
    arch = load_arch("Llama-3.1-8B")
    assert weight_bytes(arch, "bfloat16", None) == 2 * 8_030_261_248
    assert weight_bytes(arch, "auto", None) == 2 * 8_030_261_248  # checkpoint dtype
    assert weight_bytes(arch, "fp8", None) == 8_030_261_248


def test_weight_bytes_exact_total_wins() -> None:
    arch = load_arch("Llama-3.1-8B")
    assert weight_bytes(arch, "bfloat16", "awq", exact_total=16_060_522_496) == 16_060_522_496
    with pytest.raises(ValueError):
        weight_bytes(arch, "bfloat16", None, exact_total=-1)


def test_weight_bytes_uses_the_checkpoint_quantization() -> None:
    arch = load_arch("DeepSeek-V3")  # ships fp8 weights (quantization_config)
    fp8 = weight_bytes(arch, "bfloat16", None)
    embeddings = 2 * 129280 * 7168  # embedding and lm_head stay bf16
    assert fp8 == param_count(arch) - embeddings + 2 * embeddings
    assert weight_bytes(arch, "bfloat16", "fp8") == fp8


def test_int4_weights_keep_the_vocab_tables_16_bit() -> None:
    arch = load_arch("Llama-3.1-70B")
    embeddings = 2 * 128256 * 8192  # embedding and lm_head stay 16-bit
    awq = weight_bytes(arch, "float16", "awq")
    assert awq == math.ceil((70_553_706_496 - embeddings) * (0.5 + 2.5 / 128) + 2 * embeddings)
    ratio = awq / weight_bytes(arch, "bfloat16", None)
    assert 0.27 < ratio < 0.29  # ~0.52 of 2 bytes on the layers, plus the 16-bit vocab tables


def test_safetensors_index_total_size(tmp_path: Path) -> None:
    assert safetensors_total_size(tmp_path) is None
    index = {
        "metadata": {"total_size": 16_060_522_496},
        "weight_map": {"lm_head.weight": "model-00004-of-00004.safetensors"},
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index), encoding="utf-8")
    assert safetensors_total_size(tmp_path) == 16_060_522_496
    arch = load_arch("Llama-3.1-8B")
    assert weight_bytes(arch, "bfloat16", None, exact_total=safetensors_total_size(tmp_path)) == 16_060_522_496


def test_safetensors_index_without_total_and_broken(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors.index.json"
    path.write_text(json.dumps({"weight_map": {}}), encoding="utf-8")
    assert safetensors_total_size(tmp_path) is None
    path.write_text("{not json", encoding="utf-8")
    with pytest.raises(ModelConfigError, match=r"model\.safetensors\.index\.json: cannot read"):
        safetensors_total_size(tmp_path)


def test_single_file_safetensors_size_excludes_header(tmp_path: Path) -> None:
    header = json.dumps({"w": {"dtype": "BF16", "shape": [4, 8], "data_offsets": [0, 64]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(64))
    assert safetensors_total_size(tmp_path) == 64


# -- KV cache: vLLM's rules ------------------------------------------------------------------------


def test_llama3_70b_kv_bf16_whole_model() -> None:
    arch = load_arch("Llama-3-70B")
    assert kv_bytes_per_token(arch, "auto", "bfloat16") == 2 * 80 * 8 * 128 * 2 == 327_680


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_llama3_70b_kv_fp8(kv_dtype: str) -> None:
    assert kv_bytes_per_token(load_arch("Llama-3-70B"), kv_dtype) == 163_840


def test_kv_auto_follows_model_dtype() -> None:
    arch = load_arch("Llama-3-70B")
    assert kv_bytes_per_token(arch, "auto", "float32") == 655_360
    assert kv_bytes_per_token(arch, "auto", "auto") == 327_680  # checkpoint is bf16
    assert kv_bytes_per_token(arch, "bfloat16", "float32") == 327_680


def test_llama3_70b_kv_tp_splits_heads_then_replicates() -> None:
    arch = load_arch("Llama-3-70B")
    assert kv_bytes_per_token(arch, tp=2) == 163_840
    assert kv_bytes_per_token(arch, tp=8) == 40_960  # one KV head per GPU
    # 16 GPUs > 8 KV heads: each GPU still holds one whole (replicated) head
    assert kv_bytes_per_token(arch, tp=16) == 2 * 80 * 1 * 128 * 2 == 40_960


def test_llama3_70b_kv_pp_uses_the_fullest_stage() -> None:
    arch = load_arch("Llama-3-70B")
    assert kv_bytes_per_token(arch, pp=2) == 327_680 // 2
    assert kv_bytes_per_token(arch, pp=3) == 2 * 27 * 8 * 128 * 2  # ceil(80 / 3) = 27 layers
    assert kv_bytes_per_token(arch, tp=8, pp=2) == 20_480


def test_deepseek_v3_mla_kv() -> None:
    arch = load_arch("DeepSeek-V3")
    one_layer = (512 + 64) * 2
    assert one_layer == 1_152
    assert kv_bytes_per_token(arch) == 61 * 1_152 == 70_272
    for tp in (1, 2, 8, 16):  # the latent is not split by TP
        assert kv_bytes_per_token(arch, tp=tp) == 70_272
    assert kv_bytes_per_token(arch, "fp8") == 61 * 576
    assert kv_bytes_per_token(arch, pp=2) == 31 * 1_152


def test_kv_rejects_bad_arguments() -> None:
    arch = load_arch("Llama-3.1-8B")
    with pytest.raises(ValueError, match=r"unknown kv_dtype 'int4'; accepted: auto, .*fp8"):
        kv_bytes_per_token(arch, "int4")
    with pytest.raises(ValueError, match="tp and pp must be >= 1"):
        kv_bytes_per_token(arch, tp=0)
    with pytest.raises(ValueError, match="unknown model_dtype"):
        kv_bytes_per_token(arch, "auto", "float64")


def test_sliding_window_caps_tokens_per_sequence_for_mistral() -> None:
    mistral = load_arch("Mistral-7B-v0.1")
    assert kv_tokens_per_sequence(mistral, 32_768) == 4_096
    assert kv_tokens_per_sequence(mistral, 2_048) == 2_048
    assert kv_tokens_per_sequence(load_arch("Llama-3.1-8B"), 32_768) == 32_768
    assert kv_tokens_per_sequence(load_arch("Qwen2.5-72B"), 32_768) == 32_768  # use_sliding_window false
    with pytest.raises(ValueError):
        kv_tokens_per_sequence(mistral, 0)


def test_mixed_sliding_layers_count_full_length() -> None:
    cfg = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
           "vocab_size": 10, "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"]}
    assert kv_tokens_per_sequence(arch_from_config(cfg), 1_000) == 1_000


# -- the KV pool -----------------------------------------------------------------------------------


def test_llama31_8b_on_one_80gib_h100() -> None:
    arch = load_arch("Llama-3.1-8B")
    weights = weight_bytes(arch, "bfloat16", None)
    per_token = kv_bytes_per_token(arch)
    assert per_token == 131_072  # 128 KiB
    budget = kv_budget(80 * GIB, 0.92, weights, 2 * GIB, per_token, kv_tokens_per_sequence(arch, 8192))
    assert budget.usable_bytes == int(80 * GIB * 0.92) == 79_027_398_246
    assert budget.kv_pool_bytes == 79_027_398_246 - 16_060_522_496 - 2 * GIB == 60_819_392_102
    assert budget.kv_tokens == 60_819_392_102 // 131_072 == 464_015
    assert budget.max_concurrency == pytest.approx(464_015 / 8192)
    assert round(budget.max_concurrency, 2) == 56.64
    assert budget.full_sequences == 56
    assert budget.fits
    assert budget.lines() == [
        "80.0 GiB x 0.92 = 73.6 GiB usable; - 15.0 GiB weights; - 2.0 GiB reserve = 56.6 GiB KV pool",
        "56.6 GiB / 131,072 B (128.0 KiB) per token = 464,015 tokens",
        "464,015 tokens / 8,192 per sequence = 56.64 sequences at full length",
    ]


def test_llama31_70b_bf16_on_one_gpu_has_a_negative_pool() -> None:
    arch = load_arch("Llama-3.1-70B")
    weights = weight_bytes(arch, "bfloat16", None)
    budget = kv_budget(80 * GIB, 0.92, weights, 2 * GIB, kv_bytes_per_token(arch), 8192)
    assert budget.kv_pool_bytes == int(80 * GIB * 0.92) - 141_107_412_992 - 2 * GIB
    assert budget.kv_pool_bytes < 0
    assert (budget.kv_tokens, budget.max_concurrency, budget.full_sequences, budget.fits) == (0, 0.0, 0, False)
    lines = budget.lines()
    assert lines[0].endswith("- 131.4 GiB weights; - 2.0 GiB reserve = -59.8 GiB KV pool")
    assert lines[1] == "no KV pool: weights and reserve exceed usable memory by 59.8 GiB"


def test_llama31_70b_tp4_fits() -> None:
    arch = load_arch("Llama-3.1-70B")
    [per_gpu] = stage_weights_per_gpu(arch, weight_bytes(arch, "bfloat16", None), tp=4, pp=1)
    assert per_gpu == math.ceil(141_107_412_992 / 4)
    budget = kv_budget(80 * GIB, 0.92, per_gpu, 2 * GIB, kv_bytes_per_token(arch, tp=4), 8192)
    assert budget.kv_bytes_per_token == 81_920
    assert budget.kv_tokens == (int(80 * GIB * 0.92) - per_gpu - 2 * GIB) // 81_920
    assert budget.full_sequences >= 50


def test_the_pool_is_counted_in_whole_blocks() -> None:
    pool = 10 * 131_072 * 16 + 5 * 131_072  # 10 blocks of 16 tokens and 5 tokens more
    budget = kv_budget(pool, 1.0, 0, 0, 131_072, 20, block_size=16)
    assert budget.kv_tokens == 160  # the 5 tokens make no block
    assert budget.max_concurrency == 10 / 2  # a sequence of 20 tokens takes 2 blocks, as vLLM counts it
    assert budget.lines()[1].endswith("per token in blocks of 16 = 160 tokens")


def test_the_margin_is_taken_from_the_pool_before_blocks() -> None:
    pool = 100 * 131_072 * 16  # 100 blocks; 3% off leaves 97 of them
    budget = kv_budget(pool, 1.0, 0, 0, 131_072, 16, block_size=16, kv_margin=0.03)
    assert budget.kv_pool_bytes == pool and budget.kv_tokens == 97 * 16 and budget.max_concurrency == 97
    assert budget.lines()[1].endswith("x (1 - 0.03 margin) / 131,072 B (128.0 KiB) per token in blocks of 16"
                                      " = 1,552 tokens")
    assert kv_budget(pool + 131_072 * 16, 1.0, 0, 0, 131_072, 16, block_size=16, kv_margin=0.03).kv_tokens == 97 * 16
    with pytest.raises(ValueError, match="kv_margin"):
        kv_budget(pool, 1.0, 0, 0, 131_072, 16, kv_margin=1.0)


def test_budget_lines_name_the_stage_and_the_reserve_parts() -> None:
    budget = kv_budget(80 * GIB, 0.9, 4 * GIB, 3 * GIB, 32_768, 8192, block_size=16, stage=3, stages=4,
                       reserve_parts=(("activations", 2 * GIB), ("communication", GIB)))
    assert budget.lines()[0] == ("stage 4 of 4: 80.0 GiB x 0.9 = 72.0 GiB usable; - 4.0 GiB weights; - 3.0 GiB"
                                 " reserve (activations 2.00, communication 1.00) = 65.0 GiB KV pool")


def test_cpu_kv_space_is_the_pool_whatever_the_weights() -> None:
    # vLLM's CPU build: VLLM_CPU_KVCACHE_SPACE=1 (GiB), blocks of 128 tokens, the lab's tiny Llama at 512 B/token.
    budget = kv_space_budget(GIB, 853_248, 512, 256, block_size=128)
    assert budget.kv_pool_bytes == GIB and budget.reserve_bytes == 0
    assert budget.kv_tokens == GIB // (512 * 128) * 128 == 2_097_152
    assert budget.max_concurrency == 16_384 / 2
    assert budget.lines()[0] == "VLLM_CPU_KVCACHE_SPACE 1.0 GiB = 1.0 GiB KV pool (weights 0.0 GiB beside it in RAM)"


@pytest.mark.parametrize(("layers", "pp", "expected"), [
    (32, 1, [32]), (32, 4, [8, 8, 8, 8]), (61, 2, [31, 30]), (80, 3, [27, 27, 26]), (10, 4, [2, 3, 3, 2]),
])
def test_stage_layers_follow_vllm(layers: int, pp: int, expected: list[int]) -> None:
    # vLLM's get_pp_indices: the remainder goes one each to the stages before the last, the latest first.
    assert stage_layers(layers, pp) == expected
    with pytest.raises(ValueError, match="pp"):
        stage_layers(2, 3)


def test_kv_budget_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_budget(80 * GIB, 1.5, 0, 0, 1, 1)
    with pytest.raises(ValueError, match="kv_bytes_per_token"):
        kv_budget(80 * GIB, 0.9, 0, 0, 0, 1)


def test_stage_weights_put_the_tables_on_the_first_and_last_stages() -> None:
    arch = load_arch("Llama-3.1-8B")
    total = weight_bytes(arch, "bfloat16", None)
    table = 128_256 * 4096 * 2
    [whole] = stage_weights_per_gpu(arch, total, 1, 1)
    assert whole == total
    first, middle, _, last = stage_weights_per_gpu(arch, total, 1, 4)
    norm = 4096 * 2
    layers = (total - 2 * table - norm) // 32 * 8  # estimated bf16 weights: 2 bytes for every parameter
    assert (first, middle, last) == (table + layers, layers, layers + norm + table)  # vLLM: 4.26 GiB on stage 1
    assert stage_weights_per_gpu(arch, total, 2, 4) == [math.ceil(w / 2) for w in (first, middle, middle, last)]


def test_stage_weights_of_a_tied_model_copy_the_table_to_the_last_stage() -> None:
    cfg = {"num_hidden_layers": 4, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
           "vocab_size": 1000, "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
    arch = arch_from_config(cfg)
    total = weight_bytes(arch, "bfloat16", None)
    table = 1024 * 64 * 2  # the vocabulary padded to a multiple of 64
    [whole] = stage_weights_per_gpu(arch, total, 1, 1)
    first, last = stage_weights_per_gpu(arch, total, 1, 2)
    assert whole == pytest.approx(total + (table - 1000 * 64 * 2), abs=1)  # one table
    assert last - first == pytest.approx(64 * 2, abs=2)  # each stage a table; the last adds the final norm
    with pytest.raises(ValueError, match="tp and pp"):
        stage_weights_per_gpu(arch, total, 1, 0)


def test_model_info_keys_and_values() -> None:
    info = model_info(load_arch("Llama-3-70B"), tp=8)
    assert {"num_layers", "num_kv_heads", "head_dim", "param_count", "kv_bytes_per_token"} <= info.keys()
    assert info == {
        "model_type": "llama",
        "num_layers": 80,
        "num_kv_heads": 8,
        "head_dim": 128,
        "param_count": 70_553_706_496,
        "kv_bytes_per_token": 40_960,
        "is_moe": False,
        "is_mla": False,
    }
    assert json.loads(json.dumps(info)) == info
    deepseek = model_info(load_arch("DeepSeek-V3"), kv_dtype="fp8")
    assert (deepseek["is_moe"], deepseek["is_mla"], deepseek["kv_bytes_per_token"]) == (True, True, 35_136)


def test_mla_without_q_lora_deepseek_v2_lite() -> None:
    # DeepSeek-V2-Lite's config.json fields; its model card gives 15.7B total parameters.
    cfg = {"model_type": "deepseek_v2", "num_hidden_layers": 27, "hidden_size": 2048, "intermediate_size": 10944,
           "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 102400, "kv_lora_rank": 512,
           "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
           "moe_intermediate_size": 1408, "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
           "first_k_dense_replace": 1, "moe_layer_freq": 1}
    arch = arch_from_config(cfg)
    assert abs(param_count(arch) - 15.7e9) / 15.7e9 < 0.03
    assert kv_bytes_per_token(arch) == 27 * (512 + 64) * 2


# Llama-3.1-8B's LoRA elements per slot at rank 16 (create_lora_weights' shapes): per decoder layer, A's columns
# and B's rows; and the input embedding's and LM head's (128,256 + 4,096 each)
LORA_8B_LAYER_TP1 = 16 * ((5 * 4096 + 4096 + 14336) + (4096 + 2 * 1024 + 2 * 14336 + 2 * 4096))
LORA_8B_LAYER_TP2 = 16 * ((5 * 4096 + 2048 + 7168) + (2048 + 2 * 512 + 2 * 7168 + 2 * 4096))  # split parts halve
LORA_8B_TABLE = 16 * (128_256 + 4096)


@pytest.mark.parametrize(("tp", "pp", "stage", "elements"), [
    (1, 1, 0, 32 * LORA_8B_LAYER_TP1 + 2 * LORA_8B_TABLE),
    (2, 1, 0, 32 * LORA_8B_LAYER_TP2 + 2 * LORA_8B_TABLE),
    (1, 2, 0, 16 * LORA_8B_LAYER_TP1 + LORA_8B_TABLE),  # the embedding on the first stage
    (1, 2, 1, 16 * LORA_8B_LAYER_TP1 + LORA_8B_TABLE),  # the LM head on the last
])
def test_lora_slots_follow_the_layers_shapes_and_shards(tp: int, pp: int, stage: int, elements: int) -> None:
    arch = load_arch("meta-llama/Llama-3.1-8B-Instruct")
    assert lora_modelled(arch)
    assert lora_slot_bytes(arch, max_loras=3, rank=16, dtype_bytes=2, tp=tp, pp=pp, stage=stage) == 3 * 2 * elements


def test_lora_slots_of_kv_heads_fewer_than_the_gpus_are_copied_and_moe_is_not_modelled() -> None:
    arch = load_arch("meta-llama/Llama-3.1-8B-Instruct")  # 8 KV heads of 128
    at_16 = lora_slot_bytes(arch, max_loras=1, rank=8, dtype_bytes=2, tp=16)
    at_8 = lora_slot_bytes(arch, max_loras=1, rank=8, dtype_bytes=2, tp=8)
    # from TP 8 to 16 every split part halves but k and v, one head a GPU either way
    split_8 = 8 * (4096 // 8 + 14336 // 8 + 4096 // 8 + 2 * 14336 // 8)
    assert at_8 - at_16 == 2 * 32 * split_8 // 2
    assert not lora_modelled(load_arch("mistralai/Mixtral-8x7B-v0.1"))
    with pytest.raises(ValueError):
        lora_slot_bytes(arch, max_loras=0, rank=16, dtype_bytes=2)
