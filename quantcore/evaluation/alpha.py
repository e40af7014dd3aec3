"""Choosing SmoothQuant's α for the scheme that will be saved, from the stored calibration statistics alone.

numpy only (no torch, no pandas): the Outliers page imports it. For every α on a grid this module estimates how
much error the *planned* scheme (its weight and activation formats and scale granularities) adds to the output of
a smoothed layer, counts the channels that scheme flushes to zero, and suggests the α with the least estimated
error. One α applies to a whole fusion group (q/k/v, gate/up read one input and share one s), so a group's
suggestion minimises the group's summed error.

The error model (docs/guides/outliers.md "Choosing α")
-----------------------------------------------------
For ``Y = X W^T`` with smoothing ``s`` (``s_j = a_j^α / w_j^(1-α)`` as :mod:`quantcore.algorithms.smoothquant`
computes it, maxima clamped at 1e-5), the smoothed operands are ``X' = X / s`` and ``W' = W * s``. Quantizing
both adds noise ``E_x``, ``E_w`` and, to first order, ``Y_q - Y ≈ E_x W'^T + X' E_w^T``. With independent
rounding noise the mean squared error of one output is

    Σ_j ( var_x,j · E[W'_j²] + E[X'_j²] · var_w,j )

and it is reported relative to the signal ``Σ_j E[X_j²] E[W_j²]``, which smoothing leaves unchanged, so the figures
of the layers of a fusion group add up. The statistics hold maxima, so the spreads are modelled:

* weights: column j is N(0, σ_j²), ``w_j`` (the stored column max) being the level its N rows stay below half of the
  time (:func:`gaussian_max_level`); a row's scale comes from the median maximum of the row's smoothed values (of its
  group / block for those granularities), the whole-row picture the stored column maxima cannot give directly;
* activations: tokens fall into classes by the stored per-token maximum (:data:`TOKEN_CLASSES`: half at p50, 40 % at
  p90, ...). In a class with token maximum t, channel j's values are bounded by ``min(a_j, t)`` and taken as
  Gaussian, scaled so that the class's median token maximum is t; the level of every class's energies is then set
  from the |x| histogram's mean square (LLM activations are heavy-tailed: far smaller on average than Gaussian
  channels with those maxima). Per-token (and 1 x G group) scales are the class's smoothed token maximum,
  per-tensor scales the smoothed calibrated amax ``max_j(a_j / s_j)`` (static and dynamic alike);
* rounding noise of values of mean square ``e`` under scale ``S`` is ``S² · min(q² / 12, e / S²)``: the uniform
  noise of the step q (1 for integers, ``max(rms · 2^-mantissa, min_subnormal)`` for floats, whose step grows with
  the value), at most the values' own energy (a channel below half a step is flushed and loses exactly its signal).

Not modelled: o_proj's factors tied across the query heads of a kv head under grouped-query attention, GPTQ / AWQ
rounding. An outlier channel that fires on a few tokens only is counted as if it fired on the p99 class and above.

A channel counts as *flushed* when the largest value its scale sees is at or below half the smallest positive step:
the channel maximum ``a_j / s_j`` under a per-tensor scale (all tokens share it: the rule of
:func:`quantcore.evaluation.outliers.alpha_sweep`), the typical (p50) token's ``min(a_j, t) / s_j`` under per-token
and group scales, the column maximum ``w_j s_j`` against the typical row's scale for weights.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from quantcore.evaluation.outliers import DEFAULT_ALPHAS, smoothing_factors
from quantcore.evaluation.stats import LayerStats, hist_edges
from quantcore.formats.catalog import element_format, get_format
from quantcore.schemes.presets import SQ_DEFAULT_ALPHA, get_scheme
from quantcore.schemes.specs import Scheme, TensorSpec

# ---------------------------------------------------------------------------------------------
# Named constants
# ---------------------------------------------------------------------------------------------
ALPHA_GRID = DEFAULT_ALPHAS  # 0, 0.05, ..., 1: the α the page offers and the suggestion is searched over
WARN_ERROR_RATIO = 2.0  # warn before saving an α whose estimated error is over 2x the suggested α's
WARN_FLUSH_SHARE = 0.25  # ... or that flushes over a quarter of one operand's channels (more than the suggestion)
DEFAULT_NEW_PLAN_SCHEME = "INT8_W8A8"  # what plans_svc.save_layer_alpha gives a new plan
# Presets offered for a new plan on the Outliers page: their activations are quantized (smoothing has something to
# do), round to nearest (the model has no GPTQ / AWQ), and their α is set per layer by the save.
SMOOTHABLE_PRESETS = ("INT8_W8A8", "INT8_PER_TENSOR", "FP8_DYNAMIC", "FP8_PER_TENSOR", "FP8")

# (share of tokens, token_max key): the classes of tokens the activation error is averaged over (token_classes)
TOKEN_CLASSES = ((0.5, "p50"), (0.4, "p90"), (0.09, "p99"), (0.01, "max"))
TIE_RTOL = 0.01  # errors within 1 % of the least count as equal: the estimate is far coarser than that
_BISECTIONS = 24  # of log m in gaussian_max_level: its 14-octave bracket to ~1e-6 relative, far below the estimate's
#                   accuracy

_HIST_CENTRES = np.sqrt(hist_edges()[:-1] * hist_edges()[1:])  # geometric centre of every |x| histogram bin

SWEEP_COLUMNS = ("alpha", "error", "act_error", "weight_error", "act_flushed", "weight_flushed")


# ---------------------------------------------------------------------------------------------
# The planned scheme, as this estimate reads it
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Operand:
    """How one operand is scaled, as far as the estimate needs it.

    format:      the format name (a block format is read as its element format with its own block as the group)
    granularity: ``tensor``, ``channel``, ``token``, ``group`` or ``block``
    group:       channels along K that share one scale (``group`` / ``block``), else None
    """

    format: str
    granularity: str
    group: int | None = None

    @classmethod
    def of(cls, spec: TensorSpec) -> Operand:
        """The operand of a scheme's tensor spec."""
        fmt = get_format(spec.format)
        gran = str(getattr(spec.granularity, "value", spec.granularity))
        group: int | None = None
        if fmt.kind == "block":
            gran, group = "group", int(fmt.block_size or 0) or None
        elif gran == "group":
            group = spec.group_size
        elif gran == "block" and spec.block is not None:
            group = int(spec.block[1])  # (rows, cols): cols run along K
        return cls(spec.format, gran, group)


@dataclass(frozen=True)
class PlannedScheme:
    """The weight and activation operands of the scheme a saved α will smooth."""

    name: str
    weights: Operand
    activations: Operand

    @classmethod
    def of(cls, scheme: Scheme | str) -> PlannedScheme:
        """From a Scheme or a preset name; ValueError for a scheme that quantizes no activations or no weights
        (nothing for smoothing to trade between)."""
        sch = get_scheme(scheme)
        if sch.activations is None or sch.weights is None or sch.is_identity:
            raise ValueError(
                f"{sch.name} does not quantize both weights and activations, so SmoothQuant has nothing to balance; "
                f"choose a scheme that does, e.g. one of {', '.join(SMOOTHABLE_PRESETS)}"
            )
        return cls(sch.name, Operand.of(sch.weights), Operand.of(sch.activations))

    @property
    def label(self) -> str:
        """'INT8_W8A8 (int8 per-token activations, per-channel weights)' for pages."""
        a, w = self.activations, self.weights
        return f"{self.name} ({a.format} per-{a.granularity} activations, {w.format} per-{w.granularity} weights)"


# ---------------------------------------------------------------------------------------------
# Pieces of the estimate
# ---------------------------------------------------------------------------------------------
def token_classes(stat: LayerStats) -> list[tuple[float, float]]:
    """(share of tokens, their largest |x|) classes from the stored per-token max summary.

    The tokens up to the median stand at ``p50``, the next 40 % at ``p90``, the next 9 % at ``p99`` and the top 1 %
    at ``max`` (each class at its upper quantile: on the pessimistic side). A summary without the keys falls back to
    one class at the layer's amax (every token as large as the largest).
    """
    tm = stat.token_max
    classes = [(share, float(tm[key])) for share, key in TOKEN_CLASSES if key in tm]
    if len(classes) != len(TOKEN_CLASSES):
        return [(1.0, stat.amax)]
    return classes


def hist_mean_square(stat: LayerStats) -> float:
    """Mean of x² over every calibrated input value, from the |x| histogram (bins at their geometric centre, exact
    zeros counted); 0 without a histogram."""
    counts = np.asarray(stat.hist_counts, dtype=np.float64)
    total = counts.sum() + float(stat.zeros)
    if counts.size != _HIST_CENTRES.size or total <= 0:
        return 0.0
    return float(np.dot(counts, _HIST_CENTRES**2) / total)


def _erfc(x: np.ndarray) -> np.ndarray:
    """erfc(x) for x >= 0 (Abramowitz & Stegun 7.1.26, absolute error < 1.5e-7): numpy has none, scipy is no
    dependency of quantcore."""
    t = 1.0 / (1.0 + 0.3275911 * x)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    return poly * np.exp(-x * x)


def gaussian_max_level(sigmas: np.ndarray, prob: float = 0.5) -> float:
    """The level m that the largest magnitude of independent values N(0, sigma_j²) stays below with ``prob``.

    Solves ``Σ_j log(1 - erfc(m / (sigma_j √2))) = log(prob)`` by bisection on log m. With the default 0.5: the
    median maximum of one row of values with these spreads; one dominant spread gives about 0.67 times it, K equal
    spreads σ about σ times the (1/2)^(1/K) two-sided normal quantile.
    """
    sig = np.asarray(sigmas, dtype=np.float64)
    sig = sig[sig > 0]
    if sig.size == 0:
        return 0.0
    target = math.log(prob)
    lo, hi = float(sig.max()) * 1e-3, float(sig.max()) * 20.0
    for _ in range(_BISECTIONS):
        mid = math.sqrt(lo * hi)
        inside = np.clip(1.0 - _erfc(mid / (sig * math.sqrt(2.0))), 1e-300, 1.0)
        if float(np.log(inside).sum()) < target:
            lo = mid
        else:
            hi = mid
    return math.sqrt(lo * hi)


@lru_cache(maxsize=64)
def _unit_max_level(n: int) -> float:
    """:func:`gaussian_max_level` of n N(0, 1) draws (a model has a handful of output widths: kept)."""
    return max(gaussian_max_level(np.ones(n)), 1e-12)


def _noise(fmt_name: str, energy: np.ndarray, scale_amax: np.ndarray) -> np.ndarray:
    """Rounding-noise variance of values with mean square ``energy`` under scales set from ``scale_amax``.

    ``S² · min(q² / 12, energy / S²)`` (module docstring): uniform noise of the step q, at most the values' own
    energy (a value below half a step is flushed and loses exactly itself).
    """
    elem = element_format(fmt_name)
    scale = np.asarray(scale_amax, dtype=np.float64) / float(elem.max)
    with np.errstate(divide="ignore", invalid="ignore"):
        u2 = np.where(scale > 0, energy / scale**2, 0.0)
    if elem.kind == "int":
        q2 = np.ones_like(u2)
    else:
        q2 = np.maximum(u2 * 4.0 ** -int(elem.man_bits), float(elem.min_subnormal) ** 2)
    return scale**2 * np.minimum(q2 / 12.0, u2)


def _flushed(fmt_name: str, magnitude: np.ndarray, scale_amax: np.ndarray) -> np.ndarray:
    """Whether ``magnitude`` is at or below half the smallest positive value under scales from ``scale_amax``."""
    elem = element_format(fmt_name)
    half_min = float(elem.min_subnormal) / 2.0 * np.asarray(scale_amax, dtype=np.float64) / float(elem.max)
    return np.asarray(magnitude, dtype=np.float64) <= half_min


def _group_max(values: np.ndarray, group: int | None) -> np.ndarray:
    """For every channel, the largest value of its scale's extent along K: all of K without a group."""
    if values.size == 0:
        return values
    if not group or group >= values.size:
        return np.full(values.shape, values.max())
    pad = (-values.size) % group
    tiles = np.pad(values, (0, pad)).reshape(-1, group).max(axis=1)
    return np.repeat(tiles, group)[: values.size]


def _row_max(sigmas: np.ndarray, group: int | None) -> np.ndarray:
    """For every column, the typical maximum of a weight row's values that share its scale (:func:`gaussian_max_level`
    over the row, or over the row's group / block of columns)."""
    if sigmas.size == 0:
        return sigmas
    if not group or group >= sigmas.size:
        return np.full(sigmas.shape, gaussian_max_level(sigmas))
    pad = (-sigmas.size) % group
    tiles = np.pad(sigmas, (0, pad)).reshape(-1, group)
    return np.repeat([gaussian_max_level(t) for t in tiles], group)[: sigmas.size]


@dataclass(frozen=True)
class LayerEstimate:
    """The estimate for one layer at one α: relative error of its output (activation and weight parts) and the
    shares of its activation channels and weight columns flushed to zero."""

    act_error: float
    weight_error: float
    act_flushed: float
    weight_flushed: float

    @property
    def error(self) -> float:
        """Total estimated relative output error (mean squared, over the signal)."""
        return self.act_error + self.weight_error


@dataclass(frozen=True)
class TokenClass:
    """One class of tokens of a layer's input (before smoothing): its share of the tokens, every channel's bound
    (largest value) and Gaussian spread tau; ``level`` scales tau² to the measured mean square (module docstring)."""

    share: float
    bound: np.ndarray
    tau: np.ndarray
    level: float


def activation_classes(stat: LayerStats) -> list[TokenClass]:
    """The token classes of :func:`token_classes`, with each channel's bound and spread (independent of α)."""
    a = np.asarray(stat.channel_max, dtype=np.float64)
    rows = []
    for share, tmax in token_classes(stat):
        bound = np.minimum(a, max(tmax, 0.0))  # this class's largest value in each channel
        # channel j ~ N(0, tau_j²), tau ∝ bound, scaled so that the class's token max is its stored one: tmax
        level = gaussian_max_level(bound)
        rows.append((share, bound, bound * (tmax / level) if level > 0 else bound))
    # the energies' level from the |x| histogram where there is one: LLM activations are heavy-tailed, their mean
    # square far below what Gaussian channels with these maxima would have
    gaussian_ms = sum(share * float(np.mean(tau**2)) for share, _, tau in rows)
    measured_ms = hist_mean_square(stat)
    level_fix = measured_ms / gaussian_ms if measured_ms > 0 and gaussian_ms > 0 else 1.0
    return [TokenClass(share, bound, tau, level_fix) for share, bound, tau in rows]


def layer_estimate(stat: LayerStats, s: np.ndarray, scheme: PlannedScheme,
                   classes: Sequence[TokenClass] | None = None) -> LayerEstimate:
    """The estimate of one layer (its statistics) smoothed by ``s`` (the group's, [K]) under ``scheme``.

    classes: :func:`activation_classes` of ``stat``, when the caller has them already (a sweep computes them once).
    See the module docstring for the model.
    """
    a = np.asarray(stat.channel_max, dtype=np.float64)
    w = np.asarray(stat.weight_channel_max, dtype=np.float64)
    s = np.asarray(s, dtype=np.float64)
    if not (a.shape == w.shape == s.shape):
        raise ValueError(f"channel_max, weight_channel_max and s differ in shape: {a.shape}, {w.shape}, {s.shape}")
    if a.size == 0:
        return LayerEstimate(0.0, 0.0, 0.0, 0.0)
    act, wop = scheme.activations, scheme.weights
    # weights: W_nj ~ N(0, sigma_j²), the column max w_j the level its N rows stay below half of the time
    sigma = w / _unit_max_level(max(stat.out_features, 1))
    w_energy = (sigma * s) ** 2
    w_group = wop.group if wop.granularity in ("group", "block") else None
    row_amax = _row_max(sigma * s, w_group)
    w_var = _noise(wop.format, w_energy, row_amax)
    w_flush = _flushed(wop.format, w * s, row_amax)
    act_err = weight_err = signal = 0.0
    act_flush = np.zeros(a.shape, dtype=bool)
    a_group = act.group if act.granularity == "group" else None
    for i, cls in enumerate(activation_classes(stat) if classes is None else classes):
        share, bound, tau = cls.share, cls.bound, cls.tau
        energy = cls.level * (tau / s) ** 2
        if act.granularity == "tensor":
            amax = np.full(a.shape, float((a / s).max()))  # every token on the calibrated (smoothed) amax
            flush = _flushed(act.format, a / s, amax)  # ... so a channel is lost when even its max flushes
        else:
            amax = _row_max(tau / s, a_group)  # the token's (or its tile's) own max after smoothing
            flush = _flushed(act.format, bound / s, amax)
        if i == 0:
            act_flush = flush  # the typical token's
        act_err += share * float(np.sum(_noise(act.format, energy, amax) * w_energy))
        weight_err += share * float(np.sum(energy * w_var))
        signal += share * float(np.sum(energy * w_energy))
    if signal <= 0:
        return LayerEstimate(0.0, 0.0, float(np.mean(act_flush)), float(np.mean(w_flush)))
    return LayerEstimate(act_err / signal, weight_err / signal, float(np.mean(act_flush)), float(np.mean(w_flush)))


# ---------------------------------------------------------------------------------------------
# The sweep and the suggestion
# ---------------------------------------------------------------------------------------------
def group_factors(members: Sequence[LayerStats], alpha: float) -> np.ndarray:
    """The one s of a fusion group, as :func:`quantcore.algorithms.smoothquant.smooth_model` computes it: from the
    elementwise max of the members' input maxima and of their weight column maxima (their weights stacked)."""
    a = np.max([np.asarray(m.channel_max, dtype=np.float64) for m in members], axis=0)
    w = np.max([np.asarray(m.weight_channel_max, dtype=np.float64) for m in members], axis=0)
    return smoothing_factors(a, w, alpha)


def alpha_error_sweep(
    members: Sequence[LayerStats] | LayerStats,
    scheme: PlannedScheme | Scheme | str,
    alphas: Sequence[float] | np.ndarray = ALPHA_GRID,
) -> dict[str, np.ndarray]:
    """For each α, the estimate for a layer or a fusion group (members share one s) under ``scheme``.

    Columns (:data:`SWEEP_COLUMNS`): alpha; error, act_error, weight_error: the members' relative output errors
    summed; act_flushed: share of the input's channels flushed (one input for the group; the largest share over
    members); weight_flushed: share of weight columns flushed, over all members' columns.
    """
    group = [members] if isinstance(members, LayerStats) else list(members)
    if not group:
        raise ValueError("alpha_error_sweep needs at least one layer's statistics")
    planned = scheme if isinstance(scheme, PlannedScheme) else PlannedScheme.of(scheme)
    cols: dict[str, list[float]] = {c: [] for c in SWEEP_COLUMNS}
    classes = [activation_classes(m) for m in group]
    for alpha in alphas:
        s = group_factors(group, float(alpha))
        parts = [layer_estimate(m, s, planned, c) for m, c in zip(group, classes, strict=True)]
        sizes = np.array([m.channel_max.size for m in group], dtype=np.float64)
        cols["alpha"].append(float(alpha))
        cols["error"].append(sum(p.error for p in parts))
        cols["act_error"].append(sum(p.act_error for p in parts))
        cols["weight_error"].append(sum(p.weight_error for p in parts))
        cols["act_flushed"].append(max(p.act_flushed for p in parts))
        cols["weight_flushed"].append(float(np.dot([p.weight_flushed for p in parts], sizes) / sizes.sum())
                                      if sizes.sum() else 0.0)
    return {k: np.asarray(v, dtype=np.float64) for k, v in cols.items()}


def suggested_alpha(sweep: dict[str, np.ndarray]) -> float:
    """The α of the sweep with the least estimated error.

    α whose error is within :data:`TIE_RTOL` of the least are a tie the estimate cannot break (FP8's relative
    rounding makes the curve nearly flat; identical channels make it exactly flat): of those, the one nearest the
    usual α = 0.5 (SmoothQuant's default, the presets' α) is suggested.
    """
    errors = np.asarray(sweep["error"], dtype=np.float64)
    alphas = np.asarray(sweep["alpha"], dtype=np.float64)
    if errors.size == 0 or not np.isfinite(errors).any():
        raise ValueError("a sweep without a finite error has no suggestion")
    best = float(np.nanmin(errors))
    tied = np.flatnonzero(errors <= best * (1.0 + TIE_RTOL))
    return float(alphas[tied[int(np.argmin(np.abs(alphas[tied] - SQ_DEFAULT_ALPHA)))]])


def suggest_alpha(
    members: Sequence[LayerStats] | LayerStats,
    scheme: PlannedScheme | Scheme | str,
    alphas: Sequence[float] | np.ndarray = ALPHA_GRID,
) -> float:
    """The suggested α of a layer or fusion group under ``scheme``: argmin of :func:`alpha_error_sweep`'s error."""
    return suggested_alpha(alpha_error_sweep(members, scheme, alphas))


def _row(sweep: dict[str, np.ndarray], alpha: float) -> int:
    return int(np.argmin(np.abs(np.asarray(sweep["alpha"], dtype=np.float64) - float(alpha))))


def alpha_warning(sweep: dict[str, np.ndarray], alpha: float) -> str | None:
    """Why saving ``alpha`` is a bad idea by the sweep's own figures, or None.

    Rule: warn when the estimated error at ``alpha`` is over :data:`WARN_ERROR_RATIO` times the suggested α's, or
    when ``alpha`` flushes over :data:`WARN_FLUSH_SHARE` of the activation channels or weight columns and more than
    the suggested α does. ``alpha`` is read at the nearest α of the sweep.
    """
    best = _row(sweep, suggested_alpha(sweep))
    here = _row(sweep, alpha)
    err, best_err = float(sweep["error"][here]), float(sweep["error"][best])
    picked, suggested = float(sweep["alpha"][here]), float(sweep["alpha"][best])
    reasons = []
    if best_err > 0 and err > WARN_ERROR_RATIO * best_err:
        reasons.append(f"its estimated error is {err / best_err:,.1f}× that of the suggested α = {suggested:.2f}")
    elif best_err == 0 and err > 0:
        reasons.append(f"it has an estimated error where the suggested α = {suggested:.2f} has none")
    for column, what in (("weight_flushed", "weight columns"), ("act_flushed", "activation channels")):
        share, at_best = float(sweep[column][here]), float(sweep[column][best])
        if share > WARN_FLUSH_SHARE and share > at_best:
            reasons.append(f"it flushes {share:.0%} of the {what} to zero (the suggested α: {at_best:.0%})")
    if not reasons:
        return None
    return f"α = {picked:.2f} looks bad for this scheme: " + "; ".join(reasons) + "."
