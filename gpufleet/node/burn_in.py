#!/usr/bin/env python3
"""Burn a node's GPUs in, and judge the run from its results, never from an exit code (gpufleet node tool).

    <release>/bin/python3 burn_in.py --tier quick --floors /etc/gpufleet/burn-in.json [--json] [--out VERDICT.json]

Run with the release's own Python (its torch) while no replica runs on the node. The tiers:

- ``quick``: the NVML gate (``nvml_probe.py --gate`` beside this file); ``dcgmi diag -r 1`` then ``-r 2``; on every
  GPU at once, a matrix product with a checksum and a TFLOP/s floor, then a device copy with a bandwidth floor;
- ``full``: ``dcgmi diag -r 3``; an all-reduce over the node's GPUs (``fabric_check.py`` beside this file, one rank
  per GPU on loopback) with a bus-bandwidth floor.

``dcgmi`` is read from ``--json``, test by test and GPU by GPU: a failed test fails the run whatever ``dcgmi``'s exit
status, a warning is kept as a warning, a skipped test is recorded as skipped; no results at all is a failure. The
floors file (JSON, written by the deploy from the node's GPU profile) holds every bound; a missing or non-positive one
is a bad file (exit 2). The verdict (``gpufleet.burn-in/1``) lists every check with its value, floor and evidence;
exit 0 when it passed, 1 when it failed. Standard library, plus torch for the kernels and nvidia-ml-py for the
readings around them where the release has them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

SCHEMA = "gpufleet.burn-in/1"
HERE = Path(__file__).resolve().parent
TIERS = ("quick", "full")
DCGM_LEVELS = {"quick": (1, 2), "full": (3,)}
DCGM_STATUS = {"pass": "pass", "fail": "fail", "warn": "warn", "skip": "skip", "not run": "skip"}
GIGA = 1e9
TERA = 1e12

Runner = Callable[[list[str], float], tuple[int, str, str]]  # argv, timeout -> (exit status, stdout, stderr)


class FloorsError(Exception):
    """The floors file cannot be used: the run judges nothing."""


@dataclass(frozen=True)
class Floors:
    """Every bound one burn-in run is judged by (the node's GPU profile, rendered by the deploy)."""

    device: str  # "cuda", or "cpu" where the host's CPU stands in for the GPUs (the lab's double)
    dtype: str  # the matrix product's element type: "bfloat16" on GPUs
    matmul_n: int
    matmul_seconds: float
    matmul_tflops: float  # the median product's rate, per GPU
    copy_bytes: int
    copy_seconds: float
    copy_gbps: float  # bytes read plus bytes written, per second, per GPU
    allreduce_bytes: int
    allreduce_busbw_gbps: float
    dcgm_timeout_s: dict[str, float] = field(default_factory=lambda: {"1": 120.0, "2": 600.0, "3": 2400.0})
    gate_policy: str = ""  # the health policy the NVML gate judges by ("": no gate)

    POSITIVE = ("matmul_n", "matmul_seconds", "matmul_tflops", "copy_bytes", "copy_seconds", "copy_gbps",
                "allreduce_bytes", "allreduce_busbw_gbps")


def load_floors(path: Path) -> Floors:
    """Read a floors file; every bound must be there and positive, and no key may be unknown."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise FloorsError(f"{path}: not a readable JSON file ({type(exc).__name__})") from None
    if not isinstance(doc, dict):
        raise FloorsError(f"{path}: expected an object")
    known = set(Floors.__dataclass_fields__)
    unknown = sorted(set(doc) - known)
    if unknown:
        raise FloorsError(f"{path}: unknown key {unknown[0]!r}")
    missing = [f.name for f in fields(Floors)
               if f.name not in doc and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise FloorsError(f"{path}: missing key {missing[0]!r}")
    for key in Floors.POSITIVE:
        value = doc[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
            raise FloorsError(f"{path}: {key}: expected a positive number, found {value!r}")
    if doc["device"] not in ("cuda", "cpu"):
        raise FloorsError(f"{path}: device: expected 'cuda' or 'cpu', found {doc['device']!r}")
    if doc["dtype"] not in ("bfloat16", "float16", "float32"):
        raise FloorsError(f"{path}: dtype: expected bfloat16, float16 or float32, found {doc['dtype']!r}")
    return Floors(**doc)


@dataclass
class Check:
    """One judged result: a test of one GPU (``gpu`` None: the node as a whole)."""

    check: str
    status: str  # pass, fail, warn or skip
    gpu: int | None = None
    value: float | None = None
    floor: float | None = None
    unit: str = ""
    evidence: dict[str, Any] = field(default_factory=dict)


# --- dcgmi diag, read from its JSON -------------------------------------------------------------------------------


def read_dcgm_diag(doc: Any, level: int) -> list[Check]:
    """Every test's result per GPU from ``dcgmi diag --json`` (DCGM 4's ``DCGM Diagnostic`` and DCGM 3's
    ``DCGM GPU Diagnostic``). A document with no result, or a runtime error, is one failed check."""
    name = f"dcgm-r{level}"
    if not isinstance(doc, dict):
        return [Check(name, "fail", evidence={"error": "no JSON object in dcgmi's output"})]
    body = doc.get("DCGM Diagnostic", doc.get("DCGM GPU Diagnostic"))
    if not isinstance(body, dict):
        return [Check(name, "fail", evidence={"error": "no 'DCGM Diagnostic' in dcgmi's output"})]
    serials = {str(e.get("entity_id")): e.get("serial_num", "")
               for g in doc.get("entity_groups", []) if isinstance(g, dict) and g.get("entity_group") == "GPU"
               for e in g.get("entities", []) if isinstance(e, dict)}
    checks: list[Check] = []
    if body.get("runtime_error"):
        checks.append(Check(name, "fail", evidence={"error": str(body["runtime_error"])[:500]}))
    for category in body.get("test_categories") or []:
        for test in category.get("tests") or []:
            for result in test.get("results") or []:
                if result.get("entity_group", "GPU") != "GPU":
                    continue
                status = DCGM_STATUS.get(str(result.get("status", "")).lower(), "fail")
                gpus = ([result["entity_id"]] if "entity_id" in result
                        else str(result.get("gpu_ids", result.get("gpu_id", ""))).split(","))
                warnings = [{"code": w.get("error_id"), "text": str(w.get("warning", ""))[:300]}
                            for w in result.get("warnings") or [] if isinstance(w, dict)]
                for gpu in gpus:
                    index = int(gpu) if str(gpu).strip().isdigit() else None
                    evidence: dict[str, Any] = {"test": test.get("name", "?"),
                                                "category": category.get("category", "?")}
                    if warnings:
                        evidence["warnings"] = warnings
                    if index is not None and serials.get(str(index)):
                        evidence["serial"] = serials[str(index)]
                    checks.append(Check(name, status, index, evidence=evidence))
    if not checks:
        checks.append(Check(name, "fail", evidence={"error": "dcgmi reported no test result"}))
    return checks


def _json_in(text: str) -> Any:
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end < start:
        return None
    try:
        return json.loads(text[start:end + 1])
    except ValueError:
        return None


def run_dcgm(level: int, floors: Floors, runner: Runner, dcgmi: str = "dcgmi") -> list[Check]:
    """``dcgmi diag -r LEVEL --json``, judged from its results whatever its exit status."""
    timeout = float(floors.dcgm_timeout_s.get(str(level), 600.0))
    status, out, err = runner([dcgmi, "diag", "-r", str(level), "--json"], timeout)
    checks = read_dcgm_diag(_json_in(out), level)
    for check in checks:
        check.evidence.setdefault("exit_status", status)
        if check.gpu is None and check.status == "fail" and err.strip():
            check.evidence.setdefault("stderr", err.strip()[-300:])
    if status != 0 and all(c.status != "fail" for c in checks):
        checks.append(Check(f"dcgm-r{level}", "warn", evidence={"exit_status": status, "stderr": err[-300:]}))
    return checks


# --- the kernels (torch) ------------------------------------------------------------------------------------------


def _readings(nvml: Any, index: int) -> dict[str, Any]:
    """NVML's view of one GPU around a kernel: heat, power, clocks, throttling, new ECC errors."""
    if nvml is None:
        return {}
    out: dict[str, Any] = {}
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        out["temperature_c"] = nvml.nvmlDeviceGetTemperature(handle, 0)
        out["power_w"] = nvml.nvmlDeviceGetPowerUsage(handle) / 1000
        out["sm_clock_mhz"] = nvml.nvmlDeviceGetClockInfo(handle, 1)
        out["clock_event_reasons"] = nvml.nvmlDeviceGetCurrentClocksEventReasons(handle)
        out["ecc_volatile_uncorrected"] = nvml.nvmlDeviceGetTotalEccErrors(handle, 1, 0)
    except Exception as exc:  # noqa: BLE001 - a reading NVML cannot give is left out, with why
        out["error"] = type(exc).__name__
    return out


def matmul_burn(torch: Any, device: str, index: int | None, floors: Floors, nvml: Any = None) -> Check:
    """Products of the same two matrices for ``matmul_seconds``: every product's row sums equal the first's (a GPU
    that computes the same thing twice differently is broken), the first agrees with a float64 product of a slice,
    and the median rate clears the floor."""
    dev = torch.device(device if index is None else f"{device}:{index}")
    dtype = getattr(torch, floors.dtype)
    gen = torch.Generator(device="cpu").manual_seed(1234)
    n = floors.matmul_n
    a = torch.randn(n, n, generator=gen, dtype=torch.float32).to(dev, dtype)
    b = torch.randn(n, n, generator=gen, dtype=torch.float32).to(dev, dtype)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda *_: None)
    before = _readings(nvml, index) if index is not None else {}
    c = a @ b
    sync(dev)
    reference = c.float().sum(dim=1)
    rows = min(n, 16)
    exact = a[:rows].double() @ b.double()
    error = float(((c[:rows].double() - exact).abs().max() / exact.abs().max()).item())
    tolerance = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 5e-3}[floors.dtype]
    rates: list[float] = []
    mismatched = 0
    during: dict[str, Any] = {}
    start = time.perf_counter()
    while time.perf_counter() - start < floors.matmul_seconds:
        t0 = time.perf_counter()
        c = a @ b
        sync(dev)
        rates.append(2 * n**3 / (time.perf_counter() - t0) / TERA)
        if not torch.equal(c.float().sum(dim=1), reference):
            mismatched += 1
        if not during and time.perf_counter() - start > floors.matmul_seconds / 2 and index is not None:
            during = _readings(nvml, index)
    after = _readings(nvml, index) if index is not None else {}
    median = statistics.median(rates)
    evidence: dict[str, Any] = {"products": len(rates), "min": round(min(rates), 3), "max": round(max(rates), 3),
                                "mismatched_products": mismatched, "slice_error": error, "n": n,
                                "dtype": floors.dtype}
    if before:
        evidence["nvml"] = {"before": before, "during": during, "after": after}
    failed: list[str] = []
    if mismatched:
        failed.append(f"{mismatched} of {len(rates)} products differ from the first")
    if not error <= tolerance:
        failed.append(f"the product is wrong: relative error {error:.3g} > {tolerance:g}")
    if median < floors.matmul_tflops:
        failed.append(f"median {median:.4g} TFLOP/s < floor {floors.matmul_tflops:g}")
    new_ecc = after.get("ecc_volatile_uncorrected", 0) - before.get("ecc_volatile_uncorrected", 0)
    if isinstance(new_ecc, int) and new_ecc > 0:
        failed.append(f"{new_ecc} new uncorrected ECC errors")
    if failed:
        evidence["failed"] = failed
    return Check("matmul", "fail" if failed else "pass", index, round(median, 3), floors.matmul_tflops, "TFLOP/s",
                 evidence)


def copy_burn(torch: Any, device: str, index: int | None, floors: Floors) -> Check:
    """Copies of one buffer into another for ``copy_seconds``; the rate counts bytes read and written, and the last
    copy must equal its source."""
    dev = torch.device(device if index is None else f"{device}:{index}")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda *_: None)
    src = torch.randint(0, 255, (floors.copy_bytes,), dtype=torch.uint8,
                        generator=torch.Generator(device="cpu").manual_seed(99)).to(dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(dev)
    rates: list[float] = []
    start = time.perf_counter()
    while time.perf_counter() - start < floors.copy_seconds:
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(dev)
        rates.append(2 * floors.copy_bytes / (time.perf_counter() - t0) / GIGA)
    equal = bool(torch.equal(dst, src))
    median = statistics.median(rates)
    failed = [] if equal else ["the copy differs from its source"]
    if median < floors.copy_gbps:
        failed.append(f"median {median:.4g} GB/s < floor {floors.copy_gbps:g}")
    evidence: dict[str, Any] = {"copies": len(rates), "bytes": floors.copy_bytes, "min": round(min(rates), 3)}
    if failed:
        evidence["failed"] = failed
    return Check("copy", "fail" if failed else "pass", index, round(median, 3), floors.copy_gbps, "GB/s", evidence)


def kernel_checks(floors: Floors, nvml: Any = None) -> list[Check]:
    """The matrix product and the copy on every GPU torch sees (or once on the CPU, the lab's double)."""
    try:
        import torch  # type: ignore[import-not-found]  # the release's own
    except ImportError as exc:
        return [Check("torch", "fail", evidence={"error": f"no torch in this Python: {exc}"})]
    if floors.device == "cpu":
        return [matmul_burn(torch, "cpu", None, floors), copy_burn(torch, "cpu", None, floors)]
    count = torch.cuda.device_count()
    if count == 0:
        return [Check("torch", "fail", evidence={"error": "torch sees no CUDA device"})]

    def one_gpu(index: int) -> list[Check]:
        return [matmul_burn(torch, "cuda", index, floors, nvml), copy_burn(torch, "cuda", index, floors)]

    with ThreadPoolExecutor(max_workers=count) as pool:  # every GPU at once: torch lets go of the GIL in CUDA calls
        return [check for found in pool.map(one_gpu, range(count)) for check in found]


# --- the gate and the node's all-reduce -----------------------------------------------------------------------------


def gate_check(floors: Floors, runner: Runner) -> Check:
    """The NVML gate the replicas' units run, judged from its JSON verdict."""
    if not floors.gate_policy:
        return Check("nvml-gate", "skip", evidence={"why": "no gate policy in the floors file"})
    status, out, err = runner([sys.executable, str(HERE / "nvml_probe.py"), "--gate", floors.gate_policy, "--json"],
                              120.0)
    verdict = _json_in(out)
    if not isinstance(verdict, dict) or "passed" not in verdict:
        return Check("nvml-gate", "fail", evidence={"exit_status": status, "stderr": err[-300:]})
    return Check("nvml-gate", "pass" if verdict["passed"] is True else "fail",
                 evidence={"failures": verdict.get("failures", [])})


CPU_RANKS = 2  # the CPU build's all-reduce (the lab's double): two gloo ranks on loopback, the code path GPUs take


def allreduce_check(floors: Floors, runner: Runner, gpus: int) -> Check:
    """An all-reduce over the node's GPUs, one ``fabric_check.py`` rank per GPU on loopback (NCCL); on the CPU build,
    :data:`CPU_RANKS` gloo ranks, held to the floors' own bound."""
    cpu = floors.device == "cpu"
    ranks = CPU_RANKS if cpu else gpus
    if ranks < 2:
        return Check("allreduce", "skip", evidence={"why": "fewer than two GPUs"})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, str(HERE / "fabric_check.py"), "--rank", str(r), "--world", str(ranks),
                               "--leader", f"127.0.0.1:{port}", "--backend", "gloo" if cpu else "nccl",
                               "--iface", "lo",  # the unit reaches localhost only: the collective's sockets too
                               *([] if cpu else ["--local-gpu", str(r)]), "--bytes", str(floors.allreduce_bytes),
                               "--floor-gbps",
                               str(floors.allreduce_busbw_gbps), "--timeout", "120"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(ranks)]
    outs = [p.communicate(timeout=180) for p in procs]
    leader = _json_in(outs[0][0])
    if not isinstance(leader, dict):
        return Check("allreduce", "fail", evidence={"stderr": outs[0][1][-300:]})
    return Check("allreduce", "pass" if leader.get("passed") else "fail", None, leader.get("busbw_gbps"),
                 floors.allreduce_busbw_gbps, "GB/s", {k: v for k, v in leader.items() if k != "passed"})


# --- a run ----------------------------------------------------------------------------------------------------------


def run_command(argv: list[str], timeout: float) -> tuple[int, str, str]:
    """``argv`` with a time limit: (exit status, stdout, stderr); 127 when it is not there, 124 when it ran out."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        return 127, "", f"{argv[0]}: not found"
    except subprocess.TimeoutExpired:
        return 124, "", f"no answer within {timeout:g} s"
    return done.returncode, done.stdout, done.stderr


def _nvml() -> Any:
    try:
        import pynvml as nvml  # nvidia-ml-py, which vLLM depends on

        nvml.nvmlInit()
        return nvml
    except Exception:  # noqa: BLE001 - readings are evidence, not a verdict
        return None


def burn_in(tier: str, floors: Floors, runner: Runner = run_command, dcgmi: str = "dcgmi") -> dict[str, Any]:
    """One tier's run: every check, and the verdict (passed when no check failed)."""
    started = time.monotonic()
    checks: list[Check] = [gate_check(floors, runner)]
    for level in DCGM_LEVELS[tier]:
        checks += run_dcgm(level, floors, runner, dcgmi)
    nvml = _nvml() if floors.device == "cuda" else None
    if tier == "quick":
        checks += kernel_checks(floors, nvml)
    else:
        gpus = nvml.nvmlDeviceGetCount() if nvml is not None else 0
        checks.append(allreduce_check(floors, runner, gpus))
    failed = [c for c in checks if c.status == "fail"]
    return {"schema": SCHEMA, "node": socket.gethostname(), "tier": tier, "passed": not failed,
            "failed": len(failed), "seconds": round(time.monotonic() - started, 1),
            "checks": [asdict(c) for c in checks]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="burn_in.py", description="Burn a node's GPUs in; judge the results.")
    parser.add_argument("--tier", choices=TIERS, required=True)
    parser.add_argument("--floors", type=Path, required=True, metavar="FLOORS.json")
    parser.add_argument("--dcgmi", default=os.environ.get("GPUFLEET_DCGMI", "dcgmi"), help="the dcgmi to run")
    parser.add_argument("--json", action="store_true", help="print the verdict as JSON (else a line per failure)")
    parser.add_argument("--out", type=Path, metavar="VERDICT.json",
                        help="also write the verdict there (0644, replaced whole); exit 0 once it is written")
    args = parser.parse_args(argv)
    try:
        floors = load_floors(args.floors)
    except FloorsError as exc:
        print(f"burn-in: {exc}", file=sys.stderr)
        return 2
    if args.out is not None:
        args.out.unlink(missing_ok=True)  # no verdict but this run's
    verdict = burn_in(args.tier, floors, dcgmi=args.dcgmi)
    if args.out is not None:
        temporary = args.out.with_name(f".{args.out.name}.tmp")
        temporary.write_text(json.dumps(verdict, indent=1) + "\n")
        os.chmod(temporary, 0o644)
        os.replace(temporary, args.out)
    if args.json:
        print(json.dumps(verdict, indent=1))
    else:
        for check in verdict["checks"]:
            if check["status"] == "fail":
                where = "node" if check["gpu"] is None else f"GPU {check['gpu']}"
                print(f"burn-in {args.tier}: {verdict['node']}: {check['check']} failed on {where}: "
                      f"{json.dumps(check['evidence'])[:400]}")
        print(f"burn-in {args.tier}: {verdict['node']}: {'passed' if verdict['passed'] else 'failed'} "
              f"in {verdict['seconds']} s")
    # with --out, a failed burn-in is a verdict written, not a failed run (its unit does not fail: the verdict alerts)
    return 0 if verdict["passed"] or args.out is not None else 1


if __name__ == "__main__":
    sys.exit(main())
