"""``--canary-bench``: before a canary takes traffic, a short fixed-rate bench against its own API, judged on the
stored baseline of the release it replaces.

The rate is half the ceiling per replica its release's bench record measured (a load that met the objective with
room to spare); the bench is one step of :data:`BENCH_S` seconds with the same client as ``gpufleet bench``
(guidellm, on the controller, bounded and stopping by itself), and its p95 TTFT and ITL are compared with the
record's at that rate (:func:`gpufleet.rollout.latency.latency_verdict`). A canary whose release has no record is
not benched (the report says so).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpufleet.measure.guidellm_client import ClientError, Target, Workload, run_step
from gpufleet.measure.ramp import Step
from gpufleet.measure.records import Record
from gpufleet.rollout.latency import Percentiles, baseline_record, stored_percentiles

BENCH_S = 20.0
SHARE_OF_CEILING = 0.5


@dataclass(frozen=True)
class BenchPlan:
    """What one canary is benched at, or why it is not."""

    rate: float | None
    record: Record | None
    why_not: str = ""


def bench_plan(records: Sequence[Record], model: str, release: str, layout: str, profile: str) -> BenchPlan:
    """The rate a canary of ``model`` (``layout`` on ``profile``) replacing ``release`` is benched at."""
    record = baseline_record(records, model, release, layout, profile)
    if record is None:
        return BenchPlan(None, None, f"no bench record of vLLM {release} {layout} on {profile}")
    per = record.per_replica_rps()
    if per is None:
        return BenchPlan(None, record, f"vLLM {release}'s bench record has no ceiling")
    return BenchPlan(round(per * SHARE_OF_CEILING, 6), record)


@dataclass
class GuidellmCanaryBench:
    """Benches each canary on its own API (``targets``: replica -> where and how to reach it)."""

    client: Path
    targets: Mapping[str, Target]
    workloads: Mapping[str, Workload]
    run: Callable[[Path, Target, Workload, float, float], Step] = run_step

    def bench(self, replica: str, rate: float) -> tuple[Percentiles, str]:
        """One step at ``rate``: the canary's percentiles and a line for the report; ClientError when the client
        failed."""
        step = self.run(self.client, self.targets[replica], self.workloads[replica], rate, BENCH_S)
        line = (f"canary bench at {rate:g} req/s for {BENCH_S:g} s: {step.succeeded} answered, {step.failed} failed,"
                f" TTFT p95 {_ms(step.ttft_p95_s)}, ITL p95 {_ms(step.itl_p95_s)}")
        if step.failed:
            raise ClientError(f"{step.failed} of {step.succeeded + step.failed} requests failed at {rate:g} req/s")
        return Percentiles(step.succeeded, step.ttft_p95_s, step.itl_p95_s), line


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


def stored_at(plan: BenchPlan) -> Percentiles | None:
    """The record's percentiles at the plan's rate."""
    return stored_percentiles(plan.record, plan.rate, engine=False) if plan.rate is not None else None
