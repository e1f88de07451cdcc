"""A LoRA adapter as the controller reads it (gpufleet.config.lora_files): the lab's tiny adapters, and what the
resolver's copy of its config changes. Bad adapters, one line each: tests/data/corpus/lora.yaml."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gpufleet_lab.tiny_adapters import CONFIG_FILE, WEIGHTS_FILE, TinyAdapter, make_tiny_adapter

from gpufleet.config import lora_files
from gpufleet.config.settings.vllm import LoraAdapter
from gpufleet.digest import file_sha256


def test_an_adapter_is_read_with_its_rank_base_and_weights_digest(tmp_path: Path) -> None:
    folder = make_tiny_adapter(tmp_path / "poet", TinyAdapter("poet", 8, 1), base="org/model")
    found = lora_files.read_adapter(str(folder))
    assert (found.rank, found.base_model) == (8, "org/model")
    assert found.weights_sha256 == file_sha256(folder / WEIGHTS_FILE)
    adapters = {"poet": LoraAdapter(source=str(folder), sha256=found.weights_sha256)}
    assert lora_files.adapter_problems(adapters, "org/model", "org/model", "0.31.0", {}) == []
    # a rank above the replicas' max-lora-rank, as vllm_extra_args sets it
    assert lora_files.adapter_problems(adapters, "org/model", "org/model", "0.31.0", {"max-lora-rank": 4}) == [
        (("vllm_lora_adapters.poet",), "expected a rank at most max-lora-rank (4), found r 8 in adapter_config.json")]


def test_the_resolvers_config_names_the_replicas_model_and_keeps_the_rest(tmp_path: Path) -> None:
    folder = make_tiny_adapter(tmp_path / "chef", TinyAdapter("chef", 4, 2), base="org/model")
    written = json.loads(lora_files.resolver_config(lora_files.read_adapter(str(folder)),
                                                    "/var/lib/gpufleet/models/org--model"))
    original = json.loads((folder / CONFIG_FILE).read_text())
    assert written == {**original, "base_model_name_or_path": "/var/lib/gpufleet/models/org--model"}


def test_a_replicas_adapters_are_resolved_from_its_own_directory() -> None:
    assert lora_files.adapter_env("/etc/gpufleet/vllm/r/adapters") == {
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_PLUGINS": "lora_filesystem_resolver",
        "VLLM_LORA_RESOLVER_CACHE_DIR": "/etc/gpufleet/vllm/r/adapters"}


def test_adapters_on_a_release_without_lora_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every release gpufleet catalogs (0.31 to 0.33) has --enable-lora; a catalog without it refuses the adapters
    before any other check."""
    folder = make_tiny_adapter(tmp_path / "poet", TinyAdapter("poet", 8, 1), base="org/model")
    adapters = {"poet": LoraAdapter(source=str(folder), sha256=file_sha256(folder / WEIGHTS_FILE))}
    real = lora_files.load_catalog("0.31.0")

    class WithoutLora:
        def spec(self, flag: str) -> object:
            return None if flag == "--enable-lora" else real.spec(flag)

    monkeypatch.setattr(lora_files, "load_catalog", lambda version: WithoutLora())
    assert lora_files.adapter_problems(adapters, "org/model", "org/model", "0.31.0", {}) == [
        (("vllm_lora_adapters", "vllm_version"), "expected a vLLM release with LoRA support, found 0.31.0 without"
                                                 " --enable-lora")]
