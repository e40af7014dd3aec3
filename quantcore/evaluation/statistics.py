"""Statistics of a score with their uncertainty: means ± standard error, percentiles, paired differences.

numpy only (no torch): the services, the CLI and the pages read these on stored scores without pulling torch in.

Every figure of a score is a mean or a quantile over the scored positions of ``S`` evaluation sequences, arrays
shaped ``[S, L-1]`` (one row per sequence, one column per predicted position).

Standard errors: per-sequence blocks
    The positions of one sequence are not independent draws: a passage the quantized model gets wrong stays wrong
    for many tokens, so per-token KLs along a sequence are correlated, and the textbook error ``std / sqrt(N)`` over
    all ``N = S (L-1)`` tokens understates the uncertainty (on real text by a factor of 2 to 5). Here each sequence is
    one independent block: the mean over all tokens equals the mean of the per-sequence means ``m_s`` (sequences of
    equal length), and its standard error is the standard error of those ``S`` means,

        err = std(m_1 .. m_S, ddof=1) / sqrt(S)

    which holds whatever the correlation inside a sequence is (a per-sequence block bootstrap gives the same value
    up to its resampling noise, at far more cost). With unequal lengths the ratio estimator is used:
    mean = sum(x) / sum(n), err = sqrt(S / (S-1) · sum((t_s - mean · n_s)²)) / sum(n), with ``t_s`` a sequence's sum
    and ``n_s`` its count (equal lengths reduce it to the formula above). With one sequence there is no error
    estimate: the error is None.

Derived figures
    ln(PPL_q / PPL_ref) = mean(nll_q - nll_ref): its error from the per-sequence means of that difference (the two
    perplexities are measured on the same tokens, so the difference is far sharper than either alone). Δp RMS =
    sqrt(mean(Δp²)); its error by the delta method, err(mean(Δp²)) / (2 RMS). "Same top p" is top-1 agreement, the
    mean of a 0/1 array, with the same block error.

Percentiles: numpy's default definition
    :data:`PERCENTILES` (llama.cpp's set: 99.9, 99, 95, 90, median, 10, 5, 1, 0.1) are ``numpy.percentile`` with its
    default ``method="linear"``: on the N sorted values ``v_0 <= ... <= v_{N-1}``, the p-th percentile is at
    fractional index ``h = (N-1) p / 100``, interpolated linearly between ``v_floor(h)`` and ``v_ceil(h)``.
    ``llama-perplexity --kl-divergence`` sorts and picks one element without interpolating (its index is rounded from
    ``p / 100 · N``), so on the same values the two may differ by up to one neighbouring value; on thousands of
    tokens the difference is below the figure's own uncertainty.

Paired difference
    Two scores on the same evaluation tokens (the same reference cache ``eval_key``) are compared sequence by
    sequence: ``d_s = a_s - b_s`` of their per-sequence means, the difference is ``mean(d)`` and its error
    ``std(d, ddof=1) / sqrt(S)``. The noise shared by the two plans (hard passages are hard for both) cancels, so the
    paired error is far smaller than ``sqrt(err_a² + err_b²)``. A difference is *distinguishable* when
    ``|diff| > Z · err`` (:data:`Z` = 2, about 95 % two-sided).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

Z = 2.0  # a difference is distinguishable beyond Z standard errors (two-sided, about 95 %)
# llama.cpp's percentile set, highest first, with the report keys they are stored under (kl_p999 ... kl_p001)
PERCENTILES: tuple[tuple[float, str], ...] = (
    (99.9, "p999"), (99.0, "p99"), (95.0, "p95"), (90.0, "p90"), (50.0, "p50"),
    (10.0, "p10"), (5.0, "p05"), (1.0, "p01"), (0.1, "p001"),
)
ONE_SEQUENCE = "one sequence: no error estimate"


@dataclass(frozen=True)
class Estimate:
    """A figure with its standard error; ``err`` None where there is no estimate (one sequence, or not stored)."""

    value: float
    err: float | None = None

    def text(self, fmt: str = ".4g", scale: float = 1.0) -> str:
        """'0.0367 ± 0.0021' (value and error times ``scale``); '0.0367 ± —' without an error."""
        err = "—" if self.err is None else format(self.err * scale, fmt)
        return f"{format(self.value * scale, fmt)} ± {err}"


def _rows(values: np.ndarray | Sequence[Sequence[float]]) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64)
    if arr.ndim == 1:
        arr = arr[None, :]
    if arr.ndim != 2 or arr.size == 0:
        raise ValueError(f"expected per-position values shaped [sequences, positions], got shape {arr.shape}")
    return arr


def block_mean(values: np.ndarray | Sequence[Sequence[float]],
               counts: Sequence[int] | None = None) -> Estimate:
    """Mean over every position of ``values`` ``[S, n]`` with its per-sequence block standard error.

    ``counts``: the number of valid positions of each row (the first ``counts[s]`` of row ``s``); None: every
    position of every row. Equal counts give ``std(row means, ddof=1) / sqrt(S)``; unequal ones the ratio estimator
    (see the module docstring). One sequence: ``err`` None."""
    arr = _rows(values)
    s = arr.shape[0]
    if counts is None:
        means = arr.mean(axis=1)
        mean = float(means.mean())
        return Estimate(mean, float(means.std(ddof=1) / math.sqrt(s)) if s > 1 else None)
    n = np.asarray(counts, dtype=np.float64)
    if n.shape != (s,) or (n < 1).any() or (n > arr.shape[1]).any():
        raise ValueError(f"counts must give 1..{arr.shape[1]} valid positions for each of the {s} sequences")
    totals = np.array([arr[i, : int(n[i])].sum() for i in range(s)])
    mean = float(totals.sum() / n.sum())
    if s < 2:
        return Estimate(mean, None)
    resid = totals - mean * n
    return Estimate(mean, float(math.sqrt(s / (s - 1) * float((resid**2).sum())) / n.sum()))


def sequence_means(values: np.ndarray | Sequence[Sequence[float]]) -> list[float]:
    """The mean of each sequence (row) of ``values`` ``[S, n]``: what a stored score keeps to be paired later."""
    return [float(x) for x in _rows(values).mean(axis=1)]


def percentiles(values: np.ndarray | Sequence[float]) -> dict[str, float]:
    """``{"max", "p999", "p99", "p95", "p90", "p50", "p10", "p05", "p01", "p001", "min"}`` of every value (any shape),
    by ``numpy.percentile``'s default linear interpolation (see the module docstring for llama.cpp's)."""
    flat = np.asarray(values, dtype=np.float64).reshape(-1)
    if flat.size == 0:
        raise ValueError("no values to take percentiles of")
    qs = np.percentile(flat, [p for p, _ in PERCENTILES])
    return {"max": float(flat.max()), **{key: float(q) for (_, key), q in zip(PERCENTILES, qs, strict=True)},
            "min": float(flat.min())}


def rms(values: np.ndarray | Sequence[Sequence[float]]) -> Estimate:
    """sqrt(mean(x²)) with its error by the delta method from the block error of mean(x²)."""
    sq = block_mean(_rows(values) ** 2)
    root = math.sqrt(sq.value)
    err = None if sq.err is None else (sq.err / (2 * root) if root > 0 else 0.0)
    return Estimate(root, err)


def paired_difference(a: Sequence[float], b: Sequence[float]) -> Estimate:
    """``mean(a - b)`` of two scores' per-sequence means on the same sequences, with the standard error of the
    per-sequence differences; ``err`` None for one sequence. Raises ValueError when the two are not the same size."""
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if x.ndim != 1 or x.shape != y.shape or x.size == 0:
        raise ValueError(f"paired sequences must match one for one: {x.size} against {y.size}")
    return block_mean((x - y)[:, None])


def independent_difference(a: Estimate, b: Estimate) -> Estimate:
    """``a - b`` of two figures measured on different tokens: the errors add in quadrature (None if either is)."""
    err = None if a.err is None or b.err is None else math.hypot(a.err, b.err)
    return Estimate(a.value - b.value, err)


def distinguishable(diff: Estimate, z: float = Z) -> bool:
    """Whether ``diff`` is told apart from 0: ``|value| > z · err``. Without an error (one sequence, old scores) any
    non-zero difference counts, as a point estimate."""
    return abs(diff.value) > z * (diff.err or 0.0)


def within(estimate: Estimate, budget: float, z: float = Z) -> bool | None:
    """Whether ``estimate`` is within ``budget``: True when ``value + z · err <= budget``, False when
    ``value - z · err > budget``, None when the budget lies inside the error (neither can be said). Without an
    error, the point estimate decides."""
    e = estimate.err or 0.0
    if estimate.value + z * e <= budget:
        return True
    if estimate.value - z * e > budget:
        return False
    return None


def sequences_to_settle(estimate: Estimate, budget: float, sequences: int, z: float = Z) -> int | None:
    """How many sequences in all would make ``budget`` fall outside ``value ± z · err``, assuming the error shrinks
    as 1 / sqrt(sequences) and the value stays: ``ceil(S · (z · err / |budget - value|)²)``; None when it cannot be
    settled (no error, or the value equals the budget)."""
    gap = abs(budget - estimate.value)
    if estimate.err is None or gap == 0.0 or sequences < 1:
        return None
    needed = sequences * (z * estimate.err / gap) ** 2
    return max(sequences, math.ceil(needed * (1 - 1e-12)))  # 64.00000000001 from rounding is 64


def distinguishable_front(costs: Sequence[float | None], losses: Sequence[float],
                          difference: Callable[[int, int], Estimate], z: float = Z) -> list[bool]:
    """Which plans are on a front drawn with error bars: ``costs`` exact (None / NaN: no cost, never on it), losses
    measured, ``difference(i, j)`` the estimate of ``loss_i - loss_j`` (paired where the two can be paired).

    First the point-estimate front (no other plan with a cost and a loss each at most its own, one strictly lower);
    then, walking it from the cheapest plan up, a plan stays on the front only when its loss is distinguishably lower
    (``difference < -z · err``) than that of every cheaper plan kept: a plan that costs more for a KL not told apart
    from a cheaper one's is not worth choosing. With no errors this is the point-estimate front."""

    def known(cost: float | None) -> bool:
        return cost is not None and cost == cost  # NaN != NaN

    n = len(costs)
    point = [
        known(costs[i]) and not any(
            known(costs[j]) and costs[j] <= costs[i] and losses[j] <= losses[i]  # type: ignore[operator]
            and (costs[j] < costs[i] or losses[j] < losses[i])  # type: ignore[operator]
            for j in range(n) if j != i)
        for i in range(n)
    ]
    order = sorted((i for i in range(n) if point[i]), key=lambda i: (costs[i], losses[i]))
    kept: list[int] = []
    out = [False] * n
    for i in order:
        cheaper = [j for j in kept if costs[j] < costs[i]]  # type: ignore[operator]
        if all(_lower(difference(i, j), z) for j in cheaper):
            kept.append(i)
            out[i] = True
    return out


def _lower(diff: Estimate, z: float) -> bool:
    return diff.value < 0 and distinguishable(diff, z)
