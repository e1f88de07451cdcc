"""GPU health rules: go / no-go for a node from its GPU facts, each failure with its evidence.

Standard library only: this file runs on GPU nodes (``nvml_probe.py --gate``) as well as on the
controller (``gpufleet gate``). Facts come in as the plain JSON dict of ``gpufleet.gpu-facts/1``.

Rules (``Failure.rule``) and the policy fields that shape them:

- ``nvml``: the node has a working NVML (always checked);
- ``nvml_errors``: no NVML query failed other than with NOT_SUPPORTED (always checked);
- ``gpu_count``: ``expected_gpu_count`` GPUs enumerated;
- ``gpu_model``: every GPU's NVML name contains ``expected_gpu_model``;
- ``driver_branch``: driver branch >= ``min_driver_branch`` (580: CUDA 13, which vLLM 0.33 is built for);
- ``persistence_mode``: on (``require_persistence_mode``); an unreported mode fails too;
- ``nvlinks_active``: every NVLink the GPU has is active (``require_all_nvlinks_active``);
- ``fabric_completed``: NVSwitch fabric registration completed with success where the GPU reports
  fabric state (``require_fabric_completed``; ``not_supported`` passes);
- ``uncorrected_ecc``: volatile (since driver load) uncorrected ECC errors <= ``max_uncorrected_ecc``.
  The aggregate (lifetime) count is shown as evidence but not judged: once rows are remapped an old
  error no longer makes the GPU unsafe, and a pending remap is judged by ``row_remap``;
- ``row_remap``: no row remap pending (unless ``allow_pending_row_remap``): the GPU needs a reset first;
- ``row_remap_failure``: no failed row remap (always checked: the GPU needs service);
- ``pcie_width``: the link runs at its maximum width (``require_pcie_max_width``);
- ``pcie_gen``: the link runs at its maximum generation (``require_pcie_max_gen``). GPUs drop the
  PCIe generation to save power when idle, so the check applies only when the clock event reasons
  say the GPU is not idle (no ``gpu_idle`` bit); an idle GPU, or one that does not report its clock
  event reasons, passes. A gate that runs before vLLM starts (``ExecStartPre``) normally sees idle
  GPUs: a link that trains below its maximum under load is caught by a probe taken while serving.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

Facts = dict[str, Any]


@dataclass
class HealthPolicy:
    """Thresholds for the GPU health gate (fleet config key ``gpu_health``).

    A plain dataclass so nodes can use it without pydantic; pydantic validates it as a config field
    and, through ``__pydantic_config__``, rejects unknown keys there too.
    """

    __pydantic_config__: ClassVar[dict[str, str]] = {"extra": "forbid"}

    expected_gpu_count: int | None = None
    expected_gpu_model: str | None = None  # a substring of the NVML name, e.g. "H100"
    require_all_nvlinks_active: bool = True
    require_fabric_completed: bool = True
    max_uncorrected_ecc: int = 0
    allow_pending_row_remap: bool = False
    require_pcie_max_width: bool = True
    require_pcie_max_gen: bool = True  # judged only while the GPU is not idle: see the module docstring
    require_persistence_mode: bool = True
    min_driver_branch: int = 580


@dataclass(frozen=True)
class Failure:
    """One failed rule: which, on which GPU (``None``: the node), and the evidence in one line."""

    rule: str
    gpu: int | None
    evidence: str

    def line(self) -> str:
        where = f"gpu {self.gpu}" if self.gpu is not None else "node"
        return f"{self.rule} ({where}): {self.evidence}"


class PolicyError(ValueError):
    """A health policy file or mapping that cannot be used; the message names the field."""


_POLICY_EXPECTED = {
    "expected_gpu_count": "an integer >= 1 or null",
    "expected_gpu_model": "non-empty text (a part of the NVML name) or null",
    "max_uncorrected_ecc": "an integer >= 0",
    "min_driver_branch": "an integer >= 0",
}


def _policy_value_ok(key: str, value: Any) -> bool:
    if key == "expected_gpu_count":
        return value is None or (type(value) is int and value >= 1)
    if key == "expected_gpu_model":
        return value is None or (isinstance(value, str) and value.strip() != "" and value.isprintable())
    if key in ("max_uncorrected_ecc", "min_driver_branch"):
        return type(value) is int and value >= 0
    return isinstance(value, bool)


def policy_problems(data: Any) -> list[tuple[str, str]]:
    """Every bad key of a policy mapping as (key, "expected …, found …"); the one schema of ``gpu_health``,
    used alike by config validation on the controller and by ``nvml_probe.py --gate`` on the node."""
    if not isinstance(data, dict):
        found = "null" if data is None else {"list": "a list", "str": "text"}.get(type(data).__name__, repr(data))
        return [("", f"expected a mapping, found {found}")]
    known = [f.name for f in fields(HealthPolicy)]
    problems = []
    for key, value in data.items():
        if key not in known:
            problems.append((str(key), f"expected one of {', '.join(known)}, found an unknown key"))
        elif not _policy_value_ok(key, value):
            shown = "null" if value is None else repr(value)
            problems.append((key, f"expected {_POLICY_EXPECTED.get(key, 'true or false')}, found {shown[:60]}"))
    return problems


def policy_from_dict(data: dict[str, Any], source: str = "<policy>") -> HealthPolicy:
    """Build a :class:`HealthPolicy`, rejecting unknown keys and values of the wrong type."""
    problems = policy_problems(data)
    if problems:
        key, message = problems[0]
        raise PolicyError(f"{source}: {key}: {message}" if key else f"{source}: {message}")
    return HealthPolicy(**data)


def load_policy(path: Path) -> HealthPolicy:
    """Read a policy JSON file (the ``gpu_health`` mapping as written by the deploy)."""
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise PolicyError(f"{path}: cannot read: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise PolicyError(f"{path}:{exc.lineno}:{exc.colno}: invalid JSON: {exc.msg}") from None
    return policy_from_dict(data, str(path))


def policy_json(policy: HealthPolicy) -> str:
    """The policy as the JSON file ``load_policy`` reads."""
    return json.dumps(asdict(policy), indent=2) + "\n"


def _node_rules(facts: Facts, policy: HealthPolicy) -> list[Failure]:
    failures = []
    for err in facts.get("errors") or []:
        failures.append(Failure("nvml_errors", err.get("gpu"), f"{err['query']} failed: {err['error']}"))
    gpus = facts.get("gpus") or []
    if policy.expected_gpu_count is not None and len(gpus) != policy.expected_gpu_count:
        indices = ", ".join(str(g["index"]) for g in gpus) or "none"
        failures.append(Failure("gpu_count", None,
                                f"found {len(gpus)} GPUs (indices {indices}), expected {policy.expected_gpu_count}"))
    driver = facts.get("driver_version")
    try:
        branch: int | None = int(str(driver).split(".")[0])
    except ValueError:
        branch = None
    if branch is None:
        failures.append(Failure("driver_branch", None, f"cannot read driver version {driver!r}"))
    elif branch < policy.min_driver_branch:
        failures.append(Failure("driver_branch", None, f"driver {driver} is branch {branch}, "
                                                       f"need >= {policy.min_driver_branch}"))
    return failures


def _gpu_rules(gpu: Facts, policy: HealthPolicy) -> list[Failure]:
    i, failures = gpu["index"], []

    def fail(rule: str, evidence: str) -> None:
        failures.append(Failure(rule, i, evidence))

    if policy.expected_gpu_model and policy.expected_gpu_model.lower() not in gpu["name"].lower():
        fail("gpu_model", f"{gpu['name']!r} does not contain {policy.expected_gpu_model!r}")
    if policy.require_persistence_mode and gpu.get("persistence_mode") is not True:
        fail("persistence_mode", "persistence mode is off" if gpu.get("persistence_mode") is False
             else "persistence mode not reported")
    links = gpu.get("nvlinks") or []
    down = [link["link"] for link in links if not link["active"]]
    if policy.require_all_nvlinks_active and down:
        fail("nvlinks_active", f"{len(down)} of {len(links)} NVLinks inactive (links {', '.join(map(str, down))}); "
                               f"{len(links) - len(down)} active")
    fabric = gpu.get("fabric")
    if policy.require_fabric_completed and fabric and fabric["state"] != "not_supported" and (
            fabric["state"] != "completed" or fabric.get("status") != "success"):
        fail("fabric_completed", f"fabric state {fabric['state']}, status {fabric.get('status')}; "
                                 "expected completed with success")
    ecc = gpu.get("ecc") or {}
    volatile = ecc.get("uncorrected_volatile")
    if volatile is not None and volatile > policy.max_uncorrected_ecc:
        fail("uncorrected_ecc", f"{volatile} uncorrected ECC errors since driver load, max "
                                f"{policy.max_uncorrected_ecc} ({ecc.get('uncorrected_aggregate')} lifetime)")
    rows = gpu.get("remapped_rows")
    if rows and rows["pending"] and not policy.allow_pending_row_remap:
        fail("row_remap", f"row remap pending ({rows['correctable']} correctable, {rows['uncorrectable']} "
                          "uncorrectable rows remapped): reset the GPU")
    if rows and rows["failure"]:
        fail("row_remap_failure", f"row remapping failed ({rows['uncorrectable']} uncorrectable rows): "
                                  "the GPU needs service")
    pcie = gpu.get("pcie")
    if pcie and policy.require_pcie_max_width and pcie["width_current"] < pcie["width_max"]:
        fail("pcie_width", f"PCIe link x{pcie['width_current']}, max x{pcie['width_max']}")
    active_events: list[str] | None = (gpu.get("clock_event_reasons") or {}).get("active")
    busy = active_events is not None and "gpu_idle" not in active_events
    if pcie and policy.require_pcie_max_gen and busy and pcie["gen_current"] < pcie["gen_max"]:
        fail("pcie_gen", f"PCIe gen {pcie['gen_current']} while busy (clock events: "
                         f"{', '.join(active_events or []) or 'none'}), max gen {pcie['gen_max']}")
    return failures


def evaluate(facts: Facts, policy: HealthPolicy) -> list[Failure]:
    """Every rule the node fails; empty when it may serve."""
    nvml = facts.get("nvml") or {}
    if not nvml.get("available"):
        return [Failure("nvml", None, nvml.get("error") or "NVML not available")]
    failures = _node_rules(facts, policy)
    for gpu in facts.get("gpus") or []:
        failures += _gpu_rules(gpu, policy)
    return failures


def link_sample(facts: Facts) -> list[dict[str, Any]]:
    """What the node watch follows over time whatever the policy (its throttle and link trends): per GPU, its PCI
    address, the clock event reasons, the PCIe link, and how many NVLinks it has and how many are inactive."""
    out = []
    for gpu in facts.get("gpus") or []:
        links = gpu.get("nvlinks") or []
        out.append({"gpu": gpu.get("index"), "pci": gpu.get("pci_bus_id"),
                    "events": (gpu.get("clock_event_reasons") or {}).get("active"), "pcie": gpu.get("pcie"),
                    "nvlinks": len(links), "nvlinks_down": sum(1 for link in links if not link.get("active"))})
    return out


def verdict(facts: Facts, failures: list[Failure], host: str | None = None) -> dict[str, Any]:
    """The gate's answer for one node, as JSON-ready data; ``host`` is the name the caller knows the
    node by (default: the hostname in its facts)."""
    gpus = facts.get("gpus") or []
    names = sorted({g["name"] for g in gpus})
    return {"host": host or facts.get("hostname"), "hostname": facts.get("hostname"), "passed": not failures,
            "gpus": len(gpus), "gpu_names": names, "driver_version": facts.get("driver_version"),
            "failures": [asdict(f) for f in failures], "sample": link_sample(facts)}


def format_verdict(result: dict[str, Any]) -> str:
    """Human lines for one node's verdict."""
    gpus = f"{result['gpus']} x {', '.join(result['gpu_names'])}" if result["gpus"] else "no GPUs"
    head = f"{result['host']}: {'PASS' if result['passed'] else 'FAIL'} ({gpus}, driver {result['driver_version']})"
    return "\n".join([head] + ["  " + Failure(**f).line() for f in result["failures"]])
