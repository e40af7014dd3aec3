"""What a Hadamard rotation does to a layer's input, beside SmoothQuant: the Outliers page's what-if (numpy only).

A calibration run with the plan's rotation applied (:func:`quantcore.algorithms.rotation.rotation_applied` around
:func:`quantcore.evaluation.calibrate.calibrate`) gives the statistics of the rotated inputs; set beside the
unrotated run's, per layer: the per-channel max |x|, the outlier ratio (max / median channel max) and the kurtosis
E[x⁴] / E[x²]² (3 for a Gaussian; an input whose energy sits in a few outlier channels has a far larger one), and
the same for SmoothQuant at an α (the input divided by s, which scales channel j's maxima by 1/s_j; its kurtosis is
not known from the statistics, since the histogram mixes channels). The model-level table ranks the layers by how much
a fix (the rotation, or SmoothQuant) lowers the outlier ratio; :func:`depth_fixes` gives every layer under every fix
for a chart across depth, and :func:`fix_breakage` what each number format flushes or clips under each fix.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from quantcore.evaluation.stats import LayerStats, hist_edges, outlier_ratio

Columns = dict[str, np.ndarray]


def kurtosis(stat: LayerStats) -> float:
    """E[x⁴] / E[x²]² of the layer's input, from its |x| histogram at the bins' geometric centres (quarter-octave
    bins: each moment is known to about ±20%; exact zeros count as zeros); nan for an all-zero input."""
    edges = hist_edges()
    mid = np.sqrt(edges[:-1] * edges[1:])
    counts = np.asarray(stat.hist_counts, dtype=np.float64)[: mid.size]
    n = float(counts.sum()) + float(stat.zeros)
    m2, m4 = float((counts * mid**2).sum()), float((counts * mid**4).sum())
    return m4 * n / (m2 * m2) if m2 > 0 else float("nan")


def smoothed_channel_max(stat: LayerStats, alpha: float) -> np.ndarray:
    """The input's per-channel max after SmoothQuant at ``alpha``: channel_max / s (s from the same statistics)."""
    from quantcore.evaluation.outliers import smoothing_factors

    return np.asarray(stat.channel_max, dtype=np.float64) / smoothing_factors(stat.channel_max,
                                                                             stat.weight_channel_max, alpha)


@dataclass(frozen=True)
class FixView:
    """One layer's input under one fix: its per-channel max, outlier ratio, tensor amax and kurtosis (nan: unknown)."""

    fix: str
    channel_max: np.ndarray
    outlier_ratio: float
    amax: float
    kurtosis: float


def layer_fixes(before: LayerStats, rotated: LayerStats | None, alpha: float) -> list[FixView]:
    """The layer's input as calibrated, under SmoothQuant at ``alpha``, and rotated (when a rotated run is given)."""
    smooth = smoothed_channel_max(before, alpha)
    out = [FixView("none", np.asarray(before.channel_max, np.float64), before.outlier_ratio, before.amax,
                   kurtosis(before)),
           FixView(smoothquant_label(alpha), smooth, outlier_ratio(smooth), float(smooth.max()), float("nan"))]
    if rotated is not None:
        out.append(FixView("rotation", np.asarray(rotated.channel_max, np.float64), rotated.outlier_ratio,
                           rotated.amax, kurtosis(rotated)))
    return out


FIX_NONE, FIX_ROTATION, FIX_SMOOTHQUANT = "none", "rotation", "SmoothQuant"
RANK_BY = {FIX_ROTATION: "rotation_gain", FIX_SMOOTHQUANT: "smoothquant_gain"}  # the fix a table is ranked by


def smoothquant_label(alpha: float) -> str:
    """The SmoothQuant fix's name in tables and charts: ``SmoothQuant α=0.5``."""
    return f"{FIX_SMOOTHQUANT} α={alpha:g}"


def fix_table(before: Mapping[str, LayerStats], rotated: Mapping[str, LayerStats], alpha: float,
              rank_by: str = FIX_ROTATION) -> Columns:
    """One row per layer both runs saw, ranked by how much ``rank_by`` (``rotation`` or ``SmoothQuant``) lowers the
    outlier ratio, most first: layer, outlier ratio none / SmoothQuant / rotation, kurtosis none / rotation, each
    fix's gain (ratio as calibrated / ratio under the fix: above 1 the fix helps) and the fix with the larger gain."""
    if rank_by not in RANK_BY:
        raise ValueError(f"rotation_view.fix_table: rank_by must be one of {', '.join(RANK_BY)}, not {rank_by!r}")
    names = [n for n in before if n in rotated]
    ratio = np.array([before[n].outlier_ratio for n in names], dtype=np.float64)
    sq = np.array([outlier_ratio(smoothed_channel_max(before[n], alpha)) for n in names], dtype=np.float64)
    rot = np.array([rotated[n].outlier_ratio for n in names], dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        gains = {"smoothquant_gain": ratio / sq, "rotation_gain": ratio / rot}
    key = gains[RANK_BY[rank_by]]
    order = np.argsort(-np.nan_to_num(key, nan=-np.inf), kind="stable")
    best = np.where(np.nan_to_num(gains["rotation_gain"], nan=-np.inf)
                    >= np.nan_to_num(gains["smoothquant_gain"], nan=-np.inf), FIX_ROTATION, smoothquant_label(alpha))
    return {
        "layer": np.array(names, dtype=object)[order],
        "outlier_ratio": ratio[order],
        "outlier_ratio_smoothquant": sq[order],
        "outlier_ratio_rotation": rot[order],
        "kurtosis": np.array([kurtosis(before[n]) for n in names], dtype=np.float64)[order],
        "kurtosis_rotation": np.array([kurtosis(rotated[n]) for n in names], dtype=np.float64)[order],
        "smoothquant_gain": gains["smoothquant_gain"][order],
        "rotation_gain": gains["rotation_gain"][order],
        "best_fix": np.asarray(best, dtype=object)[order],
    }


def depth_fixes(before: Mapping[str, LayerStats], rotated: Mapping[str, LayerStats], alpha: float) -> Columns:
    """The whole model under each fix, long form for a chart across depth: one row per (layer both runs saw, fix)
    with its block (-1 outside the blocks), projection type, outlier ratio and kurtosis (nan under SmoothQuant: not
    known from the statistics)."""
    from quantcore.evaluation.outliers import parse_layer_name

    rows: list[tuple[str, int, str, str, float, float]] = []
    sq_name = smoothquant_label(alpha)
    for name in (n for n in before if n in rotated):
        block, proj = parse_layer_name(name)
        where = (name, -1 if block is None else block, proj)
        rows += [(*where, FIX_NONE, before[name].outlier_ratio, kurtosis(before[name])),
                 (*where, sq_name, outlier_ratio(smoothed_channel_max(before[name], alpha)), float("nan")),
                 (*where, FIX_ROTATION, rotated[name].outlier_ratio, kurtosis(rotated[name]))]
    cols = list(zip(*rows, strict=True)) if rows else [()] * 6
    return {"layer": np.array(cols[0], dtype=object), "block": np.array(cols[1], dtype=np.int64),
            "proj": np.array(cols[2], dtype=object), "fix": np.array(cols[3], dtype=object),
            "outlier_ratio": np.array(cols[4], dtype=np.float64), "kurtosis": np.array(cols[5], dtype=np.float64)}


# Breakage columns SmoothQuant's statistics cannot give: the smoothed input's per-token maxima and |x| histogram are
# not known (each token's maximum may sit in another channel after the division), so a per-token scale's numbers and
# a static scale's clipping are nan in its rows; per-tensor and block scales read the per-channel maxima alone.
_TOKEN_COLUMNS = ("scale_amax", "flush_threshold", "frac_channels_flushed", "worst_rel_error", "median_rel_error")


def fix_breakage(before: Mapping[str, LayerStats], rotated: Mapping[str, LayerStats] | None, alpha: float,
                 layers: Sequence[str], formats: Sequence[str], granularity: str = "tensor") -> Columns:
    """The "what will break" table (:func:`quantcore.evaluation.outliers.breakage_table`) of ``layers``' inputs under
    each fix: as calibrated, smoothed at ``alpha`` (the input divided by s: its per-channel maxima scaled) and rotated
    (the rotated calibration's statistics; its rows are left out where ``rotated`` is None or lacks the layer). A
    ``fix`` column first; the smoothed rows' clipping by a static scale is nan (not known from the statistics), and so
    is every number of a per-token scale. Raises ValueError naming the layer a calibration does not have."""
    from quantcore.evaluation.outliers import BREAKAGE_COLUMNS, breakage_table

    missing = [n for n in layers if n not in before]
    if missing:
        raise ValueError(f"rotation_view.fix_breakage: the calibration has no statistics for {', '.join(missing)}")
    plain = [before[n] for n in layers]
    smoothed = [replace(s, channel_max=smoothed_channel_max(s, alpha).astype(np.float32), token_max={},
                        hist_counts=np.zeros_like(s.hist_counts), zeros=0) for s in plain]
    parts: list[tuple[str, Columns]] = [(FIX_NONE, breakage_table(plain, formats, granularity)),
                                        (smoothquant_label(alpha), breakage_table(smoothed, formats, granularity))]
    unknown = np.isin(parts[1][1]["granularity"], ["token"])
    for col in _TOKEN_COLUMNS:
        parts[1][1][col] = np.where(unknown, np.nan, parts[1][1][col])
    parts[1][1]["expected_saturation"] = np.where(parts[1][1]["granularity"] == "tensor", np.nan,
                                                  parts[1][1]["expected_saturation"])
    if rotated is not None and (have := [rotated[n] for n in layers if n in rotated]):
        parts.append((FIX_ROTATION, breakage_table(have, formats, granularity)))
    out: Columns = {"fix": np.array([fix for fix, cols in parts for _ in cols["layer"]], dtype=object)}
    for col in BREAKAGE_COLUMNS:
        out[col] = np.concatenate([cols[col] for _, cols in parts])
    return out


__all__ = ["FIX_NONE", "FIX_ROTATION", "FIX_SMOOTHQUANT", "FixView", "depth_fixes", "fix_breakage", "fix_table",
           "kurtosis", "layer_fixes", "smoothed_channel_max", "smoothquant_label"]
