"""Golden values and properties of quantcore.evaluation.outliers.

Golden values come from the reference texts (shared/reference): INT8 per-tensor step
amax/127 and flush below half a step; E4M3 smallest subnormal 2**-9 under the scale
amax/448; the SmoothQuant worked example (alpha 0.5, X max (1.3, 0.9, 58), W max
(0.42, 0.55, 0.020) -> s = (1.759, 1.279, 53.85), steps 58/7 = 8.29 -> ~0.154).
Properties cross-check the flush and error bounds against an explicit numpy
emulation of rounding (the reference's fp_round, round-half-to-even as in torch).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quantcore.evaluation import outliers as ol
from quantcore.evaluation.stats import HIST_BINS, LayerStats, hist_edges

E4M3_MAN_BITS = 3
E4M3_EMIN = -6


def make_stat(
    name: str,
    channel_max,
    weight_max=None,
    token_max: dict[str, float] | None = None,
    hist: np.ndarray | None = None,
    zeros: int = 0,
) -> LayerStats:
    cm = np.asarray(channel_max, dtype=np.float32)
    wm = np.ones_like(cm) if weight_max is None else np.asarray(weight_max, dtype=np.float32)
    return LayerStats(
        name=name,
        in_features=cm.size,
        out_features=4,
        n_tokens=16,
        channel_max=cm,
        weight_channel_max=wm,
        token_max=token_max or {},
        hist_counts=np.zeros(HIST_BINS, dtype=np.int64) if hist is None else hist,
        zeros=zeros,
    )


def int8_round(x: np.ndarray, amax: float) -> np.ndarray:
    """INT8 per-tensor fake quantization as in the reference's int8PerTensor (round-half-even)."""
    s = amax / 127
    return np.round(np.asarray(x, dtype=np.float64) / s) * s


def e4m3_round(x: np.ndarray) -> np.ndarray:
    """The reference's fp_round(x, 3, -6, 448) in numpy (no scale)."""
    x = np.asarray(x, dtype=np.float64)
    e = np.maximum(np.floor(np.log2(np.maximum(np.abs(x), 1e-30))), E4M3_EMIN)
    step = np.exp2(e - E4M3_MAN_BITS)
    return np.clip(np.round(x / step) * step, -448.0, 448.0)


# --------------------------------------------------------------------------- layer names
@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("model.layers.11.mlp.down_proj", (11, "down_proj")),
        ("model.layers.0.self_attn.q_proj", (0, "q_proj")),
        ("model.layers.29.self_attn.o_proj", (29, "o_proj")),  # Llama / Qwen2 / Mistral / Gemma
        ("lm_head", (None, "lm_head")),
        ("encoder.layer.3.attention.self.query", (3, "query")),  # BERT
        ("encoder.layer.3.attention.output.dense", (3, "attention.output.dense")),
        ("encoder.layer.3.intermediate.dense", (3, "intermediate.dense")),
        ("encoder.layer.3.output.dense", (3, "output.dense")),
        ("transformer.h.0.attn.c_attn", (0, "c_attn")),  # GPT-2
        ("transformer.h.0.mlp.c_proj", (0, "mlp.c_proj")),
        ("transformer.h.0.attn.c_proj", (0, "attn.c_proj")),
        ("model.layers.3.mlp.experts.7.down_proj", (3, "down_proj")),  # mixture of experts
        ("encoder.block.2.layer.0.SelfAttention.q", (2, "q")),  # T5: block index, not sub-layer
        ("model.embed_tokens", (None, "embed_tokens")),
    ],
)
def test_parse_layer_name(name: str, expected: tuple[int | None, str]) -> None:
    assert ol.parse_layer_name(name) == expected


# --------------------------------------------------------------------------- thresholds
def test_int8_flush_threshold_is_half_a_step() -> None:
    assert ol.int8_flush_threshold(254.0) == 1.0
    assert ol.int8_flush_threshold(3000.0) == pytest.approx(3000.0 / 127 / 2)
    assert ol.flush_threshold("int8", 3000.0) == pytest.approx(3000.0 / 254)


def test_e4m3_min_subnormal_under_scale() -> None:
    assert ol.e4m3_min_subnormal_under_scale(448.0) == 2.0**-9
    assert ol.e4m3_min_subnormal_under_scale(3000.0) == pytest.approx(2.0**-9 * 3000.0 / 448.0)
    # E4M3 flushes at half its smallest subnormal
    assert ol.flush_threshold("fp8_e4m3", 448.0) == 2.0**-10


def test_flush_threshold_other_formats() -> None:
    assert ol.flush_threshold("fp4_e2m1", 6.0) == 0.25  # grid 0, 0.5, 1, ... -> half of 0.5
    assert ol.flush_threshold("fp8_e5m2", 57344.0) == 2.0**-17  # half of the 2**-16 subnormal


def test_reference_tiny_example_flush() -> None:
    """The reference's x = (60, 0.5, 2, 0.05, 30): INT8 per-tensor zeroes 0.05, E4M3 keeps it."""
    x = np.array([60.0, 0.5, 2.0, 0.05, 30.0])
    thr = ol.int8_flush_threshold(60.0)
    assert list(x <= thr) == [False, False, False, True, False]
    assert list(int8_round(x, 60.0) == 0) == list(x <= thr)
    assert 0.05 > ol.flush_threshold("fp8_e4m3", 60.0)
    # reference output: INT8 rel err on 0.5 is 0.055, within the bound s/(2x)
    s = 60.0 / 127
    assert ol.relative_error_bound("int8", 0.5 / s) == pytest.approx(s / 2 / 0.5)
    assert ol.relative_error_bound("int8", 0.5 / s) >= 0.055
    assert ol.relative_error_bound("int8", 0.05 / s) == 1.0


@given(
    amax=st.floats(1e-3, 1e4),
    fractions=st.lists(st.floats(1e-6, 1.0), min_size=1, max_size=64),
)
@settings(max_examples=200, deadline=None)
def test_int8_flush_matches_rounding(amax: float, fractions: list[float]) -> None:
    """A channel counts as flushed exactly when INT8 per-tensor rounding sends its max to 0."""
    cm = np.asarray([amax] + [amax * f for f in fractions], dtype=np.float32).astype(np.float64)
    stat = make_stat("model.layers.0.mlp.down_proj", cm)
    row = ol.layer_breakage(stat, "int8")
    amax32 = float(cm.max())
    zeroed = int8_round(cm, amax32) == 0
    assert row["frac_channels_flushed"] == pytest.approx(zeroed.mean())


@given(x=st.floats(2.0**-14, 448.0))
@settings(max_examples=300, deadline=None)
def test_e4m3_flush_and_error_bound_match_emulation(x: float) -> None:
    """Under scale 1 (amax 448): flush iff rounding gives 0; rounding error within the bound."""
    q = float(e4m3_round(np.array([x]))[0])
    flushed = x <= ol.flush_threshold("fp8_e4m3", 448.0)
    assert flushed == (q == 0.0)
    bound = float(ol.relative_error_bound("fp8_e4m3", x))
    assert abs(q - x) / x <= bound + 1e-12


@given(x=st.floats(0.01, 127.0))
@settings(max_examples=300, deadline=None)
def test_int8_error_bound_holds(x: float) -> None:
    bound = float(ol.relative_error_bound("int8", x))
    assert abs(np.round(x) - x) / x <= bound + 1e-12


def test_relative_error_bound_golden() -> None:
    # E4M3: 2**-(3+1) in the normal range, min_subnormal / 2 / x below 2**-6, 1.0 at the flush point
    got = ol.relative_error_bound("fp8_e4m3", np.array([448.0, 1.0, 2.0**-6, 2.0**-7, 2.0**-9, 2.0**-10]))
    np.testing.assert_allclose(got, [1 / 16, 1 / 16, 1 / 16, 1 / 8, 1 / 2, 1.0])
    assert ol.relative_error_bound("fp8_e5m2", 1.0) == 1 / 8
    assert ol.relative_error_bound("fp4_e2m1", 1.0) == 1 / 4
    np.testing.assert_allclose(
        ol.relative_error_bound("int8", np.array([127.0, 1.0, 0.5])), [0.5 / 127, 0.5, 1.0]
    )


# --------------------------------------------------------------------------- SmoothQuant
WORKED_ACT = np.array([1.3, 0.9, 58.0])
WORKED_W = np.array([0.42, 0.55, 0.020])


def test_smoothquant_worked_example() -> None:
    view = ol.smoothquant_view(WORKED_ACT, WORKED_W, 0.5, levels=7)
    np.testing.assert_allclose(view.s, [1.759, 1.279, 53.85], atol=5e-4, rtol=1e-4)
    assert view.act_step_before == pytest.approx(8.29, abs=5e-3)  # "58/7 = 8.29"
    assert view.weight_step_before == pytest.approx(0.079, abs=5e-4)  # "0.55/7 = 0.079"
    assert view.act_step_after == pytest.approx(0.154, abs=5e-4)  # "both steps are about 0.154"
    assert view.weight_step_after == pytest.approx(0.154, abs=5e-4)
    # alpha 0.5 equalises the ranges: both become sqrt(max|X| * max|W|)
    np.testing.assert_allclose(view.act_after, np.sqrt(WORKED_ACT * WORKED_W))
    np.testing.assert_allclose(view.weight_after, np.sqrt(WORKED_ACT * WORKED_W))


def test_smoothquant_default_levels_is_int8() -> None:
    view = ol.smoothquant_view(WORKED_ACT, WORKED_W, 0.5)
    assert view.levels == 127
    assert view.act_step_before == pytest.approx(58.0 / 127)


def test_smoothquant_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="alpha"):
        ol.smoothing_factors(WORKED_ACT, WORKED_W, 1.5)
    with pytest.raises(ValueError, match="shape"):
        ol.smoothing_factors(WORKED_ACT, WORKED_W[:2], 0.5)


def test_alpha_sweep_endpoints() -> None:
    act = np.array([100.0, 0.1, 0.2, 0.3])
    w = np.array([0.01, 0.5, 0.4, 0.3])
    sweep = ol.alpha_sweep(act, w, alphas=[0.0, 0.5, 1.0])
    # alpha 0: s = 1/w -> every weight column becomes 1: nothing flushed on the weight side
    assert sweep["weight_flushed"][0] == 0.0
    # alpha 1: s = act -> every activation channel becomes 1: nothing flushed on the activation side
    assert sweep["act_flushed"][2] == 0.0
    # before smoothing (act per-tensor step 100/127) three of four activation channels flush
    assert ol.smoothquant_view(act, w, 0.0).act_before[1:].max() <= 100 / 127 / 2


# --------------------------------------------------------------------------- breakage
def test_breakage_hand_built_tensor() -> None:
    # amax 254 -> INT8 step 2, flush at 1.0 (inclusive: 0.5 rounds to even 0)
    cm = [254.0, 1.0, 0.5, 1.01, 2.0, 4.0, 0.0, 100.0]
    stat = make_stat("model.layers.2.mlp.down_proj", cm)
    rows = {r["format"]: r for r in (ol.layer_breakage(stat, f) for f in ol.DEFAULT_BREAKAGE_FORMATS)}
    int8 = rows["int8"]
    assert int8["dead_channels"] == 1
    assert int8["frac_channels_flushed"] == pytest.approx(2 / 7)  # 1.0 and 0.5 of 7 live channels
    assert int8["flush_threshold"] == pytest.approx(1.0)
    assert int8["worst_rel_error"] == 1.0
    # live x/s = 127, .5, .25, .505, 1, 2, 50 -> bounds 0.0039, 1, 1, 0.99, 0.5, 0.25, 0.01; median 0.5
    assert int8["median_rel_error"] == pytest.approx(0.5)
    e4m3 = rows["fp8_e4m3"]
    assert e4m3["frac_channels_flushed"] == 0.0
    assert e4m3["worst_rel_error"] == 1 / 16  # 0.5 * 448 / 254 = 0.88 is in the normal range
    assert e4m3["flush_threshold"] == pytest.approx(2.0**-10 * 254 / 448)
    fp4 = rows["fp4_e2m1"]  # scale 254/6, flush at 0.25 * 254/6 = 10.58
    assert fp4["frac_channels_flushed"] == pytest.approx(5 / 7)
    assert rows["fp8_e5m2"]["worst_rel_error"] == 1 / 8
    assert int8["block"] == 2 and int8["proj"] == "down_proj" and int8["granularity"] == "tensor"


def test_breakage_e4m3_subnormal_flush() -> None:
    stat = make_stat("lm_head", [448.0, 2.0**-9, 2.0**-10, 0.75 * 2.0**-8])
    row = ol.layer_breakage(stat, "fp8_e4m3")
    assert row["frac_channels_flushed"] == pytest.approx(1 / 4)  # 2**-10 is half the min subnormal
    assert row["worst_rel_error"] == 1.0
    assert row["block"] == -1


def test_breakage_block_granularity_rescues_small_tiles() -> None:
    cm = [254.0, 0.9, 1.0, 1.1, 0.02, 0.02, 0.02, 0.02]
    stat = make_stat("model.layers.0.mlp.down_proj", cm)
    tensor = ol.layer_breakage(stat, "int8", "tensor")
    block = ol.layer_breakage(stat, "int8", "block", block_size=4)
    assert tensor["frac_channels_flushed"] == pytest.approx(6 / 8)
    assert block["frac_channels_flushed"] == pytest.approx(2 / 8)  # only 0.9 and 1.0 in the outlier's tile
    assert block["expected_saturation"] == 0.0  # dynamic scales do not clip
    # per-group along K (schemes.Granularity.GROUP) is the same estimate for activations
    from quantcore.formats.granularity import Granularity

    group = ol.layer_breakage(stat, "int8", Granularity.GROUP, block_size=4)
    assert group["frac_channels_flushed"] == pytest.approx(2 / 8)
    assert group["granularity"] == "block"
    assert ol.layer_breakage(stat, "int8", Granularity.TENSOR)["granularity"] == "tensor"


def test_breakage_block_formats_use_their_own_blocks() -> None:
    """One 3000 outlier among ones: only its own block (32 for MX, 16 for NVFP4) loses the small values."""
    cm = np.ones(64)
    cm[0] = 3000.0
    stat = make_stat("model.layers.2.mlp.down_proj", cm)
    # FP4 per-tensor: scale 3000/6 = 500, flush at 0.25 * 500 = 125 -> every 1.0 channel
    assert ol.layer_breakage(stat, "fp4_e2m1")["frac_channels_flushed"] == pytest.approx(63 / 64)
    # MXFP4: block 0 scale 2**(floor(log2 3000) - 2) = 512, flush 128 -> its 31 ones; block 1 scale 2**-2
    mx = ol.layer_breakage(stat, "mxfp4")
    assert mx["granularity"] == "block"
    assert mx["frac_channels_flushed"] == pytest.approx(31 / 64)
    assert mx["expected_saturation"] == 0.0
    # NVFP4: 16-element blocks, ideal scale amax/6 -> only the outlier's 15 neighbours flush
    assert ol.layer_breakage(stat, "nvfp4")["frac_channels_flushed"] == pytest.approx(15 / 64)


@given(
    values=st.lists(st.floats(0.0, 1e4), min_size=1, max_size=64),
    fmt=st.sampled_from(["int8", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1"]),
)
@settings(max_examples=150, deadline=None)
def test_one_block_spanning_k_equals_per_tensor(values: list[float], fmt: str) -> None:
    """The per-channel (block) path and the shared-scale path agree when one tile covers all of K."""
    stat = make_stat("model.layers.0.mlp.down_proj", values)
    tensor = ol.layer_breakage(stat, fmt, "tensor")
    block = ol.layer_breakage(stat, fmt, "block", block_size=len(values))
    for key in ("frac_channels_flushed", "worst_rel_error", "flush_threshold", "scale_amax"):
        assert block[key] == pytest.approx(tensor[key]), key


def test_breakage_token_granularity_uses_median_token() -> None:
    cm = [254.0, 0.9, 0.05, 0.2]
    stat = make_stat("model.layers.0.mlp.down_proj", cm, token_max={"p50": 25.4, "p99": 200.0})
    row = ol.layer_breakage(stat, "int8", "token")
    assert row["scale_amax"] == pytest.approx(25.4)
    assert row["flush_threshold"] == pytest.approx(0.1)
    assert row["frac_channels_flushed"] == pytest.approx(1 / 4)  # only 0.05


def test_breakage_table_columns_and_rows() -> None:
    stats = {
        "a": make_stat("model.layers.0.self_attn.q_proj", [1.0, 2.0, 30.0]),
        "b": make_stat("model.layers.1.self_attn.q_proj", [1.0, 2.0, 3.0]),
    }
    table = ol.breakage_table(stats, formats=("int8", "fp8_e4m3"))
    assert tuple(table) == ol.BREAKAGE_COLUMNS
    assert all(len(v) == 4 for v in table.values())
    assert list(table["format"]) == ["int8", "fp8_e4m3", "int8", "fp8_e4m3"]
    with pytest.raises(ValueError, match="granularity"):
        ol.breakage_table(stats, granularity="channel")


# --------------------------------------------------------------------------- saturation
def _hist(bins: dict[int, int]) -> np.ndarray:
    h = np.zeros(HIST_BINS, dtype=np.int64)
    for i, c in bins.items():
        h[i] = c
    return h


def test_expected_saturation_from_histogram_tail() -> None:
    edges = hist_edges()
    hist = _hist({100: 90, 110: 10})
    clip = float(edges[105])  # between the two populated bins
    stat = make_stat("x.layers.0.q", [float(edges[111])], token_max={"p99": clip}, hist=hist)
    assert ol.expected_saturation(stat) == pytest.approx(10 / 100)
    # zeros are values too: they join the denominator
    stat_z = make_stat("x.layers.0.q", [float(edges[111])], token_max={"p99": clip}, hist=hist, zeros=100)
    assert ol.expected_saturation(stat_z) == pytest.approx(10 / 200)
    # a clip in the middle (in log2) of bin 110 counts half of it
    mid = math.sqrt(edges[110] * edges[111])
    assert ol.fraction_above(stat, mid) == pytest.approx(5 / 100)


def test_expected_saturation_zero_without_percentile_or_at_amax() -> None:
    hist = _hist({100: 90, 110: 10})
    assert ol.expected_saturation(make_stat("q", [5.0], hist=hist)) == 0.0
    assert ol.expected_saturation(make_stat("q", [5.0], token_max={"p99": 5.0}, hist=hist)) == 0.0


# --------------------------------------------------------------------------- histogram, grids
def test_histogram_frame_drops_empty_tails_only() -> None:
    stat = make_stat("q", [1.0], hist=_hist({10: 3, 12: 5}))
    h = ol.histogram_frame(stat)
    edges = hist_edges()
    assert list(h["count"]) == [3, 0, 5]
    np.testing.assert_allclose(h["lo"], edges[10:13])
    np.testing.assert_allclose(h["hi"], edges[11:14])
    np.testing.assert_allclose(h["center"], np.sqrt(edges[10:13] * edges[11:14]))
    assert ol.histogram_frame(make_stat("q", [1.0]))["count"].size == 0


def test_format_grid_int8() -> None:
    g = ol.format_grid("int8", 254.0)
    np.testing.assert_allclose(g.values, 2.0 * np.arange(1, 128))
    assert g.clip == 254.0 and g.scale == 2.0 and g.flush == 1.0


def test_format_grid_e4m3_and_fp4() -> None:
    g = ol.format_grid("fp8_e4m3", 448.0)
    assert g.values.size == 126  # 7 subnormals + 119 normals (0 left out)
    assert g.values[0] == 2.0**-9 and g.values[-1] == 448.0
    assert g.flush == 2.0**-10
    g4 = ol.format_grid("fp4_e2m1", 12.0)
    np.testing.assert_allclose(g4.values, 2.0 * np.array([0.5, 1, 1.5, 2, 3, 4, 6]))
    assert g4.clip == 12.0


def test_format_grid_mx_power_of_two_scale() -> None:
    g = ol.format_grid("mxfp4", 5.0)  # floor(log2 5) - emax(E2M1) = 2 - 2 -> scale 1
    assert g.scale == 1.0 and g.clip == 6.0 and g.flush == 0.25
    g = ol.format_grid("mxfp4", 3000.0)  # 2**(11 - 2) = 512: clip 3072 sits above the amax
    assert g.scale == 512.0 and g.clip == 3072.0
    g = ol.format_grid("mxfp4", 7.9)  # scale 1: the block max clips at 6
    assert g.clip == 6.0
    assert ol.format_grid("nvfp4", 12.0).scale == 2.0


def test_representative_amax() -> None:
    stat = make_stat("q", [10.0, 1.0, 2.0, 3.0], token_max={"p50": 2.5})
    assert ol.representative_amax(stat, "tensor") == 10.0
    assert ol.representative_amax(stat, "token") == 2.5
    with pytest.raises(ValueError, match="granularity"):
        ol.representative_amax(stat, "row")


# --------------------------------------------------------------------------- downsampling
def test_downsample_keeps_max_and_top_k() -> None:
    rng = np.random.default_rng(0)
    cm = rng.lognormal(size=20_000)
    planted = [123, 9_999, 19_998]
    cm[planted] = [3000.0, 2000.0, 1000.0]
    idx = ol.downsample_channels(cm, max_points=500, top_k=10)
    assert idx.size <= 500
    assert np.all(np.diff(idx) > 0)
    assert set(planted) <= set(idx.tolist())
    assert set(np.argsort(-cm)[:10].tolist()) <= set(idx.tolist())
    assert cm[idx].max() == cm.max()


def test_downsample_small_input_returns_everything() -> None:
    np.testing.assert_array_equal(ol.downsample_channels(np.ones(7), max_points=10), np.arange(7))


@given(
    values=st.lists(st.floats(0.0, 1e4), min_size=1, max_size=400),
    max_points=st.integers(1, 50),
    top_k=st.integers(0, 10),
)
@settings(max_examples=150, deadline=None)
def test_downsample_properties(values: list[float], max_points: int, top_k: int) -> None:
    cm = np.asarray(values)
    idx = ol.downsample_channels(cm, max_points=max_points, top_k=top_k)
    assert 1 <= idx.size <= max_points
    assert cm[idx].max() == cm.max()
    assert idx.min() >= 0 and idx.max() < cm.size


# --------------------------------------------------------------------------- overview, depth
def test_overview_table() -> None:
    stats = [
        make_stat("model.layers.0.mlp.down_proj", [1.0, 1.0, 2.0, 1.0, 3000.0]),
        make_stat("lm_head", [0.0, 0.0, 0.0, 1.0]),
    ]
    t = ol.overview_table(stats)
    assert list(t) == ["layer", "block", "proj", "in_features", "outlier_ratio", "amax", "median_channel_max"]
    assert list(t["block"]) == [0, -1]
    assert list(t["proj"]) == ["down_proj", "lm_head"]
    assert t["outlier_ratio"][0] == pytest.approx(3000.0)
    assert t["median_channel_max"][0] == 1.0
    assert t["outlier_ratio"][1] == math.inf  # median channel 0


def test_depth_table_bins_keep_the_persistent_channel() -> None:
    stats = []
    for b in (2, 0, 1):
        cm = np.ones(10)
        cm[7] = 100.0 * (b + 1)
        stats.append(make_stat(f"model.layers.{b}.mlp.down_proj", cm))
    stats.append(make_stat("model.layers.0.mlp.up_proj", np.full(10, 9.0)))
    t = ol.depth_table(stats, "down_proj", max_points=15)
    assert t["block"].size == 15  # 3 blocks x 5 bins
    assert list(t["block"][::5]) == [0, 1, 2]
    hot = t["argmax_channel"] == 7
    assert hot.sum() == 3  # one bin per block holds channel 7
    np.testing.assert_allclose(t["channel_max"][hot], [100.0, 200.0, 300.0])
    assert np.all((t["ch_lo"][hot] <= 7) & (t["ch_hi"][hot] > 7))
    assert ol.depth_table(stats, "q_proj")["block"].size == 0


def test_module_is_torch_free() -> None:
    import subprocess
    import sys

    code = "import sys, quantcore.evaluation.outliers; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_shared_expert_inputs_keep_a_blocks_gate_up_once_only_when_they_are_one_input() -> None:
    def stat(name: str, channel_max: list[float]) -> LayerStats:
        cm = np.asarray(channel_max, dtype=np.float32)
        return LayerStats(name=name, in_features=cm.size, out_features=4, n_tokens=8, channel_max=cm,
                          weight_channel_max=np.ones_like(cm), hist_counts=np.zeros(HIST_BINS, dtype=np.int64))

    block = "model.layers.0.mlp.experts"
    same = [stat(f"{block}.{e}.{p}", [1.0, 5.0]) for e in range(3) for p in ("gate_proj", "up_proj")]
    downs = [stat(f"{block}.{e}.down_proj", [1.0, float(e + 2)]) for e in range(3)]
    old = [stat(f"model.layers.1.mlp.experts.{e}.gate_proj", [1.0, float(e + 2)]) for e in range(2)]  # routed only
    dense = [stat("model.layers.0.self_attn.q_proj", [1.0, 2.0]), stat("model.layers.0.self_attn.k_proj", [1.0, 2.0])]
    kept, stands_for = ol.shared_expert_inputs(dense + same + downs + old)
    assert stands_for == {f"{block}.0.gate_proj": 6}
    assert [s.name for s in kept] == [s.name for s in dense] + [f"{block}.0.gate_proj"] + [s.name for s in downs + old]
    assert ol.shared_expert_inputs(dense) == (dense, {})  # q/k/v of a dense model are layers of their own here
