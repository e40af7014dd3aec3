"""How far the fast sensitivity estimate can be trusted: rank agreement with the exact sweep, and the correction from
a plan's predicted KL (the sum of its units' estimates) to its measured KL.

Torch-free (numpy only): the pages and services read these figures without loading the numeric stack.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation of two equally long sequences (ties get their mean rank); NaN under 2 values or
    where one side is constant."""
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if x.shape != y.shape:
        raise ValueError(f"spearman needs two sequences of one length, got {x.shape[0]} and {y.shape[0]}")
    if x.size < 2:
        return math.nan
    rx, ry = _ranks(x), _ranks(y)
    sx, sy = rx.std(), ry.std()
    if sx == 0 or sy == 0:
        return math.nan
    return float(((rx - rx.mean()) * (ry - ry.mean())).mean() / (sx * sy))


def _ranks(v: np.ndarray) -> np.ndarray:
    order = np.argsort(v, kind="mergesort")
    ranks = np.empty(v.size, dtype=np.float64)
    ranks[order] = np.arange(v.size, dtype=np.float64)
    values, counts = np.unique(v, return_counts=True)
    for value in values[counts > 1]:
        tied = v == value
        ranks[tied] = ranks[tied].mean()
    return ranks


# ---------------------------------------------------------------------- predicted -> measured

MIN_VERIFICATIONS = 1  # a correction rests on at least this many verified plans
MAX_FACTOR = 10.0  # a fitted factor is kept within [1 / MAX_FACTOR, MAX_FACTOR] (a stray score cannot run away)


@dataclass(frozen=True)
class Correction:
    """measured KL ≈ ``factor`` × predicted KL, fitted over ``verifications`` automatic plans whose prediction (the
    sum of their units' KLs) was checked by a score: the interaction between the units' errors (and, for Fisher
    estimates, the estimate's own bias) that the sum of units leaves out.

    factor:        the geometric mean of measured / predicted over the verifications (each weighed alike)
    spread:        the geometric standard deviation of that ratio (1.0 with one verification): how far a single plan
                   strays from the fitted factor
    verifications: how many verified plans it rests on
    """

    factor: float
    spread: float
    verifications: int

    def corrected(self, predicted: float) -> float:
        """The measured KL to expect for a plan predicted at ``predicted``."""
        return self.factor * predicted

    def search_budget(self, kl_budget: float) -> float:
        """The budget for the sum of units' KLs under which the corrected prediction stays within ``kl_budget``."""
        return kl_budget / self.factor

    def text(self) -> str:
        """'measured ≈ 1.31 × predicted (× / ÷ 1.12), from 4 verified plans'."""
        plural = "s" if self.verifications != 1 else ""
        return (f"measured ≈ {self.factor:.3g} × predicted (× / ÷ {self.spread:.3g}), from {self.verifications} "
                f"verified plan{plural}")


def fit_correction(pairs: Sequence[tuple[float, float]]) -> Correction | None:
    """The :class:`Correction` of (predicted KL, measured KL) ``pairs``; None with fewer than
    :data:`MIN_VERIFICATIONS` usable pairs (both figures positive and finite)."""
    ratios = [math.log(m / p) for p, m in pairs
              if math.isfinite(p) and math.isfinite(m) and p > 0 and m > 0]
    if len(ratios) < MIN_VERIFICATIONS:
        return None
    mean = sum(ratios) / len(ratios)
    sd = math.sqrt(sum((r - mean) ** 2 for r in ratios) / (len(ratios) - 1)) if len(ratios) > 1 else 0.0
    bound = math.log(MAX_FACTOR)
    return Correction(factor=math.exp(min(max(mean, -bound), bound)), spread=math.exp(sd),
                      verifications=len(ratios))
