"""The Outliers page's charts and the frames that feed them: the outlier ratio of every linear input (click to drill
down), one layer's per-channel maxima with the flush thresholds, block x channel maxima of one projection type,
SmoothQuant before / after and its alpha sweep, the |x| histogram against a format's grid, the "what will break"
table, and the K / V / Q maxima a KV cache holds."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import altair as alt
import numpy as np
import pandas as pd

from app.charts.base import (
    CHANNEL_POINTS,
    CHART_HEIGHT,
    DEFAULT_MAX_POINTS,
    DEFAULT_TOP_K,
    E4M3_SUBNORMAL_LABEL,
    GREEN,
    GRID_KIND_COLORS,
    HEATMAP_MAX_CELLS,
    INT8_FLUSH_LABEL,
    LABEL_DECADES,
    LABEL_FLIP_AT,
    LABEL_SPAN,
    LABEL_STEP_PX,
    MAGNITUDE_SCHEME,
    MAX_MARKS,
    NEUTRAL,
    OUTLIER_RATIO_CAP,
    OUTSIDE_BLOCKS_COLOR,
    OVERVIEW_HEIGHT,
    OVERVIEW_WIDTH,
    SELECTION_NAME,
    SEQUENTIAL_SCHEME,
    SERIES_COLORS,
    SMOOTH_WIDTH,
    THRESHOLD_COLORS,
    VERMILLION,
    category_scale,
    check_columns,
    on_canvas,
    positive_floor,
    proj_sort,
)
from quantcore.evaluation import outliers as ol
from quantcore.evaluation.stats import LayerStats


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
    stat: LayerStats, max_points: int = CHANNEL_POINTS, top_k: int = DEFAULT_TOP_K
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
    view: ol.SmoothQuantView, max_points: int = CHANNEL_POINTS
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


def overview_chart(df: pd.DataFrame, height: int = OVERVIEW_HEIGHT, width: int = OVERVIEW_WIDTH) -> alt.Chart:
    """Outlier ratio (log y) of every linear input, one column per projection type, coloured by depth.

    Input: :func:`overview_frame`. A click selects a layer: the point selection param
    ``layer_pick`` carries the ``layer`` field, which ``st.altair_chart(..., on_select="rerun")``
    returns to the page for the drill-down.
    """
    check_columns(df, ["layer", "block", "proj", "outlier_ratio"], "overview_chart")
    if len(df) > MAX_MARKS:
        df = df.nlargest(MAX_MARKS, "outlier_ratio")
    pick = alt.selection_point(name=SELECTION_NAME, fields=["layer"], on="click", toggle=False)
    tooltip = [
        alt.Tooltip("layer:N", title="layer"),
        alt.Tooltip("outlier_ratio:Q", title="outlier ratio (max / median channel)", format=",.1f"),
    ]
    for col, fmt, name in (("amax", ",.4g", "largest |x|"), ("median_channel_max", ",.4g", "median channel's max |x|"),
                           ("in_features", ",d", "input channels")):
        if col in df.columns:
            tooltip.append(alt.Tooltip(f"{col}:Q", format=fmt, title=name))
    # a layer outside the blocks (lm_head: block -1) sits mid-band in its column, in grey, not as block 0
    middle = int(df.loc[df["block"] >= 0, "block"].max() // 2) if (df["block"] >= 0).any() else 0
    df = df.assign(slot=df["block"].where(df["block"] >= 0, middle))
    return (
        alt.Chart(df, height=height, width=width)  # no title: the page's heading and caption say what it is
        .mark_circle(size=60)
        .encode(
            x=alt.X("proj:N", title="projection", sort=proj_sort(df["proj"]), axis=alt.Axis(labelAngle=0)),
            xOffset=alt.XOffset("slot:O"),
            y=alt.Y(
                "outlier_ratio:Q", title="max channel max / median channel max", scale=alt.Scale(type="log")
            ),
            # the legend runs over the blocks; a layer outside them is grey (its tooltip names it)
            color=alt.condition(
                "datum.block < 0", alt.value(OUTSIDE_BLOCKS_COLOR),
                alt.Color("block:Q", title="block", scale=alt.Scale(scheme=SEQUENTIAL_SCHEME, domainMin=0,
                                                                   clamp=True))),
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
    max_points: int = CHANNEL_POINTS,
) -> alt.LayerChart:
    """Per-channel max |x| (log y) of one layer, the top-k channels labelled, the thresholds as rules.

    channels:   :func:`channels_frame` (channel, channel_max[, rank]).
    thresholds: :func:`thresholds_frame` (label, value): horizontal rules with a legend.
    """
    check_columns(channels, ["channel", "channel_max"], "channels_chart")
    check_columns(thresholds, ["label", "value"], "channels_chart thresholds")
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
            tooltip=[alt.Tooltip("channel:Q", title="input channel"),
                     alt.Tooltip("channel_max:Q", format=".4g", title="max |x|"),
                     alt.Tooltip("rank:Q", title="rank (1 = largest)")],
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
    color_range = [THRESHOLD_COLORS.get(lbl, NEUTRAL) for lbl in domain]
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
            tooltip=[alt.Tooltip("label:N", title="threshold"), alt.Tooltip("value:Q", format=".4g", title="|x|")],
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
    check_columns(df, ["block", "ch_lo", "ch_hi", "channel_max"], "depth_heatmap")
    if len(df) > MAX_MARKS:
        raise ValueError(
            f"depth_heatmap got {len(df)} cells (limit {MAX_MARKS}); build the frame with depth_frame(max_cells=...)"
        )
    floor = positive_floor(df["channel_max"])
    # only the columns drawn or shown on hover go to the browser (the layer's name, the bin's number do not)
    df = df[[c for c in ("block", "ch_lo", "ch_hi", "argmax_channel", "channel_max") if c in df.columns]]
    df = df.assign(color_value=df["channel_max"].clip(lower=floor))
    tooltip = [
        alt.Tooltip("block:O", title="block"),
        alt.Tooltip("ch_lo:Q", title="first channel"),
        alt.Tooltip("ch_hi:Q", title="end channel"),
    ]
    if "argmax_channel" in df.columns:
        tooltip.append(alt.Tooltip("argmax_channel:Q", title="largest channel"))
    tooltip.append(alt.Tooltip("channel_max:Q", format=".4g", title="max |x|"))
    return on_canvas(  # 1,500 cells: a canvas draws them in a fraction of the time of as many SVG rects
        alt.Chart(df, height=height, title=f"Channel max across depth{f' ({proj})' if proj else ''}")
        .mark_rect()
        .encode(
            x=alt.X("ch_lo:Q", title="input channel", bin="binned"),
            x2="ch_hi:Q",
            y=alt.Y("block:O", title="block", sort="ascending"),
            color=alt.Color("color_value:Q", title="max |x|", scale=alt.Scale(type="log", scheme=MAGNITUDE_SCHEME)),
            tooltip=tooltip,
        )
    )


LABEL_ROOM = 10 ** 0.5  # the SmoothQuant panels' y axis: half a decade beyond the data, for the steps' names


SMOOTH_DATA = "smoothquant_"  # the prefix of the SmoothQuant panels' named datasets (smoothquant_chart, named=True)


def smoothquant_parts(points: pd.DataFrame, steps: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """What each SmoothQuant panel draws, by name: its points (``before_dots``), its steps' rules (``before_rules``)
    and each step's name at the panel's last channel, the larger step first (``before_name0``, ``before_name1``);
    the same for ``after``."""
    parts = {}
    for stage in ("before", "after"):
        pts = points[points["stage"] == stage]
        stp = steps[steps["stage"] == stage].assign(
            text=lambda d: [f"{t} INT8 step {v:.3g}" for t, v in zip(d["tensor"], d["step"], strict=True)]
        )
        named = stp.assign(channel=pts["channel"].max() if len(pts) else 0).sort_values("step", ascending=False)
        parts |= {f"{stage}_dots": pts, f"{stage}_rules": stp,
                  **{f"{stage}_name{i}": named.iloc[i:i + 1] for i in (0, 1)}}
    return parts


def smoothquant_datasets(points: pd.DataFrame, steps: pd.DataFrame) -> dict[str, list[dict]]:
    """The datasets of a :func:`smoothquant_chart` spec built with ``named=True``, for these frames (one α)."""
    return {SMOOTH_DATA + k: frame.to_dict("records") for k, frame in smoothquant_parts(points, steps).items()}


def smoothquant_domain(act_max: np.ndarray, weight_max: np.ndarray,
                       alphas: Iterable[float] = tuple(np.linspace(0.0, 1.0, 21))) -> list[float] | None:
    """The log y domain of the SmoothQuant panels that holds every channel and step at each of ``alphas`` (the
    slider's positions), with room for the steps' names: one axis whatever the α, so a slider step changes the chart's
    data only and the browser redraws it in place instead of embedding it anew. None where no value is positive."""
    lo, hi = np.inf, 0.0
    for a in alphas:
        v = ol.smoothquant_view(act_max, weight_max, float(a))
        values = np.concatenate([v.act_before, v.weight_before, v.act_after, v.weight_after,
                                 [v.act_step_before, v.weight_step_before, v.act_step_after, v.weight_step_after]])
        values = values[np.isfinite(values) & (values > 0)]
        if values.size:
            lo, hi = min(lo, float(values.min())), max(hi, float(values.max()))
    return [lo / LABEL_ROOM, hi * LABEL_ROOM] if hi > 0 else None


def smoothquant_chart(
    points: pd.DataFrame, steps: pd.DataFrame, alpha: float, height: int = CHART_HEIGHT, width: int = SMOOTH_WIDTH,
    domain: list[float] | None = None, named: bool = False,
) -> alt.HConcatChart:
    """Activation vs weight per-channel max before and after smoothing (two panels, shared log y).

    points: channel, stage, tensor, value (from :func:`smoothquant_frame`).
    steps:  stage, tensor, step: the per-tensor INT8 step of each tensor, drawn as a rule.
    domain: the log y axis' (from :func:`smoothquant_domain`); default: the data's, with room for the names.
    named: the data as named datasets without their values (:data:`SMOOTH_DATA` + a part of
    :func:`smoothquant_parts`; give them with :func:`smoothquant_datasets`), and no α in the titles: the spec of
    every α of a layer is then the same but for its datasets.
    """
    check_columns(points, ["channel", "stage", "tensor", "value"], "smoothquant_chart")
    check_columns(steps, ["stage", "tensor", "step"], "smoothquant_chart steps")
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
    # room on the log axis for a step's name above the top line and below the bottom one (half a decade each way):
    # a name drawn past the plot's edge would sit on the axis' labels
    values = np.concatenate([points["value"].to_numpy(float), steps["step"].to_numpy(float)])
    values = values[np.isfinite(values) & (values > 0)]
    if domain is None and values.size:
        domain = [float(values.min()) / LABEL_ROOM, float(values.max()) * LABEL_ROOM]
    y_scale = alt.Scale(type="log", domain=domain) if domain is not None else alt.Scale(type="log")
    # each encoding built once and given each panel's data (Altair's encode is most of a chart's build time)
    dots_base = alt.Chart().mark_circle(size=14, opacity=0.7).encode(
        x=alt.X("channel:Q", title="input channel"),
        y=alt.Y("value:Q", title="per-channel max |·|", scale=y_scale),
        color=color,
        tooltip=[alt.Tooltip("channel:Q", title="input channel"), alt.Tooltip("tensor:N", title="tensor"),
                 alt.Tooltip("value:Q", format=".4g", title="max |·| of the channel")],
    )
    rules_base = alt.Chart().mark_rule(strokeDash=[6, 3]).encode(
        y=alt.Y("step:Q", scale=y_scale), color=color, tooltip=[alt.Tooltip("text:N", title="per-tensor step")])
    text_base = alt.Chart().encode(x="channel:Q", y=alt.Y("step:Q", scale=y_scale), text="text:N")
    text_colored = text_base.encode(color=color)
    parts = smoothquant_parts(points, steps)

    def data(part: str) -> pd.DataFrame | alt.NamedData:
        return alt.NamedData(name=SMOOTH_DATA + part) if named else parts[part]

    panels = []
    for stage, title in (("before", "before smoothing"),
                         ("after", "after smoothing" if named else f"after smoothing (α = {alpha:.2f})")):
        dots = dots_base.properties(data=data(f"{stage}_dots"))
        rules = rules_base.properties(data=data(f"{stage}_rules"))
        # each rule named at its right end (the legend's colours say which tensor, not what a dashed line is): the
        # larger step's name above its line, the smaller's below, so the two never overlap however close the steps
        # come (after smoothing they often meet: at α = 0.5 the weight's can sit a hair above the activation's);
        # each on a white halo over the points
        names = [
            (text_base if style else text_colored).mark_text(align="right", dy=dy, fontSize=11, **style)
            .properties(data=data(f"{stage}_name{i}"))
            for i, dy in ((0, -7), (1, 11)) if named or len(parts[f"{stage}_name{i}"])
            for style in ({"stroke": "white", "strokeWidth": 3, "strokeOpacity": 0.9}, {})
        ]
        panels.append(alt.layer(dots, rules, *names, title=title, height=height, width=width))
    return alt.hconcat(*panels).resolve_scale(y="shared")


def alpha_sweep_chart(sweep: pd.DataFrame, alpha: float, height: int = CHART_HEIGHT) -> alt.LayerChart:
    """Share of activation / weight channels flushed by per-tensor INT8 as alpha varies, chosen alpha marked.

    sweep: alpha, act_flushed, weight_flushed (``quantcore.evaluation.outliers.alpha_sweep``).
    """
    check_columns(sweep, ["alpha", "act_flushed", "weight_flushed"], "alpha_sweep_chart")
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
            tooltip=[alt.Tooltip("alpha:Q", title="α", format=".2f"), alt.Tooltip("tensor:N", title="tensor"),
                     alt.Tooltip("flushed:Q", format=".1%", title="channels flushed")],
        )
    )
    chosen = alt.Chart(pd.DataFrame({"alpha": [alpha]})).mark_rule(color="black").encode(x="alpha:Q")
    return alt.layer(lines, chosen, height=height, title="Choosing α")


SUGGESTED_COLOR = GREEN  # the suggested α's rule: apart from the activation / weight series colours


def alpha_choice_chart(sweep: pd.DataFrame, alpha: float, suggested: float, scheme: str,
                       height: int = CHART_HEIGHT) -> alt.VConcatChart:
    """"Choosing α" for the scheme that will be saved: the estimated relative output error (log axis) above the
    shares of activation channels and weight columns that scheme flushes to zero; the chosen α a black rule, the
    suggested one (least estimated error) a dashed green rule in both panels.

    sweep: alpha, error, act_flushed, weight_flushed (``quantcore.evaluation.alpha.alpha_error_sweep``).
    """
    check_columns(sweep, ["alpha", "error", "act_flushed", "weight_flushed"], "alpha_choice_chart")
    x = alt.X("alpha:Q", title="α", scale=alt.Scale(domain=[0, 1]))
    rules = pd.DataFrame({"alpha": [float(alpha), float(suggested)], "which": ["chosen", "suggested"]})
    marks = (
        alt.Chart(rules)
        .mark_rule()
        .encode(
            x="alpha:Q",
            color=alt.Color("which:N", title="α", scale=alt.Scale(domain=["chosen", "suggested"],
                                                                  range=["black", SUGGESTED_COLOR])),
            strokeDash=alt.StrokeDash("which:N", scale=alt.Scale(domain=["chosen", "suggested"],
                                                                 range=[[1, 0], [6, 3]]), legend=None),
            tooltip=[alt.Tooltip("which:N", title="α"), alt.Tooltip("alpha:Q", format=".2f", title="value")],
        )
    )
    errors = sweep[["alpha", "error"]].copy()
    errors["error"] = errors["error"].clip(lower=positive_floor(errors["error"]))  # a log axis: no zeros
    error_line = (
        alt.Chart(errors)
        .mark_line(point=True, color=SERIES_COLORS["activation"])
        .encode(x=x, y=alt.Y("error:Q", title="estimated rel. output error", scale=alt.Scale(type="log")),
                tooltip=[alt.Tooltip("alpha:Q", title="α", format=".2f"),
                         alt.Tooltip("error:Q", format=".3g", title="estimated rel. output error")])
    )
    long = sweep.melt(id_vars=["alpha"], value_vars=["act_flushed", "weight_flushed"], var_name="tensor",
                      value_name="flushed")
    long["tensor"] = long["tensor"].map({"act_flushed": "activation", "weight_flushed": "weight"})
    flush_lines = (
        alt.Chart(long)
        .mark_line(point=True)
        .encode(
            x=x,
            y=alt.Y("flushed:Q", title="channels flushed", axis=alt.Axis(format="%")),
            color=alt.Color("tensor:N", scale=alt.Scale(domain=list(SERIES_COLORS),
                                                        range=list(SERIES_COLORS.values()))),
            tooltip=[alt.Tooltip("alpha:Q", title="α", format=".2f"), alt.Tooltip("tensor:N", title="tensor"),
                     alt.Tooltip("flushed:Q", format=".1%", title="channels flushed")],
        )
    )
    top = alt.layer(error_line, marks, height=height // 2)
    bottom = alt.layer(flush_lines, marks, height=height // 2)
    return alt.vconcat(top, bottom, title=f"Choosing α for {scheme}").resolve_scale(color="independent")


def with_chosen_alpha(spec: dict, alpha: float) -> dict:
    """An :func:`alpha_choice_chart` spec (a dict, changed in place and returned) with its chosen α moved to
    ``alpha``: the chart is built once per layer and scheme, and a slider step only moves its rule."""
    for rows in spec.get("datasets", {}).values():
        for row in rows:
            if isinstance(row, dict) and row.get("which") == "chosen":
                row["alpha"] = float(alpha)
    return spec


def histogram_chart(
    hist: pd.DataFrame, grid: pd.DataFrame, fmt_label: str = "", height: int = CHART_HEIGHT
) -> alt.LayerChart:
    """The |x| histogram (log x, symlog count) with a format's representable values, clip and flush points.

    hist: lo, hi, count (from :func:`hist_frame`); grid: value, kind (from :func:`grid_frame`).
    """
    check_columns(hist, ["lo", "hi", "count"], "histogram_chart")
    check_columns(grid, ["value", "kind"], "histogram_chart grid")
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
                alt.Tooltip("lo:Q", format=".3g", title="from |x|"),
                alt.Tooltip("hi:Q", format=".3g", title="to |x|"),
                alt.Tooltip("count:Q", format=",d", title="values"),
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
            tooltip=[alt.Tooltip("kind:N", title="grid point"), alt.Tooltip("value:Q", format=".4g", title="|x|")],
        )
    )
    title = f"|x| histogram with the {fmt_label} grid" if fmt_label else "|x| histogram"
    return alt.layer(bars, rules, height=height, title=title)


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
    check_columns(df, ["layer", "block", "tensor", "amax"], "kv_amax_chart")
    floor = positive_floor(df["amax"])
    df = df.assign(value=df["amax"].clip(lower=floor))
    top = max(float(df["value"].max()) if len(df) else limit, limit) * 2
    points = (
        alt.Chart(df, height=height, title="Largest |Q|, |K| and |V| per attention layer, as attention reads them")
        .mark_line(point=True)
        .encode(
            x=alt.X("block:O", title="block"),
            y=alt.Y("value:Q", title="max |x|", scale=alt.Scale(type="log", domainMax=top)),
            color=alt.Color("tensor:N", title="tensor", scale=category_scale(["K", "V", "Q"])),
            tooltip=[alt.Tooltip("layer:N", title="layer"), alt.Tooltip("tensor:N", title="tensor"),
                     alt.Tooltip("amax:Q", format=",.4g", title="max |x|")],
        )
    )
    rule = alt.Chart(pd.DataFrame({"y": [limit], "label": [f"E4M3 max {limit:g} (scale 1.0)"]})).mark_rule(
        strokeDash=[6, 3], color=VERMILLION).encode(y="y:Q")
    text = alt.Chart(pd.DataFrame({"y": [limit], "label": [f"E4M3 max {limit:g}: unscaled FP8 saturates above"]})) \
        .mark_text(align="left", dx=4, dy=-6, color=VERMILLION).encode(y="y:Q", text="label:N")
    return alt.layer(points, rule, text)


def rotation_frame(views: Sequence, max_points: int = CHANNEL_POINTS) -> pd.DataFrame:
    """One row per (fix, channel rank) of a layer's input under each fix (quantcore.evaluation.rotation_view.FixView):
    the per-channel max, sorted largest first, so the fixes' curves overlay. Past ``max_points`` / 3 channels a curve
    keeps log-spaced ranks (every one of the first, where the outliers are; fewer down the flat tail)."""
    rows = []
    per_fix = max(2, max_points // 3)
    for v in views:
        ordered = np.sort(np.asarray(v.channel_max, dtype=np.float64))[::-1]
        ranks = np.arange(ordered.size)
        if ordered.size > per_fix:
            ranks = np.unique(np.round(np.geomspace(1, ordered.size, per_fix)).astype(np.int64) - 1)
        rows += [{"fix": v.fix, "rank": int(i), "channel_max": float(ordered[i])} for i in ranks]
    return pd.DataFrame(rows)


def rotation_chart(frame: pd.DataFrame) -> alt.Chart:
    """Sorted per-channel max |x| of a layer's input: as calibrated, smoothed and rotated (log scale)."""
    return alt.Chart(frame).mark_line().encode(
        x=alt.X("rank:Q", title="input channels, largest max first"),
        y=alt.Y("channel_max:Q", title="max |x| of the channel", scale=alt.Scale(type="log")),
        color=alt.Color("fix:N", title="fix", scale=category_scale(list(dict.fromkeys(frame["fix"])))),
        tooltip=[alt.Tooltip("fix:N", title="fix"), alt.Tooltip("rank:Q", title="rank (0 = largest)"),
                 alt.Tooltip("channel_max:Q", format=".3g", title="max |x| of the channel")],
    ).properties(height=260)
