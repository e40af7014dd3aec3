"""Which workers are alive and which queues they consume, as they report themselves to the store (jobs.workers
reads the records; worker.presence writes them), for this deployment."""

from __future__ import annotations

from collections.abc import Iterable

from jobs import workers as presence
from quantplan.services.deployment import settings
from store import repo
from store.db import session_scope
from store.records import WorkerRecord


def live_workers() -> list[WorkerRecord]:
    """The workers seen within jobs.workers.LIVE_WITHIN_S."""
    return presence.live_workers(settings())


def idle_queues(queues: Iterable[str]) -> list[str]:
    """Queues among ``queues`` that no live worker consumes (``local``, the CLI's in-process runs, never)."""
    return presence.idle_queues(queues, settings())


def all_workers() -> list[WorkerRecord]:
    """Every worker that ever reported itself, alive or not."""
    with session_scope(settings()) as s:
        return repo.list_workers(s)


def no_worker_note(queue: str) -> str | None:
    """A warning when no live worker consumes ``queue`` (the job would wait), else None."""
    return presence.no_worker_note(queue, settings())
