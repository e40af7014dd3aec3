"""What a Hadamard rotation does to a layer's input, beside SmoothQuant: the Outliers page's what-if (numpy only).

A calibration run with the plan's rotation applied (:func:`quantcore.algorithms.rotation.rotation_applied` around
:func:`quantcore.evaluation.calibrate.calibrate`) gives the statistics of the rotated inputs; set beside the
unrotated run's, per layer: the per-channel max |x|, the outlier ratio (max / median channel max) and the kurtosis
E[x⁴] / E[x²]² (3 for a Gaussian; an input whose energy sits in a few outlier channels has a far larger one), and
the same for SmoothQuant at an α (the input divided by s, which scales channel j's maxima by 1/s_j; its kurtosis is
not known from the statistics, since the histogram mixes channels). The model-level table ranks the layers by how much
the rotation lowers the outlier ratio.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

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
           FixView(f"SmoothQuant α={alpha:g}", smooth, outlier_ratio(smooth), float(smooth.max()), float("nan"))]
    if rotated is not None:
        out.append(FixView("rotation", np.asarray(rotated.channel_max, np.float64), rotated.outlier_ratio,
                           rotated.amax, kurtosis(rotated)))
    return out


def fix_table(before: Mapping[str, LayerStats], rotated: Mapping[str, LayerStats], alpha: float) -> Columns:
    """One row per layer both runs saw, ranked by how much the rotation lowers the outlier ratio (most first):
    layer, outlier ratio none / SmoothQuant / rotation, kurtosis none / rotation, gain (ratio none / rotation)."""
    names = [n for n in before if n in rotated]
    ratio = np.array([before[n].outlier_ratio for n in names], dtype=np.float64)
    sq = np.array([outlier_ratio(smoothed_channel_max(before[n], alpha)) for n in names], dtype=np.float64)
    rot = np.array([rotated[n].outlier_ratio for n in names], dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        gain = ratio / rot
    order = np.argsort(-np.nan_to_num(gain, nan=-np.inf), kind="stable")
    return {
        "layer": np.array(names, dtype=object)[order],
        "outlier_ratio": ratio[order],
        "outlier_ratio_smoothquant": sq[order],
        "outlier_ratio_rotation": rot[order],
        "kurtosis": np.array([kurtosis(before[n]) for n in names], dtype=np.float64)[order],
        "kurtosis_rotation": np.array([kurtosis(rotated[n]) for n in names], dtype=np.float64)[order],
        "rotation_gain": gain[order],
    }


__all__ = ["FixView", "fix_table", "kurtosis", "layer_fixes", "smoothed_channel_max"]
