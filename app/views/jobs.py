"""Jobs: the queue with live progress, cancel, and error details."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from app import auth, frames, notes_panel
from app import text as page_text
from app.live import ACTIVE
from quantplan.services import jobs as jobs_svc
from quantplan.services import workers as workers_svc

st.title("Jobs")
st.caption("Every registration, calibration, scoring, sensitivity and benchmark job, newest first. Running jobs "
           "update live.")

RETRIED = "jobs_retried"  # what the last "Queue it again" did, said once after the rerun
if RETRIED in st.session_state:
    ok, note = st.session_state.pop(RETRIED)
    (st.success if ok else st.error)(note)

SWEPT = "jobs_swept"  # jobs the stale-job sweep failed while the page was drawn, said until it is drawn anew
st.session_state[SWEPT] = []

PAGE = 100  # jobs per page of the history
c1, c2, c3 = st.columns([1, 1, 2])
kind = c1.selectbox("Kind", [None, "register", "calibrate", "score", "sensitivity", "bench"],
                    format_func=lambda k: "all" if k is None else k, key="jobs_kind")
status = c2.selectbox("Status", [None, "queued", "running", "succeeded", "failed", "cancelled"],
                      format_func=lambda k: "any" if k is None else k, key="jobs_status")
statuses = (status,) if status else None
total = jobs_svc.count_jobs(kind=kind, status=statuses)
pages = max(1, -(-total // PAGE))
if st.session_state.get("jobs_page", 1) > pages:  # a filter left fewer pages than the one shown
    st.session_state["jobs_page"] = pages
page = c3.number_input(f"Page (of {pages}; {total:,} job(s), {PAGE} a page, newest first)", min_value=1,
                       max_value=pages, value=1, step=1, key="jobs_page") if pages > 1 else 1


def _details(job, row) -> None:
    """The selected job's row in full: what the key columns leave out, times relative with UTC on hover."""
    with st.container(border=True):
        st.markdown(f"**#{job.id} {job.kind}** {row['what']} · {job.status}")
        times = " · ".join(f"{what} {page_text.ago_html(ts)} ({page_text.utc_text(ts)})"
                           for what, ts in (("created", job.created_at), ("started", job.started_at),
                                            ("finished", job.finished_at)) if ts is not None)
        st.markdown(times, unsafe_allow_html=True)
        st.markdown(f"queue `{job.queue}` · worker {job.worker_host or '(none yet)'} · device {job.device or '?'}"
                    f" · torch {job.torch_version or '?'} · ran {page_text.duration_text(job.run_seconds()) or '—'}")
        st.caption(f"Message: {row['message']}")


@st.fragment(run_every=2.0)
def job_table() -> None:
    st.session_state[SWEPT] += jobs_svc.sweep_stale()  # while the page is watched, not only when it opens
    if st.session_state[SWEPT]:
        st.warning(f"Jobs {sorted(st.session_state[SWEPT])} had a worker that stopped reporting; they were marked "
                   "failed.")
    jobs = jobs_svc.list_jobs(limit=PAGE, kind=kind, status=statuses, offset=(int(page) - 1) * PAGE)
    # queued and running jobs are drawn with their progress and a cancel button whatever the page shows
    active = jobs_svc.list_jobs(limit=PAGE, kind=kind, status=[a for a in ACTIVE if statuses is None or a in statuses])
    if not jobs and not active:
        st.info("No jobs yet." if total == 0 and not kind and not status else "No job matches.")
        return
    whats = jobs_svc.jobs_what([*jobs, *active])  # the plans named read in one query, not one a row
    for job in active:
        with st.container(border=True):
            a, b = st.columns([4, 1])
            what = whats[job.id]
            a.markdown(f"**#{job.id} {job.kind}**{f' {what}' if what else ''} · {job.status} · "
                       f"{job.device or job.queue} · asked by {job.requested_by or '?'}")
            a.progress(job.progress, text=job.progress_text)
            note = workers_svc.no_worker_note(job.queue) if job.status == "queued" else jobs_svc.silent_note(job)
            if note:
                a.warning(note)
            if job.cancel_requested:
                b.caption("cancel requested")
            elif auth.may_cancel(job.requested_by) and b.button("Cancel", key=f"cancel_{job.id}"):
                try:  # a viewer, or a member with another's job, is refused by the application layer
                    jobs_svc.cancel_job(job.id)
                except ValueError as exc:
                    a.error(str(exc))
                else:
                    st.rerun()
    table = frames.jobs_frame(jobs, whats, jobs_svc.jobs_model(jobs))
    picked = st.dataframe(
        table, hide_index=True, width="stretch", column_order=frames.JOB_KEY_COLUMNS, key="jobs_table",
        on_select="rerun", selection_mode="single-row",
        # widths that fit the key columns in the page at 1400 px: the progress text's count and time left first
        column_config={"id": st.column_config.NumberColumn(width=50), "kind": st.column_config.TextColumn(width=85),
                       "model": st.column_config.TextColumn(width=110),
                       "status": st.column_config.TextColumn(width=80),
                       "progress": st.column_config.TextColumn(
                           width=300, help="a running job's share done, its count in its own units and the "
                                           "time left at its measured rate; an ended job's final state"),
                       "asked by": st.column_config.TextColumn(width=75),
                       "device": st.column_config.TextColumn(width=95, help="the worker's device; its full name "
                                                                            "is in the row's details"),
                       "age": st.column_config.TextColumn(width=80, help=page_text.AGO_HELP)})
    st.caption("Select a row for the rest of it: what it works on, its message, queue, worker and times.")
    rows = picked.selection.rows if picked is not None else []
    if rows and rows[0] < len(jobs):
        _details(jobs[rows[0]], table.iloc[rows[0]])
    ended = [j for j in jobs if j.status in ("failed", "cancelled")]  # each can be queued again
    for j in ended[:10]:
        why = (j.error or "")[:120] if j.status == "failed" else j.message
        with st.expander(f"#{j.id} {j.kind} {j.status}: {why}"):
            if j.status == "failed":
                st.error(j.error)
            if j.traceback:
                st.code(j.traceback, language="text")
            if refusal := jobs_svc.retry_refusal(j):  # say why, rather than offer a button that only refuses
                st.caption(f"Not offered again: {refusal}.")
            elif auth.may("queue") and st.button("Queue it again", key=f"retry_{j.id}",
                                                 help="same kind, parameters, model and plan"):
                try:
                    again = jobs_svc.retry_job(j.id)
                    st.session_state[RETRIED] = (True, f"Job #{j.id} queued again as job #{again.id}.")
                except (ValueError, LookupError) as exc:
                    st.session_state[RETRIED] = (False, f"Job #{j.id} cannot be queued again: {exc}")
                st.rerun()


job_table()
notes_panel.job_notes()


st.subheader("Workers")
workers = workers_svc.all_workers()
live = {w.name for w in workers_svc.live_workers()}
if not workers:
    st.info("No worker has reported yet. `quantplan up` starts one; `quantplan worker --queues gpu` on a GPU host "
            "adds another.")
else:
    def liveness(w) -> str:
        """'yes', or 'no: last seen 12 min ago' (a worker stopped, or its host gone)."""
        return "yes" if w.name in live else f"no: last seen {page_text.ago(w.seen_at)}"

    st.dataframe(pd.DataFrame([{
        "worker": w.name, "live": liveness(w), "queues": ", ".join(w.queues), "device": w.device_name,
        "class": w.device_class, "torch": w.torch_version, "started": page_text.ago(w.started_at),
        "last seen": page_text.ago(w.seen_at)} for w in workers]), hide_index=True, width="stretch",
        # the exact times on hover over the header: a worker's row has no details view
        column_config={c: st.column_config.TextColumn(help="how long ago, from now; in UTC: " + "; ".join(
            f"{w.name} {page_text.utc_text(getattr(w, a))}" for w in workers))
            for c, a in (("started", "started_at"), ("last seen", "seen_at"))})
    st.caption("A worker reports every 30 s; one not seen for 90 s is not live. Jobs wait in their queue until a "
               "live worker consumes it.")
