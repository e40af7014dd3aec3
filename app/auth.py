"""Who is at the page: the sign-in of QUANTPLAN_AUTH, run at the top of every page run (app/main.py).

none: the operator (QUANTPLAN_USER or the OS user, admin), as before sign-in existed. oidc: Streamlit's own
st.login / st.user / st.logout with the provider of .streamlit/secrets.toml [auth]. header: the person named by the
authenticating proxy's header (QUANTPLAN_AUTH_HEADER), from the proxy's addresses only (QUANTPLAN_AUTH_PROXIES).
Whoever it is, the application layer (quantplan.services.access) decides what they may do; this only says who.
"""

from __future__ import annotations

import streamlit as st

from quantplan.services import access
from quantplan.services.deployment import settings

ACTOR_KEY = "qp_actor"
LOOPBACK = (None, "127.0.0.1", "::1")  # Streamlit gives no address for a client on localhost


def signed_in() -> access.Actor | None:
    """The person at the page, set as the one acting for this run; the page stops with a sign-in (or the reason
    there is no access) where nobody is. None with QUANTPLAN_AUTH=none (the operator acts)."""
    s = settings()
    if s.auth == "none":
        return None
    access.signin_required(_session_actor)  # a use case reached without a person is refused, not the operator
    st.session_state.pop(ACTOR_KEY, None)
    name = _oidc_name() if s.auth == "oidc" else _header_name()
    try:
        actor = access.sign_in(name)
    except access.Forbidden as exc:
        st.error(str(exc))
        st.stop()
    st.session_state[ACTOR_KEY] = actor
    return actor


def _session_actor() -> access.Actor | None:
    """The person this session signed in as (set on each full run; a fragment's run reads it too)."""
    try:
        actor = st.session_state.get(ACTOR_KEY)
    except Exception:  # no Streamlit session in this thread
        return None
    return actor if isinstance(actor, access.Actor) else None


def _oidc_name() -> str:
    if not st.user.is_logged_in:
        st.markdown("## quantplan")
        st.write("Sign in to see this team's models, plans and results.")
        st.button("Sign in", type="primary", on_click=st.login)
        st.stop()
    for claim in ("email", "preferred_username", "name", "sub"):
        value = st.user.get(claim)
        if isinstance(value, str) and value.strip():
            return value
    st.error("The provider named nobody (no email, preferred_username, name or sub claim): no access.")
    st.stop()
    raise AssertionError  # not reached: st.stop ends the run


def _header_name() -> str:
    s = settings()
    proxies = [p.strip() for p in s.auth_proxies.split(",") if p.strip()]
    if proxies:
        address = st.context.ip_address
        seen = "127.0.0.1" if address in LOOPBACK else address
        if seen not in proxies:
            st.error(f"No access: this request did not come through the sign-in proxy ({', '.join(proxies)}).")
            st.stop()
    value = st.context.headers.get(s.auth_header)
    if not value or not value.strip():
        st.error(f"No access: nobody is signed in (the request carries no {s.auth_header} header; open quantplan "
                 "through the team's sign-in address).")
        st.stop()
    return value.strip()


def sidebar_identity(actor: access.Actor | None) -> None:
    """Who is signed in, their role, and the way out (oidc); nothing with QUANTPLAN_AUTH=none."""
    if actor is None:
        return
    with st.sidebar:
        st.caption(f"Signed in as **{actor.name}** ({actor.role})")
        if settings().auth == "oidc":
            st.button("Sign out", on_click=st.logout, key="qp_sign_out")


def may(action: str) -> bool:
    """Whether the person at the page may do ``action`` (a key of quantplan.services.access.NEEDS): pages offer a
    write control only where it would not be refused. The services refuse regardless of what a page offers."""
    try:
        return access.current().may(action)
    except access.Forbidden:  # nobody signed in where a sign-in is required
        return False


def cannot(action: str) -> str:
    """The line a page shows instead of a control the person's role lacks ("... needs the member role")."""
    needed, what = access.NEEDS[action]
    try:
        who = access.current()
    except access.Forbidden:
        return f"Sign in: {what} needs the {needed} role."
    return f"{who.name} is a {who.role}: {what} needs the {needed} role. An admin can give it on the Users page."


def may_cancel(requested_by: str | None) -> bool:
    """Whether the person at the page may cancel a job ``requested_by`` asked for: their own as a member, anyone's
    as an admin (quantplan.services.jobs.cancel_job's rule)."""
    try:
        actor = access.current()
    except access.Forbidden:
        return False
    return actor.may("cancel_any") or (actor.may("cancel_own") and requested_by == actor.name)
