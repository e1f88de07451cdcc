"""bench/unit_security.py (every unit gpufleet writes, rendered as the roles render it, and rated by
``systemd-analyze security``), loaded as a module."""

from __future__ import annotations

import importlib.util

from tests.conftest import ROOT

_SPEC = importlib.util.spec_from_file_location("bench_unit_security", ROOT / "bench" / "unit_security.py")
assert _SPEC is not None and _SPEC.loader is not None
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)
