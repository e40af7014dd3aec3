"""Which workers are alive, and on which queues: each worker reports itself to the store.

A worker records itself when it starts (its Celery node name, the queues it consumes, its device)
and refreshes ``seen_at`` every WORKER_HEARTBEAT_S from a daemon thread, also while a job runs.
The app and the CLI read the records to say when a queued job has no live worker to take it, for
example a CUDA job on the embedded setup, whose one worker consumes only ``cpu``. Torch-free at
import: the app imports this module.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterable, Sequence

from store import repo
from store.db import session_scope
from store.records import WorkerRecord
from store.settings import Settings, get_settings

log = logging.getLogger("quantplan.worker")

WORKER_HEARTBEAT_S = 30.0
LIVE_WITHIN_S = 3 * WORKER_HEARTBEAT_S  # a worker seen this recently counts as alive


def describe_device(queues: Sequence[str]) -> tuple[str, str, str, str | None]:
    """(device, device_name, device_class, torch_version) of this process: its GPU when it consumes a
    gpu queue and has one, else its CPU."""
    from quantcore.kernels.hardware import probe_device

    info = None
    if any(q == "gpu" or q.startswith("gpu.") for q in queues):
        try:
            info = probe_device("cuda")
        except Exception:  # no CUDA here: the worker still runs, on the CPU
            info = None
    if info is None:
        info = probe_device("cpu")
    return info.kind, info.name, info.device_class, info.torch_version


def announce(name: str, queues: Sequence[str], settings: Settings | None = None) -> WorkerRecord:
    """Record this worker (again, after a restart) with its queues and device."""
    s = settings or get_settings()
    device, device_name, device_class, torch_version = describe_device(queues)
    with session_scope(s) as session:
        return repo.worker_started(session, name=name, host=socket.gethostname(), queues=list(queues),
                                   device=device, device_name=device_name, device_class=device_class,
                                   torch_version=torch_version)


def start_heartbeat(name: str, queues: Sequence[str], settings: Settings | None = None,
                    interval_s: float = WORKER_HEARTBEAT_S) -> threading.Event:
    """Refresh the worker's seen_at every interval_s from a daemon thread; set the returned event to stop."""
    s = settings or get_settings()
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(interval_s):
            try:
                with session_scope(s) as session:
                    known = repo.worker_seen(session, name)
                if not known:  # its row was removed (a cleanup, a new database): record it again
                    announce(name, queues, s)
            except Exception:  # the heartbeat must never take a worker down
                log.exception("worker heartbeat failed")

    threading.Thread(target=beat, name=f"quantplan-heartbeat-{name}", daemon=True).start()
    return stop


def forget(name: str, settings: Settings | None = None) -> None:
    """Remove a worker that is shutting down cleanly."""
    try:
        with session_scope(settings or get_settings()) as session:
            repo.forget_worker(session, name)
    except Exception:
        log.exception("could not remove worker %s from the store", name)


def live_workers(settings: Settings | None = None) -> list[WorkerRecord]:
    with session_scope(settings or get_settings()) as session:
        return repo.list_workers(session, seen_within_s=LIVE_WITHIN_S)


def idle_queues(queues: Iterable[str], settings: Settings | None = None) -> list[str]:
    """The queues among ``queues`` that no live worker consumes (``local``, the CLI's in-process runs, never)."""
    wanted = sorted({q for q in queues if q != "local"})
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
