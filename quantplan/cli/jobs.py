"""`quantplan jobs [list | show | cancel | retry]`: the job history, and acting on one job."""

from __future__ import annotations

import argparse
import sys

from jobs.specs import LIST_LIMIT
from quantplan.cli.common import (
    CliError,
    checked_settings,
    print_json,
)
from quantplan.cli.options import SubParsers, add_json, bounded


def cmd_jobs(args: argparse.Namespace) -> int:
    """`quantplan jobs [list | show ID | cancel ID | retry ID]`: the newest jobs, one job, cancelling or queueing
    one again."""
    from quantplan.services import jobs as jobs_svc

    checked_settings()
    if args.action != "list" and args.id is None:
        raise CliError(f"say which job: quantplan jobs {args.action} ID")
    if args.action == "retry":
        from quantplan.services import workers as workers_svc

        job = jobs_svc.retry_job(args.id)
        print(f"job #{args.id} queued again as job #{job.id} on queue '{job.queue}'")
        note = workers_svc.no_worker_note(job.queue)
        if note:
            print(f"note: {note}", file=sys.stderr)
        return 0
    if args.action == "cancel":
        job = jobs_svc.cancel_job(args.id)
        print(f"job #{job.id}: {job.status} ({job.message})")
        return 0
    if args.action == "show":
        print_json(jobs_svc.get_job(args.id).__dict__)
        return 0
    jobs = jobs_svc.list_jobs(limit=args.limit)
    if args.json:
        print_json([j.__dict__ for j in jobs])
    else:
        whats, models = jobs_svc.jobs_what(jobs), jobs_svc.jobs_model(jobs)
        width = max([len(models[j.id][:30]) for j in jobs] or [0])
        for j in jobs:
            ran = j.run_seconds()
            # an ended job's final state is its status: no partial percent it stopped at (a failed job's 5 %)
            done = "" if j.finished else f"{j.progress * 100:5.1f}%"
            print(f"#{j.id:<4} {j.kind:11s} {j.status:9s} {done:>6}  "
                  f"{'' if ran is None else f'{ran:.0f} s':>7}  {models[j.id][:30]:<{width}}  {whats[j.id][:40]:<40}  "
                  f"{j.message[:60]}" + (f"  ERROR: {j.error[:100]}" if j.error else ""))
    return 0


def add_commands(sub: SubParsers) -> None:
    """jobs [list | show ID | cancel ID | retry ID]."""
    sp = sub.add_parser("jobs", help="list, show, cancel or retry jobs")
    sp.add_argument("action", nargs="?", default="list", choices=["list", "show", "cancel", "retry"],
                    help="list (default), show ID, cancel ID, or retry ID (queue a failed / cancelled job again)")
    sp.add_argument("id", nargs="?", type=int, help="job id (show, cancel, retry)")
    sp.add_argument("--limit", type=bounded(LIST_LIMIT), default=30, help="newest jobs listed (default 30)")
    add_json(sp, "print as JSON")
    sp.set_defaults(func=cmd_jobs)
