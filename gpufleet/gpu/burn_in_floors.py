"""The rates a GPU must reach in the burn-in (``gpufleet/node/burn_in.py``), per GPU model.

A floor catches a GPU that computes or copies far slower than its kind does (held-down clocks, a degraded memory
stack, a bad slot), not one that is a little slow: it is :data:`FLOOR_SHARE` of what a healthy GPU of the model
reaches, which varies with power limits and cooling. What a healthy GPU reaches was measured on an H100 and an H200
(tests/data/gpu_captures/); for the others it is estimated from the datasheet at the ratios those two showed: the
median bf16 product at 70% of the dense peak, the copy (bytes read plus written) at 90% of the memory bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass

FLOOR_SHARE = 0.6
PEAK_SHARE = 0.7  # measured: H100 683 of 989 TFLOP/s, H200 693 of 989
BANDWIDTH_SHARE = 0.9  # measured: H100 3,023 GB/s of 3,350, H200 4,210 of 4,800


@dataclass(frozen=True)
class BurnInRates:
    """What a GPU of one model reaches: a bf16 matrix product (TFLOP/s), a device copy (GB/s, read plus written),
    the all-reduce bus bandwidth inside one node of such GPUs (GB/s); and where the figures come from."""

    matmul_tflops: float
    copy_gbps: float
    allreduce_busbw_gbps: float
    source: str

    def floors(self) -> BurnInRates:
        return BurnInRates(round(self.matmul_tflops * FLOOR_SHARE, 1), round(self.copy_gbps * FLOOR_SHARE, 1),
                           round(self.allreduce_busbw_gbps * FLOOR_SHARE, 1), f"{FLOOR_SHARE:.0%} of {self.source}")


def _datasheet(peak_tflops: float, bandwidth_gbps: float, busbw_gbps: float, name: str) -> BurnInRates:
    return BurnInRates(round(peak_tflops * PEAK_SHARE, 1), round(bandwidth_gbps * BANDWIDTH_SHARE, 1), busbw_gbps,
                       f"the {name} datasheet ({peak_tflops:g} TFLOP/s bf16 dense, {bandwidth_gbps:g} GB/s)")


# Keys are gpufleet.gpu.profiles' GPU model keys. All-reduce bus bandwidth inside a node: nccl-tests' published
# figures for 8-GPU NVSwitch boards (about 450 GB/s on H100/H200, 230 on A100); 20 for GPUs that meet over PCIe.
HEALTHY: dict[str, BurnInRates] = {
    "H100": BurnInRates(683.0, 3023.0, 450.0, "an H100 80GB HBM3 measured (median of 921 products in 30 s)"),
    "H200": BurnInRates(693.0, 4210.0, 450.0, "an H200 measured (median of 15,494 products in 30 s)"),
    "H100NVL": _datasheet(835, 3900, 20, "H100 NVL"),
    "A100": _datasheet(312, 2039, 230, "A100 SXM4 80GB"),
    "A100PCIe": _datasheet(312, 1935, 20, "A100 80GB PCIe"),
    "L40S": _datasheet(362, 864, 20, "L40S"),
    "RTX4090": _datasheet(165, 1008, 20, "GeForce RTX 4090"),
}


def burn_in_floors(gpu_model: str) -> BurnInRates:
    """The floors for GPUs of ``gpu_model`` (a key of gpufleet.gpu.profiles.GPU_MODELS)."""
    return HEALTHY[gpu_model].floors()
