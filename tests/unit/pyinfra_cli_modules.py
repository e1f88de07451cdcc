"""pyinfra's CLI modules, imported in this process once, for tests that run its entry points without a subprocess."""

from __future__ import annotations

import functools
import importlib
import sys
from types import ModuleType

import pytest


@functools.cache
def pyinfra_cli_modules() -> dict[str, ModuleType]:
    """pyinfra's CLI modules, imported once without gevent's monkey-patching, then taken out of ``sys.modules``
    (where gpufleet looks to know it runs under pyinfra's CLI): a test puts them back for its run."""
    from gevent import monkey

    if "pyinfra_cli" in sys.modules:  # imported by someone else in this process: theirs stays
        return {name: module for name, module in sys.modules.items() if name.split(".")[0] == "pyinfra_cli"}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(monkey, "patch_all", lambda *args, **kwargs: None)
        importlib.import_module("pyinfra_cli.cli")  # and with it .inventory and .util
    return {name: sys.modules.pop(name) for name in list(sys.modules) if name.split(".")[0] == "pyinfra_cli"}
