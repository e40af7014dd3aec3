"""The team's people and the audit log: users with a role, and who did what destructive action when.

Plain records out, as in store.repo; the rules (who may do what, the first admin) are the application layer's
(quantplan.services.access), which calls these inside its own transactions.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from store import models as m
from store.repo import NotFound


@dataclass(frozen=True)
class Member:
    """A person and their role (None: named as who asked, never signed in)."""

    id: int
    name: str
    role: str | None
    created_at: dt.datetime
    last_seen_at: dt.datetime | None


@dataclass(frozen=True)
class AuditRecord:
    id: int
    at: dt.datetime
    actor: str
    action: str
    target: str
    detail: dict[str, Any]


def _utc(t: dt.datetime) -> dt.datetime:
    """A time as UTC-aware: SQLite gives back the naive UTC it stored."""
    return t.replace(tzinfo=dt.UTC) if t.tzinfo is None else t


def _member(row: m.User) -> Member:
    return Member(id=row.id, name=row.name, role=row.role, created_at=_utc(row.created_at),
                  last_seen_at=_utc(row.last_seen_at) if row.last_seen_at else None)


def list_members(session: Session) -> list[Member]:
    """Every person, by name."""
    return [_member(r) for r in session.scalars(select(m.User).order_by(m.User.name))]


def find_member(session: Session, name: str) -> Member | None:
    row = session.scalar(select(m.User).where(m.User.name == name))
    return None if row is None else _member(row)


def admin_count(session: Session) -> int:
    return int(session.scalar(select(func.count()).select_from(m.User).where(m.User.role == "admin")) or 0)


def seen(session: Session, name: str, role_if_new: str) -> Member:
    """Record that ``name`` signed in now; a person without a role gets ``role_if_new``. The row is locked for the
    transaction (PostgreSQL), so two first sign-ins at once do not both read "no admin yet" from the same row."""
    row = session.scalar(select(m.User).where(m.User.name == name).with_for_update())
    if row is None:
        row = m.User(name=name)
        session.add(row)
    if row.role is None:
        row.role = role_if_new
    row.last_seen_at = m.utcnow()
    session.flush()
    return _member(row)


def set_role(session: Session, name: str, role: str) -> tuple[str | None, Member]:
    """Give ``name`` the role; (the role before, the person after). NotFound for a name never seen."""
    row = session.scalar(select(m.User).where(m.User.name == name).with_for_update())
    if row is None:
        known = ", ".join(r.name for r in session.scalars(select(m.User).order_by(m.User.name))) or "none yet"
        raise NotFound(f"no person named {name!r} (known: {known})")
    before = row.role
    row.role = role
    session.flush()
    return before, _member(row)


def record(session: Session, *, actor: str, action: str, target: str, detail: dict[str, Any] | None = None) -> None:
    """Add one line to the audit log, in the caller's transaction (it stands or falls with the action)."""
    session.add(m.AuditEntry(actor=actor, action=action, target=target[:500], detail=detail or {}))
    session.flush()


def list_audit(session: Session, limit: int | None = None, actor: str | None = None,
               action: str | None = None) -> list[AuditRecord]:
    """The audit log, newest first."""
    q = select(m.AuditEntry).order_by(m.AuditEntry.id.desc())
    if actor:
        q = q.where(m.AuditEntry.actor == actor)
    if action:
        q = q.where(m.AuditEntry.action == action)
    if limit:
        q = q.limit(limit)
    return [AuditRecord(id=r.id, at=_utc(r.at), actor=r.actor, action=r.action, target=r.target,
                        detail=dict(r.detail or {})) for r in session.scalars(q)]


@dataclass(frozen=True)
class NoteRecord:
    id: int
    at: dt.datetime
    author: str
    target_kind: str
    target_id: int
    text: str
    tags: list[str]


def add_note(session: Session, *, author: str, target_kind: str, target_id: int, text: str,
             tags: list[str]) -> NoteRecord:
    row = m.Note(author=author, target_kind=target_kind, target_id=target_id, text=text, tags=list(tags))
    session.add(row)
    session.flush()
    return _note(row)


def _note(row: m.Note) -> NoteRecord:
    return NoteRecord(id=row.id, at=_utc(row.at), author=row.author, target_kind=row.target_kind,
                      target_id=row.target_id, text=row.text, tags=list(row.tags or []))


def list_notes(session: Session, target_kind: str | None = None, target_id: int | None = None,
               tag: str | None = None) -> list[NoteRecord]:
    """Notes, oldest first: on one target, of one kind, or all; with ``tag``, those carrying it."""
    q = select(m.Note).order_by(m.Note.id)
    if target_kind:
        q = q.where(m.Note.target_kind == target_kind)
    if target_id is not None:
        q = q.where(m.Note.target_id == target_id)
    notes = [_note(r) for r in session.scalars(q)]
    return [n for n in notes if tag in n.tags] if tag else notes
