"""Secrets that could leak through other doors: a URL's query, a JSON option, a variable that loads code, a secret
file that would break its environment file."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpufleet.config import env_names
from gpufleet.config.secrets import read_secret, unfit_secret
from gpufleet.values import grammar
from gpufleet.values.problems import ConfigError
from gpufleet.values.types import SecretRef

SECRET = "s3cr3t-VALUE"

REFUSED_ENV = ["CUDA_INJECTION64_PATH", "NCCL_NET_PLUGIN", "NCCL_TUNER_PLUGIN", "NCCL_PROFILER_PLUGIN",
               "NCCL_ENV_PLUGIN", "PYTHONWARNINGS", "PYTHONSTARTUP", "PYTHONPATH", "LD_PRELOAD", "LD_LIBRARY_PATH",
               "LD_AUDIT", "VLLM_SERVER_DEV_MODE", "VLLM_PLUGINS", "NCCL_NET", "HTTPS_PROXY", "no_proxy",
               "SSL_CERT_FILE", "RAY_AUTH_MODE", "MASTER_ADDR", "VLLM_ALLOW_RUNTIME_LORA_UPDATING"]
ALLOWED_ENV = ["VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "NCCL_DEBUG", "NCCL_IB_HCA",
               "VLLM_ATTENTION_BACKEND", "PYTHONUNBUFFERED", "VLLM_LOGGING_LEVEL", "NCCL_PLUGIN_X"]


@pytest.mark.parametrize("name", REFUSED_ENV)
def test_env_names_that_load_code_or_change_transport_are_refused(name: str) -> None:
    message = env_names.refusal(name)
    assert message is not None and message.startswith("expected ") and f"found {name}" in message


@pytest.mark.parametrize("name", ALLOWED_ENV)
def test_tuning_env_names_pass(name: str) -> None:
    assert env_names.refusal(name) is None


@pytest.mark.parametrize(("name", "secret"), [
    ("token", True), ("Access-Token", True), ("X-Amz-Signature", True), ("sig", True), ("api_key", True),
    ("hf_token", True), ("client_secret", True), ("eos_token", False), ("page", False), ("model", False),
    ("num_speculative_tokens", False), ("key_prefix", False),
])
def test_secret_named_keys(name: str, secret: bool) -> None:
    assert grammar.names_secret(name) is secret


@pytest.mark.parametrize("url", [
    f"https://pypi.example/simple?token={SECRET}",
    f"http://pypi.example/simple?a=1&password={SECRET}",
    f"https://pypi.example:99999/simple?token={SECRET}",
    f"https://pypi.éxample/simple?token={SECRET}",
    f"https://u:{SECRET}@pypi.example/simple?key={SECRET}",
    f"https://pypi.example/simple#access_token={SECRET}",
])
def test_a_url_with_a_secret_in_its_query_is_refused_without_showing_it(url: str) -> None:
    problem = grammar.url(url, plain_http=False)
    assert problem is not None and SECRET not in problem and "not shown" in problem


def test_a_url_with_an_ordinary_query_passes() -> None:
    assert grammar.url("https://mirror.example/lock.txt?ref=main&page=2", plain_http=False) is None


@pytest.mark.parametrize(("content", "kind"), [
    (f"{SECRET}\nExecStartPre=/bin/sh\n", "a line break"), (f"{SECRET}\0x", "a NUL byte"),
    (f"{SECRET}\x1b[2J", "a control character (U+001B)"), (f"{SECRET}\u202e", "a format character (U+202E)"),
])
def test_a_secret_file_that_cannot_be_one_environment_line_is_refused_unshown(
        tmp_path: Path, content: str, kind: str) -> None:
    path = tmp_path / "secret"
    path.write_bytes(content.encode())
    ref = SecretRef(file=str(path))
    with pytest.raises(ConfigError) as error:
        read_secret(ref, "vllm_api_key")
    line = error.value.problems[0].line()
    assert kind in line and SECRET not in line and line.startswith("controller: vllm_api_key: ")
    assert unfit_secret(ref) == error.value.problems[0].message


def test_a_pem_reads_whole_and_a_one_line_secret_with_its_final_newline_passes(tmp_path: Path) -> None:
    pem, key = tmp_path / "pem", tmp_path / "key"
    pem.write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    key.write_text(f"{SECRET}\n")
    assert read_secret(SecretRef(file=str(pem)), "router_tls_certificate", one_line=False).count("\n") == 2
    assert read_secret(SecretRef(file=str(key)), "vllm_api_key") == SECRET
    assert unfit_secret(SecretRef(file=str(key))) is None
    assert unfit_secret(SecretRef(file=str(tmp_path / "missing"))) is None  # the deploy reads it and says why
