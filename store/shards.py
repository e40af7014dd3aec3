"""The shards of a sharded sensitivity sweep (the ``sweep_shards`` table): which job rows are shards of which sweep,
their aggregated progress, a failed shard put back on the queue.

A sharded sweep is one parent job row (kind ``sensitivity``, what the pages and the CLI show) and one job row per
shard (also ``sensitivity``, with ``shard: [index, count]`` in its parameters), each run by whichever worker of
the queue takes it (worker.bodies.sweep_shards). Shard rows are left out of job lists (store.repo.list_jobs); a
cancel of the parent cancels them (store.repo.request_cancel), and the stale-job sweep leaves a parent alone while
one of its shards is queued or running.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from store import models as m
from store import repo
from store.records import JobRecord


@dataclass(frozen=True)
class ShardRecord:
    """One shard: its own job row, its place among its parent's shards, how often a worker started it."""

    parent_id: int
    shard: int
    shards: int
    attempts: int
    worker: str | None
    job: JobRecord


def add_shard(session: Session, *, parent_id: int, job_id: int, shard: int, shards: int) -> None:
    """Record ``job_id`` as shard ``shard`` of ``shards`` of the sweep ``parent_id``."""
    session.add(m.SweepShard(parent_id=parent_id, job_id=job_id, shard=shard, shards=shards, attempts=0))
    session.flush()


def _record(session: Session, row: m.SweepShard) -> ShardRecord:
    return ShardRecord(parent_id=row.parent_id, shard=row.shard, shards=row.shards, attempts=row.attempts,
                       worker=row.worker, job=repo.get_job(session, row.job_id))


def shard_of(session: Session, job_id: int) -> ShardRecord | None:
    """The shard whose job row is ``job_id``; None for any other job."""
    row = session.scalar(select(m.SweepShard).where(m.SweepShard.job_id == job_id))
    return None if row is None else _record(session, row)


def shards_of(session: Session, parent_id: int) -> list[ShardRecord]:
    """The shards of the sweep ``parent_id``, in shard order ([] for a sweep that is not sharded)."""
    rows = session.scalars(select(m.SweepShard).where(m.SweepShard.parent_id == parent_id)
                           .order_by(m.SweepShard.shard))
    return [_record(session, r) for r in rows]


def count_attempt(session: Session, job_id: int, worker: str) -> int:
    """The worker ``worker`` (its Celery node name) starts the shard ``job_id``: its attempts, this one counted."""
    session.execute(update(m.SweepShard).where(m.SweepShard.job_id == job_id)
                    .values(attempts=m.SweepShard.attempts + 1, worker=worker[:200]))
    return int(session.scalar(select(m.SweepShard.attempts).where(m.SweepShard.job_id == job_id)) or 0)


def requeue(session: Session, job_id: int, note: str) -> bool:
    """A failed shard back to ``queued`` (its error kept in the message), to run again alone; False when it is not
    failed (cancelled meanwhile, or its parent was)."""
    res = session.execute(update(m.Job).where(m.Job.id == job_id, m.Job.status == "failed",
                                              m.Job.cancel_requested.is_(False))
                          .values(status="queued", progress=0.0, message=note[:2000], finished_at=None,
                                  started_at=None))
    return bool(getattr(res, "rowcount", 0) == 1)


SHARD_ATTEMPTS = repo.SHARD_ATTEMPTS  # a shard that fails, or whose worker is lost, runs once more, alone


def report_parent(session: Session, parent_id: int, *, worker_host: str, device: str, torch_version: str,
                  message: str) -> bool:
    """A shard made progress: its parent runs (queued → running on the first shard's first progress) and its
    progress is the mean of its shards' (each shard weighs the same: they hold the same number of units, ± 1),
    with ``message``; True when the parent's cancel was requested."""
    repo.mark_running(session, parent_id, worker_host=worker_host, device=device, torch_version=torch_version)
    parts = session.scalars(select(m.Job.progress).join(m.SweepShard, m.SweepShard.job_id == m.Job.id)
                            .where(m.SweepShard.parent_id == parent_id)).all()
    fraction = sum(parts) / len(parts) if parts else 0.0
    return repo.report_progress(session, parent_id, min(fraction, 0.999), message)


__all__ = ["SHARD_ATTEMPTS", "ShardRecord", "add_shard", "count_attempt", "report_parent", "requeue", "shard_of",
           "shards_of"]
