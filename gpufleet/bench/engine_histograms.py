"""vLLM's own latency over one step of a bench: its time-to-first-token and inter-token latency histograms, read
from each replica's ``/metrics`` just before and just after the step, and the p99 and p95 of the difference (estimated
within a bucket as Prometheus's ``histogram_quantile`` does, so that a step is judged as the alerts judge a model and
a record reads like the canary's watch) and its mean (exact: the histogram's sum over its count).

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

TIMEOUT_S = 10.0
_BUCKET = re.compile(r'^(?P<name>[a-z_:]+)_bucket\{(?P<labels>[^}]*)\}\s+(?P<value>\S+)')
_SUM = re.compile(r'^(?P<name>[a-z_:]+)_sum(?:\{[^}]*\})?\s+(?P<value>\S+)')
_LE = re.compile(r'(?:^|,)le="(?P<le>[^"]+)"')

Buckets = dict[str, dict[float, float]]
"""Per figure (``ttft``, ``itl``): cumulative count per upper bound, summed over the replica's engines."""


@dataclass(frozen=True)
class Reading:
    """The histograms of one or more ``/metrics`` pages: cumulative buckets, and each figure's sum of seconds."""

    buckets: Buckets
    sums: dict[str, float]


def parse(text: str) -> Reading:
    """The latency histograms of a ``/metrics`` page (Prometheus's text format): buckets and sums, each summed
    over the page's engines."""
    by_name = {name: key for key, name in HISTOGRAMS.items()}
    found: Buckets = {key: {} for key in HISTOGRAMS}
    sums = dict.fromkeys(HISTOGRAMS, 0.0)
    for line in text.splitlines():
        if (match := _BUCKET.match(line)) is not None and match["name"] in by_name:
            if (le := _LE.search(match["labels"])) is not None:
                counts, bound = found[by_name[match["name"]]], float(le["le"])
                counts[bound] = counts.get(bound, 0.0) + float(match["value"])
        elif (match := _SUM.match(line)) is not None and match["name"] in by_name:
            sums[by_name[match["name"]]] += float(match["value"])
    return Reading(found, sums)


def read(urls: Sequence[str]) -> Reading:
    """The sum of the histograms of the ``/metrics`` pages at ``urls`` (OSError when one cannot be read)."""
    total: Buckets = {key: {} for key in HISTOGRAMS}
    sums = dict.fromkeys(HISTOGRAMS, 0.0)
    for url in urls:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as answer:
            page = parse(answer.read().decode("utf-8", "replace"))
        for key, counts in page.buckets.items():
            for bound, count in counts.items():
                total[key][bound] = total[key].get(bound, 0.0) + count
            sums[key] += page.sums[key]
    return Reading(total, sums)


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
