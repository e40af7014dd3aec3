"""The team's runs as one table: every job with who, what, where, when and its headline figures, filtered, sorted
and paged in SQL; and the software a job ran with (``jobs.environment``, written as a worker starts it).

A page of the history reads a bounded number of rows, and of each only scalar columns and a few values picked out
of the JSON columns in SQL (a score's KL, a calibration's top outlier, a sweep's top unit): never a job's whole
``params`` (a scored plan file names every layer) or ``result`` (a benchmark's every record), never a score's
``details`` or ``plan_body``, never per-layer rows. The notes of the page's runs come in one more query, a
benchmark's best speed-up per kernel path in another.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Text, and_, case, cast, exists, func, literal, or_, select, update
from sqlalchemy.orm import Session, aliased

from store import models as m
from store.repo import REMOVED_MODEL_KEY, NotFound

# what jobs.environment holds (worker.runner records them; None where a value could not be found)
ENVIRONMENT_KEYS = ("quantplan", "git_commit", "python", "torch", "transformers", "cuda")
MAX_PAGE = 500  # rows a page of the history may ask for

SORTS = ("id", "kind", "status", "model", "plan", "scheme", "person", "device", "worker", "queued", "started",
         "duration", "kl", "notes")


@dataclass(frozen=True)
class HistoryFilter:
    """What a history shows; each field None (or empty) for no filter. ``model``: a name or an id (a removed model
    by the name it had); ``plan``: a plan's name (every version), ``NAME vN`` / ``NAME@vN`` (one) or an id;
    ``device``: a part of the device's label (``cuda`` finds ``cuda (NVIDIA H100)``); ``since`` / ``until``: days
    (UTC, both included) the run was asked for on; ``text``: words found in the model, plan, scheme, person,
    kind, status, device, worker, message, error, or a note's text or tags."""

    person: str | None = None
    model: str | None = None
    plan: str | None = None
    kind: str | None = None
    status: str | None = None
    device: str | None = None
    tag: str | None = None
    since: dt.date | None = None
    until: dt.date | None = None
    text: str | None = None


@dataclass(frozen=True)
class HistoryRow:
    """One run as the history table shows it. ``figures``: the headline numbers found for its kind (score:
    ``kl_mean``, ``kl_mean_err``, ``top1_agree``; calibrate: ``layers``, ``top_layer``, ``top_outlier_ratio``;
    sensitivity: ``units``, ``top_unit``, ``top_kl``; bench: ``measured``, ``reused``, ``speedups`` {path: best
    speed-up among the cases it measured}); absent where the run has none."""

    id: int
    kind: str
    status: str
    model: str | None
    model_id: int | None
    model_removed: bool
    plan: str | None
    plan_id: int | None
    plan_chosen: bool
    scheme: str | None
    person: str | None
    device: str | None
    worker: str | None
    queued_at: dt.datetime
    started_at: dt.datetime | None
    finished_at: dt.datetime | None
    error: str | None
    figures: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    tags: list[str] = field(default_factory=list)

    @property
    def duration_s(self) -> float | None:
        """Seconds from its start to its end; None for a run that never started or has not finished."""
        if self.started_at is None or self.finished_at is None:
            return None
        return max(0.0, (self.finished_at - self.started_at).total_seconds())


def _utc(t: dt.datetime | None) -> dt.datetime | None:
    return None if t is None else t.replace(tzinfo=dt.UTC) if t.tzinfo is None else t


def _seconds(session: Session, start: Any, end: Any) -> Any:
    """``end - start`` in seconds, in SQL, as the session's database writes it."""
    if session.get_bind().dialect.name == "postgresql":
        return func.extract("epoch", end - start)
    return (func.julianday(end) - func.julianday(start)) * 86400.0


def _tag_pattern(tag: str) -> str:
    """The tag as it stands in a notes.tags JSON text: quoted, non-ASCII escaped (json.dumps, as the column
    writes it), so a LIKE on the text finds the whole tag only (a tag holds no quote)."""
    return json.dumps(tag)


def _plan_ref(ref: str) -> tuple[str | None, int | None, int | None]:
    """(name, version, id) of a plan reference: "NAME", "NAME vN", "NAME@vN" or an id."""
    ref = ref.strip()
    if ref.isdigit():
        return None, None, int(ref)
    for sep in ("@v", " v"):
        name, _, version = ref.rpartition(sep)
        if name and version.isdigit():
            return name, int(version), None
    return ref, None, None


class _Query:
    """The columns and joins of the history, shared by its page and its count."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.user = aliased(m.User)
        self.model = aliased(m.Model)
        self.plan = aliased(m.Plan)
        self.score = aliased(m.ScoreResult)
        j = m.Job
        self.removed_name = j.params[REMOVED_MODEL_KEY].as_string()
        self.scheme = func.coalesce(j.params["scheme"].as_string(), self.score.plan_label)
        self.model_name = func.coalesce(self.model.name, self.removed_name)
        self.plan_label = case((self.plan.id.is_not(None),
                                self.plan.name + literal(" v") + cast(self.plan.version, Text)),
                               else_=None)
        self.duration = _seconds(session, j.started_at, j.finished_at)
        note_count = (select(func.count(m.Note.id)).where(m.Note.target_kind == "job", m.Note.target_id == j.id)
                      .correlate(j).scalar_subquery())
        self.sort_columns: dict[str, Any] = {
            "id": j.id, "kind": j.kind, "status": j.status, "model": self.model_name,
            "plan": self.plan.name, "scheme": self.scheme, "person": self.user.name, "device": j.device,
            "worker": j.worker_host, "queued": j.created_at, "started": j.started_at,
            "duration": self.duration, "kl": self.score.kl_mean, "notes": note_count,
        }

    def joined(self, q: Any) -> Any:
        j = m.Job
        return (q.select_from(j)
                .outerjoin(self.user, self.user.id == j.requested_by)
                .outerjoin(self.model, self.model.id == j.model_id)
                .outerjoin(self.plan, self.plan.id == j.plan_id)
                .outerjoin(self.score, self.score.job_id == j.id)
                .where(j.id.not_in(select(m.SweepShard.job_id))))  # a sharded sweep is one run (store.shards)

    def filtered(self, q: Any, f: HistoryFilter) -> Any:
        j = m.Job
        if f.person:
            q = q.where(func.lower(self.user.name) == f.person.strip().lower())
        if f.model:
            ref = f.model.strip()
            named = or_(func.lower(self.model.name) == ref.lower(), func.lower(self.removed_name) == ref.lower())
            q = q.where(or_(j.model_id == int(ref), named) if ref.isdigit() else named)
        if f.plan:
            name, version, plan_id = _plan_ref(f.plan)
            if plan_id is not None:
                q = q.where(j.plan_id == plan_id)
            else:
                assert name is not None
                by_plan = func.lower(self.plan.name) == name.lower()
                if version is not None:
                    by_plan = and_(by_plan, self.plan.version == version)
                label = name if version is None else f"{name} v{version}"
                q = q.where(or_(by_plan, func.lower(self.score.plan_label) == label.lower()))
        if f.kind:
            q = q.where(j.kind == f.kind)
        if f.status:
            q = q.where(j.status == f.status)
        if f.device:
            q = q.where(func.lower(j.device).contains(f.device.strip().lower(), autoescape=True))
        if f.tag:
            q = q.where(exists().where(m.Note.target_kind == "job", m.Note.target_id == j.id,
                                       cast(m.Note.tags, Text).contains(_tag_pattern(f.tag.strip()),
                                                                        autoescape=True)))
        if f.since:
            q = q.where(j.created_at >= dt.datetime.combine(f.since, dt.time(), dt.UTC))
        if f.until:
            q = q.where(j.created_at < dt.datetime.combine(f.until + dt.timedelta(days=1), dt.time(), dt.UTC))
        for word in (f.text or "").lower().split():
            fields = [self.model_name, self.plan.name, self.scheme, self.user.name, j.kind, j.status, j.device,
                      j.worker_host, j.message, j.error]
            in_notes = exists().where(m.Note.target_kind == "job", m.Note.target_id == j.id,
                                      or_(func.lower(m.Note.text).contains(word, autoescape=True),
                                          func.lower(cast(m.Note.tags, Text)).contains(word, autoescape=True)))
            q = q.where(or_(*(func.lower(c).contains(word, autoescape=True) for c in fields), in_notes,
                            *([j.id == int(word.lstrip("#"))] if word.lstrip("#").isdigit() else [])))
        return q


def history(session: Session, f: HistoryFilter = HistoryFilter(), *, sort: str = "id", descending: bool = True,
            offset: int = 0, limit: int = 50) -> tuple[list[HistoryRow], int]:
    """(a page of the runs that pass ``f``, sorted by ``sort`` (one of SORTS; runs without a value last, then
    newest first), from ``offset``, at most ``limit``; how many pass ``f`` in all)."""
    if sort not in SORTS:
        raise ValueError(f"sort by one of {', '.join(SORTS)}; not {sort!r}")
    if not 1 <= limit <= MAX_PAGE or offset < 0:
        raise ValueError(f"a page is 1 to {MAX_PAGE} runs from an offset of 0 or more; not {limit} from {offset}")
    hq = _Query(session)
    j = m.Job
    total = int(session.scalar(hq.filtered(hq.joined(select(func.count(j.id))), f)) or 0)
    key = hq.sort_columns[sort]
    order = [key.desc().nulls_last() if descending else key.asc().nulls_last()]
    if sort != "id":
        order.append(j.id.desc())
    chosen = exists().where(m.ChosenPlan.plan_id == j.plan_id).correlate(j)  # the model's chosen version
    columns = [
        j.id, j.kind, j.status, j.model_id, j.plan_id, j.device, j.worker_host, j.created_at, j.started_at,
        j.finished_at, j.error, hq.model_name.label("model"), hq.removed_name.label("removed_name"),
        hq.model.removed_at.is_not(None).label("removed"),
        hq.plan_label.label("plan"), chosen.label("chosen"), hq.scheme.label("scheme"),
        hq.user.name.label("person"), j.params["kv_sweep"].as_string().label("kv_sweep"),
        hq.score.kl_mean, hq.score.kl_mean_err, hq.score.top1_agree,
        j.result["layers"].as_integer().label("layers"), j.result["units"].as_integer().label("units"),
        j.result[("top", 0, "name")].as_string().label("top_layer"),
        j.result[("top", 0, "outlier_ratio")].as_float().label("top_outlier_ratio"),
        j.result[("top", 0, "layer")].as_string().label("top_unit"),
        j.result[("top", 0, "kl_mean")].as_float().label("top_kl"),
        j.result["scheme"].as_string().label("swept_scheme"),
        j.result["measured"].as_integer().label("measured"), j.result["reused"].as_integer().label("reused"),
    ]
    q = hq.filtered(hq.joined(select(*columns)), f).order_by(*order).offset(offset).limit(limit)
    rows = session.execute(q).all()
    ids = [r.id for r in rows]
    notes: dict[int, list[m.Note]] = {}
    if ids:
        for note in session.scalars(select(m.Note).where(m.Note.target_kind == "job", m.Note.target_id.in_(ids))
                                    .order_by(m.Note.id)):
            notes.setdefault(note.target_id, []).append(note)
    speedups: dict[int, dict[str, float]] = {}
    bench_ids = [r.id for r in rows if r.kind == "bench"]
    if bench_ids:
        best = (select(m.KernelResult.job_id, m.KernelResult.path, func.max(m.KernelResult.speedup))
                .where(m.KernelResult.job_id.in_(bench_ids), m.KernelResult.path != "baseline",
                       m.KernelResult.speedup.is_not(None))
                .group_by(m.KernelResult.job_id, m.KernelResult.path))
        for job_id, path, value in session.execute(best):
            if value is not None:
                speedups.setdefault(job_id, {})[path] = float(value)
    return [_row(r, notes.get(r.id, []), speedups.get(r.id, {})) for r in rows], total


def _row(r: Any, notes: list[m.Note], speedups: dict[str, float]) -> HistoryRow:
    figures: dict[str, Any] = {}
    if r.kind == "score" and r.kl_mean is not None:
        figures = {"kl_mean": r.kl_mean, "kl_mean_err": r.kl_mean_err, "top1_agree": r.top1_agree}
    elif r.kind == "calibrate" and r.layers is not None:
        figures = {"layers": r.layers, "top_layer": r.top_layer, "top_outlier_ratio": r.top_outlier_ratio}
    elif r.kind == "sensitivity" and r.units is not None:
        figures = {"units": r.units, "top_unit": r.top_unit, "top_kl": r.top_kl}
    elif r.kind == "bench" and (r.measured is not None or speedups):
        figures = {"measured": r.measured, "reused": r.reused, "speedups": speedups}
    scheme = r.scheme or r.swept_scheme or (f"KV {r.kv_sweep}" if r.kv_sweep else None)
    tags = list(dict.fromkeys(t for n in notes for t in (n.tags or [])))
    return HistoryRow(
        id=r.id, kind=r.kind, status=r.status, model=r.model, model_id=r.model_id,
        model_removed=bool(r.removed) or (r.model_id is None and r.removed_name is not None), plan=r.plan,
        plan_id=r.plan_id, plan_chosen=bool(r.chosen), scheme=scheme, person=r.person, device=r.device,
        worker=r.worker_host, queued_at=_utc(r.created_at) or r.created_at, started_at=_utc(r.started_at),
        finished_at=_utc(r.finished_at), error=r.error, figures=figures,
        notes=[f"{n.author}: {n.text}" for n in notes if n.text], tags=tags)


def people(session: Session) -> list[str]:
    """The names of everyone who asked for a run, by name."""
    q = select(m.User.name).where(exists().where(m.Job.requested_by == m.User.id)).order_by(m.User.name)
    return list(session.scalars(q))


def plan_names(session: Session) -> list[str]:
    """The names of the stored plans (not their bodies, which name every layer)."""
    return list(session.scalars(select(m.Plan.name).distinct().order_by(m.Plan.name)))


def devices(session: Session) -> list[str]:
    """The device labels runs ran on."""
    return sorted(d for d in session.scalars(select(m.Job.device).distinct()) if d)


def tags(session: Session) -> list[str]:
    """Every tag written on a run."""
    found: dict[str, None] = {}
    for row in session.scalars(select(m.Note.tags).where(m.Note.target_kind == "job")):
        found.update(dict.fromkeys(row or []))
    return sorted(found)


def model_removed(session: Session, model_id: int | None) -> bool:
    """Whether the model is marked removed (its row kept for its history, its files gone)."""
    if model_id is None:
        return False
    return session.scalar(select(m.Model.removed_at).where(m.Model.id == model_id)) is not None


def record_environment(session: Session, job_id: int, environment: dict[str, Any]) -> None:
    """Keep the software the job runs with (keys of ENVIRONMENT_KEYS), in the caller's transaction."""
    session.execute(update(m.Job).where(m.Job.id == job_id).values(environment=dict(environment)))


def job_environment(session: Session, job_id: int) -> dict[str, Any] | None:
    """The software job ``job_id`` ran with; None where it was not recorded (started before migration 0013, or
    never started). NotFound for an unknown job."""
    row = session.execute(select(m.Job.id, m.Job.environment).where(m.Job.id == job_id)).first()
    if row is None:
        raise NotFound(f"no job #{job_id}")
    return dict(row.environment) if row.environment else None


def neighbours(session: Session, job_id: int, *, limit: int = 50) -> list[tuple[int, str, str]]:
    """(id, kind, status) of the runs a run may be compared with: those of its kind on its model first (newest
    first), then the newest of its kind; not itself, nor a shard."""
    row = session.execute(select(m.Job.kind, m.Job.model_id).where(m.Job.id == job_id)).first()
    if row is None:
        raise NotFound(f"no job #{job_id}")
    base = (select(m.Job.id, m.Job.kind, m.Job.status)
            .where(m.Job.kind == row.kind, m.Job.id != job_id, m.Job.id.not_in(select(m.SweepShard.job_id))))
    same = list(session.execute(base.where(m.Job.model_id == row.model_id).order_by(m.Job.id.desc()).limit(limit)))
    seen = {r.id for r in same}
    more = [r for r in session.execute(base.order_by(m.Job.id.desc()).limit(limit)) if r.id not in seen]
    return [(r.id, r.kind, r.status) for r in (same + more)[:limit]]
