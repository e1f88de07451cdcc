"""Reading model architecture from config.json: bundled configs, paths, names, and errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from gpufleet.plan.model_arch import ModelArch, ModelConfigError, arch_from_config, bundled_models, load_arch

BUNDLED = [
    "DeepSeek-V3",
    "Llama-3-70B",
    "Llama-3.1-405B",
    "Llama-3.1-70B",
    "Llama-3.1-8B",
    "Mistral-7B-v0.1",
    "Mixtral-8x7B-v0.1",
    "Qwen2.5-72B",
]

# (name, model_type, layers, hidden, intermediate, heads, kv_heads, head_dim, vocab, max_position)
SHAPES = [
    ("Llama-3.1-8B", "llama", 32, 4096, 14336, 32, 8, 128, 128256, 131072),
    ("Llama-3.1-70B", "llama", 80, 8192, 28672, 64, 8, 128, 128256, 131072),
    ("Llama-3.1-405B", "llama", 126, 16384, 53248, 128, 8, 128, 128256, 131072),
    ("Llama-3-70B", "llama", 80, 8192, 28672, 64, 8, 128, 128256, 8192),
    ("Mistral-7B-v0.1", "mistral", 32, 4096, 14336, 32, 8, 128, 32000, 32768),
    ("Qwen2.5-72B", "qwen2", 80, 8192, 29568, 64, 8, 128, 152064, 131072),
    ("Mixtral-8x7B-v0.1", "mixtral", 32, 4096, 14336, 32, 8, 128, 32000, 32768),
    # MLA: head_dim is the q/k head, qk_nope + qk_rope = 128 + 64
    ("DeepSeek-V3", "deepseek_v3", 61, 7168, 18432, 128, 128, 192, 129280, 163840),
]

LLAMA_MINI = {
    "model_type": "llama",
    "num_hidden_layers": 2,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 512,
    "torch_dtype": "bfloat16",
}


def write_config(path: Path, cfg: object) -> Path:
    path.write_text(json.dumps(cfg), encoding="utf-8")
    return path


def test_bundled_models_lists_the_eight_configs() -> None:
    assert bundled_models() == BUNDLED


@pytest.mark.parametrize(
    ("name", "model_type", "layers", "hidden", "inter", "heads", "kv", "head_dim", "vocab", "max_pos"), SHAPES
)
def test_bundled_shapes(
    name: str, model_type: str, layers: int, hidden: int, inter: int, heads: int, kv: int, head_dim: int,
    vocab: int, max_pos: int,
) -> None:
    arch = load_arch(name)
    assert (arch.name, arch.model_type, arch.num_layers, arch.hidden_size, arch.intermediate_size) == (
        name, model_type, layers, hidden, inter,
    )
    assert (arch.num_attention_heads, arch.num_kv_heads, arch.head_dim) == (heads, kv, head_dim)
    assert (arch.vocab_size, arch.max_position_embeddings) == (vocab, max_pos)
    assert arch.torch_dtype == "bfloat16"
    assert arch.tie_word_embeddings is False


@pytest.mark.parametrize(
    ("alias", "expected"),
    [
        ("Llama-3.1-70B", "Llama-3.1-70B"),
        ("meta-llama/Llama-3.1-70B", "Llama-3.1-70B"),
        ("meta-llama/Llama-3.1-70B-Instruct", "Llama-3.1-70B"),
        ("LLAMA-3.1-8b-instruct", "Llama-3.1-8B"),
        ("meta-llama/Meta-Llama-3.1-405B-Instruct", "Llama-3.1-405B"),
        ("meta-llama/Meta-Llama-3-70B-Instruct", "Llama-3-70B"),
        ("mistralai/Mistral-7B-Instruct-v0.1", "Mistral-7B-v0.1"),
        ("mistralai/Mixtral-8x7B-Instruct-v0.1", "Mixtral-8x7B-v0.1"),
        ("Qwen/Qwen2.5-72B-Instruct", "Qwen2.5-72B"),
        ("deepseek-ai/DeepSeek-V3", "DeepSeek-V3"),
        ("deepseek-ai/DeepSeek-V3-Base", "DeepSeek-V3"),
    ],
)
def test_bundled_names_resolve_with_org_case_and_variant(alias: str, expected: str) -> None:
    assert load_arch(alias).name == expected


def test_unknown_name_lists_bundled_models() -> None:
    with pytest.raises(ModelConfigError) as err:
        load_arch("meta-llama/Llama-3.1-8000B")
    message = str(err.value)
    assert "meta-llama/Llama-3.1-8000B" in message
    assert "no such file or directory" in message
    assert "Llama-3.1-70B" in message and "DeepSeek-V3" in message


def test_load_from_file_and_from_directory(tmp_path: Path) -> None:
    config = write_config(tmp_path / "config.json", LLAMA_MINI)
    from_file = load_arch(config)
    from_dir = load_arch(tmp_path)
    from_str = load_arch(str(tmp_path))
    assert from_file == from_dir == from_str
    assert from_file.name == str(config)
    assert (from_file.num_layers, from_file.num_kv_heads, from_file.head_dim) == (2, 1, 64)


def test_existing_path_wins_over_a_bundled_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "Llama-3.1-8B").mkdir()
    write_config(tmp_path / "Llama-3.1-8B" / "config.json", LLAMA_MINI)
    monkeypatch.chdir(tmp_path)
    assert load_arch("Llama-3.1-8B").num_layers == 2


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "config.json"
    with pytest.raises(ModelConfigError, match="no such file or directory") as err:
        load_arch(missing)
    assert str(missing) in str(err.value)


def test_directory_without_config_json(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError) as err:
        load_arch(tmp_path)
    assert str(err.value) == f"{tmp_path}: model directory has no config.json"


def test_bad_json_names_file_and_position(tmp_path: Path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text('{\n  "hidden_size": 4096,\n  "num_hidden_layers": ,\n}\n', encoding="utf-8")
    with pytest.raises(ModelConfigError) as err:
        load_arch(tmp_path)
    message = str(err.value)
    assert message.startswith(f"{bad}: not valid JSON (line 3")


def test_missing_num_hidden_layers(tmp_path: Path) -> None:
    cfg = {k: v for k, v in LLAMA_MINI.items() if k != "num_hidden_layers"}
    config = write_config(tmp_path / "config.json", cfg)
    with pytest.raises(ModelConfigError) as err:
        load_arch(config)
    assert str(err.value) == f"{config}: missing required key(s): num_hidden_layers"


def test_every_missing_key_is_named_at_once(tmp_path: Path) -> None:
    config = write_config(tmp_path / "config.json", {"model_type": "llama", "hidden_size": 64})
    with pytest.raises(ModelConfigError) as err:
        load_arch(config)
    assert str(err.value).endswith(
        "missing required key(s): num_hidden_layers, num_attention_heads, vocab_size, intermediate_size"
    )


@pytest.mark.parametrize(("value", "shown"), [("4096", "'4096'"), (0, "0"), (True, "True"), (12.5, "12.5")])
def test_invalid_values_are_rejected(tmp_path: Path, value: object, shown: str) -> None:
    config = write_config(tmp_path / "config.json", {**LLAMA_MINI, "hidden_size": value})
    with pytest.raises(ModelConfigError) as err:
        load_arch(config)
    assert str(err.value) == f"{config}: 'hidden_size' must be a positive integer, got {shown}"


def test_config_must_be_an_object(tmp_path: Path) -> None:
    config = write_config(tmp_path / "config.json", [1, 2, 3])
    with pytest.raises(ModelConfigError, match="expected a JSON object, got list"):
        load_arch(config)


def test_gqa_defaults_and_explicit_head_dim() -> None:
    no_kv = {k: v for k, v in LLAMA_MINI.items() if k != "num_key_value_heads"}
    arch = arch_from_config(no_kv)
    assert arch.num_kv_heads == arch.num_attention_heads == 2
    # Mistral-Nemo style: head_dim given explicitly and not hidden / heads (5120 / 32 = 160)
    nemo = {**LLAMA_MINI, "hidden_size": 5120, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128}
    assert arch_from_config(nemo).head_dim == 128
    assert arch_from_config({**nemo, "head_dim": None}).head_dim == 160


def test_sliding_window_mistral_uses_it_on_every_layer() -> None:
    arch = load_arch("Mistral-7B-v0.1")
    assert arch.sliding_window == 4096
    assert arch.sliding_window_layers == tuple(range(32))
    assert arch.all_layers_sliding


@pytest.mark.parametrize("name", ["Qwen2.5-72B", "Mixtral-8x7B-v0.1", "Llama-3.1-8B", "DeepSeek-V3"])
def test_no_sliding_window(name: str) -> None:
    # Qwen2.5 carries sliding_window 131072 but use_sliding_window false; Mixtral has null.
    arch = load_arch(name)
    assert arch.sliding_window is None
    assert arch.sliding_window_layers == ()
    assert not arch.all_layers_sliding


def test_sliding_window_from_layer_types_and_qwen_switch() -> None:
    mixed = {**LLAMA_MINI, "num_hidden_layers": 4, "sliding_window": 128,
             "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]}
    arch = arch_from_config(mixed)
    assert (arch.sliding_window, arch.sliding_window_layers, arch.all_layers_sliding) == (128, (0, 2), False)
    qwen_on = {**LLAMA_MINI, "model_type": "qwen2", "num_hidden_layers": 4, "sliding_window": 256,
               "use_sliding_window": True, "max_window_layers": 1}
    assert arch_from_config(qwen_on).sliding_window_layers == (1, 2, 3)


def test_mixtral_moe_fields() -> None:
    arch = load_arch("Mixtral-8x7B-v0.1")
    assert arch.is_moe and not arch.is_mla
    assert (arch.num_experts, arch.num_experts_per_tok) == (8, 2)
    # no moe_intermediate_size in Mixtral's config: each expert is a full-size MLP
    assert arch.moe_intermediate_size == 14336
    assert (arch.num_shared_experts, arch.first_k_dense_replace, arch.moe_layers) == (0, 0, 32)


def test_deepseek_v3_moe_and_mla_fields() -> None:
    arch = load_arch("DeepSeek-V3")
    assert arch.is_moe and arch.is_mla
    assert (arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size) == (256, 8, 2048)
    assert (arch.num_shared_experts, arch.shared_expert_intermediate_size) == (1, 2048)
    assert (arch.first_k_dense_replace, arch.moe_layers) == (3, 58)
    assert (arch.kv_lora_rank, arch.q_lora_rank) == (512, 1536)
    assert (arch.qk_rope_head_dim, arch.qk_nope_head_dim, arch.v_head_dim) == (64, 128, 128)
    assert arch.num_mtp_layers == 1
    assert arch.quant_method == "fp8"
    assert arch.quantization_config is not None
    assert arch.quantization_config["weight_block_size"] == [128, 128]


def test_dense_models_have_no_moe_or_mla() -> None:
    arch = load_arch("Llama-3.1-70B")
    assert not arch.is_moe and not arch.is_mla
    assert (arch.num_experts, arch.moe_layers, arch.kv_lora_rank, arch.quant_method) == (0, 0, None, None)


def test_qwen2_has_qkv_bias_llama_does_not() -> None:
    assert load_arch("Qwen2.5-72B").attention_bias is True
    assert load_arch("Llama-3.1-8B").attention_bias is False


@pytest.mark.parametrize(
    ("quantization_config", "method"),
    [
        ({"quant_method": "awq", "bits": 4, "group_size": 128}, "awq"),
        ({"quant_method": "gptq", "bits": 4}, "gptq"),
        ({"quant_method": "gptq", "bits": 8}, "int8"),
        ({"quant_method": "compressed-tensors",
          "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "float"}}}}, "fp8"),
        ({"quant_method": "compressed-tensors",
          "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int"}}}}, "int4"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "int4"),
    ],
)
def test_quant_method_is_normalised(quantization_config: dict[str, object], method: str) -> None:
    arch = arch_from_config({**LLAMA_MINI, "quantization_config": quantization_config})
    assert arch.quant_method == method


def test_multimodal_text_config_is_read() -> None:
    wrapper = {"model_type": "llava", "text_config": LLAMA_MINI, "vision_config": {"hidden_size": 1024}}
    arch = arch_from_config(wrapper)
    assert (arch.num_layers, arch.hidden_size, arch.model_type) == (2, 128, "llama")


def test_newer_dtype_key_is_read() -> None:
    cfg = {k: v for k, v in LLAMA_MINI.items() if k != "torch_dtype"}
    assert arch_from_config({**cfg, "dtype": "float16"}).torch_dtype == "float16"
    assert arch_from_config(cfg).torch_dtype is None


def test_model_arch_is_frozen_and_hashable() -> None:
    arch = load_arch("DeepSeek-V3")
    with pytest.raises(dataclasses.FrozenInstanceError):
        arch.num_layers = 1  # type: ignore[misc]
    assert {arch: "ok"}[load_arch("deepseek-ai/DeepSeek-V3")] == "ok"
    assert isinstance(arch, ModelArch)


def test_zero_counts_and_the_num_experts_alias() -> None:
    # Qwen3-MoE style: experts under "num_experts", no shared expert, no dense-first layers
    moe = {**LLAMA_MINI, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
           "n_shared_experts": 0, "first_k_dense_replace": 0, "num_nextn_predict_layers": 0}
    arch = arch_from_config(moe)
    assert (arch.num_experts, arch.moe_intermediate_size, arch.num_shared_experts) == (4, 32, 0)
    assert (arch.first_k_dense_replace, arch.moe_layers, arch.num_mtp_layers) == (0, 2, 0)
    with pytest.raises(ModelConfigError, match="'n_shared_experts' must be an integer >= 0, got -1"):
        arch_from_config({**moe, "n_shared_experts": -1})
