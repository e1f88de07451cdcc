"""Tests for the vLLM flag catalogs and the ``vllm serve`` flag checker."""

from __future__ import annotations

import json
import re
from importlib import resources

import pytest

from gpufleet.config.schema import OWNED_FLAGS
from gpufleet.values.vllm_flags import (
    DEFAULT_VLLM_VERSION,
    SUPPORTED_VLLM_VERSIONS,
    FlagCatalog,
    FlagProblem,
    UnsupportedVersionError,
    load_catalog,
)

MODEL = "meta-llama/Llama-3.1-70B-Instruct"

SEED_REMOVED = [
    "--worker-use-ray", "--use-v2-block-manager", "--speculative-model",
    "--num-speculative-tokens", "--speculative-draft-tensor-parallel-size",
    "--num-scheduler-steps", "--swap-space", "--preemption-mode", "--guided-decoding-backend",
    "--scheduler-delay-factor", "--tokenizer-pool-size", "--tokenizer-pool-type",
    "--max-seq-len-to-capture", "--enable-prompt-adapter", "--calculate-kv-scales",
    "--disable-async-output-proc", "--device", "--max-concurrency", "--reasoning-effort",
]


def removed_entries() -> dict[str, dict[str, str]]:
    text = (resources.files("gpufleet") / "data" / "vllm_catalogs" / "removed.json").read_text()
    return json.loads(text)


@pytest.fixture(scope="module")
def cat() -> FlagCatalog:
    return load_catalog("0.33.0")


@pytest.fixture(scope="module")
def cat32() -> FlagCatalog:
    return load_catalog("0.32.0")


def messages(catalog: FlagCatalog, *args: str) -> list[str]:
    return [str(p) for p in catalog.check_argv([MODEL, *args])]


# -- catalogs -------------------------------------------------------------------


def test_supported_versions_and_default() -> None:
    assert SUPPORTED_VLLM_VERSIONS == ("0.33.0", "0.32.0", "0.31.0")
    assert DEFAULT_VLLM_VERSION == "0.33.0"
    assert load_catalog().version == "0.33.0"


def test_catalog_is_cached(cat: FlagCatalog) -> None:
    assert load_catalog("0.33.0") is cat


def test_unsupported_version_lists_supported_ones() -> None:
    with pytest.raises(UnsupportedVersionError) as info:
        load_catalog("0.30.0")
    assert "0.30.0" in str(info.value)
    for version in SUPPORTED_VLLM_VERSIONS:
        assert version in str(info.value)


@pytest.mark.parametrize("version", SUPPORTED_VLLM_VERSIONS)
def test_catalog_sizes(version: str) -> None:
    catalog = load_catalog(version)
    assert catalog.version == version
    assert 250 < len(catalog) < 400


def test_033_has_more_than_250_options(cat: FlagCatalog) -> None:
    assert len(cat) > 250
    assert len(cat) == len(cat.names) == len(set(cat.names))


def test_gpu_memory_utilization_default_is_092(cat: FlagCatalog) -> None:
    spec = cat.spec("--gpu-memory-utilization")
    assert spec is not None
    assert spec.default == 0.92
    assert spec.type == "float"
    assert cat.spec("--device-memory-utilization") is spec


@pytest.mark.parametrize("version", SUPPORTED_VLLM_VERSIONS)
def test_catalog_files_are_sorted_and_complete(version: str) -> None:
    path = resources.files("gpufleet") / "data" / "vllm_catalogs" / f"vllm-{version}.json"
    data = json.loads(path.read_text())
    assert data["vllm_version"] == version
    names = [o["name"] for o in data["options"]]
    assert names == sorted(names)
    required = {"name", "option_strings", "aliases", "type", "nargs", "choices", "default",
                "negatable", "negations"}
    for option in data["options"]:
        assert required <= option.keys(), option["name"]
        assert option["name"] in option["option_strings"]
        assert option["option_strings"] == sorted(option["option_strings"])
        assert option["negatable"] == bool(option["negations"])
        help_text = option["help"]
        assert isinstance(help_text, str)
    # Built under --help: the help texts are there.
    assert sum(bool(o["help"]) for o in data["options"]) > 0.9 * len(names)


@pytest.mark.parametrize("version", SUPPORTED_VLLM_VERSIONS)
def test_every_flag_gpufleet_owns_is_in_the_catalog(version: str) -> None:
    catalog = load_catalog(version)
    assert [flag for flag in OWNED_FLAGS if not catalog.has(flag)] == []


def test_031_lacks_the_flags_032_added(cat32: FlagCatalog) -> None:
    cat31 = load_catalog("0.31.0")
    assert set(cat31.names) < set(cat32.names)
    for flag in ("--enable-shm-tensor-arena", "--grpc-port", "--custom-histogram-buckets"):
        assert cat32.has(flag) and not cat31.has(flag), flag


def test_catalog_records_aliases_and_negations(cat: FlagCatalog) -> None:
    tp = cat.spec("-tp")
    assert tp is not None and tp.name == "--tensor-parallel-size" and tp.type == "int"
    caching = cat.spec("--enable-prefix-caching")
    assert caching is not None and caching.type == "bool"
    assert set(caching.negations) == {"--no-enable-prefix-caching", "--disable-prefix-caching"}
    assert cat.spec("-pp").name == "--pipeline-parallel-size"  # type: ignore[union-attr]
    assert cat.spec("-O") is None  # -O<level> is rewritten by vLLM, not registered


def test_has_accepts_every_spelling(cat: FlagCatalog) -> None:
    assert cat.has("--tensor-parallel-size")
    assert cat.has("tensor_parallel_size")
    assert cat.has("-tp")
    assert cat.has("--no-enable-prefix-caching")
    assert not cat.has("--swap-space")
    assert not cat.has("--reasoning-effort")


def test_kv_cache_memory_bytes_is_human_readable_int(cat: FlagCatalog) -> None:
    spec = cat.spec("--kv-cache-memory-bytes")
    assert spec is not None
    assert spec.type == "human_int"
    assert spec.nullable


@pytest.mark.parametrize("flag", [
    "--distributed-executor-backend", "--nnodes", "--node-rank", "--master-addr",
    "--master-port", "--headless", "--data-parallel-size", "--data-parallel-size-local",
    "--data-parallel-address", "--data-parallel-rpc-port", "--data-parallel-start-rank",
    "--data-parallel-backend", "--api-server-count",
])
def test_multi_node_flags_exist_in_033(cat: FlagCatalog, flag: str) -> None:
    assert cat.has(flag)


def test_multi_node_flag_details(cat: FlagCatalog) -> None:
    backend = cat.spec("--distributed-executor-backend")
    assert backend is not None and backend.known_values is not None
    assert {"ray", "mp"} <= set(backend.known_values)
    assert cat.spec("--nnodes").default == 1  # type: ignore[union-attr]
    assert cat.spec("--headless").type == "bool"  # type: ignore[union-attr]


# -- removed flags -----------------------------------------------------------------


def test_removed_json_lists_every_seed_flag() -> None:
    entries = removed_entries()
    for flag in SEED_REMOVED:
        assert flag in entries, flag
        assert entries[flag]["replacement"].strip()


def test_replacement_flags_exist_in_033(cat: FlagCatalog) -> None:
    for flag, entry in removed_entries().items():
        for named in re.findall(r"--[a-z][a-z0-9-]*", entry["replacement"]):
            assert cat.has(named) or named == flag, f"{flag} names unknown {named}"


@pytest.mark.parametrize("flag", SEED_REMOVED)
def test_removed_seed_flag_gives_its_replacement(cat: FlagCatalog, flag: str) -> None:
    assert not cat.has(flag)
    problems = cat.check_argv([MODEL, flag, "1"])
    assert len(problems) == 1
    assert problems[0].flag == flag
    assert removed_entries()[flag]["replacement"] in problems[0].message


@pytest.mark.parametrize(("flag", "expected"), [
    ("--worker-use-ray", "--distributed-executor-backend ray"),
    ("--speculative-model", "--speculative-config"),
    ("--num-speculative-tokens", "num_speculative_tokens"),
    ("--guided-decoding-backend", "--structured-outputs-config.backend"),
    ("--max-seq-len-to-capture", "--max-cudagraph-capture-size"),
    ("--preemption-mode", "--kv-offloading-backend"),
    ("--max-concurrency", "vllm bench serve"),
])
def test_specific_replacements(cat: FlagCatalog, flag: str, expected: str) -> None:
    [problem] = cat.check_argv([MODEL, flag, "x"])
    assert expected in problem.message


def test_swap_space_one_liner(cat: FlagCatalog) -> None:
    assert messages(cat, "--swap-space", "4") == [
        "--swap-space: removed from vLLM; use --kv-offloading-size / --kv-offloading-backend"
    ]


def test_removed_flag_in_underscore_and_equals_forms(cat: FlagCatalog) -> None:
    [problem] = cat.check_argv([MODEL, "--swap_space=4"])
    assert problem.flag == "--swap-space"
    assert "--kv-offloading-size" in problem.message


def test_disable_log_requests_parses_in_033_only(cat: FlagCatalog, cat32: FlagCatalog) -> None:
    assert messages(cat, "--disable-log-requests") == []
    assert "--disable-log-requests" not in cat.removed
    [problem] = cat32.check_argv([MODEL, "--disable-log-requests"])
    assert "--enable-log-requests" in problem.message
    assert "--disable-log-requests" in cat32.removed


def test_problem_str() -> None:
    problem = FlagProblem("--x", "bad")
    assert str(problem) == "--x: bad"


# -- unknown flags and the prefix trap -----------------------------------------------


@pytest.mark.parametrize(("typo", "nearest"), [
    ("--max-modl-len", "--max-model-len"),
    ("--tensor-paralel-size", "--tensor-parallel-size"),
    ("--gpu-memory-utilisation", "--gpu-memory-utilization"),
])
def test_unknown_flag_names_the_nearest(cat: FlagCatalog, typo: str, nearest: str) -> None:
    [problem] = cat.check_argv([MODEL, typo, "1"])
    assert problem.flag == typo
    assert "unknown flag" in problem.message
    assert nearest in problem.message


def test_reasoning_effort_prefix_trap(cat: FlagCatalog) -> None:
    # vLLM's argparse would read it as --reasoning-effort-map and fail on "high".
    assert cat.has("--reasoning-effort-map")
    [problem] = cat.check_argv([MODEL, "--reasoning-effort", "high"])
    assert problem.flag == "--reasoning-effort"
    assert "--reasoning-effort-map" in problem.message


@pytest.mark.parametrize(("prefix", "full"), [
    ("--max-num-seq", "--max-num-seqs"),
    ("--enable-prefix", "--enable-prefix-caching"),
    ("--gpu-memory", "--gpu-memory-utilization"),
])
def test_unique_prefixes_are_rejected(cat: FlagCatalog, prefix: str, full: str) -> None:
    [problem] = cat.check_argv([MODEL, prefix, "8"])
    assert "prefix" in problem.message and full in problem.message


def test_ambiguous_prefix(cat: FlagCatalog) -> None:
    [problem] = cat.check_argv([MODEL, "--max-num", "8"])
    assert "ambiguous prefix" in problem.message


def test_double_dash_short_alias_hint(cat: FlagCatalog) -> None:
    [problem] = cat.check_argv([MODEL, "--tp", "2"])
    assert "-tp" in problem.message and "--tensor-parallel-size" in problem.message


# -- values ----------------------------------------------------------------------------


@pytest.mark.parametrize("version", SUPPORTED_VLLM_VERSIONS)
def test_kv_cache_dtype_values(version: str) -> None:
    catalog = load_catalog(version)
    [problem] = catalog.check_argv([MODEL, "--kv-cache-dtype", "fp9"])
    assert "'fp9'" in problem.message and "fp8" in problem.message
    for good in ("fp8", "fp8_e4m3", "auto"):
        assert catalog.check_argv([MODEL, "--kv-cache-dtype", good]) == []


def test_kv_cache_dtype_is_an_open_literal_in_033(cat: FlagCatalog, cat32: FlagCatalog) -> None:
    # 0.33.0 lists the dtypes without enforcing them in argparse; 0.32.0 enforced them.
    spec33, spec32 = cat.spec("--kv-cache-dtype"), cat32.spec("--kv-cache-dtype")
    assert spec33 is not None and spec32 is not None
    assert spec33.choices is None and "fp8" in (spec33.known_values or ())
    assert spec32.choices is not None and "fp8" in spec32.choices


def test_prefix_caching_hash_algo_choices(cat: FlagCatalog) -> None:
    for algo in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"):
        assert messages(cat, "--prefix-caching-hash-algo", algo) == []
    [problem] = cat.check_argv([MODEL, "--prefix-caching-hash-algo", "md5"])
    assert "invalid choice 'md5'" in problem.message


def test_dtype_choice_suggests_the_nearest(cat: FlagCatalog) -> None:
    [problem] = cat.check_argv([MODEL, "--dtype", "bfloat_16"])
    assert "did you mean bfloat16" in problem.message


def test_choices_after_normalisation(cat: FlagCatalog) -> None:
    # vLLM lower-cases and turns dashes into underscores before checking choices.
    assert messages(cat, "--moe-backend", "Flashinfer-Cutlass") == []
    assert len(cat.check_argv([MODEL, "--moe-backend", "nope"])) == 1


@pytest.mark.parametrize("args", [
    ["--max-model-len", "abc"],
    ["--max-model-len", "1.5K"],
    ["--tensor-parallel-size", "2.5"],
    ["--gpu-memory-utilization", "high"],
    ["--kv-cache-memory-bytes", "1.5G"],
    ["--kv-cache-memory-bytes", "ten"],
    ["--compilation-config", '{"mode": 3'],
    ["--speculative-config", "num_speculative_tokens=3"],
    ["--reasoning-effort-map", "high"],
])
def test_bad_values(cat: FlagCatalog, args: list[str]) -> None:
    problems = cat.check_argv([MODEL, *args])
    assert len(problems) == 1
    assert problems[0].flag == args[0]
    assert repr(args[1]) in problems[0].message


@pytest.mark.parametrize("args", [
    ["--max-model-len", "32768"],
    ["--max-model-len", "32k"],
    ["--max-model-len", "32K"],
    ["--max-model-len", "auto"],
    ["--max-model-len", "-1"],
    ["--kv-cache-memory-bytes", "10G"],
    ["--kv-cache-memory-bytes", "1.5g"],
    ["--kv-cache-memory-bytes", "21474836480"],
    ["--max-num-batched-tokens", "16k"],
    ["--gpu-memory-utilization", "0.9"],
    ["--compilation-config", '{"mode": 3, "cudagraph_capture_sizes": [1, 2, 4]}'],
    ["--kv-transfer-config", '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}'],
    ["--speculative-config", '{"model": "draft", "num_speculative_tokens": 3}'],
    ["--hf-overrides", '{"rope_theta": 1000000}'],
    ["--served-model-name", "llama", "llama-70b"],
    ["--hf-token"],
])
def test_good_values(cat: FlagCatalog, args: list[str]) -> None:
    assert messages(cat, *args) == []


def test_missing_values(cat: FlagCatalog) -> None:
    assert messages(cat, "--max-model-len") == ["--max-model-len: expects a value"]
    assert messages(cat, "--max-model-len", "--enforce-eager") == [
        "--max-model-len: expects a value"
    ]
    assert messages(cat, "--served-model-name") == ["--served-model-name: expects a value"]


# -- booleans, aliases, forms ---------------------------------------------------------------


@pytest.mark.parametrize("args", [
    ["--enable-prefix-caching"],
    ["--no-enable-prefix-caching"],
    ["--disable-prefix-caching"],
    ["--enforce-eager"],
    ["--no-enforce-eager"],
    ["--headless"],
    ["-ep"],
])
def test_boolean_forms(cat: FlagCatalog, args: list[str]) -> None:
    assert messages(cat, *args) == []


def test_boolean_takes_no_value(cat: FlagCatalog) -> None:
    [problem] = cat.check_argv([MODEL, "--enable-prefix-caching=true"])
    assert "takes no value" in problem.message
    assert "--no-enable-prefix-caching" in problem.message


def test_plain_switch_has_no_negation(cat: FlagCatalog) -> None:
    [problem] = cat.check_argv([MODEL, "--no-headless"])
    assert "--headless" in problem.message


@pytest.mark.parametrize("args", [
    ["-tp", "2"], ["-tp=2"], ["-pp", "2"], ["-dp", "4"], ["-O3"], ["-O", "3"], ["-O=3"],
    ["--tensor_parallel_size", "2"], ["--max-model-len=8192"], ["--max_model_len=8k"],
    ["--compilation-config.mode", "3"], ["-cc.mode=3"],
    ["--compilation-config.cudagraph_capture_sizes+", "8,16"],
    ["--speculative-config.num_speculative_tokens", "3"],
    ["--structured-outputs-config.backend", "xgrammar"],
])
def test_accepted_forms(cat: FlagCatalog, args: list[str]) -> None:
    assert messages(cat, *args) == []


def test_tp_short_alias_value_is_checked(cat: FlagCatalog) -> None:
    [problem] = cat.check_argv([MODEL, "-tp", "two"])
    assert problem.flag == "-tp"


def test_bare_dash_o_needs_a_level(cat: FlagCatalog) -> None:
    assert len(cat.check_argv([MODEL, "-O"])) == 1
    assert len(cat.check_argv([MODEL, "-O", "decode"])) == 2  # and "decode" is a 2nd positional


def test_dotted_keys_need_a_json_flag(cat: FlagCatalog) -> None:
    [problem] = cat.check_argv([MODEL, "--max-model-len.x", "3"])
    assert "does not take JSON" in problem.message


def test_config_two_token_form_only(cat: FlagCatalog) -> None:
    assert messages(cat, "--config", "serve.yaml") == []
    assert cat.check_argv(["--config", "serve.yaml"]) == []
    [problem] = cat.check_argv([MODEL, "--config=serve.yaml"])
    assert problem.flag == "--config"
    assert "silently ignores" in problem.message
    assert len(cat.check_argv([MODEL, "--config"])) == 1
    assert len(cat.check_argv([MODEL, "--config", "a.yaml", "--config", "b.yaml"])) == 1


def test_config_file_must_be_yaml(cat: FlagCatalog) -> None:
    [problem] = cat.check_argv([MODEL, "--config", "serve.json"])
    assert ".yaml" in problem.message
    assert cat.check_argv([MODEL, "--config", "serve.yml"]) == []


def test_lora_modules_forms(cat: FlagCatalog) -> None:
    good = ["sql=/loras/sql", '{"name": "chat", "path": "/loras/chat"}']
    assert messages(cat, "--enable-lora", "--lora-modules", *good) == []
    [problem] = cat.check_argv([MODEL, "--lora-modules", "sql"])
    assert "NAME=PATH" in problem.message


def test_known_values_are_case_insensitive(cat: FlagCatalog) -> None:
    # vLLM lower-cases --tokenizer-mode before looking it up.
    assert messages(cat, "--tokenizer-mode", "HF") == []
    assert len(cat.check_argv([MODEL, "--tokenizer-mode", "fancy"])) == 1


def test_executor_backend_accepts_import_paths(cat: FlagCatalog) -> None:
    assert messages(cat, "--distributed-executor-backend", "mp") == []
    assert messages(cat, "--distributed-executor-backend", "my_pkg.executor.MyExecutor") == []
    assert len(cat.check_argv([MODEL, "--distributed-executor-backend", "rayy"])) == 1


def test_positionals(cat: FlagCatalog) -> None:
    assert cat.check_argv(["-tp", "2", MODEL]) == []  # argparse takes it anywhere
    [problem] = cat.check_argv([MODEL, "-tp", "2", "extra"])
    assert problem.flag == "extra"
    [problem] = cat.check_argv([MODEL, "--model", MODEL])
    assert problem.flag == "--model"


def test_ray_multi_node_command_passes_033(cat: FlagCatalog) -> None:
    argv = [
        MODEL, "-tp", "8", "-pp", "2", "--distributed-executor-backend", "ray",
        "--host", "0.0.0.0", "--port", "8000", "--served-model-name", "llama-3.1-70b",
        "--gpu-memory-utilization", "0.92", "--max-model-len", "32k",
        "--max-num-seqs", "256", "--max-num-batched-tokens", "16384",
        "--enable-prefix-caching", "--enable-chunked-prefill", "--kv-cache-dtype", "fp8",
        "--api-key", "change-me", "--disable-log-stats",
    ]
    assert cat.check_argv(argv) == []


def test_mp_multi_node_commands_pass_033(cat: FlagCatalog) -> None:
    common = [MODEL, "-tp", "8", "-pp", "2", "--nnodes", "2", "--master-addr", "10.0.0.1",
              "--master-port", "29501"]
    assert cat.check_argv([*common, "--node-rank", "0"]) == []
    assert cat.check_argv([*common, "--node-rank", "1", "--headless"]) == []


def test_data_parallel_follower_passes_033(cat: FlagCatalog) -> None:
    argv = [MODEL, "--data-parallel-size", "4", "--data-parallel-size-local", "2",
            "--data-parallel-start-rank", "2", "--data-parallel-address", "10.0.0.1",
            "--data-parallel-rpc-port", "13345", "--data-parallel-backend", "mp", "--headless"]
    assert cat.check_argv(argv) == []


def test_seed_style_command_fails_with_all_problems(cat: FlagCatalog) -> None:
    argv = [MODEL, "--worker-use-ray", "--swap-space", "16", "--num-scheduler-steps", "8",
            "--use-v2-block-manager", "-tp", "4"]
    flags = [p.flag for p in cat.check_argv(argv)]
    assert flags == ["--worker-use-ray", "--swap-space", "--num-scheduler-steps",
                     "--use-v2-block-manager"]


# -- YAML config mappings -------------------------------------------------------------------


def test_config_mapping_passes(cat: FlagCatalog) -> None:
    mapping: dict[str, object] = {
        "model": MODEL,
        "tensor-parallel-size": 8,
        "pipeline_parallel_size": 2,
        "distributed-executor-backend": "ray",
        "gpu-memory-utilization": 0.92,
        "max-model-len": "32k",
        "kv-cache-memory-bytes": "10G",
        "enable-prefix-caching": True,
        "enable-chunked-prefill": False,
        "headless": False,
        "served-model-name": ["llama", "llama-70b"],
        "compilation-config": {"mode": 3},
        "speculative-config": {"model": "draft", "num_speculative_tokens": 3},
        "kv-cache-dtype": "fp8",
        "api-key": None,
    }
    assert cat.check_config(mapping) == []


@pytest.mark.parametrize(("mapping", "flag", "needle"), [
    ({"swap-space": 4}, "--swap-space", "--kv-offloading-size"),
    ({"max-modl-len": 4096}, "--max-modl-len", "--max-model-len"),
    ({"reasoning-effort": "high"}, "--reasoning-effort", "--reasoning-effort-map"),
    ({"max-model-len": "abc"}, "--max-model-len", "'abc'"),
    ({"kv-cache-dtype": "fp9"}, "--kv-cache-dtype", "'fp9'"),
    ({"max-model-len": {"x": 1}}, "--max-model-len", "JSON"),
    ({"port": [8000, 8001]}, "--port", "list of 2"),
    ({"enforce-eager": 1}, "--enforce-eager", "true or false"),
    ({"max-model-len": True}, "--max-model-len", "takes a value"),
    ({"max-num-seqs": False}, "--max-num-seqs", "silently ignores"),
    ({"enable_prefix_caching": False}, "--enable-prefix-caching", "silently ignores"),
    ({"config": "other.yaml"}, "--config", "inside another"),
    ({"--port": 8000}, "--port", "without dashes"),
    ({"tp": 2}, "--tp", "--tensor-parallel-size"),
    ({"speculative-config": "{not json"}, "--speculative-config", "JSON"),
])
def test_config_mapping_problems(
    cat: FlagCatalog, mapping: dict[str, object], flag: str, needle: str
) -> None:
    [problem] = cat.check_config(mapping)
    assert problem.flag == flag
    assert needle in problem.message


def test_config_false_with_dashes_is_fine(cat: FlagCatalog) -> None:
    assert cat.check_config({"enable-prefix-caching": False}) == []


def test_config_lists_are_checked_item_by_item(cat: FlagCatalog) -> None:
    assert cat.check_config({"cudagraph-capture-sizes": [1, 2, 4, 8]}) == []
    [problem] = cat.check_config({"cudagraph-capture-sizes": [1, "two"]})
    assert "'two'" in problem.message


# -- nested config objects (--compilation-config and the like) ------------------------------

LAB_COMPILATION = {"mode": 1, "backend": "eager"}  # inventories/lab/group_vars/lab.yml, on vLLM 0.32.0


@pytest.mark.parametrize("version", SUPPORTED_VLLM_VERSIONS)
def test_config_classes_are_recorded(version: str) -> None:
    catalog = load_catalog(version)
    for flag, cls in [("--compilation-config", "CompilationConfig"),
                      ("--kv-transfer-config", "KVTransferConfig"),
                      ("--speculative-config", "SpeculativeConfig"),
                      ("--structured-outputs-config", "StructuredOutputsConfig")]:
        spec = catalog.spec(flag)
        assert spec is not None and spec.config_class == cls
        assert catalog.config_classes[cls]["extra"] == "forbid"
    pass_config = catalog.config_classes["CompilationConfig"]["fields"]["pass_config"]
    assert pass_config["type"] == "class" and pass_config["class"] == "PassConfig"
    # Free-form: not a config class, so not checked below the top level.
    assert catalog.spec("--additional-config").config_class is None  # type: ignore[union-attr]


@pytest.mark.parametrize("version", SUPPORTED_VLLM_VERSIONS)
@pytest.mark.parametrize("mapping", [
    {"compilation-config": LAB_COMPILATION},
    {"compilation-config": json.dumps(LAB_COMPILATION)},
    {"compilation-config": {"mode": "VLLM_COMPILE", "cudagraph_mode": "FULL_AND_PIECEWISE",
                            "cudagraph_capture_sizes": [1, 2, 4, "8"],
                            "pass_config": {"eliminate_noops": "true"}, "backend": "inductor",
                            "inductor_compile_config": {"anything": [1, {"x": None}]}}},
    {"compilation-config": {"max_cudagraph_capture_size": None, "debug_dump_path": None}},
    {"speculative-config": {"method": "ngram", "num-speculative-tokens": 3,
                            "prompt_lookup_max": 4}},
    {"kv-transfer-config": {"kv_connector": "NixlConnector", "kv_role": "kv_both"}},
    {"kv-events-config": {"enable_kv_cache_events": True, "publisher": "zmq"}},
    {"structured-outputs-config": {"backend": "xgrammar"}},
    {"additional-config": {"whatever": {"goes": 1}}},
    {"compilation-config.backendd": "eager"},  # dotted keys: only the flag is checked
    {"enable-prefix-caching": True, "max-num-seqs": 256},  # group_vars/llama_70b.yml
])
def test_good_nested_values(version: str, mapping: dict[str, object]) -> None:
    assert load_catalog(version).check_config(mapping) == []


@pytest.mark.parametrize("version", SUPPORTED_VLLM_VERSIONS)
@pytest.mark.parametrize(("mapping", "flag", "message"), [
    ({"compilation-config": {"backendd": "eager"}}, "--compilation-config.backendd",
     "expected a key of CompilationConfig, found 'backendd'; did you mean backend?"),
    ({"compilation-config": '{"mode": 1, "backendd": "eager"}'}, "--compilation-config.backendd",
     "expected a key of CompilationConfig, found 'backendd'; did you mean backend?"),
    ({"compilation-config": {"pass_config": {"eliminate_noop": True}}},
     "--compilation-config.pass_config.eliminate_noop",
     "expected a key of PassConfig, found 'eliminate_noop'; did you mean eliminate_noops?"),
    ({"compilation-config": {"pass_config": {"eliminate_noops": "maybe"}}},
     "--compilation-config.pass_config.eliminate_noops", "expected a boolean, found 'maybe'"),
    ({"compilation-config": {"cudagraph_capture_sizes": [1, "two"]}},
     "--compilation-config.cudagraph_capture_sizes[1]", "expected an integer, found 'two'"),
    ({"compilation-config": {"cudagraph_capture_sizes": 8}},
     "--compilation-config.cudagraph_capture_sizes", "expected a list, found 8"),
    ({"compilation-config": {"backend": 3}}, "--compilation-config.backend",
     "expected a string, found 3"),
    ({"compilation-config": {"backend": None}}, "--compilation-config.backend",
     "expected a string, found null"),
    ({"compilation-config": {"dynamic_shapes_config": [1]}},
     "--compilation-config.dynamic_shapes_config",
     "expected an object (DynamicShapesConfig), found a list"),
    ({"compilation-config": {"dynamic_shapes_config": {"typ": "backed"}}},
     "--compilation-config.dynamic_shapes_config.typ",
     "expected a key of DynamicShapesConfig, found 'typ'; did you mean type?"),
    ({"compilation-config": {"compile_cache_save_format": "zip"}},
     "--compilation-config.compile_cache_save_format",
     "expected one of binary, unpacked, found 'zip'"),
    ({"speculative-config": {"num-speculative-tokens": "three"}},
     "--speculative-config.num-speculative-tokens", "expected an integer, found 'three'"),
    ({"kv-transfer-config": {"kv_conector": "NixlConnector"}}, "--kv-transfer-config.kv_conector",
     "expected a key of KVTransferConfig, found 'kv_conector'; did you mean kv_connector?"),
])
def test_bad_nested_values(version: str, mapping: dict[str, object], flag: str, message: str) -> None:
    [problem] = load_catalog(version).check_config(mapping)
    assert (problem.flag, problem.message) == (flag, message)
    assert problem.subkey == flag.partition(".")[2]


def test_nested_values_in_argv(cat: FlagCatalog, cat32: FlagCatalog) -> None:
    assert messages(cat32, "--compilation-config", json.dumps(LAB_COMPILATION)) == []
    assert messages(cat, "--compilation-config", '{"backendd": "eager"}') == [
        "--compilation-config.backendd: expected a key of CompilationConfig, found 'backendd'; "
        "did you mean backend?"]
    # vLLM expands bare human-readable numbers in JSON arguments before validating.
    assert messages(cat, "--compilation-config", '{"decoder_replay_trim_threshold": 1k}') == []

