"""The plan version "chosen" for a model: one at a time, who chose it, when and why (table ``chosen_plans``,
migration 0012).

Plain records out, as in store.repo; the rules (who may choose, the audit line that keeps the history of choices)
are quantplan.services.choices'. Pages and the History read :func:`chosen_plans` / :func:`chosen_for_model`.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from store import models as m
from store.records import PlanRecord
from store.repo import NotFound


@dataclass(frozen=True)
class ChosenRecord:
    """The plan version chosen for a model: ``plan_id`` (``plan_name`` v``version``), by whom, when (UTC), why."""

    model_id: int
    plan_id: int
    plan_name: str
    version: int
    chosen_by: str
    chosen_at: dt.datetime
    why: str

    @property
    def label(self) -> str:
        return PlanRecord.label_of(self.plan_name, self.version)

    def to_dict(self) -> dict[str, object]:
        """What an exported plan file carries (``chosen``): the version, who, when (ISO 8601 UTC) and why."""
        return {"plan": self.plan_name, "version": self.version, "chosen_by": self.chosen_by,
                "chosen_at": self.chosen_at.isoformat(), "why": self.why}


def _utc(t: dt.datetime) -> dt.datetime:
    return t.replace(tzinfo=dt.UTC) if t.tzinfo is None else t


def _query() -> Any:
    return (select(m.ChosenPlan.model_id, m.ChosenPlan.plan_id, m.Plan.name, m.Plan.version, m.ChosenPlan.chosen_by,
                   m.ChosenPlan.chosen_at, m.ChosenPlan.why)
            .join(m.Plan, m.Plan.id == m.ChosenPlan.plan_id))


def _record(row: Any) -> ChosenRecord:
    return ChosenRecord(model_id=row[0], plan_id=row[1], plan_name=row[2], version=row[3], chosen_by=row[4],
                        chosen_at=_utc(row[5]), why=row[6] or "")


def chosen_for_model(session: Session, model_id: int) -> ChosenRecord | None:
    """The plan version chosen for the model, or None."""
    row = session.execute(_query().where(m.ChosenPlan.model_id == model_id)).first()
    return None if row is None else _record(row)


def chosen_plans(session: Session, model_ids: Iterable[int] | None = None) -> dict[int, ChosenRecord]:
    """{model id: its chosen plan version}, of every model (``model_ids`` None) or of these, in one query."""
    q = _query()
    if model_ids is not None:
        wanted = set(model_ids)
        if not wanted:
            return {}
        q = q.where(m.ChosenPlan.model_id.in_(wanted))
    return {r[0]: _record(r) for r in session.execute(q)}


def chosen_plan_ids(session: Session) -> set[int]:
    """The ids of every chosen plan version (a table of plan versions marks these)."""
    return set(session.scalars(select(m.ChosenPlan.plan_id)))


def choose(session: Session, *, plan_id: int, by: str, why: str,
           at: dt.datetime | None = None) -> tuple[ChosenRecord | None, ChosenRecord]:
    """Make plan version ``plan_id`` the one chosen for its model, by ``by`` (a name), with ``why``; (the choice it
    replaces or None, the new one). Choosing the chosen version again updates who, when and why."""
    plan = session.get(m.Plan, plan_id)
    if plan is None:
        raise NotFound(f"no plan version #{plan_id}")
    before = chosen_for_model(session, plan.model_id)
    row = session.scalar(select(m.ChosenPlan).where(m.ChosenPlan.model_id == plan.model_id))
    if row is None:
        row = m.ChosenPlan(model_id=plan.model_id)
        session.add(row)
    row.plan_id, row.chosen_by, row.chosen_at, row.why = plan_id, by, at or m.utcnow(), why
    session.flush()
    after = chosen_for_model(session, plan.model_id)
    assert after is not None
    return before, after


def unchoose(session: Session, model_id: int) -> ChosenRecord | None:
    """Clear the model's choice; the choice cleared, or None where there was none."""
    before = chosen_for_model(session, model_id)
    session.execute(delete(m.ChosenPlan).where(m.ChosenPlan.model_id == model_id))
    return before
