"""Who is acting, and what their role lets them do: the rules both front ends go through.

Every use case that writes asks :func:`require` first, so a refusal does not depend on what a page shows. The
person acting is, in order: the one a front end set for this run (:func:`acting`: the app's signed-in person), else,
where the process allows it (the CLI, the app with QUANTPLAN_AUTH=none, the tests), the operator: QUANTPLAN_USER or
the OS user, as admin. A CLI runs against the database directly, which is an operator's access; ``--as NAME`` only
says whose name its records carry. The app with a sign-in calls :func:`signin_required` once, so a run in which no
person was set is refused rather than treated as the operator.

Roles, each with everything of the ones before it: viewer (reads everything), member (queues jobs, saves plans,
writes notes, cancels their own jobs), admin (removes models, clears caches, registers server paths, cancels
anyone's job, manages roles, reads the audit log). The first person to sign in where nobody is admin yet becomes
admin; later ones get QUANTPLAN_DEFAULT_ROLE (viewer).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantplan.services.deployment import settings
from quantplan.services.errors import Refused
from store import team
from store.db import session_scope
from store.models import ROLES

RANK = {role: i for i, role in enumerate(ROLES)}

# what each action needs, and how a refusal names it
NEEDS: dict[str, tuple[str, str]] = {
    "queue": ("member", "queueing a job"),
    "save_plan": ("member", "saving a plan"),
    "upload_text": ("member", "uploading a text"),
    "write_note": ("member", "writing a note"),
    "cancel_own": ("member", "cancelling a job"),
    "cancel_any": ("admin", "cancelling someone else's job"),
    "remove_model": ("admin", "removing a model"),
    "purge_model": ("admin", "purging a removed model"),
    "choose_plan": ("member", "choosing a plan version"),
    "clear_cache": ("admin", "clearing a model's cached files"),
    "register_path": ("admin", "registering a path on the server"),
    "manage_roles": ("admin", "changing a role"),
    "read_audit": ("admin", "reading the audit log"),
}


class Forbidden(Refused):
    """The person acting lacks the role an action needs; the message names both and who can change it."""


@dataclass(frozen=True)
class Actor:
    name: str
    role: str
    operator: bool = False  # QUANTPLAN_USER / the OS user with direct access, not a signed-in person

    def may(self, action: str) -> bool:
        return RANK[self.role] >= RANK[NEEDS[action][0]]


_ACTOR: contextvars.ContextVar[Actor | None] = contextvars.ContextVar("quantplan_actor", default=None)
_SIGNIN_REQUIRED = False
_SIGNED_IN: Callable[[], Actor | None] | None = None


def signin_required(signed_in: Callable[[], Actor | None]) -> None:
    """From now on, in this process, the person acting is the one ``signed_in`` names (the app: its session's
    signed-in person, also in a fragment's later run); where it names nobody, refused, never the operator."""
    global _SIGNIN_REQUIRED, _SIGNED_IN
    _SIGNIN_REQUIRED, _SIGNED_IN = True, signed_in


def operator() -> Actor:
    """QUANTPLAN_USER (a CLI's --as) or the OS user, with an operator's access: admin."""
    return Actor(name=settings().user or "anonymous", role="admin", operator=True)


def current() -> Actor:
    """The person acting now (see the module's text); Forbidden where a sign-in is required and none was made."""
    actor = _ACTOR.get()
    if actor is not None:
        return actor
    if _SIGNIN_REQUIRED:
        actor = _SIGNED_IN() if _SIGNED_IN is not None else None
        if actor is not None:
            return actor
        raise Forbidden("sign in first: nobody is signed in on this page")
    return operator()


def set_actor(actor: Actor | None) -> None:
    """Make ``actor`` the person acting for the rest of this thread's run (the app, at the top of each run)."""
    _ACTOR.set(actor)


@contextmanager
def acting(actor: Actor) -> Iterator[Actor]:
    """``actor`` is the person acting inside the block."""
    token = _ACTOR.set(actor)
    try:
        yield actor
    finally:
        _ACTOR.reset(token)


def require(action: str) -> Actor:
    """The person acting, when their role allows ``action``; Forbidden, saying who may, otherwise."""
    actor = current()
    needed, what = NEEDS[action]
    if not actor.may(action):
        raise Forbidden(f"{actor.name} is a {actor.role}: {what} needs the {needed} role. An admin can give it on "
                        f"the Users page or with `quantplan users set-role {actor.name} {needed}`.")
    return actor


def sign_in(name: str) -> Actor:
    """The person ``name`` signed in (by the app's sign-in): their role, recorded as seen now. The first one where
    nobody is admin yet becomes admin; a newcomer gets QUANTPLAN_DEFAULT_ROLE."""
    name = name.strip()
    if not name or len(name) > 200:
        raise Forbidden("the sign-in gave no usable name (empty, or over 200 characters): no access")
    with session_scope(settings()) as s:
        first = team.admin_count(s) == 0
        member = team.seen(s, name, "admin" if first else settings().default_role)
        if first and member.role == "admin":
            team.record(s, actor=name, action="first-admin", target=f"user {name}",
                        detail={"why": "first person to sign in where nobody was admin"})
    return Actor(name=member.name, role=member.role or "viewer")


def list_users() -> list[team.Member]:
    """Every person named in this deployment, with their role (None: named as who asked, never signed in)."""
    with session_scope(settings()) as s:
        return team.list_members(s)


def set_role(name: str, role: str) -> team.Member:
    """Give ``name`` the role (admin only, audited). Refused for an unknown role, and for taking the last admin's
    role away (nobody could give it back from the app)."""
    actor = require("manage_roles")
    if role not in ROLES:
        raise Refused(f"{role!r} is not a role: choose one of {', '.join(ROLES)}")
    with session_scope(settings()) as s:
        existing = team.find_member(s, name)
        if existing is not None and existing.role == "admin" and role != "admin" and team.admin_count(s) <= 1:
            raise Refused(f"{name} is the only admin: make someone else admin first")
        before, after = team.set_role(s, name, role)
        team.record(s, actor=actor.name, action="set-role", target=f"user {name}",
                    detail={"from": before, "to": role})
    return after


def audit(action: str, target: str, detail: dict[str, Any] | None = None, session: Any = None) -> None:
    """Add a line to the audit log, by the person acting: in ``session``'s transaction where given."""
    name = current().name
    if session is not None:
        team.record(session, actor=name, action=action, target=target, detail=detail)
        return
    with session_scope(settings()) as s:
        team.record(s, actor=name, action=action, target=target, detail=detail)


def audit_log(limit: int | None = None, actor: str | None = None, action: str | None = None) -> list[team.AuditRecord]:
    """The audit log, newest first (admins only)."""
    require("read_audit")
    with session_scope(settings()) as s:
        return team.list_audit(s, limit=limit, actor=actor, action=action)


def allowed_server_path(path: Path) -> Path:
    """``path`` with its symlinks resolved, when it lies in a folder of QUANTPLAN_MODEL_ROOTS; Refused otherwise.
    Without configured roots: anywhere with QUANTPLAN_AUTH=none (one person's own machine), nowhere otherwise."""
    s = settings()
    real = path.resolve()
    roots = s.model_root_paths
    if not roots:
        if s.auth == "none":
            return real
        raise Refused("registering a path on the server needs QUANTPLAN_MODEL_ROOTS (the folders models may be "
                      "registered from) on this deployment: nothing was queued")
    if any(real == root or root in real.parents for root in roots):
        return real
    shown = f"{path} (which is {real})" if real != path else str(path)
    raise Refused(f"{shown} is outside the folders models may be registered from "
                  f"(QUANTPLAN_MODEL_ROOTS: {', '.join(map(str, roots))}): nothing was queued")


def binding_problem(address: str, auth: str) -> str | None:
    """Why the app must not start on ``address`` with sign-in ``auth``, with the fix; None where it may. Without a
    sign-in (none) everyone who reaches the port is the operator, an admin: only a loopback address is allowed."""
    if auth != "none":
        return None
    import ipaddress

    host = address.strip().strip("[]")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if loopback:
        return None
    return (f"the app would listen on {address} with QUANTPLAN_AUTH=none: anyone who reaches it would act as "
            f"{settings().user} with every right. Set QUANTPLAN_AUTH=oidc (with .streamlit/secrets.toml [auth]) or "
            "QUANTPLAN_AUTH=header (behind an authenticating proxy), or bind QUANTPLAN_UI_ADDRESS=127.0.0.1 "
            "(docs/deployment/team.md)")
