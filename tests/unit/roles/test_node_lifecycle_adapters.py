"""What the node_lifecycle role gives the node watch about LoRA adapters (roles/node_lifecycle.staged_adapters): each
of the pool's adapters for each replica on the node, by the weights file its resolver folder links to and the
declared digest; the watch's own check of its configuration takes it as written."""

from __future__ import annotations

import json
from pathlib import Path

from gpufleet_lab.tiny_adapters import TinyAdapter, make_tiny_adapter

from gpufleet.digest import file_sha256
from roles.node_lifecycle import config_values, staged_adapters
from tests.unit.configs import host_config
from tests.unit.lifecycle_configs import node_watch_config


def test_each_replica_on_the_node_checks_each_adapter_of_its_pool(tmp_path: Path) -> None:
    folders = {name: make_tiny_adapter(tmp_path / name, TinyAdapter(name, 4, seed), base="org/model")
               for seed, name in enumerate(("poet", "chef"))}
    digests = {name: file_sha256(folder / "adapter_model.safetensors") for name, folder in folders.items()}
    cfg = host_config(vllm_lora_adapters={name: {"source": str(folder), "sha256": digests[name]}
                                          for name, folder in folders.items()})
    found = staged_adapters(cfg, ["model-1", "model-0"])
    assert found == [{"replica": replica, "name": name, "sha256": digests[name],
                      "path": f"/etc/gpufleet/vllm/{replica}/adapters/{name}/adapter_model.safetensors"}
                     for replica in ("model-0", "model-1") for name in ("chef", "poet")]
    doc = config_values(cfg, "gpu-a01", "10.0.0.5", [], found)
    assert doc["adapters"] == found
    watched = node_watch_config(tmp_path, adapters=json.loads(json.dumps(doc["adapters"])))
    assert [(a.replica, a.name, a.path, a.sha256) for a in watched.adapters] == [
        (a["replica"], a["name"], a["path"], a["sha256"]) for a in found]
    assert staged_adapters(host_config(), ["model-0"]) == []
