"""vLLM's own latency over one step of a bench: its time-to-first-token and inter-token latency histograms, read
from each replica's ``/metrics`` just before and just after the step, and the p99 and p95 of the difference (estimated
within a bucket as Prometheus's ``histogram_quantile`` does, so that a step is judged as the alerts judge a model and
a record reads like the canary's watch) and its mean (exact: the histogram's sum over its count). The same pages give
the requests answered and the output tokens, and the requests in the engines, for a step stopped before its end
(:mod:`gpufleet.measure.early_stop`).

Read directly rather than from Prometheus: a step of a few seconds is shorter than a scrape interval, and the
replica has counted every answer of the step once the client has it.
"""

from __future__ import annotations

import math
import re
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

HISTOGRAMS = {"ttft": "vllm:time_to_first_token_seconds", "itl": "vllm:inter_token_latency_seconds"}
"""vLLM's latency histograms, by the short name of the figure."""

COUNTERS = {"answered": "vllm:request_success_total", "output_tokens": "vllm:generation_tokens_total",
            "in_flight": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
            "preemptions": "vllm:num_preemptions_total"}
"""The counters and gauges read beside the histograms, by their short name (``answered`` leaves out the requests
that finished for :data:`NOT_ANSWERED`; ``in_flight`` adds the waiting to the running)."""

NOT_ANSWERED = ('finished_reason="abort"', 'finished_reason="error"')
"""The ``vllm:request_success_total`` series that count requests ended without an answer."""

TIMEOUT_S = 10.0
_SAMPLE = re.compile(r'^(?P<name>[a-z_:]+)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)')
_BUCKET = re.compile(r'^(?P<name>[a-z_:]+)_bucket\{(?P<labels>[^}]*)\}\s+(?P<value>\S+)')
_SUM = re.compile(r'^(?P<name>[a-z_:]+)_sum(?:\{[^}]*\})?\s+(?P<value>\S+)')
_LE = re.compile(r'(?:^|,)le="(?P<le>[^"]+)"')

Buckets = dict[str, dict[float, float]]
"""Per figure (``ttft``, ``itl``): cumulative count per upper bound, summed over the replica's engines."""


@dataclass(frozen=True)
class Reading:
    """The histograms of one or more ``/metrics`` pages: cumulative buckets, and each figure's sum of seconds; the
    requests answered, output tokens and preemptions so far (counters), and the requests in the engines now, those
    not yet scheduled among them (``waiting``)."""

    buckets: Buckets
    sums: dict[str, float]
    answered: float = 0.0
    output_tokens: float = 0.0
    in_flight: float = 0.0
    waiting: float = 0.0
    preemptions: float = 0.0


def parse(text: str) -> Reading:
    """The latency histograms of a ``/metrics`` page (Prometheus's text format): buckets and sums, each summed
    over the page's engines."""
    by_name = {name: key for key, name in HISTOGRAMS.items()}
    counter_of = {name: key for key, name in COUNTERS.items()}
    found: Buckets = {key: {} for key in HISTOGRAMS}
    sums = dict.fromkeys(HISTOGRAMS, 0.0)
    counted = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        if (sample := _SAMPLE.match(line)) is not None and sample["name"] in counter_of:
            if not any(label in (sample["labels"] or "") for label in NOT_ANSWERED):
                counted[counter_of[sample["name"]]] += float(sample["value"])
            continue
        if (match := _BUCKET.match(line)) is not None and match["name"] in by_name:
            if (le := _LE.search(match["labels"])) is not None:
                counts, bound = found[by_name[match["name"]]], float(le["le"])
                counts[bound] = counts.get(bound, 0.0) + float(match["value"])
        elif (match := _SUM.match(line)) is not None and match["name"] in by_name:
            sums[by_name[match["name"]]] += float(match["value"])
    return Reading(found, sums, counted["answered"], counted["output_tokens"],
                   counted["in_flight"] + counted["waiting"], counted["waiting"], counted["preemptions"])


def read(urls: Sequence[str]) -> Reading:
    """The sum of the histograms of the ``/metrics`` pages at ``urls`` (OSError when one cannot be read)."""
    total: Buckets = {key: {} for key in HISTOGRAMS}
    sums = dict.fromkeys(HISTOGRAMS, 0.0)
    counted = dict.fromkeys(COUNTERS, 0.0)  # Reading's fields of the same names
    for url in urls:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as answer:
            page = parse(answer.read().decode("utf-8", "replace"))
        for key, counts in page.buckets.items():
            for bound, count in counts.items():
                total[key][bound] = total[key].get(bound, 0.0) + count
            sums[key] += page.sums[key]
        for name in counted:
            counted[name] += getattr(page, name)
    return Reading(total, sums, **counted)


def quantile(q: float, cumulative: Mapping[float, float]) -> float | None:
    """The ``q`` quantile of a histogram's cumulative bucket counts, by linear interpolation within its bucket
    (the highest finite bound when it falls in ``+Inf``); None without observations."""
    bounds = sorted(cumulative)
    if not bounds or cumulative[bounds[-1]] <= 0:
        return None
    rank = q * cumulative[bounds[-1]]
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = cumulative[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower
            inside = count - below
            return bound if inside <= 0 else lower + (bound - lower) * (rank - below) / inside
        lower, below = bound, count
    return lower


def quantile_between(q: float, before: Buckets, after: Buckets) -> dict[str, float | None]:
    """Each figure's ``q`` quantile over what was observed between two readings."""
    return {key: quantile(q, {le: after[key][le] - before[key].get(le, 0.0) for le in after[key]})
            for key in HISTOGRAMS}


def mean_between(before: Reading, after: Reading) -> dict[str, float | None]:
    """Each figure's mean over what was observed between two readings (None when nothing was)."""
    found: dict[str, float | None] = {}
    for key in HISTOGRAMS:
        count = after.buckets[key].get(math.inf, 0.0) - before.buckets[key].get(math.inf, 0.0)
        found[key] = (after.sums[key] - before.sums[key]) / count if count > 0 else None
    return found


def bound_over(counts: Mapping[float, float], bound: float) -> float:
    """The smallest bucket bound at or over ``bound`` seconds (``+Inf`` when none is)."""
    return min((le for le in counts if le >= bound), default=math.inf)


def above_between(figure: str, bound: float, before: Buckets, after: Buckets) -> float:
    """How many of ``figure``'s observations between two readings were certainly above ``bound`` seconds: those
    above the smallest bucket bound at or over it (0 when that is ``+Inf``)."""
    counts = after[figure]
    edge = bound_over(counts, bound)
    if math.isinf(edge):
        return 0.0
    total = counts.get(math.inf, 0.0) - before[figure].get(math.inf, 0.0)
    return total - (counts[edge] - before[figure].get(edge, 0.0))
