"""The team's history: every run in one searchable, filterable, sortable table (the History page, ``quantplan
history``), and one run in full for its permalink page (parameters, software, device, worker, timings, results, the
plan version's change from its parent, notes).

Everyone reads the history, whatever their role. A page of it reads a bounded number of rows and no per-layer
details (store.history); a run's page reads that one run's.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import asdict, dataclass, field
from typing import Any

from quantplan.services.deployment import settings
from quantplan.services.errors import Refused
from quantplan.services.notes import TAG
from quantplan.services.scoring import pm_text
from store import history as store
from store import repo, team
from store.db import session_scope
from store.history import ENVIRONMENT_KEYS, MAX_PAGE, SORTS, HistoryFilter, HistoryRow
from store.models import JOB_KINDS, JOB_STATUSES
from store.records import JobRecord, ModelRecord, PlanRecord, ScoreRecord

__all__ = ["SORTS", "HistoryFilter", "HistoryRow", "history_filter", "history", "run", "headline"]

COLUMNS = ("id", "kind", "status", "model", "plan", "scheme", "person", "device", "worker", "started", "duration",
           "headline", "notes", "tags")
SOFTWARE_LABELS = {"quantplan": "quantplan", "git_commit": "git commit", "python": "Python", "torch": "torch",
                   "transformers": "transformers", "cuda": "CUDA (torch build)"}
NOT_RECORDED = "not recorded"


def _date(field_name: str, value: str | dt.date | None) -> dt.date | None:
    if value is None or value == "":
        return None
    if isinstance(value, dt.date):
        return value
    try:
        return dt.date.fromisoformat(str(value).strip())
    except ValueError:
        raise Refused(f"{field_name}: {value!r} is not a date; write it as YYYY-MM-DD (e.g. 2026-12-01)") from None


def history_filter(*, person: str | None = None, model: str | None = None, plan: str | None = None,
                   kind: str | None = None, status: str | None = None, device: str | None = None,
                   tag: str | None = None, since: str | dt.date | None = None, until: str | dt.date | None = None,
                   text: str | None = None) -> HistoryFilter:
    """A history filter from what a person typed or chose; Refused, naming the field, for an unknown kind or
    status, a date that is not YYYY-MM-DD, a range that ends before it starts, a tag that is no tag."""
    def clean(value: str | None) -> str | None:
        return value.strip() or None if isinstance(value, str) else value

    kind, status, tag = clean(kind), clean(status), clean(tag)
    if kind is not None and kind not in JOB_KINDS:
        raise Refused(f"kind: {kind!r} is no kind of run; choose one of {', '.join(JOB_KINDS)}")
    if status is not None and status not in JOB_STATUSES:
        raise Refused(f"status: {status!r} is no status; choose one of {', '.join(JOB_STATUSES)}")
    if tag is not None and not TAG.match(tag):
        raise Refused(f"tag: {tag!r} is no tag (one word of letters, digits and _ . : + -, at most 40 characters)")
    start, end = _date("since", since), _date("until", until)
    if start and end and end < start:
        raise Refused(f"until ({end}) is before since ({start}): no day is in that range")
    return HistoryFilter(person=clean(person), model=clean(model), plan=clean(plan), kind=kind, status=status,
                         device=clean(device), tag=tag, since=start, until=end, text=clean(text))


@dataclass(frozen=True)
class HistoryPage:
    rows: list[HistoryRow]
    total: int  # runs that pass the filter, on every page
    page: int
    pages: int
    page_size: int


def history(f: HistoryFilter | None = None, *, sort: str = "id", descending: bool = True, page: int = 1,
            page_size: int = 50) -> HistoryPage:
    """Page ``page`` (from 1) of the runs that pass ``f``, ``page_size`` a page, sorted by ``sort`` (one of SORTS).
    Refused for an unknown sort or a page size outside 1..500; a page past the last is the last."""
    if sort not in SORTS:
        raise Refused(f"sort: {sort!r} is no column to sort by; choose one of {', '.join(SORTS)}")
    if not 1 <= page_size <= MAX_PAGE:
        raise Refused(f"page size: {page_size} runs; a page holds 1 to {MAX_PAGE}")
    if page < 1:
        raise Refused(f"page: {page}; pages count from 1")
    f = f or HistoryFilter()
    with session_scope(settings()) as s:
        rows, total = store.history(s, f, sort=sort, descending=descending, offset=(page - 1) * page_size,
                                    limit=page_size)
        pages = max(1, -(-total // page_size))
        if page > pages:  # a filter left fewer pages than the one asked for: its last
            page = pages
            rows, total = store.history(s, f, sort=sort, descending=descending, offset=(page - 1) * page_size,
                                        limit=page_size)
    return HistoryPage(rows=rows, total=total, page=page, pages=pages, page_size=page_size)


def headline(row: HistoryRow) -> str:
    """A run's headline figures in a few words: a score's KL ± its error and top-1, a calibration's strongest
    outlier, a sweep's most sensitive unit, a benchmark's best speed-up per kernel path; "" where it has none."""
    f = row.figures
    if row.kind == "score" and f.get("kl_mean") is not None:
        top1 = f" · top-1 {f['top1_agree']:.4f}" if f.get("top1_agree") is not None else ""
        return f"KL {pm_text(f['kl_mean'], f.get('kl_mean_err'))}{top1}"
    if row.kind == "calibrate" and f.get("layers") is not None:
        top = (f" · top outlier ×{f['top_outlier_ratio']:,.0f} {f['top_layer']}"
               if f.get("top_outlier_ratio") is not None and f.get("top_layer") else "")
        return f"{f['layers']} layers{top}"
    if row.kind == "sensitivity" and f.get("units") is not None:
        top = (f" · most sensitive {f['top_unit']} (KL {f['top_kl']:.3g})"
               if f.get("top_unit") and f.get("top_kl") is not None else "")
        return f"{f['units']} units{top}"
    if row.kind == "bench" and f:
        best = sorted((f.get("speedups") or {}).items(), key=lambda kv: -kv[1])
        speed = ", ".join(f"{path} ×{value:.2f}" for path, value in best[:3])
        counts = f"{f.get('measured') or 0} measured, {f.get('reused') or 0} reused"
        return f"best {speed} ({counts})" if speed else counts
    return ""


def row_dict(row: HistoryRow) -> dict[str, Any]:
    """A run as the CLI's JSON and the page's table carry it."""
    d = asdict(row)
    for key in ("queued_at", "started_at", "finished_at"):
        d[key] = d[key].isoformat() if d[key] else None
    return {**d, "duration_s": row.duration_s, "headline": headline(row)}


@dataclass(frozen=True)
class Choices:
    """What the History page's filters offer."""

    people: list[str]
    models: list[str]
    plans: list[str]
    devices: list[str]
    tags: list[str]


def choices() -> Choices:
    """The people, models, plan names, devices and tags the history holds (no plan body, no model summary)."""
    with session_scope(settings()) as s:
        return Choices(people=store.people(s), models=[m.name for m in repo.list_models(s, include_removed=True)],
                       plans=store.plan_names(s), devices=store.devices(s), tags=store.tags(s))


@dataclass(frozen=True)
class Run:
    """One run in full, for its permalink page."""

    job: JobRecord
    environment: dict[str, Any] | None  # None: not recorded (started before it was kept, or never started)
    model: ModelRecord | None  # None: no model, or one purged since (``model_name`` still names it)
    model_name: str | None
    model_removed: bool
    plan: PlanRecord | None
    parent: PlanRecord | None  # the plan version it was edited from
    score: ScoreRecord | None
    outliers: list[dict[str, Any]] = field(default_factory=list)  # a calibration's 10 strongest, by ratio
    sensitivity: list[dict[str, Any]] = field(default_factory=list)  # a sweep's 10 most sensitive units
    kernels: list[dict[str, Any]] = field(default_factory=list)  # a benchmark's records, measured and reused
    notes: list[team.NoteRecord] = field(default_factory=list)
    neighbours: list[tuple[int, str, str]] = field(default_factory=list)  # (id, kind, status) to compare with

    @property
    def software(self) -> list[tuple[str, str]]:
        """(what, version) of each piece of software, "not recorded" for a run from before it was kept."""
        env = self.environment or {}
        return [(SOFTWARE_LABELS[k], NOT_RECORDED if self.environment is None
                 else str(env.get(k)) if env.get(k) is not None else "none found") for k in ENVIRONMENT_KEYS]

    @property
    def timings(self) -> list[tuple[str, str]]:
        j = self.job
        ran = j.run_seconds()
        waited = ((j.started_at - j.created_at).total_seconds()
                  if j.started_at is not None and j.started_at.tzinfo == j.created_at.tzinfo else None)
        return [("queued", j.created_at.strftime("%Y-%m-%d %H:%M:%S")),
                ("started", j.started_at.strftime("%Y-%m-%d %H:%M:%S") if j.started_at else "never"),
                ("finished", j.finished_at.strftime("%Y-%m-%d %H:%M:%S") if j.finished_at else "not yet"),
                ("waited in its queue", "—" if waited is None else f"{max(waited, 0.0):,.1f} s"),
                ("ran" if j.finished_at else "running for", "—" if ran is None else f"{ran:,.1f} s")]


def run(job_id: int) -> Run:
    """Job ``job_id`` in full: store.repo.NotFound (a LookupError) naming it when there is none."""
    with session_scope(settings()) as s:
        job = repo.get_job(s, job_id)
        environment = store.job_environment(s, job_id)
        model = None
        if job.model_id is not None:
            try:
                model = repo.get_model(s, job.model_id)
            except LookupError:
                model = None
        removed_name = job.params.get(repo.REMOVED_MODEL_KEY)
        removed = removed_name is not None or store.model_removed(s, job.model_id)
        plan = parent = None
        if job.plan_id is not None:
            try:
                plan = repo.get_plan(s, job.plan_id)
                parent = repo.get_plan(s, plan.parent_id) if plan.parent_id is not None else None
            except LookupError:
                pass
        score = None
        if job.kind == "score":
            try:
                score = repo.get_score(s, job.id)
            except LookupError:
                score = None
        outliers = (sorted(repo.stats_overview(s, job.id), key=lambda r: -r["outlier_ratio"])[:10]
                    if job.kind == "calibrate" else [])
        sensitivity = ([{"unit": r.unit, "kl_mean": r.kl_mean, "kl_mean_err": r.kl_mean_err,
                         "top1_agree": r.top1_agree, "sqnr_db": r.sqnr_db}
                        for r in repo.list_sensitivity(s, job.id)[:10]] if job.kind == "sensitivity" else [])
        kernels = list((job.result or {}).get("records") or []) if job.kind == "bench" else []
        notes = team.list_notes(s, "job", job.id)
        near = store.neighbours(s, job.id)
    return Run(job=job, environment=environment, model=model, model_name=model.name if model else removed_name,
               model_removed=removed, plan=plan, parent=parent, score=score, outliers=outliers,
               sensitivity=sensitivity, kernels=kernels, notes=notes, neighbours=near)


def parameters(job: JobRecord) -> dict[str, Any]:
    """The run's parameters as asked, a scored plan file shown by its name and size rather than every layer."""
    out: dict[str, Any] = {}
    for key, value in sorted(job.params.items()):
        if key == "plan" and isinstance(value, dict):
            layers, rules = value.get("layers") or {}, value.get("rules") or []
            out[key] = (f"plan file{' ' + value['name'] if value.get('name') else ''}: default "
                        f"{value.get('default')}, {len(rules)} rule(s), {len(layers)} layer override(s)")
        else:
            out[key] = value
    return out
