"""The node watch's look at LoRA adapters (``gpufleet/node/staged_adapters.py``): each adapter's weights, through its
replica's resolver link, against the declared digest, hashed again only when the file changed; a FIFO is never
opened; the verdicts reach the node's textfile; a configuration that is not what the role writes is refused. On a
node: tests/lab/test_adapters.py (a corrupted copy)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pytest

from gpufleet.node import node_watch, staged_adapters
from tests.unit.lifecycle_configs import node_watch_config as _config

WEIGHTS = b"tiny adapter weights"
DIGEST = hashlib.sha256(WEIGHTS).hexdigest()


def _declared(tmp_path: Path, name: str = "poet", sha256: str = DIGEST) -> staged_adapters.Declared:
    """``name``'s weights staged in a store and linked from a resolver folder, as the vllm role lays them out."""
    store = tmp_path / "store" / sha256[:16]
    store.mkdir(parents=True, exist_ok=True)
    (store / "adapter_model.safetensors").write_bytes(WEIGHTS)
    folder = tmp_path / "resolver" / name
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / "adapter_model.safetensors"
    link.symlink_to(store / "adapter_model.safetensors")
    return staged_adapters.Declared("llama_70b-0", name, str(link), sha256)


def test_an_adapter_as_declared_then_changed_then_restaged(tmp_path: Path) -> None:
    adapter, digests = _declared(tmp_path), staged_adapters.Digests()
    assert staged_adapters.verdicts([adapter], digests) == [(adapter, True)]
    target = Path(os.path.realpath(adapter.path))
    target.write_bytes(WEIGHTS[::-1])  # the same size: found by its modification time
    os.utime(target, ns=(1, 1))
    assert staged_adapters.verdicts([adapter], digests) == [(adapter, False)]
    target.write_bytes(WEIGHTS)
    assert staged_adapters.verdicts([adapter], digests) == [(adapter, True)]


def test_a_file_unchanged_is_not_read_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    adapter, digests = _declared(tmp_path), staged_adapters.Digests()
    assert digests.of(adapter.path) == DIGEST
    opened: list[str] = []
    real_open = os.open
    monkeypatch.setattr(staged_adapters.os, "open", lambda path, *a: opened.append(path) or real_open(path, *a))
    assert digests.of(adapter.path) == DIGEST
    assert opened == []


@pytest.mark.parametrize("damage", ["missing", "dangling", "fifo", "directory", "another adapter's weights"])
def test_weights_that_are_not_the_declared_file_are_not_as_declared(tmp_path: Path, damage: str) -> None:
    adapter = _declared(tmp_path)
    link, target = Path(adapter.path), Path(os.path.realpath(adapter.path))
    if damage == "missing":
        link.unlink()
    elif damage == "dangling":
        target.unlink()
    elif damage == "fifo":
        target.unlink()
        os.mkfifo(target)  # a FIFO with no writer: opening it for reading would wait forever
    elif damage == "directory":
        link.unlink()
        link.mkdir()
    else:
        target.write_bytes(b"another adapter")
    assert staged_adapters.verdicts([adapter], staged_adapters.Digests()) == [(adapter, False)]


def test_the_verdicts_reach_the_nodes_textfile(tmp_path: Path) -> None:
    poet, chef = _declared(tmp_path), _declared(tmp_path, "chef", hashlib.sha256(b"other").hexdigest())
    config = _config(tmp_path, adapters=[
        {"replica": a.replica, "name": a.name, "path": a.path, "sha256": a.sha256} for a in (poet, chef)])
    # as the watch loads it: node tools import their siblings by file, not through the package
    assert [(a.replica, a.name, a.path, a.sha256) for a in config.adapters] == [
        (a.replica, a.name, a.path, a.sha256) for a in (poet, chef)]
    looked = node_watch.staged_adapters
    node_watch.export(config, node_watch.read_record(config), looked.verdicts(config.adapters, looked.Digests()))
    text = Path(config.doc["textfile"]).read_text()
    assert 'gpufleet_replica_adapter_staged{replica="llama_70b-0",adapter="poet"} 1\n' in text
    assert 'gpufleet_replica_adapter_staged{replica="llama_70b-0",adapter="chef"} 0\n' in text
    node_watch.export(config, node_watch.read_record(config))  # before the first look: no verdict, no series
    assert "gpufleet_replica_adapter_staged" not in Path(config.doc["textfile"]).read_text()


@pytest.mark.parametrize("adapters", [
    {"poet": "x"},
    [{"replica": "llama_70b-0", "name": "poet", "path": "relative/weights", "sha256": DIGEST}],
    [{"replica": "llama_70b-0", "name": "po\"et", "path": "/w", "sha256": DIGEST}],
    [{"replica": "llama_70b-0", "name": "poet", "path": "/w", "sha256": DIGEST.upper()}],
    [{"replica": "llama_70b-0", "name": "poet", "path": "/w", "sha256": DIGEST, "revision": "v2"}],
    [{"replica": "llama_70b-0", "name": "poet", "path": "/w"}],
])
def test_a_configuration_the_role_does_not_write_is_refused(tmp_path: Path, adapters: Any) -> None:
    with pytest.raises(ValueError, match="adapters"):
        _config(tmp_path, adapters=adapters)

