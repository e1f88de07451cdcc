"""A pool's LoRA adapters as the controller reads them, before any host: their files, hash, rank and base model.

An adapter is PEFT's layout: ``adapter_config.json`` (its rank ``r``, ``target_modules`` and the base model it was
trained on, ``base_model_name_or_path``) and ``adapter_model.safetensors``, the weights, whose SHA-256 the inventory
pins. What vLLM would refuse at load time, or load onto the wrong model, is refused here with one line: a hash that
does not match, a rank above the replicas' ``max-lora-rank``, an adapter of another base model, a name that is the
model's own, a release without LoRA.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpufleet.config.settings.vllm import LoraAdapter
from gpufleet.digest import file_sha256
from gpufleet.input_files import MAX_FILE_BYTES, InputFileError, found_at, json_depth_problem, read_regular
from gpufleet.values import grammar
from gpufleet.values.vllm_flags import load_catalog

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
JSON_KINDS = {list: "a list", str: "a string", int: "a number", float: "a number", bool: "true or false",
              type(None): "null"}
RESOLVER_PLUGIN = "lora_filesystem_resolver"
"""vLLM's plugin that loads an adapter a request names from a directory (``VLLM_LORA_RESOLVER_CACHE_DIR``)."""


@dataclass(frozen=True)
class AdapterFiles:
    """What an adapter's ``adapter_config.json`` says, and its weights' digest."""

    config: dict[str, Any]
    rank: int
    base_model: str
    weights_sha256: str


def read_adapter(source: str) -> AdapterFiles:
    """The adapter in directory ``source``; ValueError saying what was expected and found."""
    root = Path(source).expanduser()
    try:
        text = read_regular(root / CONFIG_FILE, CONFIG_FILE).decode()
    except InputFileError as error:
        raise ValueError(f"expected a readable {CONFIG_FILE} of at most {MAX_FILE_BYTES:,} bytes in"
                         f" {grammar.show(source)}, found {error.found or 'none'}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"expected a readable {CONFIG_FILE} in {grammar.show(source)},"
                         f" found {type(error).__name__}") from None
    if problem := json_depth_problem(text):
        raise ValueError(f"{CONFIG_FILE}: {problem}")
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"expected JSON in {CONFIG_FILE}, found an error at line {error.lineno}") from None
    if not isinstance(config, dict):
        raise ValueError(f"expected a JSON object in {CONFIG_FILE}, found {JSON_KINDS.get(type(config), 'a value')}")
    if config.get("peft_type") != "LORA":
        raise ValueError(f"expected a LoRA adapter ({CONFIG_FILE} with peft_type LORA), found peft_type"
                         f" {grammar.show(config.get('peft_type'))}")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"expected a whole rank r >= 1 in {CONFIG_FILE}, found {grammar.show(rank)}")
    base = config.get("base_model_name_or_path")
    if not isinstance(base, str) or not base:
        raise ValueError(f"expected base_model_name_or_path in {CONFIG_FILE}, found {grammar.show(base)}")
    weights = root / WEIGHTS_FILE
    if (what := found_at(str(weights))) != "a regular file":
        raise ValueError(f"expected {WEIGHTS_FILE} in {grammar.show(source)}, found {what}")
    return AdapterFiles(config, rank, base, file_sha256(weights))  # once per run: the digest is kept


def max_rank(version: str, args: Mapping[str, Any]) -> int:
    """The replicas' ``--max-lora-rank``: as ``vllm_extra_args`` (``args``) sets it, else release ``version``'s
    default."""
    catalog = load_catalog(version)
    given = catalog.given(args, "--max-lora-rank")
    spec = catalog.spec("--max-lora-rank")
    return whole_number(given[1] if given else (spec.default if spec else None)) or 16


def whole_number(value: object) -> int | None:
    """A LoRA flag's whole number as vLLM reads it: an integer, or its digits written as text (argparse's int())."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    return int(value) if isinstance(value, str) and value.isdigit() else None


def adapter_problems(adapters: Mapping[str, LoraAdapter], served: str, model: str, version: str,
                     args: Mapping[str, Any]) -> list[tuple[tuple[str, ...], str]]:
    """Each of a pool's ``adapters`` vLLM would not serve as declared, one problem per adapter: (keys, what is
    wrong). ``served``: the pool's served model name; ``model``: its ``vllm_model``; ``version``, ``args``: its
    ``vllm_version`` and ``vllm_extra_args``."""
    if not adapters:
        return []
    catalog = load_catalog(version)
    if catalog.spec("--enable-lora") is None:
        return [(("vllm_lora_adapters", "vllm_version"),
                 f"expected a vLLM release with LoRA support, found {version} without --enable-lora")]
    enabled = catalog.given(args, "--enable-lora")
    if enabled is not None and enabled[1] is not True:
        return [((f"vllm_extra_args.{enabled[0]}", "vllm_lora_adapters"),
                 "expected enable-lora left out or true with vllm_lora_adapters, found it off")]
    found: list[tuple[tuple[str, ...], str]] = []
    rank_limit = max_rank(version, args)
    for name, adapter in adapters.items():
        where = f"vllm_lora_adapters.{name}"
        if name == served:
            found.append(((where,), "expected a name other than the served model's, found the same"))
            continue
        try:
            files = read_adapter(adapter.source)
        except ValueError as error:
            found.append(((f"{where}.source",), str(error)))
            continue
        if files.weights_sha256 != adapter.sha256:
            found.append(((f"{where}.sha256",), f"expected the SHA-256 of {WEIGHTS_FILE}, found {adapter.sha256};"
                                                f" the file's is {files.weights_sha256}"))
        elif files.rank > rank_limit:
            found.append(((where,), f"expected a rank at most max-lora-rank ({rank_limit}), found r {files.rank}"
                                    f" in {CONFIG_FILE}"))
        elif files.base_model != model:
            found.append(((where,), f"expected an adapter of vllm_model {grammar.show(model)}, found one"
                                    f" of {grammar.show(files.base_model)} ({CONFIG_FILE}'s"
                                    " base_model_name_or_path)"))
    return found


def resolver_config(files: AdapterFiles, model: str) -> str:
    """The ``adapter_config.json`` vLLM's filesystem resolver reads: the adapter's own, its base model named as the
    replica's ``--model`` (the resolver loads only an adapter of the model it serves, by that name)."""
    return json.dumps({**files.config, "base_model_name_or_path": model}, indent=1, sort_keys=True) + "\n"


def adapter_env(resolver: str) -> dict[str, str]:
    """What a replica's vLLM serves its adapters with: the filesystem resolver over ``resolver`` (which vLLM 0.31 to
    0.33 load only with runtime updating on; its load and unload routes are never routed: roles/router)."""
    return {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_PLUGINS": RESOLVER_PLUGIN,
            "VLLM_LORA_RESOLVER_CACHE_DIR": resolver}
