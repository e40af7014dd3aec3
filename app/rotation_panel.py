"""The Outliers page's rotation what-if (issue #46): a layer's input as calibrated, under SmoothQuant at the page's α
and Hadamard-rotated (from a calibration of the rotated model, queued here), what each number format flushes or clips
under each fix, and the whole model ranked by how much each fix helps. Included from ``app/views/outliers.py``
inside its SmoothQuant fragment (the α slider reruns it); the format table and the whole-model view compute only
while their expander is open."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pandas as pd
import streamlit as st

from app import auth
from app.charts import outliers as outlier_charts
from app.charts import rotation as rotation_charts
from app.charts.base import proj_sort, vega_spec
from quantcore.algorithms.rotation_spec import ROTATIONS, RotationSpec
from quantcore.errors import PlanError
from quantcore.evaluation import outliers as ol
from quantcore.evaluation import rotation_view as rv
from quantcore.formats.catalog import list_formats
from quantplan.services import calibration as calibration_svc
from quantplan.services import fixes as fixes_svc

BLOCK_SIZES = (None, 32, 64, 128)  # the queue form's choices: one Hadamard of the whole width, or blocks (MR-GPTQ)
FIX_FORMATS = ("int8", "fp8_e4m3", "fp4_e2m1", "mxfp4", "nvfp4")  # the format table's default, where they exist
RANKED_ROWS = 15
RANKED_COLUMNS = ("rotation_gain", "smoothquant_gain", "best_fix", "outlier_ratio", "outlier_ratio_rotation",
                  "outlier_ratio_smoothquant", "kurtosis", "kurtosis_rotation")  # the gains in view first
PCT = "%.2f%%"


@st.cache_resource(show_spinner="Loading the rotated statistics…", max_entries=4)
def rotated_stats(job_id: int) -> dict:
    """A rotated calibration's statistics by layer name (a finished job's results never change: keyed by its id)."""
    return {s.name: s for s in calibration_svc.layer_stats(job_id)}


# Keyed on the two calibrations' job ids (and the choices); the statistics themselves (underscored) are not hashed.
@st.cache_data(show_spinner=False, max_entries=32)
def layer_view(cal_id: int, rot_id: int, layer: str, alpha: float, _before: Mapping,
               _rotated: Mapping) -> tuple[pd.DataFrame, dict]:
    """The layer's input as calibrated, smoothed at ``alpha`` and rotated: the table's rows and the chart's spec."""
    views = rv.layer_fixes(_before[layer], _rotated.get(layer), alpha)
    table = pd.DataFrame([{"fix": v.fix, "outlier ratio (max / median)": round(v.outlier_ratio, 2),
                           "max |x|": round(v.amax, 4),
                           # a text column: SmoothQuant's kurtosis is not known (a null cell would read "None")
                           "kurtosis": "not known" if v.kurtosis != v.kurtosis else f"{v.kurtosis:,.1f}"}
                          for v in views])
    return table, vega_spec(outlier_charts.rotation_chart(outlier_charts.rotation_frame(views)))


@st.cache_data(show_spinner=False, max_entries=16)
def ranked(cal_id: int, rot_id: int, alpha: float, rank_by: str, _before: Mapping, _rotated: Mapping) -> pd.DataFrame:
    return pd.DataFrame(rv.fix_table(_before, _rotated, alpha, rank_by))


@st.cache_data(show_spinner=False, max_entries=16)
def depth_columns(cal_id: int, rot_id: int, alpha: float, _before: Mapping, _rotated: Mapping) -> dict:
    return rv.depth_fixes(_before, _rotated, alpha)


@st.cache_data(show_spinner=False, max_entries=32)
def depth_spec(cal_id: int, rot_id: int, alpha: float, proj: str, figure: str, _before: Mapping,
               _rotated: Mapping) -> dict:
    frame = rotation_charts.depth_fix_frame(depth_columns(cal_id, rot_id, alpha, _before, _rotated), proj)
    return vega_spec(rotation_charts.depth_fix_chart(frame, proj, figure))


@st.cache_data(show_spinner=False, max_entries=32)
def breakage(cal_id: int, rot_id: int, alpha: float, layers: tuple[str, ...], formats: tuple[str, ...], gran: str,
             _before: Mapping, _rotated: Mapping) -> pd.DataFrame:
    return pd.DataFrame(rv.fix_breakage(_before, _rotated, alpha, list(layers), list(formats), gran))


def _pct(df: pd.DataFrame, cols: tuple[str, ...]) -> pd.DataFrame:
    return df.assign(**{c: df[c] * 100 for c in cols if c in df})


def queue_form(model: Any, cal: Any, key: str) -> None:
    """Which rotation to calibrate (R1 / R2 / R4, whole width or blocks), and the button that queues it on the
    calibration ``cal``'s text and sizes."""
    if not auth.may("queue"):
        st.caption(auth.cannot("queue"))
        return
    c1, c2 = st.columns(2)
    rotations = c1.multiselect("Rotations", list(ROTATIONS), default=list(ROTATIONS), key=f"{key}_rotations",
                               help="R1: the residual stream (every block's input and output projections); R2: each "
                                    "attention head's values (v_proj → o_proj); R4: online before every down_proj")
    block = c2.selectbox("Hadamard", BLOCK_SIZES, key=f"{key}_block",
                         format_func=lambda b: "one of the whole width" if b is None else f"blocks of {b}",
                         help="blocks of a power of two are what llm-compressor's SpinQuantModifier can export")
    if st.button(f"Calibrate the rotated model (Hadamard {' + '.join(rotations) or '…'})", key=key):
        try:
            spec = RotationSpec(rotations=tuple(rotations), block_size=block)
        except PlanError as exc:
            st.error(f"Not queued: {exc}")
            return
        job = calibration_svc.submit_rotated_calibration(model.id, spec.to_dict(), like=cal)
        st.success(f"Queued job #{job.id}: this section compares once it has finished (the Jobs page shows it).")


def render(model: Any, cal: Any, layer: str, before: Mapping, alpha: float) -> bool:
    """The section, for calibration ``cal`` (a JobRecord) whose statistics by layer are ``before``, the chosen
    ``layer`` and SmoothQuant's ``alpha``; whether what it drew reads ``alpha`` (only with a rotated calibration: the
    α slider must then rerun this section too)."""
    st.subheader("Hadamard rotation, beside SmoothQuant")
    rotated_cals = calibration_svc.rotated_calibrations(model.id)
    pending = fixes_svc.pending_rotated_calibrations(model.id)
    if pending:
        st.info("Rotated calibration " + ", ".join(f"job #{j.id} ({j.progress_text})" for j in pending)
                + ": this section compares once it has finished.")
    if not rotated_cals:
        st.caption("A Hadamard rotation (QuaRot, SpinQuant: R1 on the residual stream, R2 on attention values, R4 "
                   "online before down_proj) spreads an outlier channel over every channel; the model computes the "
                   "same. A calibration of the rotated model, on this calibration's text and sizes, shows each layer's "
                   "input before and after.")
        if not pending:
            queue_form(model, cal, "outliers_rotate")
        return False
    what = {c.id: f"job #{c.id} · {fixes_svc.rotation_text((c.params or {}).get('rotation'))}" for c in rotated_cals}
    rot_id = st.selectbox("Rotated calibration", list(what), key="outliers_rot_cal", format_func=what.get)
    rotated = rotated_stats(rot_id)
    if layer not in rotated:
        st.info(f"Rotated calibration #{rot_id} has no statistics for {layer}.")
    else:
        table, spec = layer_view(cal.id, rot_id, layer, alpha, before, rotated)
        st.vega_lite_chart(spec, width="stretch")
        st.dataframe(table, hide_index=True)
        st.caption(f"{layer}'s input as calibrated, smoothed at the SmoothQuant section's α = {alpha:.2f} "
                   "(per-channel max divided by SmoothQuant's factors) and rotated (calibrated rotated). Kurtosis "
                   "E[x⁴]/E[x²]² is 3 for a Gaussian; SmoothQuant's is not known from the statistics (the histogram "
                   "mixes channels).")
        fmt_choices = list_formats()
        exp = st.expander(f"What each format flushes or clips in {layer}, under each fix", key="rot_breakage_open",
                          on_change="rerun")
        with exp:
            if exp.open:
                c1, c2 = st.columns(2)
                gran = c1.selectbox("Granularity", list(ol.GRANULARITIES), key="rot_breakage_gran")
                formats = c2.multiselect("Formats", fmt_choices, key="rot_breakage_fmts",
                                         default=[f for f in FIX_FORMATS if f in fmt_choices])
                if formats:
                    t = breakage(cal.id, rot_id, alpha, (layer,), tuple(formats), gran, before, rotated)
                    shown = _pct(t.sort_values(["format"], kind="stable"),
                                 ("frac_channels_flushed", "worst_rel_error", "expected_saturation"))
                    st.dataframe(shown[["format", "fix", "granularity", "frac_channels_flushed", "worst_rel_error",
                                        "expected_saturation", "scale_amax"]], hide_index=True, width="stretch",
                                 column_config={
                                     "frac_channels_flushed": st.column_config.NumberColumn(
                                         "channels flushed", format=PCT,
                                         help="channels whose largest value rounds to zero"),
                                     "worst_rel_error": st.column_config.NumberColumn(
                                         "worst rel. error", format=PCT,
                                         help="rounding error of the smallest channel's largest value"),
                                     "expected_saturation": st.column_config.NumberColumn(
                                         "clipped by a static scale", format=PCT,
                                         help="values a static scale from the p99 token max would clip"),
                                     "scale_amax": st.column_config.NumberColumn("scale amax", format="%.4g")})
                    st.caption("As the page's \"What will break\" table, for this layer's input under each fix. "
                               "SmoothQuant's rows come from the per-channel maxima divided by its factors: what a "
                               "static scale clips and what a per-token scale does are not known from those (empty); "
                               "the weights it scales up are not in this table.")
    model_exp = st.expander("Whole model: where each fix helps most", key="rot_model_open", on_change="rerun")
    with model_exp:
        if model_exp.open:
            _whole_model(cal.id, rot_id, alpha, layer, before, rotated)
    with st.expander("Calibrate another rotation"):
        queue_form(model, cal, "outliers_rotate_more")
    return True


def _whole_model(cal_id: int, rot_id: int, alpha: float, layer: str, before: Mapping, rotated: Mapping) -> None:
    sq = rv.smoothquant_label(alpha)
    rank_by = st.radio("Rank the layers by what", [rv.FIX_ROTATION, rv.FIX_SMOOTHQUANT], horizontal=True,
                       key="rot_rank_by", format_func=lambda f: "the rotation" if f == rv.FIX_ROTATION else sq)
    table = ranked(cal_id, rot_id, alpha, rank_by, before, rotated)
    gain = rv.RANK_BY[rank_by]  # the column ranked by
    st.dataframe(table.head(RANKED_ROWS), hide_index=True, width="stretch",
                 column_order=["layer", gain, *(c for c in RANKED_COLUMNS if c != gain)],
                 column_config={
                     "outlier_ratio": st.column_config.NumberColumn("ratio as calibrated", format="%.4g"),
                     "outlier_ratio_smoothquant": st.column_config.NumberColumn(f"ratio, {sq}", format="%.4g"),
                     "outlier_ratio_rotation": st.column_config.NumberColumn("ratio rotated", format="%.4g"),
                     "kurtosis": st.column_config.NumberColumn("kurtosis", format="%.4g"),
                     "kurtosis_rotation": st.column_config.NumberColumn("kurtosis rotated", format="%.4g"),
                     "smoothquant_gain": st.column_config.NumberColumn(
                         "SmoothQuant's gain", format="%.3g×", help="outlier ratio as calibrated / smoothed"),
                     "rotation_gain": st.column_config.NumberColumn(
                         "rotation's gain", format="%.3g×", help="outlier ratio as calibrated / rotated"),
                     "best_fix": st.column_config.TextColumn("larger gain")})
    wins = table["best_fix"].value_counts()
    what = "the rotation" if rank_by == rv.FIX_ROTATION else sq
    st.caption(f"The {min(RANKED_ROWS, len(table))} of {len(table)} layers {what} helps most (outlier ratio as "
               f"calibrated over the ratio under the fix). The rotation has the larger gain on "
               f"{int(wins.get(rv.FIX_ROTATION, 0))} layers, {sq} on {int(wins.get(sq, 0))}.")
    projs = proj_sort({ol.parse_layer_name(n)[1] for n in before if n in rotated})
    c1, c2 = st.columns(2)
    mine = ol.parse_layer_name(layer)[1]
    proj = c1.selectbox("Projection type", projs, index=projs.index(mine) if mine in projs else 0,
                        key="rot_depth_proj")
    figure = c2.radio("Figure", ["outlier_ratio", "kurtosis"], horizontal=True, key="rot_depth_figure",
                      format_func=lambda f: "outlier ratio" if f == "outlier_ratio" else "kurtosis")
    st.vega_lite_chart(depth_spec(cal_id, rot_id, alpha, proj, figure, before, rotated), width="stretch")
    flushed = breakage(cal_id, rot_id, alpha, tuple(n for n in before if n in rotated), ("int8", "fp8_e4m3"),
                       "tensor", before, rotated)
    summary = (flushed.assign(any_flushed=flushed["frac_channels_flushed"] > 0)
               .groupby(["format", "fix"], sort=False)  # the fixes in their order, within each format
               .agg(layers_flushing=("any_flushed", "sum"), mean_flushed=("frac_channels_flushed", "mean"))
               .reset_index().sort_values("format", kind="stable"))
    st.dataframe(_pct(summary, ("mean_flushed",)), hide_index=True,
                 column_config={"layers_flushing": st.column_config.NumberColumn(
                                    "layers losing a channel", help="layers where some channel's largest value "
                                                                    "rounds to zero under a per-tensor scale"),
                                "mean_flushed": st.column_config.NumberColumn("channels flushed, mean", format=PCT)})
    st.caption("Per-tensor INT8 and FP8 E4M3 over every layer both calibrations saw: how many layers lose some "
               "channel entirely under each fix.")
