"""``kvpack eval --plan KL_BUDGET``: the fewest-bits per-layer plan that meets a KL budget, verified.

1. The per-layer sensitivity sweep (:func:`~kvpack.evaluation.attribution.layer_sensitivity`) gives each
   layer's attention-output error for every format of the ladder (narrowest first, e.g. ``int4, int8``).
2. Greedy order: start with the narrowest format everywhere and repeatedly move the layer with the largest
   current error one rung up the ladder. That gives a sequence of plans from fewest to most bits.
3. Binary search along that sequence for the first plan whose mean teacher-forced KL (the real cache, the
   same text for every candidate) is within the budget. Each probe is a real measurement; the chosen plan is
   one of them, so its KL is measured, never predicted.

The search assumes KL falls as layers widen; it usually does, and a probe that breaks the assumption only makes
the chosen plan wider than needed, never one that misses the budget.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpack.errors import ConfigError
from kvpack.formats import KVFormat
from kvpack.plans import LayerPlan

__all__ = ["PlanSearch", "greedy_plans", "plan_from_layers", "search_plan"]


def plan_from_layers(formats: Sequence[KVFormat], prefer: Sequence[KVFormat] = ()) -> LayerPlan:
    """The plan whose layer ``i`` has ``formats[i]``: the most common format is the base (on a tie, the first
    of ``prefer``, else the first to appear)."""
    counts: dict[KVFormat, int] = {}
    for f in formats:
        counts[f] = counts.get(f, 0) + 1
    order = [*prefer, *counts]
    base = max(counts, key=lambda f: (counts[f], -order.index(f)))
    overrides = []
    for f in counts:
        if f != base:
            overrides.append((f, frozenset(i for i, g in enumerate(formats) if g == f)))
    return LayerPlan(base, tuple(overrides))


def greedy_plans(ladder: Sequence[KVFormat], errors: Sequence[Sequence[float]]) -> list[LayerPlan]:
    """Plans from the narrowest format everywhere to the widest everywhere, one layer one rung up per step.

    Args:
        ladder: formats, narrowest first.
        errors: ``errors[r][layer]``: the attention-output error of ``ladder[r]`` in that layer alone.

    Returns:
        ``1 + layers * (len(ladder) - 1)`` plans; the first is ``ladder[0]`` everywhere.
    """
    n = len(errors[0])
    rung = [0] * n
    plans = [plan_from_layers([ladder[0]] * n, ladder)]
    while True:
        open_layers = [i for i in range(n) if rung[i] < len(ladder) - 1]
        if not open_layers:
            return plans
        worst = max(open_layers, key=lambda i: (errors[rung[i]][i], -i))
        rung[worst] += 1
        plans.append(plan_from_layers([ladder[r] for r in rung], ladder))


@dataclass
class PlanSearch:
    """What the search measured: ``probes`` (plan, bits, mean KL) in the order measured, ``chosen`` (the fewest-bits
    probe within the budget, or ``None`` when even the widest plan misses it)."""

    budget: float
    ladder: list[str]
    probes: list[dict[str, Any]] = field(default_factory=list)
    chosen: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"budget": self.budget, "ladder": self.ladder, "probes": self.probes, "chosen": self.chosen}


def search_plan(
    plans: Sequence[LayerPlan],
    kl_of: Callable[[LayerPlan], float],
    bits_of: Callable[[LayerPlan], float],
    budget: float,
    ladder: Sequence[KVFormat],
) -> PlanSearch:
    """Binary search of ``plans`` (fewest bits first) for the first within ``budget`` (``kl_of`` measures one).

    Raises:
        ConfigError: ``budget`` is not a positive number.
    """
    if not budget > 0:
        raise ConfigError(f"the KL budget must be a positive number of nats, e.g. 0.005; got {budget!r}")
    result = PlanSearch(budget, [f.name for f in ladder])
    measured: dict[int, float] = {}

    def probe(i: int) -> float:
        if i not in measured:
            measured[i] = kl_of(plans[i])
            result.probes.append({"plan": plans[i].name, "bits": bits_of(plans[i]), "kl_mean": measured[i]})
        return measured[i]

    lo, hi = 0, len(plans) - 1
    if probe(hi) > budget:
        return result  # even the widest plan misses: nothing to choose
    if probe(lo) <= budget:
        hi = lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if probe(mid) <= budget:
            hi = mid
        else:
            lo = mid
    result.chosen = next(p for p in result.probes if p["plan"] == plans[hi].name)
    return result
