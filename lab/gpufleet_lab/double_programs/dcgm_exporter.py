#!/usr/bin/python3
"""dcgm-exporter, gpufleet LAB DOUBLE: Prometheus DCGM_FI_* metrics read from the node's NVML through pynvml.

Command line like NVIDIA's dcgm-exporter: ``-f/--collectors CSV`` (the fields to export, ``FIELD, type, help``
per line, ``#`` comments), ``-a/--address [HOST]:PORT`` (default ``:9400``), ``-r/--remote-hostengine-info
HOST:PORT`` (the running nv-hostengine must accept a connection there), ``-c/--collect-interval MS`` (accepted;
the double reads NVML at every scrape). Serves ``/metrics`` and ``/health``. Fields the double does not know
are reported once on stderr and left out, as are values the GPU answers NOT_SUPPORTED for (DCGM leaves those
blank). A known field whose NVML entry point the node's library lacks is served as 0: the lab's simulated NVML
implements only what gpufleet's probe and the lab's faults need, and every counter a deployment turns on should
still appear. The same holds for ``DCGM_FI_DEV_XID_ERRORS`` when NVML events are missing: 0, no XID seen, and for
``DCGM_EXP_XID_ERRORS_COUNT``, the exporter's count of each XID within its window (``-x/--xid-count-window-size MS``,
default 5 minutes): one 0 per GPU without an ``xid`` label.

Every scrape reads the GPUs afresh (count, handles, values, XID events), so faults injected on a running node show
and clear at run time. A GPU whose handle NVML no longer gives (fallen off the bus: ``GPU is lost``) is left out, as
dcgm-exporter leaves out the blank values DCGM has for it: the node reports one GPU fewer.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

BUNDLED_PYNVML = "/usr/lib/gpufleet-lab/dcgm-exporter"
if os.path.isdir(BUNDLED_PYNVML):
    sys.path.insert(0, BUNDLED_PYNVML)

import pynvml as nv  # noqa: E402

MIB = 1024 * 1024


def _no_answer(exc: Exception) -> bool:
    """True when the NVML library lacks the entry point (the simulated NVML answers only the probe's calls)."""
    return isinstance(exc, nv.NVMLError) and exc.value == nv.NVML_ERROR_FUNCTION_NOT_FOUND


def _field_value(handle: Any, field_id: int) -> float:
    (value,) = nv.nvmlDeviceGetFieldValues(handle, [field_id])
    if value.nvmlReturn != nv.NVML_SUCCESS:
        raise nv.NVMLError(value.nvmlReturn)
    reading: float = value.value.uiVal
    return reading


def _ecc(kind: int, counter: int) -> Callable[[Any], float]:
    return lambda h: nv.nvmlDeviceGetTotalEccErrors(h, kind, counter)


def _violation(policy: int) -> Callable[[Any], float]:
    return lambda h: nv.nvmlDeviceGetViolationStatus(h, policy).violationTime / 1000  # ns -> us


def _nvlink(counter: int) -> Callable[[Any], float]:
    def total(h: Any) -> float:
        found, errors = False, 0
        for link in range(nv.NVML_NVLINK_MAX_LINKS):
            try:
                if nv.nvmlDeviceGetNvLinkState(h, link) != nv.NVML_FEATURE_ENABLED:
                    continue
            except nv.NVMLError:
                continue  # no such link
            try:
                errors += nv.nvmlDeviceGetNvLinkErrorCounter(h, link, counter)
                found = True
            except nv.NVMLError as exc:
                found = found or _no_answer(exc)  # an active link whose counter the library cannot read: 0
        if not found:
            raise nv.NVMLError(nv.NVML_ERROR_NOT_SUPPORTED)
        return errors

    return total


def _remapped(index: int) -> Callable[[Any], float]:
    return lambda h: nv.nvmlDeviceGetRemappedRows(h)[index]


# DCGM field -> how the double reads it from NVML (units as DCGM reports them).
FIELDS: dict[str, Callable[[Any], float]] = {
    "DCGM_FI_DEV_GPU_TEMP": lambda h: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
    "DCGM_FI_DEV_MEMORY_TEMP": lambda h: _field_value(h, nv.NVML_FI_DEV_MEMORY_TEMP),
    "DCGM_FI_DEV_POWER_USAGE": lambda h: nv.nvmlDeviceGetPowerUsage(h) / 1000,
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": lambda h: nv.nvmlDeviceGetTotalEnergyConsumption(h),
    "DCGM_FI_DEV_SM_CLOCK": lambda h: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
    "DCGM_FI_DEV_MEM_CLOCK": lambda h: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM),
    "DCGM_FI_DEV_GPU_UTIL": lambda h: nv.nvmlDeviceGetUtilizationRates(h).gpu,
    "DCGM_FI_DEV_MEM_COPY_UTIL": lambda h: nv.nvmlDeviceGetUtilizationRates(h).memory,
    "DCGM_FI_DEV_ENC_UTIL": lambda h: nv.nvmlDeviceGetEncoderUtilization(h)[0],
    "DCGM_FI_DEV_DEC_UTIL": lambda h: nv.nvmlDeviceGetDecoderUtilization(h)[0],
    "DCGM_FI_DEV_FB_TOTAL": lambda h: nv.nvmlDeviceGetMemoryInfo(h).total // MIB,
    "DCGM_FI_DEV_FB_FREE": lambda h: nv.nvmlDeviceGetMemoryInfo(h).free // MIB,
    "DCGM_FI_DEV_FB_USED": lambda h: nv.nvmlDeviceGetMemoryInfo(h).used // MIB,
    "DCGM_FI_DEV_PSTATE": lambda h: nv.nvmlDeviceGetPerformanceState(h),
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": lambda h: nv.nvmlDeviceGetPcieReplayCounter(h),
    "DCGM_FI_DEV_PCIE_LINK_GEN": lambda h: nv.nvmlDeviceGetCurrPcieLinkGeneration(h),
    "DCGM_FI_DEV_PCIE_LINK_WIDTH": lambda h: nv.nvmlDeviceGetCurrPcieLinkWidth(h),
    "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": lambda h: nv.nvmlDeviceGetCurrentClocksEventReasons(h),
    "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": lambda h: nv.nvmlDeviceGetCurrentClocksEventReasons(h),
    "DCGM_FI_DEV_POWER_VIOLATION": _violation(nv.NVML_PERF_POLICY_POWER),
    "DCGM_FI_DEV_THERMAL_VIOLATION": _violation(nv.NVML_PERF_POLICY_THERMAL),
    "DCGM_FI_DEV_SYNC_BOOST_VIOLATION": _violation(nv.NVML_PERF_POLICY_SYNC_BOOST),
    "DCGM_FI_DEV_BOARD_LIMIT_VIOLATION": _violation(nv.NVML_PERF_POLICY_BOARD_LIMIT),
    "DCGM_FI_DEV_LOW_UTIL_VIOLATION": _violation(nv.NVML_PERF_POLICY_LOW_UTILIZATION),
    "DCGM_FI_DEV_RELIABILITY_VIOLATION": _violation(nv.NVML_PERF_POLICY_RELIABILITY),
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": _ecc(nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC),
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": _ecc(nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC),
    "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL": _ecc(nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_AGGREGATE_ECC),
    "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL": _ecc(nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_AGGREGATE_ECC),
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": _remapped(0),
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": _remapped(1),
    "DCGM_FI_DEV_ROW_REMAP_PENDING": _remapped(2),
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": _remapped(3),
    "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL": _nvlink(nv.NVML_NVLINK_ERROR_DL_CRC_FLIT),
    "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL": _nvlink(nv.NVML_NVLINK_ERROR_DL_CRC_DATA),
    "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL": _nvlink(nv.NVML_NVLINK_ERROR_DL_REPLAY),
    "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL": _nvlink(nv.NVML_NVLINK_ERROR_DL_RECOVERY),
}
XID_FIELD = "DCGM_FI_DEV_XID_ERRORS"  # the last XID seen per GPU, from NVML events (0: none yet)
XID_COUNT_FIELD = "DCGM_EXP_XID_ERRORS_COUNT"  # XIDs per GPU and XID (label xid) within the window, same events
XID_WINDOW_MS = 300000  # dcgm-exporter's default --xid-count-window-size
LABEL_FIELDS: dict[str, Callable[[Any], str]] = {
    "DCGM_FI_DRIVER_VERSION": lambda h: _text(nv.nvmlSystemGetDriverVersion()),
    "DCGM_FI_DEV_SERIAL": lambda h: _text(nv.nvmlDeviceGetSerial(h)),
}


@dataclass(frozen=True)
class Gpu:
    """A GPU NVML answers for at this scrape."""

    index: int
    handle: Any
    uuid: str


def _read(field: str, handle: Any) -> float:
    """One field of one GPU; 0 when the NVML library lacks the entry point (see the module docstring)."""
    try:
        return FIELDS[field](handle)
    except nv.NVMLError as exc:
        if _no_answer(exc):
            return 0
        raise


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def read_counters(path: str) -> list[tuple[str, str, str]]:
    """The enabled ``(field, type, help)`` lines of a dcgm-exporter counters file."""
    rows = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = [p.strip() for p in line.split(",", 2)]
            if len(parts) < 2 or not parts[0].startswith("DCGM_"):
                raise ValueError(f"{path}:{number}: expected 'DCGM_FIELD, type, help', got {line!r}")
            rows.append((parts[0], parts[1], parts[2] if len(parts) > 2 else ""))
    return rows


class Collector:
    """Reads the enabled fields of every GPU and renders them in the Prometheus text format."""

    def __init__(self, counters: list[tuple[str, str, str]], hostname: str, xid_window_ms: int = XID_WINDOW_MS) -> None:
        supported = set(FIELDS) | set(LABEL_FIELDS) | {XID_FIELD, XID_COUNT_FIELD}
        for field, _, _ in counters:
            if field not in supported:
                print(f"dcgm-exporter (lab double): {field} is not supported by the double; skipped", file=sys.stderr)
        self.metrics = [c for c in counters if c[0] in supported and c[1] != "label"]
        self.labels = [c[0] for c in counters if c[0] in LABEL_FIELDS and c[1] == "label"]
        self.hostname = hostname
        self.lock = threading.Lock()
        self.gpus: list[Gpu] = []
        self.last_xid: dict[str, int] = {}  # per GPU UUID, for the GPUs whose XIDs the double can tell
        self.xid_window_ms = xid_window_ms
        self.xids_seen: list[tuple[float, str, int]] = []  # (monotonic time, GPU UUID, XID), within the window
        self.xid_watched: set[str] = set()  # GPUs (UUIDs) the double set out to watch for XIDs, with or without luck
        self.want_xids = any(m[0] in (XID_FIELD, XID_COUNT_FIELD) for m in self.metrics)
        self.events = self._create_event_set() if self.want_xids else None
        self.read_gpus()

    def _create_event_set(self) -> Any:
        try:
            return nv.nvmlEventSetCreate()
        except nv.NVMLError as exc:
            if not _no_answer(exc):
                print(f"dcgm-exporter (lab double): XID events unavailable ({exc}); {XID_FIELD} left out",
                      file=sys.stderr)
                self.want_xids = False
                return None
            print(f"dcgm-exporter (lab double): NVML has no events here; {XID_FIELD} stays 0", file=sys.stderr)
            return None

    def read_gpus(self) -> None:
        """The GPUs NVML answers for now; a GPU seen for the first time is registered for XID events."""
        gpus = []
        for index in range(nv.nvmlDeviceGetCount()):
            try:
                handle = nv.nvmlDeviceGetHandleByIndex(index)
                uuid = _text(nv.nvmlDeviceGetUUID(handle))
            except nv.NVMLError:
                continue  # lost: left out (see the module docstring)
            gpus.append(Gpu(index, handle, uuid))
            if self.want_xids and uuid not in self.xid_watched:
                self.xid_watched.add(uuid)
                self._watch_xids(handle, uuid)
        self.gpus = gpus

    def _watch_xids(self, handle: Any, uuid: str) -> None:
        if self.events is None:  # NVML without events: no XID seen
            self.last_xid[uuid] = 0
            return
        try:
            nv.nvmlDeviceRegisterEvents(handle, nv.nvmlEventTypeXidCriticalError, self.events)
            self.last_xid[uuid] = 0
        except nv.NVMLError as exc:
            print(f"dcgm-exporter (lab double): XID events unavailable for {uuid} ({exc}); {XID_FIELD} left out",
                  file=sys.stderr)

    def _drain_xid_events(self) -> None:
        while self.events is not None:
            try:
                event = nv.nvmlEventSetWait_v2(self.events, 0)
            except nv.NVMLError:
                break  # NVML_ERROR_TIMEOUT: no more events
            try:
                uuid, xid = _text(nv.nvmlDeviceGetUUID(event.device)), int(event.eventData)
            except nv.NVMLError:
                continue  # the GPU is lost, and left out
            self.last_xid[uuid] = xid
            self.xids_seen.append((time.monotonic(), uuid, xid))
        since = time.monotonic() - self.xid_window_ms / 1000
        self.xids_seen = [seen for seen in self.xids_seen if seen[0] >= since]

    def _xid_counts(self, uuid: str, labels: str) -> list[str]:
        """One GPU's XID counts within the window, as the exporter gives them: a sample per XID, or one 0 without an
        ``xid`` label; none while XID events are unavailable (as ``DCGM_FI_DEV_XID_ERRORS``)."""
        if uuid not in self.last_xid:
            return []
        counts = Counter(xid for _, seen, xid in self.xids_seen if seen == uuid)
        window = f'{labels},window_size_in_ms="{self.xid_window_ms}"'
        if not counts:
            return [f"{XID_COUNT_FIELD}{{{window}}} 0"]
        return [f'{XID_COUNT_FIELD}{{{window},xid="{xid}"}} {n}' for xid, n in sorted(counts.items())]

    def _labels(self, gpu: Gpu) -> str:
        try:
            minor = nv.nvmlDeviceGetMinorNumber(gpu.handle)
        except nv.NVMLError:
            minor = gpu.index  # the device node number, when NVML cannot say
        pairs = {
            "gpu": str(gpu.index),
            "UUID": gpu.uuid,
            "pci_bus_id": _text(nv.nvmlDeviceGetPciInfo_v3(gpu.handle).busId),
            "device": f"nvidia{minor}",
            "modelName": _text(nv.nvmlDeviceGetName(gpu.handle)),
            "Hostname": self.hostname,
        }
        for field in self.labels:
            try:
                pairs[field] = LABEL_FIELDS[field](gpu.handle)
            except nv.NVMLError:
                continue
        return ",".join(f'{k}="{_escape(v)}"' for k, v in pairs.items())

    def render(self) -> str:
        with self.lock:
            self._drain_xid_events()
            self.read_gpus()
            labels = {}
            for gpu in self.gpus:
                try:
                    labels[gpu.uuid] = self._labels(gpu)
                except nv.NVMLError:
                    continue  # lost since it was counted
            lines = []
            for field, kind, help_text in self.metrics:
                samples = []
                for gpu in (gpu for gpu in self.gpus if gpu.uuid in labels):
                    if field == XID_COUNT_FIELD:
                        samples += self._xid_counts(gpu.uuid, labels[gpu.uuid])
                        continue
                    try:
                        value = self.last_xid[gpu.uuid] if field == XID_FIELD else _read(field, gpu.handle)
                    except (nv.NVMLError, KeyError):
                        continue
                    samples.append(f"{field}{{{labels[gpu.uuid]}}} {_number(value)}")
                if samples:
                    lines += [f"# HELP {field} {help_text}", f"# TYPE {field} {kind}", *samples]
            return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def _wait_for_hostengine(address: str, timeout: float = 10.0) -> None:
    host, port = _split_address(address)
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host or "127.0.0.1", port), timeout=2).close()
            return
        except OSError as exc:
            if time.monotonic() > deadline:
                raise SystemExit(
                    f"dcgm-exporter (lab double): cannot connect to the host engine at {address}: {exc}"
                ) from None
            time.sleep(0.5)


def serve(collector: Collector, address: str) -> None:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?")[0] == "/metrics":
                body, ctype = collector.render().encode(), "text/plain; version=0.0.4; charset=utf-8"
            elif self.path == "/health":
                body, ctype = b"OK\n", "text/plain"
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    host, port = _split_address(address)
    server = ThreadingHTTPServer((host, port), Handler)
    print(f"dcgm-exporter (lab double): serving {len(collector.gpus)} GPU(s) on {address}", file=sys.stderr)
    server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dcgm-exporter", description="gpufleet lab double of NVIDIA dcgm-exporter")
    parser.add_argument("-f", "--collectors", default="/etc/dcgm-exporter/default-counters.csv")
    parser.add_argument("-a", "--address", default=":9400")
    parser.add_argument("-r", "--remote-hostengine-info", default="")
    parser.add_argument("-c", "--collect-interval", type=int, default=30000)
    parser.add_argument("-x", "--xid-count-window-size", type=int, default=XID_WINDOW_MS)
    args = parser.parse_args(argv)
    counters = read_counters(args.collectors)
    if args.remote_hostengine_info:
        _wait_for_hostengine(args.remote_hostengine_info)
    nv.nvmlInit()
    serve(Collector(counters, socket.gethostname(), args.xid_count_window_size), args.address)
    return 0


if __name__ == "__main__":
    sys.exit(main())
