"""A run's own page (/run?job=ID, linked from the History page): its parameters, the software it ran with, device,
worker, timings, results, the plan version's change from its parent, links to the job, the plan and a comparison,
and its notes."""

from __future__ import annotations

import pandas as pd
import streamlit as st
from streamlit.errors import StreamlitAPIException

from app import frames, notes_panel
from quantplan.services import history as history_svc
from quantplan.services import scoring as scoring_svc
from quantplan.services.errors import Refused

raw = st.query_params.get("job", "")
if not raw.strip().isdigit():
    st.title("Run")
    st.info("Open a run from the History page (its address is /run?job=ID)." if not raw else
            f"job={raw!r} in the address is no run id: it is a number, as in /run?job=12.")
    st.page_link("views/history.py", label="History", icon=":material/history:")
    st.stop()
try:
    run = history_svc.run(int(raw))
except LookupError as exc:
    st.title("Run")
    st.error(f"{exc}: the address names a run this deployment does not have.")
    st.page_link("views/history.py", label="History", icon=":material/history:")
    st.stop()
job = run.job

st.title(f"Run #{job.id} · {job.kind} · {job.status}")
model_text = "no model" if not run.model_name else run.model_name + (" (removed)" if run.model_removed else "")
plan_text = f" · plan {run.plan.label}" if run.plan else ""
st.markdown(f"**{model_text}**{plan_text} · asked by **{job.requested_by or '?'}** · "
            f"device {job.device or job.queue} · worker {job.worker_host or '—'}")
if job.status == "failed" and job.error:
    st.error(job.error)

l1, l2, l3 = st.columns(3)
with l1:
    st.page_link("views/jobs.py", label=f"Job #{job.id} on the Jobs page", icon=":material/list:")
with l2:
    if run.plan is not None and run.model is not None:
        st.page_link("views/plans.py", label=f"Plan {run.plan.label} on the Plans page", icon=":material/tune:",
                     query_params={"model": str(run.model.id)})
    else:
        st.caption("No stored plan version." if job.plan_id is None else "Its plan version was removed.")
with l3:
    st.page_link("views/history.py", label="Back to the History", icon=":material/history:")

left, right = st.columns(2)
with left:
    st.subheader("Parameters")
    st.json(history_svc.parameters(job), expanded=True)
with right:
    st.subheader("Software")
    st.table(pd.DataFrame(run.software, columns=["software", "version"]).set_index("software"))
    if run.environment is None:
        st.caption("Not recorded: the run started before quantplan kept it (migration 0013), or never started.")
    st.subheader("Timings")
    st.table(pd.DataFrame(run.timings, columns=["", "UTC / seconds"]).set_index(""))

st.subheader("Results")
if run.score is not None:
    sc = run.score
    m1, m2, m3 = st.columns(3)
    m1.metric("KL mean", scoring_svc.pm_text(sc.kl_mean, sc.kl_mean_err))
    m2.metric("top-1 agree", scoring_svc.pm_text(sc.top1_agree, sc.top1_agree_err, ".4f"))
    m3.metric("perplexity", f"{sc.ppl:.3f}", f"{sc.ppl - sc.ppl_ref:+.3f} from {sc.ppl_ref:.3f}", delta_color="off")
    st.code(f"#{job.id} {sc.plan_label} on {sc.dataset}, {sc.tokens:,} positions\n"
            + "\n".join(scoring_svc.statistics_lines({**sc.metrics(), **sc.statistics()})), language=None)
elif run.outliers:
    st.caption("The layers with the strongest outliers (largest channel maximum over the median channel's).")
    st.dataframe(pd.DataFrame(run.outliers), hide_index=True, width="stretch")
elif run.sensitivity:
    st.caption("The most sensitive units: KL with only that unit quantized.")
    st.dataframe(pd.DataFrame(run.sensitivity), hide_index=True, width="stretch")
elif run.kernels:
    table = pd.DataFrame(run.kernels)
    st.dataframe(table[[c for c in ("m", "n", "k", "path", "ms", "speedup", "tflops", "native", "skipped")
                        if c in table]], hide_index=True, width="stretch")
if job.result:
    with st.expander("Its result as stored"):
        st.json({k: v for k, v in job.result.items() if k != "records"}, expanded=False)
elif not (run.score or run.outliers or run.sensitivity or run.kernels):
    st.caption("No results: " + ("it has not finished." if not job.finished else f"it ended {job.status}."))
if job.traceback:
    with st.expander("Traceback"):
        st.code(job.traceback, language="text")

if run.plan is not None:
    st.subheader(f"Plan {run.plan.label} against its parent")
    if run.parent is None:
        st.caption(f"{run.plan.label} is the plan's first version: no parent to compare with.")
    elif run.model is None:
        st.caption("Its model was purged: the layers to compare the versions on are gone.")
    else:
        try:
            diff = frames.plan_diff(run.model, run.parent, run.plan)
        except Refused as exc:
            st.warning(str(exc))
        else:
            if diff.empty:
                st.caption(f"{run.plan.label} gives every layer the scheme {run.parent.label} gave it"
                           + (f" ({run.plan.note})." if run.plan.note else "."))
            else:
                st.caption(f"{len(diff)} layer(s) changed from {run.parent.label}"
                           + (f": {run.plan.note}" if run.plan.note else "") + ".")
                st.dataframe(diff, hide_index=True, width="stretch")

st.subheader("Compare with…")
if not run.neighbours:
    st.caption(f"No other {job.kind} run to compare with yet.")
else:
    others = {i: f"#{i} {kind} · {status}" for i, kind, status in run.neighbours}
    c1, c2 = st.columns([3, 1])
    other = c1.selectbox(f"Another run (its model's {job.kind} runs first)", list(others),
                         format_func=lambda i: others[i], key=f"run_compare_{job.id}")
    with c2:
        try:  # the Compare page (url_path compare, ?jobs=ID,ID)
            st.page_link("views/compare.py", label=f"Compare #{job.id} with #{other}", icon=":material/compare:",
                         query_params={"jobs": f"{job.id},{other}"})
        except StreamlitAPIException:  # a deployment without the Compare page
            st.caption("The Compare page is not part of this app.")

notes_panel.job_notes(job.id)
