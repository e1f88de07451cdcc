"""How pyinfra's CLI orders operations, read from the frames instead of through ``inspect.stack()``.

pyinfra's CLI identifies and orders each operation by the line numbers of its call stack from the deploy file
down (``pyinfra.api.util.get_operation_order_from_stack``). It reads them with ``inspect.stack()`` and
``inspect.getframeinfo()``, which look up each frame's source file; the deploy file is compiled under a relative
name no module has, so each lookup of its frame scans every loaded module. That is three scans per operation and
host: three quarters of the time the full deploy spends adding operations, and what made a no-change rerun on
eight nodes take twice as long as on one.

:func:`operation_order` computes the same list from the frames' code objects and line numbers; :func:`install`
gives it to pyinfra (through :mod:`gpufleet.pyinfra_seam`) when pyinfra's own reader is the one it replaces
(tests prove the two agree).
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

import pyinfra

from gpufleet.pyinfra_seam import install_operation_order, pyinfra_install_dir


def _frames_outermost_first(start: FrameType | None) -> list[FrameType]:
    frames: list[FrameType] = []
    while start is not None:
        frames.append(start)
        start = start.f_back
    frames.reverse()
    return frames


def operation_order(state: Any) -> list[int]:
    """pyinfra's operation order for the operation being added: the deploy file's number (CLI), then the line of
    every frame from the outermost frame of the deploy file inwards, pyinfra's own frames left out."""
    frames = _frames_outermost_first(sys._getframe(1))  # from the caller in, as pyinfra's reader sees them
    start = 0
    if state.current_deploy_filename:
        # like pyinfra: from the first frame of the deploy file; without one, no frame (pyinfra starts at its own)
        start = next((i for i, f in enumerate(frames) if f.f_code.co_filename == state.current_deploy_filename),
                     len(frames))
    order = [state.current_op_file_number] if pyinfra.is_cli else []
    pyinfra_dir = pyinfra_install_dir()
    order += [f.f_lineno for f in frames[start:] if not f.f_code.co_filename.startswith(pyinfra_dir)]
    return order


def install() -> bool:
    """Make pyinfra use :func:`operation_order`; False (pyinfra left as it is) when pyinfra does not call the
    reader this module was checked against."""
    return install_operation_order(operation_order)
