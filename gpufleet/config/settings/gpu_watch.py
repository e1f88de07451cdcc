"""The GPU health watch's settings.

Each field is one variable's record (:mod:`gpufleet.config.settings`); ``roles/gpu_watch/defaults.yml`` is written
from them.
"""

from __future__ import annotations

from pydantic import field_validator

from gpufleet.config.settings import RoleSettings, setting
from gpufleet.values import grammar


class GpuWatchSettings(RoleSettings):
    """The GPU health watch: a timer that judges the node's GPUs with its gpu_health gate while it serves, stops every
    vLLM replica on the node while they fail it and starts them again once they pass.
    """

    gpu_watch_interval_s: int = setting(
        30,
        "Seconds between two judgements (5 to 86400); 0 turns the watch off.",
    )

    @field_validator("gpu_watch_interval_s")
    @classmethod
    def _watch_interval(cls, value: int) -> int:
        """0 (off), or seconds from 5 to 86400."""
        if value != 0 and not 5 <= value <= 86400:
            raise ValueError(f"expected 0 (off) or seconds from 5 to 86400, found {grammar.show(value)}")
        return value
