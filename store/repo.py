"""Repositories: every read and write of the database, returning plain records.

Functions take an open Session (from ``store.db.session_scope``) so a caller can
group several writes into one transaction, as the worker does when it stores a
job's results and marks it succeeded.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Sequence
from dataclasses import fields as dataclass_fields
from typing import Any, cast

import numpy as np
from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.engine import CursorResult
from sqlalchemy.orm import Session

from store import models as m
from store.records import (
    ActivationStatRecord,
    ActivationStats,
    DatasetRecord,
    JobRecord,
    KernelRecordRow,
    ModelListing,
    ModelRecord,
    PlanRecord,
    ScoreRecord,
    SensitivityRecord,
    WorkerRecord,
)

DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"


class NotFound(LookupError):
    pass


def _write(session: Session, statement: Any) -> CursorResult[Any]:
    """Run an UPDATE / DELETE and return its result, whose ``rowcount`` says how many rows it changed."""
    return cast(CursorResult[Any], session.execute(statement))


# ----------------------------------------------------------------------------- users


def user_id(session: Session, name: str | None) -> int | None:
    if not name:
        return None
    uid = session.scalar(select(m.User.id).where(m.User.name == name))
    if uid is None:  # name and time only: a name recorded as who asked has no role (store.team), at any revision
        uid = session.execute(insert(m.User).values(name=name, created_at=m.utcnow()).returning(m.User.id)).scalar_one()
    return uid


def _user_name(session: Session, uid: int | None) -> str | None:
    if uid is None:
        return None
    return session.scalar(select(m.User.name).where(m.User.id == uid))


# ----------------------------------------------------------------------------- models


def _model_record(row: m.Model) -> ModelRecord:
    return ModelRecord(
        id=row.id, name=row.name, sha256=row.sha256, source_kind=row.source_kind,
        source_name=row.source_name, path=row.path, architecture=row.architecture,
        model_type=row.model_type, num_layers=row.num_layers, num_params=row.num_params, dtype=row.dtype,
        hidden_size=row.hidden_size, vocab_size=row.vocab_size, total_bytes=row.total_bytes,
        summary=row.summary, created_at=row.created_at, removed_at=row.removed_at, removed_by=row.removed_by,
    )


def model_by_sha(session: Session, sha256: str) -> ModelRecord | None:
    """The model registered with this checkpoint content, if any (a removed one, whose files are gone, is not)."""
    row = session.scalar(select(m.Model).where(m.Model.sha256 == sha256, m.Model.removed_at.is_(None)))
    return None if row is None else _model_record(row)


def model_by_source(session: Session, source_kind: str, source_name: str) -> ModelRecord | None:
    """The model registered from this source (e.g. kind "hub", ``hf://ORG/NAME@<commit>``), if any; not a removed
    one (its files are gone)."""
    row = session.scalar(select(m.Model).where(m.Model.source_kind == source_kind, m.Model.removed_at.is_(None),
                                               m.Model.source_name == source_name).order_by(m.Model.id).limit(1))
    return None if row is None else _model_record(row)


def add_model(session: Session, *, name: str, sha256: str, source_kind: str, source_name: str, path: str,
              summary: dict[str, Any], user: str | None) -> ModelRecord:
    """Register a stored checkpoint. The same content registered twice returns the first record."""
    existing = model_by_sha(session, sha256)
    if existing is not None:
        return existing
    gone = session.scalar(select(m.Model).where(m.Model.sha256 == sha256))
    if gone is not None:  # removed (store.removal), its files stored again now: back, with the results it kept
        gone.removed_at, gone.removed_by, gone.path = None, None, path
        session.flush()
        return _model_record(gone)
    base, n = name, 1
    while session.scalar(select(m.Model.id).where(m.Model.name == name)) is not None:
        n += 1
        name = f"{base}-{n}"
    row = m.Model(
        name=name, sha256=sha256, source_kind=source_kind, source_name=source_name, path=path,
        architecture=summary.get("architecture", "?"), model_type=summary.get("model_type", "?"),
        num_layers=int(summary.get("num_layers", 0)), num_params=int(summary.get("num_params", 0)),
        dtype=str(summary.get("dtype", "?")), hidden_size=summary.get("hidden_size"),
        vocab_size=summary.get("vocab_size"), total_bytes=int(summary.get("total_bytes", 0)),
        summary=summary, created_by=user_id(session, user),
    )
    session.add(row)
    session.flush()
    return _model_record(row)


_LISTING_COLUMNS = tuple(getattr(m.Model, f.name) for f in dataclass_fields(ModelListing))


def list_models(session: Session, *, include_removed: bool = False) -> list[ModelListing]:
    """Every registered model, oldest first, as a listing shows it: the summary column is not read. Removed models
    (store.removal) only with ``include_removed`` (a history naming them), never for new work."""
    q = select(*_LISTING_COLUMNS).order_by(m.Model.id)
    rows = session.execute(q if include_removed else q.where(m.Model.removed_at.is_(None)))
    return [ModelListing(**{**row._asdict(), "overview": row.overview or {}}) for row in rows]


def set_model_overview(session: Session, model_id: int, overview: dict[str, Any]) -> None:
    """Store what a listing shows of a model (records.ModelListing.overview)."""
    row = session.get(m.Model, model_id)
    if row is not None:
        row.overview = dict(overview)


def get_model(session: Session, ref: int | str) -> ModelRecord:
    """A model by id, by name, or ``demo`` for the demo model."""
    row = None
    if isinstance(ref, int) or (isinstance(ref, str) and ref.isdigit()):
        row = session.get(m.Model, int(ref))
    if row is None and isinstance(ref, str):
        name = DEMO_MODEL_NAME if ref == "demo" else ref
        row = session.scalar(select(m.Model).where(m.Model.name == name))
        if row is None and ref == "demo":
            row = session.scalar(select(m.Model).where(m.Model.source_kind == "demo"))
    if row is None:
        names = ", ".join(r.name for r in session.scalars(select(m.Model).order_by(m.Model.id))) or "none yet"
        hint = " Register it with `quantplan models add --demo`." if ref == "demo" else ""
        raise NotFound(f"no model {ref!r} is registered (registered: {names}).{hint}")
    return _model_record(row)


def add_model_summary_fields(session: Session, model_id: int, fields: dict[str, Any],
                             replace: Sequence[str] = ()) -> ModelRecord:
    """Add fields that a later quantplan summarises (e.g. ``attention_windows``) to a model's intake summary;
    fields it already has are kept as they are, except those named in ``replace`` (a later quantplan sees more
    of them, e.g. an MoE model's expert ``linears``)."""
    row = session.get(m.Model, model_id)
    if row is None:
        raise NotFound(f"no model #{model_id}")
    kept = {k: v for k, v in (row.summary or {}).items() if k not in replace or k not in fields}
    row.summary = {**fields, **kept}  # a new dict: the JSON column sees the change
    row.overview = None  # derived from the summary: the next listing writes it anew
    session.flush()
    return _model_record(row)


def model_usage(session: Session, model_id: int) -> dict[str, int]:
    """How much is stored about one model: calibrations, scores, sensitivity sweeps, plan versions, and
    its jobs that are still queued or running (``active``)."""

    def count(q) -> int:
        return int(session.scalar(select(func.count()).select_from(q.subquery())) or 0)

    return {
        "calibrations": count(select(m.ActivationStat.job_id).where(m.ActivationStat.model_id == model_id)
                              .distinct()),
        "scores": count(select(m.ScoreResult.id).where(m.ScoreResult.model_id == model_id)),
        "sensitivity sweeps": count(select(m.SensitivityResult.job_id)
                                    .where(m.SensitivityResult.model_id == model_id).distinct()),
        "plan versions": count(select(m.Plan.id).where(m.Plan.model_id == model_id)),
        "active": count(select(m.Job.id).where(m.Job.model_id == model_id,
                                               m.Job.status.in_(("queued", "running")))),
    }


REMOVED_MODEL_KEY = "removed_model"  # job params: the name of the model a job ran on, once it is removed


def delete_model(session: Session, model_id: int) -> None:
    """Delete a model row: its statistics, scores, sensitivity rows and plans go with it (ON DELETE
    CASCADE); its jobs stay in the history with no model (SET NULL), their params naming the model
    they ran on (``removed_model``), so the history still says what they were about."""
    row = session.get(m.Model, model_id)
    if row is None:
        return
    for job in session.scalars(select(m.Job).where(m.Job.model_id == model_id)):
        job.params = {**(job.params or {}), REMOVED_MODEL_KEY: row.name}  # a new dict: JSON columns track assignment
    # plans of one model point at each other (parent_id): unlink them first, so no database has to
    # order the cascade within the table
    session.execute(update(m.Plan).where(m.Plan.model_id == model_id).values(parent_id=None))
    session.flush()
    session.execute(delete(m.Model).where(m.Model.id == model_id))


# ----------------------------------------------------------------------------- datasets


def _dataset_record(row: m.Dataset) -> DatasetRecord:
    return DatasetRecord(id=row.id, name=row.name, role=row.role, sha256=row.sha256, path=row.path,
                         builtin=row.builtin, n_documents=row.n_documents, n_bytes=row.n_bytes,
                         created_at=row.created_at)


def add_dataset(session: Session, *, name: str, role: str, sha256: str, path: str, n_documents: int,
                n_bytes: int, builtin: bool = False, user: str | None = None) -> DatasetRecord:
    existing = session.scalar(select(m.Dataset).where(m.Dataset.name == name))
    if existing is not None:
        if existing.sha256 == sha256:
            return _dataset_record(existing)
        raise ValueError(f"a dataset named {name!r} with other content exists; choose another name")
    row = m.Dataset(name=name, role=role, sha256=sha256, path=path, n_documents=n_documents, n_bytes=n_bytes,
                    builtin=builtin, created_by=user_id(session, user))
    session.add(row)
    session.flush()
    return _dataset_record(row)


def list_datasets(session: Session) -> list[DatasetRecord]:
    return [_dataset_record(r) for r in session.scalars(select(m.Dataset).order_by(m.Dataset.id))]


def get_dataset(session: Session, ref: int | str) -> DatasetRecord:
    row = None
    if isinstance(ref, int) or (isinstance(ref, str) and ref.isdigit()):
        row = session.get(m.Dataset, int(ref))
    if row is None:
        row = session.scalar(select(m.Dataset).where(m.Dataset.name == str(ref)))
    if row is None:
        raise NotFound(f"no dataset {ref!r}")
    return _dataset_record(row)


# ----------------------------------------------------------------------------- jobs


def _job_record(session: Session, row: m.Job) -> JobRecord:
    return JobRecord(
        id=row.id, kind=row.kind, status=row.status, queue=row.queue, params=dict(row.params or {}),
        model_id=row.model_id, plan_id=row.plan_id, progress=row.progress, message=row.message or "",
        error=row.error, traceback=row.traceback, result=row.result, worker_host=row.worker_host,
        device=row.device, torch_version=row.torch_version, celery_task_id=row.celery_task_id,
        cancel_requested=row.cancel_requested, requested_by=_user_name(session, row.requested_by),
        created_at=row.created_at, started_at=row.started_at, finished_at=row.finished_at,
        heartbeat_at=row.heartbeat_at,
    )


def create_job(session: Session, *, kind: str, params: dict[str, Any], queue: str, user: str | None,
               model_id: int | None = None, plan_id: int | None = None) -> JobRecord:
    if kind not in m.JOB_KINDS:
        raise ValueError(f"unknown job kind {kind!r}; valid: {', '.join(m.JOB_KINDS)}")
    row = m.Job(kind=kind, params=params, queue=queue, model_id=model_id, plan_id=plan_id,
                requested_by=user_id(session, user), status="queued", progress=0.0, message="queued")
    session.add(row)
    session.flush()
    return _job_record(session, row)


def get_job(session: Session, job_id: int) -> JobRecord:
    row = session.get(m.Job, job_id)
    if row is None:
        raise NotFound(f"no job #{job_id}")
    return _job_record(session, row)


def _job_filter(q: Any, kind: str | Sequence[str] | None, model_id: int | None, status: Sequence[str] | None) -> Any:
    q = q.where(m.Job.id.not_in(select(m.SweepShard.job_id)))  # a sharded sweep is listed once (store.shards)
    if kind:
        q = q.where(m.Job.kind.in_([kind] if isinstance(kind, str) else list(kind)))
    if model_id is not None:
        q = q.where(m.Job.model_id == model_id)
    if status is not None:  # None: any status; an empty list: none (a filter that leaves no status)
        q = q.where(m.Job.status.in_(list(status)))
    return q


def list_jobs(session: Session, *, limit: int = 100, kind: str | Sequence[str] | None = None,
              model_id: int | None = None, status: Sequence[str] | None = None, offset: int = 0) -> list[JobRecord]:
    """Newest first, ``offset`` newest ones skipped (a page of the history); ``kind`` is one kind or several."""
    q = _job_filter(select(m.Job), kind, model_id, status).order_by(m.Job.id.desc()).offset(offset).limit(limit)
    return [_job_record(session, r) for r in session.scalars(q)]


def count_jobs(session: Session, *, kind: str | Sequence[str] | None = None, model_id: int | None = None,
               status: Sequence[str] | None = None) -> int:
    """How many jobs :func:`list_jobs` pages through with the same filters."""
    return int(session.scalar(_job_filter(select(func.count(m.Job.id)), kind, model_id, status)) or 0)


def set_celery_task_id(session: Session, job_id: int, task_id: str) -> None:
    session.execute(update(m.Job).where(m.Job.id == job_id).values(celery_task_id=task_id))


def mark_running(session: Session, job_id: int, *, worker_host: str, device: str, torch_version: str) -> bool:
    """queued → running, in one UPDATE that asks for ``queued``: exactly one delivery of a job's task runs it.
    False for any other status: a job running elsewhere (a task redelivered while its worker lives, or after it
    died: the sweep fails that job), finished, or cancelled before it started; the worker then drops the task."""
    now = m.utcnow()
    res = _write(session,
        update(m.Job)
        .where(m.Job.id == job_id, m.Job.status == "queued", m.Job.cancel_requested.is_(False))
        .values(status="running", worker_host=worker_host, device=device, torch_version=torch_version,
                started_at=now, heartbeat_at=now, progress=0.0, message="started", error=None, traceback=None)
    )
    return res.rowcount == 1


def report_progress(session: Session, job_id: int, fraction: float, message: str) -> bool:
    """Write progress + heartbeat; returns True when a cancel was requested."""
    fraction = min(max(float(fraction), 0.0), 1.0)
    session.execute(
        update(m.Job).where(m.Job.id == job_id, m.Job.status == "running")
        .values(progress=fraction, message=message[:2000], heartbeat_at=m.utcnow())
    )
    return bool(session.scalar(select(m.Job.cancel_requested).where(m.Job.id == job_id)))


JOB_HEARTBEAT_S = 30.0  # a running job's heartbeat, written from a thread also while it reports nothing


def beat_interval_s(stale_after_s: float) -> float:
    """Seconds between a running job's heartbeats and between two stale-job sweeps of a live worker (or a waiting
    CLI): a quarter of the stale limit, at most :data:`JOB_HEARTBEAT_S`. A job whose process died is failed within
    ``stale_after_s`` plus this after its last heartbeat (120 + 30 s by default)."""
    return max(min(JOB_HEARTBEAT_S, stale_after_s / 4), 0.05)


def job_heartbeat(session: Session, job_id: int) -> None:
    """Its process is alive: the heartbeat of a running job, without touching its progress."""
    session.execute(update(m.Job).where(m.Job.id == job_id, m.Job.status == "running").values(heartbeat_at=m.utcnow()))


def request_cancel(session: Session, job_id: int) -> JobRecord:
    """A queued job is cancelled at once; a running one stops at its next batch."""
    row = session.get(m.Job, job_id)
    if row is None:
        raise NotFound(f"no job #{job_id}")
    if row.status == "queued":
        row.status, row.finished_at, row.message, row.cancel_requested = ("cancelled", m.utcnow(),
                                                                    "by request, before it started", True)
    elif row.status == "running":
        row.cancel_requested = True
        row.message = "cancel requested; stopping after the current batch"
    for shard_id in list(session.scalars(select(m.SweepShard.job_id).where(m.SweepShard.parent_id == job_id))):
        request_cancel(session, shard_id)  # a sharded sweep's every shard (store.shards)
    session.flush()
    return _job_record(session, row)


def finish_job(session: Session, job_id: int, *, status: str, message: str = "", error: str | None = None,
               traceback: str | None = None, result: dict[str, Any] | None = None) -> None:
    if status not in m.FINISHED_STATUSES:
        raise ValueError(f"finish_job needs one of {m.FINISHED_STATUSES}, not {status!r}")
    values: dict[str, Any] = dict(status=status, message=message[:2000], error=error, traceback=traceback,
                                  finished_at=m.utcnow(), heartbeat_at=m.utcnow())
    if status == "succeeded":
        values["progress"] = 1.0
    if result is not None:
        values["result"] = result
    session.execute(update(m.Job).where(m.Job.id == job_id).values(**values))


def _aware(t: dt.datetime) -> dt.datetime:
    """A UTC datetime with its time zone: SQLite hands back naive ones."""
    return t.replace(tzinfo=dt.UTC) if t.tzinfo is None else t


LOCAL_QUEUE = "local"  # = jobs.routing.LOCAL_QUEUE: a job its own process runs (CLI --local), sent to no broker


def sweep_stale_jobs(session: Session, *, stale_after_s: float) -> list[int]:
    """Fail running jobs whose heartbeat is older than stale_after_s (their worker died), and jobs of queue
    ``local`` still queued that long after they were written (the process that wrote them to run them at once
    died first: nothing else will ever take them); the ids failed.

    Each is failed by an UPDATE that still asks for the status and heartbeat it was read with, so a job
    whose worker beats, finishes or is cancelled between the read and the write is left as that worker set it.
    """
    stale = _sweep_running(session, stale_after_s)
    cutoff = m.utcnow() - dt.timedelta(seconds=stale_after_s)
    for job_id, created_at in session.execute(select(m.Job.id, m.Job.created_at).where(
            m.Job.status == "queued", m.Job.queue == LOCAL_QUEUE)).all():
        if _aware(created_at) >= cutoff:
            continue
        res = _write(session, update(m.Job).where(m.Job.id == job_id, m.Job.status == "queued").values(
            status="failed", finished_at=m.utcnow(), message="failed",
            error=f"the process that was to run it here (--local) stopped before it started (over {stale_after_s:g} "
                  "s ago). Run it again."))
        if res.rowcount == 1:
            stale.append(job_id)
    return stale


def queued_for_workers(session: Session, *, older_than_s: float) -> list[tuple[int, str]]:
    """(job id, Celery task id) of the jobs queued for a worker (not ``local``) for over ``older_than_s``: those
    whose message a worker took and then died before marking them running are among them (jobs.broker)."""
    cutoff = m.utcnow() - dt.timedelta(seconds=older_than_s)
    rows = session.execute(select(m.Job.id, m.Job.celery_task_id, m.Job.created_at).where(
        m.Job.status == "queued", m.Job.queue != LOCAL_QUEUE, m.Job.celery_task_id.is_not(None))).all()
    return [(job_id, str(task_id)) for job_id, task_id, created_at in rows if _aware(created_at) < cutoff]


SHARD_ATTEMPTS = 2  # a sweep's shard that fails, or whose worker is lost, runs once more, alone (store.shards)


def _requeue_lost_shard(session: Session, job_id: int, *, heartbeat_at: Any, stale_after_s: float,
                        host: str | None) -> bool:
    """The stale-job sweep found the running job ``job_id`` without a heartbeat for ``stale_after_s`` (its worker was
    killed, or its machine lost): when it is a shard with attempts left (:data:`SHARD_ATTEMPTS`) and neither it nor
    its sweep was asked to cancel, it goes back to ``queued`` (its ``heartbeat_at`` as read, so a worker that beats
    meanwhile keeps it), for the next worker of its queue to run alone, instead of failing the sweep (store.shards).
    The broker hands its task out again: Redis once its visibility timeout passes, kombu's SQLAlchemy transport
    through the workers' lost-task restore (worker.runner.restore_lost_tasks), both with the chord's own task id.
    False for anything else (the sweep fails it as any job)."""
    row = session.scalar(select(m.SweepShard).where(m.SweepShard.job_id == job_id))
    if row is None or row.attempts >= SHARD_ATTEMPTS:
        return False
    if session.scalar(select(m.Job.cancel_requested).where(m.Job.id == row.parent_id)):
        return False
    unchanged = m.Job.heartbeat_at.is_(None) if heartbeat_at is None else m.Job.heartbeat_at == heartbeat_at
    res = session.execute(update(m.Job).where(m.Job.id == job_id, m.Job.status == "running",
                                              m.Job.cancel_requested.is_(False), unchanged)
                          .values(status="queued", progress=0.0, started_at=None, heartbeat_at=None,
                                  message=f"attempt {row.attempts} lost: its worker stopped reporting (no heartbeat "
                                          f"for over {stale_after_s:g} s; last from {host or 'unknown host'}); "
                                          "queued again, to run alone on the next free worker"))
    return bool(getattr(res, "rowcount", 0) == 1)


def _sweep_running(session: Session, stale_after_s: float) -> list[int]:
    """The running half of :func:`sweep_stale_jobs`."""
    cutoff = m.utcnow() - dt.timedelta(seconds=stale_after_s)
    rows = session.execute(select(m.Job.id, m.Job.heartbeat_at, m.Job.started_at, m.Job.created_at,
                                  m.Job.worker_host).where(m.Job.status == "running")).all()
    stale = []
    beating = set(session.scalars(select(m.SweepShard.parent_id).join(m.Job, m.Job.id == m.SweepShard.job_id)
                                  .where(m.Job.status.in_(("queued", "running")))))  # sweeps whose shards beat
    for job_id, heartbeat_at, started_at, created_at, host in rows:
        if _aware(heartbeat_at or started_at or created_at) >= cutoff or job_id in beating:
            continue
        if _requeue_lost_shard(session, job_id, heartbeat_at=heartbeat_at, stale_after_s=stale_after_s, host=host):
            continue  # a sharded sweep's shard with attempts left: queued again, its sweep goes on
        unchanged = m.Job.heartbeat_at.is_(None) if heartbeat_at is None else m.Job.heartbeat_at == heartbeat_at
        res = _write(session,
            update(m.Job).where(m.Job.id == job_id, m.Job.status == "running", unchanged).values(
                status="failed", finished_at=m.utcnow(),
                error=(f"the worker stopped reporting (no heartbeat for over {stale_after_s:g} s; "
                       f"last from {host or 'unknown host'}). Queue the job again.")))
        if res.rowcount == 1:
            stale.append(job_id)
    return stale


# ----------------------------------------------------------------------------- workers


def _worker_record(row: m.Worker) -> WorkerRecord:
    return WorkerRecord(id=row.id, name=row.name, host=row.host,
                        queues=[q for q in row.queues.split(",") if q], device=row.device,
                        device_name=row.device_name, device_class=row.device_class,
                        torch_version=row.torch_version, started_at=_aware(row.started_at),
                        seen_at=_aware(row.seen_at))


def worker_started(session: Session, *, name: str, host: str, queues: Sequence[str], device: str,
                   device_name: str, device_class: str, torch_version: str | None) -> WorkerRecord:
    """Record (or re-record, after a restart) a worker process and the queues it consumes."""
    row = session.scalars(select(m.Worker).where(m.Worker.name == name)).first()
    now = m.utcnow()
    if row is None:
        row = m.Worker(name=name)
        session.add(row)
    row.host, row.queues, row.device = host, ",".join(queues), device
    row.device_name, row.device_class, row.torch_version = device_name, device_class, torch_version
    row.started_at = row.seen_at = now
    session.flush()
    return _worker_record(row)


def worker_seen(session: Session, name: str) -> bool:
    """Refresh a worker's seen_at; False when no such worker was recorded."""
    res = _write(session, update(m.Worker).where(m.Worker.name == name).values(seen_at=m.utcnow()))
    return bool(res.rowcount)


def forget_worker(session: Session, name: str) -> None:
    session.execute(delete(m.Worker).where(m.Worker.name == name))


def list_workers(session: Session, *, seen_within_s: float | None = None) -> list[WorkerRecord]:
    """Workers, most recently seen first; only those seen in the last seen_within_s seconds when given."""
    rows = [_worker_record(r) for r in session.scalars(select(m.Worker).order_by(m.Worker.seen_at.desc(), m.Worker.id))]
    if seen_within_s is not None:  # compared here: SQLite keeps no time zone to compare with
        cutoff = m.utcnow() - dt.timedelta(seconds=seen_within_s)
        rows = [r for r in rows if r.seen_at >= cutoff]
    return rows


def pending_cleanup_dirs(session: Session) -> set[str]:
    """Upload folders that a queued or running job will still read (its ``params['cleanup_dir']``)."""
    rows = session.scalars(select(m.Job.params).where(m.Job.status.in_(("queued", "running"))))
    return {str(p["cleanup_dir"]) for p in rows if isinstance(p, dict) and p.get("cleanup_dir")}


# ----------------------------------------------------------------------------- activation statistics


def _f32(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, dtype="<f4").tobytes()


def save_activation_stats(session: Session, *, job_id: int, model_id: int, stats: Iterable[ActivationStats]) -> int:
    """Replace the statistics of job_id (idempotent on a rerun) with these; returns the row count."""
    session.execute(delete(m.ActivationStat).where(m.ActivationStat.job_id == job_id))
    n = 0
    for st in stats:
        session.add(m.ActivationStat(
            job_id=job_id, model_id=model_id, layer=st.name, in_features=int(st.in_features),
            out_features=int(st.out_features), n_tokens=int(st.n_tokens),
            outlier_ratio=float(min(st.outlier_ratio, 1e30)), amax=float(st.amax),
            channel_max=_f32(st.channel_max), weight_channel_max=_f32(st.weight_channel_max),
            token_max={k: float(v) for k, v in st.token_max.items()},
            hist_counts=np.ascontiguousarray(st.hist_counts, dtype="<i8").tobytes(), zeros=int(st.zeros),
        ))
        n += 1
    session.flush()
    return n


def _layer_stats(row: m.ActivationStat) -> ActivationStatRecord:
    return ActivationStatRecord(
        name=row.layer, in_features=row.in_features, out_features=row.out_features, n_tokens=row.n_tokens,
        channel_max=np.frombuffer(row.channel_max, dtype="<f4").copy(),
        weight_channel_max=np.frombuffer(row.weight_channel_max, dtype="<f4").copy(),
        token_max=dict(row.token_max or {}),
        hist_counts=np.frombuffer(row.hist_counts, dtype="<i8").copy(), zeros=row.zeros,
        outlier_ratio=float(row.outlier_ratio), amax=float(row.amax),
    )


def load_activation_stats(session: Session, job_id: int) -> list[ActivationStatRecord]:
    """The statistics job_id saved, layer by layer in the order they were saved."""
    rows = session.scalars(select(m.ActivationStat).where(m.ActivationStat.job_id == job_id)
                           .order_by(m.ActivationStat.id))
    return [_layer_stats(r) for r in rows]


def stats_overview(session: Session, job_id: int) -> list[dict[str, Any]]:
    """Per-layer scalars only (no arrays): for tables and the JSON output of the CLI."""
    q = select(m.ActivationStat.layer, m.ActivationStat.in_features, m.ActivationStat.out_features,
               m.ActivationStat.outlier_ratio, m.ActivationStat.amax, m.ActivationStat.n_tokens) \
        .where(m.ActivationStat.job_id == job_id).order_by(m.ActivationStat.id)
    return [dict(name=r[0], in_features=r[1], out_features=r[2], outlier_ratio=r[3], amax=r[4], n_tokens=r[5])
            for r in session.execute(q)]


def calibrations(session: Session, model_id: int) -> list[JobRecord]:
    """Succeeded calibrate jobs of a model, newest first."""
    return list_jobs(session, kind="calibrate", model_id=model_id, status=("succeeded",), limit=1000)


def latest_calibration(session: Session, model_id: int) -> JobRecord | None:
    jobs = calibrations(session, model_id)
    return jobs[0] if jobs else None


# ----------------------------------------------------------------------------- plans


def _plan_record(session: Session, row: m.Plan) -> PlanRecord:
    return PlanRecord(id=row.id, model_id=row.model_id, name=row.name, version=row.version,
                      parent_id=row.parent_id, body=dict(row.body), note=row.note or "",
                      author=_user_name(session, row.created_by), created_at=row.created_at)


def save_plan(session: Session, *, model_id: int, name: str, body: dict[str, Any], user: str | None,
              note: str = "", parent_id: int | None = None) -> PlanRecord:
    """Write a new version of plan `name` for the model (version = last + 1; parent = last unless given)."""
    last = session.scalar(select(m.Plan).where(m.Plan.model_id == model_id, m.Plan.name == name)
                          .order_by(m.Plan.version.desc()).limit(1))
    version = 1 if last is None else last.version + 1
    if parent_id is None and last is not None:
        parent_id = last.id
    row = m.Plan(model_id=model_id, name=name, version=version, parent_id=parent_id, body=body, note=note,
                 created_by=user_id(session, user))
    session.add(row)
    session.flush()
    return _plan_record(session, row)


def list_plans(session: Session, model_id: int | None = None) -> list[PlanRecord]:
    q = select(m.Plan).order_by(m.Plan.model_id, m.Plan.name, m.Plan.version)
    if model_id is not None:
        q = q.where(m.Plan.model_id == model_id)
    return [_plan_record(session, r) for r in session.scalars(q)]


def plan_labels(session: Session, ids: Iterable[int]) -> dict[int, str]:
    """'name vN' of the plan versions of these ids, in one query; a removed plan is absent."""
    wanted = set(ids)
    if not wanted:
        return {}
    rows = session.execute(select(m.Plan.id, m.Plan.name, m.Plan.version).where(m.Plan.id.in_(wanted)))
    return {i: PlanRecord.label_of(name, version) for i, name, version in rows}


def get_plan(session: Session, ref: int | str) -> PlanRecord:
    """A plan by id, by 'name' (newest version) or 'name@vN' / 'name vN'."""
    row = None
    if isinstance(ref, int) or (isinstance(ref, str) and ref.isdigit()):
        row = session.get(m.Plan, int(ref))
    if row is None and isinstance(ref, str):
        name, version = ref, None
        for sep in ("@v", " v"):
            if sep in ref and ref.rsplit(sep, 1)[1].isdigit():
                name, v = ref.rsplit(sep, 1)
                version = int(v)
        q = select(m.Plan).where(m.Plan.name == name)
        q = q.where(m.Plan.version == version) if version else q.order_by(m.Plan.version.desc())
        row = session.scalar(q.limit(1))
    if row is None:
        raise NotFound(f"no plan {ref!r}")
    return _plan_record(session, row)


# ----------------------------------------------------------------------------- results


def save_score(session: Session, *, job_id: int, model_id: int, plan_id: int | None, plan_label: str,
               plan_body: dict[str, Any], dataset: str, report: dict[str, Any],
               predicted_kl: float | None = None) -> None:
    session.execute(delete(m.ScoreResult).where(m.ScoreResult.job_id == job_id))
    details = {k: v for k, v in report.items() if k not in _SCORE_SCALARS + _SCORE_OPTIONAL}
    session.add(m.ScoreResult(job_id=job_id, model_id=model_id, plan_id=plan_id, plan_label=plan_label,
                              plan_body=plan_body, dataset=dataset, predicted_kl=predicted_kl, details=details,
                              **{k: report[k] for k in _SCORE_SCALARS}, **{k: report.get(k) for k in _SCORE_OPTIONAL}))
    session.flush()


_SCORE_SCALARS = ("tokens", "kl_mean", "kl_p50", "kl_p90", "kl_p99", "kl_max", "top1_agree", "ppl_ref", "ppl")
# columns a report may lack (scored before quantcore.evaluation.statistics): NULL then
_SCORE_OPTIONAL = ("kl_mean_err", "top1_agree_err", "ln_ppl_ratio", "ln_ppl_ratio_err", "dp_mean")


def _score_record(row: m.ScoreResult) -> ScoreRecord:
    return ScoreRecord(id=row.id, job_id=row.job_id, model_id=row.model_id, plan_id=row.plan_id,
                       plan_label=row.plan_label, plan_body=row.plan_body, dataset=row.dataset, tokens=row.tokens,
                       kl_mean=row.kl_mean, kl_p50=row.kl_p50, kl_p90=row.kl_p90, kl_p99=row.kl_p99,
                       kl_max=row.kl_max, top1_agree=row.top1_agree, ppl_ref=row.ppl_ref, ppl=row.ppl,
                       predicted_kl=row.predicted_kl, details=row.details or {}, created_at=row.created_at,
                       **{k: getattr(row, k) for k in _SCORE_OPTIONAL})


def list_scores(session: Session, model_id: int | None = None) -> list[ScoreRecord]:
    q = select(m.ScoreResult).order_by(m.ScoreResult.id.desc())
    if model_id is not None:
        q = q.where(m.ScoreResult.model_id == model_id)
    return [_score_record(r) for r in session.scalars(q)]


def get_score(session: Session, job_id: int) -> ScoreRecord:
    row = session.scalar(select(m.ScoreResult).where(m.ScoreResult.job_id == job_id))
    if row is None:
        raise NotFound(f"job #{job_id} has no score result")
    return _score_record(row)


KV_SWEEP_PREFIX = "KV "  # the scheme a KV cache sweep is stored under: "KV FP8_ATTN" (units are attention modules)


def save_sensitivity(session: Session, *, job_id: int, model_id: int, scheme: str,
                     rows: Iterable[dict[str, Any]]) -> None:
    session.execute(delete(m.SensitivityResult).where(m.SensitivityResult.job_id == job_id))
    for r in rows:
        session.add(m.SensitivityResult(job_id=job_id, model_id=model_id, scheme=scheme, unit=r["layer"],
                                        layers=list(r.get("layers") or [r["layer"]]), kl_mean=r["kl_mean"],
                                        top1_agree=r["top1_agree"], sqnr_db=r.get("sqnr_db"),
                                        kl_mean_err=r.get("kl_mean_err")))
    session.flush()


def list_sensitivity(session: Session, job_id: int) -> list[SensitivityRecord]:
    q = select(m.SensitivityResult).where(m.SensitivityResult.job_id == job_id) \
        .order_by(m.SensitivityResult.kl_mean.desc())
    return [SensitivityRecord(job_id=r.job_id, model_id=r.model_id, scheme=r.scheme, unit=r.unit,
                              layers=list(r.layers), kl_mean=r.kl_mean, top1_agree=r.top1_agree,
                              sqnr_db=r.sqnr_db, kl_mean_err=r.kl_mean_err) for r in session.scalars(q)]


def sensitivity_jobs(session: Session, model_id: int) -> list[JobRecord]:
    return list_jobs(session, kind="sensitivity", model_id=model_id, status=("succeeded",), limit=1000)


_KERNEL_FIELDS = ("device", "device_name", "torch_version", "m", "n", "k", "path", "ms", "tflops", "pct_peak",
                  "speedup", "native", "max_rel_err", "padded_m", "padded_k", "padded_n", "skipped", "timing",
                  "repeats", "ms_p20", "ms_p80", "baseline_ms", "baseline_ms_p20", "baseline_ms_p80", "unstable")


def save_kernel_results(session: Session, *, job_id: int, records: Iterable[dict[str, Any]]) -> int:
    session.execute(delete(m.KernelResult).where(m.KernelResult.job_id == job_id))
    n = 0
    for r in records:
        session.add(m.KernelResult(job_id=job_id, **{k: r.get(k) for k in _KERNEL_FIELDS}))
        n += 1
    session.flush()
    return n


def kernel_results(session: Session, *, device_name: str | None = None, torch_version: str | None = None,
                   job_id: int | None = None) -> list[KernelRecordRow]:
    """Kernel timings, newest job first; filtered by device (and torch version) or by job."""
    q = select(m.KernelResult).order_by(m.KernelResult.job_id.desc(), m.KernelResult.id)
    if device_name is not None:
        q = q.where(m.KernelResult.device_name == device_name)
    if torch_version is not None:
        q = q.where(m.KernelResult.torch_version == torch_version)
    if job_id is not None:
        q = q.where(m.KernelResult.job_id == job_id)
    return [KernelRecordRow(job_id=r.job_id, **{k: getattr(r, k) for k in _KERNEL_FIELDS})
            for r in session.scalars(q)]




def newest_kernel_results(session: Session, *, device_name: str,
                          torch_version: str | None = None) -> list[KernelRecordRow]:
    """The newest record per (M, N, K, path) on one device (and torch version, when given), timed or skipped.

    Which stored records a new benchmark may reuse (a skip measured again, an older time standing) is not the
    store's to decide: that is ``quantcore.kernels.records.reusable_records`` over :func:`kernel_results`.
    """
    newest: dict[tuple[int, int, int, str], KernelRecordRow] = {}
    for r in kernel_results(session, device_name=device_name, torch_version=torch_version):  # newest first
        newest.setdefault((r.m, r.n, r.k, r.path), r)
    return list(newest.values())


def params_and_results(session: Session, job_ids: Iterable[int]) -> dict[int, tuple[dict[str, Any] | None,
                                                                                     dict[str, Any] | None]]:
    """``{job id: (its params, its result)}`` of those of ``job_ids`` that exist."""
    q = select(m.Job.id, m.Job.params, m.Job.result).where(m.Job.id.in_(set(job_ids)))
    return {j: (params, result) for j, params, result in session.execute(q)}


def kernel_devices(session: Session) -> list[tuple[str, str, str]]:
    """(device, device_name, torch_version) triples that have timings."""
    q = select(m.KernelResult.device, m.KernelResult.device_name, m.KernelResult.torch_version).distinct()
    return [(r[0], r[1], r[2]) for r in session.execute(q)]


def device_probe(session: Session, device_name: str, *, scan: int = 500) -> dict[str, Any] | None:
    """What the newest succeeded benchmark on ``device_name`` found its device to be: ``{"device": the
    device probe the job stored (a dict), "paths": [one dict per kernel path, ...] or None (a job from before
    quantplan stored them), "job_id": ...}``; None when no benchmark of the newest ``scan`` said which device."""
    q = (select(m.Job.id, m.Job.result).where(m.Job.kind == "bench", m.Job.status == "succeeded")
         .order_by(m.Job.id.desc()).limit(scan))
    for job_id, result in session.execute(q):
        device = (result or {}).get("device")
        if isinstance(device, dict) and device.get("name") == device_name:
            return {"device": device, "paths": result.get("paths"), "job_id": job_id}
    return None


def count_rows(session: Session, table: type[m.Base]) -> int:
    return int(session.scalar(select(func.count()).select_from(table)) or 0)


def set_job_model(session: Session, job_id: int, model_id: int) -> None:
    session.execute(update(m.Job).where(m.Job.id == job_id).values(model_id=model_id))
