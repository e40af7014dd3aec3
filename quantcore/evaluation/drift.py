"""Outlier drift: two calibrations of models of one architecture (a base and its fine-tune), layer by layer.

numpy only (no torch): the services, the CLI and the pages read this on stored statistics.

Fine-tunes move outliers (``shared/reference``, "Interaction with post-trained models"): the activation outlier
channels are a property of the trained network, and fine-tuning can grow, shrink or move them, so smoothing factors
and static scales calibrated on the base are wrong for the fine-tune. This module says where, from the per-channel
maxima both calibrations stored (:class:`quantcore.evaluation.stats.LayerStats`):

Per layer (:func:`layer_drift`)
    the outlier ratio of each (max channel / median channel), the outlier channels of each (a channel whose max is
    at least :data:`OUTLIER_FACTOR` times the layer's median channel), the channels that *appeared* (outliers of B
    only) or are *gone* (outliers of A only): together, outliers that moved; and among the outlier channels of
    either, those that *grew* or *shrank* by at least :data:`CHANGE_FACTOR` from A to B.

Calibrated on A, served on B (:func:`transfer`)
    SmoothQuant: ``s_j = max|X_j|^α / max|W_j|^(1-α)`` (the weight maxima of a fusion group's members taken
    together, as they share the input and the fold). With A's factors on B, B's input is divided by ``s_A`` and B's
    weights multiplied by it. The smoothed ranges ``max_j(x_B,j / s_A,j)`` and ``max_j(w_B,j · s_A,j)`` are compared
    with those of factors recalibrated on B: a ratio above 1 is range the stale factors waste (the per-token or
    per-tensor step grows by that factor: log2 of it, in bits of the format's levels); the channels whose smoothed
    max on B exceeds the smoothed amax A's calibration saw are *under-smoothed*: an outlier the factors no longer
    tame.

    Static activation scale: one amax per tensor, calibrated on A (of the smoothed input where the scheme smooths,
    as :func:`quantcore.algorithms.apply` sets it). B's live max above it by more than :data:`CLIP_MARGIN` *clips*
    (a tenth of the range or more saturates: a few values just past the calibrated max, which any new text brings,
    are not called clipping; ``overshoot`` says by how much either way; the share of B's calibrated values that
    saturate at all is read from B's |x| histogram where the input is not smoothed; the channels past the margin are
    listed either way); B's live max below it by :data:`WASTE_FACTOR` or more *wastes range*:
    ``log2(amax_A / max_B)`` bits of the format's levels go unused.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from quantcore.evaluation.outliers import SMOOTHQUANT_EPS, fraction_above, smoothing_factors
from quantcore.evaluation.stats import LayerStats, outlier_ratio
from quantcore.schemes.fusion import fusion_groups

OUTLIER_FACTOR = 10.0  # an outlier channel: its max at least 10x the layer's median channel max
CHANGE_FACTOR = 2.0  # an outlier channel grew / shrank when its max changed by at least 2x
WASTE_FACTOR = 2.0  # a scale wastes range when the live max is at most half of what it was set for (1 bit)
CLIP_MARGIN = 1.1  # a static scale clips when the live max exceeds its amax by more than a tenth of the range
TOP_CHANNELS = 10  # channels listed per layer and kind, largest change first
DEFAULT_ALPHA = 0.5  # the what-if SmoothQuant strength where no plan says one (the paper's default)


class DriftError(ValueError):
    """Two calibrations that cannot be compared layer by layer (no layer in common, different widths)."""


@dataclass(frozen=True)
class LayerDrift:
    """How one layer's input moved from calibration A to calibration B.

    ratio_a, ratio_b: outlier ratios (max / median channel max); amax_a, amax_b: the largest |x| of each
    outliers_a, outliers_b: outlier channels of each (largest first, at most TOP_CHANNELS), n_outliers_*: how many
    appeared / gone: outlier channels of B only / of A only (moved); grew / shrank: outlier channels of either whose
    max changed by CHANGE_FACTOR or more (largest change first), each as (channel, max_a, max_b)
    """

    layer: str
    in_features: int
    ratio_a: float
    ratio_b: float
    amax_a: float
    amax_b: float
    n_outliers_a: int
    n_outliers_b: int
    outliers_a: list[int] = field(default_factory=list)
    outliers_b: list[int] = field(default_factory=list)
    appeared: list[int] = field(default_factory=list)
    gone: list[int] = field(default_factory=list)
    grew: list[tuple[int, float, float]] = field(default_factory=list)
    shrank: list[tuple[int, float, float]] = field(default_factory=list)

    @property
    def moved(self) -> bool:
        """Outliers moved: a channel became one, or stopped being one."""
        return bool(self.appeared or self.gone)

    @property
    def verdict(self) -> str:
        """"moved", "grew", "shrank", "grew and shrank" or "steady"."""
        if self.moved:
            return "moved"
        kinds = [k for k, v in (("grew", self.grew), ("shrank", self.shrank)) if v]
        return " and ".join(kinds) or "steady"


@dataclass(frozen=True)
class Transfer:
    """What the calibration of A does to B on one layer, for the layer's scheme.

    alpha: the SmoothQuant α (None: not smoothed); static: whether the activation scale is static.
    act_range, weight_range: smoothed range on B with A's factors over that with B's own (None: not smoothed)
    under_smoothed: channels of B whose smoothed max exceeds the smoothed amax A saw by more than CLIP_MARGIN,
        largest first
    static_amax_a: the static amax set on A (smoothed where the scheme smooths; None: not static)
    live_max_b: B's max of the same input (smoothed by A's factors where the scheme smooths)
    overshoot: live_max_b / static_amax_a (None: not static)
    clipped_share: share of B's calibrated values above the static amax (None: not static, or smoothed, where the
        histogram of the raw input cannot say); clipped_channels: B's channels past it by more than CLIP_MARGIN,
        largest first
    verdict: "clips", "wastes range", "clips and wastes range" (the factors waste, the static scale clips), "fits"
    """

    layer: str
    alpha: float | None
    static: bool
    act_range: float | None = None
    weight_range: float | None = None
    under_smoothed: list[int] = field(default_factory=list)
    static_amax_a: float | None = None
    live_max_b: float | None = None
    clipped_share: float | None = None
    clipped_channels: list[int] = field(default_factory=list)

    @property
    def overshoot(self) -> float | None:
        if self.static_amax_a is None or self.live_max_b is None:
            return None
        return _ratio(self.live_max_b, self.static_amax_a)

    @property
    def clips(self) -> bool:
        return self.overshoot is not None and self.overshoot > CLIP_MARGIN

    @property
    def wasted_bits(self) -> float:
        """Bits of the format's levels the stale calibration leaves unused on B: the largest of log2(act_range),
        log2(weight_range) and, for a static scale B's traffic does not reach, log2(amax_A / max_B)."""
        bits = [math.log2(r) for r in (self.act_range, self.weight_range) if r is not None and r > 0]
        if self.static_amax_a is not None and self.live_max_b is not None and 0 < self.live_max_b < self.static_amax_a:
            bits.append(math.log2(self.static_amax_a / self.live_max_b))
        return max([0.0, *bits])

    @property
    def wastes(self) -> bool:
        return self.wasted_bits >= math.log2(WASTE_FACTOR)

    @property
    def verdict(self) -> str:
        parts = [w for w, on in (("clips", self.clips), ("wastes range", self.wastes)) if on]
        return " and ".join(parts) or "fits"


def outlier_channels(channel_max: np.ndarray, factor: float = OUTLIER_FACTOR) -> np.ndarray:
    """Indices of the channels whose max is at least ``factor`` times the median channel max, largest first (none
    when the median is 0: every nonzero channel would count)."""
    cm = np.asarray(channel_max, dtype=np.float64)
    med = float(np.median(cm)) if cm.size else 0.0
    if med <= 0.0:
        return np.zeros(0, dtype=np.int64)
    idx = np.flatnonzero(cm >= factor * med)
    return idx[np.argsort(-cm[idx], kind="stable")]


def _check_pair(a: LayerStats, b: LayerStats) -> None:
    if a.in_features != b.in_features or a.channel_max.shape != b.channel_max.shape:
        raise DriftError(f"layer {a.name!r}: {a.in_features} input channels in one calibration, {b.in_features} in "
                         "the other; outlier drift compares models of one architecture and size")


def layer_drift(a: LayerStats, b: LayerStats, *, factor: float = OUTLIER_FACTOR, change: float = CHANGE_FACTOR,
                top: int = TOP_CHANNELS) -> LayerDrift:
    """How the input of one layer moved from calibration ``a`` to ``b`` (see the module docstring)."""
    _check_pair(a, b)
    if factor <= 1.0 or change <= 1.0:
        raise ValueError(f"factor and change must exceed 1; got {factor} and {change}")
    ca = np.asarray(a.channel_max, dtype=np.float64)
    cb = np.asarray(b.channel_max, dtype=np.float64)
    out_a, out_b = outlier_channels(ca, factor), outlier_channels(cb, factor)
    set_a, set_b = set(out_a.tolist()), set(out_b.tolist())
    appeared = [int(j) for j in out_b if int(j) not in set_a]
    gone = [int(j) for j in out_a if int(j) not in set_b]
    either = np.array(sorted(set_a | set_b), dtype=np.int64)
    grew: list[tuple[int, float, float]] = []
    shrank: list[tuple[int, float, float]] = []
    if either.size:
        ratio = np.maximum(cb[either], SMOOTHQUANT_EPS) / np.maximum(ca[either], SMOOTHQUANT_EPS)
        order = np.argsort(-np.abs(np.log(ratio)), kind="stable")
        for i in order:
            j, r = int(either[i]), float(ratio[i])
            row = (j, float(ca[j]), float(cb[j]))
            if r >= change:
                grew.append(row)
            elif r <= 1.0 / change:
                shrank.append(row)
    return LayerDrift(layer=a.name, in_features=a.in_features, ratio_a=outlier_ratio(ca), ratio_b=outlier_ratio(cb),
                      amax_a=float(ca.max()) if ca.size else 0.0, amax_b=float(cb.max()) if cb.size else 0.0,
                      n_outliers_a=int(out_a.size), n_outliers_b=int(out_b.size),
                      outliers_a=[int(j) for j in out_a[:top]], outliers_b=[int(j) for j in out_b[:top]],
                      appeared=appeared[:top], gone=gone[:top], grew=grew[:top], shrank=shrank[:top])


def _by_name(stats: Iterable[LayerStats] | Mapping[str, LayerStats]) -> dict[str, LayerStats]:
    rows = list(stats.values()) if isinstance(stats, Mapping) else list(stats)
    return {s.name: s for s in rows}


def common_layers(a: Iterable[LayerStats] | Mapping[str, LayerStats],
                  b: Iterable[LayerStats] | Mapping[str, LayerStats]) -> tuple[list[str], list[str], list[str]]:
    """(layers in both, in A's order; layers of A only; layers of B only)."""
    da, db = _by_name(a), _by_name(b)
    return [n for n in da if n in db], [n for n in da if n not in db], [n for n in db if n not in da]


def drift(a: Iterable[LayerStats] | Mapping[str, LayerStats], b: Iterable[LayerStats] | Mapping[str, LayerStats],
          *, factor: float = OUTLIER_FACTOR, change: float = CHANGE_FACTOR) -> list[LayerDrift]:
    """:func:`layer_drift` of every layer both calibrations have, in A's order; DriftError when they share none or
    a shared layer differs in width."""
    da, db = _by_name(a), _by_name(b)
    both, _, _ = common_layers(da, db)
    if not both:
        raise DriftError("the two calibrations share no layer name: outlier drift compares models of one "
                         "architecture (a base and its fine-tune)")
    return [layer_drift(da[n], db[n], factor=factor, change=change) for n in both]


def group_weight_max(stats: Mapping[str, LayerStats]) -> dict[str, np.ndarray]:
    """{layer: per-input-channel max |W|} with a fusion group's members (q/k/v, gate/up) taken together: they read
    one input, so SmoothQuant folds one factor per channel for the group."""
    out = {n: np.asarray(s.weight_channel_max, dtype=np.float64) for n, s in stats.items()}
    for group in fusion_groups(stats):
        members = [n for n in group if n in out and out[n].shape == out[group[0]].shape]
        if len(members) > 1:
            joint = np.maximum.reduce([out[n] for n in members])
            for n in members:
                out[n] = joint
    return out


@dataclass(frozen=True)
class LayerScheme:
    """What a transfer check reads of a layer's scheme: its SmoothQuant α (None: none) and whether its activation
    scale is static (calibrated)."""

    alpha: float | None
    static: bool

    @property
    def calibrated(self) -> bool:
        return self.alpha is not None or self.static


def transfer(a: Iterable[LayerStats] | Mapping[str, LayerStats], b: Iterable[LayerStats] | Mapping[str, LayerStats],
             schemes: Mapping[str, LayerScheme], *, top: int = TOP_CHANNELS) -> list[Transfer]:
    """For each layer of ``schemes`` that smooths or has a static activation scale and that both calibrations hold:
    what A's factors and static scale do on B (see the module docstring), in A's order."""
    da, db = _by_name(a), _by_name(b)
    wa, wb = group_weight_max(da), group_weight_max(db)
    out = []
    for name in da:
        scheme = schemes.get(name)
        if scheme is None or not scheme.calibrated or name not in db:
            continue
        sa, sb = da[name], db[name]
        _check_pair(sa, sb)
        ca, cb = (np.asarray(x.channel_max, dtype=np.float64) for x in (sa, sb))
        row: dict = {"layer": name, "alpha": scheme.alpha, "static": scheme.static}
        seen_a, live_b = ca, cb
        if scheme.alpha is not None:
            fa = smoothing_factors(ca, wa[name], scheme.alpha)
            fb = smoothing_factors(cb, wb[name], scheme.alpha)
            seen_a, live_b = ca / fa, cb / fa
            row["act_range"] = _ratio(live_b.max(), (cb / fb).max())
            row["weight_range"] = _ratio((wb[name] * fa).max(), (wb[name] * fb).max())
            over = np.flatnonzero(live_b > CLIP_MARGIN * seen_a.max())
            row["under_smoothed"] = [int(j) for j in over[np.argsort(-live_b[over], kind="stable")][:top]]
        if scheme.static:
            amax_a, max_b = float(seen_a.max()), float(live_b.max())
            row.update(static_amax_a=amax_a, live_max_b=max_b)
            over = np.flatnonzero(live_b > CLIP_MARGIN * amax_a)
            row["clipped_channels"] = [int(j) for j in over[np.argsort(-live_b[over], kind="stable")][:top]]
            if scheme.alpha is None:
                row["clipped_share"] = fraction_above(sb, amax_a) if max_b > amax_a else 0.0
        out.append(Transfer(**row))
    return out


def _ratio(x: float, y: float) -> float:
    return float(x) / float(y) if y > 0 else math.inf


def every_layer(names: Sequence[str], alpha: float = DEFAULT_ALPHA, static: bool = True) -> dict[str, LayerScheme]:
    """The what-if where no plan is given: SmoothQuant ``alpha`` and a static activation scale on every layer."""
    return {n: LayerScheme(alpha, static) for n in names}
