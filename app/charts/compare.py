"""The Compare page's charts: runs side by side, each run one colour of a categorical palette, its legend naming the
run's plan and version (quantplan.services.compare.Run.label)."""

from __future__ import annotations

import altair as alt
import pandas as pd

from app.charts.base import BLUE, CHART_HEIGHT, MAX_MARKS, VERMILLION, category_scale, check_columns
from quantcore.evaluation.outliers import parse_layer_name

ERROR_Z = 2.0  # error bars: ± this many standard errors (quantcore.evaluation.statistics.Z)
LEGEND = "run (plan and version)"
LEGEND_LABEL_PX = 420  # a run's label in the legend, whole up to this width
DRIFT_COLORS = {"base (a)": BLUE, "other (b)": VERMILLION}  # the one palette (app.charts.base)


def short_names(layers: list[str]) -> dict[str, str]:
    """{layer: "11 q_proj"} (block and projection) for an axis, when that names each layer once; else the names."""
    short = {}
    for name in layers:
        block, proj = parse_layer_name(name)
        short[name] = proj if block is None else f"{block} {proj}"
    return short if len(set(short.values())) == len(short) else {n: n for n in layers}


def _layer_axis(order: list[str]) -> alt.X:
    return alt.X("short:N", sort=order, title="layer (block and projection)",
                 axis=alt.Axis(labels=len(order) <= 80, labelAngle=-45, labelLimit=160))


def _color(labels: list[str]) -> alt.Color:
    return alt.Color("run:N", title=LEGEND, scale=category_scale(labels),  # the one palette (app.charts.base)
                     legend=alt.Legend(orient="right", columns=1, labelLimit=LEGEND_LABEL_PX))


def metric_chart(df: pd.DataFrame, labels: list[str], title: str, height: int = CHART_HEIGHT) -> alt.LayerChart:
    """One figure of each run as a bar with ± ERROR_Z error bars where it has an error.

    Input columns: run (its label), value, err (NaN: none)."""
    check_columns(df, ["run", "value", "err"], "metric_chart")
    df = df.head(MAX_MARKS).copy()
    df["lo"], df["hi"] = df["value"] - ERROR_Z * df["err"], df["value"] + ERROR_Z * df["err"]
    y = alt.Y("run:N", title=None, sort=labels, axis=alt.Axis(labelLimit=400))
    bars = alt.Chart(df).mark_bar().encode(
        x=alt.X("value:Q", title=title), y=y, color=_color(labels),
        tooltip=["run:N", alt.Tooltip("value:Q", format=".4g"), alt.Tooltip("err:Q", title="± error", format=".2g")])
    rules = alt.Chart(df[df["err"].notna()]).mark_rule(color="#333333").encode(x="lo:Q", x2="hi:Q", y=y)
    return alt.layer(bars, rules, height=max(60, 28 * len(df)), title=title)


def difference_chart(df: pd.DataFrame, height: int = CHART_HEIGHT) -> alt.LayerChart:
    """Each run's difference from the baseline with ± ERROR_Z errors: paired (solid) and, for contrast, what the
    same difference's error would be unpaired (faint).

    Input columns: run (its label), difference, err, err_unpaired (NaN: none)."""
    check_columns(df, ["run", "difference", "err", "err_unpaired"], "difference_chart")
    df = df.head(MAX_MARKS).copy()
    labels = list(df["run"])
    for col, name in (("err", "p"), ("err_unpaired", "u")):
        df[f"{name}_lo"], df[f"{name}_hi"] = df["difference"] - ERROR_Z * df[col], df["difference"] + ERROR_Z * df[col]
    y = alt.Y("run:N", title=None, sort=labels, axis=alt.Axis(labelLimit=400))
    x_title = f"difference from the baseline (± {ERROR_Z:g} standard errors)"
    unpaired = alt.Chart(df[df["err_unpaired"].notna()]).mark_rule(strokeWidth=8, opacity=0.2, color="#888888") \
        .encode(x=alt.X("u_lo:Q", title=x_title), x2="u_hi:Q", y=y)
    paired = alt.Chart(df[df["err"].notna()]).mark_rule(strokeWidth=2).encode(
        x=alt.X("p_lo:Q", title=x_title), x2="p_hi:Q", y=y, color=_color(labels))
    points = alt.Chart(df).mark_circle(size=90).encode(
        x=alt.X("difference:Q", title=x_title), y=y, color=_color(labels),
        tooltip=["run:N", alt.Tooltip("difference:Q", format=".4g"),
                 alt.Tooltip("err:Q", title="± error", format=".2g"),
                 alt.Tooltip("err_unpaired:Q", title="± unpaired", format=".2g")])
    zero = alt.Chart(pd.DataFrame({"x": [0.0]})).mark_rule(strokeDash=[4, 4], color="#999999").encode(x="x:Q")
    return alt.layer(zero, unpaired, paired, points, height=max(80, 36 * len(df)))


def per_layer_chart(df: pd.DataFrame, labels: list[str], y_title: str, log: bool = True,
                    height: int = CHART_HEIGHT) -> alt.Chart:
    """A value per layer (or unit) for each run, the layers in model order along x.

    Input columns: layer, run (its label), value."""
    check_columns(df, ["layer", "run", "value"], "per_layer_chart")
    df = df[df["value"].notna()].head(MAX_MARKS).copy()
    short = short_names(list(dict.fromkeys(df["layer"])))
    df["short"] = df["layer"].map(short)
    scale = alt.Scale(type="log") if log else alt.Scale()
    return alt.Chart(df).mark_line(point=True, opacity=0.8).encode(
        x=_layer_axis(list(short.values())),
        y=alt.Y("value:Q", title=y_title, scale=scale), color=_color(labels),
        tooltip=["layer:N", "run:N", alt.Tooltip("value:Q", format=".4g")]).properties(height=height)


def drift_chart(df: pd.DataFrame, a: str, b: str, height: int = CHART_HEIGHT) -> alt.Chart:
    """Outlier ratio of each layer under calibration a and b, a line each, the layer's verdict in the tooltip.

    Input columns: layer, verdict, ratio_a, ratio_b."""
    check_columns(df, ["layer", "verdict", "ratio_a", "ratio_b"], "drift_chart")
    long = df.melt(id_vars=["layer", "verdict"], value_vars=["ratio_a", "ratio_b"], var_name="which",
                   value_name="ratio").head(MAX_MARKS)
    long["run"] = long["which"].map({"ratio_a": a, "ratio_b": b})
    short = short_names(list(dict.fromkeys(df["layer"])))
    long["short"] = long["layer"].map(short)
    return alt.Chart(long).mark_line(point=True).encode(
        x=_layer_axis(list(short.values())),
        y=alt.Y("ratio:Q", title="outlier ratio (max / median, log)", scale=alt.Scale(type="log")),
        color=alt.Color("run:N", title="calibration", scale=alt.Scale(domain=[a, b],
                                                                       range=list(DRIFT_COLORS.values())),
                        legend=alt.Legend(orient="right", columns=1, labelLimit=LEGEND_LABEL_PX)),
        tooltip=["layer:N", "run:N", "verdict:N", alt.Tooltip("ratio:Q", format=".4g")]).properties(height=height)
