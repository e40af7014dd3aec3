"""The Results page's charts: the per-token KL distribution and KL by position of scored plans, sensitivity per
unit (one scheme, or every swept scheme side by side), and the KL of each scored plan against its cost."""

from __future__ import annotations

from collections.abc import Iterable

import altair as alt
import numpy as np
import pandas as pd

from app.charts.base import (
    BLUE,
    CHART_HEIGHT,
    DEFAULT_MAX_POINTS,
    KL_BINS,
    KL_FLOOR,
    MAGNITUDE_SCHEME,
    MAX_MARKS,
    NEUTRAL,
    ORANGE,
    SENSITIVITY_TOP_N,
    VERMILLION,
    category_scale,
    check_columns,
    positive_floor,
    proj_sort,
)

RUN_LEGEND = "score (plan and version)"  # the legend of runs compared: each label "#12 fp8-mlp v2"
LEGEND_LABEL_PX = 420  # a run's label in the legend, whole up to this width


def run_order(labels: Iterable[object]) -> list[str]:
    """The runs' labels ("#12 fp8-mlp v2") in job order (by the number after '#', then by the label): every chart of
    the same runs gives each one the same colour."""
    def key(label: str) -> tuple[int, str]:
        head = label[1:].split(" ", 1)[0] if label.startswith("#") else ""
        return (int(head) if head.isdigit() else 1 << 62, label)

    return sorted({str(x) for x in labels}, key=key)


def run_color(labels: Iterable[object]) -> alt.Color:
    """The colour of the runs compared: one palette colour each, in job order (:func:`run_order`), the legend beside
    the chart (below it, it would take the plot's height) naming each run's job, plan and version in full."""
    return alt.Color("label:N", title=RUN_LEGEND, scale=category_scale(run_order(labels)),
                     legend=alt.Legend(orient="right", columns=1, labelLimit=LEGEND_LABEL_PX))


def kl_histogram_frame(df: pd.DataFrame, bins: int = KL_BINS) -> pd.DataFrame:
    """Per-token KL values (columns kl[, label]) binned on shared log bins: label, lo, hi, center, count, share.

    Values below :data:`KL_FLOOR` (including exact zeros) fall in the first bin.
    """
    check_columns(df, ["kl"], "kl_histogram_frame")
    if "label" not in df.columns:
        df = df.assign(label="run")
    kl = df["kl"].to_numpy(dtype=np.float64)
    finite = np.isfinite(kl)
    top = max(float(kl[finite].max()) if finite.any() else KL_FLOOR, KL_FLOOR * 10)
    lo_edge = max(KL_FLOOR, positive_floor(kl[finite], KL_FLOOR))
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
        check_columns(df, ["label", "center", "share"], "kl_distribution_chart")
        binned = df
        means = pd.DataFrame({"label": [], "mean": []})
    if len(binned) > MAX_MARKS:
        raise ValueError(f"kl_distribution_chart got {len(binned)} bins (limit {MAX_MARKS})")
    means["mean"] = means["mean"].clip(lower=KL_FLOOR)
    color = run_color(dict.fromkeys(binned["label"]))
    lines = (
        alt.Chart(binned)
        .mark_line(interpolate="step")
        .encode(
            x=alt.X("center:Q", title="per-token KL (nats)", scale=alt.Scale(type="log")),
            y=alt.Y("share:Q", title="share of tokens", axis=alt.Axis(format="%")),
            color=color,
            tooltip=[alt.Tooltip("label:N", title="score"),
                     alt.Tooltip("center:Q", format=".3g", title="per-token KL (nats)"),
                     alt.Tooltip("share:Q", format=".1%", title="share of tokens")],
        )
    )
    rules = (
        alt.Chart(means)
        .mark_rule(strokeDash=[4, 3])
        .encode(x="mean:Q", color=color, tooltip=[alt.Tooltip("label:N", title="score"),
                                                  alt.Tooltip("mean:Q", format=".4g", title="mean KL (nats)")])
    )
    return alt.layer(lines, rules, height=height, title="Per-token KL against the unquantized model")


def kl_by_position_chart(
    df: pd.DataFrame, height: int = 260, max_points: int = DEFAULT_MAX_POINTS
) -> alt.Chart:
    """Mean KL by token position (log y), one line per label.

    Input columns: position, kl[, label]. Positions beyond ``max_points`` per label are
    averaged in contiguous buckets (the chart keeps the mean, not single tokens).
    """
    check_columns(df, ["position", "kl"], "kl_by_position_chart")
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
            color=run_color(dict.fromkeys(df["label"])),
            tooltip=[alt.Tooltip("label:N", title="score"),
                     alt.Tooltip("position:Q", format=".0f", title="token position"),
                     alt.Tooltip("kl:Q", format=".4g", title="mean KL (nats)")],
        )
    )


def sensitivity_chart(df: pd.DataFrame, top_n: int = SENSITIVITY_TOP_N, bar_height: int = 16) -> alt.Chart:
    """Per-layer sensitivity as horizontal bars, most sensitive first (the ``top_n`` largest).

    Input columns: layer, kl (mean KL with only that layer quantized)[, proj]. Bars are
    coloured by projection type when ``proj`` is present.
    """
    check_columns(df, ["layer", "kl"], "sensitivity_chart")
    top = df.nlargest(min(top_n, MAX_MARKS), "kl")
    encodings = {
        "x": alt.X("kl:Q", title="mean KL with only this layer quantized (nats)"),
        # every bar labelled in full: layer names are long and each one is the point of a row
        "y": alt.Y("layer:N", title="", sort="-x", axis=alt.Axis(labelLimit=360, labelOverlap=False)),
        "tooltip": [alt.Tooltip("layer:N", title="layer"), alt.Tooltip("kl:Q", format=".4g", title="KL (nats)")],
    }
    if "proj" in top.columns:
        projs = proj_sort(top["proj"])
        encodings["color"] = alt.Color("proj:N", title="projection", sort=projs, scale=category_scale(projs))
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
    check_columns(df, ["scheme", "block", "proj", "kl"], "sensitivity_by_scheme")
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
    tooltip = [alt.Tooltip("scheme:N", title="scheme")] + (
        [alt.Tooltip("unit:N", title="unit")] if "unit" in df.columns
        else [alt.Tooltip("col:N", title="block"), alt.Tooltip("proj:N", title="projection")])
    tooltip.append(alt.Tooltip("kl:Q", format=".4g", title="KL (nats)"))
    return (
        alt.Chart(df, width=alt.Step(cell), height=alt.Step(cell))
        .mark_rect()
        .encode(
            x=alt.X("col:O", title="block", sort=order),
            # every projection labelled: the default overlap rule drops every other one
            y=alt.Y("proj:N", title="", sort=proj_sort(df["proj"]),
                    axis=alt.Axis(labelOverlap=False, labelLimit=240)),
            color=alt.Color("kl_plot:Q", title="KL (nats)", scale=alt.Scale(type="log", scheme=MAGNITUDE_SCHEME),
                            legend=alt.Legend(format=".1e")),
            row=alt.Row("scheme:N", title=None, header=alt.Header(labelAngle=0, labelAlign="left")),
            tooltip=tooltip,
        )
        .properties(title="KL with one unit quantized, per swept scheme")
    )


FRONT_COLORS = {"on the front": VERMILLION, "beaten": NEUTRAL}


ERROR_BAR_Z = 2.0  # error bars of the trade-off chart: ± this many standard errors (quantcore.evaluation.statistics.Z)


def tradeoff_chart(df: pd.DataFrame, cost: str, cost_title: str, height: int = CHART_HEIGHT) -> alt.LayerChart:
    """KL of each scored plan (log y) against what it costs (x), the Pareto front joined and labelled.

    Input columns: plan, kl_mean, ``cost``, front (bool: the plans worth choosing between, see
    quantplan.services.scoring.with_front)[, kl_mean_err, top1_agree]. Rows without a cost are left out (the page
    names them). A KL of 0 (BF16) is drawn a decade below the smallest positive KL (never below :data:`KL_FLOOR`);
    the tooltip keeps the true value. With ``kl_mean_err``, each plan has an error bar of ± :data:`ERROR_BAR_Z`
    standard errors (none where the error is NaN: a score stored before errors were kept). The front is a step line,
    its plans labelled: from each, the best KL available for no more cost.
    """
    check_columns(df, ["plan", "kl_mean", cost, "front"], "tradeoff_chart")
    keep = ["plan", "kl_mean", cost, "front"] + [c for c in ("kl_mean_err", "top1_agree") if c in df.columns]
    df = df.loc[df[cost].notna(), keep].head(MAX_MARKS // 4).copy()  # four marks per row
    # a KL of 0 (BF16) sits a decade below the smallest positive KL, not at KL_FLOOR: the plans worth
    # comparing keep the height of the chart
    floor = max(positive_floor(df["kl_mean"], default=KL_FLOOR) / 10, KL_FLOOR)
    df["kl_plot"] = df["kl_mean"].clip(lower=floor)
    df["where"] = np.where(df["front"], "on the front", "beaten")
    err = df["kl_mean_err"] if "kl_mean_err" in df.columns else pd.Series(np.nan, index=df.index)
    df["kl_lo"] = (df["kl_mean"] - ERROR_BAR_Z * err).clip(lower=floor)
    df["kl_hi"] = (df["kl_mean"] + ERROR_BAR_Z * err).clip(lower=floor)
    x = alt.X(f"{cost}:Q", title=cost_title, scale=alt.Scale(zero=False),
              axis=alt.Axis(format=",.4~r"))  # one plan alone: its value is the only tick, not 128.640381
    y = alt.Y("kl_plot:Q", title="KL mean (nats, log)", scale=alt.Scale(type="log"))
    tooltip = [alt.Tooltip("plan:N", title="plan"), alt.Tooltip("kl_mean:Q", title="KL mean (nats)", format=".4g"),
               *([alt.Tooltip("kl_mean_err:Q", title="± error", format=".2g")] if "kl_mean_err" in df.columns else []),
               alt.Tooltip(f"{cost}:Q", title=cost_title, format=".4g")]
    if "top1_agree" in df.columns:
        tooltip.append(alt.Tooltip("top1_agree:Q", title="top-1 agree", format=".3f"))
    color = alt.Color("where:N", title="", scale=alt.Scale(domain=list(FRONT_COLORS),
                                                           range=list(FRONT_COLORS.values())))
    base = alt.Chart(df)
    points = base.mark_circle(size=90).encode(x=x, y=y, color=color, tooltip=tooltip)
    bars = (alt.Chart(df[err.notna()]).mark_rule(opacity=0.6)
            .encode(x=x, y=alt.Y("kl_lo:Q", title="KL mean (nats, log)", scale=alt.Scale(type="log")), y2="kl_hi:Q",
                    color=color))
    front = df[df["front"]].sort_values(cost)
    line = (alt.Chart(front).mark_line(interpolate="step-after", color=FRONT_COLORS["on the front"], opacity=0.5)
            .encode(x=x, y=y))
    labels = alt.Chart(front).mark_text(align="left", dx=7, dy=-6, fontSize=11).encode(
        x=x, y=y, text="plan:N", color=alt.value("#333333"))  # the beaten ones crowd: they have tooltips
    return alt.layer(line, bars, points, labels, height=height, title=f"KL against {cost_title}")


PREDICTION_COLORS = {"kl": BLUE, "fisher": ORANGE}  # exact sweeps, Fisher estimates


def prediction_chart(df: pd.DataFrame, height: int = CHART_HEIGHT) -> alt.LayerChart:
    """Each verified automatic plan's measured KL (y, log, ± :data:`ERROR_BAR_Z` standard errors) against the KL it
    predicted as the sum of its units' (x, log), coloured by where those came from (exact sweeps or Fisher
    estimates), with the line measured = predicted: the points' distance from it is what the correction learns.

    Input columns: plan, sensitivity ("kl" | "fisher"), predicted_kl, measured_kl[, measured_kl_err, model]. Rows
    whose predicted or measured KL is not positive are left out (a log axis)."""
    check_columns(df, ["plan", "sensitivity", "predicted_kl", "measured_kl"], "prediction_chart")
    df = df[(df["predicted_kl"] > 0) & (df["measured_kl"] > 0)].head(MAX_MARKS // 3).copy()
    err = df["measured_kl_err"] if "measured_kl_err" in df.columns else pd.Series(np.nan, index=df.index)
    low = float(min(df["predicted_kl"].min(), df["measured_kl"].min())) if len(df) else KL_FLOOR
    high = float(max(df["predicted_kl"].max(), df["measured_kl"].max())) if len(df) else 1.0
    df["lo"] = (df["measured_kl"] - ERROR_BAR_Z * err).clip(lower=low / 2)
    df["hi"] = df["measured_kl"] + ERROR_BAR_Z * err
    x = alt.X("predicted_kl:Q", title="predicted KL (sum of units, log)", scale=alt.Scale(type="log"))
    y = alt.Y("measured_kl:Q", title="measured KL (log)", scale=alt.Scale(type="log"))
    color = alt.Color("sensitivity:N", title="predicted from",
                      scale=alt.Scale(domain=list(PREDICTION_COLORS), range=list(PREDICTION_COLORS.values())))
    tooltip = [alt.Tooltip("plan:N", title="plan"),
               *([alt.Tooltip("model:N", title="model")] if "model" in df.columns else []),
               alt.Tooltip("sensitivity:N", title="predicted from"),
               alt.Tooltip("predicted_kl:Q", title="predicted KL (nats)", format=".4g"),
               alt.Tooltip("measured_kl:Q", title="measured KL (nats)", format=".4g")]
    diagonal = alt.Chart(pd.DataFrame({"predicted_kl": [low / 2, high * 2], "measured_kl": [low / 2, high * 2]}))
    line = diagonal.mark_line(color=NEUTRAL, strokeDash=[4, 4]).encode(x=x, y=y)
    bars = (alt.Chart(df[err.notna()]).mark_rule(opacity=0.6)
            .encode(x=x, y=alt.Y("lo:Q", title="measured KL (log)", scale=alt.Scale(type="log")), y2="hi:Q",
                    color=color))
    points = alt.Chart(df).mark_circle(size=80).encode(x=x, y=y, color=color, tooltip=tooltip)
    return alt.layer(line, bars, points, height=height, title="Automatic plans: measured against predicted KL")
