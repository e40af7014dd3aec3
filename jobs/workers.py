"""Which workers are alive, and on which queues, as the senders see it: each worker records itself in the store
(worker.presence) and refreshes ``seen_at`` every :data:`WORKER_HEARTBEAT_S`; the app and the CLI read the records
to say when a queued job has no live worker to take it, for example a CUDA job on the embedded setup, whose one
worker consumes only ``cpu``."""

from __future__ import annotations

from collections.abc import Iterable

from jobs.routing import LOCAL_QUEUE
from store import repo
from store.db import session_scope
from store.records import WorkerRecord
from store.settings import Settings, get_settings

WORKER_HEARTBEAT_S = 30.0  # how often a worker refreshes its record
LIVE_WITHIN_S = 3 * WORKER_HEARTBEAT_S  # a worker seen this recently counts as alive


def live_workers(settings: Settings | None = None) -> list[WorkerRecord]:
    """The workers seen within :data:`LIVE_WITHIN_S`."""
    with session_scope(settings or get_settings()) as session:
        return repo.list_workers(session, seen_within_s=LIVE_WITHIN_S)


def idle_queues(queues: Iterable[str], settings: Settings | None = None) -> list[str]:
    """The queues among ``queues`` that no live worker consumes (``local``, the CLI's in-process runs, never)."""
    wanted = sorted({q for q in queues if q != LOCAL_QUEUE})
    if not wanted:
        return []
    served = {q for w in live_workers(settings) for q in w.queues}
    return [q for q in wanted if q not in served]


def no_worker_note(queue: str, settings: Settings | None = None) -> str | None:
    """A sentence for a person when no live worker consumes ``queue``; None when one does."""
    if not idle_queues([queue], settings):
        return None
    where = "a GPU host" if queue.startswith("gpu") else "a machine that can reach the broker"
    return (f"No worker consuming queue '{queue}' has reported in the last {LIVE_WITHIN_S:.0f} s: the job waits "
            f"until one starts. Start one on {where} with `quantplan worker --queues {queue}`.")


__all__ = ["LIVE_WITHIN_S", "WORKER_HEARTBEAT_S", "idle_queues", "live_workers", "no_worker_note"]
