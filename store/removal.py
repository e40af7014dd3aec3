"""Removing a model keeps its history; purging deletes it for good.

A removal marks the model's row (``removed_at``, ``removed_by``: migration 0012) and the application layer frees its
files; its plans, jobs, statistics, scores, sensitivity sweeps, notes and chosen plan stay readable, shown with a
"removed" marker, and it leaves the listings new work is picked from (store.repo.list_models). The same checkpoint
registered again brings the row back with them (store.repo.add_model). A purge deletes the row, and with it
(ON DELETE CASCADE) what was measured on it (store.repo.delete_model). The rules (who may, what is audited) are
quantplan.services.models'.
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import select
from sqlalchemy.orm import Session

from store import models as m
from store import repo
from store.records import ModelRecord


def _utc(t: dt.datetime | None) -> dt.datetime | None:
    """A time as UTC-aware: SQLite gives back the naive UTC it stored."""
    return t.replace(tzinfo=dt.UTC) if t is not None and t.tzinfo is None else t


def mark_removed(session: Session, model_id: int, by: str, at: dt.datetime | None = None) -> ModelRecord:
    """Mark the model removed by ``by`` (a name) now; its record. A model removed already keeps its first marks."""
    row = session.get(m.Model, model_id)
    if row is None:
        raise repo.NotFound(f"no model #{model_id}")
    if row.removed_at is None:
        row.removed_at, row.removed_by = at or m.utcnow(), by
        session.flush()
    return repo.get_model(session, model_id)


def removed_models(session: Session) -> list[ModelRecord]:
    """The models marked removed, most recently removed first (the Models page's purge list, ``models list
    --removed``); their summaries are read: a purge list is short."""
    rows = session.scalars(select(m.Model).where(m.Model.removed_at.is_not(None))
                           .order_by(m.Model.removed_at.desc(), m.Model.id.desc()))
    return [repo.get_model(session, r.id) for r in rows]


def removal_of(session: Session, model_id: int) -> tuple[dt.datetime, str] | None:
    """(when, by whom) a model was removed, UTC-aware; None for a model that is not removed (or not stored)."""
    row = session.execute(select(m.Model.removed_at, m.Model.removed_by).where(m.Model.id == model_id)).first()
    if row is None or row.removed_at is None:
        return None
    return _utc(row.removed_at) or row.removed_at, row.removed_by or "?"


def removed_note(model: ModelRecord) -> str | None:
    """"removed by NAME on YYYY-MM-DD HH:MM UTC" for a removed model (the marker pages and the CLI show), else None."""
    if model.removed_at is None:
        return None
    at = _utc(model.removed_at)
    return f"removed by {model.removed_by or '?'} on {at:%Y-%m-%d %H:%M} UTC" if at else "removed"


def refuse_removed(model: ModelRecord, what: str) -> str | None:
    """Why ``what`` (e.g. "a score job") cannot be asked of ``model``: it was removed; None where it was not."""
    note = removed_note(model)
    if note is None:
        return None
    return (f"{model.name} was {note}: its files are gone, so {what} cannot run on it (its results stay readable). "
            "Register the same checkpoint again to bring it back, or pick another model")
