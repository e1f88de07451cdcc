"""Each secret is read once per run (gpufleet/config/secrets.py): every consumer of one process gets the value first
read, a key rotated during the run included, and the next run reads the new one."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpufleet.config import secrets
from gpufleet.values.types import SecretRef
from tests.unit.vllm_role_run import planned_shape, run_vllm_role


def test_a_secret_is_read_once_and_kept_for_the_run(tmp_path: Path) -> None:
    key = tmp_path / "api.key"
    key.write_text("first-key-0123456789abcdef\n")
    ref = SecretRef(file=str(key))
    assert secrets.read_secret(ref, "vllm_api_key") == "first-key-0123456789abcdef"
    key.write_text("rotated-key-0123456789abcdef\n")  # rotated while the run goes on
    assert {secrets.read_secret(ref, "vllm_api_key") for _ in range(5)} == {"first-key-0123456789abcdef"}
    assert secrets.unfit_secret(ref) is None
    assert {str(key): 1} == secrets.READS
    secrets.forget()  # the next run
    assert secrets.read_secret(ref, "vllm_api_key") == "rotated-key-0123456789abcdef"
    assert {str(key): 1} == secrets.READS


def test_a_source_that_cannot_be_read_is_tried_again(tmp_path: Path) -> None:
    key = tmp_path / "late.key"
    ref = SecretRef(file=str(key))
    with pytest.raises(secrets.ConfigError):
        secrets.read_secret(ref, "vllm_api_key")
    key.write_text("late-key-0123456789abcdef\n")
    assert secrets.read_secret(ref, "vllm_api_key") == "late-key-0123456789abcdef"


def test_every_node_of_every_replica_gets_the_key_of_one_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The vllm role on each node of a two-node shape, its API key, Hugging Face token and Ray token in files: each
    file read once however many nodes and replicas write it."""
    paths = {name: tmp_path / f"{name}.secret" for name in ("api", "hub", "ray")}
    for name, path in paths.items():
        path.write_text(f"{name}-secret-0123456789abcdef\n")
    values = {"vllm_api_key": SecretRef(file=str(paths["api"])), "vllm_hf_token": SecretRef(file=str(paths["hub"])),
              "ray_auth_token": SecretRef(file=str(paths["ray"]))}
    _, replicas = planned_shape("b_two_nodes_ray")
    nodes = sorted({host for replica in replicas for host in replica.nodes})
    assert len(nodes) >= 2
    for host in nodes:
        with monkeypatch.context() as patched:
            run_vllm_role(patched, "b_two_nodes_ray", host, read_secrets=True, **values)
    assert {str(paths["api"]): 1, str(paths["hub"]): 1, str(paths["ray"]): 1} == secrets.READS
