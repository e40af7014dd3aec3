"""Live progress of the jobs a page queues: a fragment redrawn every few seconds while one of them is queued
or running, which draws the whole page again when one ends (its results change the page below it)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import streamlit as st

from quantplan.services import jobs as jobs_svc
from quantplan.services import workers as workers_svc

REFRESH_S = 2.0
ACTIVE = ("queued", "running")
KIND_WORDS = {"register": "Registration", "calibrate": "Calibration", "score": "Score", "sensitivity": "Sensitivity",
              "bench": "Benchmark"}


def _panel(key: str, kinds: tuple[str, ...], model_id: int | None, recent: int,
           done_notes: Mapping[str, str], newer_try: bool = False) -> None:
    running = jobs_svc.list_jobs(limit=100, kind=kinds, model_id=model_id, status=ACTIVE)
    newest = jobs_svc.list_jobs(limit=recent, kind=kinds, model_id=model_id)  # newest first
    active = {j.id for j in running}
    ended = st.session_state.get(key, set()) - active
    st.session_state[key] = active
    if ended:  # new results: the rest of the page changes
        st.session_state[f"{key}:ended"] = ended
        st.rerun()
    just_ended = st.session_state.pop(f"{key}:ended", set())
    shown = {j.id: j for j in [*running, *newest]}
    shown.update((i, jobs_svc.get_job(i)) for i in just_ended - shown.keys())
    newest_id = newest[0].id if newest else None
    waiting: list[str] = []  # queues of queued jobs, each named once below the bars
    whats = jobs_svc.jobs_what(shown.values())
    for job in sorted(shown.values(), key=lambda j: j.id, reverse=True):
        what = whats[job.id]
        name = f"{KIND_WORDS.get(job.kind, job.kind)} job #{job.id}" + (f" ({what})" if what else "")
        if job.id in just_ended and job.status == "succeeded":
            note = done_notes.get(job.kind)
            st.success(f"{name} is done: {job.message}." + (f" {note}" if note else ""))
        elif job.status == "failed" and (job.id in just_ended or (job.id == newest_id and not newer_try)):
            st.error(f"{name} failed: {job.error}")
        elif job.status == "cancelled" and job.id in just_ended:
            st.info(f"{name} was cancelled.")
        elif not job.finished:
            st.progress(job.progress, text=f"{name} {job.status}: {job.progress_text}")
            if job.status == "queued" and job.queue not in waiting:
                waiting.append(job.queue)
    for queue in waiting:
        note = workers_svc.no_worker_note(queue)
        if note:
            st.warning(note)


def job_progress(key: str, kinds: Sequence[str], *, model_id: int | None = None, recent: int = 3,
                 done_notes: Mapping[str, str] | None = None, newer_try: bool = False) -> None:
    """The queued and running jobs of ``kinds`` (of one model, when given) with progress bars, what just ended
    (success, failure or cancel) and the newest job's failure until a newer try (``newer_try``: this run's try
    was refused before a job was made, and says why itself); redrawn every REFRESH_S while any is active. Call it
    below the form that queues them, so a job queued in this run starts the refresh."""
    kinds = tuple(kinds)
    live = bool(jobs_svc.list_jobs(limit=1, kind=kinds, model_id=model_id, status=ACTIVE))
    st.fragment(_panel, run_every=REFRESH_S if live else None)(
        f"live_jobs:{key}", kinds, model_id, recent, dict(done_notes or {}), newer_try)
