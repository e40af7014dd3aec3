"""Outliers: which layers and channels carry activation magnitudes far above the median, and what each
number format does to them, from the stored calibration statistics alone."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from app import auth, rotation_panel, state
from app.charts import base as chart_base
from app.charts import outliers as outlier_charts
from app.charts.base import vega_spec
from quantcore.evaluation import alpha as alpha_est
from quantcore.evaluation import outliers as ol
from quantcore.evaluation.kvcache import kv_head_spread
from quantcore.formats.catalog import list_formats
from quantcore.schemes.fusion import fusion_group_of
from quantplan.services import calibration as calibration_svc
from quantplan.services import plans as plans_svc
from quantplan.services.models import layer_names
from store.records import PlanRecord

st.title("Outliers")
model = state.current_model()
if model is None:
    st.stop()

cals = calibration_svc.calibrations(model.id)
if not cals:
    st.info(f"{model.name} has no calibration yet. Queue one on the Models page; it takes a minute on CPU "
            "for the demo model.")
    st.stop()


@st.cache_resource(show_spinner="Loading statistics…", max_entries=8)
def stats_of(job_id: int) -> list:
    """A calibration's statistics, shared by every session without a copy: a finished job's results never change,
    and a new calibration is a new job id (the cache's key)."""
    return calibration_svc.layer_stats(job_id)


@st.cache_resource(show_spinner=False, max_entries=8)
def layers_of(job_id: int) -> tuple[dict, list, dict, dict]:
    """(every layer by name, the layers shown (MoE blocks' shared expert inputs once), those shared, shown by name)."""
    every = {s_.name: s_ for s_ in stats_of(job_id)}  # MoE experts included (fusion groups)
    shown, shared_inputs = ol.shared_expert_inputs(every)
    return every, shown, shared_inputs, {s_.name: s_ for s_ in shown}


@st.cache_data(show_spinner=False, max_entries=8)
def overview_of(job_id: int) -> pd.DataFrame:
    return outlier_charts.overview_frame(layers_of(job_id)[1])


# Each chart's Vega-Lite spec, built once per stored result and choice (Altair's build and validation are most of a
# chart's cost) and drawn by st.vega_lite_chart. Keyed on the calibration's job id: a new calibration is a new key.
@st.cache_data(show_spinner=False, max_entries=8)
def overview_spec(job_id: int) -> dict:
    return vega_spec(outlier_charts.overview_chart(overview_of(job_id)))


@st.cache_data(show_spinner=False, max_entries=32)
def channels_spec(job_id: int, layer: str) -> dict:
    stat_ = layers_of(job_id)[3][layer]
    return vega_spec(outlier_charts.channels_chart(outlier_charts.channels_frame(stat_),
                                                   outlier_charts.thresholds_frame(stat_.amax)))


@st.cache_data(show_spinner=False, max_entries=32)
def depth_spec(job_id: int, proj: str) -> dict:
    return vega_spec(outlier_charts.depth_heatmap(outlier_charts.depth_frame(layers_of(job_id)[1], proj), proj))


@st.cache_data(show_spinner=False, max_entries=32)
def smoothquant_template(job_id: int, layer: str) -> dict:
    """The SmoothQuant panels' spec of a layer without its data, the same for every α (one y axis for all): an α
    step changes the chart's datasets only, which the browser redraws in place instead of embedding the chart anew."""
    stat_ = layers_of(job_id)[3][layer]
    points, steps = outlier_charts.smoothquant_frame(
        ol.smoothquant_view(stat_.channel_max, stat_.weight_channel_max, 0.5), chart_base.SMOOTH_POINTS)
    domain = outlier_charts.smoothquant_domain(stat_.channel_max, stat_.weight_channel_max)
    return vega_spec(outlier_charts.smoothquant_chart(points, steps, 0.5, domain=domain, named=True))


@st.cache_data(show_spinner=False, max_entries=64)
def smoothquant_spec(job_id: int, layer: str, alpha: float) -> dict:
    stat_ = layers_of(job_id)[3][layer]
    points, steps = outlier_charts.smoothquant_frame(
        ol.smoothquant_view(stat_.channel_max, stat_.weight_channel_max, alpha), chart_base.SMOOTH_POINTS)
    return {**smoothquant_template(job_id, layer), "datasets": outlier_charts.smoothquant_datasets(points, steps)}


@st.cache_data(show_spinner=False, max_entries=64)
def alpha_sweep_of(job_id: int, group: tuple[str, ...], planned: alpha_est.PlannedScheme) -> dict:
    """The α sweep of a layer's fusion group under the planned scheme (a slider move reruns its section: kept)."""
    members = layers_of(job_id)[0]
    return alpha_est.alpha_error_sweep([members[m] for m in group], planned)


@st.cache_data(show_spinner=False, max_entries=64)
def alpha_choice_spec(job_id: int, group: tuple[str, ...], planned: alpha_est.PlannedScheme) -> dict:
    """The "Choosing α" chart of a fusion group under a scheme, its chosen α at the suggested one (a copy each call:
    the slider's α is set into it with outlier_charts.with_chosen_alpha)."""
    sweep_ = alpha_sweep_of(job_id, group, planned)
    suggested_ = alpha_est.suggested_alpha(sweep_)
    return vega_spec(outlier_charts.alpha_choice_chart(pd.DataFrame(sweep_), suggested_, suggested_, planned.name))


@st.cache_data(show_spinner=False, max_entries=32)
def histogram_spec(job_id: int, layer: str, fmt: str, gran: str) -> dict | None:
    stat_ = layers_of(job_id)[3][layer]
    hist_ = outlier_charts.hist_frame(stat_)
    if hist_.empty:
        return None
    grid_ = ol.format_grid(fmt, ol.representative_amax(stat_, gran), gran)
    grid_points = outlier_charts.grid_frame(grid_, hist_["lo"].min(), hist_["hi"].max())
    return vega_spec(outlier_charts.histogram_chart(hist_, grid_points, f"{fmt} ({gran})"))


@st.cache_data(show_spinner=False, max_entries=8)
def kv_of(job_id: int, _kv_amax: dict | None) -> tuple[pd.DataFrame, dict | None]:
    """The calibration's K / V / Q maxima as a frame, and their chart's spec (None without any)."""
    frame = outlier_charts.kv_amax_frame(_kv_amax)
    return frame, (None if frame.empty else vega_spec(outlier_charts.kv_amax_chart(frame)))


@st.cache_data(show_spinner=False, max_entries=16)
def breakage_of(job_id: int, formats: tuple[str, ...], gran: str) -> pd.DataFrame:
    return outlier_charts.breakage_frame(layers_of(job_id)[1], list(formats), gran)


def _count(n) -> str:
    """'1,024' as the page's other counts read, '?' where the job did not say."""
    return f"{n:,}" if isinstance(n, int) else "?"


cal_id = st.selectbox(
    "Calibration", [c.id for c in cals],
    format_func=lambda i: next(f"job #{c.id} · {_count(c.result.get('tokens'))} tokens of "
                               f"{c.result.get('text', '?')} · {c.finished_at:%Y-%m-%d %H:%M}"
                               for c in cals if c.id == i),
    key="outliers_cal",
)
all_stats, stats, shared, by_name = layers_of(cal_id)
overview = overview_of(cal_id)

# ----------------------------------------------------------------------------- 1. overview
st.subheader("Outlier ratio of every linear input")
st.caption("max channel max / median channel max of each layer's input, on a log axis; click a point to "
           "drill into that layer.")
if shared:
    first = next(iter(shared))
    st.caption(f"{len(shared)} MoE block(s): the gate_proj and up_proj of all routed experts of a block read the "
               "block's input, which calibration gives every expert, so each block's appears once, as its first "
               f"expert's gate_proj ({first} stands for {shared[first]} expert linears), and the counts below count "
               "it once.")
event = st.vega_lite_chart(overview_spec(cal_id), on_select="rerun", key="overview_chart")
picked = None
try:
    sel = event.selection.get(chart_base.SELECTION_NAME) if event else None
    if sel:
        picked = sel[0].get("layer")
except (AttributeError, IndexError, KeyError, TypeError):
    picked = None
top = overview.sort_values("outlier_ratio", ascending=False)
c1, c2, c3 = st.columns(3)
c1.metric("Largest ratio", f"{top.iloc[0]['outlier_ratio']:,.0f}×", top.iloc[0]["layer"], delta_color="off",
          delta_arrow="off")
c2.metric("Median ratio", f"{overview['outlier_ratio'].median():,.1f}×")
c3.metric("Layers above 100×", int((overview["outlier_ratio"] > 100).sum()))

names = list(top["layer"])
if picked in by_name:
    st.session_state["outliers_layer"] = picked


@st.fragment
def layer_sections() -> None:
    """The Layer box and every section of the layer picked (channels, depth, SmoothQuant, histogram; called below,
    once they are defined): picking another layer reruns this part alone, not the overview and the sections after."""
    layer = st.selectbox("Layer", names, key="outliers_layer")
    stat = by_name[layer]
    # ------------------------------------------------------------------------- 2. channels
    st.subheader(f"Channels of {layer}")
    st.caption(f"per-channel max|x| over {stat.n_tokens:,} tokens; below the red line INT8 per-tensor rounds a "
               "channel's largest value to zero, below the green one even FP8 E4M3 cannot represent it.")
    st.vega_lite_chart(channels_spec(cal_id, layer), width="stretch")
    depth_section(layer)  # 3. depth heatmap
    smoothing_section(layer)  # 3b. rotation, 4. SmoothQuant
    histogram_section(layer)  # 5. histogram + grid


# Each section below with a control of its own is a fragment: its control reruns that section alone. The sections
# below the fold (SmoothQuant, the histogram, the K / V maxima, what will break) are built only once their expander is
# opened (st.expander(..., on_change="rerun") and its .open): a visit sends and draws three charts, not seven.
SMOOTHQUANT_OPEN, HISTOGRAM_OPEN, KV_OPEN, BREAKAGE_OPEN = ("outliers_sq_open", "outliers_hist_open",
                                                            "outliers_kv_open", "outliers_breakage_open")


@st.fragment
def depth_section(layer: str) -> None:
    st.subheader("Across depth")
    projs = sorted(set(overview["proj"]), key=lambda p: (p != ol.parse_layer_name(layer)[1], p))
    proj = st.selectbox("Projection type", projs, key="outliers_proj")
    st.vega_lite_chart(depth_spec(cal_id, proj), width="stretch")


@st.fragment
def smoothing_section(layer: str) -> None:
    """The rotation what-if and SmoothQuant. The α slider reruns the part from the slider down alone (a fragment
    within this one), or this whole section where the rotation what-if above shows a rotated calibration smoothed at
    that α; the plan and scheme chosen rerun this section."""
    # ----------------------------------------------------------------------------- 3b. rotation what-if (issue #46)
    reads_alpha = rotation_panel.render(model, next(c for c in cals if c.id == cal_id), layer, layers_of(cal_id)[3],
                                        float(st.session_state.get("outliers_alpha", 0.5)))  # the slider's, below

    # ----------------------------------------------------------------------------- 4. SmoothQuant
    st.subheader("SmoothQuant")
    st.caption("s_j = max|X_j|^α / max|W_j|^(1−α): activations are divided by s, weights multiplied. The first chart "
               "shows the per-tensor INT8 steps; after smoothing both tensors share the difficulty.")
    box = st.expander("Smooth this layer: the α slider, the panels before and after, the α suggested for a plan",
                      key=SMOOTHQUANT_OPEN, on_change="rerun")
    with box:
        if box.open:  # built, and its three charts sent, only once opened (opening reruns this section alone)
            smoothquant_body(layer, reads_alpha)


def smoothquant_body(layer: str, reads_alpha: bool) -> None:
    """The SmoothQuant section's content: the plan α is saved into, and the slider with what it moves (the whole
    section reruns on a step where ``reads_alpha``: the rotation what-if above draws at the slider's α)."""
    plans = plans_svc.list_plans(model.id)
    latest = {p.name: p for p in plans}  # ordered by version: the last one per name wins
    newest_first = sorted(latest, key=lambda n: latest[n].id, reverse=True)  # the plan last saved comes first
    c1, c2 = st.columns(2)
    # a new plan unless one is picked: saving into the plan last saved by default wrote into an unrelated plan
    plan_name = c1.selectbox("Save α into plan", ["(new plan)"] + newest_first, key="alpha_plan",
                             help="A new version of the plan picked, or a new plan under the name below; the α chart "
                                  "counts what the layer's scheme in that plan does")
    base = latest.get(plan_name)
    new_scheme = alpha_est.DEFAULT_NEW_PLAN_SCHEME
    planned: alpha_est.PlannedScheme | None = None
    try:
        if base is None:
            new_scheme = c2.selectbox(
                "Scheme of the new plan", list(alpha_est.SMOOTHABLE_PRESETS), key="alpha_scheme",
                help="on every layer but lm_head, smoothed with the α saved for this layer's group")
        planned = alpha_est.PlannedScheme.of(plans_svc.alpha_scheme(model, base, layer, new_scheme))
    except ValueError as exc:  # Refused is one: the base plan does not resolve; or its scheme quantizes no activations
        st.info(f"No α to suggest for {layer} in {plan_name}: {exc}")
    group = [m for m in fusion_group_of(layer, layer_names(model)) if m in all_stats] or [layer]
    (alpha_part if reads_alpha else alpha_fragment)(layer, tuple(group), planned, base, new_scheme)


def alpha_part(layer: str, group: tuple[str, ...], planned: alpha_est.PlannedScheme | None,
               base: PlanRecord | None, new_scheme: str) -> None:
    """The α slider, the SmoothQuant panels and the "Choosing α" chart at its α, and the form that saves it into
    ``base`` (None: a new plan of ``new_scheme``) for the layer's fusion ``group``."""
    alpha = st.slider("α (migration strength)", 0.0, 1.0, 0.5, 0.05, key="outliers_alpha")
    st.vega_lite_chart(smoothquant_spec(cal_id, layer, alpha), width="content")  # two fixed panels
    st.caption(f"Right: after smoothing at α = {alpha:.2f}; one y axis for every α.")
    sweep = None
    if planned is not None:
        sweep = alpha_sweep_of(cal_id, group, planned)
        suggested = alpha_est.suggested_alpha(sweep)
        error_at = {round(float(a), 2): float(e) for a, e in zip(sweep["alpha"], sweep["error"], strict=True)}
        choice = alpha_choice_spec(cal_id, group, planned)
        st.vega_lite_chart(outlier_charts.with_chosen_alpha(choice, alpha), width="stretch")
        c1, c2 = st.columns([3, 1])
        c1.markdown(f"**Suggested α = {suggested:.2f}** for {', '.join(group)} under {planned.label}: the least "
                    f"estimated output error from these statistics ({error_at[round(suggested, 2)]:.3g}; at α = 0.50: "
                    f"{error_at[0.5]:.3g}). One α smooths the whole fusion group.")
        c2.button(f"Use α = {suggested:.2f}", key="alpha_use_suggested",
                  on_click=lambda: st.session_state.update(outliers_alpha=suggested))
    if auth.may("save_plan"):
        with st.form("save_alpha"):
            new_name = st.text_input("Name, for a new plan", value=f"{model.name}-smoothquant", key="alpha_new_name",
                                     disabled=base is not None)
            warning = alpha_est.alpha_warning(sweep, alpha) if sweep is not None else None
            anyway = False
            if warning:
                st.warning(warning)
                anyway = st.checkbox("Save anyway", key=f"alpha_anyway_{layer}_{alpha:.2f}",
                                     help="the chart above estimates this α to be bad for the scheme; tick to save it")
            if st.form_submit_button(f"Save α = {alpha:.2f} for {layer} (and its fusion group)"):
                name = new_name if base is None else base.name
                if base is not None:  # its newest version: an α saved since this fragment's arguments were set
                    base = {p.name: p for p in plans_svc.list_plans(model.id)}.get(base.name, base)
                try:
                    if warning and not anyway:  # no silent save of an α the chart itself estimates to be bad
                        raise ValueError(f"{warning} Tick 'Save anyway' to save it all the same.")
                    saved = plans_svc.save_layer_alpha(model, name, layer, alpha, base, scheme=new_scheme)
                except ValueError as exc:  # Refused is a ValueError
                    st.error(f"Not saved: {exc}")
                else:
                    scheme = plans_svc.resolve(model, saved.body)[0][layer]
                    st.success(f"Saved {saved.label}: α = {alpha:.2f} for {layer} and its fusion group, smoothed "
                               f"before its {scheme.name.split('(')[0].strip()} quantization"
                               + (f" (a new plan: {new_scheme} on every layer but lm_head)" if base is None else "")
                               + ".")
    else:
        st.caption(auth.cannot("save_plan"))


# an α step reruns the slider and what it moves, not the rotation what-if, the plan's selects and their queries
alpha_fragment = st.fragment(alpha_part)



# ----------------------------------------------------------------------------- 5. histogram + grid
element_formats = [f for f in list_formats()]


@st.fragment
def histogram_section(layer: str) -> None:
    st.subheader("|x| histogram with a format's grid")
    box = st.expander("The layer's |x| histogram against a format's grid", key=HISTOGRAM_OPEN,
                      on_change="rerun")
    with box:
        if box.open:  # built and sent only once opened
            histogram_body(layer)


def histogram_body(layer: str) -> None:
    c1, c2 = st.columns(2)
    fmt = c1.selectbox("Format", element_formats, index=element_formats.index("int8"), key="outliers_fmt")
    gran = c2.selectbox("Scale granularity", list(ol.GRANULARITIES), key="outliers_gran")
    spec = histogram_spec(cal_id, layer, fmt, gran)
    if spec is None:
        st.info("This layer's input was all zeros during calibration.")
    else:
        st.vega_lite_chart(spec, width="stretch")


layer_sections()

# ----------------------------------------------------------------------------- 6. Q, K and V
cal = next(c for c in cals if c.id == cal_id)


@st.fragment
def kv_section() -> None:
    """The K / V / Q maxima: what they say in words, and their chart once its expander is opened (which reruns this
    section alone)."""
    kv_frame, kv_spec = kv_of(cal_id, (cal.result or {}).get("kv_amax"))
    st.subheader("Q, K and V: what the KV cache and FP8 attention hold")
    if kv_frame.empty:
        st.caption("This calibration has no K/V maxima"
                   + (f": {cal.result['kv_note']}." if (cal.result or {}).get("kv_note") else
                      " (it predates them; calibrate again to see them)."))
        return
    box = st.expander("The maxima of every attention layer, on a chart", key=KV_OPEN, on_change="rerun")
    with box:
        if box.open:
            st.vega_lite_chart(kv_spec, width="stretch")
    cached = kv_frame[kv_frame["tensor"] != "Q"]
    over = cached[cached["amax"] > 448.0]
    q = kv_frame[kv_frame["tensor"] == "Q"]
    q_over = q[q["amax"] > 448.0]
    st.caption("K after the rotary embedding and V, per attention layer, over the calibration text: the tensors a "
               "serving engine writes into its KV cache. An FP8 E4M3 cache without calibrated scales "
               "(FP8_UNSCALED, vLLM's `--kv-cache-dtype fp8` on a checkpoint without K/V scales) clips everything "
               "above 448; calibrated scales (FP8) map each layer's maximum onto 448 instead. "
               + (f"**{len(over)} of {len(cached)} maxima exceed 448** "
                  f"({', '.join(sorted(set(over['layer'])))[:300]}): "
                  "choose FP8, not FP8_UNSCALED, for this model's KV cache." if len(over) else
                  f"Every maximum is below 448 (largest {cached['amax'].max():,.4g}): scale 1.0 clips nothing "
                  "on this text."))
    if len(q):
        st.caption("Q (after the rotary embedding) matters where attention itself runs in FP8: vLLM's "
                   "FlashAttention 3 backend on Hopper quantizes Q to E4M3 at scale 1.0 whenever the cache is FP8 "
                   "(scored as FP8_ATTN, FP8_ATTN_UNSCALED or FP8_ATTN_HEAD). "
                   + (f"**{len(q_over)} of {len(q)} Q maxima exceed 448** "
                      f"({', '.join(sorted(q_over['layer']))[:300]}): FP8 attention clips them." if len(q_over)
                      else f"Every Q maximum is below 448 (largest {q['amax'].max():,.4g}): FP8 attention clips no "
                           "Q on this text."))
    spread = kv_head_spread(cal.result.get("kv_amax"))
    if spread:
        layer, tensor, ratio = spread[0]
        st.caption(f"Within one layer, the KV heads' largest values differ by up to **{ratio:,.1f}×** ({tensor} of "
                   f"{layer}): one scale per layer puts that layer's smallest head on a grid {ratio:,.1f}× coarser "
                   "than its own range; FP8_ATTN_HEAD gives every KV head its own scale (vLLM's FlashAttention "
                   "backend, Hopper). Median over layers and tensors: "
                   f"{sorted(r for *_, r in spread)[len(spread) // 2]:,.1f}×.")


kv_section()

from app import moe_panel  # noqa: E402  (6b. an MoE model's calibration tokens per expert)

moe_panel.render(cal)


# ----------------------------------------------------------------------------- 7. what will break
@st.fragment
def breakage_section() -> None:
    st.subheader("What will break, before running anything")
    st.caption("From the statistics alone: share of channels whose largest value flushes to zero, the worst "
               "relative rounding error of the smallest channel, and the share of values a static scale set "
               "from the p99 token max would clip.")
    box = st.expander("The table, by layer and format", key=BREAKAGE_OPEN, on_change="rerun")
    with box:
        if box.open:  # the table is built and drawn only once opened
            breakage_table()


def breakage_table() -> None:
    c1, c2 = st.columns(2)
    bgran = c1.selectbox("Granularity", list(ol.GRANULARITIES), key="breakage_gran")
    bfmts = c2.multiselect("Formats", element_formats, default=list(ol.DEFAULT_BREAKAGE_FORMATS), key="breakage_fmts")
    if bfmts:
        table = breakage_of(cal_id, tuple(bfmts), bgran)
        pct = "%.2f%%"
        st.dataframe(
            table.sort_values(["frac_channels_flushed", "worst_rel_error"], ascending=False)
            .assign(**{c: table[c] * 100 for c in ("frac_channels_flushed", "worst_rel_error", "median_rel_error",
                                                     "expected_saturation")}),
            hide_index=True, width="stretch",
            column_config={
                "scale_amax": st.column_config.NumberColumn("scale amax", format="%.4g",
                                                            help="the largest |x| the scale is set from"),
                "flush_threshold": st.column_config.NumberColumn("flushes below", format="%.3g",
                                                                 help="|x| at or below this rounds to zero"),
                "frac_channels_flushed": st.column_config.NumberColumn(
                    "channels flushed", format=pct, help="channels whose largest value rounds to zero"),
                "worst_rel_error": st.column_config.NumberColumn(
                    "worst rel. error", format=pct, help="rounding error of the smallest channel's largest value"),
                "median_rel_error": st.column_config.NumberColumn(
                    "median rel. error", format=pct, help="the same for the median channel"),
                "expected_saturation": st.column_config.NumberColumn(
                    "clipped by a static scale", format=pct,
                    help="share of values a static scale set from the p99 token max would clip"),
                "dead_channels": st.column_config.NumberColumn("dead channels", help="channels that are always 0"),
            })


breakage_section()
