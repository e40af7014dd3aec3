"""Kernels: the real FP8 / INT8 GEMMs timed on the model's own shapes, per device, and what a plan's
prefill and decode steps would cost."""

from __future__ import annotations

import numpy as np
import pandas as pd
import streamlit as st

from app import auth, forms, frames, live, state
from app import text as page_text
from app.charts import kernels as kernel_charts
from jobs.specs import BUDGET_S, TENSOR_PARALLEL, BenchSpec
from quantcore.kernels.device import describe_probe
from quantcore.kernels.paths import PATHS as KERNEL_PATHS
from quantcore.kernels.records import UNSTABLE_SPREAD, duration_bound, parse_ms
from quantcore.schemes.presets import list_schemes
from quantplan.services import kernels as kernels_svc
from quantplan.services import models as models_svc
from quantplan.services import plans as plans_svc
from quantplan.services import queue as queue_svc
from quantplan.services import serving as serving_svc

KEPT_PLAN = "kernels_plan_kept"  # {model id: the step estimate's plan option picked}

st.title("Kernels")
CASES_OPEN = "kernels_cases_open"  # the "Every case" table, built only once its expander is opened
st.caption("Measured, not assumed: each low-precision path is timed against the baseline GEMM (bf16 on GPU, "
           "fp32 on CPU) for every (N, K) of the model's linear layers; '+q' includes quantizing the "
           "activation on the fly, in eager unfused PyTorch (a serving engine's fused kernel pays less, so the "
           "truth lies between a path and its '+q'). w8_row, w4_g128, w4_g64, w4_g32 and w4_ch are the weight-only "
           "kernels (W8A16, W4A16, W4A16_G64, W4A16_G32, W4A16_CHANNEL): activations stay 16-bit, INT8 / INT4 weights "
           "are dequantized inside the kernel, which saves weight "
           "traffic (a decode step's bound), not FLOPs. A path the device does not accelerate is marked so, never "
           "shown as a speed-up.")
model = state.current_model()
if model is None:
    st.stop()

if auth.may("queue"):
    with st.form("bench_form", enter_to_submit=False):  # Enter in a field queues no job
        st.markdown(f"**Queue a benchmark** of {model.name}'s {len(model.linears)} linear layers "
                    f"({kernels_svc.bench_shape_count(model)} distinct shapes).")
        c1, c2, c3, c4, c5 = st.columns([2, 3, 2, 3, 2])
        # the values last queued, kept for this session: Streamlit forgets a form's widgets while another page is drawn
        last = forms.last("bench", model.id)  # per model (app.forms)
        device = c1.selectbox("Device", ["cpu", "cuda"], index=["cpu", "cuda"].index(last.get("device", "cpu")),
                              key="bench_device")
        ms = c2.text_input("M values (batch × tokens)", last.get("ms", ",".join(map(str, BenchSpec.DEFAULT_MS))),
                           key="bench_m")
        budget = c3.number_input("Budget per shape (s)", *BUDGET_S.form_bounds(),  # the bench spec's own bounds
                                 float(last.get("budget", BenchSpec.budget_s)), step=1.0, format="%g",
                                 key="bench_budget",
                                 help="Wall-clock seconds for all M values and paths of one (N, K) shape, on any "
                                      "device (a run takes at most shapes × budget): "
                                      "a case predicted not to fit in what is left is skipped and reported \"over "
                                      "budget\", and measured when asked again with a larger budget.")
        queue = c4.text_input("Queue (optional, e.g. gpu.sm90)", last.get("queue", ""), key="bench_queue")
        bench_tp = int(c5.number_input("GPUs (tensor parallel)", *TENSOR_PARALLEL.form_bounds(), last.get("tp", 1),
                                       key="bench_tp",
                                       help="Time each GPU's share of every layer, as vLLM splits it over this many "
                                            "GPUs: the shapes a plan for that many GPUs runs (Plans page)."))
        timed_paths = [p for p in KERNEL_PATHS if p != "baseline"]
        paths = st.multiselect("Paths", timed_paths, default=last.get("paths", timed_paths), key="bench_paths",
                               help="The kernel paths to time; the baseline always is (speed-ups need it). A CPU only "
                                    "emulates FP8: leaving those four out gives their budget to INT8 and the "
                                    "weight-only kernels.")
        if models_svc.routed_layers(model):
            st.caption("A routed expert runs on a share of each step's tokens: the benchmark also times every shape at "
                       "the M one touched expert gets at each of your M values, and the step estimate below counts "
                       "each expert at that M, times the chance a step touches it (tokens routed evenly).")
        try:  # what it will cost, at the values shown: cases to time, and their time measured on past benchmarks
            shapes = kernels_svc.bench_shape_count(model, bench_tp)
            st.caption("Cost: " + forms.cost_note("bench", device, model, shapes * len(parse_ms(ms)) * (len(paths) + 1),
                                                  "GEMM cases", forms.cases_of, scale_by_size=False,
                                                  at_most_s=shapes * float(budget)) + " At the values shown.")
        except ValueError:  # M values it cannot read: the button below names them
            pass
        if st.form_submit_button("Queue benchmark", type="primary"):
            try:
                m_values = parse_ms(ms)
                if not paths:
                    raise ValueError("choose at least one kernel path to time against the baseline")
                params = {"device": device, "m": m_values, "budget_s": float(budget),
                          **({"tensor_parallel": bench_tp} if bench_tp > 1 else {}),
                          **({"paths": [p for p in timed_paths if p in paths]}
                             if set(paths) != set(timed_paths) else {})}
                if queue.strip():
                    params["queue"] = queue.strip()
                job = queue_svc.submit("bench", params, model_id=model.id)
                bound = duration_bound(kernels_svc.bench_shape_count(model, bench_tp), float(budget))
                st.success(f"Queued benchmark job #{job.id} on queue '{job.queue}': {bound} of timing, less where "
                           "shapes finish early or were timed on that device before.")
                forms.remember("bench", model.id, {"device": device, "ms": ms, "budget": float(budget), "queue": queue,
                                                   "tp": bench_tp, "paths": [p for p in timed_paths if p in paths]})
            except ValueError as exc:
                st.error(str(exc))
else:
    st.caption(auth.cannot("queue"))

live.job_progress("kernels", ["bench"], model_id=model.id, done_notes={"bench": "Its timings are below."})

devices = kernels_svc.kernel_devices()
if not devices:
    st.info("No kernel timings stored yet. Queue a benchmark above.")
    st.stop()
labels = {d[1]: f"{d[1]} ({d[0]}, torch {d[2]})" for d in devices}
device_name = st.selectbox("Device measured", list(labels), format_func=labels.get, key="kernels_device")
probe = kernels_svc.device_probe(device_name)
if probe is None:
    st.caption(f"No stored benchmark job says what {device_name} is (its timings came without the probe).")
else:
    st.caption(describe_probe(probe["device"]))
    with st.expander(f"What runs natively on {device_name}"):
        if probe["paths"]:
            st.dataframe(frames.capability_frame(probe["paths"]), hide_index=True, width="stretch")
            st.caption(f"As benchmark job #{probe['job_id']} probed it: each path's tiny kernel was run on the device; "
                       "\"native\" follows the device's low-precision units (FP8 from sm89, INT8 from sm75, FP4 from "
                       "sm100; on a CPU, INT8 dot-product instructions).")
        else:
            st.caption(f"Benchmark job #{probe['job_id']} predates quantplan storing the capability table: queue a "
                       f"benchmark on {device_name} to see it.")
frame = kernels_svc.kernel_frame(device_name)
labels = kernels_svc.shape_labels(model)  # the model's shapes, and each GPU's share of them split over a node's GPUs
frame = frame[[(n, k) in labels for n, k in zip(frame["n"], frame["k"], strict=True)]] if len(frame) else frame
if frame.empty:
    st.info(f"No timings of {model.name}'s shapes on {device_name} yet.")
    st.stop()

frame = frame.assign(shape=[f"{labels.get((n, k), f'? {n}×{k}')} M={m}" for n, k, m in
                            zip(frame["n"], frame["k"], frame["m"], strict=True)])
native_any = bool(frame.loc[frame["path"] != "baseline", "native"].any())
emulated = sorted(set(frame.loc[(frame["path"] != "baseline") & ~frame["native"], "path"]))  # the step reads it too
if not native_any:
    st.warning(f"{device_name} runs none of the low-precision paths natively: their times are shown in the "
               "table for completeness, and the heatmap marks them n/a.")
elif emulated:
    st.caption(f"Not native on {device_name}: {', '.join(emulated)}. Their cells read n/a; their times are "
               "in the table below.")
stale = frames.timed_otherwise(frame)
if stale:
    st.warning(f"{stale} of these {len(frame)} timings were taken before quantplan flushed a CPU's caches between "
               "timed calls: a small weight then read from the cache, faster than a served step reads it. Queue a "
               f"benchmark on {device_name}: it measures them again and keeps these in the history.")
# rows stored before quantplan kept the spread have None there: shown "—", never flagged
shaky = frame["unstable"].map(lambda u: u is True or (isinstance(u, np.bool_) and bool(u)))
heat = kernel_charts.case_tooltips(frame[frame["path"] != "baseline"].copy())
heat["speedup"] = np.where(heat["native"] & heat["ms"].notna(), heat["speedup"], np.nan)
heat["note"] = frames.no_time_notes(heat["ms"], heat["skipped"])  # "skipped" / "failed" where not merely n/a
heat["unstable"] = shaky[heat.index]
st.subheader("Speed-up over the baseline GEMM")
st.caption("Each path's calls alternate with the baseline's at the same shape (baseline, path, baseline, ...): a "
           "speed-up is the ratio of the two medians. Hover a cell for both times, their 20th-80th percentiles and "
           "the repeats.")
# the heading says what the chart is
cells = heat[["shape", "path", "speedup", "note", "unstable", "time", "baseline", "status"]]
state.chart(("kernel_heatmap", *state.frame_key(cells)), lambda: kernel_charts.kernel_heatmap(cells, title=""),
            width="stretch")
if n_shaky := int(shaky.sum()):
    names = ", ".join([f"{r.path} M={r.m} N={r.n} K={r.k}" for r in frame[shaky].itertuples()][:4])
    st.warning(f"{n_shaky} case(s) UNSTABLE ({names}{', …' if n_shaky > 4 else ''}): the 20th-80th percentile "
               f"band of their timed calls is wider than {100 * UNSTABLE_SPREAD:.0f}% of the median, so the load "
               "on the device moved while they ran. They are outlined in the heatmap, their speed-up marked "
               f"'{kernel_charts.UNSTABLE_MARK.strip()}'; the step estimate below leaves them out, and the next "
               "benchmark on this device measures them again.")
if over := int((heat["note"] == "skipped").sum()):
    over_emulated = sorted(set(heat.loc[heat["note"] == "skipped", "path"]).intersection(emulated))
    st.caption(f"{over} case(s) read \"skipped\": they did not fit in the time budget per shape; queue the "
               "benchmark again with a larger budget to time them"
               + (f", or without {', '.join(over_emulated)} (Paths), which {device_name} only emulates and times last"
                  if over_emulated else "") + ".")
if failed := int((heat["note"] == "failed").sum()):
    st.caption(f"{failed} case(s) read \"failed\": the kernel refused the shape or this torch build (the table "
               "below says how).")

peak = frame[frame["pct_peak"].notna()]
if not peak.empty:
    st.subheader("Percent of the device's peak")
    bars = peak.assign(label=peak["shape"] + " · " + peak["path"])[["label", "pct_peak", "path"]]
    state.chart(("peak_bars", *state.frame_key(bars)), lambda: kernel_charts.peak_bars(bars, title=""),
                width="stretch")
else:
    st.caption("No peak figure is known for this device (CPU or an unlisted GPU): only measured times.")


def cases_table() -> None:
    """The "Every case" table (the benchmark's every row)."""
    cases = frame.assign(  # empty, not None, where there is nothing to say; "—" where a spread was not kept
        padded_m=[f"{int(p)}" if pd.notna(p) else "" for p in frame["padded_m"]], skipped=frame["skipped"].fillna(""),
        **kernel_charts.spread_columns(frame))
    columns = ["shape", "m", "n", "k", "path", "ms", "spread", "repeats", "baseline", "stability", "tflops",
               "pct_peak", "speedup", "native", "max_rel_err", "padded_m", "skipped"]
    if peak.empty:  # no peak known: said above
        columns.remove("pct_peak")
    st.dataframe(cases[columns].sort_values(["n", "k", "m", "path"]),
                 hide_index=True, width="stretch",
                 column_config={
                     "ms": st.column_config.NumberColumn("ms", format="%.4f", help="median time of one call"),
                     "spread": st.column_config.TextColumn("p20-p80 ms", help="20th and 80th percentiles of the timed "
                                                                              "calls (as triton's do_bench reports); "
                                                                              "— : stored before quantplan kept them"),
                     "repeats": st.column_config.TextColumn("repeats", help="timed calls the median is of"),
                     "baseline": st.column_config.TextColumn(
                         "baseline ms (p20-p80)", help="the baseline, timed interleaved with this path: what the "
                                                       "speed-up is over"),
                     "stability": st.column_config.TextColumn(
                         "stable?", help=f"UNSTABLE: the p20-p80 band of this path or of its baseline is wider than "
                                         f"{100 * UNSTABLE_SPREAD:.0f}% of the median; left out of step estimates"),
                     "tflops": st.column_config.NumberColumn("TFLOP/s", format="%.4g",
                                                             help="2·M·N·K / time (TOPS for INT8)"),
                     "pct_peak": st.column_config.NumberColumn("% of peak", format="%.1f",
                                                               help="of the device's dense peak for the path's dtype; "
                                                                    "None where the peak is not known"),
                     "speedup": st.column_config.NumberColumn("speed-up", format="×%.2f",
                                                              help="baseline median / this median, timed interleaved"),
                     "max_rel_err": st.column_config.NumberColumn(
                         "max rel. error", format="%.2e", help="kernel output against quantcore's emulation of the "
                                                               "same quantized operands"),
                     "padded_m": st.column_config.TextColumn("padded M", help="the M the kernel ran at, where it "
                                                                              "needs padding; empty: none"),
                     "skipped": st.column_config.TextColumn("why no time", help="empty where timed"),
                 })


st.subheader("Every case")
cases_box = st.expander("Each path's time, spread, speed-up and error at each shape", key=CASES_OPEN,
                        on_change="rerun")
with cases_box:
    if cases_box.open:  # the table is built and drawn only once opened: a visit draws the charts above first
        cases_table()


available_m = sorted(set(int(m) for m in frame["m"]))  # this device's timings of the model's shapes
if len({d[1] for d in devices}) >= 2:
    st.subheader("Compare devices")
    st.caption("One kernel path at one M on every device that measured this model's shapes: where FP8 or "
               "INT8 pays off depends on the GPU as much as on the shape.")
    c1, c2 = st.columns(2)
    cmp_path = c1.selectbox("Path", [p for p in KERNEL_PATHS if p != "baseline"],
                            index=[p for p in KERNEL_PATHS if p != "baseline"].index("fp8_row+q"), key="cmp_path")
    cmp_m = c2.selectbox("M (batch × tokens)", available_m, index=len(available_m) - 1, key="cmp_m")
    cmp = kernels_svc.device_comparison(model, cmp_path, cmp_m)
    if cmp.empty:
        st.info(f"Fewer than two devices have {cmp_path} timings of this model's shapes at M={cmp_m}.")
    else:
        state.chart(("device_heatmap", cmp_path, cmp_m, *state.frame_key(cmp)),
                    lambda: kernel_charts.kernel_heatmap(cmp, column="device", column_title="device",
                                                         title=f"Speed-up of {cmp_path} at M={cmp_m}"),
                    width="content")

@st.fragment
def step_section() -> None:  # its plan and M pickers rerun this section alone
    st.subheader("A plan's prefill and decode step")
    plans = plans_svc.list_plans(model.id)
    options = [f"preset:{s}" for s in list_schemes()] + [f"plan:{p.id}" for p in plans]
    plan_labels = {f"preset:{s}": f"{s} on every layer" for s in list_schemes()} | {
        f"plan:{p.id}": f"plan {p.label}" for p in plans}
    newest = plans_svc.newest_plan(plans)  # else a preset
    # Streamlit forgets a widget's value while another model's page is drawn: each model's pick is kept here too
    kept = st.session_state.setdefault(KEPT_PLAN, {})
    default = kept.get(model.id) if kept.get(model.id) in options else (
        f"plan:{newest.id}" if newest else "preset:FP8_DYNAMIC")
    choice = st.selectbox("Plan", options, index=options.index(default),
                          format_func=plan_labels.get,
                          key=f"kernels_plan_{model.id}")  # per model: its plans are its own
    kept[model.id] = choice
    c1, c2 = st.columns(2)
    m_prefill = c1.selectbox("Prefill M (batch × prompt tokens)", available_m, index=len(available_m) - 1,
                             key="kernels_m_prefill")
    m_decode = c2.selectbox("Decode M (batch)", available_m, index=0, key="kernels_m_decode")
    body = ({"default": choice.split(":", 1)[1]} if choice.startswith("preset:")
            else next(p.body for p in plans if f"plan:{p.id}" == choice))
    est = kernels_svc.step_estimate(model, body, device_name, m_prefill=m_prefill, m_decode=m_decode)
    n_layers = len(est["per_layer"])
    cols = st.columns(2)
    for col, step, m in ((cols[0], "prefill", m_prefill), (cols[1], "decode", m_decode)):
        missing = est[f"missing_{step}"]
        speedup = est[f"speedup_{step}"]
        # with layers missing, the speed-up is over the layers measured both ways: so is the baseline shown beside it
        base_ms = est[f"common_baseline_{step}_ms"] if missing else est[f"baseline_{step}_ms"]
        if len(missing) == n_layers:  # nothing to add up: no number, rather than 0.000 ms
            col.metric(f"{step.capitalize()} (M={m})", "not measured", "no layer has a time for its path at this M",
                       delta_color="off", delta_arrow="off")
            continue
        if missing:  # a partial sum is no step time: its coverage comes first, and it is never the headline figure
            shaky_layers = est.get(f"unstable_{step}", [])
            col.markdown(f"**{step.capitalize()} (M={m}) covers {n_layers - len(missing)} of {n_layers} layers: "
                         "partial**")
            col.caption(f"{est[f'{step}_ms']:.3f} ms over those layers alone"
                        + (f"; ×{speedup:.2f} vs baseline {base_ms:.3f} ms on the same layers" if speedup else
                           "; no baseline on them")
                        + (f"; {len(shaky_layers)} left out as unstable" if shaky_layers else "")
                        + ". Not the plan's step: benchmark the missing layers' paths (named below).")
            continue
        col.metric(f"{step.capitalize()} (M={m})", f"{est[f'{step}_ms']:.3f} ms",
                   f"×{speedup:.2f} vs baseline {base_ms:.3f} ms" if speedup else "no baseline",
                   delta_color="normal" if speedup and speedup >= 1 else "inverse", delta_arrow="off")
    if thin := page_text.thin_estimate_note(est):
        st.warning(thin)
    target = kernels_svc.target_of_device(device_name)
    if target:  # a GPU of the table: how far the measured eager kernels are from the roofline bound
        ideal = {step: serving_svc.step_bound(model, body, target, m).ms for step, m in (("prefill", m_prefill),
                                                                                 ("decode", m_decode))}
        st.caption("Ideal (roofline) step on this GPU's datasheet: " + "; ".join(
            f"{step} {ideal[step]:.4f} ms" + (f", the measured sum is {est[f'{step}_ms'] / ideal[step]:.1f}× that"
                                              if not est[f"missing_{step}"] else "")
            for step in ("prefill", "decode")) + ". Eager PyTorch kernels with unfused quantization pay the gap; "
            "the bound is what fused serving kernels approach.")
    if used := sorted({e["path"] for e in est["per_layer"].values()}.intersection(emulated)):
        st.warning(f"This plan's {', '.join(used)} path(s) are not native on {device_name}: the times above are of "
                   "their emulation, not of hardware that runs them (the heatmap marks them n/a).")
    untimed = est["untimed"]
    if untimed:
        st.caption(f"{sum(untimed.values())} layer(s) of this plan ("
                   + ", ".join(f"{name}: {n}" for name, n in sorted(untimed.items()))
                   + ") are in formats no kernel quantplan times serves (FP4, MX and block scales among them): the "
                   "sums above count them at the baseline's time, not at their own.")
    missing = sorted(set(est["missing_prefill"]) | set(est["missing_decode"]))
    plan_tp = int(body.get("tensor_parallel") or 1)
    if missing:
        st.caption(page_text.missing_times_note(est, plan_tp))
    if plan_tp > 1:
        st.caption(f"The plan is for {plan_tp} GPUs: the step above is one GPU's, its share of every layer, the "
                   "all-reduces between GPUs not counted.")
    st.dataframe(frames.step_breakdown(est), hide_index=True, width="stretch",
                 column_config={
                     "prefill_ms": st.column_config.NumberColumn(f"prefill ms (M={m_prefill})", format="%.4f"),
                     "decode_ms": st.column_config.NumberColumn(f"decode ms (M={m_decode})", format="%.4f")})


step_section()
