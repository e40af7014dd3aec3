"""The Kernels page's charts: speed-up of each kernel path per GEMM shape, and the share of peak throughput."""

from __future__ import annotations

from typing import Any

import altair as alt
import numpy as np
import pandas as pd

from app.charts.base import (
    DIVERGING_SCHEME,
    KERNEL_COLUMN_PX,
    KERNEL_DARK_SHARE,
    KERNEL_MIN_EXTENT,
    KERNEL_ROW_PX,
    MAX_MARKS,
    NEUTRAL,
    PURPLE,
    category_scale,
    check_columns,
)

NOTE_COLOR = NEUTRAL  # the text of a cell with no time ("skipped", "failed"): lighter than a measured one's
UNSTABLE_COLOR = PURPLE  # the outline of a cell whose case is flagged unstable: apart from the blue-orange scale
UNSTABLE_MARK = " ~"  # after an unstable cell's speed-up: its spread is wide, the figure is not to be trusted


def _time_text(ms: Any, p20: Any, p80: Any, repeats: Any) -> str:
    """'0.1234 ms (p20-p80 0.12-0.13 ms, 5 repeats)'; '—' without a time, the spread '—' where none was kept."""
    if ms is None or pd.isna(ms):
        return "—"
    spread = ("p20-p80 —" if p20 is None or p80 is None or pd.isna(p20) or pd.isna(p80)
              else f"p20-p80 {float(p20):.4g}-{float(p80):.4g} ms")
    reps = "repeats —" if repeats is None or pd.isna(repeats) else f"{int(repeats)} repeats"
    return f"{float(ms):.4g} ms ({spread}, {reps})"


def spread_columns(df: pd.DataFrame) -> dict[str, list[str]]:
    """The "Every case" table's text columns of a kernel frame: ``spread`` ("0.12-0.13" ms, p20-p80), ``repeats``,
    ``baseline`` (the interleaved baseline's median and p20-p80) and ``stability`` ("UNSTABLE", "stable"); "—" where
    a row has none (stored before quantplan kept the spread, or no time)."""

    def missing(v: Any) -> bool:
        return v is None or bool(pd.isna(v))

    def band(lo: Any, hi: Any) -> str:
        return "—" if missing(lo) or missing(hi) else f"{float(lo):.4g}-{float(hi):.4g}"

    def col(name: str) -> list[Any]:
        return list(df[name]) if name in df.columns else [None] * len(df)

    return {
        "spread": [band(lo, hi) for lo, hi in zip(col("ms_p20"), col("ms_p80"), strict=True)],
        "repeats": ["—" if missing(r) else str(int(r)) for r in col("repeats")],
        "baseline": ["—" if missing(b) else f"{float(b):.4g} ({band(lo, hi)})"
                     for b, lo, hi in zip(col("baseline_ms"), col("baseline_ms_p20"), col("baseline_ms_p80"),
                                          strict=True)],
        "stability": ["—" if missing(u) else "UNSTABLE" if bool(u) else "stable" for u in col("unstable")],
    }


def case_tooltips(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` (rows of quantplan.services.kernels.kernel_frame) with the heatmap tooltip's columns: ``time`` (the
    path's median, p20-p80 and repeats), ``baseline`` (the baseline's, timed interleaved with it, what the speed-up
    is over) and ``status`` (measured, UNSTABLE with its spread, or why there is no time)."""
    from quantcore.kernels.records import UNSTABLE_SPREAD, relative_spread

    def col(name: str) -> list[Any]:
        return list(df[name]) if name in df.columns else [None] * len(df)

    times = [_time_text(*v) for v in zip(col("ms"), col("ms_p20"), col("ms_p80"), col("repeats"), strict=True)]
    bases = [_time_text(m, lo, hi, r) for m, lo, hi, r in zip(col("baseline_ms"), col("baseline_ms_p20"),
                                                              col("baseline_ms_p80"), col("repeats"), strict=True)]
    status = []
    for ms, lo, hi, bms, blo, bhi, shaky, why, native in zip(
            col("ms"), col("ms_p20"), col("ms_p80"), col("baseline_ms"), col("baseline_ms_p20"),
            col("baseline_ms_p80"), col("unstable"), col("skipped"), col("native"), strict=True):
        if ms is None or pd.isna(ms):
            status.append(f"no time: {why}" if isinstance(why, str) and why else "no time")
        elif isinstance(shaky, bool | np.bool_) and shaky:
            rels = [f"{name} {100 * r:.0f}%" for name, r in (("path", relative_spread(ms, lo, hi)),
                                                            ("baseline", relative_spread(bms, blo, bhi)))
                    if r is not None]
            status.append(f"UNSTABLE: p20-p80 over {100 * UNSTABLE_SPREAD:.0f}% of the median ({', '.join(rels)}): "
                          "left out of step estimates until measured again")
        elif native is not None and not pd.isna(native) and not native:
            status.append("measured, but not native on this device: its speed-up is not shown")
        else:
            status.append("measured" + ("" if lo is not None and not pd.isna(lo) else " (spread not kept then)"))
    return df.assign(time=times, baseline=bases, status=status)


def kernel_heatmap(
    df: pd.DataFrame,
    height: int | None = None,
    column: str = "path",
    column_title: str = "kernel path",
    title: str = "Speed-up over baseline",
) -> alt.LayerChart:
    """Speed-up over the baseline GEMM, GEMM shape x kernel path; 1x is white, faster blue, slower orange.

    Input columns: shape (a label such as "down_proj 576x1536 M=512"), ``column`` (default
    path; e.g. "device" to compare devices on one path), speedup (NaN where the device does
    not run the path natively: drawn as "n/a", never as a speed-up)[, note: drawn instead of
    "n/a" where it is not empty, e.g. "skipped" for a case with no time, in a lighter grey than a measured cell's]
    [, unstable: True where the case's spread is wide: outlined, its speed-up followed by ``UNSTABLE_MARK``]
    [, time, baseline, status: more lines of the tooltip (:func:`case_tooltips`)].
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
    notes = [str(n) if isinstance(n, str) else "" for n in (df["note"] if "note" in df.columns else [""] * len(df))]
    shaky = [isinstance(u, bool | np.bool_) and bool(u) for u in
             (df["unstable"] if "unstable" in df.columns else [False] * len(df))]
    df = df.assign(
        text=[f"{v:.2f}×" + (UNSTABLE_MARK if u else "") if ok else (note or "n/a")
              for v, ok, note, u in zip(speedup, valid, notes, shaky, strict=True)],
        text_color=np.where(dark, "white", np.where([bool(n) and not ok for n, ok in zip(notes, valid, strict=True)],
                                                    NOTE_COLOR, "black")),
        unstable=shaky,
    )
    extra = [c for c in ("time", "baseline", "status") if c in df.columns]
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
            scale=alt.Scale(type="log", scheme=DIVERGING_SCHEME, domain=[1 / extent, extent], domainMid=1.0,
                            reverse=True),  # faster (above 1x) blue, slower orange
        ),
        tooltip=[alt.Tooltip("shape:N", title="GEMM shape"), alt.Tooltip(f"{column}:N", title=column_title),
                 alt.Tooltip("text:N", title="speed-up"),
                 *(alt.Tooltip(f"{c}:N", title=c) for c in extra)],
        # an unstable case is outlined: its figure is shown, but not to be trusted
        stroke=alt.condition("datum.unstable", alt.value(UNSTABLE_COLOR), alt.value(None)),
        strokeWidth=alt.condition("datum.unstable", alt.value(2.5), alt.value(0)),
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
        "tooltip": [alt.Tooltip("label:N", title="case"), alt.Tooltip("pct_peak:Q", format=".1f", title="% of peak")],
    }
    if "path" in df.columns:
        paths = sorted(set(df["path"]))
        encodings["color"] = alt.Color("path:N", title="kernel path", scale=category_scale(paths))
    bars = alt.Chart(df).mark_bar().encode(**encodings)
    full = alt.Chart(pd.DataFrame({"pct_peak": [100.0]})).mark_rule(strokeDash=[4, 3]).encode(x="pct_peak:Q")
    return alt.layer(bars, full, height=height or alt.Step(18), **({"title": title} if title else {}))
