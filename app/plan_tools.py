"""Plan page sections that build on scoring and benchmarks: automatic plans and export."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from app import auth, forms, frames, state
from quantcore.evaluation.kvcache import KV_FORMATS
from quantplan.services import autoplan as autoplan_svc
from quantplan.services import exchange as exchange_svc
from quantplan.services import kernels as kernels_svc
from quantplan.services import plans as plans_svc
from quantplan.services import scoring as scoring_svc
from quantplan.services import serving as serving_svc
from quantplan.services import sweeps as sweeps_svc
from store.records import ModelRecord


def scheme_explainer(catalog: pd.DataFrame | None = None) -> None:
    """Every preset by family (app.frames.scheme_catalog), a tab a family, each a table that wraps its text so the
    whole row is in view at 1400 px: the Plans page's rules editor and the Results page's "What each preset does"
    read this one table."""
    catalog = frames.scheme_catalog() if catalog is None else catalog
    for tab, family in zip(st.tabs(list(frames.SCHEME_FAMILIES)), frames.SCHEME_FAMILIES, strict=True):
        rows = catalog[catalog["family"] == family].drop(columns="family").set_index("scheme")
        tab.table(rows.style.format({"storage bits": lambda b: f"{b:.3f}".rstrip("0").rstrip(".")}))  # 4.125
    st.caption("Storage bits: bits per weight as stored, scales included, on a 4096 × 4096 layer. Native on: the "
               "GPUs of the target list whose own units run the scheme's formats; elsewhere it is emulated.")


@st.fragment
def lazy_scheme_explainer(label: str, key: str, catalog: pd.DataFrame | None = None) -> None:
    """:func:`scheme_explainer` in an expander that builds it only when opened (its five tables are most of what a
    browser draws for a page that shows it): opening or closing it reruns this fragment alone."""
    with st.expander(label, key=key, on_change="rerun") as box:
        if box.open:
            scheme_explainer(catalog)


def unit_note(scheme: str, unit: list[str]) -> str:
    """What a scheme set on one row of the layer table set besides it: its fusion group, its MoE block's experts, or
    (a per-expert plan's unit) its own expert's gate/up/down only."""
    from quantcore.planning.plans import group_label
    from quantcore.schemes.fusion import expert_block

    blocks = {expert_block(m) for m in unit}
    experts = {m.rsplit(".", 1)[0] for m in unit}
    if len(blocks) == 1 and None not in blocks and len(experts) == 1:
        expert = experts.pop()
        return (f"{scheme} set on expert {expert.rsplit('.', 1)[-1]} of {blocks.pop()} only ({group_label(unit)}): "
                "a per-expert plan, the block's other experts keep theirs")
    if len(blocks) == 1 and None not in blocks:
        return (f"{scheme} set on every routed expert of {blocks.pop()} ({len(unit)} expert linears: one fused MoE "
                "layer; Experts one by one, above, lets each expert take its own)")
    return f"{scheme} set on the whole fusion group {group_label(unit)}"


AUTO_OUTCOME = "auto_plan_outcome"  # (what was said, notes, layers per scheme) of the automatic plan just saved


def render(model: ModelRecord, target: str, tp: int = 1, expert_parallel: bool = False, unsaved: bool = False) -> None:
    """``unsaved``: the plan edited above has changes not saved; an automatic plan then does not replace it."""
    st.subheader("Automatic plan")
    fast = bool(sweeps_svc.sensitivity_map(model, tp, expert_parallel, "fisher")[0])  # the default where there are any
    method = st.radio("Search on", ["fisher", "kl"], index=0 if fast else 1, horizontal=True,
                      key=f"auto_sensitivity_{model.id}",
                      format_func={"kl": "exact sensitivity sweeps", "fisher": "Fisher estimates (fast)"}.get,
                      help="The unit KLs the search sums: the exact sweeps, or the sampled-Fisher estimates "
                           "(Results page, method Fisher). Either way the plan is verified by a score, and the next "
                           "search corrects its prediction by the verified plans of this architecture family.")
    sens, _units = sweeps_svc.sensitivity_map(model, tp, expert_parallel, method)
    if model.causal_lm is False:
        st.info(f"An automatic plan chooses from per-layer sensitivity sweeps, which compare next-token "
                f"distributions: {model.name} is a {model.architecture}, not a causal language model, so it has "
                "none. Build its plan by preset and rules above; its export works as for any model.")
    elif not sens:
        st.info("An automatic plan needs per-layer sensitivity: queue sweeps for the candidate schemes on the "
                "Results page (e.g. FP8_DYNAMIC, INT8_W8A8, W4A16).")
    else:
        device_name = kernels_svc.measured_device_for(target)
        st.caption(f"Sensitivity known for: {', '.join(sorted(sens))}. "
                   + (f"Kernel timings of this GPU are stored (from {device_name})." if device_name
                      else f"No {target} kernel timings are stored: the first cost falls back to weight memory."))
        if tp > 1:
            read = sweeps_svc.planner_sweeps(model, tp, expert_parallel)
            on_tp = sorted(sweeps_svc.schemes_swept_on(read, tp, expert_parallel))
            standing_in = sorted(set(sens) - set(on_tp))
            inexact = sweeps_svc.split_scale_schemes(standing_in)
            stand = ""
            if inexact:
                stand = (f"One-GPU sweeps stand in for {', '.join(standing_in)}; those of {', '.join(inexact)} "
                         "overstate the KL of o_proj and down_proj, whose dynamic activation scale each GPU takes "
                         f"over its own share of their input (set the Results page's GPU count to {tp} to sweep "
                         "them so).")
            elif standing_in:
                stand = (f"One-GPU sweeps stand in for {', '.join(standing_in)}, exactly: their scales are the same "
                         "on any number of GPUs.")
            st.caption(f"For {plans_svc.gpus_label(tp, expert_parallel)} (the plan's tensor parallel above): no "
                       "scheme is "
                       "chosen for a layer whose share on one GPU vLLM would refuse. "
                       + (f"Swept on {tp} GPUs: {', '.join(on_tp)}. " if on_tp else "") + stand)
        if auth.may("queue"):
            with st.form("auto_plan", enter_to_submit=False):  # Enter in a field queues no job
                c1, c2 = st.columns(2)
                kept = forms.last("auto_plan", model.id)  # what was last asked for this model in this session
                budget = c1.number_input("KL budget (nats per token)", 0.0, 10.0, kept.get("budget", 0.02),
                                         step=0.005, format="%.4f", key="auto_budget")
                swept = sorted(set(sens) | {"BF16"})
                # keyed by the model and what it has sweeps for: another model, or a sweep finished since, opens on
                # every swept scheme again, not on the picks left from other options (filtered, they can leave BF16
                # alone)
                cands = c2.multiselect("Candidate schemes", swept,
                                       # the picks last queued while these schemes were swept; all, once one is
                                       # added
                                       default=kept["cands"] if kept.get("swept") == swept else swept,
                                       key=f"auto_cands_{model.id}_{'+'.join(swept)}")
                c1, c2, c3 = st.columns([3, 1, 1])
                costs = list(autoplan_svc.AUTO_COSTS)
                cost = c1.radio("Minimise", costs, format_func=autoplan_svc.AUTO_COSTS.get, key="auto_cost",
                                index=costs.index(kept["cost"]) if kept.get("cost") in costs else 0)
                m = c2.number_input("M (tokens per step)", 1, 1 << 20, kept.get("m", autoplan_svc.STEP_TOKENS),
                                    key="auto_m",
                                    help="1 for a decode step at batch 1; batch × prompt tokens for a prefill")
                kv = c3.selectbox("KV cache", list(KV_FORMATS), key="auto_kv",
                                  index=list(KV_FORMATS).index(kept["kv"]) if kept.get("kv") in KV_FORMATS else 0,
                                  help="Cache K and V in this format too: its KL, measured by scoring it alone (preset "
                                       "BF16 with this KV cache on the Results page), comes off the budget first.")
                newest = sweeps_svc.sensitivity_jobs(model.id)[:1]  # the verifying score runs on its sweeps' tokens
                tokens = forms.tokens_of(newest[0]) if newest else None
                device = autoplan_svc.AutoPlan.device  # where the verifying score runs
                st.caption("Cost: choosing is immediate; the verifying score job: " + (
                    forms.cost_note("score", device, model, tokens, "tokens", forms.tokens_of) if tokens else
                    "no estimate: the sweeps it reads recorded no token count."))
                if st.form_submit_button("Choose and verify", type="primary"):
                    forms.remember("auto_plan", model.id, {"budget": float(budget), "cands": cands,
                                                           "swept": swept, "cost": cost, "m": int(m), "kv": kv})
                    try:
                        before = {p.id for p in plans_svc.list_plans(model.id)}
                        command = autoplan_svc.AutoPlan(model, kl_budget=float(budget), target=target,
                                                        candidates=cands, cost=cost, m=int(m), kv_cache=kv,
                                                        tensor_parallel=tp, expert_parallel=expert_parallel,
                                                        sensitivity=method)
                        result, plan, job = command.run()
                    except ValueError as exc:
                        st.error(str(exc))
                    else:  # drawn again from the top, the plan saved is in Start from and in the table above
                        st.session_state[AUTO_OUTCOME] = (
                            f"{plan.label}: predicted KL {result.predicted_kl:.4g}, cost "
                            f"{autoplan_svc.cost_text(result.cost, result.cost_unit)} vs "
                            f"{autoplan_svc.cost_text(result.baseline_cost, result.cost_unit)} in BF16 "
                            f"({result.cost / result.baseline_cost:.0%}). Verification: score job #{job.id} "
                            "(Results page shows predicted vs measured).",
                            list(result.notes), pd.Series(result.plan).value_counts().to_dict())
                        said = (f"Saved the automatic plan {plan.label}" if plan.id not in before
                                else f"The automatic plan is {plan.label}, saved before: no new version")
                        said += f" (verification: score job #{job.id})"
                        if unsaved:  # the page would otherwise load the automatic plan over the user's edits
                            said += ". Your unsaved changes above are kept: choose it under Start from to open it"
                        state.plan_saved(said, None if unsaved else plan.name)
        else:
            st.caption(auth.cannot("queue"))
        if outcome := st.session_state.pop(AUTO_OUTCOME, None):  # the plan chosen in the run before
            said, notes, counts = outcome
            st.success(said)
            for note in notes:
                st.caption(note)
            st.dataframe(pd.Series(counts, name="layers"), width="content")
    scored = [s for s in scoring_svc.list_scores(model.id) if s.predicted_kl is not None]
    if scored:
        st.dataframe(pd.DataFrame([{"plan": s.plan_label, "predicted KL": s.predicted_kl, "measured KL": s.kl_mean,
                                    "top-1": s.top1_agree} for s in scored]), hide_index=True, width="stretch")

    st.subheader("Export")
    plans = sorted(plans_svc.list_plans(model.id), key=lambda p: p.id)  # again: the automatic plan may have saved one
    if not plans:
        st.info("Save a plan first; then export it for llm-compressor, compressed-tensors or vLLM.")
    else:
        _export(model, plans)
    _import(model)


EXPORT_FILES = {"llmcompressor": "recipe.yaml", "compressed-tensors": "quantization_config.json", "vllm": "serve.sh"}


def _export(model, plans) -> None:
    c1, c2 = st.columns(2)
    ids = [p.id for p in plans]
    # the newest version, also after one is saved in this browser session (the key changes with it)
    plan_id = c1.selectbox("Plan", ids, index=len(ids) - 1, format_func={p.id: p.label for p in plans}.get,
                           key=f"export_plan_{ids[-1]}")
    fmt = c2.selectbox("Format", list(exchange_svc.EXPORT_FORMATS), key="export_fmt")
    plan = next(p for p in plans if p.id == plan_id)
    files = {f: f"{plan.name}-v{plan.version}-{ext}" for f, ext in EXPORT_FILES.items()}
    try:  # the vLLM script's compression step reads the recipe under the name its Download button gives it
        text = exchange_svc.export_plan(model, plan.body, fmt, recipe_file=files["llmcompressor"], plan=plan)
    except ValueError as exc:
        st.error(str(exc))
        return
    for warning in serving_svc.serving_warnings(model, plan.body):
        st.warning(warning)
    lang = {"llmcompressor": "yaml", "compressed-tensors": "json", "vllm": "bash"}[fmt]
    st.code(text, language=lang, wrap_lines=True)  # long lines wrap; its copy button copies them whole
    st.download_button("Download", text, file_name=files[fmt], key="export_download")


def _import(model) -> None:
    if not auth.may("save_plan"):  # a viewer is offered no import that would be refused
        return
    up = st.file_uploader("Import a plan (.yaml plan or llm-compressor recipe, .json compressed-tensors config)",
                          type=["yaml", "yml", "json"], key="import_plan")
    if up is not None and st.button("Import", key="import_btn"):
        try:
            rec, new = exchange_svc.import_plan(model, up.name, up.getvalue())  # bytes: the loader tells binary
        except ValueError as exc:
            st.error(str(exc))
        else:
            said = f"Imported {rec.label}" if new else f"{up.name} holds {rec.label} already: no new version"
            note = exchange_svc.import_note(up.name)
            state.plan_saved(said + (f". Note: {note}" if note else ""), rec.name)
