"""The Outliers page's what-if numbers (quantcore.evaluation.rotation_view): kurtosis from the |x| histogram, each
layer under each fix (none / SmoothQuant / rotation), the model-level ranking by how much a fix helps, and the
"what will break" table per fix."""

from __future__ import annotations

import numpy as np
import pytest

from quantcore.evaluation import outliers as ol
from quantcore.evaluation import rotation_view as rv
from quantcore.evaluation.stats import HIST_BINS, LayerStats, hist_edges


def stat(name: str, channel_max, values: np.ndarray | None = None, token_p50: float | None = None) -> LayerStats:
    cm = np.asarray(channel_max, dtype=np.float32)
    hist = np.zeros(HIST_BINS, dtype=np.int64)
    if values is not None:
        hist = np.histogram(np.abs(values), bins=hist_edges())[0].astype(np.int64)
    return LayerStats(name=name, in_features=cm.size, out_features=4, n_tokens=16, channel_max=cm,
                      weight_channel_max=np.ones_like(cm), token_max={} if token_p50 is None else {"p50": token_p50},
                      hist_counts=hist, zeros=0)


def test_kurtosis_from_the_histogram_is_a_gaussians_3_and_far_more_with_outliers():
    x = np.random.default_rng(0).standard_normal(200_000)
    assert rv.kurtosis(stat("a", [1.0], x)) == pytest.approx(3.0, rel=0.15)  # quarter-octave bins: about ±20 %
    spiky = np.concatenate([x, np.full(20, 500.0)])  # 1e-4 of the values 500 sigma out
    assert rv.kurtosis(stat("a", [1.0], spiky)) > 100 * rv.kurtosis(stat("a", [1.0], x))
    assert np.isnan(rv.kurtosis(stat("a", [0.0])))  # an all-zero input


def _model() -> tuple[dict[str, LayerStats], dict[str, LayerStats]]:
    # weight maxima are 1, so SmoothQuant's s_j = cm_j^α and the smoothed maxima cm_j^(1-α)
    before = {"model.layers.0.mlp.down_proj": stat("model.layers.0.mlp.down_proj", [1, 1, 1, 1, 1000.0]),
              "model.layers.1.self_attn.o_proj": stat("model.layers.1.self_attn.o_proj", [1, 1, 2, 2, 16.0]),
              "lm_head": stat("lm_head", [1, 1, 1, 1, 4.0])}
    rotated = {"model.layers.0.mlp.down_proj": stat("model.layers.0.mlp.down_proj", [400, 450, 450, 450, 500.0]),
               "model.layers.1.self_attn.o_proj": stat("model.layers.1.self_attn.o_proj", [4, 4, 4, 4, 8.0])}
    return before, rotated


def test_fix_table_ranks_the_layers_both_runs_saw_by_the_chosen_fixs_gain():
    before, rotated = _model()
    t = rv.fix_table(before, rotated, 0.5)
    assert list(t["layer"]) == ["model.layers.0.mlp.down_proj", "model.layers.1.self_attn.o_proj"]  # no lm_head
    assert t["outlier_ratio"][0] == pytest.approx(1000.0)
    assert t["outlier_ratio_smoothquant"][0] == pytest.approx(1000.0 ** 0.5, rel=1e-5)  # sqrt(1000) / sqrt(1)
    assert t["rotation_gain"][0] == pytest.approx(1000.0 / (500 / 450), rel=1e-5)
    assert t["smoothquant_gain"][1] == pytest.approx(8.0 / (16 ** 0.5 / 2 ** 0.5), rel=1e-5)
    assert t["rotation_gain"][1] == pytest.approx(8.0 / 2.0)
    assert list(t["best_fix"]) == ["rotation", "rotation"]
    # ranked by SmoothQuant's gain instead: o_proj's 2.83 is below down_proj's 31.6, the order stays; a layer whose
    # SmoothQuant gain is larger comes first
    before["model.layers.1.self_attn.o_proj"] = stat("model.layers.1.self_attn.o_proj", [1, 1, 1, 1, 1e6])
    rotated["model.layers.1.self_attn.o_proj"] = stat("model.layers.1.self_attn.o_proj", [1, 1, 1, 1, 1e5])
    by_sq = rv.fix_table(before, rotated, 0.5, rank_by="SmoothQuant")
    assert by_sq["layer"][0] == "model.layers.1.self_attn.o_proj"
    assert by_sq["best_fix"][0] == "SmoothQuant α=0.5"  # 1000× by SmoothQuant against 10× rotated
    with pytest.raises(ValueError, match="rank_by"):
        rv.fix_table(before, rotated, 0.5, rank_by="GPTQ")


def test_depth_fixes_has_each_layer_under_each_fix():
    before, rotated = _model()
    d = rv.depth_fixes(before, rotated, 0.5)
    assert len(d["layer"]) == 6
    assert list(d["fix"][:3]) == ["none", "SmoothQuant α=0.5", "rotation"]
    assert list(d["block"]) == [0, 0, 0, 1, 1, 1] and d["proj"][3] == "o_proj"
    assert np.isnan(d["kurtosis"][1])  # SmoothQuant's kurtosis is not known from the statistics
    assert d["outlier_ratio"][2] == pytest.approx(500 / 450)


def test_fix_breakage_says_what_each_format_flushes_under_each_fix():
    before, rotated = _model()
    layer = "model.layers.0.mlp.down_proj"
    t = rv.fix_breakage(before, rotated, 0.5, [layer], ["int8"], "tensor")
    flushed = dict(zip(t["fix"], t["frac_channels_flushed"], strict=True))
    # INT8 per tensor: step 1000/127 = 7.9, half a step 3.9 > 1: the four small channels flush; rotated none does;
    # smoothed (maxima 1 and 31.6: step 0.249) none either
    assert flushed == {"none": pytest.approx(0.8), "SmoothQuant α=0.5": 0.0, "rotation": 0.0}
    assert t["scale_amax"][1] == pytest.approx(1000 ** 0.5, rel=1e-5)
    assert np.isnan(t["expected_saturation"][1]) and t["expected_saturation"][0] == 0.0  # no p99 in these stats
    # per-token scales: the smoothed input's token maxima are not known, its rows say so (nan); MXFP4 has its own
    before[layer].token_max["p50"] = 1000.0
    tok = rv.fix_breakage(before, None, 0.5, [layer], ["int8", "mxfp4"], "token")
    assert list(tok["fix"]) == ["none", "none", "SmoothQuant α=0.5", "SmoothQuant α=0.5"]  # no rotated run
    assert np.isnan(tok["frac_channels_flushed"][2]) and not np.isnan(tok["frac_channels_flushed"][3])
    assert tok["granularity"][3] == "block"
    assert set(t) == {"fix", *ol.BREAKAGE_COLUMNS}
    with pytest.raises(ValueError, match="no statistics for model.layers.9.mlp.down_proj"):
        rv.fix_breakage(before, rotated, 0.5, ["model.layers.9.mlp.down_proj"], ["int8"])
