"""The CLI's one door into the worker package: ``--local`` runs a job's body in this process, and ``quantplan
worker`` describes the device this machine serves. No other module of the CLI imports ``worker``; each import here
is made when it is needed, so a command that queues jobs never loads torch."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from store.records import JobRecord
    from store.settings import Settings


def missing_device(params: Mapping[str, Any]) -> Exception | None:
    """The UnsupportedOnDevice a job's device raises on this machine (a CUDA job without CUDA), else None."""
    from quantcore.errors import UnsupportedOnDevice
    from worker.bodies.shared import resolve_device

    try:
        resolve_device(params.get("device"))
    except UnsupportedOnDevice as exc:
        return exc
    return None


STOP_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")  # what ends a --local run with its job cancelled (not SIGKILL: the
# sweep of a live worker or a waiting CLI fails that job once its heartbeat is stale)


def run_here(job: JobRecord, *, settings: Settings, on_progress: Callable[[float, str], Any]) -> None:
    """Run a job written for this process (queue 'local') through the worker's runner: its row ends succeeded,
    failed or cancelled, as a worker would leave it.

    While it runs, SIGINT (Ctrl-C), SIGTERM and SIGHUP raise worker.runner.JobInterrupted (a KeyboardInterrupt) in
    this thread: the runner ends the job cancelled, "interrupted (SIGTERM) before it finished", and the exception
    is raised again for the command to exit 128 + the signal's number. A job the signal caught before or after the
    runner's own handling is ended here too, so none is left queued or running. A second signal while the first is
    handled is ignored; the previous handlers are restored after. (Signals are taken only in the main thread; from
    another the job runs with the handlers as they are.)"""
    import signal
    import threading

    from worker.bodies import body_for
    from worker.runner import JobInterrupted, run_job

    caught: list[int] = []

    def interrupt(signum: int, _frame: Any) -> None:
        if caught:  # the first one is being handled: the job is being ended
            return
        caught.append(signum)
        raise JobInterrupted(signum, "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name)

    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for name in STOP_SIGNALS:
            if (signum := getattr(signal, name, None)) is not None:
                previous[signum] = signal.signal(signum, interrupt)
    try:
        run_job(job.id, body_for(job.kind), settings=settings, on_progress=on_progress)
    except KeyboardInterrupt as exc:
        caught.append(0)  # from here on every signal is ignored until the handlers are restored
        _end_unfinished(job.id, exc, settings)
        raise
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _end_unfinished(job_id: int, exc: KeyboardInterrupt, settings: Settings) -> None:
    """A job a signal interrupted outside the runner's own handling: still queued → cancelled, still running →
    cancelled, saying how it was interrupted."""
    from store import repo
    from store.db import session_scope

    how = getattr(exc, "how", "Ctrl-C")
    with session_scope(settings) as s:
        status = repo.get_job(s, job_id).status
        if status in ("queued", "running"):
            repo.finish_job(s, job_id, status="cancelled", message=f"interrupted ({how}) before it finished")


def describe_device(queues: list[str]) -> tuple[str, str, str, str | None]:
    """(device, device_name, device_class, torch_version) a worker consuming ``queues`` would announce here: its
    GPU when a gpu queue asks for one and it has one, else its CPU (worker.presence.describe_device)."""
    from worker.presence import describe_device as describe

    return describe(queues)
