"""Altair chart builders of quantplan's pages, and the small frame builders that feed them.

Pure functions: a DataFrame (or calibration statistics, for the ``*_frame`` helpers)
in, an ``alt.Chart`` out. No Streamlit calls, no torch: pages call these and hand the
result to ``st.altair_chart``. Every builder bounds what it embeds: no chart carries
more than :data:`MAX_MARKS` data rows (server-side aggregation or downsampling does the
rest), so a 100-layer model stays as fast as a small one.

Outliers page (issue 6):
    overview_frame / overview_chart      outlier ratio of every linear input, click to drill down
    channels_frame / thresholds_frame /
    channels_chart                       per-channel max of one layer with the flush thresholds
    depth_frame / depth_heatmap          block x channel max for one projection type
    smoothquant_frame / smoothquant_chart
    alpha_sweep_chart                    activation vs weight maxima before / after smoothing
    hist_frame / grid_frame /
    histogram_chart                      the |x| histogram with a format's grid and clipping point
    breakage_frame                       the "what will break" table (shown with st.dataframe)
Scoring and kernel pages:
    kl_histogram_frame / kl_distribution_chart, kl_by_position_chart, sensitivity_chart,
    kernel_heatmap, peak_bars, tradeoff_chart (KL of each scored plan against its cost)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import altair as alt
import numpy as np
import pandas as pd

from quantcore.evaluation import outliers as ol
from quantcore.evaluation.stats import LayerStats

# ---------------------------------------------------------------------------------------------
# Named constants
# ---------------------------------------------------------------------------------------------
MAX_MARKS = 5000  # hard bound on data rows embedded in one chart (Altair's own default limit)
DEFAULT_MAX_POINTS = ol.DEFAULT_MAX_POINTS  # 2000 channel points per chart
DEFAULT_TOP_K = 5  # channels labelled in the channels chart
HEATMAP_MAX_CELLS = 3000  # blocks x channel bins in the depth heatmap
OUTLIER_RATIO_CAP = 1e6  # plotted in place of an infinite ratio (median channel exactly 0)
KL_FLOOR = 1e-6  # KL values below this are drawn at it (log axes cannot show 0)
KL_BINS = 40  # log bins of the per-token KL histogram
SENSITIVITY_TOP_N = 40  # bars in the sensitivity chart
SELECTION_NAME = "layer_pick"  # point selection of the overview; Streamlit returns it on rerun
CHART_HEIGHT = 320
KERNEL_COLUMN_PX = 110  # width of one kernel-path column of the kernel heatmap
KERNEL_ROW_PX = 26  # height of one GEMM-shape row
KERNEL_MIN_EXTENT = 2.0  # the speed-up colour scale spans at least 0.5x .. 2x
KERNEL_DARK_SHARE = 0.6  # cells beyond this share of the log extent are dark: white text
OVERVIEW_HEIGHT = 420  # Streamlit fits a stretched chart into its height overall: its axes and labels take part of it
OUTSIDE_BLOCKS_COLOR = "#9e9e9e"  # lm_head and other layers outside the decoder blocks
SMOOTH_WIDTH = 360  # each of the two SmoothQuant panels: both fit a wide page's column with their axes
LABEL_FLIP_AT = 0.8  # channels chart: labels of points past this share of the channels read leftwards
LABEL_SPAN = 0.12  # channels chart: the share of the channel axis one label covers ("ch 1229: 3.12e+03")
LABEL_DECADES = 0.4  # ... and the decades of the log y axis it covers: labels closer on both stack upwards
LABEL_STEP_PX = 13  # ... by this many pixels a level
OVERVIEW_WIDTH = 720  # fixed: a band per projection x an offset per block would otherwise grow with depth

INT8_FLUSH_LABEL = "INT8 per-tensor flush"
E4M3_SUBNORMAL_LABEL = "E4M3 min subnormal"
THRESHOLD_COLORS = {INT8_FLUSH_LABEL: "#d62728", E4M3_SUBNORMAL_LABEL: "#2ca02c"}
SERIES_COLORS = {"activation": "#1f77b4", "weight": "#ff7f0e"}
GRID_KIND_COLORS = {"representable": "#9e9e9e", "clipping point": "#d62728", "flush to zero": "#ff7f0e"}

# Projection types in data-flow order; others follow alphabetically.
PROJ_ORDER = (
    "q_proj",
    "k_proj",
    "v_proj",
    "qkv_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "gate_up_proj",
    "down_proj",
    "lm_head",
)


def _proj_sort(projs: Iterable[str]) -> list[str]:
    """Projection types in model order; a fusion group ("q_proj/k_proj/v_proj") sorts as its first member."""

    def key(p: str) -> tuple[int, str]:
        first = p.split("/")[0]
        return (PROJ_ORDER.index(first) if first in PROJ_ORDER else len(PROJ_ORDER), p)

    return sorted(set(projs), key=key)


def _check_columns(df: pd.DataFrame, required: Sequence[str], what: str) -> None:
    missing = [c for c in required if c not in df.columns]
    if missing:
        raise ValueError(f"{what} needs columns {list(required)}; missing {missing} (got {list(df.columns)})")


def _positive_floor(values: Iterable[float], default: float = 1e-12) -> float:
    arr = np.asarray(list(values), dtype=np.float64)
    arr = arr[np.isfinite(arr) & (arr > 0)]
    return float(arr.min()) if arr.size else default


# =============================================================================================
# Outliers page: frames
# =============================================================================================
def overview_frame(
    stats: Iterable[LayerStats] | Mapping[str, LayerStats], max_points: int = DEFAULT_MAX_POINTS
) -> pd.DataFrame:
    """Outlier ratio of every linear input (one row per layer), ready for :func:`overview_chart`.

    Columns: layer, block (-1 outside the blocks), proj, in_features, outlier_ratio, amax,
    median_channel_max, median_zero. An infinite ratio (median channel exactly 0) is
    drawn at :data:`OUTLIER_RATIO_CAP` with ``median_zero`` set. With more than
    ``max_points`` layers (mixture-of-experts models), each (block, proj) keeps its
    worst layer, and then the ``max_points`` worst overall.
    """
    df = pd.DataFrame(ol.overview_table(stats))
    df = df[df["outlier_ratio"].notna()].copy()
    df["median_zero"] = ~np.isfinite(df["outlier_ratio"].to_numpy())
    df["outlier_ratio"] = df["outlier_ratio"].clip(upper=OUTLIER_RATIO_CAP)
    if len(df) > max_points:
        idx = df.groupby(["block", "proj"])["outlier_ratio"].idxmax()
        df = df.loc[idx]
        df = df.nlargest(max_points, "outlier_ratio")
    return df.sort_values(["block", "proj"]).reset_index(drop=True)


def channels_frame(
    stat: LayerStats, max_points: int = DEFAULT_MAX_POINTS, top_k: int = DEFAULT_TOP_K
) -> pd.DataFrame:
    """Per-channel max |x| of one layer: columns channel, channel_max, rank (1 = largest), is_top.

    Dead channels (max exactly 0) are left out: a log axis cannot draw them and they
    lose nothing to quantization. At most ``max_points`` rows (max-preserving downsampling).
    """
    cm = np.asarray(stat.channel_max, dtype=np.float64)
    order = np.argsort(-cm, kind="stable")
    rank = np.empty(cm.size, dtype=np.int64)
    rank[order] = np.arange(1, cm.size + 1)
    keep = ol.downsample_channels(cm, max_points=max_points, top_k=max(top_k, ol.DEFAULT_TOP_K))
    keep = keep[cm[keep] > 0]
    return pd.DataFrame(
        {
            "channel": keep.astype(np.int64),
            "channel_max": cm[keep],
            "rank": rank[keep],
            "is_top": rank[keep] <= top_k,
        }
    )


def thresholds_frame(amax: float) -> pd.DataFrame:
    """The two thresholds of the channels chart for a per-tensor scale from ``amax``: label, value.

    ``INT8 per-tensor flush`` = amax / 127 / 2 (channels at or below are zeroed);
    ``E4M3 min subnormal`` = 2**-9 * amax / 448 (the smallest positive FP8 value).
    """
    return pd.DataFrame(
        {
            "label": [INT8_FLUSH_LABEL, E4M3_SUBNORMAL_LABEL],
            "value": [ol.int8_flush_threshold(amax), ol.e4m3_min_subnormal_under_scale(amax)],
        }
    )


def depth_frame(
    stats: Iterable[LayerStats] | Mapping[str, LayerStats], proj: str, max_cells: int = HEATMAP_MAX_CELLS
) -> pd.DataFrame:
    """Block x channel-bin maxima of one projection type (see ``quantcore.evaluation.outliers.depth_table``).

    Columns: block, layer, bin, ch_lo, ch_hi, channel_max, argmax_channel; ``blocks x bins <= max_cells``.
    """
    return pd.DataFrame(ol.depth_table(stats, proj, max_points=max_cells))


def smoothquant_frame(
    view: ol.SmoothQuantView, max_points: int = DEFAULT_MAX_POINTS
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Long frames for :func:`smoothquant_chart` from a ``quantcore.evaluation.outliers.smoothquant_view``.

    Returns (points, steps):
      points: channel, stage ("before" | "after"), tensor ("activation" | "weight"), value, s
      steps:  stage, tensor, step (the per-tensor step, max / levels)
    Channels are downsampled (max-preserving on both activation and weight maxima) so
    that ``len(points) <= max_points``.
    """
    per_series = max(1, max_points // 4)
    idx = np.union1d(
        ol.downsample_channels(view.act_before, per_series // 2 or 1, top_k=ol.DEFAULT_TOP_K),
        ol.downsample_channels(view.weight_before, per_series // 2 or 1, top_k=ol.DEFAULT_TOP_K),
    )
    series = {
        ("before", "activation"): view.act_before,
        ("before", "weight"): view.weight_before,
        ("after", "activation"): view.act_after,
        ("after", "weight"): view.weight_after,
    }
    frames = [
        pd.DataFrame(
            {"channel": idx, "stage": stage, "tensor": tensor, "value": values[idx], "s": view.s[idx]}
        )
        for (stage, tensor), values in series.items()
    ]
    points = pd.concat(frames, ignore_index=True)
    points = points[points["value"] > 0].reset_index(drop=True)
    steps = pd.DataFrame(
        {
            "stage": ["before", "before", "after", "after"],
            "tensor": ["activation", "weight", "activation", "weight"],
            "step": [
                view.act_step_before,
                view.weight_step_before,
                view.act_step_after,
                view.weight_step_after,
            ],
        }
    )
    return points, steps


def hist_frame(stat: LayerStats) -> pd.DataFrame:
    """The stored log-binned |x| histogram of one layer: lo, hi, center, count, share (of nonzero values)."""
    df = pd.DataFrame(ol.histogram_frame(stat))
    total = df["count"].sum()
    df["share"] = df["count"] / total if total else 0.0
    return df


def grid_frame(grid: ol.FormatGrid, lo: float | None = None, hi: float | None = None) -> pd.DataFrame:
    """The representable magnitudes, clipping point and flush threshold of a format grid: value, kind.

    Representable values are kept inside ``[lo, hi]`` (the histogram's range) when given;
    the clipping point and the flush threshold are always kept.
    """
    values = grid.values
    if lo is not None:
        values = values[values >= lo]
    if hi is not None:
        values = values[values <= hi]
    return pd.DataFrame(
        {
            "value": np.concatenate([values, [grid.clip, grid.flush]]),
            "kind": ["representable"] * values.size + ["clipping point", "flush to zero"],
        }
    )


def breakage_frame(
    stats: Iterable[LayerStats] | Mapping[str, LayerStats],
    formats: Sequence[str] = ol.DEFAULT_BREAKAGE_FORMATS,
    granularity: str = "tensor",
    block_size: int | None = None,
) -> pd.DataFrame:
    """The "what will break" table (see ``quantcore.evaluation.outliers.layer_breakage`` for each column)."""
    return pd.DataFrame(ol.breakage_table(stats, formats, granularity, block_size))


# =============================================================================================
# Outliers page: charts
# =============================================================================================
def overview_chart(df: pd.DataFrame, height: int = OVERVIEW_HEIGHT, width: int = OVERVIEW_WIDTH) -> alt.Chart:
    """Outlier ratio (log y) of every linear input, one column per projection type, coloured by depth.

    Input: :func:`overview_frame`. A click selects a layer: the point selection param
    ``layer_pick`` carries the ``layer`` field, which ``st.altair_chart(..., on_select="rerun")``
    returns to the page for the drill-down.
    """
    _check_columns(df, ["layer", "block", "proj", "outlier_ratio"], "overview_chart")
    if len(df) > MAX_MARKS:
        df = df.nlargest(MAX_MARKS, "outlier_ratio")
    pick = alt.selection_point(name=SELECTION_NAME, fields=["layer"], on="click", toggle=False)
    tooltip = [
        alt.Tooltip("layer:N"),
        alt.Tooltip("outlier_ratio:Q", title="max / median", format=",.1f"),
    ]
    for col, fmt in (("amax", ",.4g"), ("median_channel_max", ",.4g"), ("in_features", ",d")):
        if col in df.columns:
            tooltip.append(alt.Tooltip(f"{col}:Q", format=fmt))
    # a layer outside the blocks (lm_head: block -1) sits mid-band in its column, in grey, not as block 0
    middle = int(df.loc[df["block"] >= 0, "block"].max() // 2) if (df["block"] >= 0).any() else 0
    df = df.assign(slot=df["block"].where(df["block"] >= 0, middle))
    return (
        alt.Chart(df, height=height, width=width)  # no title: the page's heading and caption say what it is
        .mark_circle(size=60)
        .encode(
            x=alt.X("proj:N", title="projection", sort=_proj_sort(df["proj"]), axis=alt.Axis(labelAngle=0)),
            xOffset=alt.XOffset("slot:O"),
            y=alt.Y(
                "outlier_ratio:Q", title="max channel max / median channel max", scale=alt.Scale(type="log")
            ),
            # the legend runs over the blocks; a layer outside them is grey (its tooltip names it)
            color=alt.condition(
                "datum.block < 0", alt.value(OUTSIDE_BLOCKS_COLOR),
                alt.Color("block:Q", title="block", scale=alt.Scale(scheme="viridis", domainMin=0, clamp=True))),
            opacity=alt.condition(pick, alt.value(1.0), alt.value(0.35)),
            size=alt.condition(pick, alt.value(140), alt.value(60)),
            tooltip=tooltip,
        )
        .add_params(pick)
    )


def channels_chart(
    channels: pd.DataFrame,
    thresholds: pd.DataFrame,
    top_k: int = DEFAULT_TOP_K,
    title: str | None = None,
    height: int = CHART_HEIGHT,
    max_points: int = DEFAULT_MAX_POINTS,
) -> alt.LayerChart:
    """Per-channel max |x| (log y) of one layer, the top-k channels labelled, the thresholds as rules.

    channels:   :func:`channels_frame` (channel, channel_max[, rank]).
    thresholds: :func:`thresholds_frame` (label, value): horizontal rules with a legend.
    """
    _check_columns(channels, ["channel", "channel_max"], "channels_chart")
    _check_columns(thresholds, ["label", "value"], "channels_chart thresholds")
    if len(channels) > max_points:
        keep = ol.downsample_channels(channels["channel_max"].to_numpy(), max_points, top_k)
        channels = channels.iloc[keep]
    channels = channels[channels["channel_max"] > 0]
    if "rank" not in channels.columns:
        channels = channels.assign(rank=channels["channel_max"].rank(ascending=False, method="first"))
    top = channels[channels["rank"] <= top_k].assign(
        text=lambda d: [f"ch {c}: {v:.3g}" for c, v in zip(d["channel"], d["channel_max"], strict=True)]
    )
    y = alt.Y("channel_max:Q", title="max |x| over calibration tokens", scale=alt.Scale(type="log"))
    points = (
        alt.Chart(channels)
        .mark_circle(size=14, color=SERIES_COLORS["activation"])
        .encode(
            x=alt.X("channel:Q", title="input channel"),
            y=y,
            tooltip=[alt.Tooltip("channel:Q"), alt.Tooltip("channel_max:Q", format=".4g"), "rank:Q"],
        )
    )
    # a label reads rightwards from its point, leftwards in the last fifth of the channels (not off the chart)
    right = top["channel"] > LABEL_FLIP_AT * channels["channel"].max() if len(channels) else top["channel"] < 0
    top = top.assign(right=right).sort_values("rank")  # the largest channel's label sits nearest its point
    top = top.assign(level=label_levels(top["channel"], top["channel_max"], top["right"],
                                        span=LABEL_SPAN * max(float(channels["channel"].max()), 1.0)))
    labels = alt.layer(*(
        alt.Chart(part).mark_text(align="right" if is_right else "left", dx=-6 if is_right else 6,
                                  dy=-4 - LABEL_STEP_PX * level, fontSize=11)
        .encode(x="channel:Q", y=y, text="text:N")
        for (is_right, level), part in top.groupby(["right", "level"])
    ))
    labels_known = [lbl for lbl in THRESHOLD_COLORS if lbl in set(thresholds["label"])]
    others = [lbl for lbl in thresholds["label"] if lbl not in THRESHOLD_COLORS]
    domain = labels_known + others
    color_range = [THRESHOLD_COLORS.get(lbl, "#7f7f7f") for lbl in domain]
    rules = (
        alt.Chart(thresholds)
        .mark_rule(strokeDash=[6, 3], strokeWidth=1.5)
        .encode(
            y=alt.Y("value:Q", scale=alt.Scale(type="log")),
            color=alt.Color(
                "label:N",
                title="threshold (per-tensor scale)",
                scale=alt.Scale(domain=domain, range=color_range),
                legend=alt.Legend(orient="bottom"),
            ),
            tooltip=[alt.Tooltip("label:N"), alt.Tooltip("value:Q", format=".4g")],
        )
    )
    chart = alt.layer(points, labels, rules, height=height)
    return chart.properties(title=title) if title else chart  # a page heading usually names the layer


def label_levels(x: Iterable[float], y: Iterable[float], right: Iterable[bool], span: float,
                 decades: float = LABEL_DECADES) -> list[int]:
    """The level (0 = just above its point) of each point's label so that no two overlap: a label covers ``span`` of
    the x axis rightwards of its point (leftwards where ``right``) and ``decades`` of a log y axis; in the order
    given (the largest first), each takes the lowest level where it meets no label placed before it."""
    placed: list[tuple[float, float, float, int]] = []  # x from, x to, log10 y, level
    levels = []
    for xi, yi, ri in zip(x, y, right, strict=True):
        lo, hi = (xi - span, xi) if ri else (xi, xi + span)
        ly = math.log10(max(float(yi), 1e-30))
        level = 0
        while any(lv == level and lo < b and a < hi and abs(ly - py) < decades for a, b, py, lv in placed):
            level += 1
        placed.append((lo, hi, ly, level))
        levels.append(level)
    return levels


def depth_heatmap(df: pd.DataFrame, proj: str | None = None, height: int = CHART_HEIGHT) -> alt.Chart:
    """Block x channel heatmap of channel max (log colour) for one projection type.

    Input: :func:`depth_frame` (block, ch_lo, ch_hi, channel_max, argmax_channel[, layer]).
    Each cell is a contiguous channel range; its colour is the range's max, so a channel
    that stays massive across depth shows as a bright vertical stripe.
    """
    _check_columns(df, ["block", "ch_lo", "ch_hi", "channel_max"], "depth_heatmap")
    if len(df) > MAX_MARKS:
        raise ValueError(
            f"depth_heatmap got {len(df)} cells (limit {MAX_MARKS}); build the frame with depth_frame(max_cells=...)"
        )
    floor = _positive_floor(df["channel_max"])
    df = df.assign(color_value=df["channel_max"].clip(lower=floor))
    tooltip = [
        alt.Tooltip("block:O"),
        alt.Tooltip("ch_lo:Q", title="first channel"),
        alt.Tooltip("ch_hi:Q", title="end channel"),
    ]
    if "argmax_channel" in df.columns:
        tooltip.append(alt.Tooltip("argmax_channel:Q", title="largest channel"))
    tooltip.append(alt.Tooltip("channel_max:Q", format=".4g", title="max |x|"))
    return (
        alt.Chart(df, height=height, title=f"Channel max across depth{f' ({proj})' if proj else ''}")
        .mark_rect()
        .encode(
            x=alt.X("ch_lo:Q", title="input channel", bin="binned"),
            x2="ch_hi:Q",
            y=alt.Y("block:O", title="block", sort="ascending"),
            color=alt.Color("color_value:Q", title="max |x|", scale=alt.Scale(type="log", scheme="inferno")),
            tooltip=tooltip,
        )
    )


def smoothquant_chart(
    points: pd.DataFrame, steps: pd.DataFrame, alpha: float, height: int = CHART_HEIGHT, width: int = SMOOTH_WIDTH
) -> alt.HConcatChart:
    """Activation vs weight per-channel max before and after smoothing (two panels, shared log y).

    points: channel, stage, tensor, value (from :func:`smoothquant_frame`).
    steps:  stage, tensor, step: the per-tensor INT8 step of each tensor, drawn as a rule.
    """
    _check_columns(points, ["channel", "stage", "tensor", "value"], "smoothquant_chart")
    _check_columns(steps, ["stage", "tensor", "step"], "smoothquant_chart steps")
    if len(points) > MAX_MARKS:
        raise ValueError(
            f"smoothquant_chart got {len(points)} points (limit {MAX_MARKS}); use smoothquant_frame"
        )
    color = alt.Color(
        "tensor:N",
        title="",
        scale=alt.Scale(domain=list(SERIES_COLORS), range=list(SERIES_COLORS.values())),
        legend=alt.Legend(orient="bottom"),  # beside two panels it would run off a page's right edge
    )
    y_scale = alt.Scale(type="log")
    panels = []
    for stage, title in (("before", "before smoothing"), ("after", f"after smoothing (α = {alpha:.2f})")):
        pts = points[points["stage"] == stage]
        stp = steps[steps["stage"] == stage].assign(
            text=lambda d: [f"{t} INT8 step {v:.3g}" for t, v in zip(d["tensor"], d["step"], strict=True)]
        )
        dots = (
            alt.Chart(pts)
            .mark_circle(size=14, opacity=0.7)
            .encode(
                x=alt.X("channel:Q", title="input channel"),
                y=alt.Y("value:Q", title="per-channel max |·|", scale=y_scale),
                color=color,
                tooltip=["channel:Q", "tensor:N", alt.Tooltip("value:Q", format=".4g")],
            )
        )
        rules = (
            alt.Chart(stp)
            .mark_rule(strokeDash=[6, 3])
            .encode(y=alt.Y("step:Q", scale=y_scale), color=color, tooltip=["text:N"])
        )
        # each rule named at its right end (the legend's colours say which tensor, not what a dashed line is): the
        # activation's above its line, the weight's below (after smoothing the two steps often meet), each on a
        # white halo over the points
        named = stp.assign(channel=pts["channel"].max() if len(pts) else 0)
        names = [
            alt.Chart(named[named["tensor"] == tensor])
            .mark_text(align="right", dy=dy, fontSize=11, **style)
            .encode(x="channel:Q", y=alt.Y("step:Q", scale=y_scale), text="text:N",
                    **({} if style else {"color": color}))
            for tensor, dy in (("activation", -7), ("weight", 11))
            for style in ({"stroke": "white", "strokeWidth": 3, "strokeOpacity": 0.9}, {})
        ]
        panels.append(alt.layer(dots, rules, *names, title=title, height=height, width=width))
    return alt.hconcat(*panels).resolve_scale(y="shared")


def alpha_sweep_chart(sweep: pd.DataFrame, alpha: float, height: int = CHART_HEIGHT) -> alt.LayerChart:
    """Share of activation / weight channels flushed by per-tensor INT8 as alpha varies, chosen alpha marked.

    sweep: alpha, act_flushed, weight_flushed (``quantcore.evaluation.outliers.alpha_sweep``).
    """
    _check_columns(sweep, ["alpha", "act_flushed", "weight_flushed"], "alpha_sweep_chart")
    long = sweep.melt(
        id_vars=["alpha"],
        value_vars=["act_flushed", "weight_flushed"],
        var_name="tensor",
        value_name="flushed",
    )
    long["tensor"] = long["tensor"].map({"act_flushed": "activation", "weight_flushed": "weight"})
    lines = (
        alt.Chart(long)
        .mark_line(point=True)
        .encode(
            x=alt.X("alpha:Q", title="α", scale=alt.Scale(domain=[0, 1])),
            y=alt.Y("flushed:Q", title="channels flushed by INT8", axis=alt.Axis(format="%")),
            color=alt.Color(
                "tensor:N", scale=alt.Scale(domain=list(SERIES_COLORS), range=list(SERIES_COLORS.values()))
            ),
            tooltip=["alpha:Q", "tensor:N", alt.Tooltip("flushed:Q", format=".1%")],
        )
    )
    chosen = alt.Chart(pd.DataFrame({"alpha": [alpha]})).mark_rule(color="black").encode(x="alpha:Q")
    return alt.layer(lines, chosen, height=height, title="Choosing α")


def histogram_chart(
    hist: pd.DataFrame, grid: pd.DataFrame, fmt_label: str = "", height: int = CHART_HEIGHT
) -> alt.LayerChart:
    """The |x| histogram (log x, symlog count) with a format's representable values, clip and flush points.

    hist: lo, hi, count (from :func:`hist_frame`); grid: value, kind (from :func:`grid_frame`).
    """
    _check_columns(hist, ["lo", "hi", "count"], "histogram_chart")
    _check_columns(grid, ["value", "kind"], "histogram_chart grid")
    if len(hist) + len(grid) > MAX_MARKS:
        raise ValueError(f"histogram_chart got {len(hist) + len(grid)} rows (limit {MAX_MARKS})")
    grid = grid[grid["value"] > 0]
    x_scale = alt.Scale(type="log")
    bars = (
        alt.Chart(hist)
        .mark_rect(color=SERIES_COLORS["activation"], opacity=0.8)
        .encode(
            x=alt.X(
                "lo:Q", title="|x|", scale=x_scale, axis=alt.Axis(grid=False)
            ),  # the format grid is the grid
            x2="hi:Q",
            y=alt.Y("count:Q", title="values", scale=alt.Scale(type="symlog")),
            tooltip=[
                alt.Tooltip("lo:Q", format=".3g"),
                alt.Tooltip("hi:Q", format=".3g"),
                alt.Tooltip("count:Q", format=",d"),
            ],
        )
    )
    kinds = [k for k in GRID_KIND_COLORS if k in set(grid["kind"])]
    rules = (
        alt.Chart(grid)
        .mark_rule()
        .encode(
            x=alt.X("value:Q", scale=x_scale),
            color=alt.Color(
                "kind:N",
                title=fmt_label or "format",
                scale=alt.Scale(domain=kinds, range=[GRID_KIND_COLORS[k] for k in kinds]),
                legend=alt.Legend(orient="bottom"),
            ),
            opacity=alt.condition(alt.datum.kind == "representable", alt.value(0.6), alt.value(1.0)),
            strokeWidth=alt.condition(alt.datum.kind == "representable", alt.value(0.7), alt.value(2.0)),
            tooltip=["kind:N", alt.Tooltip("value:Q", format=".4g")],
        )
    )
    title = f"|x| histogram with the {fmt_label} grid" if fmt_label else "|x| histogram"
    return alt.layer(bars, rules, height=height, title=title)


# =============================================================================================
# Scoring page
# =============================================================================================
def kl_histogram_frame(df: pd.DataFrame, bins: int = KL_BINS) -> pd.DataFrame:
    """Per-token KL values (columns kl[, label]) binned on shared log bins: label, lo, hi, center, count, share.

    Values below :data:`KL_FLOOR` (including exact zeros) fall in the first bin.
    """
    _check_columns(df, ["kl"], "kl_histogram_frame")
    if "label" not in df.columns:
        df = df.assign(label="run")
    kl = df["kl"].to_numpy(dtype=np.float64)
    finite = np.isfinite(kl)
    top = max(float(kl[finite].max()) if finite.any() else KL_FLOOR, KL_FLOOR * 10)
    lo_edge = max(KL_FLOOR, _positive_floor(kl[finite], KL_FLOOR))
    if lo_edge >= top:
        lo_edge = top / 10
    edges = np.geomspace(lo_edge, top, bins + 1)
    out = []
    for label, group in df.groupby("label", sort=False):
        v = np.clip(group["kl"].to_numpy(dtype=np.float64), lo_edge, top)
        v = v[np.isfinite(v)]
        counts, _ = np.histogram(v, bins=edges)
        out.append(
            pd.DataFrame(
                {
                    "label": str(label),
                    "lo": edges[:-1],
                    "hi": edges[1:],
                    "center": np.sqrt(edges[:-1] * edges[1:]),
                    "count": counts,
                    "share": counts / max(1, v.size),
                }
            )
        )
    return pd.concat(out, ignore_index=True)


def kl_distribution_chart(df: pd.DataFrame, height: int = 260) -> alt.LayerChart:
    """Distribution of per-token KL(p_ref || p_quant), log x, one step line per label, means as rules.

    Input: either raw values (kl[, label]) — binned here with :func:`kl_histogram_frame` —
    or an already binned frame (label, center, share).
    """
    if "kl" in df.columns:
        means = (
            df.assign(label=df["label"] if "label" in df.columns else "run")
            .groupby("label", sort=False)["kl"]
            .mean()
            .reset_index()
            .rename(columns={"kl": "mean"})
        )
        binned = kl_histogram_frame(df)
    else:
        _check_columns(df, ["label", "center", "share"], "kl_distribution_chart")
        binned = df
        means = pd.DataFrame({"label": [], "mean": []})
    if len(binned) > MAX_MARKS:
        raise ValueError(f"kl_distribution_chart got {len(binned)} bins (limit {MAX_MARKS})")
    means["mean"] = means["mean"].clip(lower=KL_FLOOR)
    color = alt.Color("label:N", title="")
    lines = (
        alt.Chart(binned)
        .mark_line(interpolate="step")
        .encode(
            x=alt.X("center:Q", title="per-token KL (nats)", scale=alt.Scale(type="log")),
            y=alt.Y("share:Q", title="share of tokens", axis=alt.Axis(format="%")),
            color=color,
            tooltip=["label:N", alt.Tooltip("center:Q", format=".3g"), alt.Tooltip("share:Q", format=".1%")],
        )
    )
    rules = (
        alt.Chart(means)
        .mark_rule(strokeDash=[4, 3])
        .encode(x="mean:Q", color=color, tooltip=["label:N", alt.Tooltip("mean:Q", format=".4g")])
    )
    return alt.layer(lines, rules, height=height, title="Per-token KL against the unquantized model")


def kl_by_position_chart(
    df: pd.DataFrame, height: int = 260, max_points: int = DEFAULT_MAX_POINTS
) -> alt.Chart:
    """Mean KL by token position (log y), one line per label.

    Input columns: position, kl[, label]. Positions beyond ``max_points`` per label are
    averaged in contiguous buckets (the chart keeps the mean, not single tokens).
    """
    _check_columns(df, ["position", "kl"], "kl_by_position_chart")
    if "label" not in df.columns:
        df = df.assign(label="run")
    df = df.groupby(["label", "position"], sort=True, as_index=False)["kl"].mean()
    n_labels = max(1, df["label"].nunique())
    per_label = max(1, min(max_points, MAX_MARKS // n_labels))
    parts = []
    for label, group in df.groupby("label", sort=False):
        if len(group) > per_label:
            bucket = np.arange(len(group)) * per_label // len(group)
            group = group.groupby(bucket).agg(position=("position", "mean"), kl=("kl", "mean"))
            group["label"] = label
        parts.append(group)
    df = pd.concat(parts, ignore_index=True)
    df["kl_plot"] = df["kl"].clip(lower=KL_FLOOR)
    return (
        alt.Chart(df, height=height, title="KL by position")
        .mark_line()
        .encode(
            x=alt.X("position:Q", title="token position"),
            y=alt.Y("kl_plot:Q", title="mean KL (nats)", scale=alt.Scale(type="log")),
            color=alt.Color("label:N", title=""),
            tooltip=["label:N", alt.Tooltip("position:Q", format=".0f"), alt.Tooltip("kl:Q", format=".4g")],
        )
    )


def sensitivity_chart(df: pd.DataFrame, top_n: int = SENSITIVITY_TOP_N, bar_height: int = 16) -> alt.Chart:
    """Per-layer sensitivity as horizontal bars, most sensitive first (the ``top_n`` largest).

    Input columns: layer, kl (mean KL with only that layer quantized)[, proj]. Bars are
    coloured by projection type when ``proj`` is present.
    """
    _check_columns(df, ["layer", "kl"], "sensitivity_chart")
    top = df.nlargest(min(top_n, MAX_MARKS), "kl")
    encodings = {
        "x": alt.X("kl:Q", title="mean KL with only this layer quantized"),
        # every bar labelled in full: layer names are long and each one is the point of a row
        "y": alt.Y("layer:N", title="", sort="-x", axis=alt.Axis(labelLimit=360, labelOverlap=False)),
        "tooltip": ["layer:N", alt.Tooltip("kl:Q", format=".4g")],
    }
    if "proj" in top.columns:
        encodings["color"] = alt.Color("proj:N", title="projection", sort=_proj_sort(top["proj"]))
    return (
        alt.Chart(top, height=alt.Step(bar_height), title=f"Most sensitive layers (top {len(top)})")
        .mark_bar()
        .encode(**encodings)
    )


HEAD_BLOCK = "head"  # the column of layers outside the decoder blocks (lm_head) in sensitivity_by_scheme


def sensitivity_by_scheme(df: pd.DataFrame, cell: int = 18) -> alt.Chart:
    """Per-unit KL of every swept scheme at once: one panel per scheme, block x projection cells.

    Input columns: scheme, block (int; None/NaN for layers outside the blocks, drawn in a last
    "head" column), proj (e.g. "q_proj/k_proj/v_proj"), kl[, unit]. The colour is log KL on one
    scale shared by every panel, so a site that only one format cannot take (a down_proj that
    breaks INT8 per-tensor and barely moves FP8) stands out in that format's panel alone.
    """
    _check_columns(df, ["scheme", "block", "proj", "kl"], "sensitivity_by_scheme")
    if len(df) > MAX_MARKS:
        raise ValueError(f"sensitivity_by_scheme got {len(df)} cells (limit {MAX_MARKS})")
    blocks = pd.to_numeric(df["block"], errors="coerce")
    order = [str(b) for b in sorted(blocks.dropna().astype(int).unique())]
    df = df.assign(
        col=[str(int(b)) if pd.notna(b) else HEAD_BLOCK for b in blocks],
        kl_plot=df["kl"].clip(lower=KL_FLOOR),
    )
    if (df["col"] == HEAD_BLOCK).any():
        order.append(HEAD_BLOCK)
    tooltip = ["scheme:N"] + (["unit:N"] if "unit" in df.columns else ["col:N", "proj:N"])
    tooltip.append(alt.Tooltip("kl:Q", format=".4g", title="KL"))
    return (
        alt.Chart(df, width=alt.Step(cell), height=alt.Step(cell))
        .mark_rect()
        .encode(
            x=alt.X("col:O", title="block", sort=order),
            # every projection labelled: the default overlap rule drops every other one
            y=alt.Y("proj:N", title="", sort=_proj_sort(df["proj"]),
                    axis=alt.Axis(labelOverlap=False, labelLimit=240)),
            color=alt.Color("kl_plot:Q", title="KL (nats)", scale=alt.Scale(type="log", scheme="inferno"),
                            legend=alt.Legend(format=".1e")),
            row=alt.Row("scheme:N", title=None, header=alt.Header(labelAngle=0, labelAlign="left")),
            tooltip=tooltip,
        )
        .properties(title="KL with one unit quantized, per swept scheme")
    )


# =============================================================================================
# Kernels page
# =============================================================================================
def kernel_heatmap(
    df: pd.DataFrame,
    height: int | None = None,
    column: str = "path",
    column_title: str = "kernel path",
    title: str = "Speed-up over baseline",
) -> alt.LayerChart:
    """Speed-up over the baseline GEMM, GEMM shape x kernel path; 1x is white, faster blue, slower red.

    Input columns: shape (a label such as "down_proj 576x1536 M=512"), ``column`` (default
    path; e.g. "device" to compare devices on one path), speedup (NaN where the device does
    not run the path natively: drawn as "n/a", never as a speed-up)[, note: drawn instead of
    "n/a" where it is not empty, e.g. "skipped" for a case with no time].
    """
    _check_columns(df, ["shape", column, "speedup"], "kernel_heatmap")
    if len(df) > MAX_MARKS // 2:  # one rect and one text mark per cell
        raise ValueError(f"kernel_heatmap got {len(df)} cells (limit {MAX_MARKS // 2})")
    speedup = df["speedup"].to_numpy(dtype=np.float64)
    valid = np.isfinite(speedup) & (speedup > 0)
    # Symmetric log domain around 1x, so 2x faster and 2x slower get equally strong colours.
    log_extent = float(np.abs(np.log(speedup[valid])).max()) if valid.any() else 0.0
    extent = float(np.exp(max(log_extent, np.log(KERNEL_MIN_EXTENT))))
    dark = valid & (np.abs(np.log(np.where(valid, speedup, 1.0))) > KERNEL_DARK_SHARE * np.log(extent))
    df = df.assign(
        text=[f"{v:.2f}×" if ok else (note or "n/a") for v, ok, note in
              zip(speedup, valid, df["note"] if "note" in df.columns else [""] * len(df), strict=True)],
        text_color=np.where(dark, "white", "black"),
    )
    base = alt.Chart(df).encode(
        # kernel paths are short and read upright; device names are long and slant
        x=alt.X(f"{column}:N", title=column_title,
                axis=alt.Axis(labelLimit=260, labelAngle=-30 if column != "path" else -90)),
        y=alt.Y("shape:N", title="GEMM shape", sort=None, axis=alt.Axis(labelLimit=260)),
    )
    rects = base.mark_rect().encode(
        color=alt.Color(
            "speedup:Q",
            title="speed-up",
            scale=alt.Scale(type="log", scheme="redblue", domain=[1 / extent, extent], domainMid=1.0),
        ),
        tooltip=["shape:N", f"{column}:N", "text:N"],
    )
    text = base.mark_text(fontSize=11).encode(text="text:N", color=alt.Color("text_color:N", scale=None))
    return alt.layer(
        rects,
        text,
        # a step per row, not a total height: Streamlit's theme shrinks a fixed-height band chart
        height=height or alt.Step(KERNEL_ROW_PX),
        width=alt.Step(KERNEL_COLUMN_PX),
        title=title,
    ).resolve_scale(color="independent")  # the text colours are literal, not on the speed-up scale


def peak_bars(df: pd.DataFrame, height: int | None = None, title: str = "Share of peak throughput") -> alt.LayerChart:
    """Percent of the device's peak reached by each measured kernel, horizontal bars, 100% marked.

    Input columns: label, pct_peak (0-100)[, path].
    """
    _check_columns(df, ["label", "pct_peak"], "peak_bars")
    if len(df) > MAX_MARKS:
        raise ValueError(f"peak_bars got {len(df)} rows (limit {MAX_MARKS})")
    encodings = {
        "x": alt.X("pct_peak:Q", title="% of peak", scale=alt.Scale(domainMin=0)),
        "y": alt.Y("label:N", title="", sort="-x", axis=alt.Axis(labelLimit=320)),
        "tooltip": ["label:N", alt.Tooltip("pct_peak:Q", format=".1f")],
    }
    if "path" in df.columns:
        encodings["color"] = alt.Color("path:N", title="path")
    bars = alt.Chart(df).mark_bar().encode(**encodings)
    full = alt.Chart(pd.DataFrame({"pct_peak": [100.0]})).mark_rule(strokeDash=[4, 3]).encode(x="pct_peak:Q")
    return alt.layer(bars, full, height=height or alt.Step(18), **({"title": title} if title else {}))


# =============================================================================================
# Results page: quality against cost
# =============================================================================================
FRONT_COLORS = {"on the front": "#d62728", "beaten": "#9e9e9e"}


def tradeoff_chart(df: pd.DataFrame, cost: str, cost_title: str, height: int = CHART_HEIGHT) -> alt.LayerChart:
    """KL of each scored plan (log y) against what it costs (x), the Pareto front joined and labelled.

    Input columns: plan, kl_mean, ``cost``, front (bool: no other plan has both a lower cost and a
    lower KL)[, top1_agree]. Rows without a cost are left out (the page names them). A KL of 0
    (BF16) is drawn a decade below the smallest positive KL (never below :data:`KL_FLOOR`); the
    tooltip keeps the true value. The front is a step line, its plans labelled: from each, the
    best KL available for no more cost.
    """
    _check_columns(df, ["plan", "kl_mean", cost, "front"], "tradeoff_chart")
    keep = ["plan", "kl_mean", cost, "front"] + (["top1_agree"] if "top1_agree" in df.columns else [])
    df = df.loc[df[cost].notna(), keep].head(MAX_MARKS // 3).copy()  # three marks per row
    # a KL of 0 (BF16) sits a decade below the smallest positive KL, not at KL_FLOOR: the plans worth
    # comparing keep the height of the chart
    floor = max(_positive_floor(df["kl_mean"], default=KL_FLOOR) / 10, KL_FLOOR)
    df["kl_plot"] = df["kl_mean"].clip(lower=floor)
    df["where"] = np.where(df["front"], "on the front", "beaten")
    x = alt.X(f"{cost}:Q", title=cost_title, scale=alt.Scale(zero=False),
              axis=alt.Axis(format=",.4~r"))  # one plan alone: its value is the only tick, not 128.640381
    y = alt.Y("kl_plot:Q", title="KL mean (nats, log)", scale=alt.Scale(type="log"))
    tooltip = ["plan:N", alt.Tooltip("kl_mean:Q", title="KL mean", format=".4g"),
               alt.Tooltip(f"{cost}:Q", title=cost_title, format=".4g")]
    if "top1_agree" in df.columns:
        tooltip.append(alt.Tooltip("top1_agree:Q", title="top-1 agree", format=".3f"))
    color = alt.Color("where:N", title="", scale=alt.Scale(domain=list(FRONT_COLORS),
                                                           range=list(FRONT_COLORS.values())))
    base = alt.Chart(df)
    points = base.mark_circle(size=90).encode(x=x, y=y, color=color, tooltip=tooltip)
    front = df[df["front"]].sort_values(cost)
    line = (alt.Chart(front).mark_line(interpolate="step-after", color=FRONT_COLORS["on the front"], opacity=0.5)
            .encode(x=x, y=y))
    labels = alt.Chart(front).mark_text(align="left", dx=7, dy=-6, fontSize=11).encode(
        x=x, y=y, text="plan:N", color=alt.value("#333333"))  # the beaten ones crowd: they have tooltips
    return alt.layer(line, points, labels, height=height, title=f"KL against {cost_title}")


# ---------------------------------------------------------------------- K and V (what the KV cache holds)


def kv_amax_frame(kv_amax: Mapping[str, Mapping[str, float]] | None) -> pd.DataFrame:
    """One row per attention layer and tensor: layer, block, tensor ("K" / "V", and "Q" where the calibration
    recorded it), amax (max |x| as cached, and as FP8 attention quantizes Q).

    Input: a calibration's ``kv_amax`` ``{"k": {layer: amax}, "v": {...}, "q": {...}}``; None or empty gives an
    empty frame with the columns.
    """
    rows = []
    for tensor, key in (("K", "k"), ("V", "v"), ("Q", "q")):
        for layer, amax in ((kv_amax or {}).get(key) or {}).items():
            block = next((int(p) for p in layer.split(".") if p.isdigit()), -1)
            rows.append({"layer": layer, "block": block, "tensor": tensor, "amax": float(amax)})
    return pd.DataFrame(rows, columns=["layer", "block", "tensor", "amax"])


def kv_amax_chart(df: pd.DataFrame, limit: float = 448.0, height: int = CHART_HEIGHT) -> alt.LayerChart:
    """Max |K| and |V| (and |Q|) of every attention layer (log y) with the largest value unscaled E4M3 holds.

    Input: :func:`kv_amax_frame`. A K or V point above the rule saturates in ``FP8_UNSCALED`` (vLLM's scale
    1.0), a Q, K or V point in ``FP8_ATTN_UNSCALED``.
    """
    _check_columns(df, ["layer", "block", "tensor", "amax"], "kv_amax_chart")
    floor = _positive_floor(df["amax"])
    df = df.assign(value=df["amax"].clip(lower=floor))
    top = max(float(df["value"].max()) if len(df) else limit, limit) * 2
    points = (
        alt.Chart(df, height=height, title="Largest |Q|, |K| and |V| per attention layer, as attention reads them")
        .mark_line(point=True)
        .encode(
            x=alt.X("block:O", title="block"),
            y=alt.Y("value:Q", title="max |x|", scale=alt.Scale(type="log", domainMax=top)),
            color=alt.Color("tensor:N", title="tensor"),
            tooltip=[alt.Tooltip("layer:N"), alt.Tooltip("tensor:N"), alt.Tooltip("amax:Q", format=",.4g")],
        )
    )
    rule = alt.Chart(pd.DataFrame({"y": [limit], "label": [f"E4M3 max {limit:g} (scale 1.0)"]})).mark_rule(
        strokeDash=[6, 3], color="#c0392b").encode(y="y:Q")
    text = alt.Chart(pd.DataFrame({"y": [limit], "label": [f"E4M3 max {limit:g}: unscaled FP8 saturates above"]})) \
        .mark_text(align="left", dx=4, dy=-6, color="#c0392b").encode(y="y:Q", text="label:N")
    return alt.layer(points, rule, text)
