"""`quantplan history`: every run of the team, filtered, searched, sorted and paged as on the History page; and
`quantplan history show ID`: one run in full, as its page shows it."""

from __future__ import annotations

import argparse
from typing import Any

from quantplan.cli.common import CliError, checked_settings, print_json
from quantplan.cli.options import SubParsers


def _show(job_id: int, as_json: bool) -> int:
    from quantplan.services import history as history_svc
    from quantplan.services.scoring import pm_text

    r = history_svc.run(job_id)
    j = r.job
    out: dict[str, Any] = {
        "id": j.id, "kind": j.kind, "status": j.status, "model": r.model_name, "model_removed": r.model_removed,
        "plan": r.plan.label if r.plan else None, "plan_parent": r.parent.label if r.parent else None,
        "person": j.requested_by, "device": j.device, "worker": j.worker_host, "queue": j.queue,
        "software": r.environment, "timings": dict(r.timings), "parameters": history_svc.parameters(j),
        "result": {k: v for k, v in (j.result or {}).items() if k != "records"}, "error": j.error,
        "score": ({**r.score.metrics(), **r.score.statistics(), "plan": r.score.plan_label, "text": r.score.dataset}
                  if r.score else None),
        "notes": [{"at": n.at.isoformat(), "author": n.author, "text": n.text, "tags": n.tags} for n in r.notes],
    }
    if as_json:
        print_json(out)
        return 0
    print(f"run #{j.id} {j.kind} {j.status}: {r.model_name or 'no model'}{' (removed)' if r.model_removed else ''}"
          f"{f', plan {r.plan.label}' if r.plan else ''}, asked by {j.requested_by or '?'}")
    print(f"  device {j.device or j.queue}, worker {j.worker_host or '-'}")
    print("  software: " + ", ".join(f"{what} {version}" for what, version in r.software))
    print("  " + ", ".join(f"{what} {when}" for what, when in r.timings))
    if r.score:
        print(f"  KL {pm_text(r.score.kl_mean, r.score.kl_mean_err)}, top-1 {r.score.top1_agree:.4f}, "
              f"perplexity {r.score.ppl_ref:.3f} -> {r.score.ppl:.3f}")
    if j.error:
        print(f"  error: {j.error}")
    for n in r.notes:
        print(f"  note {n.at:%Y-%m-%d %H:%M} {n.author}: {n.text} {' '.join('#' + t for t in n.tags)}".rstrip())
    return 0


def cmd_history(args: argparse.Namespace) -> int:
    """`quantplan history [filters] [--sort COL] [--ascending] [--page N] [--limit N] [--json]` and
    `quantplan history show ID [--json]`."""
    from quantplan.services import history as history_svc
    from quantplan.services.jobs import duration_text

    checked_settings()
    if args.action == "show":
        if args.id is None:
            raise CliError("say which run: quantplan history show ID")
        return _show(args.id, args.json)
    if args.id is not None:
        raise CliError(f"quantplan history lists runs; to see run {args.id}: quantplan history show {args.id}")
    wanted = history_svc.history_filter(person=args.person, model=args.model, plan=args.plan, kind=args.kind,
                                        status=args.status, device=args.on_device, tag=args.tag, since=args.since,
                                        until=args.until, text=args.search)
    page = history_svc.history(wanted, sort=args.sort, descending=not args.ascending, page=args.page,
                               page_size=args.limit)
    if args.json:
        print_json({"total": page.total, "page": page.page, "pages": page.pages, "page_size": page.page_size,
                    "runs": [history_svc.row_dict(r) for r in page.rows]})
        return 0
    if not page.rows:
        print("no run matches" if page.total == 0 else "no run on this page")
        return 0
    for r in page.rows:
        model = f"{r.model}{' (removed)' if r.model_removed else ''}" if r.model else "-"
        when = (r.started_at or r.queued_at).strftime("%Y-%m-%d %H:%M")
        took = duration_text(r.duration_s)  # the Jobs page's and `quantplan jobs`' form
        what = r.plan or r.scheme or ""
        tags = " ".join(f"#{t}" for t in r.tags)
        print(f"#{r.id:<5} {r.kind:11s} {r.status:9s} {when}  {took:>11}  {(r.person or '?')[:24]:<24} "
              f"{model[:24]:<24} {what[:20]:<20} {(r.device or '-')[:20]:<20} {history_svc.headline(r)} {tags}"
              .rstrip())
    if page.pages > 1:
        print(f"page {page.page} of {page.pages} ({page.total} runs): --page N for another")
    return 0


def add_commands(sub: SubParsers) -> None:
    """history [show ID]."""
    from store.history import MAX_PAGE, SORTS
    from store.models import JOB_KINDS, JOB_STATUSES

    sp = sub.add_parser("history", help="every run of the team, filtered and sorted (the History page); "
                                        "show ID: one run in full")
    sp.add_argument("action", nargs="?", choices=("list", "show"), default="list",
                    help="list (default): the runs; show ID: one run's parameters, software, timings, results, notes")
    sp.add_argument("id", nargs="?", type=int, help="show: the run (job) id")
    sp.add_argument("--person", help="only runs this person asked for (as they sign in, e.g. their email)")
    sp.add_argument("--model", help="only runs on this model (name or id; a removed model by its name)")
    sp.add_argument("--plan", help="only runs of this plan: NAME (every version), NAME@vN, or a plan id")
    sp.add_argument("--kind", choices=JOB_KINDS, help="only runs of this kind")
    sp.add_argument("--status", choices=JOB_STATUSES, help="only runs with this status")
    sp.add_argument("--device", dest="on_device", metavar="DEVICE",  # not `device`: main() sets that one
                    help="only runs on a device whose label contains this (cpu, cuda, H100)")
    sp.add_argument("--tag", help="only runs someone tagged with this")
    sp.add_argument("--since", help="only runs asked for on this day (UTC, YYYY-MM-DD) or later")
    sp.add_argument("--until", help="only runs asked for on this day (UTC, YYYY-MM-DD) or earlier")
    sp.add_argument("--search", help="words found in the model, plan, person, device, worker, message, error or "
                                     "notes (every word must be found)")
    sp.add_argument("--sort", choices=SORTS, default="id", help="the column to sort by (default: id, newest first)")
    sp.add_argument("--ascending", action="store_true", help="smallest first (default: largest / newest first)")
    sp.add_argument("--page", type=int, default=1, help="which page (default 1)")
    sp.add_argument("--limit", type=int, default=50, help=f"runs a page (default 50, at most {MAX_PAGE})")
    sp.add_argument("--json", action="store_true", help="print the runs (or the run) as JSON")
    sp.set_defaults(func=cmd_history)
