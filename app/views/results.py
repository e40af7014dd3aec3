"""Results: how far a plan's model is from the unquantized one (KL, top-1, perplexity), and which layer is
to blame (one-at-a-time sensitivity)."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from app import auth, fixes_panel, forms, frames, live, plan_tools, state
from app import text as page_text
from app.charts import results as result_charts
from jobs.specs import CAL_SAMPLES, CAL_SEQ_LEN, QUICK_SWEEP_SAMPLES, SAMPLES, SCORED_SEQ_LEN, SHARDS, ScoreSpec
from quantcore.evaluation.kvcache import KV_FORMATS
from quantplan.services import datasets as datasets_svc
from quantplan.services import jobs as jobs_svc
from quantplan.services import kernels as kernels_svc
from quantplan.services import models as models_svc
from quantplan.services import plans as plans_svc
from quantplan.services import predictions as predictions_svc
from quantplan.services import queue as queue_svc
from quantplan.services import scoring as scoring_svc
from quantplan.services import serving as serving_svc
from quantplan.services import sweeps as sweeps_svc
from quantplan.services.errors import Refused
from store.records import ModelRecord, ScoreRecord

st.title("Results")
model = state.current_model()
if model is None:
    st.stop()
if model.causal_lm is False:
    st.info(f"{model.name} is a {model.architecture} ({model.model_type}), not a causal language model: scores and "
            "sensitivity sweeps compare next-token distributions with the unquantized model's, and it predicts no "
            "next token. Its calibration statistics (Outliers), plans and export work as for any model.")
    st.stop()

presets = page_text.preset_options(model)
plans = plans_svc.list_plans(model.id)
scores = scoring_svc.list_scores(model.id)  # newest first
# the sections below the comparison, built only once their expander is opened (st.expander(..., on_change="rerun"))
TRADEOFF_OPEN, SWEEP_ROWS_OPEN, BY_SCHEME_OPEN = ("results_tradeoff_open", "results_sweep_rows_open",
                                                  "results_by_scheme_open")
SCORE_OPEN = "results_score_open"  # the score form, built once its expander is opened (open while nothing is scored)
STATISTICS_OPEN = "results_statistics_open"  # the compared scores' statistics, in the comparison's fragment
SAID = f"results_said_{model.id}"  # (kind, text) of what the last Queue did, shown below the form


def say(kind: str, text: str) -> None:
    st.session_state.setdefault(SAID, []).append((kind, text))


def last_sizes(model: ModelRecord) -> tuple[int, int]:
    """The score form's sequences and tokens each while it is not built: as last queued for this model in this session
    (the form's defaults before), as the form would show them."""
    kept = forms.last("score", model.id)
    return (int(kept.get("samples", ScoreSpec.samples)),
            min(int(kept.get("seq_len", ScoreSpec.seq_len)), int(SCORED_SEQ_LEN.within(model.context).most)))


def score_form(model: ModelRecord) -> tuple[int, int]:
    """The score form: a score job for each plan or preset chosen, and the sweeps asked beside them; the sequences and
    tokens each it shows."""
    with st.form("score_form", enter_to_submit=False):  # Enter in a field queues no job
        st.markdown("**Score a plan** against the unquantized model on held-out text (default: gensim's lee.cor, "
                    "50 news articles). The reference log-probabilities are computed once and cached.")
        c1, c2, c3, c4 = st.columns([3, 1, 1, 1])
        options = [f"preset:{p}" for p in presets] + [f"plan:{p.id}" for p in plans]
        labels = {f"preset:{k}": k for k in presets} | {f"plan:{p.id}": f"plan {p.label}" for p in plans}
        kept = forms.last("score", model.id)  # what was last queued for this model in this session
        chosen_plans = c1.multiselect("Plans (one score job each, scored on the same tokens)", options,
                                      default=[w for w in kept.get("what", []) if w in options]
                                      or [scoring_svc.default_score_choice(plans, (s.plan_id for s in scores))],
                                      format_func=labels.get,
                                      key=f"score_what_{model.id}")  # keyed per model: its plans are its own
        # the job spec's own bounds (jobs.specs), a sequence no longer than the model's context: as the CLI checks them
        shown_samples, shown_seq_len = last_sizes(model)  # what the form offers and a closed form stands for
        samples = c2.number_input("Sequences", *SAMPLES.form_bounds(), shown_samples, key="score_samples")
        tokens, cal_tokens = SCORED_SEQ_LEN.within(model.context), CAL_SEQ_LEN.within(model.context)
        seq_len = c3.number_input("Tokens each", *tokens.form_bounds(), shown_seq_len, step=16,
                                  key=f"score_seq_len_{tokens.most}")
        device = c4.selectbox("Device", ["cpu", "cuda"], index=["cpu", "cuda"].index(kept.get("device", "cpu")),
                              key="score_device")
        with st.expander("What each preset does", key="score_explainer", on_change="rerun") as explained:
            if explained.open:  # built when opened: its tables are most of what a browser draws for this page
                plan_tools.scheme_explainer()  # the table the Plans page's rules editor reads too, by family
            st.caption("GPTQ: the `*_GPTQ` presets keep their format's grid and scales but choose each weight's grid "
                       "point to keep the layer's output close on the calibration text (under Texts below; "
                       f"{ScoreSpec.cal_samples} × {ScoreSpec.cal_seq_len} tokens of the built-in one by default), as "
                       "llm-compressor's GPTQModifier does; the others round to nearest. On SmolLM2, "
                       "W4A16 scores KL 0.81 and W4A16_GPTQ 0.36, NVFP4A16 0.36 and NVFP4A16_GPTQ 0.16. Each "
                       "rounded layer is kept: a later score or sweep that would round it the same way (same scheme "
                       "and fusion group, calibration text and statistics) reads it instead.")
            st.caption("AWQ: the `*_AWQ` presets round to nearest, after scaling each input channel by a factor "
                       "searched on the calibration text and folded into the norm or projection before the layer, "
                       "as llm-compressor's AWQModifier does (the exported recipe carries one). An o_proj under "
                       "grouped-query attention and lm_head have nothing to fold into and stay unscaled. On SmolLM2's "
                       "30 down_proj, W4A16 scores KL 0.23, W4A16_GPTQ 0.14 and W4A16_AWQ 0.105; on every layer but "
                       "lm_head GPTQ wins (0.31 against 0.43): sweep both and let the automatic plan choose per layer.")
        eval_texts, cal_texts = datasets_svc.datasets_for("evaluation"), datasets_svc.datasets_for("calibration")
        eval_sets, cal_sets = [None] + [d.id for d in eval_texts], [None] + [d.id for d in cal_texts]
        names = {d.id: d.name for d in eval_texts + cal_texts}
        with st.expander("Texts: what is scored, and what GPTQ, AWQ and the KV cache scales are calibrated on"):
            e1, e2, e3, e4 = st.columns([2, 2, 1, 1])
            eval_id = e1.selectbox("Evaluation text", eval_sets, key="score_eval_text",
                                   format_func=lambda i: "built-in: lee.cor (50 news articles)" if i is None
                                   else names[i])
            cal_id = e2.selectbox("Calibration text", cal_sets, key="score_cal_text",
                                  format_func=lambda i: "built-in: lee_background.cor (300 articles)" if i is None
                                  else names[i])
            cal_samples = e3.number_input("Calibration sequences", *CAL_SAMPLES.form_bounds(),
                                          kept.get("cal_samples", ScoreSpec.cal_samples),
                                          key="score_cal_samples")
            cal_seq_len = e4.number_input("Tokens each", *cal_tokens.form_bounds(),
                                          min(kept.get("cal_seq_len", ScoreSpec.cal_seq_len), cal_tokens.most), step=16,
                                          key=f"score_cal_seq_len_{cal_tokens.most}")
            st.caption("The calibration text is never the evaluation text. GPTQ's result depends on it: on SmolLM2, "
                       "leaving out one of the 16 default sequences moves W4A16_GPTQ's KL by up to 6 %, and 8 "
                       "sequences instead of 16 raise it by a third; llm-compressor's examples calibrate on 512.")
            cal_upload = st.file_uploader("…or upload a calibration text (.txt / .jsonl with a 'text' field): "
                                          "stored, and listed above from then on", type=["txt", "jsonl"],
                                          key="score_cal_upload")
        k1, k2 = st.columns([3, 1])
        kv_choice = k1.selectbox(
            "KV cache", ["(as planned)", *KV_FORMATS], key="score_kv",
            index=["(as planned)", *KV_FORMATS].index(kept.get("kv", "(as planned)")),
            help="Also store K and V in this format while scoring (replaces a plan's own kv_cache; presets plan none). "
                 + " ".join(f"{k}: {f.description}." for k, f in KV_FORMATS.items()))
        tp_choice = k2.selectbox(
            "GPUs (tensor parallel)", ["(as planned)", *range(1, 9)], key="score_tp",
            index=["(as planned)", *range(1, 9)].index(kept.get("tp", "(as planned)")),
            help="Score (and sweep) as served on this many GPUs (replaces a plan's own tensor_parallel; presets plan "
                 "one). Each GPU quantizes its share of a row-parallel layer's input (o_proj, down_proj) on its own "
                 "dynamic per-tensor or per-token scale, which a single GPU's score overstates the error of; static, "
                 "group and weight-only scales are the same on any number of GPUs.")
        sens = st.checkbox("Also run a per-layer sensitivity sweep with each chosen preset (one fusion group at a "
                           "time, on the GPUs above: an automatic plan for that many GPUs reads it)", key="score_sens")
        fisher = st.checkbox("... as the fast Fisher estimate of every unit (a few backward passes) instead of the "
                             "exact sweep (docs: concepts/sensitivity)", key="score_sens_fisher")
        kv_sens = st.checkbox("Also sweep the chosen KV cache format one attention layer at a time (which layers a "
                              "plan should keep in BF16)", key="score_kv_sens")
        run_as = st.selectbox("Run the model (scores)", list(page_text.STREAM_CHOICES), key="score_stream",
                              index=list(page_text.STREAM_CHOICES).index(kept["run_as"]) if "run_as" in kept else 0,
                              help=page_text.STREAM_HELP)
        shards = st.number_input(
            "Sweep shards (0: one per live worker)", 0, int(SHARDS.most), 0, key="score_shards",
            help="A sweep's units split into this many tasks that the queue's workers run side by side, merged into "
                 "one sweep with the same rows as one task's; 0 takes one per live worker on the queue, 1 one task.")
        st.caption("Cost: " + forms.cost_note("score", device, model, len(chosen_plans or [None]) * int(samples)
                                              * int(seq_len), "tokens", forms.tokens_of)
                   + " At the values shown, over every plan chosen (a score job each).")
        if st.form_submit_button("Queue", type="primary"):
            st.session_state[SAID] = []  # this submission's outcome replaces the last one's
            forms.remember("score", model.id, {
                "what": chosen_plans, "samples": int(samples), "seq_len": int(seq_len), "device": device,
                "cal_samples": int(cal_samples), "cal_seq_len": int(cal_seq_len), "kv": kv_choice, "tp": tp_choice,
                "run_as": run_as})
            if not chosen_plans:
                say("error", "Choose at least one plan or preset to score.")
            cal_ok = True
            if cal_upload is not None:
                try:
                    cal_id = datasets_svc.upload_dataset(cal_upload.name, cal_upload.getvalue(), "calibration").id
                except ValueError as exc:
                    say("error", f"The calibration text was not stored, so nothing was queued: {exc}")
                    cal_ok = False
            if tp_choice != "(as planned)":
                refusals = serving_svc.split_refusals(model, int(tp_choice))
            else:  # each stored plan at its own tensor_parallel (a plan file imported for another model may not split)
                by_id = {p.id: p for p in plans}
                refusals = [f"plan {by_id[int(ref)].label}: {why}" for what in chosen_plans
                            for kind, _, ref in [what.partition(":")] if kind == "plan"
                            for why in serving_svc.plan_split_refusals(model, by_id[int(ref)].body)]
            if refusals:
                say("error", "Nothing was queued: " + "; ".join(refusals))
            if cal_ok and not refusals:
                params = {"samples": int(samples), "seq_len": int(seq_len), "device": device,
                          "cal_samples": int(cal_samples), "cal_seq_len": int(cal_seq_len)}
                if eval_id is not None:
                    params["dataset"] = eval_id
                if cal_id is not None:
                    params["cal_dataset"] = cal_id
                if kv_choice != "(as planned)":
                    params["kv_cache"] = kv_choice
                if tp_choice != "(as planned)":
                    params["tensor_parallel"] = int(tp_choice)
                stream = page_text.STREAM_CHOICES[run_as]  # scores only: a sweep runs whole
                scored = {**params, **({"stream": stream} if stream is not None else {})}
                for what in chosen_plans:
                    kind, _, ref = what.partition(":")
                    if kind == "preset":
                        job = queue_svc.submit("score", {**scored, "scheme": ref}, model_id=model.id)
                    else:
                        job = queue_svc.submit("score", scored, model_id=model.id, plan_id=int(ref))
                    gpus_note = f" on {plans_svc.gpus_label(int(tp_choice))}" if "tensor_parallel" in params else ""
                    kv_note = (f" + KV {kv_choice}" if "kv_cache" in params else "") + gpus_note
                    say("success", f"Queued score job #{job.id} ({labels[what]}{kv_note}).")
                    if sens and kind == "preset":  # swept on the same GPUs: what an automatic plan for them reads
                        sweep = {**params, "samples": min(int(samples), QUICK_SWEEP_SAMPLES), "scheme": ref}
                        one_gpu = sweeps_svc.same_on_any_gpus(ref, int(params.get("tensor_parallel", 1)))
                        if one_gpu:
                            sweep.pop("tensor_parallel")
                        if shards and not fisher:
                            sweep["shards"] = int(shards)
                        if fisher:
                            sweep["method"] = "fisher"
                        sj = queue_svc.submit("sensitivity", sweep, model_id=model.id)
                        say("success", f"Queued sensitivity job #{sj.id} ({ref}{'' if one_gpu else gpus_note})."
                                   + (f" {one_gpu}." if one_gpu else ""))
                if sens and any(not w.startswith("preset:") for w in chosen_plans):
                    say("warning", "A sensitivity sweep takes one preset: stored plans were scored, not swept.")
                if kv_sens and kv_choice in ("(as planned)", "AUTO"):
                    say("warning", "A KV cache sweep needs a quantized format: choose one under KV cache.")
                elif kv_sens:
                    sweep = {k: v for k, v in params.items() if k not in ("kv_cache", "tensor_parallel")}
                    sj = queue_svc.submit("sensitivity", {**sweep, "samples": min(int(samples), QUICK_SWEEP_SAMPLES),
                                                          "kv_sweep": kv_choice, **({"shards": int(shards)} if shards
                                                                                    else {})},
                                    model_id=model.id)
                    say("success", f"Queued KV cache sweep job #{sj.id} ({kv_choice}).")
    return int(samples), int(seq_len)


if auth.may("queue"):
    # built once opened (open while nothing is scored): its widgets were most of what a browser drew before the
    # first chart (docs/results/page-speed.md, session 8); what was last queued is kept (app.forms)
    score_box = st.expander("Score a plan or preset, and sweep its layers' sensitivity", key=SCORE_OPEN,
                            on_change="rerun", expanded=not scores)
    with score_box:
        samples, seq_len = score_form(model) if score_box.open else last_sizes(model)
else:
    st.caption(auth.cannot("queue"))

for kind, text in st.session_state.get(SAID, []):  # kept until the next Queue: the page redraws when a job ends
    getattr(st, kind)(text)

live.job_progress("results", ["score", "sensitivity"], model_id=model.id,
                  done_notes={"score": "Scored plans below.", "sensitivity": "Per-layer sensitivity below."})

# the form's sizes (a viewer has no form: the cache it would reuse is not theirs to size)
kept = scoring_svc.reference_cache_bytes(model, int(samples), int(seq_len)) if auth.may("queue") else None
if kept:
    kind, size = kept
    what = (f"every log-probability of a {models_svc.vocab_size(model):,}-token vocabulary in float16"
            if kind == "full" else f"the {kind} log-probabilities and as many sampled tail tokens a position, "
            "a KL exact over the top tokens with a stated bound on the rest")
    st.caption(f"The unquantized model's predictions on {int(samples)} × {int(seq_len)} tokens (the form's "
               "sizes as last submitted, its defaults before) are computed once per model and text and cached: "
               f"{size / 2**20:,.1f} MiB on disk ({int(samples) * (int(seq_len) - 1):,} positions, {what}).")

st.subheader(f"Scored plans ({len(scores)})")
if not scores:
    st.info("Nothing scored yet for this model.")
else:
    def statistics_body(chosen: list[ScoreRecord]) -> None:
        """The compared scores' statistics as llama-perplexity prints them, built only while their expander is open."""
        st.caption("± one standard error, with each evaluation sequence an independent block (tokens along a sequence "
                   "are correlated; an error over tokens as if independent would be too small); percentiles by linear "
                   "interpolation. — : a figure the score was stored without (scored before it was kept).")
        for s in chosen:
            st.code(f"#{s.job_id} {s.plan_label}\n"
                    + "\n".join(scoring_svc.statistics_lines({**s.metrics(), **s.statistics()})),
                    language=None, wrap_lines=True)

    @st.fragment
    def compare_section() -> None:  # choosing the scores compared reruns this section alone
        picked = st.multiselect("Compare", [s.job_id for s in scores], default=scoring_svc.default_comparison(scores),
                                format_func=lambda j: next(f"#{s.job_id} {s.plan_label}" for s in scores
                                                           if s.job_id == j),
                                key=f"results_compare_{model.id}")  # keyed per model: its picks are its own job ids
        chosen = [s for s in scores if s.job_id in picked]
        if len(chosen_sets := scoring_svc.score_sets(chosen)) > 1:
            st.warning("These scores were measured on different tokens ("
                       + "; ".join(f"{text}, {n:,} positions" for text, n in chosen_sets)
                       + "): their KLs, perplexities and curves are not comparable. Compare scores of one text and "
                         "size.")
        if chosen:
            cols = st.columns(len(chosen[:4]))
            for col, s in zip(cols, chosen[:4], strict=False):
                col.metric(s.plan_label, f"KL {scoring_svc.pm_text(s.kl_mean, s.kl_mean_err)}",
                           f"top-1 {scoring_svc.pm_text(s.top1_agree, s.top1_agree_err, '.3f')}", delta_color="off",
                           delta_arrow="off")
                col.caption(f"perplexity {s.ppl_ref:.2f} → {s.ppl:.2f} · p99 KL {s.kl_p99:.3g} · max {s.kl_max:.3g}"
                            + (f" · KV cache {s.kv_cache}" if s.kv_cache != "AUTO" else ""))
            for s in chosen:
                for note in scoring_svc.score_notes(model, s):
                    st.warning(f"#{s.job_id} {s.plan_label}: {note}")
            hist, pos = frames.score_frames(chosen)  # the page's first charts, before the details
            if not hist.empty:
                state.chart(("kl_distribution", *state.frame_key(hist)),
                            lambda: result_charts.kl_distribution_chart(hist), width="stretch")
            if not pos.empty:
                state.chart(("kl_by_position", *state.frame_key(pos)), lambda: result_charts.kl_by_position_chart(pos),
                            width="stretch")
            stats_box = st.expander("Statistics with their errors (as llama-perplexity --kl-divergence prints them)",
                                    key=STATISTICS_OPEN, on_change="rerun")
            with stats_box:
                if stats_box.open:  # built when opened: each code block is highlighted in the browser, which cost a
                    statistics_body(chosen)  # visit more main-thread time than the charts below (page-speed.md)
            if len(chosen) >= 2:
                st.markdown("**Compare two plans**")
                q1, q2, q3 = st.columns([2, 2, 1])
                ids = [s.job_id for s in chosen]
                label_of = {s.job_id: f"#{s.job_id} {s.plan_label}" for s in chosen}
                among = "_".join(map(str, ids))  # keyed by the scores compared: a new choice starts from its first two
                first = q1.selectbox("A", ids, index=0, format_func=label_of.get, key=f"results_pair_a_{among}")
                second = q2.selectbox("B", ids, index=1, format_func=label_of.get, key=f"results_pair_b_{among}")
                figure = q3.selectbox("on", list(scoring_svc.PAIRED_FIGURES),
                                      format_func=lambda f: scoring_svc.PAIRED_FIGURES[f][2], key="results_pair_figure")
                if first == second:
                    st.info("Choose two different scores to compare.")
                else:
                    a, b = (next(s for s in chosen if s.job_id == j) for j in (first, second))
                    try:
                        verdict = scoring_svc.compare_scores(a, b, figure)
                    except Refused as exc:
                        st.warning(str(exc))
                    else:
                        (st.success if verdict.better else st.info)(verdict.verdict)
                        st.caption("Two scores on the same evaluation tokens are compared sequence by sequence (the "
                                   "paired difference: what makes a passage hard makes it hard for both plans, and "
                                   "cancels), far sharper than two separate errors.")
            with_pred = [s for s in chosen if s.predicted_kl is not None]
            for s in with_pred:
                st.caption(f"#{s.job_id} {s.plan_label}: predicted KL (sum of per-layer KL) {s.predicted_kl:.4g}, "
                           f"measured {scoring_svc.pm_text(s.kl_mean, s.kl_mean_err)}")

    compare_section()
    ran = jobs_svc.jobs_by_id(s.job_id for s in scores)  # who asked for each score, and where it ran
    table = pd.DataFrame([{"job": s.job_id, "plan": s.plan_label,
                           "KL ± error": scoring_svc.pm_text(s.kl_mean, s.kl_mean_err),
                           "top-1": scoring_svc.pm_text(s.top1_agree, s.top1_agree_err, ".3f"),
                           "when": page_text.ago(s.created_at),
                           "asked by": (ran[s.job_id].requested_by or "") if s.job_id in ran else "",
                           "device": (ran[s.job_id].device or "") if s.job_id in ran else "",
                           "KV cache": s.kv_cache, **s.metrics(),
                           "ln(PPL(Q)/PPL(base))": scoring_svc.pm_text(s.ln_ppl_ratio, s.ln_ppl_ratio_err),
                           "predicted KL": s.predicted_kl, "text": s.dataset, "positions": s.tokens,
                           "calibrated on": s.details.get("calibration"),  # GPTQ / KV scales; None: not needed
                           "scored": page_text.utc_text(s.created_at)} for s in scores])
    optional = ["predicted KL", "calibrated on"]  # shown where some score has one, blank (not "None") where not
    table = table.drop(columns=[c for c in optional if table[c].isna().all()])
    if "calibrated on" in table:
        table["calibrated on"] = table["calibrated on"].fillna("")
    # below the comparison, whose charts a visit draws first (page-speed.md, session 8); the key columns only,
    # visible at 1400 px (app.frames.SCORE_KEY_COLUMNS); a selected row shows the rest
    chosen_row = st.dataframe(table, hide_index=True, width="stretch", column_order=frames.SCORE_KEY_COLUMNS,
                              key=f"results_scores_{model.id}", on_select="rerun", selection_mode="single-row",
                              column_config={"plan": st.column_config.TextColumn(width=220),
                                             "KL ± error": st.column_config.TextColumn(width=150),
                                             "top-1": st.column_config.TextColumn(width=130),
                                             "when": st.column_config.TextColumn(width=90, help=page_text.AGO_HELP),
                                             "asked by": st.column_config.TextColumn(width=80),
                                             "device": st.column_config.TextColumn(width=150)})
    st.caption("Select a row for the rest of the score: KV cache, KL percentiles, perplexity, text, positions, "
               "calibration and the UTC time it was stored.")
    if chosen_row is not None and chosen_row.selection.rows:
        i = chosen_row.selection.rows[0]
        row = table.iloc[i]
        with st.container(border=True):
            st.markdown(f"**#{row['job']} {row['plan']}** · scored {page_text.ago_html(scores[i].created_at)} "
                        f"({row['scored']})", unsafe_allow_html=True)
            rest = row.drop(labels=["job", "scored", *frames.SCORE_KEY_COLUMNS])
            st.dataframe(rest.rename("value").astype(str).to_frame(), width="stretch")
    fixes_panel.render(scores)  # plans that differ only in the outlier fix, side by side (issue #46)

    verified = predictions_svc.verified_predictions(model)  # every automatic plan of this architecture family
    if verified:
        st.subheader("Predicted against measured")
        predicted = pd.DataFrame([v.to_dict() for v in verified])
        state.chart(("prediction", *state.frame_key(predicted)), lambda: result_charts.prediction_chart(predicted),
                    width="stretch")  # built once per set of verified plans (app.state.chart)
        fits = {m: predictions_svc.correction_for(model, m) for m in ("fisher", "kl")}
        st.caption(f"Every verified automatic plan of a {model.architecture} model. The next automatic plan's search "
                   "corrects its prediction by them: " + "; ".join(
                       f"from {'Fisher estimates' if m == 'fisher' else 'exact sweeps'}, {fit.text()}"
                       for m, fit in fits.items() if fit is not None) + ".")

    @st.fragment
    def tradeoff_section(model: ModelRecord) -> None:
        """Quality against cost: built, and its chart and table sent, only once its expander is opened (a page
        visit draws the charts above first); its controls rerun this section alone."""
        st.subheader("Quality against cost")
        box = st.expander("Each plan's KL against a cost: weights, KV cache, step times, serving memory",
                          key=TRADEOFF_OPEN, on_change="rerun")
        with box:
            if box.open:
                tradeoff_body(model)

    def tradeoff_body(model: ModelRecord) -> None:
        sets = scoring_svc.score_sets(scores)
        eval_set = sets[0]
        if len(sets) > 1:
            eval_set = st.selectbox("Scored on", sets, format_func=lambda t: f"{t[0]} · {t[1]:,} positions",
                                    key="tradeoff_set")
        costs = {"weight_mib": "linear weights (MiB)"}
        if any(s.kv_cache != "AUTO" for s in scores):
            costs["kv_kib"] = "KV cache per token (KiB)"
        device_name = m_prefill = m_decode = None
        c1, c2, c3, c4 = st.columns([2, 2, 1, 1])
        target = c2.selectbox("Ideal step times (roofline) on", [None, *serving_svc.target_names()],
                              format_func=lambda k: "(none)" if k is None else serving_svc.target_names()[k],
                              key="tradeoff_target")
        ideal_decode = int(c3.number_input("ideal decode batch", 1, 65536, 1, key="tradeoff_ideal_decode",
                                           help="M of the roofline decode step; measured steps use the M timed"))
        ideal_prefill = int(c4.number_input("ideal prefill tokens", 1, 1 << 20, 2048, key="tradeoff_ideal_prefill",
                                            help="M of the roofline prefill step; measured steps use the M timed"))
        if target:
            costs |= {"ideal_decode_ms": f"ideal decode step on {target}, M={ideal_decode} (ms)",
                      "ideal_prefill_ms": f"ideal prefill step on {target}, M={ideal_prefill} (ms)"}
        kernel_names = sorted({d[1] for d in kernels_svc.kernel_devices()})
        device_name = c1.selectbox("Measured step times from the kernel timings of", [None, *kernel_names],
                                   format_func=lambda d: "(none)" if d is None else d, key="tradeoff_device")
        measured = kernels_svc.measured_ms(model, kernels_svc.kernel_records(device_name)) if device_name else []
        if measured:
            m_prefill, m_decode = max(measured), min(measured)
            costs |= {"decode_ms": f"decode step on {device_name}, M={m_decode} (ms)",
                      "prefill_ms": f"prefill step on {device_name}, M={m_prefill} (ms)"}
            st.caption(f"Measured steps are at the M values {device_name} timed ({', '.join(map(str, measured))}): "
                       f"prefill at the largest, M={m_prefill}, decode at the smallest, M={m_decode}. Queue a "
                       "benchmark with other M values on the Kernels page to weigh other steps.")
        elif device_name:
            st.caption(f"{device_name} has no timings of {model.name}'s shapes.")
        c1, c2, _ = st.columns([1, 1, 2])
        serve = (int(c1.number_input("serving: sequences", 1, 1 << 16, 16, key="tradeoff_serve_batch")),
                 int(c2.number_input("× tokens of context", 1, 1 << 21, 4096, step=1024, key="tradeoff_serve_context")))
        costs["serving_gib"] = f"weights + KV cache of {serve[0]:,} × {serve[1]:,} tokens (GiB)"
        cost = st.radio("Cost", list(costs), format_func=costs.get, horizontal=True, key="tradeoff_cost")
        on_set = [s for s in scores if (s.dataset, s.tokens) == eval_set]
        trade = scoring_svc.with_front(scoring_svc.tradeoff_frame(model, on_set,
                                                                  device_name=device_name, m_prefill=m_prefill,
                                                                  m_decode=m_decode, target=target,
                                                                  ideal_m_prefill=ideal_prefill,
                                                                  ideal_m_decode=ideal_decode, serve=serve),
                                        cost, on_set)
        st.caption("The newest score of each plan on this text, its KL with an error bar of ± two standard errors. A "
                   "plan is **on the front** when no other plan has both a lower KL and a lower cost, and its KL is "
                   "distinguishably lower (beyond two standard errors of the difference, paired on the same tokens) "
                   "than that of every cheaper plan on the front: the plans worth choosing between. Measured times are "
                   "the sum of "
                   "the plan's measured GEMMs (Kernels page), shown only when every layer has a time at that M; a "
                   "scheme with no kernel path measured (MX, NVFP4, W4AFP8) counts at the baseline GEMM's time. Ideal "
                   "times "
                   "are the roofline bound on a GPU from its datasheet: each linear's weight read at the memory "
                   "bandwidth or its math at the peak of the precision the GPU runs natively, whichever is longer "
                   "(a decode step is bound by the weights, a prefill by the math); a real engine gets less. Serving "
                   "memory "
                   "is every weight (the plan's linear weights, the rest in BF16) plus the KV cache of that many "
                   "sequences of that many tokens in the format each plan was scored with: the cost where a KV format "
                   "pays off. Every cost here is the whole model's on one GPU, whatever GPUs a plan is for, so plans "
                   "compare on one footing; the Plans page shows one GPU's share of a plan split over several.")
        state.chart(("tradeoff", cost, costs[cost], *state.frame_key(trade)),
                    lambda: result_charts.tradeoff_chart(trade, cost, costs[cost]), width="stretch")
        no_cost = trade.loc[trade[cost].isna(), "plan"].tolist()
        if no_cost:
            why = {"prefill_ms": " (a layer of the plan has no timing at that M: skipped over budget, not supported or "
                                 "not measured; the Kernels page lists the cases)",
                   "ideal_prefill_ms": f" (a scheme {target} cannot serve, such as W4AFP8 off Hopper)"}
            why["decode_ms"], why["ideal_decode_ms"] = why["prefill_ms"], why["ideal_prefill_ms"]
            st.caption(f"Not drawn, no {costs[cost]}: {', '.join(no_cost)}{why.get(cost, '')}.")
        shown = trade.drop(columns=([] if device_name else ["prefill_ms", "decode_ms"])
                           + ([] if target else ["ideal_prefill_ms", "ideal_decode_ms"]))
        st.dataframe(shown, hide_index=True, width="stretch",
                     column_config={"kl_mean": st.column_config.NumberColumn("KL mean", format="%.5f"),
                                    "kl_mean_err": st.column_config.NumberColumn("± error", format="%.2g",
                                                                                 help="standard error of the KL mean; "
                                                                                      "blank: scored before errors"),
                                    "top1_agree": st.column_config.NumberColumn("top-1 agree", format="%.4f"),
                                    "ppl": st.column_config.NumberColumn("perplexity", format="%.2f"),
                                    "front": st.column_config.CheckboxColumn("on the front"),
                                    "weight_mib": st.column_config.NumberColumn("weights MiB", format="%.1f"),
                                    "weight_ratio": st.column_config.NumberColumn("of BF16", format="%.3f"),
                                    "kv_cache": st.column_config.TextColumn("KV cache"),
                                    "kv_kib": st.column_config.NumberColumn("KV KiB / token", format="%.2f"),
                                    "serving_gib": st.column_config.NumberColumn(
                                        f"serving GiB ({serve[0]:,} × {serve[1]:,})", format="%.2f"),
                                    "prefill_ms": st.column_config.NumberColumn("prefill ms", format="%.4f"),
                                    "decode_ms": st.column_config.NumberColumn("decode ms", format="%.4f"),
                                    "ideal_prefill_ms": st.column_config.NumberColumn(
                                        f"ideal prefill ms (M={ideal_prefill})", format="%.4f"),
                                    "ideal_decode_ms": st.column_config.NumberColumn(
                                        f"ideal decode ms (M={ideal_decode})", format="%.4f")})

    tradeoff_section(model)

st.subheader("Per-layer sensitivity")
sweeps = sweeps_svc.sensitivity_jobs(model.id)
if not sweeps:
    st.info("No sensitivity sweep yet: tick its box in the score form above (\"Score a plan or preset\") to queue one "
            "with a preset.")
    st.stop()
sweep_id = st.selectbox("Sweep", [j.id for j in sweeps],
                        format_func=lambda i: next(f"job #{j.id} · {sweeps_svc.sweep_label(j)} · "
                                                   f"{(j.result or {}).get('units', '?')} units" for j in sweeps
                                                   if j.id == i), key="results_sweep")
rows = sweeps_svc.sensitivity_rows(sweep_id)
stale = sweeps_svc.stale_sweeps(model).get(sweep_id)
if stale:
    st.warning(stale[1][0].upper() + stale[1][1:])
df = pd.DataFrame([{"layer": r.unit, "kl": r.kl_mean, "± error": scoring_svc.err_text(r.kl_mean_err),
                    "top1_agree": r.top1_agree, "sqnr_db": r.sqnr_db,
                    "proj": sweeps_svc.unit_block_proj(r.layers)[1]} for r in rows])
state.chart(("sensitivity", sweep_id), lambda: result_charts.sensitivity_chart(df[["layer", "kl", "proj"]]),
            width="stretch")  # a finished sweep's rows never change
rows_box = st.expander("The sweep's rows: KL, top-1 agreement and SQNR of each unit", key=SWEEP_ROWS_OPEN,
                       on_change="rerun")
with rows_box:
    if rows_box.open:  # the table is built and drawn only once opened
        st.dataframe(df, hide_index=True, width="stretch",
                     column_config={"kl": st.column_config.NumberColumn("KL mean", format="%.3e",
                                                                        help="with only this unit quantized"),
                                    "top1_agree": st.column_config.NumberColumn("top-1 agree", format="%.4f"),
                                    "sqnr_db": st.column_config.NumberColumn(
                                        "SQNR dB", format="%.1f",
                                        help="of the unit's output, quantized against unquantized"),
                                    "proj": st.column_config.TextColumn("projection")})
if left_out := (next(j for j in sweeps if j.id == sweep_id).result or {}).get("not_swept"):
    st.caption(f"Not swept: {len(left_out)} layer(s) ({', '.join(left_out[:3])}{', …' if len(left_out) > 3 else ''}) "
               "that no llm-compressor recipe can smooth (its Llama-style mappings smooth q/k/v_proj, gate/up_proj "
               "and down_proj only), so no served checkpoint would hold the SmoothQuant measured there. The "
               "automatic plan gives them a scheme without SmoothQuant; sweep one (e.g. INT8_W8A8) for their KL.")

counts = sweeps_svc.sweep_gpu_counts(model)
by_scheme = sweeps_svc.sensitivity_by_scheme(model)  # one GPU's: the panels drawn unless another count is chosen
if len(counts) > 1 or by_scheme["scheme"].nunique() >= 2:
    st.subheader("Every swept scheme side by side")
    side_at = counts[0]
    if len(counts) > 1:  # swept on several GPUs too: the panels a plan for as many reads
        side_at = st.selectbox("As served on", counts, format_func=lambda c: plans_svc.gpus_label(*c),
                               key="results_side_gpus")
    if side_at != counts[0]:
        by_scheme = sweeps_svc.sensitivity_by_scheme(model, *side_at)
    st.caption("The newest sweep of each scheme: one cell per unit (block × projection), colour = KL with only that "
               "unit quantized, on one log scale for every panel. A cell bright in one panel and dark in another "
               "is a layer to give the other format; the Plans page's automatic plan makes that choice for every "
               "layer under a KL budget."
               + (f" On {plans_svc.gpus_label(*side_at)}, a scheme not swept there shows its one-GPU sweep, as a "
                  "plan for "
                  "as many GPUs reads it (it overstates a dynamic scale's KL on o_proj and down_proj)."
                  if side_at[0] > 1 else ""))
    if differ := sweeps_svc.side_by_side_tokens_note(model, *side_at):
        st.caption(differ)
    side_box = st.expander("The panels, one a scheme", key=BY_SCHEME_OPEN, on_change="rerun")
    with side_box:
        if side_box.open:  # drawn only once opened
            state.chart(("by_scheme", *state.frame_key(by_scheme)),
                        lambda: result_charts.sensitivity_by_scheme(by_scheme), width="content")
