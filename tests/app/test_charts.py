"""Chart builders of app/charts.py, checked on their Vega-Lite dicts.

Each builder is fed a DataFrame and its ``to_dict()`` is inspected: mark types,
encodings, log scales, threshold rule values (hand-computed from the reference texts:
INT8 per-tensor flush amax/127/2, E4M3 smallest subnormal 2**-9 * amax/448), the
selection param of the overview, and a bound on embedded data rows.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import altair as alt
import numpy as np
import pandas as pd
import pytest

from app.charts import base as chart_base
from app.charts import kernels as kernel_charts
from app.charts import outliers as outlier_charts
from app.charts import results as result_charts
from quantcore.evaluation import outliers as ol
from quantcore.evaluation.stats import HIST_BINS, LayerStats, hist_edges


# --------------------------------------------------------------------------- helpers
def make_stat(name: str, channel_max, weight_max=None, token_max=None, hist=None) -> LayerStats:
    cm = np.asarray(channel_max, dtype=np.float32)
    return LayerStats(
        name=name,
        in_features=cm.size,
        out_features=8,
        n_tokens=64,
        channel_max=cm,
        weight_channel_max=np.full_like(cm, 0.05)
        if weight_max is None
        else np.asarray(weight_max, np.float32),
        token_max=token_max or {},
        hist_counts=np.zeros(HIST_BINS, dtype=np.int64) if hist is None else hist,
    )


def spec_of(chart: alt.TopLevelMixin) -> dict[str, Any]:
    spec = chart.to_dict()
    json.dumps(spec, allow_nan=False)  # Vega needs strict JSON: no NaN / Infinity anywhere
    return spec


def views(spec: dict[str, Any], data: dict[str, Any] | None = None) -> Iterator[dict[str, Any]]:
    """Every unit view (a dict with a mark) of a possibly layered / concatenated spec.

    A view that inherits its data from an enclosing layer gets that ``data`` filled in.
    """
    data = spec.get("data", data)
    if "mark" in spec:
        yield {**spec, "data": data} if data is not None else spec
    for key in ("layer", "hconcat", "vconcat", "concat"):
        for sub in spec.get(key, []):
            yield from views(sub, data)


def mark_type(view: dict[str, Any]) -> str:
    mark = view["mark"]
    return mark if isinstance(mark, str) else mark["type"]


def data_rows(spec: dict[str, Any], view: dict[str, Any]) -> list[dict[str, Any]]:
    return spec["datasets"][view["data"]["name"]]


def total_rows(spec: dict[str, Any]) -> int:
    return sum(len(rows) for rows in spec.get("datasets", {}).values())


def view_with(spec: dict[str, Any], mark: str, field: str | None = None) -> dict[str, Any]:
    found = [
        v
        for v in views(spec)
        if mark_type(v) == mark
        and (field is None or any(e.get("field") == field for e in v["encoding"].values()))
    ]
    assert found, f"no {mark} view{f' encoding {field}' if field else ''}"
    return found[0]


def synthetic_model(
    n_blocks: int = 30, hidden: int = 576, mlp: int = 1536, seed: int = 0
) -> list[LayerStats]:
    rng = np.random.default_rng(seed)
    out = []
    for b in range(n_blocks):
        for proj, k in (("self_attn.q_proj", hidden), ("self_attn.o_proj", hidden), ("mlp.down_proj", mlp)):
            cm = rng.lognormal(0.0, 0.3, size=k)
            if proj == "mlp.down_proj":
                cm[17] = 3000.0 if b == 11 else 50.0
            out.append(make_stat(f"model.layers.{b}.{proj}", cm, token_max={"p50": 1.0, "p99": 2.0}))
    out.append(make_stat("lm_head", rng.lognormal(0.0, 0.3, size=hidden)))
    return out


# --------------------------------------------------------------------------- overview
def test_overview_chart_encodings_and_selection() -> None:
    stats = synthetic_model()
    df = outlier_charts.overview_frame(stats)
    assert list(df.columns) == [
        "layer",
        "block",
        "proj",
        "in_features",
        "outlier_ratio",
        "amax",
        "median_channel_max",
        "median_zero",
    ]
    spec = spec_of(outlier_charts.overview_chart(df))
    assert mark_type(spec) == "circle"
    enc = spec["encoding"]
    assert enc["y"]["field"] == "outlier_ratio" and enc["y"]["scale"]["type"] == "log"
    assert enc["x"]["field"] == "proj" and enc["x"]["sort"] == ["q_proj", "o_proj", "down_proj", "lm_head"]
    # blocks by colour; lm_head (block -1) grey, and in the middle of its column rather than at block 0's place
    assert enc["color"]["field"] == "block" and enc["color"]["type"] == "quantitative"
    assert enc["color"]["scale"]["domainMin"] == 0 and enc["color"]["scale"]["clamp"]
    assert enc["color"]["condition"] == {"test": "datum.block < 0", "value": chart_base.OUTSIDE_BLOCKS_COLOR}
    assert enc["xOffset"]["field"] == "slot"
    slots = {r["layer"]: (r["block"], r["slot"]) for r in data_rows(spec, spec)}
    top = max(b for b, _ in slots.values())
    assert slots["lm_head"] == (-1, top // 2)
    assert all(slot == block for layer, (block, slot) in slots.items() if layer != "lm_head")
    (param,) = spec["params"]
    assert param["name"] == "layer_pick"
    assert param["select"]["type"] == "point" and param["select"]["fields"] == ["layer"]
    rows = data_rows(spec, spec)
    assert len(rows) == len(stats) and "layer" in rows[0]
    worst = max(rows, key=lambda r: r["outlier_ratio"])
    assert worst["layer"] == "model.layers.11.mlp.down_proj"


def test_overview_frame_caps_infinite_ratio() -> None:
    df = outlier_charts.overview_frame([make_stat("model.layers.0.self_attn.q_proj", [0, 0, 0, 2.0])])
    assert bool(df["median_zero"].iloc[0])
    assert df["outlier_ratio"].iloc[0] == chart_base.OUTLIER_RATIO_CAP
    spec_of(outlier_charts.overview_chart(df))


def test_overview_frame_bounds_mixture_of_experts() -> None:
    stats = [
        make_stat(f"model.layers.{b}.mlp.experts.{e}.down_proj", [1.0, 1.0, 1.0 + e + 100 * (e == 5)])
        for b in range(20)
        for e in range(64)
    ]
    df = outlier_charts.overview_frame(stats, max_points=100)
    assert len(df) <= 100
    assert len(df) == 20  # one per (block, proj)
    assert set(df["layer"]) == {f"model.layers.{b}.mlp.experts.5.down_proj" for b in range(20)}


# --------------------------------------------------------------------------- channels
def test_channels_chart_thresholds_and_labels() -> None:
    amax = 3000.0
    cm = np.ones(1536)
    cm[[17, 100, 200, 300, 400, 500]] = [amax, 40.0, 30.0, 20.0, 10.0, 5.0]
    stat = make_stat("model.layers.11.mlp.down_proj", cm)
    spec = spec_of(
        outlier_charts.channels_chart(outlier_charts.channels_frame(stat), outlier_charts.thresholds_frame(stat.amax),
                                      top_k=5)
    )
    rules = view_with(spec, "rule")
    values = {r["label"]: r["value"] for r in data_rows(spec, rules)}
    assert values["INT8 per-tensor flush"] == pytest.approx(amax / 127 / 2)  # 11.81
    assert values["E4M3 min subnormal"] == pytest.approx(2.0**-9 * amax / 448)  # 0.0131
    assert rules["encoding"]["color"]["scale"]["domain"] == ["INT8 per-tensor flush", "E4M3 min subnormal"]
    for v in views(spec):
        assert v["encoding"]["y"]["scale"]["type"] == "log"
    points = view_with(spec, "circle")
    assert points["encoding"]["x"]["field"] == "channel"
    assert len(data_rows(spec, points)) <= chart_base.CHANNEL_POINTS < 1536  # max-preserving downsampling
    labels = text_rows(spec)
    assert sorted(r["channel"] for r in labels["left"]) == [17, 100, 200, 300, 400] and not labels["right"]
    assert any(r["text"].startswith("ch 17: 3e+03") for r in labels["left"])
    # 200 (30) lies within the label of 100 (40) and a fraction of a decade from it: a level up; 300 (20) clears
    # 100's label, and 400 (10) meets 300's
    up = -4 - chart_base.LABEL_STEP_PX
    assert {r["channel"]: r["dy"] for r in labels["left"]} == {17: -4, 100: -4, 200: up, 300: -4, 400: up}
    # a top channel in the last fifth is labelled leftwards of its point, so the label stays on the chart
    cm[1487] = 1140.0
    stat = make_stat("model.layers.11.mlp.down_proj", cm)
    spec = spec_of(outlier_charts.channels_chart(outlier_charts.channels_frame(stat),
                                                 outlier_charts.thresholds_frame(stat.amax), top_k=2))
    labels = text_rows(spec)
    assert [r["channel"] for r in labels["left"]] == [17] and [r["channel"] for r in labels["right"]] == [1487]


def text_rows(spec: dict) -> dict[str, list[dict]]:
    """{"left": rows, "right": rows} of a chart's text marks, each row with its mark's dy."""
    out: dict[str, list[dict]] = {"left": [], "right": []}
    for v in views(spec):
        if mark_type(v) == "text":
            out[v["mark"]["align"]] += [{**r, "dy": v["mark"]["dy"]} for r in data_rows(spec, v)]
    return out


def test_label_levels_stack_only_labels_that_would_overlap() -> None:
    # x 0 and 50 overlap (span 100) at one y: the second goes up; x 500 is clear; y 100x apart never meet
    assert outlier_charts.label_levels([0, 50, 500, 60], [10, 10, 10, 1000], [False] * 4, span=100) == [0, 1, 0, 0]
    # a leftward label covers [x - span, x]: 150 leftwards meets 100 rightwards [100, 200]
    assert outlier_charts.label_levels([100, 150], [5, 5], [False, True], span=100) == [0, 1]
    assert outlier_charts.label_levels([100, 350], [5, 5], [False, True], span=100) == [0, 0]


def test_channels_chart_bounded_for_wide_layers() -> None:
    rng = np.random.default_rng(1)
    cm = rng.lognormal(size=50_000)
    cm[31_337] = 1e4
    stat = make_stat("model.layers.0.mlp.down_proj", cm)
    spec = spec_of(outlier_charts.channels_chart(outlier_charts.channels_frame(stat),
                                                 outlier_charts.thresholds_frame(stat.amax)))
    rows = data_rows(spec, view_with(spec, "circle"))
    assert len(rows) <= chart_base.CHANNEL_POINTS
    assert max(r["channel_max"] for r in rows) == pytest.approx(1e4)
    # a raw, too long frame is downsampled by the builder itself
    raw = pd.DataFrame({"channel": np.arange(cm.size), "channel_max": cm})
    spec = spec_of(outlier_charts.channels_chart(raw, outlier_charts.thresholds_frame(stat.amax), max_points=300))
    assert len(data_rows(spec, view_with(spec, "circle"))) <= 300


def test_channels_frame_leaves_out_dead_channels() -> None:
    df = outlier_charts.channels_frame(make_stat("q", [0.0, 1.0, 5.0, 0.0]))
    assert list(df["channel"]) == [1, 2]
    assert list(df["rank"]) == [2, 1]


def test_channels_chart_rejects_missing_columns() -> None:
    with pytest.raises(ValueError, match="channel_max"):
        outlier_charts.channels_chart(pd.DataFrame({"channel": [1]}), outlier_charts.thresholds_frame(1.0))


# --------------------------------------------------------------------------- depth heatmap
def test_depth_heatmap_bounded_and_log_colour() -> None:
    stats = synthetic_model()
    df = outlier_charts.depth_frame(stats, "down_proj")
    assert len(df) <= chart_base.HEATMAP_MAX_CELLS
    assert df["block"].nunique() == 30
    spec = spec_of(outlier_charts.depth_heatmap(df, "down_proj"))
    assert mark_type(spec) == "rect"
    assert spec["encoding"]["color"]["scale"]["type"] == "log"
    assert spec["encoding"]["y"]["field"] == "block"
    assert spec["encoding"]["x"]["field"] == "ch_lo" and spec["encoding"]["x2"]["field"] == "ch_hi"
    rows = data_rows(spec, spec)
    assert len(rows) <= chart_base.HEATMAP_MAX_CELLS
    hot = [r for r in rows if r["argmax_channel"] == 17]
    assert len(hot) == 30  # the planted channel stays the max of its bin at every depth
    assert max(r["channel_max"] for r in hot) == pytest.approx(3000.0)


def test_depth_heatmap_refuses_unbounded_frame() -> None:
    df = pd.DataFrame({"block": 0, "ch_lo": np.arange(6000), "ch_hi": np.arange(1, 6001), "channel_max": 1.0})
    with pytest.raises(ValueError, match="limit"):
        outlier_charts.depth_heatmap(df)


# --------------------------------------------------------------------------- SmoothQuant
def test_smoothquant_chart_steps_and_panels() -> None:
    view = ol.smoothquant_view(np.array([1.3, 0.9, 58.0]), np.array([0.42, 0.55, 0.020]), 0.5)
    points, steps = outlier_charts.smoothquant_frame(view)
    assert len(points) == 12  # 3 channels x before/after x activation/weight
    spec = spec_of(outlier_charts.smoothquant_chart(points, steps, 0.5))
    assert len(spec["hconcat"]) == 2
    assert spec["resolve"]["scale"]["y"] == "shared"
    step_rows = [r for v in views(spec) if mark_type(v) == "rule" for r in data_rows(spec, v)]
    got = {(r["stage"], r["tensor"]): r["step"] for r in step_rows}
    assert got[("before", "activation")] == pytest.approx(58.0 / 127)
    assert got[("before", "weight")] == pytest.approx(0.55 / 127)
    assert got[("after", "activation")] == pytest.approx(np.sqrt(58.0 * 0.020) / 127)
    # every rule named in words at the last channel, in its tensor's colour, over a white halo; the activation's
    # above its line, the weight's below
    texts = [v for v in views(spec) if mark_type(v) == "text"]
    names = [{**r, "dy": v["mark"]["dy"]} for v in texts if "color" in v["encoding"] for r in data_rows(spec, v)]
    halos = [r for v in texts if v["mark"].get("stroke") == "white" for r in data_rows(spec, v)]
    assert sorted((r["stage"], r["text"]) for r in names) == sorted(
        (stage, f"{tensor} INT8 step {step:.3g}") for (stage, tensor), step in got.items())
    assert sorted(r["text"] for r in halos) == sorted(r["text"] for r in names)
    assert {r["channel"] for r in names} == {2}
    for stage in ("before", "after"):  # the larger step's name above its line, the smaller's below: never overlapping
        here = sorted((r for r in names if r["stage"] == stage), key=lambda r: -r["step"])
        assert [r["dy"] < 0 for r in here] == [True, False]
    # at α = 0.5 the smoothed steps meet; the weight's a hair above the activation's is named above it
    close = pd.DataFrame({"stage": ["before", "before", "after", "after"], "tensor": ["activation", "weight"] * 2,
                          "step": [1.0, 0.01, 0.100, 0.101]})
    spec = spec_of(outlier_charts.smoothquant_chart(points, close, 0.5))
    after = [{**r, "dy": v["mark"]["dy"]} for v in views(spec["hconcat"][1]) if mark_type(v) == "text"
             for r in spec["datasets"][v["data"]["name"]]]
    assert {r["tensor"]: r["dy"] < 0 for r in after} == {"weight": True, "activation": False}
    for v in views(spec):
        assert v["encoding"]["y"]["scale"]["type"] == "log"
    assert "0.50" in spec["hconcat"][1]["title"]


def test_smoothquant_frame_bounded() -> None:
    rng = np.random.default_rng(2)
    act, w = rng.lognormal(size=8192), rng.lognormal(size=8192) * 0.01
    act[4000] = 5000.0
    points, _ = outlier_charts.smoothquant_frame(ol.smoothquant_view(act, w, 0.5), max_points=1000)
    assert len(points) <= 1000
    assert 4000 in set(points["channel"])


def test_alpha_sweep_chart_marks_chosen_alpha() -> None:
    sweep = pd.DataFrame(ol.alpha_sweep(np.array([100.0, 0.1, 0.2]), np.array([0.01, 0.5, 0.4])))
    spec = spec_of(outlier_charts.alpha_sweep_chart(sweep, 0.65))
    chosen = view_with(spec, "rule")
    assert data_rows(spec, chosen) == [{"alpha": 0.65}]
    assert len(data_rows(spec, view_with(spec, "line"))) == 2 * len(ol.DEFAULT_ALPHAS)


# --------------------------------------------------------------------------- histogram
def _hist_stat(amax: float) -> LayerStats:
    h = np.zeros(HIST_BINS, dtype=np.int64)
    h[60:100] = np.arange(1, 41)
    return make_stat("model.layers.3.mlp.down_proj", [amax, 1.0], hist=h)


def test_histogram_chart_grid_clip_and_flush() -> None:
    amax = 254.0
    stat = _hist_stat(amax)
    hist = outlier_charts.hist_frame(stat)
    assert len(hist) == 40 and hist["share"].sum() == pytest.approx(1.0)
    grid = ol.format_grid("int8", amax)
    lo, hi = float(hist["lo"].min()), float(hist["hi"].max())
    spec = spec_of(outlier_charts.histogram_chart(hist, outlier_charts.grid_frame(grid, lo, hi), "INT8"))
    bars = view_with(spec, "rect")
    assert bars["encoding"]["x"]["scale"]["type"] == "log"
    assert bars["encoding"]["y"]["scale"]["type"] == "symlog"
    rule_rows = data_rows(spec, view_with(spec, "rule"))
    by_kind: dict[str, list[float]] = {}
    for r in rule_rows:
        by_kind.setdefault(r["kind"], []).append(r["value"])
    assert by_kind["clipping point"] == [amax]
    assert by_kind["flush to zero"] == [pytest.approx(amax / 254)]
    rep = by_kind["representable"]
    assert all(lo <= v <= hi for v in rep)
    expected = [2.0 * k for k in range(1, 128) if lo <= 2.0 * k <= hi]
    assert rep == pytest.approx(expected)


def test_histogram_chart_e4m3_grid() -> None:
    amax = 448.0
    grid = outlier_charts.grid_frame(ol.format_grid("fp8_e4m3", amax))
    assert (grid["kind"] == "representable").sum() == 126
    assert grid.loc[grid["kind"] == "flush to zero", "value"].item() == 2.0**-10
    spec = spec_of(outlier_charts.histogram_chart(outlier_charts.hist_frame(_hist_stat(amax)), grid, "FP8 E4M3"))
    assert total_rows(spec) <= chart_base.MAX_MARKS


def test_hist_edges_agree_with_frame() -> None:
    hist = outlier_charts.hist_frame(_hist_stat(1.0))
    assert hist["lo"].iloc[0] == hist_edges()[60]


# --------------------------------------------------------------------------- scoring page
def test_kl_distribution_chart_bins_and_means() -> None:
    rng = np.random.default_rng(3)
    df = pd.concat(
        [
            pd.DataFrame({"kl": rng.lognormal(-4, 1, 50_000), "label": "fp8_e4m3"}),
            pd.DataFrame({"kl": np.r_[rng.lognormal(-1, 1, 49_999), 0.0], "label": "int8 per-tensor"}),
        ]
    )
    spec = spec_of(result_charts.kl_distribution_chart(df))
    line = view_with(spec, "line")
    assert line["encoding"]["x"]["scale"]["type"] == "log"
    assert len(data_rows(spec, line)) == 2 * chart_base.KL_BINS
    shares = pd.DataFrame(data_rows(spec, line)).groupby("label")["share"].sum()
    assert shares.to_numpy() == pytest.approx([1.0, 1.0])
    means = {r["label"]: r["mean"] for r in data_rows(spec, view_with(spec, "rule"))}
    assert means["fp8_e4m3"] == pytest.approx(df[df["label"] == "fp8_e4m3"]["kl"].mean())


def test_kl_by_position_chart_bounded() -> None:
    df = pd.DataFrame({"position": np.arange(100_000), "kl": np.linspace(0.0, 1.0, 100_000)})
    spec = spec_of(result_charts.kl_by_position_chart(df, max_points=1000))
    rows = data_rows(spec, spec)
    assert len(rows) <= 1000
    assert spec["encoding"]["y"]["scale"]["type"] == "log"
    assert np.mean([r["kl"] for r in rows]) == pytest.approx(0.5, rel=1e-6)  # equal buckets keep the mean
    assert min(r["kl_plot"] for r in rows) >= chart_base.KL_FLOOR


def test_sensitivity_chart_sorted_top_n() -> None:
    df = pd.DataFrame(
        {
            "layer": [f"model.layers.{i}.mlp.down_proj" for i in range(100)],
            "kl": np.arange(100) / 100,
            "proj": "down_proj",
        }
    )
    spec = spec_of(result_charts.sensitivity_chart(df, top_n=10))
    assert mark_type(spec) == "bar"
    assert spec["encoding"]["y"]["field"] == "layer" and spec["encoding"]["y"]["sort"] == "-x"
    rows = data_rows(spec, spec)
    assert len(rows) == 10
    assert {r["layer"] for r in rows} == {f"model.layers.{i}.mlp.down_proj" for i in range(90, 100)}


def test_sensitivity_by_scheme_one_panel_per_scheme_with_the_head_last() -> None:
    df = pd.DataFrame(
        {
            "scheme": ["INT8_PER_TENSOR"] * 4 + ["FP8_DYNAMIC"] * 4,
            "unit": ["model.layers.10.mlp.down_proj", "model.layers.2.mlp.down_proj",
                     "model.layers.2.self_attn.{q,k,v}_proj", "lm_head"] * 2,
            "block": [10, 2, 2, None] * 2,
            "proj": ["down_proj", "down_proj", "q_proj/k_proj/v_proj", "lm_head"] * 2,
            "kl": [0.3, 0.0, 0.01, 0.02, 0.001, 0.002, 0.003, 0.004],
        }
    )
    spec = spec_of(result_charts.sensitivity_by_scheme(df))
    enc = spec["encoding"]
    assert mark_type(spec) == "rect" and enc["row"]["field"] == "scheme"
    assert enc["x"]["sort"] == ["2", "10", result_charts.HEAD_BLOCK]  # blocks numerically, the head column last
    assert enc["y"]["sort"] == ["q_proj/k_proj/v_proj", "down_proj", "lm_head"]  # projections in model order
    assert enc["color"]["scale"]["type"] == "log"
    rows = data_rows(spec, spec)
    assert len(rows) == 8
    zero = next(r for r in rows if r["scheme"] == "INT8_PER_TENSOR" and r["col"] == "2" and r["proj"] == "down_proj")
    assert zero["kl"] == 0.0 and zero["kl_plot"] == chart_base.KL_FLOOR  # a log scale cannot draw 0
    assert {r["col"] for r in rows if r["proj"] == "lm_head"} == {result_charts.HEAD_BLOCK}
    with pytest.raises(ValueError, match="needs columns"):
        result_charts.sensitivity_by_scheme(df.drop(columns=["proj"]))


# --------------------------------------------------------------------------- kernels page
def test_kernel_heatmap_speedup_and_unsupported() -> None:
    df = pd.DataFrame(
        {
            "shape": ["q_proj 576x576 M=512"] * 3 + ["down_proj 576x1536 M=512"] * 3,
            "path": ["fp8 per-tensor", "fp8 row-wise", "int8"] * 2,
            "speedup": [1.8, 1.7, np.nan, 1.9, 0.8, np.nan],
        }
    )
    spec = spec_of(kernel_charts.kernel_heatmap(df))
    rect = view_with(spec, "rect")
    scale = rect["encoding"]["color"]["scale"]
    assert scale["domainMid"] == 1.0 and scale["type"] == "log"
    assert scale["domain"] == pytest.approx([0.5, 2.0])  # symmetric in log, at least 0.5x .. 2x
    rows = data_rows(spec, rect)
    assert [r["text"] for r in rows] == ["1.80×", "1.70×", "n/a", "1.90×", "0.80×", "n/a"]
    # |log v| > 0.6 * log 2 (v > 1.516 or v < 0.660): white text on the dark cells only
    assert [r["text_color"] for r in rows] == ["white", "white", "black", "white", "black", "black"]
    assert total_rows(spec) == 6
    # a case with no time says why instead of "n/a", which means "not native"
    noted = df.assign(note=["", "", "", "", "", "skipped"])
    spec = spec_of(kernel_charts.kernel_heatmap(noted))
    assert [r["text"] for r in data_rows(spec, view_with(spec, "rect"))][-2:] == ["0.80×", "skipped"]


def test_peak_bars() -> None:
    df = pd.DataFrame(
        {"label": ["fp8 q_proj", "bf16 q_proj"], "pct_peak": [62.5, 71.0], "path": ["fp8", "bf16"]}
    )
    spec = spec_of(kernel_charts.peak_bars(df))
    bars = view_with(spec, "bar")
    assert bars["encoding"]["x"]["field"] == "pct_peak"
    assert data_rows(spec, view_with(spec, "rule")) == [{"pct_peak": 100.0}]
    assert spec["title"] == "Share of peak throughput"
    assert "title" not in spec_of(kernel_charts.peak_bars(df, title=""))  # under a page heading that says it already


def test_band_charts_size_by_row_not_by_total_height() -> None:
    # a fixed total height is shrunk by Streamlit's theme until row labels overlap and drop out;
    # a step per row keeps every shape / layer readable however many rows there are
    heat = pd.DataFrame({"shape": [f"s{i} M=1" for i in range(40)], "path": "fp8_row", "speedup": 1.5})
    assert spec_of(kernel_charts.kernel_heatmap(heat))["height"] == {"step": chart_base.KERNEL_ROW_PX}
    bars = pd.DataFrame({"label": [f"case {i}" for i in range(40)], "pct_peak": 50.0})
    assert spec_of(kernel_charts.peak_bars(bars))["height"] == {"step": 18}
    sens = pd.DataFrame({"layer": [f"model.layers.{i}.mlp.down_proj" for i in range(40)], "kl": 0.1})
    spec = spec_of(result_charts.sensitivity_chart(sens))
    assert spec["height"] == {"step": 16}
    assert spec["encoding"]["y"]["axis"] == {"labelLimit": 360, "labelOverlap": False}


# --------------------------------------------------------------------------- page bound
def test_every_outlier_chart_is_bounded_for_a_large_model() -> None:
    stats = synthetic_model(n_blocks=80, hidden=4096, mlp=14336)
    worst = max(stats, key=lambda s: s.outlier_ratio)
    view = ol.smoothquant_view(worst.channel_max, worst.weight_channel_max, 0.5)
    built = [
        outlier_charts.overview_chart(outlier_charts.overview_frame(stats)),
        outlier_charts.channels_chart(outlier_charts.channels_frame(worst),
                                      outlier_charts.thresholds_frame(worst.amax)),
        outlier_charts.depth_heatmap(outlier_charts.depth_frame(stats, "down_proj")),
        outlier_charts.smoothquant_chart(*outlier_charts.smoothquant_frame(view), 0.5),
    ]
    for chart in built:
        assert total_rows(spec_of(chart)) <= chart_base.MAX_MARKS


def test_charts_module_is_torch_free() -> None:
    code = "import sys, app.charts; assert 'torch' not in sys.modules and 'streamlit' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_projection_order_puts_fusion_groups_with_their_first_member() -> None:
    got = chart_base.proj_sort(["lm_head", "down_proj", "gate_proj/up_proj", "q_proj/k_proj/v_proj", "o_proj", "zz"])
    assert got == ["q_proj/k_proj/v_proj", "o_proj", "gate_proj/up_proj", "down_proj", "lm_head", "zz"]


def test_tradeoff_chart_draws_costed_plans_and_joins_the_front() -> None:
    df = pd.DataFrame({"plan": ["BF16", "FP8_DYNAMIC", "W4A16", "INT8_PER_TENSOR", "NVFP4"],
                       "kl_mean": [0.0, 0.05, 0.9, 1.0, 0.7],
                       "decode_ms": [30.0, 20.0, 30.0, 21.0, np.nan],
                       "prefill_ms": [np.nan] * 5,
                       "front": [True, True, False, False, False],
                       "top1_agree": [1.0, 0.9, 0.5, 0.48, 0.55]})
    spec = spec_of(result_charts.tradeoff_chart(df, "decode_ms", "decode step (ms)"))
    points = view_with(spec, "circle")
    rows = data_rows(spec, points)
    assert [r["plan"] for r in rows] == ["BF16", "FP8_DYNAMIC", "W4A16", "INT8_PER_TENSOR"]  # NVFP4: no time
    assert all("prefill_ms" not in r for r in rows)  # only what the chart draws is embedded
    assert rows[0]["kl_mean"] == 0.0 and rows[0]["kl_plot"] == pytest.approx(0.005)  # log axis: a decade
    assert rows[1]["kl_plot"] == 0.05  # below the smallest positive KL; the tooltip keeps 0
    assert points["encoding"]["y"]["scale"]["type"] == "log"
    assert {r["where"] for r in rows if r["plan"] in ("BF16", "FP8_DYNAMIC")} == {"on the front"}
    line = view_with(spec, "line")
    assert [r["plan"] for r in data_rows(spec, line)] == ["FP8_DYNAMIC", "BF16"]  # the front, by cost
    assert line["mark"]["interpolate"] == "step-after"
    assert [r["plan"] for r in data_rows(spec, view_with(spec, "text"))] == ["FP8_DYNAMIC", "BF16"]  # labelled
    only_zero = spec_of(result_charts.tradeoff_chart(df.head(1), "decode_ms", "decode step (ms)"))
    assert data_rows(only_zero, view_with(only_zero, "circle"))[0]["kl_plot"] == chart_base.KL_FLOOR
    with pytest.raises(ValueError, match="front"):
        result_charts.tradeoff_chart(df.drop(columns="front"), "decode_ms", "decode step (ms)")


def test_kv_amax_chart_draws_k_and_v_per_block_against_the_e4m3_limit():
    kv = {"k": {"model.layers.0.self_attn": 21.5, "model.layers.1.self_attn": 900.0},
          "v": {"model.layers.0.self_attn": 3.0, "model.layers.1.self_attn": 0.0}}
    df = outlier_charts.kv_amax_frame(kv)
    assert list(df.columns) == ["layer", "block", "tensor", "amax"]
    assert sorted(zip(df["tensor"], df["block"], df["amax"], strict=True)) == [
        ("K", 0, 21.5), ("K", 1, 900.0), ("V", 0, 3.0), ("V", 1, 0.0)]
    spec = outlier_charts.kv_amax_chart(df).to_dict()
    points, rule, _ = spec["layer"]
    assert points["encoding"]["y"]["scale"]["type"] == "log"
    assert points["encoding"]["y"]["scale"]["domainMax"] == 1800.0  # room above the largest value
    # the all-zero V of block 1 is drawn at a positive floor (log axis), its tooltip keeps the true 0
    assert points["encoding"]["tooltip"][2]["field"] == "amax"
    rule_data = spec["datasets"][rule["data"]["name"]]
    assert rule_data[0]["y"] == 448.0
    assert outlier_charts.kv_amax_frame(None).empty and outlier_charts.kv_amax_frame({}).empty
    # a calibration that recorded Q (what FP8 attention quantizes) draws it as a third line
    with_q = outlier_charts.kv_amax_frame({**kv, "q": {"model.layers.0.self_attn": 30.0}})
    assert sorted(set(with_q["tensor"])) == ["K", "Q", "V"]
    assert with_q[with_q["tensor"] == "Q"]["amax"].tolist() == [30.0]


# --------------------------------------------------------------------------- issue #45: tooltips, one palette
def every_chart() -> dict[str, alt.TopLevelMixin]:
    """Every chart builder of the pages, fed a small frame of the shape its page feeds it."""
    stats = synthetic_model(n_blocks=4)
    worst = max(stats, key=lambda s: s.outlier_ratio)
    view = ol.smoothquant_view(worst.channel_max, worst.weight_channel_max, 0.5)
    hist = _hist_stat(10.0)
    hist_df = outlier_charts.hist_frame(hist)
    grid = ol.format_grid("int8", ol.representative_amax(hist, "tensor"), "tensor")
    sweep = pd.DataFrame({"alpha": [0.0, 0.5, 1.0], "error": [0.3, 0.1, 0.2], "act_flushed": [0.5, 0.1, 0.0],
                          "weight_flushed": [0.0, 0.1, 0.4]})
    kl = pd.DataFrame({"kl": [0.01, 0.02, 0.5, 0.03], "position": [0, 1, 0, 1],
                       "label": ["#3 fp8 v1", "#3 fp8 v1", "#4 fp8 v2", "#4 fp8 v2"]})
    sens = pd.DataFrame({"layer": ["a.q_proj", "a.down_proj"], "kl": [0.1, 0.2], "proj": ["q_proj", "down_proj"]})
    by_scheme = pd.DataFrame({"scheme": ["A", "B"], "block": [0, 0], "proj": ["q_proj", "q_proj"], "kl": [0.1, 0.2]})
    trade = pd.DataFrame({"plan": ["BF16", "FP8"], "kl_mean": [0.0, 0.05], "weight_mib": [200.0, 100.0],
                          "front": [True, True], "kl_mean_err": [np.nan, 0.01], "top1_agree": [1.0, 0.9]})
    pred = pd.DataFrame({"plan": ["auto"], "sensitivity": ["kl"], "predicted_kl": [0.1], "measured_kl": [0.12],
                         "measured_kl_err": [0.01], "model": ["m"]})
    heat = pd.DataFrame({"shape": ["q 1x1 M=1"] * 2, "path": ["int8", "fp8"], "speedup": [1.5, np.nan]})
    rot = [SimpleNamespace(fix=f, channel_max=np.array([3.0, 2.0, 1.0])) for f in ("none", "smoothed", "rotation")]
    return {
        "overview": outlier_charts.overview_chart(outlier_charts.overview_frame(stats)),
        "channels": outlier_charts.channels_chart(outlier_charts.channels_frame(worst),
                                                  outlier_charts.thresholds_frame(worst.amax)),
        "depth": outlier_charts.depth_heatmap(outlier_charts.depth_frame(stats, "down_proj")),
        "smoothquant": outlier_charts.smoothquant_chart(*outlier_charts.smoothquant_frame(view), 0.5),
        "alpha sweep": outlier_charts.alpha_sweep_chart(sweep, 0.5),
        "alpha choice": outlier_charts.alpha_choice_chart(sweep, 0.5, 0.5, "INT8_W8A8"),
        "histogram": outlier_charts.histogram_chart(hist_df, outlier_charts.grid_frame(grid), "int8"),
        "kv": outlier_charts.kv_amax_chart(outlier_charts.kv_amax_frame({"k": {"model.layers.0.self_attn": 2.0}})),
        "rotation": outlier_charts.rotation_chart(outlier_charts.rotation_frame(rot)),
        "kl distribution": result_charts.kl_distribution_chart(kl),
        "kl by position": result_charts.kl_by_position_chart(kl),
        "sensitivity": result_charts.sensitivity_chart(sens),
        "sensitivity by scheme": result_charts.sensitivity_by_scheme(by_scheme),
        "tradeoff": result_charts.tradeoff_chart(trade, "weight_mib", "linear weights (MiB)"),
        "prediction": result_charts.prediction_chart(pred),
        "kernel heatmap": kernel_charts.kernel_heatmap(kernel_charts.case_tooltips(heat)),
        "peak bars": kernel_charts.peak_bars(pd.DataFrame({"label": ["q"], "pct_peak": [50.0], "path": ["int8"]})),
    }


def encodings(spec: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for view in views(spec):
        yield view.get("encoding", {})
    for key in ("layer", "hconcat", "vconcat", "concat"):
        for sub in spec.get(key, []):
            if "mark" not in sub:
                yield from encodings(sub)
    if "spec" in spec:  # a faceted chart
        yield from encodings(spec["spec"])


def test_every_tooltip_names_its_field_for_a_person() -> None:
    """No raw column name (``median_channel_max``, ``kl_mean``) in a tooltip: every field has a title in words."""
    raw = []
    for name, chart in every_chart().items():
        for enc in encodings(spec_of(chart)):
            tips = enc.get("tooltip", [])
            for tip in tips if isinstance(tips, list) else [tips]:
                title = tip.get("title")
                if not title or "_" in title:  # "layer" may name the field "layer"; "kl_mean" names nothing
                    raw.append((name, tip.get("field"), title))
    assert not raw, raw


def colours(spec: Any) -> set[str]:
    """Every literal colour (#rrggbb) anywhere in a spec."""
    text = json.dumps(spec)
    return {m.upper() for m in __import__("re").findall(r"#[0-9a-fA-F]{6}", text)}


def test_every_chart_draws_from_the_one_colour_blind_safe_palette() -> None:
    allowed = {c.upper() for c in (*chart_base.PALETTE, chart_base.NEUTRAL, "#FFFFFF", "#333333")}
    schemes = {chart_base.SEQUENTIAL_SCHEME, chart_base.MAGNITUDE_SCHEME, chart_base.DIVERGING_SCHEME}
    for name, chart in every_chart().items():
        spec = spec_of(chart)
        assert colours(spec) <= allowed, (name, colours(spec) - allowed)
        used = set(__import__("re").findall(r'"scheme": "([a-z]+)"', json.dumps(spec)))
        assert used <= schemes, (name, used)


def test_runs_compared_get_distinct_palette_colours_and_a_legend_naming_plan_and_version() -> None:
    labels = [f"#{i} fp8-mlp v{i}" for i in (9, 10, 11)]  # job order, not the labels' string order
    kl = pd.DataFrame({"kl": [0.03, 0.01, 0.02], "position": [0, 0, 0], "label": labels[::-1]})
    for chart in (result_charts.kl_distribution_chart(kl), result_charts.kl_by_position_chart(kl)):
        color = next(e["color"] for e in encodings(spec_of(chart)) if "color" in e)
        assert color["title"] == result_charts.RUN_LEGEND and "version" in color["title"]
        assert color["scale"]["domain"] == labels
        assert color["scale"]["range"] == list(chart_base.PALETTE[:3])  # blue, orange, green: never two blues
        assert color["legend"]["labelLimit"] >= 400  # a label names job, plan and version in full
        assert color["legend"]["orient"] == "right"  # below, the legend would take the plot's height


def test_rotation_frame_keeps_the_head_of_each_curve_and_thins_its_tail() -> None:
    views_ = [SimpleNamespace(fix=f, channel_max=np.r_[1000.0, np.linspace(2.0, 1.0, 1535)]) for f in ("none", "rot")]
    df = outlier_charts.rotation_frame(views_, max_points=300)
    assert len(df) <= 300 and set(df["fix"]) == {"none", "rot"}
    none = df[df["fix"] == "none"]
    assert none["rank"].iloc[0] == 0 and none["channel_max"].iloc[0] == 1000.0  # the outlier kept
    assert none["rank"].iloc[-1] == 1535  # the smallest channel too
    assert list(none["rank"].iloc[:10]) == list(range(10))  # the head whole


def test_smoothquant_spec_of_every_alpha_differs_in_its_datasets_only() -> None:
    """Named datasets and one y axis for every α: a slider step sends the same spec with other data, which the
    browser redraws in place (issue #45); the data are what the unnamed chart draws at that α."""
    rng = np.random.default_rng(1)
    act, w = rng.lognormal(0, 1, 300), rng.lognormal(-3, 0.5, 300)
    act[7] = 500.0
    domain = outlier_charts.smoothquant_domain(act, w)
    specs = {}
    for alpha in (0.0, 0.55, 1.0):
        points, steps = outlier_charts.smoothquant_frame(ol.smoothquant_view(act, w, alpha))
        spec = spec_of(outlier_charts.smoothquant_chart(points, steps, alpha, domain=domain, named=True))
        assert "datasets" not in spec
        data = outlier_charts.smoothquant_datasets(points, steps)
        drawn = [v["data"]["name"] for v in views(spec)]
        assert sorted(set(drawn)) == sorted(data)  # every layer reads one of the datasets given
        values = [r["value"] for k, rows in data.items() if k.endswith("_dots") for r in rows]
        values += [r["step"] for k, rows in data.items() if k.endswith("_rules") for r in rows]
        assert domain[0] < min(values) and max(values) < domain[1]  # every α's points inside the one axis
        plain = spec_of(outlier_charts.smoothquant_chart(points, steps, alpha))
        plain_rows = sorted(str(r) for v in views(plain) for r in data_rows(plain, v))
        named_rows = sorted(str(r) for v in views(spec) for r in data[v["data"]["name"]])
        assert named_rows == plain_rows
        specs[alpha] = spec
    assert specs[0.0] == specs[0.55] == specs[1.0]
