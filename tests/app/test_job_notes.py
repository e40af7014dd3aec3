"""The Jobs page's notes and tags (issue 44): written under the person acting, refused for a viewer with the
reason, listed for everyone."""

from __future__ import annotations

from pathlib import Path

from streamlit.testing.v1 import AppTest

from store import repo
from store.db import session_scope

MAIN = str(Path(__file__).resolve().parents[2] / "app" / "main.py")


def _jobs_page():
    at = AppTest.from_file(MAIN, default_timeout=120)
    at.run()
    at.switch_page("views/jobs.py").run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def _write(at, job_id: int, text: str, tags: str):
    at.number_input(key="note_job").set_value(job_id)
    at.text_input(key="note_text").set_value(text)
    at.text_input(key="note_tags").set_value(tags)
    at.button(key="note_add").click().run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_a_note_and_tags_on_a_job_are_written_and_listed(qp_settings):
    from quantplan.services import notes as notes_svc

    with session_scope(qp_settings) as s:
        job = repo.create_job(s, kind="bench", params={}, queue="cpu", user="tester")
    at = _write(_jobs_page(), job.id, "shipped", "prod wikitext")
    assert [x.value for x in at.success] == [f"Noted on job #{job.id} by tester."]
    [note] = notes_svc.notes("job", job.id)
    assert (note.author, note.text, note.tags) == ("tester", "shipped", ["prod", "wikitext"])
    at = _write(at, 424242, "x", "")
    assert any("424242" in e.value for e in at.error)
    assert len(notes_svc.notes()) == 1
