"""A worker reports itself to the store: which worker is alive, on which queues, with which device.

A worker records itself when it starts (its Celery node name, the queues it consumes, its device)
and refreshes ``seen_at`` every WORKER_HEARTBEAT_S from a daemon thread, also while a job runs.
The app and the CLI read the records (jobs.workers) to say when a queued job has no live worker to
take it. Torch-free at import.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Sequence

from jobs.workers import WORKER_HEARTBEAT_S
from store import repo
from store.db import session_scope
from store.records import WorkerRecord
from store.settings import Settings, get_settings

log = logging.getLogger(__name__)


def describe_device(queues: Sequence[str]) -> tuple[str, str, str, str | None]:
    """(device, device_name, device_class, torch_version) of this process: its GPU when it consumes a
    gpu queue and has one, else its CPU."""
    from quantcore.kernels.device import probe_device

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
