"""The rollout's batches and waves (gpufleet/rollout/batches.py): cases as data, and random fleets.

Each case (tests/data/rollout_cases/*.yml) gives ``replicas`` (``[name, model]`` or ``[name, model, [nodes]]``),
optionally ``ready`` (names; all when left out), ``changing`` (the names whose release changes), ``batches``,
``max_unavailable`` and ``min_available`` (per model; the defaults when left out), and either ``expect`` (batches,
each a list of waves, each a list of names) or ``problems`` (the lines the refusal must hold, in order).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpufleet.rollout.batches import (
    DEFAULT_BATCHES,
    Batch,
    Limit,
    RolloutError,
    Unit,
    parse_batches,
    plan_rollout,
)
from tests.conftest import DATA

CASES = sorted((DATA / "rollout_cases").glob("*.yml"))
CASE_KEYS = {"replicas", "ready", "changing", "batches", "max_unavailable", "min_available", "expect", "problems"}


def _unit(item: list[Any]) -> Unit:
    name, model, *nodes = item
    return Unit(name, model, tuple(nodes[0]) if nodes else (name,))


def _waves(plan: list[Batch]) -> list[list[list[str]]]:
    return [[list(wave) for wave in batch.waves] for batch in plan]


def test_there_are_enough_cases() -> None:
    assert len(CASES) >= 15


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_case(path: Path) -> None:
    case = yaml.safe_load(path.read_text())
    assert set(case) <= CASE_KEYS and ("expect" in case) != ("problems" in case), f"{path.name}: bad case"
    units = [_unit(item) for item in case["replicas"]]
    ready = set(case["ready"]) if "ready" in case else {u.name for u in units}

    def run() -> list[Batch]:
        return plan_rollout(units, case.get("batches", DEFAULT_BATCHES), ready=ready,
                            max_unavailable=case.get("max_unavailable"), min_available=case.get("min_available"),
                            changing=set(case.get("changing", ())))

    if "problems" in case:
        with pytest.raises(RolloutError) as refused:
            run()
        assert refused.value.problems == case["problems"]
        assert str(refused.value) == "\n".join(case["problems"])
    else:
        assert _waves(run()) == case["expect"]


def test_the_default_spec_parses() -> None:
    assert [(i.count, i.percent) for i in parse_batches(DEFAULT_BATCHES)] == [(1, False), (25, True), (100, True)]


# --- random fleets --------------------------------------------------------------------------------------------

def _resolve(value: Limit, count: int, up: bool) -> int:
    """The test's own reading of a limit: a count, or a percentage of ``count`` rounded up or down (at least 1)."""
    if isinstance(value, int):
        return value
    share = int(value.rstrip("%")) * count
    return -(-share // 100) if up else max(1, share // 100)


def _random_fleet(rng: random.Random) -> tuple[list[Unit], set[str], str, dict[str, Limit], dict[str, Limit]]:
    units: list[Unit] = []
    for m in range(rng.randint(1, 4)):
        for r in range(rng.randint(1, 9)):
            width = rng.choice([1, 1, 1, 2, 4])
            units.append(Unit(f"m{m}-r{r}", f"model-{m}", tuple(f"m{m}-r{r}-n{k}" for k in range(width))))
    rng.shuffle(units)
    ready = {u.name for u in units if rng.random() < 0.8}
    spec = ",".join(rng.choice(["1", "2", "3", "10%", "25%", "50%", "100%"]) for _ in range(rng.randint(1, 4)))
    models = sorted({u.model for u in units})
    most_choices: list[Limit] = [1, 2, 3, "25%", "50%", "100%"]
    least_choices: list[Limit] = [0, 1, 2, "0%", "50%", "75%"]
    most = {m: rng.choice(most_choices) for m in models if rng.random() < 0.7}
    least = {m: rng.choice(least_choices) for m in models if rng.random() < 0.7}
    return units, ready, spec, most, least


def _expected_sizes(spec: str, total: int) -> list[int]:
    sizes: list[int] = []
    items = [item.strip() for item in spec.split(",")]
    while sum(sizes) < total:
        item = items[min(len(sizes), len(items) - 1)]
        size = max(1, -(-int(item[:-1]) * total // 100)) if item.endswith("%") else int(item)
        sizes.append(min(size, total - sum(sizes)))
    return sizes


@pytest.mark.parametrize("seed", range(300))
def test_random_fleets_roll_every_replica_once_within_the_limits(seed: int) -> None:
    rng = random.Random(seed)
    units, ready, spec, most, least = _random_fleet(rng)
    count = {m: sum(1 for u in units if u.model == m) for m in {u.model for u in units}}
    max_out = {m: _resolve(most.get(m, 1), n, up=False) for m, n in count.items()}
    min_in = {m: _resolve(least.get(m, 1), n, up=True) for m, n in count.items()}
    serving = {m: sum(1 for u in units if u.model == m and u.name in ready) for m in count}
    stuck = sorted(m for m in count if serving[m] and serving[m] - 1 < min_in[m])
    try:
        plan = plan_rollout(units, spec, ready=ready, max_unavailable=most, min_available=least)
    except RolloutError as refused:
        assert stuck, f"refused a fleet that can roll: {refused.problems}"
        assert [p.split(":")[0] for p in refused.problems] == [f"model {m}" for m in stuck]
        return
    assert not stuck, f"rolled {stuck} although taking one out loses capacity"
    rolled = [name for batch in plan for name in batch.replicas]
    assert sorted(rolled) == sorted(u.name for u in units)
    assert [len(batch.replicas) for batch in plan] == _expected_sizes(spec, len(units))
    model_of = {u.name: u.model for u in units}
    down = {u.name for u in units if u.name not in ready}
    for wave in (wave for batch in plan for wave in batch.waves):
        assert wave
        for model in {model_of[name] for name in wave}:
            out = {n for n in down if model_of[n] == model} | {n for n in wave if model_of[n] == model}
            if any(n not in down for n in wave if model_of[n] == model):  # takes a serving replica out
                assert len(out) <= max_out[model], f"{wave}: {len(out)} of {model} out, max {max_out[model]}"
                assert count[model] - len(out) >= min_in[model], f"{wave}: {model} below {min_in[model]}"
        down -= set(wave)
