"""`quantplan users` and `quantplan audit`: the team's people and roles, and the audit log.

The CLI runs against the database directly, which is an operator's access: it acts as QUANTPLAN_USER (or ``--as``),
with an admin's rights (quantplan.services.access.operator), and its records carry that name.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys

from quantplan.cli.common import CliError, checked_settings
from quantplan.cli.options import SubParsers

ROLES = ("viewer", "member", "admin")


def cmd_users(args: argparse.Namespace) -> int:
    """`quantplan users [list]` / `quantplan users set-role NAME ROLE`."""
    from quantplan.services import access

    checked_settings()
    if args.action == "set-role":
        if not args.name or not args.role:
            raise CliError("users set-role takes a NAME and a ROLE (viewer, member or admin)")
        person = access.set_role(args.name, args.role)
        print(f"{person.name} is now a {person.role}")
        return 0
    people = access.list_users()
    if args.json:
        print(json.dumps([{"name": p.name, "role": p.role, "created_at": p.created_at.isoformat(),
                           "last_seen_at": p.last_seen_at.isoformat() if p.last_seen_at else None}
                          for p in people], indent=2))
        return 0
    if not people:
        print("nobody yet: the first person to sign in becomes admin")
    for p in people:
        seen = p.last_seen_at.strftime("%Y-%m-%d %H:%M") if p.last_seen_at else "never signed in"
        print(f"{p.name:<40} {p.role or '-':<7} {seen}")
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    """`quantplan audit [--limit N] [--who NAME] [--action A] [--format csv|json]`: the audit log, newest first."""
    from quantplan.services import access

    checked_settings()
    log = access.audit_log(limit=args.limit, actor=args.who, action=args.action)
    rows = [{"id": a.id, "at": a.at.isoformat(), "actor": a.actor, "action": a.action, "target": a.target,
             "detail": json.dumps(a.detail, sort_keys=True)} for a in log]
    if args.format == "json":
        print(json.dumps([{**r, "detail": a.detail} for r, a in zip(rows, log, strict=True)], indent=2))
        return 0
    writer = csv.DictWriter(sys.stdout, fieldnames=["id", "at", "actor", "action", "target", "detail"])
    writer.writeheader()
    writer.writerows(rows)
    return 0


def cmd_note(args: argparse.Namespace) -> int:
    """`quantplan note add KIND ID [TEXT] [--tag T]...` / `quantplan note list [KIND [ID]] [--tag T]`."""
    from quantplan.services import notes as notes_svc

    checked_settings()
    if args.action == "add":
        if args.kind is None or args.id is None:
            raise CliError("note add takes a KIND (job, plan, model) and its ID, then the text")
        n = notes_svc.add_note(args.kind, args.id, args.text or "", args.tag or [])
        found = [n]
    else:
        found = notes_svc.notes(args.kind, args.id, (args.tag or [None])[0])
    if args.json:
        print(json.dumps([{"id": n.id, "at": n.at.isoformat(), "author": n.author,
                           "on": f"{n.target_kind} {n.target_id}", "text": n.text, "tags": n.tags} for n in found],
                         indent=2))
        return 0
    for n in found:
        tags = " ".join(f"#{t}" for t in n.tags)
        print(f"{n.at:%Y-%m-%d %H:%M} {n.author} on {n.target_kind} {n.target_id}: {n.text} {tags}".rstrip())
    return 0


def add_commands(sub: SubParsers) -> None:
    """users, audit, note."""
    sp = sub.add_parser("users", help="list the team's people, or set one's role (viewer, member, admin)")
    sp.add_argument("action", nargs="?", choices=("list", "set-role"), default="list",
                    help="list (default): everyone and their role; set-role NAME ROLE")
    sp.add_argument("name", nargs="?", help="set-role: the person (as they sign in, e.g. their email)")
    sp.add_argument("role", nargs="?", choices=ROLES, help="set-role: the role to give")
    sp.add_argument("--json", action="store_true", help="list as JSON")
    sp.set_defaults(func=cmd_users)
    sp = sub.add_parser("audit", help="export the audit log (who removed, cleared, registered, changed a role)")
    sp.add_argument("--limit", type=int, default=None, help="at most this many entries, newest first")
    sp.add_argument("--who", help="only this person's actions")
    sp.add_argument("--action", help="only this action (remove-model, clear-cache, register-path, set-role, ...)")
    sp.add_argument("--format", choices=("csv", "json"), default="csv", help="csv (default) or json")
    sp.set_defaults(func=cmd_audit)
    sp = sub.add_parser("note", help="write a note or tags on a job, plan version or model, or list notes")
    sp.add_argument("action", choices=("add", "list"), help="add: write one (members and admins); list: read them")
    sp.add_argument("kind", nargs="?", choices=("job", "plan", "model"), help="what the note is on")
    sp.add_argument("id", nargs="?", type=int, help="its id")
    sp.add_argument("text", nargs="?", help="add: the note's text (\"shipped\", \"bad calibration text\")")
    sp.add_argument("--tag", action="append", help="add: a tag (repeat for more); list: only notes with this tag")
    sp.add_argument("--json", action="store_true", help="print the notes as JSON")
    sp.set_defaults(func=cmd_note)
