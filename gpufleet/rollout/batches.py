"""The batches and waves of a rolling upgrade: which replicas go out together, and in what order. Pure.

A replica is one unit (:class:`Unit`): a multi-node replica is taken out, rolled and brought back whole, and
counts once in every size and limit below.

Batch spec (``--batches``, default ``1,25%,100%``): items separated by commas, spaces around an item ignored.
``N`` is N replicas; ``P%`` is P percent (1 to 100) of all the replicas to roll, rounded up, at least 1. Each item
is the size of one batch, in order; the last item repeats until every replica is in a batch, and a batch larger
than what is left takes the rest (Ansible's ``serial:`` list). The first batch is the canary.

Order: models by name; within a model, the replicas not ready first (taking them out costs no capacity, and
rolling them early gives back the budget they hold), then those whose release changes, then those on the fewest
nodes, then by name, numbers in names compared as numbers. Batches are filled round-robin over the models (the
first replica of every model, then the second of every model, ...), so a canary of 1 touches one model, the first
by name, and later batches mix models.

Waves: a batch runs as waves, one after the other; a wave's replicas go out together and are ready again before
the next wave starts (the runner waits for that, or stops). For each model, a wave takes the batch's replicas in
order while these hold, then the next wave takes the rest:

- a replica not ready is always taken: it serves nothing already;
- a ready replica is taken only while the model's replicas out (those not ready and not rolled yet, plus the
  ready ones the wave takes) stay at most ``max_unavailable``, and its ready replicas at least ``min_available``.

A wave holds replicas of several models; each model's limits apply to its own replicas.

Limits, per model (defaults: ``max_unavailable`` 1, ``min_available`` 1; a model missing from the mappings gets
the default): a count, or ``P%`` of that model's replicas to roll (0% to 100%). A ``max_unavailable`` percentage
rounds down, at least 1; a ``min_available`` percentage rounds up. Percentages and capacity are counted over the
replicas passed in, so pass every replica of a model that serves it, not a subset.

Refused before anything runs, one line each (:class:`RolloutError`): a malformed spec, a batch size below 1, a
percentage over 100%, a bad limit, ``max_unavailable`` 0 (nothing could go out), a replica listed twice, and a
model whose ready replicas minus one fall below ``min_available`` (it cannot roll without losing capacity; a model
with none ready has no capacity to lose, and rolls).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpufleet.plan.planner import Replica

Limit = int | str
"""A ``max_unavailable`` or ``min_available`` value: a count, or a percentage text like ``25%``."""

DEFAULT_BATCHES = "1,25%,100%"
DEFAULT_MAX_UNAVAILABLE: Limit = 1
DEFAULT_MIN_AVAILABLE: Limit = 1

_ITEM = re.compile(r"(-?[0-9]{1,9})(%?)")  # 9 digits: far above any fleet, far below int() limits
_LIMIT = re.compile(r"([0-9]{1,9})(%?)")
_DIGITS = re.compile(r"[0-9]+")


class RolloutError(ValueError):
    """The rollout cannot start; ``problems`` holds one line each."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(dict.fromkeys(problems))
        super().__init__("\n".join(self.problems))


@dataclass(frozen=True)
class Unit:
    """One replica to roll: its name, the model it serves and its nodes (several for a multi-node replica)."""

    name: str
    model: str
    nodes: tuple[str, ...]

    @classmethod
    def of(cls, replica: Replica) -> Unit:
        return cls(replica.name, replica.model, tuple(replica.nodes))


@dataclass(frozen=True)
class BatchSize:
    """One item of a batch spec: ``count`` replicas, or ``count`` percent of them."""

    count: int
    percent: bool

    def of(self, total: int) -> int:
        """The batch size for ``total`` replicas to roll."""
        return max(1, -(-self.count * total // 100)) if self.percent else self.count


@dataclass(frozen=True)
class Batch:
    """One batch: its waves in order, each the names of the replicas taken out together."""

    waves: tuple[tuple[str, ...], ...]

    @property
    def replicas(self) -> tuple[str, ...]:
        return tuple(name for wave in self.waves for name in wave)


def parse_batches(spec: str) -> tuple[BatchSize, ...]:
    """The items of a batch spec such as ``1,25%,100%``; raises :class:`RolloutError`."""
    matches = [_ITEM.fullmatch(item.strip()) for item in spec.split(",")]
    if not all(matches):
        raise RolloutError([f"--batches: expected comma-separated counts or percentages like {DEFAULT_BATCHES},"
                            f" found {spec!r}"])
    items = [BatchSize(int(m[1]), m[2] == "%") for m in matches if m]
    problems: list[str] = []
    for i in items:
        if i.percent and not 1 <= i.count <= 100:
            problems.append(f"--batches: expected percentages from 1% to 100%, found {i.count}%")
        elif not i.percent and i.count < 1:
            problems.append(f"--batches: expected batch sizes of at least 1, found {i.count}")
    if problems:
        raise RolloutError(problems)
    return tuple(items)


def batch_sizes(items: Sequence[BatchSize], total: int) -> list[int]:
    """The size of every batch for ``total`` replicas: the items in order, the last one repeated."""
    sizes: list[int] = []
    while sum(sizes) < total:
        size = items[min(len(sizes), len(items) - 1)].of(total)
        sizes.append(min(size, total - sum(sizes)))
    return sizes


@dataclass(frozen=True)
class _Model:
    """One model's replicas and limits, resolved to counts."""

    replicas: int
    max_unavailable: int
    min_available: int


def parse_limit(value: Limit) -> tuple[int, bool]:
    """(number, is a percentage); ValueError when it is neither a count >= 0 nor 0% to 100%."""
    if isinstance(value, bool):
        raise ValueError
    if isinstance(value, int):
        if value < 0:
            raise ValueError
        return value, False
    match = _LIMIT.fullmatch(value.strip()) if isinstance(value, str) else None
    if match is None or (match[2] and int(match[1]) > 100):
        raise ValueError
    return int(match[1]), bool(match[2])


def _limits(key: str, given: Mapping[str, Limit] | None, default: Limit, models: Mapping[str, int],
            problems: list[str]) -> dict[str, tuple[int, bool]]:
    """Every model's parsed ``key`` (the default where not given); bad values become problems."""
    parsed: dict[str, tuple[int, bool]] = {}
    values = dict(given or {})
    for model in sorted(set(values) | set(models)):
        value = values.get(model, default)
        try:
            parsed[model] = parse_limit(value)
        except ValueError:
            problems.append(f"{key} for model {model}: expected a count >= 0 or a percentage from 0% to 100%,"
                            f" found {value!r}")
            continue
        if key == "max_unavailable" and parsed[model][0] == 0:
            problems.append(f"max_unavailable for model {model}: expected at least 1 (0 never takes a replica out),"
                            f" found {value!r}")
    return parsed


def _natural(name: str) -> tuple[str, str]:
    """A sort key comparing the numbers in a name as numbers (``r2`` before ``r10``)."""
    return _DIGITS.sub(lambda m: m[0].zfill(20), name), name


def _round_robin(units: Sequence[Unit], ready: Collection[str], changing: Collection[str]) -> list[Unit]:
    """Every unit in rollout order: models by name, round-robin; in a model, not ready first, then those whose
    release changes (a canary that keeps its release shows nothing of the new one), then those on the fewest nodes
    (the canary that restarts soonest, and holds the fewest GPUs if its release is bad), then by name."""
    by_model: dict[str, list[Unit]] = {}
    for unit in units:
        by_model.setdefault(unit.model, []).append(unit)
    queues = [sorted(by_model[m], key=lambda u: (u.name in ready, u.name not in changing, len(u.nodes),
                                                _natural(u.name)))
              for m in sorted(by_model)]
    return [q[rank] for rank in range(max(map(len, queues), default=0)) for q in queues if rank < len(q)]


def _waves(batch: Sequence[Unit], models: Mapping[str, _Model], down: set[Unit]) -> tuple[tuple[str, ...], ...]:
    """A batch's waves; ``down`` (the replicas not ready and not rolled yet) loses each wave's replicas."""
    left = list(batch)
    waves: list[tuple[str, ...]] = []
    while left:
        taken: set[Unit] = set()
        for model, limits in models.items():
            out = sum(1 for u in down if u.model == model)
            for unit in (u for u in left if u.model == model):
                if unit not in down:
                    if out + 1 > limits.max_unavailable or limits.replicas - out - 1 < limits.min_available:
                        break
                    out += 1
                taken.add(unit)
        # A model's replicas not ready come first, and once they are rolled its first ready replica fits (the
        # refusals guarantee it), so every wave takes at least one replica.
        waves.append(tuple(u.name for u in left if u in taken))
        left = [u for u in left if u not in taken]
        down -= taken
    return tuple(waves)


def plan_rollout(units: Sequence[Unit], batches: str = DEFAULT_BATCHES, *, ready: Collection[str],
                 max_unavailable: Mapping[str, Limit] | None = None,
                 min_available: Mapping[str, Limit] | None = None, changing: Collection[str] = ()) -> list[Batch]:
    """The batches to roll ``units`` in, canary first; raises :class:`RolloutError` with every problem found.

    ``ready``: the names of the replicas serving now; ``changing``: of the units whose release changes.
    ``max_unavailable``/``min_available``: per model name.
    """
    problems: list[str] = []
    try:
        items = parse_batches(batches)
    except RolloutError as exc:
        problems += exc.problems
        items = ()
    names = Counter(u.name for u in units)
    problems += [f"replica {name}: listed {n} times" for name, n in names.items() if n > 1]
    counts = Counter(u.model for u in units)
    max_out = _limits("max_unavailable", max_unavailable, DEFAULT_MAX_UNAVAILABLE, counts, problems)
    min_in = _limits("min_available", min_available, DEFAULT_MIN_AVAILABLE, counts, problems)
    models: dict[str, _Model] = {}
    for model, count in sorted(counts.items()):
        if model not in max_out or model not in min_in:
            continue
        (most, most_pct), (least, least_pct) = max_out[model], min_in[model]
        limits = _Model(count, max(1, most * count // 100) if most_pct else most,
                        -(-least * count // 100) if least_pct else least)
        serving = sum(1 for u in units if u.model == model and u.name in ready)
        if serving and serving - 1 < limits.min_available:
            shown = f"{least}% (= {limits.min_available})" if least_pct else str(least)
            problems.append(f"model {model}: {serving} of {count} replicas ready and min_available {shown}: taking"
                            f" one out leaves {serving - 1}, so it cannot roll without losing capacity")
        models[model] = limits
    if problems:
        raise RolloutError(problems)
    order = _round_robin(units, ready, changing)
    down = {u for u in units if u.name not in ready}
    plan: list[Batch] = []
    for size in batch_sizes(items, len(order)):
        batch, order = order[:size], order[size:]
        plan.append(Batch(_waves(batch, models, down)))
    return plan
