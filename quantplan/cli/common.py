"""What every command shares: its errors, the settings after the schema check, finding a model, checking option
values, and queueing a job and waiting for it (or running it here with --local, through quantplan.cli.local)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quantplan.cli.local import missing_device, run_here

if TYPE_CHECKING:
    from store.records import JobRecord, ModelRecord
    from store.settings import Settings


def print_json(obj: Any) -> None:
    """Print ``obj`` as indented JSON (anything JSON does not know as its str)."""
    print(json.dumps(obj, indent=2, default=str))


class CliError(Exception):
    """A command refused or failed in a way a person fixes: printed as one line after "quantplan: " (exit 1)."""


class Interrupted(CliError):
    """Ctrl-C (or SIGTERM / SIGHUP on a --local run) while a job command ran or waited: said in one line; the exit
    status is ``exit_code``, 128 + the signal's number as a shell reports it (130 for SIGINT, 143 for SIGTERM)."""

    def __init__(self, message: str, exit_code: int = 130):
        super().__init__(message)
        self.exit_code = exit_code


def current_settings() -> Settings:
    """The deployment's settings (store.settings), its schema not checked."""
    from store.settings import get_settings

    return get_settings()


def checked_settings() -> Settings:
    """Settings after the schema check every entry point makes."""
    from store.db import check_schema_current

    s = current_settings()
    check_schema_current(s)
    return s


def _progress_printer(quiet: bool):
    """show(job): a line on stderr for each new status, progress or message of a job (nothing when ``quiet``)."""
    last = {"msg": None}

    def show(job) -> None:
        if quiet:
            return
        line = f"job #{job.id} {job.status:9s} {job.progress * 100:5.1f}%  {job.message}"
        if line != last["msg"]:
            print(line, file=sys.stderr, flush=True)
            last["msg"] = line

    return show


def _local_progress(job, show):
    """on_progress(fraction, message) for run_job: a --local run prints its progress as a queued job's wait does."""
    from types import SimpleNamespace

    return lambda fraction, message: show(SimpleNamespace(id=job.id, status="running", progress=fraction,
                                                          message=message))


def run_job(kind: str, params: dict[str, Any], *, model_id: int | None, plan_id: int | None = None,
            local: bool, quiet: bool, timeout_s: float | None = None) -> JobRecord:
    """Queue the job and wait (default; at most ``timeout_s``, the --timeout option), or run its body in this
    process (--local); a job that did not succeed, or is not done in time, is a CliError."""
    job = start_job(kind, params, model_id=model_id, plan_id=plan_id, local=local)
    job = finish_job(job, local=local, quiet=quiet, timeout_s=timeout_s)
    if job.status != "succeeded":
        raise CliError(f"job #{job.id} {job.status}: {job.error or job.message}")
    return job


def start_job(kind: str, params: dict[str, Any], *, model_id: int | None, plan_id: int | None = None,
              local: bool) -> JobRecord:
    """Write the job: queued for a worker (saying when no worker consumes its queue), or, with ``local``, a row
    for :func:`finish_job` to run here (refused before anything is written when this machine lacks its device)."""
    from jobs.client import create_local_job, submit_job

    s = current_settings()
    if local:
        if missing := missing_device(params):  # a device this machine lacks: refused before a job is written
            raise CliError(f"{missing} (this machine runs --local jobs; without --local the job is queued for a "
                           "worker)") from missing
        return create_local_job(kind, params, model_id=model_id, plan_id=plan_id, settings=s)
    job = submit_job(kind, params, model_id=model_id, plan_id=plan_id, settings=s)
    print(f"job #{job.id}: queued {kind} on queue '{job.queue}' (Ctrl-C stops waiting, not the job)", file=sys.stderr)
    from jobs.workers import no_worker_note

    note = no_worker_note(job.queue, s)
    if note:
        print(f"quantplan: {note}{_local_hint(params)}", file=sys.stderr)
    return job


def finish_job(job: JobRecord, *, local: bool, quiet: bool, timeout_s: float | None = None) -> JobRecord:
    """Run a :func:`start_job`-ed local job here, or wait for a queued one (at most ``timeout_s``: then a CliError
    saying the job goes on); the job as it ended. Ctrl-C, or SIGTERM / SIGHUP on a local run: Interrupted (the local
    job ends cancelled, never left running: quantplan.cli.local.run_here).

    The wait sweeps stale jobs as it polls (jobs.client.wait_for), so a job whose worker was killed ends failed
    within QUANTPLAN_HEARTBEAT_STALE_S plus one sweep interval, and the command with it."""
    from jobs.client import wait_for

    s = current_settings()
    show = _progress_printer(quiet)
    if local:
        print(f"job #{job.id}: running {job.kind} in this process", file=sys.stderr)
        try:
            run_here(job, settings=s, on_progress=_local_progress(job, show))
        except KeyboardInterrupt as exc:  # the job is stored as cancelled
            how, signum = getattr(exc, "how", "Ctrl-C"), getattr(exc, "signum", 2)
            raise Interrupted(f"job #{job.id} {job_status(job.id)}: interrupted ({how}) before it finished",
                              exit_code=128 + signum) from None
    try:
        done = wait_for(job.id, on_update=show, settings=s, timeout_s=timeout_s)
    except KeyboardInterrupt:
        raise Interrupted(f"stopped waiting; job #{job.id} is still {job_status(job.id)} "
                          f"(`quantplan jobs show {job.id}`, `quantplan jobs cancel {job.id}`)") from None
    if not done.finished:
        raise CliError(f"stopped waiting after {timeout_s:g} s (--timeout); job #{job.id} is still {done.status} and "
                       f"goes on (`quantplan jobs show {job.id}`, `quantplan jobs cancel {job.id}`)")
    return done


def _local_hint(params: dict[str, Any]) -> str:
    """' Or run it here with --local.' where this machine has the job's device, else ''."""
    return "" if missing_device(params) else " Or run it here with --local."


def job_status(job_id: int) -> str:
    """A job's status now, as stored."""
    from quantplan.services import jobs as jobs_svc

    return jobs_svc.get_job(job_id).status


def find_model(ref: str) -> ModelRecord:
    """The registered model ``ref`` names (an id or a name); CliError saying so where none does."""
    from quantplan.services import models as models_svc
    from store.repo import NotFound

    try:
        return models_svc.get_model(ref)
    except NotFound as exc:
        raise CliError(str(exc)) from exc


def dataset_param(path: str | None, role: str) -> dict[str, Any]:
    """``{"dataset": id}`` of the text file ``path``, stored for ``role``; {} without a path."""
    if not path:
        return {}
    from quantplan.services import datasets as datasets_svc

    ds = datasets_svc.add_dataset_file(Path(path), role)
    return {"dataset": ds.id}


def comma_items(text: str) -> list[str]:
    """The items of a comma-separated option as people type them ("A, B,"): stripped, empty ones dropped."""
    return [item.strip() for item in text.split(",") if item.strip()]


def text_sizes(args: argparse.Namespace) -> dict[str, int]:
    """--samples / --seq-len as a job's params (already bounded when parsed: options.add_text_job_options)."""
    return {"samples": args.samples, "seq_len": args.seq_len}


def scheme_arg(name: str) -> str:
    """A preset scheme name, checked before any job is made: an unknown one is a CliError listing the valid names
    (and the right case, where only that was wrong)."""
    from quantcore.schemes.presets import get_scheme

    try:
        return get_scheme(name).name
    except ValueError as exc:
        raise CliError(str(exc)) from exc


def kv_format_arg(name: str | None) -> str:
    """A KV cache format name as quantcore.evaluation.kvcache spells it (None is AUTO), or a CliError naming the known
    ones."""
    from quantcore.errors import PlanError
    from quantcore.evaluation.kvcache import get_kv_format

    try:
        return get_kv_format(name).name
    except PlanError as exc:
        raise CliError(str(exc)) from exc


def check_target(target: str | None) -> None:
    """A GPU key of the target table, or a CliError naming the valid ones."""
    from quantcore.kernels.hardware import TARGETS

    if target is not None and target not in TARGETS:
        raise CliError(f"unknown GPU target {target!r}; choose one of: {', '.join(TARGETS)}")
