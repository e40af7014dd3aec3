"""Outlier drift between two calibrations: outlier channels that moved, grew or shrank; what a base model's
SmoothQuant factors and static scales do on the fine-tune (quantcore.evaluation.drift, numpy only)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from quantcore.evaluation import drift as qd
from quantcore.evaluation.outliers import smoothing_factors
from quantcore.evaluation.stats import HIST_BINS, HIST_BINS_PER_OCTAVE, HIST_LOG2_MIN, LayerStats


def stats(name: str, channel_max, weight_max=None, hist=None) -> LayerStats:
    cm = np.asarray(channel_max, dtype=np.float32)
    wm = np.full(cm.shape, 0.1, dtype=np.float32) if weight_max is None else np.asarray(weight_max, np.float32)
    return LayerStats(name=name, in_features=cm.size, out_features=8, n_tokens=64, channel_max=cm,
                      weight_channel_max=wm, hist_counts=np.zeros(HIST_BINS, np.int64) if hist is None else hist)


def test_outliers_that_move_grow_and_shrink_are_named_channel_by_channel():
    base = np.ones(32)
    base[[3, 9, 20]] = [50.0, 30.0, 40.0]
    tuned = base.copy()
    tuned[3], tuned[11] = 1.0, 50.0  # channel 3's outlier moved to 11
    tuned[9] = 120.0  # grew 4x
    tuned[20] = 15.0  # shrank 40 -> 15 (still an outlier: >= 10x the median 1)
    d = qd.layer_drift(stats("l", base), stats("l", tuned))
    assert d.outliers_a == [3, 20, 9] and d.outliers_b == [9, 11, 20]
    assert d.appeared == [11] and d.gone == [3] and d.moved and d.verdict == "moved"
    assert [g[0] for g in d.grew] == [11, 9]  # 1 -> 50 first (the largest change), then 30 -> 120
    assert [s[0] for s in d.shrank] == [3, 20] and d.shrank[1] == (20, 40.0, 15.0)
    assert d.ratio_a == 50.0 and d.ratio_b == 120.0 and d.amax_b == 120.0


def test_identical_calibrations_are_steady_and_their_scales_fit():
    cm = np.ones(16)
    cm[5] = 80.0
    a = stats("m.layers.0.mlp.down_proj", cm)
    (d,) = qd.drift([a], [a])
    assert d.verdict == "steady" and not d.appeared and not d.grew
    (t,) = qd.transfer([a], [a], qd.every_layer([a.name]))
    assert t.act_range == pytest.approx(1.0) and t.weight_range == pytest.approx(1.0)
    assert not t.clips and t.wasted_bits == 0.0 and t.verdict == "fits" and t.under_smoothed == []


def test_a_static_scale_set_on_the_base_clips_the_fine_tunes_larger_traffic():
    """Unsmoothed: B's values above A's amax are clipped; their share is read from B's |x| histogram."""
    a_cm, b_cm = np.ones(16), np.ones(16)
    a_cm[2], b_cm[2] = 4.0, 16.0
    hist = np.zeros(HIST_BINS, np.int64)
    edge = lambda v: int((math.log2(v) - HIST_LOG2_MIN) * HIST_BINS_PER_OCTAVE)  # noqa: E731 - the bin of v
    hist[edge(1.0)] = 90  # 90 values at [1, 1.19)
    hist[edge(8.0)] = 10  # 10 values at [8, 9.5): above A's amax of 4
    (t,) = qd.transfer([stats("l", a_cm)], [stats("l", b_cm, hist=hist)], {"l": qd.LayerScheme(None, True)})
    assert t.static_amax_a == 4.0 and t.live_max_b == 16.0 and t.clips
    assert t.clipped_share == pytest.approx(0.10) and t.clipped_channels == [2]
    assert t.verdict == "clips" and t.act_range is None


def test_a_static_scale_the_fine_tune_never_reaches_wastes_its_range_in_bits():
    a_cm, b_cm = np.ones(16), np.ones(16)
    a_cm[2], b_cm[2] = 64.0, 8.0  # the outlier shrank 8x: 3 bits of the levels unused
    (t,) = qd.transfer([stats("l", a_cm)], [stats("l", b_cm)], {"l": qd.LayerScheme(None, True)})
    assert not t.clips and t.wasted_bits == pytest.approx(3.0) and t.verdict == "wastes range"
    assert t.clipped_share == 0.0


def test_stale_smoothing_factors_leave_a_moved_outlier_untamed():
    """A's factors divide channel 3 (its outlier) and not 11; on B the outlier sits at 11: the smoothed range is
    wider than B's own factors make it, channel 11 is under-smoothed, and a static scale set on A clips it."""
    a_cm, b_cm = np.ones(16), np.ones(16)
    a_cm[3], b_cm[11] = 100.0, 100.0
    w = np.full(16, 0.1)
    a, b = stats("l", a_cm, w), stats("l", b_cm, w)
    (t,) = qd.transfer([a], [b], {"l": qd.LayerScheme(0.5, True)})
    fa, fb = smoothing_factors(a_cm, w, 0.5), smoothing_factors(b_cm, w, 0.5)
    assert t.act_range == pytest.approx((b_cm / fa).max() / (b_cm / fb).max())
    assert t.act_range == pytest.approx(10.0)  # sqrt(100): α 0.5 would have taken the square root of it
    assert t.weight_range == pytest.approx((w * fa).max() / (w * fb).max())
    assert t.under_smoothed == [11] and t.clipped_channels == [11]
    assert t.static_amax_a == pytest.approx((a_cm / fa).max()) and t.clips and t.clipped_share is None
    assert t.verdict == "clips and wastes range" and t.wasted_bits == pytest.approx(math.log2(10.0))


def test_a_fusion_group_shares_its_weight_maxima_for_the_factors():
    names = [f"model.layers.0.self_attn.{p}_proj" for p in ("q", "k", "v")]
    cm = np.ones(4)
    group = {n: stats(n, cm, np.full(4, v)) for n, v in zip(names, (0.1, 0.4, 0.2), strict=True)}
    joint = qd.group_weight_max(group)
    assert all(np.array_equal(joint[n], np.full(4, np.float32(0.4), dtype=np.float64)) for n in names)


def test_calibrations_that_cannot_be_compared_say_why():
    with pytest.raises(qd.DriftError, match="share no layer"):
        qd.drift([stats("a", np.ones(4))], [stats("b", np.ones(4))])
    with pytest.raises(qd.DriftError, match="'a': 4 input channels in one calibration, 8 in the other"):
        qd.drift([stats("a", np.ones(4))], [stats("a", np.ones(8))])
    assert qd.common_layers([stats("a", np.ones(4)), stats("x", np.ones(4))],
                            [stats("a", np.ones(4)), stats("y", np.ones(4))]) == (["a"], ["x"], ["y"])


def test_a_few_values_just_past_the_calibrated_max_are_not_called_clipping():
    a_cm, b_cm = np.ones(16), np.ones(16)
    a_cm[2], b_cm[2] = 10.0, 10.5  # 5 % past: within CLIP_MARGIN
    (t,) = qd.transfer([stats("l", a_cm)], [stats("l", b_cm)], {"l": qd.LayerScheme(None, True)})
    assert t.overshoot == pytest.approx(1.05) and not t.clips and t.clipped_channels == [] and t.verdict == "fits"
    b_cm[2] = 11.5  # 15 % past
    (t,) = qd.transfer([stats("l", a_cm)], [stats("l", b_cm)], {"l": qd.LayerScheme(None, True)})
    assert t.clips and t.clipped_channels == [2]
