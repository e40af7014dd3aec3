"""Compare: two or more runs side by side, across models or dates (``/compare?jobs=12,15``): parameters with the
differences highlighted, metrics with the paired difference of scores on the same tokens, per-layer views, and
the outlier drift between two calibrations of one architecture (a base and its fine-tune)."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd
import streamlit as st

from app.charts import compare as charts
from quantplan.services import compare as compare_svc
from quantplan.services import plans as plans_svc
from quantplan.services.errors import Refused

HIGHLIGHT = "background-color: rgba(255, 193, 7, 0.25)"  # a row whose runs differ

st.title("Compare")
st.caption("Pick two or more runs (jobs) of any kind, models or dates: their parameters side by side, the rows that "
           "differ highlighted; their figures, with the difference of each score from the baseline (paired "
           "sequence by sequence where both read the same evaluation tokens); per-layer schemes, sensitivities and "
           "outlier ratios; and, for two calibrations, how the outliers drifted and what a plan's calibration on "
           "one does on the other.")

try:
    asked = compare_svc.parse_job_ids(st.query_params.get("jobs", ""))
except Refused as exc:
    st.warning(str(exc))
    asked = []
choices = compare_svc.run_choices(include=asked)
missing = [j for j in asked if j not in choices]
if missing:
    st.warning(f"No job {', '.join(f'#{j}' for j in missing)}: the link names runs this database does not hold.")
chosen = st.multiselect("Runs to compare (two or more)", list(choices), default=[j for j in asked if j in choices],
                        format_func=lambda j: choices.get(j, f"#{j}"), max_selections=compare_svc.MAX_RUNS,
                        key="compare_jobs")
if chosen != asked:  # the address names the runs: a comparison can be shared as a link
    st.query_params["jobs"] = ",".join(map(str, chosen))
if len(chosen) < 2:
    st.info("Pick two or more runs above (or open /compare?jobs=ID,ID), e.g. two scores of one model, a sweep before "
            "and after a change, or the calibrations of a base model and its fine-tune.")
    st.stop()

c1, c2 = st.columns([2, 3])
baseline = c1.selectbox("Baseline (the others are measured against it)", chosen, format_func=choices.get,
                        key="compare_baseline")
try:
    comparison = compare_svc.compare_runs(chosen, baseline=baseline)
except Refused as exc:
    st.error(str(exc))
    st.stop()

calibrations = [r for r in comparison.runs if r.stats]
plan_id = None
if len(calibrations) >= 2:  # the plan whose smoothing and static scales the drift check reads
    base_cal = next((r for r in calibrations if r.key == comparison.baseline), calibrations[0])
    plans = plans_svc.list_plans(base_cal.job.model_id) if base_cal.job.model_id is not None else []
    plan_options: dict[Any, str] = {None: compare_svc.WHAT_IF} | {p.id: f"plan {p.label}" for p in plans}
    plan_id = c2.selectbox(f"Plan checked for drift (a plan of {base_cal.model_name})", list(plan_options),
                           format_func=plan_options.get, key="compare_drift_plan")
    if plan_id is not None:
        comparison = compare_svc.compare_runs(chosen, baseline=baseline, plan_id=plan_id)

runs = comparison.runs
label = {r.key: r.label for r in runs}
labels = [r.label for r in runs]
st.markdown("  \n".join(f"**{r.label}** — {r.job.status}" + (" *(baseline)*" if r.key == comparison.baseline
                                                                 else "") for r in runs))


def text(v: Any) -> str:
    """A cell as a table shows it: numbers to 4 significant digits, lists and None as text."""
    if v is None:
        return "—"
    if isinstance(v, float):
        return "inf" if math.isinf(v) else format(v, ".4g")
    return str(v)


def side_by_side(rows: list[dict[str, Any]], first: str, only_differing: bool = False) -> None:
    """A table with one column per run (named by its key), the rows whose runs differ highlighted."""
    shown = [r for r in rows if r.get("differs") or not only_differing]
    if not shown:
        st.caption("Every row is the same for these runs.")
        return
    keys = [k for k in comparison.keys if k in shown[0]]
    frame = pd.DataFrame([{first: r[first], **{k: text(r.get(k)) for k in keys}} for r in shown])
    differs = [bool(r.get("differs")) for r in shown]
    styled = frame.style.apply(lambda row: [HIGHLIGHT if differs[row.name] else ""] * len(row), axis=1)
    st.dataframe(styled, hide_index=True, width="stretch",
                 column_config={k: st.column_config.TextColumn(k, help=label[k]) for k in keys})


def notes(part: str) -> None:
    for note in comparison.notes.get(part, []):
        st.caption(note)


notes("runs")
tabs = st.tabs(["Parameters", "Metrics", "Differences", "Per layer", "Outlier drift"])

with tabs[0]:
    only = st.toggle("Only the rows that differ", value=True, key="compare_only_differing")
    side_by_side(comparison.parameters, "parameter", only_differing=only)

with tabs[1]:
    side_by_side(comparison.metrics, "metric")
    scored = [r for r in runs if r.score is not None]
    if scored:
        figure = st.radio("Chart", ["kl_mean", "top1_agree", "ln_ppl_ratio", "ppl"], horizontal=True,
                          key="compare_metric")
        errs = {"kl_mean": "kl_mean_err", "top1_agree": "top1_agree_err", "ln_ppl_ratio": "ln_ppl_ratio_err"}
        rows = [{"run": r.label, "value": r.score.figure(figure),
                 "err": r.score.figure(errs[figure]) if figure in errs else None} for r in scored if r.score]
        frame = pd.DataFrame([x for x in rows if x["value"] is not None], columns=["run", "value", "err"])
        if frame.empty:
            st.caption(f"No score here kept {figure} (scored before it was).")
        else:
            frame["err"] = pd.to_numeric(frame["err"], errors="coerce")
            st.altair_chart(charts.metric_chart(frame, [x for x in labels if x in set(frame["run"])], figure),
                            width="stretch")

with tabs[2]:
    notes("differences")
    if comparison.differences:
        diffs = pd.DataFrame(comparison.differences)
        figure = st.radio("Figure", list(dict.fromkeys(diffs["figure"])), horizontal=True, key="compare_figure")
        part = diffs[(diffs["figure"] == figure) & diffs["difference"].notna()]
        if not part.empty:
            chart = pd.DataFrame({"run": [label[k] for k in part["a"]], "difference": part["difference"],
                                  "err": pd.to_numeric(part["err"], errors="coerce"),
                                  "err_unpaired": pd.to_numeric(part["err_unpaired"], errors="coerce")})
            st.altair_chart(charts.difference_chart(chart), width="stretch")
            st.caption(f"Against {comparison.baseline}. Solid: the error as measured (paired where the row says "
                       "so); faint: what the error of the same difference would be from the two scores' own errors.")
        st.dataframe(diffs[diffs["figure"] == figure][["a", "b", "difference", "err", "err_unpaired", "paired",
                                                       "verdict", "why"]],
                     hide_index=True, width="stretch",
                     column_config={"a": "run", "b": "baseline", "err": st.column_config.NumberColumn(
                         "± error", format="%.3g"), "err_unpaired": st.column_config.NumberColumn(
                         "± unpaired", format="%.3g"), "difference": st.column_config.NumberColumn(format="%.4g")})

with tabs[3]:
    notes("schemes")
    if comparison.schemes:
        st.subheader("Schemes of the scored plans")
        side_by_side(comparison.schemes, "layer",
                     only_differing=st.toggle("Only the layers that differ", value=False, key="compare_layers"))
    notes("sensitivity")
    if comparison.sensitivity:
        st.subheader("Sensitivity: KL of each unit quantized alone")
        long = pd.DataFrame([{"layer": r["unit"], "run": label[k], "value": r.get(k)}
                             for r in comparison.sensitivity for k in comparison.keys if k in r])
        st.altair_chart(charts.per_layer_chart(long, [label[k] for k in comparison.keys if k in
                                                      comparison.sensitivity[0]], "KL (log)"), width="stretch")
        for rc in comparison.rank_correlation:
            st.caption(f"Rank correlation (Spearman) of {rc['a']} with {rc['b']} over {rc['units']} units: "
                       f"{text(rc['spearman'])}")
        side_by_side(comparison.sensitivity, "unit")
    if comparison.outliers:
        st.subheader("Outlier ratio of each layer's input (max / median channel)")
        long = pd.DataFrame([{"layer": r["layer"], "run": label[k], "value": r.get(k)}
                             for r in comparison.outliers for k in comparison.keys if k in r])
        st.altair_chart(charts.per_layer_chart(long, [label[k] for k in comparison.keys if k in
                                                      comparison.outliers[0]], "outlier ratio (log)"),
                        width="stretch")

with tabs[4]:
    notes("drift")
    for rep in comparison.drift:
        st.subheader(f"{rep.a} → {rep.b}")
        (st.warning if "recalibrate" in rep.summary else st.success)(rep.summary)
        layers = pd.DataFrame(rep.layers)
        st.altair_chart(charts.drift_chart(layers, label[rep.a], label[rep.b]), width="stretch")
        for col in ("outliers_a", "outliers_b", "appeared", "gone"):
            layers[col] = layers[col].map(lambda v: ", ".join(map(str, v)))
        for col in ("grew", "shrank"):
            layers[col] = layers[col].map(lambda v: ", ".join(f"{c} ({a:.3g} → {b:.3g})" for c, a, b in v))
        st.dataframe(layers, hide_index=True, width="stretch",
                     column_config={"ratio_a": st.column_config.NumberColumn(f"ratio {rep.a}", format="%.4g"),
                                    "ratio_b": st.column_config.NumberColumn(f"ratio {rep.b}", format="%.4g"),
                                    "amax_a": st.column_config.NumberColumn(f"amax {rep.a}", format="%.4g"),
                                    "amax_b": st.column_config.NumberColumn(f"amax {rep.b}", format="%.4g")})
        st.markdown(f"**Calibrated on {rep.a}, served on {rep.b}** ({rep.plan}): a static scale *clips* where "
                    f"{rep.b}'s input exceeds the amax set on {rep.a}; stale factors or a scale its traffic never "
                    "reaches *waste range* (bits of the format's levels unused).")
        if rep.transfer:
            transfer = pd.DataFrame(rep.transfer)
            for col in ("under_smoothed", "clipped_channels"):
                transfer[col] = transfer[col].map(lambda v: ", ".join(map(str, v)))
            st.dataframe(transfer, hide_index=True, width="stretch",
                         column_config={"clipped_share": st.column_config.NumberColumn("clipped share",
                                                                                       format="percent"),
                                        "wasted_bits": st.column_config.NumberColumn("wasted bits", format="%.2f"),
                                        "act_range": st.column_config.NumberColumn(format="%.3g"),
                                        "weight_range": st.column_config.NumberColumn(format="%.3g")})
        else:
            st.caption("The plan smooths no layer and sets no static scale: nothing calibrated to carry over.")
        if rep.only_a or rep.only_b:
            st.caption(f"Layers of one calibration only: {len(rep.only_a)} of {rep.a}, {len(rep.only_b)} of "
                       f"{rep.b} (not compared).")
