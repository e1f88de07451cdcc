"""The lab's tiny model: a random-weight Llama the lab makes itself, small enough for the CPU build of vLLM.

Deterministic (fixed seed, fixed corpus): the same call writes the same bytes, so its checksums can pin a model
revision like a real one. No torch needed: bf16 weights are written in the safetensors format directly, the
tokenizer is a byte-level BPE trained locally with ``tokenizers``. The shape follows the lab findings: head_dim 64
(the CPU attention kernels reject 16), one KV head, 2 layers, about 0.4 M parameters.

numpy and tokenizers (the ``lab`` extra) are imported only when a model is made or read.
"""

from __future__ import annotations

import json
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

SEED = 20251121
BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class TinyLlama:
    """The architecture of the lab's tiny model."""

    layers: int = 2
    hidden: int = 128
    heads: int = 2
    kv_heads: int = 1
    head_dim: int = 64
    intermediate: int = 256
    vocab: int = 512
    max_positions: int = 512

    def config(self) -> dict[str, object]:
        """The Hugging Face ``config.json`` of a ``LlamaForCausalLM`` of this shape."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab,
            "max_position_embeddings": self.max_positions,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "initializer_range": 0.02,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "pad_token_id": 2,
            "torch_dtype": "bfloat16",
            "use_cache": True,
        }

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight tensor of the checkpoint, by its Hugging Face Llama name."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab, self.hidden)}
        for i in range(self.layers):
            p = f"model.layers.{i}"
            shapes |= {
                f"{p}.input_layernorm.weight": (self.hidden,),
                f"{p}.self_attn.q_proj.weight": (q, self.hidden),
                f"{p}.self_attn.k_proj.weight": (kv, self.hidden),
                f"{p}.self_attn.v_proj.weight": (kv, self.hidden),
                f"{p}.self_attn.o_proj.weight": (self.hidden, q),
                f"{p}.post_attention_layernorm.weight": (self.hidden,),
                f"{p}.mlp.gate_proj.weight": (self.intermediate, self.hidden),
                f"{p}.mlp.up_proj.weight": (self.intermediate, self.hidden),
                f"{p}.mlp.down_proj.weight": (self.hidden, self.intermediate),
            }
        shapes |= {"model.norm.weight": (self.hidden,), "lm_head.weight": (self.vocab, self.hidden)}
        return shapes


# A wider one (about 8.5 M parameters, 2048 positions) for benches where a prompt's prefill must take measurable
# time on the CPU build (a prompt of 1,000 tokens: about 0.15 s on an idle lab replica, where the tiny model's
# takes 15 ms whether its prefix is cached or not): bench/prefix_routing.py's default.
WIDE = TinyLlama(layers=4, hidden=512, heads=8, head_dim=64, intermediate=1024, max_positions=2048)


def make_tiny_model(out_dir: Path | str, arch: TinyLlama = TinyLlama()) -> Path:
    """Write the tiny model (config, bf16 safetensors, tokenizer) into ``out_dir`` and return it."""
    import numpy as np

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(SEED)
    tensors = {
        name: np.ones(shape, np.float32) if name.endswith("norm.weight") else rng.normal(0.0, 0.02, shape)
        for name, shape in arch.tensor_shapes().items()
    }
    total = write_bf16_safetensors(out / WEIGHTS_FILE, tensors)
    index = {"metadata": {"total_size": total}, "weight_map": dict.fromkeys(sorted(tensors), WEIGHTS_FILE)}
    _write_json(out / "model.safetensors.index.json", index)
    _write_json(out / "config.json", arch.config())
    _write_json(out / "generation_config.json", {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2})
    _write_tokenizer(out, arch.vocab)
    return out


def to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) of float values, rounded to nearest even."""
    import numpy as np

    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def from_bf16_bits(bits: np.ndarray) -> np.ndarray:
    """float32 values of bfloat16 bit patterns."""
    import numpy as np

    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def write_bf16_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> int:
    """Write ``tensors`` as BF16 in the safetensors format; return the size of the tensor data in bytes."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name in sorted(tensors):
        blob = to_bf16_bits(tensors[name]).astype("<u2").tobytes()
        shape, offsets = list(tensors[name].shape), [offset, offset + len(blob)]
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": offsets}
        blobs.append(blob)
        offset += len(blob)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for blob in blobs:
            f.write(blob)
    return offset


def read_bf16_safetensors(path: Path) -> dict[str, np.ndarray]:
    """float32 values of every BF16 tensor of a safetensors file (the inverse of :func:`write_bf16_safetensors`)."""
    import numpy as np

    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    header.pop("__metadata__", None)
    base = 8 + size
    out = {}
    for name, meta in header.items():
        if meta["dtype"] != "BF16":
            raise ValueError(f"{name}: dtype {meta['dtype']}, expected BF16")
        start, end = meta["data_offsets"]
        bits = np.frombuffer(data[base + start : base + end], dtype="<u2")
        out[name] = from_bf16_bits(bits).reshape(meta["shape"])
    return out


# A small, fixed training corpus: enough text for 250 byte-level merges.
CORPUS = (
    "The fleet serves language models from GPU servers. Each node runs a driver, a fabric manager, "
    "a DCGM host engine and an exporter; the serving process starts only after the health gate passes.\n"
    "A replica spans one or more nodes. Tensor parallel groups stay inside an NVLink island, pipeline stages "
    "may cross nodes, and every node of a replica runs the same driver, the same Python and the same vLLM.\n",
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
    "How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow.\n"
    "One two three four five six seven eight nine ten. 0 1 2 3 4 5 6 7 8 9 10 100 1000.\n",
    "Hello! How are you today? I am fine, thank you. What is the capital of France? Paris is the capital. "
    "Tell me a story about a small robot who learned to count the stars in the night sky.\n"
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(add(i, i))\n",
)

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def _write_tokenizer(out: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    with tempfile.TemporaryDirectory() as tmp:
        files = []
        for i, text in enumerate(CORPUS):
            files.append(Path(tmp) / f"corpus-{i}.txt")
            files[-1].write_text(text)
        tokenizer.train([str(f) for f in files], trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tokenizer.token_to_id(BOS))]
    )
    tokenizer.save(str(out / "tokenizer.json"))
    specials = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    _write_json(out / "special_tokens_map.json", specials)
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **specials,
            "model_max_length": 512,
            "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE,
        },
    )


def _write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
