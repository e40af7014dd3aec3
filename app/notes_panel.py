"""Notes and tags on jobs, written on the Jobs page: who wrote what on which run (quantplan.services.notes)."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from app import auth
from quantplan.services import notes as notes_svc


def job_notes(job: int | None = None) -> None:
    """A form to write a note and tags on a job (members and admins: the application layer refuses a viewer), and
    the newest notes on jobs; ``job``: on that one job only (a run's page), and its notes."""
    st.subheader("Notes and tags")
    if auth.may("write_note"):
        _write_box(job)
    else:
        st.caption(auth.cannot("write_note"))
    shown = notes_svc.notes("job", job)[-50:][::-1]
    if shown:
        st.dataframe(pd.DataFrame([{"job": n.target_id, "note": n.text, "tags": " ".join(n.tags), "by": n.author,
                                    "when": n.at} for n in shown]), hide_index=True, width="stretch")


def _write_box(job: int | None) -> None:
    """The note's job (unless given), text and tags, and its Add button."""
    c1, c2, c3 = st.columns([1, 3, 2])
    job_id = c1.number_input("Job", min_value=1, step=1, key="note_job") if job is None else job
    if job is not None:
        c1.markdown(f"on run #{job}")
    text = c2.text_input("Note", key="note_text", placeholder="shipped, bad calibration text…")
    tags = c3.text_input("Tags", key="note_tags", help="words separated by spaces, e.g. shipped wikitext")
    if st.button("Add note", key="note_add"):
        try:
            note = notes_svc.add_note("job", int(job_id), text, tags.split())
            st.success(f"Noted on job #{note.target_id} by {note.author}.")
        except (ValueError, LookupError) as exc:
            st.error(str(exc))
