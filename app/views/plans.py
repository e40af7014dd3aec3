"""Plans: a number format for every linear layer — by preset, by rule, per row — checked against a target
GPU, saved as versions, compared, chosen automatically under a KL budget, and exported."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from app import auth, choice_panel, frames, plan_tools, state
from app import text as page_text
from jobs.specs import TENSOR_PARALLEL
from quantcore.evaluation.kvcache import KV_FORMATS, layer_index
from quantcore.kernels.hardware import list_targets
from quantcore.planning.plans import gpus_label, kv_label
from quantcore.schemes.presets import list_schemes
from quantplan.services import models as models_svc
from quantplan.services import plan_editor as plan_editor_svc
from quantplan.services import plans as plans_svc
from quantplan.services import serving as serving_svc
from quantplan.services import sweeps as sweeps_svc
from quantplan.services import units as units_svc

st.title("Plans")
model = state.current_model()
if model is None:
    st.stop()
SCHEMES = list_schemes()
EDIT = f"plan_body_{model.id}"

plans = plans_svc.list_plans(model.id)
latest = {p.name: p for p in plans}
START = f"plan_start_{model.id}"
if saved := st.session_state.pop(state.PLAN_SAVED, None):  # saved or imported in the run before: edit it from here
    label, name = saved
    st.success(f"{label}.")
    st.toast(f"{label}.")  # seen beside the button pressed too (Import sits at the foot of a long page)
    if name in latest:
        st.session_state[START] = name
        st.session_state.pop(f"{EDIT}_from", None)  # edit the version saved (an import may reuse the name shown)
        for key in [k for k in st.session_state
                    if str(k).startswith("plan_") and str(k).endswith(f"_{model.id}_{name}")]:
            del st.session_state[key]  # its widgets (default, KV cache, GPUs, rules, table) drawn anew from it
c1, c2 = st.columns([2, 1])
start = c1.selectbox("Start from", ["(new plan)"] + sorted(latest), key=START)
target = c2.selectbox("Target GPU", [t.key for t in list_targets()], index=2,
                      format_func=lambda k: next(t.name for t in list_targets() if t.key == k), key="plan_target")
if st.session_state.get(f"{EDIT}_from") != start:
    st.session_state[EDIT] = (dict(latest[start].body) if start in latest
                              else plans_svc.new_plan_body(model, "FP8_DYNAMIC"))
    st.session_state[f"{EDIT}_from"] = start
    st.session_state.pop(f"{EDIT}_base", None)  # the body as loaded, once the widgets below have read it
body = st.session_state[EDIT]

# ----------------------------------------------------------------------------- preset + rules


CATALOG = frames.scheme_catalog()  # every preset with its description, formats, bits and native GPUs, by family
SCHEME_ORDER = CATALOG["scheme"].tolist()
SCHEME_LABEL = {r.scheme: f"{r.family} · {r.scheme}: {r.description}" for r in CATALOG.itertuples()}
PATTERNS = frames.layer_patterns


def _rule_builder(names: list[str], rules_key: str, body: dict) -> None:
    """A rule made from the model's own layer-name patterns (or one typed, its matches counted) and a scheme
    picked with its description; the preset explainer beside it."""
    plan_tools.lazy_scheme_explainer("Schemes explained: every preset by family, its formats, storage and where it "
                                     "runs natively", f"{rules_key}_explainer", CATALOG)
    patterns = PATTERNS(names)
    b1, b2, b3 = st.columns([2, 3, 1], vertical_alignment="bottom")
    pattern = b1.selectbox("Layers (a pattern of this model, or type one)", list(patterns), index=None,
                           accept_new_options=True, key=f"{rules_key}_pattern",
                           format_func=lambda p: f"{p} ({patterns[p]} layers)" if p in patterns else p,
                           placeholder="down_proj, layers\\.0\\., lm_head …")
    scheme = b2.selectbox("Scheme", SCHEME_ORDER, index=None, key=f"{rules_key}_scheme",
                          format_func=SCHEME_LABEL.get, placeholder="FP8 · INT8 · FP4 · weight-only · keep")
    if pattern:
        count = frames.pattern_matches(pattern, names)
        st.caption(f"`{pattern}` matches {count} of {len(names)} layers" if isinstance(count, int) else
                   f"`{pattern}`: {count}")
    if b3.button("Add rule", key=f"{rules_key}_add", disabled=not (pattern and scheme)):
        st.session_state[EDIT] = {**body, "rules": [*(body.get("rules") or []),
                                                    {"match": pattern, "scheme": scheme}]}
        st.session_state.pop(rules_key, None)  # the grid drawn anew from the rules with the new one
        st.rerun()


def _filled(cell) -> bool:
    """A rules-table cell holds something: not empty, and not the NaN / None a new row starts with."""
    return not pd.isna(cell) and str(cell).strip() != ""


with st.container(border=True):
    st.markdown("**Preset for all layers, then rules** (regular expressions on layer names; the last "
                "matching rule wins; per-row choices below win over rules).")
    c1, c2, c3 = st.columns([2, 2, 1])
    default = c1.selectbox("Default scheme", SCHEME_ORDER, index=SCHEME_ORDER.index(body.get("default", "BF16")),
                           format_func=SCHEME_LABEL.get, key=f"plan_default_{model.id}_{start}")
    tp_now = int(body.get("tensor_parallel") or 1)
    tp = int(c3.number_input("GPUs (tensor parallel)", *TENSOR_PARALLEL.form_bounds(), tp_now, step=1,
                             key=f"plan_tp_{model.id}_{start}",
                             help="vLLM's --tensor-parallel-size: every layer is split over this many GPUs (q/k/v "
                                  "and gate/up by output rows, o_proj and down_proj by input columns). The serving "
                                  "checks below read each GPU's share: a quantization group or FP8 block may not "
                                  "straddle two GPUs. The ideal step and the KV cache figures are per GPU."))
    ep = bool(model.moe) and c3.checkbox(
        "Experts whole (expert parallel)", bool(body.get("expert_parallel")), key=f"plan_ep_{model.id}_{start}",
        disabled=tp == 1, help="vLLM's --enable-expert-parallel: every routed expert stays whole on one GPU and the "
                               "GPUs share the experts out, instead of every expert being split over them (which "
                               "block-scaled FP8 refuses where an expert's share is not a whole number of blocks)")
    per_expert = bool(model.moe) and c3.checkbox(
        "Experts one by one (per_expert)", body.get("per_expert") is True, key=f"plan_pe_{model.id}_{start}",
        help="per_expert: true in the plan: each routed expert of an MoE block may take its own scheme (its "
             "gate/up/down together, the unit of a per-expert sensitivity sweep), as ModelOpt's per-module search "
             "spaces allow; a scheme set on an expert's row in the table below then sets that expert only. Off: "
             "every expert of a block takes one scheme, what vLLM's fused MoE layer serves. An llm-compressor "
             "recipe and a compressed-tensors config hold a mix; vLLM cannot serve it, so its export refuses a "
             "block whose experts differ (the serving warnings say which). Turning it off with experts that "
             "differ leaves a plan that does not resolve until each block's experts share one scheme.")
    rot_now = (body.get("transforms") or {}).get("rotation") or {}
    rot_kind = c1.selectbox(
        "Rotation (before quantizing)", plan_editor_svc.ROTATION_CHOICES, key=f"plan_rot_{model.id}_{start}",
        index=plan_editor_svc.ROTATION_CHOICES.index(rot_now.get("kind", "none")),
        help="A Hadamard rotation folded into the weights (R1: residual stream, R2: attention values) and applied "
             "online before down_proj (R4), as QuaRot and SpinQuant do: the model computes the same, but outlier "
             "channels are spread over all channels before the activations are quantized. Exported as "
             "llm-compressor's SpinQuantModifier.")
    rot_block = int(c2.number_input("Rotation block size (0: whole width)", 0, 65536,
                                    int(rot_now.get("block_size") or 0), step=16, disabled=rot_kind == "none",
                                    key=f"plan_rot_block_{model.id}_{start}",
                                    help="A block-diagonal Hadamard of this order for R1 and R4 (MR-GPTQ's); "
                                         "llm-compressor builds powers of two only"))
    kv_names = list(KV_FORMATS)
    kv_cache = c2.selectbox("KV cache", kv_names, index=kv_names.index(body.get("kv_cache", "AUTO")),
                            key=f"plan_kv_{model.id}_{start}",
                            format_func=lambda k: "AUTO (model dtype)" if k == "AUTO" else k,
                            help="How the serving engine stores K and V (vLLM --kv-cache-dtype). "
                                 + " ".join(f"{k}: {f.description}." for k, f in KV_FORMATS.items()))
    skip_options = plan_editor_svc.kv_skip_options(model)
    skip_key = f"plan_kv_skip_{model.id}_{start}"
    kv_skip = st.multiselect(
        "Keep these layers' KV cache in BF16", skip_options, disabled=kv_cache == "AUTO" or not skip_options,
        default=None if skip_key in st.session_state else
        [e for e in map(str, body.get("kv_cache_skip") or []) if e in skip_options],
        key=skip_key,
        help="vLLM's --kv-cache-dtype-skip-layers: decoder layer indices, or sliding_window for every "
             "sliding-window layer (which some models find more sensitive to a quantized cache; they hold only "
             "their window, so keeping them in BF16 costs little memory).") if skip_options else []
    if kv_cache != "AUTO" and skip_options:
        kv_sens = sweeps_svc.kv_sensitivity(model, kv_cache)
        if kv_sens:
            worst = sorted(kv_sens[1].items(), key=lambda item: -item[1])[:5]
            skipped_layers = plans_svc.kv_skipped(model, {"kv_cache": kv_cache, "kv_cache_skip": kv_skip})
            kept = {str(layer_index(n)) for n in skipped_layers}
            rest = sum(kl for i, kl in kv_sens[1].items() if i not in kept)
            st.caption(f"The newest {kv_cache} sweep (job #{kv_sens[0]}): the layers whose cache costs most on "
                       "its own, " + ", ".join(f"{i} (KL {kl:.2g})" for i, kl in worst) + ". The layers left in "
                       f"{kv_cache} add up to KL {rest:.3g} there (a sum of one-layer KLs: a whole cache can cost "
                       "more; score the plan to know).")
            def keep_within(budget_key: str, kv: str = kv_cache, key: str = skip_key) -> None:
                choice = plan_editor_svc.choose_kv_skip(model, kv, float(st.session_state[budget_key]),
                                            int(st.session_state.get("plan_kv_context", 4096)))
                st.session_state[key] = [e for e in choice["kv_cache_skip"] if e in skip_options]

            b1, b2 = st.columns([1, 2])
            b1.number_input("Cache KL budget", 0.0, 10.0, round(sum(kv_sens[1].values()) / 2, 5), format="%.5f",
                            key="plan_kv_budget")
            b2.button("Keep the layers that bring the cache within it, with the least memory",
                      on_click=keep_within, args=("plan_kv_budget",), key="plan_kv_choose",
                      help="Every attention layer either stays in the format (its KL from the sweep) or keeps BF16 "
                           "(KL 0, twice the bytes; a sliding-window layer holds only its window): the cheapest "
                           "choice at the context of the KV cache section below.")
        else:
            st.caption(f"Which layers to keep: a KV cache sweep of {kv_cache} (Results page) measures each layer's "
                       "cache on its own.")
    names = models_svc.layer_names(model)
    rules_key = f"plan_rules_{model.id}_{start}"
    _rule_builder(names, rules_key, body)
    rules = st.data_editor(pd.DataFrame(body.get("rules") or [], columns=["match", "scheme"]),
                           num_rows="dynamic", key=rules_key, width="stretch",
                           # not required: the browser would keep a row without a scheme to itself, and
                           # the page could not say it was left out (the rules as read, below)
                           column_config={
                               "match": st.column_config.TextColumn(
                                   "match", help="a regular expression searched in each layer name, e.g. "
                                   + ", ".join(f"`{p}` ({n})" for p, n in list(PATTERNS(names).items())[:6])),
                               "scheme": st.column_config.SelectboxColumn(
                                   "scheme", options=SCHEME_ORDER, format_func=SCHEME_LABEL.get,
                                   help="grouped by family; what each does: Schemes explained, above")})
    rule_rows = rules.to_dict("records")
    body = {**{k: v for k, v in plan_editor_svc.with_rotation(body, rot_kind, rot_block).items()
               if k not in ("kv_cache", "kv_cache_skip", "tensor_parallel", "expert_parallel", "per_expert")},
            "default": default,
            **({"kv_cache": kv_cache} if kv_cache != "AUTO" else {}),
            **({"kv_cache_skip": kv_skip} if kv_cache != "AUTO" and kv_skip else {}),
            **({"tensor_parallel": tp} if tp > 1 else {}),
            **({"expert_parallel": True} if ep and tp > 1 else {}),
            **({"per_expert": True} if per_expert else {}),
            "rules": [{"match": str(r["match"]), "scheme": str(r["scheme"])}
                      for r in rule_rows if _filled(r.get("match")) and _filled(r.get("scheme"))]}
    st.session_state[EDIT] = body
    half = [i for i, r in enumerate(rule_rows, start=1) if _filled(r.get("match")) != _filled(r.get("scheme"))]
    if rule_rows:  # each row as the plan reads it, in place: an incomplete one says so, no warning while typing
        st.dataframe(frames.rules_readback(rule_rows, names), hide_index=True, width="stretch",
                     key=f"plan_rules_read_{model.id}_{start}",
                     column_config={"layers": st.column_config.NumberColumn(help="layers the match finds"),
                                    "state": st.column_config.TextColumn(width="large")})
    st.session_state.setdefault(f"{EDIT}_base", body)

resolved, problem = plans_svc.resolve(model, body)
if problem:
    st.error(problem)

# ----------------------------------------------------------------------------- per-row table
st.subheader("Every linear layer")
st.caption(page_text.FUSION_REASON + (" This plan is per-expert (Experts one by one, above): each expert's "
                                      "gate/up/down share a scheme, and the experts of a block may differ."
                                      if body.get("per_expert") else ""))
table = plan_editor_svc.layer_table(model, body, target)
# SmoothQuant's alpha as text, empty where the layer's scheme does not smooth (a number column shows None there)
table["alpha"] = [f"{a:g}" if pd.notna(a) else "" for a in table["alpha"]]
# a column of None for every quantized layer says nothing (BF16 ones read 0 without a sweep): say it once instead
quantized = table["scheme"] != "BF16"
no_sensitivity = model.causal_lm is False or (  # an encoder has no sweeps at all
    bool(quantized.any()) and table.loc[quantized, "sensitivity_kl"].isna().all())
if no_sensitivity:
    table = table.drop(columns="sensitivity_kl")
edited = st.data_editor(
    table, key=f"plan_table_{model.id}_{start}", hide_index=True, width="stretch",
    disabled=[c for c in table.columns if c != "scheme"],
    column_config={
        "scheme": st.column_config.SelectboxColumn("scheme", options=SCHEME_ORDER, required=True,
                                                   format_func=SCHEME_LABEL.get),
        "outlier_ratio": st.column_config.NumberColumn(
            "outlier ratio", format="%.1f", help="the input's largest channel max|x| over its median channel's, from "
                                                 "the newest calibration (Outliers page); None: not calibrated yet"),
        "sensitivity_kl": st.column_config.NumberColumn(
            "sensitivity KL", format="%.5f",
            help="KL against the unquantized model when only this layer (its fusion group) uses the scheme "
                 "of this row, from the newest sensitivity sweep of that scheme; 0 in BF16; None: no sweep of it "
                 "yet, or a SmoothQuant sweep, which leaves out the layers no llm-compressor recipe can smooth. "
                 "An MoE expert's row: its expert's KL from a per-expert sweep (sensitivity --per-expert) when the "
                 "plan is per-expert, its whole block's from a plain sweep when not, and the other where only "
                 "that one was made"),
        "alpha": st.column_config.TextColumn(help="SmoothQuant's migration strength of the layer's scheme; empty: "
                                                  "the scheme does not smooth"),
        "on_target": st.column_config.TextColumn(
            f"on {target}", width="medium", help="native / emulated / unsupported: whether the GPU runs the "
                                 "scheme's formats in its "
                                 "own units; refused: llm-compressor or vLLM would not make or load the layer "
                                 "(the warnings below the table say why and offer a scheme that fits)"),
        "N / GPU": st.column_config.NumberColumn(help=f"output rows of this layer on each of the {tp} GPUs"),
        "K / GPU": st.column_config.NumberColumn(help=f"input columns of this layer on each of the {tp} GPUs"),
        "fused_with": st.column_config.NumberColumn(
            "fused with", help="other layers that share this one's scheme: served in one GEMM with it (q/k/v, "
                               "gate/up), every routed expert of its MoE block, or in a per-expert plan its own "
                               "expert's other projections (its gate/up/down)"),
    },
)
changed = edited[edited["scheme"] != table["scheme"]]
if len(changed):
    notes = []
    for row in changed.to_dict("records"):
        body, group = plan_editor_svc.with_layer_scheme(model, body, row["layer"], row["scheme"])
        if len(group) > 1:
            notes.append(plan_tools.unit_note(row["scheme"], group))
    st.session_state[EDIT] = body
    st.session_state[f"{EDIT}_notes"] = notes  # said in the run drawn next, the table showing the change
    st.rerun()
for n in st.session_state.pop(f"{EDIT}_notes", None) or []:
    st.info(n)
if no_sensitivity and model.causal_lm is not False:
    swept = sorted(sweeps_svc.sensitivity_map(model, tp, bool(body.get("expert_parallel")))[0])
    unswept = sorted(set(table.loc[quantized, "scheme"]) - set(swept))
    st.caption("No sensitivity KL column: "
               + (f"no sweep of {', '.join(unswept)} yet" if unswept else "no sweep of this plan's layers")
               + (f" (swept: {', '.join(swept)})" if swept else "")
               + ". The Results page queues one; each layer then shows the KL of its own scheme.")
counts = table["on_target"].value_counts().to_dict()
if counts:
    st.caption(" · ".join(f"{v} layers {k}" for k, v in counts.items()) + f" on {target}.")
for reason in serving_svc.support_reasons(table["scheme"].unique(), target):
    st.caption(reason)
for warning in serving_svc.serving_warnings(model, body):
    st.warning(warning)


def use_fix(scheme: str, layers: list[str], clear_alpha: bool = False,
            table_key: str = f"plan_table_{model.id}_{start}") -> None:
    st.session_state[EDIT] = plan_editor_svc.with_schemes(model, st.session_state[EDIT], {scheme: layers},
                                                          clear_alpha=clear_alpha)
    st.session_state.pop(table_key, None)  # the table's own edits would otherwise be laid over the new choices


for alt, layers in plan_editor_svc.regroup_fixes(model, body).items():
    st.button(f"Use {alt} on the {len(layers)} layer(s) whose K it fits", key=f"plan_regroup_{alt}",
              on_click=use_fix, args=(alt, layers),
              help="Sets it as a per-layer choice on those layers (and their fusion groups); the rest of the plan "
                   "keeps its schemes. Clear per-layer overrides below to undo.")
for plain, layers in plan_editor_svc.unsmoothed_fixes(model, body).items():
    st.button(f"Use {plain} on the {len(layers)} layer(s) no llm-compressor recipe can smooth",
              key=f"plan_unsmooth_{plain}", on_click=use_fix, args=(plain, layers, True),
              help="Sets it as a per-layer choice on those layers (their own SmoothQuant alphas go too); the rest of "
                   "the plan keeps its schemes. Clear per-layer overrides below to undo.")
if body.get("layers"):
    with st.expander(f"{len(body['layers'])} per-layer overrides"):
        st.json(body["layers"])
        if st.button("Clear per-layer overrides", key="plan_clear"):
            st.session_state[EDIT] = {**body, "layers": {}}
            st.rerun()

# ----------------------------------------------------------------------------- weight memory
if resolved is not None:
    fp = plans_svc.plan_footprint(model, body)
    st.subheader("Weight memory")
    c1, c2 = st.columns([1, 2])
    c1.metric("Linear weights", units_svc.mib_text(fp.bits),
              f"{fp.ratio:.0%} of BF16 ({units_svc.mib_text(fp.bf16_bits)})",
              delta_color="off", delta_arrow="off")
    c2.dataframe(frames.footprint_frame(fp), hide_index=True, width="stretch",
                 column_config={"weights (M)": st.column_config.NumberColumn(format="%.2f"),
                                "MiB": st.column_config.NumberColumn(format="%.1f"),
                                "bits / weight": st.column_config.NumberColumn(format="%.3f"),
                                "share": st.column_config.ProgressColumn(min_value=0.0, max_value=1.0,
                                                                         format="percent")})
    st.caption("Stored size of the linear weights: elements at the format's width plus their scales "
               "(16-bit per tensor, channel, group or block, as compressed-tensors saves them; E8M0 per 32 "
               "for MX; E4M3 per 16 plus one fp32 for NVFP4). Embeddings, norms and biases are not counted. "
               "In a memory-bound decode step this is also the weight traffic per generated token.")

    gpu = serving_svc.target_names()[target]
    on = f"each of {tp} × {gpu}" if tp > 1 else gpu
    if tp > 1:
        st.caption(f"Split over {tp} GPUs, each holds about 1/{tp} of these weights (layers vLLM does not split, "
                   "such as an MoE router, whole on each).")
    cols = st.columns(2)
    for col, (step, m) in zip(cols, (("decode step, batch 1", 1), ("prefill step, 2,048 tokens", 2048)), strict=True):
        bound = serving_svc.step_bound(model, body, target, m)
        bf16 = serving_svc.step_bound(model, plans_svc.bf16_body(body), target, m)
        col.metric(f"Ideal {step} on {on}", f"{bound.ms:.3f} ms", f"×{bf16.ms / bound.ms:.2f} vs BF16 "
                   f"({bf16.ms:.3f} ms)", delta_color="off", delta_arrow="off")
    not_native, unsupported = len(bound.not_native), len(bound.unsupported)  # the same layers at any M
    refused = int(table["on_target"].str.startswith("refused").sum())
    st.caption(f"The roofline bound of the plan's linear layers on a {gpu} from its datasheet: each layer's "
               f"weight read at {serving_svc.target_bandwidth(target):g} TB/s or its math at the peak of the precision "
               "the GPU runs natively, whichever is longer (decode is bound by the weights, prefill by the math). "
               "A real engine gets less; measured times are on the Kernels page."
               + (f" With {tp} GPUs each computes its share of every layer; the all-reduces that add the shares "
                  "of o_proj and down_proj are not counted." if tp > 1 else "")
               + (f" {not_native} layer(s) use a scheme {target} does not run natively: their math counts at "
                  "bf16." if not_native else "")
               + (f" **{unsupported} of them have no serving kernel on {target} at all**: the plan cannot be served "
                  "there as it stands." if unsupported else "")
               + (f" **{refused} layer(s) would be refused** by llm-compressor or vLLM (\"refused\" in the table): "
                  "they count here as if served; mend them first (the warnings above)." if refused else ""))

    if models_svc.kv_kib_per_token(model) is not None:  # the model's cache can be counted (separate k_proj / v_proj)
        st.subheader("KV cache")
        c1, c2 = st.columns(2)
        batch = int(c1.number_input("Sequences decoding", 1, 4096, 16, key="plan_kv_batch"))
        context = int(c2.number_input("Tokens of context each", 1, 1 << 21, 4096, step=1024, key="plan_kv_context"))
        kvm = serving_svc.kv_memory(model, body, target, context)
        dec = serving_svc.decode_with_cache(model, body, target, batch, context)
        c1, c2, c3 = st.columns(3)
        on = f"{tp} × " if tp > 1 else ""
        c1.metric(f"Cache of one sequence ({kvm['kv_cache']})", f"{kvm['sequence_bytes'] / units_svc.MIB:,.1f} MiB",
                  f"{kvm['sequence_bytes'] / kvm['bf16_sequence_bytes']:.0%} of BF16 "
                  f"({kvm['bf16_sequence_bytes'] / units_svc.MIB:,.1f} MiB)", delta_color="off", delta_arrow="off",
                  help=f"K and V of one sequence of {context:,} tokens")
        c2.metric(f"Sequences that fit on {on}{target}", f"{kvm['sequences']:,}",
                  f"×{kvm['sequences'] / kvm['bf16_sequences']:.2f} vs all-BF16 ({kvm['bf16_sequences']:,})"
                  if kvm["bf16_sequences"] else "all-BF16: none fit", delta_color="off", delta_arrow="off",
                  help=f"sequences of {context:,} tokens whose cache fits beside the weights on {on or 'one '}{gpu}")
        c3.metric("Ideal decode step, cache read", f"{dec['ms']:.3f} ms",
                  f"×{dec['bf16_ms'] / dec['ms']:.2f} vs all-BF16 ({dec['bf16_ms']:.3f} ms); cache read "
                  f"{dec['kv_ms'] / dec['ms']:.0%} of it", delta_color="off", delta_arrow="off",
                  help=f"the roofline step of {batch:,} sequences decoding a token each: the weights and every "
                       "sequence's cache read" + (", one GPU's share" if tp > 1 else ""))
        skipped = (f" {kvm['skipped_layers']} layer(s) keep their cache in BF16 (kv_cache_skip)."
                   if kvm["skipped_layers"] else "")
        windowed = (f" {kvm['windowed_layers']} layer(s) attend to a sliding window of "
                    f"{', '.join(f'{w:,}' for w in kvm['windows'])} tokens and keep only that many (as vLLM's "
                    "hybrid KV cache manager does)." if kvm["windowed_layers"] else "")
        st.caption(f"K and V of every layer: {kvm['bytes_per_token'] / 1024:,.2f} KiB a token "
                   f"(BF16 {kvm['bf16_bytes_per_token'] / 1024:,.2f} KiB), from the k_proj + v_proj widths, so "
                   f"grouped-query attention is counted.{windowed}{skipped} What fits: {kvm['memory_gb']:g} GB × "
                   "90 % (vLLM's "
                   "default memory share) minus the weights (the plan's linear weights, everything else in BF16); "
                   "activations and CUDA graphs take some of it, so this is an upper bound on batch × context. A "
                   f"decode step reads every cached token once: {batch:,} sequences' caches at "
                   f"{serving_svc.target_bandwidth(target):g} TB/s on top of the linears' bound, which is where a long "
                   "context spends its time. The accuracy cost of a KV format shows when the plan is scored "
                   "(Results)."
                   + (f" On {tp} GPUs the memory is {tp} × {serving_svc.target_names()[target]}'s"
                      + (f", and each key-value head is cached on {kvm['kv_copies']:g} GPUs (more GPUs than heads)"
                         if kvm["kv_copies"] > 1 else "") + "." if tp > 1 else "")
                   + (" FP8_UNSCALED keeps vLLM's default scale 1.0: a |K| or |V| above 448 saturates."
                      if kvm["kv_cache"] == "FP8_UNSCALED" else ""))
        backend = serving_svc.kv_backend_note(kvm["kv_cache"], target)
        if backend:
            st.info(backend)

# ----------------------------------------------------------------------------- save
if auth.may("save_plan"):
    with st.form("plan_save", enter_to_submit=False):  # Enter in a field saves nothing: the button does
        c1, c2 = st.columns([1, 2])
        name = c1.text_input("Plan name", value=start if start in latest else f"{model.name}-plan",
                             key=f"plan_name_{model.id}_{start}")  # the plan opened's own name, whichever it is
        note = c2.text_input("What changed", key=f"plan_note_{model.id}_{start}")
        if st.form_submit_button("Save as a new version", type="primary", disabled=problem is not None):
            name = name.strip()
            to_save = {**body, "name": name, "model": model.name}
            if not name:
                st.error("Give the plan a name: its versions are saved, listed and exported under it.")
            elif half:
                st.error(f"Rule row(s) {', '.join(map(str, half))} have a match or a scheme but not both: finish or "
                         "delete them first, or they would be lost from the version saved.")
            elif same := plans_svc.unchanged_version(model.id, name, to_save):
                st.info(f"No change from {same.label}: nothing saved.")
            else:
                try:  # a viewer is refused by the application layer
                    saved = plans_svc.save_plan(model.id, name, to_save, note=note)
                except ValueError as exc:
                    st.error(str(exc))
                else:
                    state.plan_saved(f"Saved {saved.label}", saved.name)
else:
    st.caption(auth.cannot("save_plan"))

# ----------------------------------------------------------------------------- versions and diff
plans = sorted(plans, key=lambda p: p.id)  # as saved, the newest last
if plans:
    st.subheader("Versions")
    st.dataframe(pd.DataFrame([{"id": p.id, "plan": p.label, "parent": "" if p.parent_id is None else f"{p.parent_id}",
                                "author": p.author or "", "note": p.note, "saved": page_text.ago(p.created_at)}
                               for p in plans]),
                 hide_index=True, width="stretch",
                 column_config={"plan": st.column_config.TextColumn(width="large"),
                                # relative, as every time on the pages; the exact UTC times on hover over the header
                                "saved": st.column_config.TextColumn(help="how long ago; in UTC: " + "; ".join(
                                    f"{p.label} {page_text.utc_text(p.created_at)}" for p in plans[-10:])),
                                "parent": st.column_config.TextColumn(
                     help="the id of the version this one was saved from; empty: a plan's first version")})
    if len(plans) >= 2:
        c1, c2 = st.columns(2)
        ids = [p.id for p in plans]
        lab = {p.id: p.label for p in plans}
        # keyed by the newest version: a version saved since shows as the newest two compared, not an older pair
        a = c1.selectbox("Compare", ids, index=len(ids) - 2, format_func=lab.get, key=f"diff_a_{ids[-1]}")
        b = c2.selectbox("with", ids, index=len(ids) - 1, format_func=lab.get, key=f"diff_b_{ids[-1]}")
        try:
            diff = frames.plan_diff(model, next(p for p in plans if p.id == a), next(p for p in plans if p.id == b))
        except ValueError as exc:  # a version that no longer resolves (saved by an older quantplan, or by hand)
            st.error(f"Cannot compare these versions: {exc}")
            diff = None
        kv_a, kv_b = (kv_label(next(p for p in plans if p.id == i).body) for i in (a, b))
        if kv_a != kv_b:
            st.caption(f"KV cache: {lab[a]} {kv_a} → {lab[b]} {kv_b}.")
        gpus_a, gpus_b = (gpus_label(next(p for p in plans if p.id == i).body) for i in (a, b))
        if gpus_a != gpus_b:
            st.caption(f"Served on: {lab[a]} {gpus_a} → {lab[b]} {gpus_b}.")
        if diff is not None and diff.empty:
            st.caption("Same scheme on every layer.")
        elif diff is not None:
            st.dataframe(diff, hide_index=True, width="stretch")
            sizes = [plans_svc.plan_footprint(model, next(p for p in plans if p.id == i).body) for i in (a, b)]
            st.caption(f"Linear weights: {lab[a]} {units_svc.mib_text(sizes[0].bits)} → {lab[b]} "
                       f"{units_svc.mib_text(sizes[1].bits)} ({sizes[0].ratio:.0%} → {sizes[1].ratio:.0%} of BF16).")

if plans:
    choice_panel.render(model, plans)  # the version chosen for the model: who, when, why

plan_tools.render(model, target, tp, bool(body.get("expert_parallel")),
                  unsaved=st.session_state[EDIT] != st.session_state.get(f"{EDIT}_base"))
