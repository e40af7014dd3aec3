"""The Kernels page's charts: speed-up of each kernel path per GEMM shape, and the share of peak throughput."""

from __future__ import annotations

import altair as alt
import numpy as np
import pandas as pd

from app.charts.base import (
    KERNEL_COLUMN_PX,
    KERNEL_DARK_SHARE,
    KERNEL_MIN_EXTENT,
    KERNEL_ROW_PX,
    MAX_MARKS,
    check_columns,
)


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
    check_columns(df, ["shape", column, "speedup"], "kernel_heatmap")
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
    check_columns(df, ["label", "pct_peak"], "peak_bars")
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
