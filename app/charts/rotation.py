"""The rotation what-if's model-level charts (issue #46): every layer's input under each fix (as calibrated,
SmoothQuant at an α, Hadamard-rotated) across depth. Pure Altair; the layer-level chart is
:func:`app.charts.outliers.rotation_chart`."""

from __future__ import annotations

import altair as alt
import numpy as np
import pandas as pd

from app.charts.base import CHART_HEIGHT, OUTLIER_RATIO_CAP, category_scale, check_columns

DEPTH_COLUMNS = ("layer", "block", "proj", "fix", "outlier_ratio", "kurtosis")


def depth_fix_frame(columns: dict, proj: str) -> pd.DataFrame:
    """The rows of :func:`quantcore.evaluation.rotation_view.depth_fixes` for one projection type, as a frame, an
    infinite ratio drawn at the cap (a median channel exactly 0)."""
    df = pd.DataFrame(columns, columns=list(DEPTH_COLUMNS))
    df = df[df["proj"] == proj].copy()
    df["outlier_ratio"] = df["outlier_ratio"].replace([np.inf], OUTLIER_RATIO_CAP)
    return df


def depth_fix_chart(df: pd.DataFrame, proj: str, figure: str = "outlier_ratio",
                    height: int = CHART_HEIGHT) -> alt.Chart:
    """``figure`` (outlier ratio or kurtosis, log y) of every ``proj`` input across depth, one line per fix: where
    each fix brings the layers' inputs down. Rows whose figure is unknown (nan: SmoothQuant's kurtosis) are left out."""
    check_columns(df, ["layer", "block", "fix", figure], "depth_fix_chart")
    title = {"outlier_ratio": "outlier ratio (max / median channel)", "kurtosis": "kurtosis E[x⁴]/E[x²]²"}[figure]
    shown = df[np.isfinite(df[figure]) & (df[figure] > 0)]
    return alt.Chart(shown, height=height, title=f"{title} of every {proj} input, by fix").mark_line(point=True).encode(
        x=alt.X("block:O", title="block"),
        y=alt.Y(f"{figure}:Q", title=title, scale=alt.Scale(type="log")),
        color=alt.Color("fix:N", title="fix", scale=category_scale(list(dict.fromkeys(df["fix"])))),
        tooltip=[alt.Tooltip("layer:N", title="layer"), alt.Tooltip("fix:N", title="fix"),
                 alt.Tooltip(f"{figure}:Q", format=",.3g", title=title)],
    )


def fix_kl_chart(df: pd.DataFrame, height: int = 60) -> alt.Chart:
    """KL (log x) of plans that differ only in their outlier fix, one bar per fix with its ± one standard error.

    Input: fix, kl_mean, kl_lo, kl_hi (kl_lo / kl_hi: the error bar's ends; the mean where there is no error)."""
    check_columns(df, ["fix", "kl_mean", "kl_lo", "kl_hi"], "fix_kl_chart")
    floor = max(float(df["kl_mean"][df["kl_mean"] > 0].min()) / 10 if (df["kl_mean"] > 0).any() else 1e-6, 1e-9)
    df = df.assign(kl_plot=df["kl_mean"].clip(lower=floor), kl_lo=df["kl_lo"].clip(lower=floor),
                   kl_hi=df["kl_hi"].clip(lower=floor))
    fixes = list(df["fix"])
    y = alt.Y("fix:N", title=None, sort=fixes)
    x_scale = alt.Scale(type="log")
    bars = alt.Chart(df).mark_bar().encode(
        x=alt.X("kl_plot:Q", title="KL mean (nats, log)", scale=x_scale), y=y,
        color=alt.Color("fix:N", legend=None, scale=category_scale(fixes)),
        tooltip=[alt.Tooltip("fix:N", title="fix"), alt.Tooltip("kl_mean:Q", format=".4g", title="KL mean"),
                 alt.Tooltip("kl_lo:Q", format=".4g", title="− 1 s.e."), alt.Tooltip("kl_hi:Q", format=".4g",
                                                                                     title="+ 1 s.e.")])
    errors = alt.Chart(df).mark_rule(color="black").encode(x=alt.X("kl_lo:Q", scale=x_scale), x2="kl_hi:Q", y=y)
    return alt.layer(bars, errors).properties(height=max(height, 28 * len(df)))
