"""The multiple-choice knapsack under the automatic planner (:mod:`quantcore.planning.autoplan`; torch-free).

Solver
    Exact dynamic programming over a discretised KL budget: the budget is cut into
    ``resolution`` steps of ``kl_budget / resolution`` and every KL is rounded **up** to a
    whole number of steps, in exact rational arithmetic. The DP finds the cheapest plan
    whose rounded KLs fit; since rounding only ever increases a KL, the true predicted KL of
    the answer never exceeds the budget (conservative). The price of the rounding: the
    answer is at least as cheap as the best plan with KL <= ``kl_budget - n_units * step``
    (with the default 10,000 steps and 130 units, 1.3 % of the budget). When every KL is a
    whole number of steps the answer is exactly optimal. Time and memory:
    O(units * schemes * resolution) with numpy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

from quantcore.errors import PlanError

DEFAULT_KL_STEPS = 10_000  # budget resolution of the DP (steps of kl_budget / 10,000)
MAX_KL_STEPS = 1_000_000  # beyond this the DP tables grow past ~100 MB for large models
COST_TIE_RTOL = 1e-12  # plans whose costs differ by less than this (relative) count as equally cheap


def _steps(kl: float, budget: float, resolution: int) -> int | None:
    """ceil(kl / (budget / resolution)) exactly (rationals), or None when it cannot fit at all."""
    if budget == 0.0:
        return 0 if kl == 0.0 else None
    q = Fraction(kl) * resolution / Fraction(budget)
    w = -((-q.numerator) // q.denominator)
    return w if w <= resolution else None


def solve_mck(
    options: Sequence[Sequence[tuple[float, float]]], kl_budget: float, resolution: int = DEFAULT_KL_STEPS
) -> list[int]:
    """Multiple-choice knapsack: one option per unit, min sum of costs, sum of KLs <= kl_budget.

    ``options[u]`` lists ``(kl, cost)`` pairs of unit ``u``; returns the chosen option index
    per unit. KLs are rounded up to steps of ``kl_budget / resolution`` (exact rationals), so
    the chosen KLs always sum to <= kl_budget; among equally cheap answers (relative
    tolerance COST_TIE_RTOL) the one using the fewest budget steps wins. Raises PlanError
    when no choice fits (some unit has no option of KL 0 that fits, etc.).
    """
    if not math.isfinite(kl_budget) or kl_budget < 0:
        raise PlanError(f"the KL budget must be a finite number >= 0 (nats per token), got {kl_budget!r}")
    if not isinstance(resolution, int) or isinstance(resolution, bool) or not 1 <= resolution <= MAX_KL_STEPS:
        raise PlanError(f"resolution must be an integer in [1, {MAX_KL_STEPS}], got {resolution!r}")
    steps = 0 if kl_budget == 0.0 else resolution
    size = steps + 1
    dp = np.full(size, np.inf)
    dp[0] = 0.0
    choice = np.full((len(options), size), -1, dtype=np.int32)
    weights: list[list[int | None]] = []
    for u, opts in enumerate(options):
        ws = [_steps(kl, kl_budget, steps) for kl, _ in opts]
        weights.append(ws)
        new = np.full(size, np.inf)
        ch = np.full(size, -1, dtype=np.int32)
        # try cheaper budget use first so that, at equal cost, fewer steps win
        for j in sorted(range(len(opts)), key=lambda j: (ws[j] if ws[j] is not None else size, opts[j][1])):
            w = ws[j]
            if w is None:
                continue
            cand = np.full(size, np.inf)
            cand[w:] = dp[: size - w] + opts[j][1]
            better = cand < new
            new[better] = cand[better]
            ch[better] = j
        dp = new
        choice[u] = ch
    finite = np.isfinite(dp)
    if not finite.any():
        raise PlanError(
            f"no plan fits a KL budget of {kl_budget:g}: some unit has no scheme with a known KL that fits"
        )
    best = float(dp[finite].min())
    tol = COST_TIE_RTOL * max(abs(best), 1.0)
    b = int(np.flatnonzero(finite & (dp <= best + tol))[0])
    picked = [0] * len(options)
    for u in range(len(options) - 1, -1, -1):
        j = int(choice[u][b])
        picked[u] = j
        w = weights[u][j]
        assert w is not None  # a chosen option fits the budget
        b -= w
    return picked
