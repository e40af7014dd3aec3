"""A job's life on the worker: running → progress → succeeded / failed / cancelled.

``run_job(job_id, body)`` is the same whether Celery calls it (queued) or the CLI does
(``--local``): the body gets a :class:`JobContext` (parameters, progress, cancel) and
returns a :class:`Outcome` whose ``write`` stores the results; results and the
``succeeded`` status are written in one transaction.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import threading
import time
import traceback as tb
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from jobs.progress import Pace
from store import history, repo
from store.db import check_schema_current, session_scope
from store.settings import Settings, get_settings
from worker.environment import environment

log = logging.getLogger(__name__)

PROGRESS_INTERVAL_S = 0.5  # at most two progress writes a second: SQLite is shared with the app


class JobCancelled(Exception):
    """Raised inside a body when the job's cancel flag is set (also quantcore.errors.Cancelled works)."""


class JobInterrupted(KeyboardInterrupt):
    """Raised in a CLI --local run's main thread by its signal handler (quantplan.cli.local): SIGTERM, SIGHUP or
    SIGINT. :func:`run_job` ends the job cancelled, saying ``how`` ("Ctrl-C", "SIGTERM"), and raises it again;
    ``signum`` gives the conventional exit status, 128 + signum."""

    def __init__(self, signum: int, how: str):
        super().__init__(how)
        self.signum, self.how = signum, how


class JobTimedOut(Exception):
    """Raised inside a body that runs past QUANTPLAN_JOB_SOFT_TIME_LIMIT_S, where it reports progress or asks
    whether to stop. The worker's solo pool never enforces Celery's own time limits (they need the prefork or gevent
    pool), and a CLI --local run has none, so the limit is the job's own, checked as a cancel request is."""


@dataclass
class Outcome:
    """What a body produced: a small JSON summary for the jobs list, and a writer for the results."""

    result: dict[str, Any] = field(default_factory=dict)
    write: Callable[[Session], None] | None = None
    message: str = "done"


@dataclass
class JobContext:
    job_id: int
    kind: str
    params: dict[str, Any]
    model_id: int | None
    plan_id: int | None
    settings: Settings
    _last_write: float = 0.0
    _cancel: bool = False
    _fraction: float = 0.0  # the furthest fraction reported, written or throttled
    _deadline: float = float("inf")  # time.monotonic() past which the job times out (run_job passes it)
    cache_used: bool = False  # the body read or wrote files beside a model (store.cache): its end trims the cache
    on_progress: Callable[[float, str], None] | None = None  # told each progress it writes (a CLI --local run prints)
    _pace: Pace = field(default_factory=Pace)  # the step under way's rate: the time left its messages carry

    def progress(self, fraction: float, message: str, *, force: bool = False) -> None:
        """Report progress (throttled, unless ``force``: a message that must not be lost, such as the start of a
        long step that reports nothing for a while), with the time left at the measured rate where the message
        carries a count (jobs.progress.Pace); raises JobCancelled when a cancel was requested, JobTimedOut past the
        time limit."""
        self._check_time()
        self._fraction = max(self._fraction, fraction)
        message = self._pace.say(fraction, message)  # every report times the step, written or throttled
        now = time.monotonic()
        if force or now - self._last_write >= PROGRESS_INTERVAL_S or fraction >= 1.0:
            self._last_write = now
            with session_scope(self.settings) as s:
                self._cancel = repo.report_progress(s, self.job_id, fraction, message)
            if self.on_progress is not None:
                try:
                    self.on_progress(self._fraction, message)
                except Exception:  # a listener that fails (a CLI whose reader went away: BrokenPipeError) is
                    log.warning("job %s: its progress listener failed; the job goes on without it", self.job_id,
                                exc_info=True)
                    self.on_progress = None  # dropped, never the job's failure
        if self._cancel:
            raise JobCancelled()

    @property
    def furthest(self) -> float:
        """The furthest fraction reported so far (where the bar stands)."""
        return self._fraction

    def _check_time(self) -> None:
        if time.monotonic() > self._deadline:
            raise JobTimedOut()

    def rest(self) -> Callable[[float, str], None]:
        """A progress callback for a job's last phase: its fraction 0..1 fills what is left of the bar from the
        furthest point reported so far. A score or sweep whose reference log-probs came from the cache (reported at
        0.1) starts there rather than at the 0.3 computing them would have reached, so the bar tracks the phase's
        own count ("30 of 121 units")."""
        start = self._fraction
        return lambda fraction, message: self.progress(start + (1.0 - start) * fraction, message)

    def should_cancel(self) -> bool:
        """Checked between batches by quantcore functions; raises JobTimedOut past the time limit."""
        self._check_time()
        if not self._cancel:
            with session_scope(self.settings) as s:
                self._cancel = repo.get_job(s, self.job_id).cancel_requested
        return self._cancel


def _device_label(params: dict[str, Any]) -> tuple[str, str]:
    device = str(params.get("device") or "cpu")
    try:
        import torch

        version = str(torch.__version__)
        if device.startswith("cuda") and torch.cuda.is_available():
            device = f"{device} ({torch.cuda.get_device_name(0)})"
    except ImportError:  # a register job on a worker without torch still runs
        version = "none"
    return device, version


def run_job(job_id: int, body: Callable[[JobContext], Outcome], settings: Settings | None = None,
            on_progress: Callable[[float, str], None] | None = None) -> str:
    """Run one job to a final status; returns that status ('skipped' if it was not runnable). ``on_progress``
    (fraction, message) hears each progress the job writes."""
    from quantcore.errors import Cancelled, QuantcoreError

    settings = settings or get_settings()
    check_schema_current(settings)
    with session_scope(settings) as s:
        job = repo.get_job(s, job_id)
        device, torch_version = _device_label(job.params)
        started_here = repo.mark_running(s, job_id, worker_host=socket.gethostname(), device=device,
                                         torch_version=torch_version)
        if started_here:  # the software it runs with, for its run's page (store.history)
            history.record_environment(s, job_id, environment())
    if not started_here:
        return _drop(job_id, settings)
    log.info("job %s (%s) running on %s", job_id, job.kind, device)
    started = time.monotonic()
    limit = settings.job_soft_time_limit_s
    ctx = JobContext(job_id=job_id, kind=job.kind, params=job.params, model_id=job.model_id,
                     plan_id=job.plan_id, settings=settings, on_progress=on_progress,
                     _deadline=time.monotonic() + limit if limit > 0 else float("inf"))
    stop_beating = _beat_while_running(ctx)
    try:
        outcome = body(ctx)
        with session_scope(settings) as s:
            if outcome.write is not None:
                outcome.write(s)
            repo.finish_job(s, job_id, status="succeeded", message=outcome.message, result=outcome.result)
        log.info("job %s (%s) succeeded in %.1f s: %s", job_id, job.kind, time.monotonic() - started, outcome.message)
        return "succeeded"
    except (JobCancelled, Cancelled):
        with session_scope(settings) as s:
            repo.finish_job(s, job_id, status="cancelled", message="by request, while it ran")
        return "cancelled"
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM on a CLI --local run: the job ends cancelled, not running
        how = exc.how if isinstance(exc, JobInterrupted) else "Ctrl-C"
        with session_scope(settings) as s:
            repo.finish_job(s, job_id, status="cancelled", message=f"interrupted ({how}) before it finished")
        raise
    except SystemExit:  # Celery's hard shutdown (WorkerTerminate) stops the task where it is: never left running
        with session_scope(settings) as s:
            repo.finish_job(s, job_id, status="failed", message="failed",
                            error="the worker was shut down before the job finished. Queue the job again.")
        raise
    except Exception as exc:  # every failure is stored, then the task ends normally
        from celery.exceptions import SoftTimeLimitExceeded

        timed_out = isinstance(exc, JobTimedOut | SoftTimeLimitExceeded)
        if timed_out:
            error = f"timed out after {settings.job_soft_time_limit_s} s (QUANTPLAN_JOB_SOFT_TIME_LIMIT_S)"
        elif isinstance(exc, QuantcoreError | ValueError | LookupError | FileNotFoundError):
            error = str(exc)  # our own messages are written for a person already
        else:
            error = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, QuantcoreError):  # bad input, a device without the kernel: the message says it all, in
            log.info("job %s failed: %s", job_id, error)  # the worker's log (INFO) and the row, with the traceback
        elif timed_out:
            log.warning("job %s failed: %s", job_id, error)
        else:
            log.exception("job %s failed", job_id)
        with session_scope(settings) as s:
            repo.finish_job(s, job_id, status="failed", message="failed", error=error, traceback=tb.format_exc())
        return "failed"
    finally:
        stop_beating.set()
        if ctx.cache_used:
            trim_cache(settings)
        if settings.mlflow_tracking_uri:  # every finished job also an MLflow run; never the job's failure
            from worker.mlflow_log import log_finished_job

            log_finished_job(job_id, settings)


def _beat_while_running(ctx: JobContext) -> threading.Event:
    """Refresh the job's heartbeat from a daemon thread until the returned event is set, so a long step that
    reports no progress (hashing a large upload, loading a 70B checkpoint) is not taken for a dead worker by the
    stale-job sweep: a job goes stale only when its process is gone. Past its time limit it stops beating, so a job
    stuck where it never checks the limit is failed by the sweep after all."""
    stop = threading.Event()
    interval = repo.beat_interval_s(ctx.settings.heartbeat_stale_s)

    def beat() -> None:
        while not stop.wait(interval) and time.monotonic() <= ctx._deadline:
            try:
                with session_scope(ctx.settings) as s:
                    repo.job_heartbeat(s, ctx.job_id)
            except Exception:  # the heartbeat must never take a job down
                log.exception("job %s heartbeat failed", ctx.job_id)

    threading.Thread(target=beat, name=f"quantplan-job-{ctx.job_id}", daemon=True).start()
    return stop


def trim_cache(settings: Settings) -> list[tuple[Path, int]]:
    """Delete the least recently used files jobs keep beside the models until they fit ``cache_max_gib``
    (store.cache.trim); what was deleted. Run after every job that read or wrote some (``JobContext.cache_used``:
    score and sensitivity jobs), whatever its status; never raises."""
    from store import cache

    try:
        removed = cache.trim(settings.reference_root, settings.cache_max_bytes)
    except Exception:  # the trim must never take a worker down
        log.exception("cache trim failed")
        return []
    if removed:
        log.warning("deleted %d least recently used cached file(s), %.1f MiB, to keep them under %g GiB "
                    "(QUANTPLAN_CACHE_MAX_GIB)", len(removed), sum(b for _, b in removed) / 2**20,
                    settings.cache_max_gib)
    return removed


def _drop(job_id: int, settings: Settings) -> str:
    """A task whose job is not queued (mark_running refused it): acknowledged and dropped, never run again, with a
    log line. That is a task Redis redelivered (its visibility timeout passed, jobs.broker) or one sent twice: its job
    already finished, was cancelled, or runs on another worker (or ran on one that died: then it is stale and this
    sweep fails it now rather than at the next periodic one). 'skipped'."""
    with session_scope(settings) as s:
        status = repo.get_job(s, job_id).status
    log.log(logging.INFO if status == "cancelled" else logging.WARNING,
            "job %s is %s, not queued: its task is acknowledged and dropped, not run (a task redelivered or sent "
            "again, or a job cancelled before it started)", job_id, status)
    if status == "running":
        sweep(settings)
    return "skipped"


def sweep(settings: Settings | None = None) -> list[int]:
    """Fail jobs whose worker stopped sending heartbeats (and --local jobs whose process died before they started:
    store.repo.sweep_stale_jobs); their ids. Never raises."""
    settings = settings or get_settings()
    try:
        with session_scope(settings) as s:
            stale = repo.sweep_stale_jobs(s, stale_after_s=settings.heartbeat_stale_s)
    except Exception:  # the sweep must never take a worker down
        log.exception("stale-job sweep failed")
        return []
    if stale:
        log.warning("failed stale jobs: %s", stale)
    sweep_scratch(settings)
    return stale


def sweep_scratch(settings: Settings) -> list[Path]:
    """Remove this machine's job scratch folders (``Settings.job_scratch_dir``: a streamed job's memory-mapped hidden
    states) whose job is no longer running: a job's end removes its own, this catches a worker killed mid-stream
    once the stale-job sweep has failed its job. The folders removed; never raises."""
    root = settings.job_scratch_dir(0).parent
    removed: list[Path] = []
    try:
        folders = [p for p in root.glob("job-*") if p.name[4:].isdigit()] if root.is_dir() else []
        for folder in folders:
            with session_scope(settings) as s:
                try:
                    status = repo.get_job(s, int(folder.name[4:])).status
                except LookupError:
                    status = None
            if status != "running":
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder)
    except Exception:  # the sweep must never take a worker down
        log.exception("scratch sweep failed")
    if removed:
        log.warning("removed %d scratch folder(s) of jobs no longer running: %s", len(removed),
                    ", ".join(p.name for p in removed))
    return removed


def start_sweeping(settings: Settings | None = None, interval_s: float | None = None) -> threading.Event:
    """Sweep stale jobs (:func:`sweep`) every ``interval_s`` (default store.repo.beat_interval_s of the stale limit:
    30 s of 120) from a daemon thread, for as long as this process lives; set the returned event to stop. Every
    live worker runs one, so a job whose worker was killed is failed within QUANTPLAN_HEARTBEAT_STALE_S plus one
    interval of its last heartbeat, whether or not a page is open or a worker (re)starts. No Celery beat: each
    worker sweeps on its own; the sweep's UPDATEs ask for the row as read, so two workers never both fail a job."""
    s = settings or get_settings()
    interval = repo.beat_interval_s(s.heartbeat_stale_s) if interval_s is None else interval_s
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(interval):
            sweep(s)
            restore_lost_tasks(s)

    threading.Thread(target=loop, name="quantplan-sweep", daemon=True).start()
    return stop


_TAKEN_SINCE: dict[str, float] = {}  # task id → when this process first saw its message taken, its job still queued


def restore_lost_tasks(settings: Settings | None = None) -> list[int]:
    """Queued jobs whose message a worker took and then died before marking them running (kombu's SQLAlchemy
    transport never redelivers it): once this process has seen such a message taken, its job still queued, for
    QUANTPLAN_HEARTBEAT_STALE_S, it is put back on the queue for the next worker (mark_running still lets only one
    delivery run the job). The ids of those jobs; never raises. Redis needs none of this (its visibility timeout)."""
    from jobs.broker import restore_messages, taken_messages

    s = settings or get_settings()
    try:
        with session_scope(s) as session:
            waiting = repo.queued_for_workers(session, older_than_s=s.heartbeat_stale_s)
        taken = taken_messages(s, [task_id for _, task_id in waiting])
        now = time.monotonic()
        for task_id in list(_TAKEN_SINCE):
            if task_id not in taken:
                del _TAKEN_SINCE[task_id]
        lost = [(job_id, taken[task_id]) for job_id, task_id in waiting
                if task_id in taken and now - _TAKEN_SINCE.setdefault(task_id, now) >= s.heartbeat_stale_s]
        if lost:
            restore_messages(s, [message_id for _, message_id in lost])
            log.warning("jobs %s: their tasks were taken by a worker that died before starting them; put back on "
                        "the queue", [job_id for job_id, _ in lost])
        return [job_id for job_id, _ in lost]
    except Exception:  # the restore must never take a worker down
        log.exception("restoring lost tasks failed")
        return []


STAGING_IDLE_S = 3600  # an intake copy nobody has written to for an hour: its process died
UPLOAD_IDLE_S = 24 * 3600  # an app upload no queued or running job will read, a day old


def _newest_mtime(root: Path) -> float:
    newest = root.lstat().st_mtime
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            try:
                newest = max(newest, os.lstat(os.path.join(dirpath, name)).st_mtime)
            except FileNotFoundError:  # removed while we looked
                pass
    return newest


def sweep_leftovers(settings: Settings | None = None, *, now: float | None = None) -> list[Path]:
    """Remove intake folders nothing will finish; returns what was removed.

    - ``models/.staging-*``: a checkpoint copy in progress; left behind when the process doing
      the intake was killed. Removed once nothing in it has been written for STAGING_IDLE_S.
    - ``uploads/<id>``: a file uploaded through the app for a register job; the job removes it
      when it ends, but a job cancelled before it ran, or a lost message, leaves it. Removed
      when no queued or running job names it and it is older than UPLOAD_IDLE_S.
    """
    from quantcore.models.validation import STAGING_PREFIX

    settings = settings or get_settings()
    now = time.time() if now is None else now
    removed: list[Path] = []
    try:
        candidates = [(d, STAGING_IDLE_S) for d in Path(settings.models_dir).glob(STAGING_PREFIX + "*")
                      if d.is_dir()]
        uploads = Path(str(settings.artifact_dir)) / "uploads"
        if uploads.is_dir():
            with session_scope(settings) as s:
                pending = {str(Path(p).resolve()) for p in repo.pending_cleanup_dirs(s)}
            candidates += [(d, UPLOAD_IDLE_S) for d in uploads.iterdir()
                           if d.is_dir() and str(d.resolve()) not in pending]
        for d, idle_s in candidates:
            if now - _newest_mtime(d) > idle_s:
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d)
    except Exception:  # the sweep must never take a worker down
        log.exception("leftover sweep failed")
        return removed
    if removed:
        log.warning("removed abandoned intake folders: %s", ", ".join(str(d) for d in removed))
    return removed
