"""What the tools a deploy hands values to can hold: systemd's time spans and unit names, HAProxy's names,
PromQL's numbers. ``gpufleet check`` refuses a value beyond them, so that nothing passes the check and fails at
deploy time; each check returns ``expected …, found …`` or None.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from gpufleet import node_paths

SYSTEMD_MAX_SECONDS = (2**64 - 1) // 10**6 - 1
"""The longest time span in seconds systemd parses: it keeps microseconds in a 64-bit unsigned integer, all ones
meaning infinity, and refuses a number of seconds from ``(2**64 - 1) // 10**6`` up (``TimeoutStartSec=`` then does not
parse; ``systemd-analyze timespan`` says so)."""

SYSTEMD_DEFAULT_START_S = 90
"""systemd's default start timeout (``DefaultTimeoutStartSec=``)."""

PROMQL_MAX_INT = 2**53
"""The largest integer a PromQL number holds exactly: promtool reads numbers as 64-bit floats (a number beyond
about 1.8e308 does not parse at all; one beyond 2**53 compares as another)."""

DURATION_MAX_SECONDS = (2**63 - 1) // 10**9
"""The longest duration in seconds Prometheus's duration type holds (Alertmanager's ``group_wait``,
``group_interval``, ``repeat_interval``): nanoseconds in a signed 64-bit integer; ``amtool check-config`` refuses a
second more."""

NODE_MAX_GPUS = 16
"""The most GPUs a node has (a hardware profile holds 1 to 16): the most replicas a node can serve."""

REPLICA_MAX_RANKS = 1024
"""The largest parallel size gpufleet plans (tensor, pipeline, data parallel, nodes per replica): beyond any
replica's GPUs, and a bound that keeps the planner's figures and messages short."""

MAX_TOKENS = 2**31 - 1
"""The longest context gpufleet plans: a signed 32-bit token count (what GPU kernels index tokens with)."""

MAX_COUNT = 100_000
"""The largest sequence count gpufleet plans for (``vllm_min_concurrency``), as ``vllm_max_num_queued_reqs``."""

UNIT_NAME_MAX = 255
"""The longest unit name systemd takes (``UNIT_NAME_MAX``, 256 with its final NUL)."""

HAPROXY_NAME = re.compile(r"^[A-Za-z0-9_.:-]+$")
"""The characters HAProxy takes in a backend's or a server's name (its ``invalid_char``)."""



def _vllm_unit(replica: str) -> str:
    return node_paths.VLLM_UNIT_TEMPLATE.replace("@", f"@{replica}")


_REPLICA_UNITS: tuple[Callable[[str], str], ...] = (node_paths.watchdog_unit, node_paths.ray_unit, _vllm_unit)
LONGEST_REPLICA_UNIT: Callable[[str], str] = max(_REPLICA_UNITS, key=lambda unit: len(unit("")))
"""The replica unit with the longest name around the replica's: ``vllm-watchdog@<replica>.service``."""


def systemd_seconds(seconds: int, added: int = 0) -> str | None:
    """Seconds that fit a systemd time span (gpufleet writes them into a unit ``added`` seconds longer); a
    problem when they do not."""
    if seconds + added > SYSTEMD_MAX_SECONDS:
        return (f"expected at most {SYSTEMD_MAX_SECONDS - added} seconds (systemd's longest time span),"
                f" found {_digits(seconds)}")
    return None


def promql_int(value: int) -> str | None:
    """An alert threshold PromQL reads as itself (at most 2^53); a problem when it is not."""
    if abs(value) > PROMQL_MAX_INT:
        return f"expected at most {PROMQL_MAX_INT} (the largest integer a PromQL number holds), found {_digits(value)}"
    return None


def alertmanager_wait(seconds: int) -> str | None:
    """Seconds amtool takes as a route's wait (``group_wait``): from 0 to Prometheus's longest duration."""
    if not 0 <= seconds <= DURATION_MAX_SECONDS:
        return (f"expected 0 to {DURATION_MAX_SECONDS} seconds (Alertmanager's longest duration),"
                f" found {_digits(seconds)}")
    return None


def alertmanager_interval(seconds: int) -> str | None:
    """Seconds amtool takes as a route's interval (``group_interval``, ``repeat_interval``): not zero, at most
    Prometheus's longest duration."""
    if seconds == 0:
        return "expected at least 1 second (amtool refuses a zero interval), found 0"
    return alertmanager_wait(seconds)


def replica_name(pool: str, longest: str) -> str | None:
    """Whether a pool's name fits a HAProxy server name and a systemd unit name, and ``longest``, the longest name
    of its replicas, fits the longest of their units."""
    if not HAPROXY_NAME.match(pool):
        return (f"expected letters, digits, '_', '.', ':' or '-' only (its replicas' names are HAProxy server"
                f" names and systemd unit names), found {pool!r}")
    unit = LONGEST_REPLICA_UNIT(longest)
    if len(unit) > UNIT_NAME_MAX:
        return (f"expected names of at most {UNIT_NAME_MAX} characters for its replicas' units, found"
                f" {len(unit)} in {unit[:40]}...")
    return None


def _digits(value: int) -> str:
    """An integer as a message shows it: whole, or its first digits and how many there are."""
    text = str(value)
    return text if len(text) <= 24 else f"{text[:12]}... ({len(text.lstrip('-'))} digits)"
