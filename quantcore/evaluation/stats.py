"""Activation statistics of one linear layer, as calibration produces them.

numpy only (no torch): the store, the app and the chart builders read these
without pulling torch in.

The |x| histogram is log-binned with fixed edges so that every layer, every run
and every model share one grid and can be compared or summed:

    bin i covers [2**(LOG2_MIN + i/BINS_PER_OCTAVE), 2**(LOG2_MIN + (i+1)/BINS_PER_OCTAVE))

Values below 2**LOG2_MIN land in bin 0, values at or above 2**LOG2_MAX in the
last bin; exact zeros are counted apart (``zeros``) because log2(0) has no bin.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

HIST_LOG2_MIN = -24  # 2**-24 ≈ 6e-8: below the smallest fp16 subnormal, far below any E4M3 step
HIST_LOG2_MAX = 16  # 2**16 = 65536: above the largest activation seen in LLMs we know of
HIST_BINS_PER_OCTAVE = 4  # quarter-octave bins: ≈19% wide, finer than E4M3's 12.5% steps only at 8/oct
HIST_BINS = (HIST_LOG2_MAX - HIST_LOG2_MIN) * HIST_BINS_PER_OCTAVE  # 160


def hist_edges() -> np.ndarray:
    """The HIST_BINS + 1 bin edges of every |x| histogram (float64)."""
    return np.exp2(HIST_LOG2_MIN + np.arange(HIST_BINS + 1) / HIST_BINS_PER_OCTAVE)


def outlier_ratio(channel_max: np.ndarray) -> float:
    """max channel max / median channel max; inf when the median is 0 and the max is not."""
    cm = np.asarray(channel_max, dtype=np.float64)
    if cm.size == 0:
        return float("nan")
    med = float(np.median(cm))
    top = float(cm.max())
    if med == 0.0:
        return float("inf") if top > 0 else 1.0
    return top / med


@dataclass
class LayerStats:
    """Calibration statistics of the input (and weight) of one ``nn.Linear``.

    name:               module name as in ``model.named_modules()``, e.g. ``model.layers.11.mlp.down_proj``
    in_features:        K, the input width
    out_features:       N, the output width
    n_tokens:           number of input rows (tokens) seen
    channel_max:        float32 [K], max |x[:, j]| over all calibration tokens
    weight_channel_max: float32 [K], max |W[:, j]| over output rows (the SmoothQuant denominator)
    token_max:          summary of the per-token max |x[t, :]|: keys p50, p90, p99, max, mean
    hist_counts:        int64 [HIST_BINS], log-binned counts of |x| (see module docstring)
    zeros:              number of exact zeros in x
    """

    name: str
    in_features: int
    out_features: int
    n_tokens: int
    channel_max: np.ndarray
    weight_channel_max: np.ndarray
    token_max: dict[str, float] = field(default_factory=dict)
    hist_counts: np.ndarray = field(default_factory=lambda: np.zeros(HIST_BINS, dtype=np.int64))
    zeros: int = 0

    @classmethod
    def from_record(cls, record: Any) -> LayerStats:
        """The statistics held by any object with these fields' attributes (a stored record, e.g. the store's
        ``ActivationStatRecord``; attributes beyond the fields, such as its saved ``outlier_ratio``, are ignored)."""
        return cls(**{f.name: getattr(record, f.name) for f in fields(cls)})

    @property
    def outlier_ratio(self) -> float:
        """max channel max / median channel max of the input (:func:`outlier_ratio`)."""
        return outlier_ratio(self.channel_max)

    @property
    def amax(self) -> float:
        """Largest |x| seen: the static per-tensor activation amax."""
        return float(np.max(self.channel_max)) if self.channel_max.size else 0.0
