"""How exposed a node's systemd services are, by ``systemd-analyze security``'s overall exposure score.

systemd scores a service's sandbox from 0.0 (fully confined) to 10.0 (no confinement at all) and names a level:
PERFECT, SAFE, OK (below 5.0), MEDIUM, EXPOSED, UNSAFE, DANGEROUS. :func:`exposure` reads the score from the
command's last line, ``→ Overall exposure level for node_exporter.service: 1.7 OK 🙂``; :func:`node_report`
asks one node about gpufleet's units through any command runner (SSH in ``bench/unit_security.py``), so that
tests and the benchmark read the numbers the same way.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass

# Every service gpufleet writes a unit (or drop-in) for: vLLM's instances, their watchdogs and the Ray head/worker
# units of Ray replicas (patterns), node_exporter (tarball: our unit; package: Debian's unit with our drop-in), NVIDIA's
# DCGM exporter, the GPU health watch, the node lifecycle's watch and its burn-in units, the routers' HAProxy,
# keepalived and its HAProxy check, and the monitoring hosts' Prometheus and Alertmanager (Debian's units with our
# drop-ins). Each must rate at most EXPOSURE_BOUND.
UNITS: tuple[str, ...] = (
    "vllm@*.service",
    "vllm-watchdog@*.service",
    "gpufleet-ray-*.service",
    "node_exporter.service",
    "prometheus-node-exporter.service",
    "dcgm-exporter.service",
    "gpufleet-gpu-watch.service",
    "gpufleet-node-watch.service",
    "gpufleet-burn-in-quick.service",
    "gpufleet-burn-in-full.service",
    "gpufleet-capture@*.service",
    "haproxy.service",
    "keepalived.service",
    "gpufleet-router-health.service",
    "gpufleet-router-clients.service",
    "prometheus.service",
    "prometheus-alertmanager.service",
)

# The most exposure a gpufleet unit may have on Debian 12's systemd 252: what is left is what the service
# needs (the network, D-Bus, /proc, GPU devices, W+X memory for PyTorch's kernels).
EXPOSURE_BOUND = 2.0

_OVERALL = re.compile(r"Overall exposure level for (?P<unit>\S+?):\s*(?P<score>\d+(?:\.\d+)?)\s+(?P<level>[A-Z]+)")

Runner = Callable[[str], tuple[int, str]]  # a shell command on the node -> (exit status, stdout)


class ExposureParseError(ValueError):
    """systemd-analyze's output has no overall exposure line."""


@dataclass(frozen=True)
class Exposure:
    """One unit's overall exposure, as systemd-analyze security rates it."""

    unit: str
    score: float  # 0.0 (confined) .. 10.0 (exposed)
    level: str  # PERFECT, SAFE, OK, MEDIUM, EXPOSED, UNSAFE, DANGEROUS


def exposure(output: str) -> Exposure:
    """The overall exposure line of ``systemd-analyze security UNIT``'s output (the last one, if several)."""
    found = list(_OVERALL.finditer(output))
    if not found:
        tail = output.strip().splitlines()[-1:] or ["no output"]
        raise ExposureParseError(f"expected 'Overall exposure level for UNIT: SCORE LEVEL', found {tail[0]!r}")
    last = found[-1]
    return Exposure(last["unit"], float(last["score"]), last["level"])


def exposure_score(output: str) -> float:
    """The overall exposure score (0.0 .. 10.0) in ``systemd-analyze security UNIT``'s output."""
    return exposure(output).score


def loaded_units(run: Runner, pattern: str) -> list[str]:
    """The units matching ``pattern`` that systemd has loaded on the node (a unit with no file is not)."""
    status, out = run(f"systemctl list-units --all --plain --no-legend --no-pager {shlex.quote(pattern)}")
    if status != 0:
        return []
    names = []
    for line in out.splitlines():
        fields = line.split()
        if fields and fields[0].lstrip("●").strip() and fields[1:2] == ["loaded"]:
            names.append(fields[0].lstrip("●").strip())
    if "*" not in pattern and pattern not in names:
        # A unit that is installed but inactive and not wanted by anything is not listed: ask for it by name.
        status, state = run(f"systemctl show --property=LoadState --value {shlex.quote(pattern)}")
        if status == 0 and state.strip() == "loaded":
            names.append(pattern)
    return names


def node_report(run: Runner, units: tuple[str, ...] = UNITS) -> dict[str, dict[str, object]]:
    """Each of ``units`` (patterns expanded to the loaded instances): its exposure, or that it is absent."""
    report: dict[str, dict[str, object]] = {}
    for pattern in units:
        names = loaded_units(run, pattern)
        if not names:
            report[pattern] = {"present": False}
        for name in names:
            status, out = run(f"systemd-analyze security --no-pager {shlex.quote(name)}")
            try:
                rated = exposure(out)
            except ExposureParseError as exc:
                report[name] = {"present": True, "error": f"systemd-analyze exited {status}: {exc}"}
                continue
            report[name] = {"present": True, "exposure": rated.score, "level": rated.level}
    return report
