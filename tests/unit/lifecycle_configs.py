"""A node watch's configuration (``/etc/gpufleet/lifecycle.json``) as the node_lifecycle role writes it, every path
under a test's own folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpufleet.config.settings.node_lifecycle import repository_catalog
from gpufleet.node import node_watch


def node_watch_config(tmp_path: Path, **extra: Any) -> node_watch.Config:
    """The configuration of node ``gpu-a01`` with the repository's findings catalog, and ``extra`` keys."""
    doc = {"node": "gpu-a01", "policy": {"readmit_passes": 2, "cool_off_s": 20, "retire_after": 3,
                                         "retire_window_s": 604800},
           "catalog": json.loads(json.dumps(repository_catalog())), "kernel_log": str(tmp_path / "kmsg"),
           "gate_marker": str(tmp_path / "gate-failed"),
           "burn_in": {"units": {"quick": "gpufleet-burn-in-quick.service", "full": "gpufleet-burn-in-full.service"},
                       "verdicts": str(tmp_path / "burn-in")},
           "state_file": str(tmp_path / "state" / "state.json"), "evidence_dir": str(tmp_path / "evidence"),
           "textfile": str(tmp_path / "textfile" / "gpufleet-node.prom"), **extra}
    path = tmp_path / "lifecycle.json"
    path.write_text(json.dumps(doc))
    return node_watch.Config.load(path)
