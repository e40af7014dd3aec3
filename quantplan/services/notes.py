"""Notes and tags a person writes on a run (a job), a plan version or a model ("shipped", "bad calibration text"):
members and admins write, everyone reads; each says who wrote it and when, and outlives what it is about."""

from __future__ import annotations

import re

from quantplan.services import access
from quantplan.services.deployment import settings
from quantplan.services.errors import Refused
from store import repo, team
from store.db import session_scope
from store.models import NOTE_TARGETS

TAG = re.compile(r"^[\w.:+-]{1,40}$")
MAX_TEXT = 10_000


def add_note(target_kind: str, target_id: int, text: str = "",
             tags: list[str] | tuple[str, ...] = ()) -> team.NoteRecord:
    """Write a note (text, tags or both) on job / plan / model ``target_id``, by the person acting. Refused for a
    viewer, an unknown target, an empty note, text over 10,000 characters and a tag that is not one word
    (letters, digits, ``_ . : + -``, at most 40)."""
    author = access.require("write_note").name
    if target_kind not in NOTE_TARGETS:
        raise Refused(f"a note is written on a {', a '.join(NOTE_TARGETS)}; not on a {target_kind!r}")
    text = text.strip()
    clean = list(dict.fromkeys(t.strip() for t in tags if t.strip()))
    if not text and not clean:
        raise Refused("an empty note: give a text, a tag or both")
    if len(text) > MAX_TEXT:
        raise Refused(f"a note is at most {MAX_TEXT:,} characters; this one has {len(text):,}")
    bad = [t for t in clean if not TAG.match(t)]
    if bad:
        raise Refused(f"tag(s) {', '.join(map(repr, bad))}: a tag is one word of letters, digits and _ . : + - "
                      "(at most 40 characters)")
    with session_scope(settings()) as s:
        getter = {"job": repo.get_job, "plan": repo.get_plan, "model": repo.get_model}[target_kind]
        getter(s, target_id)  # NotFound (a LookupError) naming what exists
        return team.add_note(s, author=author, target_kind=target_kind, target_id=target_id, text=text, tags=clean)


def notes(target_kind: str | None = None, target_id: int | None = None,
          tag: str | None = None) -> list[team.NoteRecord]:
    """Notes, oldest first: on one target, on one kind of target, with a tag, or all."""
    with session_scope(settings()) as s:
        return team.list_notes(s, target_kind, target_id, tag)
