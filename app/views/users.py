"""Users: the team's people and their roles; for admins, changing a role and the audit log."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from quantplan.services import access

st.title("Users")
st.caption("Viewers read everything; members also queue jobs, save plans and write notes; admins also remove "
           "models, clear caches, register server paths and manage roles. The first person to sign in is admin.")

me = access.current()
people = access.list_users()
st.dataframe(pd.DataFrame([{"name": p.name, "role": p.role or "(never signed in)", "first seen": p.created_at,
                            "last signed in": p.last_seen_at} for p in people]),
             hide_index=True, width="stretch")

if not me.may("manage_roles"):
    st.info(f"You are a {me.role}: an admin changes roles here.")
    st.stop()

with st.form("set_role"):
    c1, c2 = st.columns(2)
    who = c1.selectbox("Person", [p.name for p in people], key="users_who")
    role = c2.selectbox("Role", ["viewer", "member", "admin"], key="users_role")
    if st.form_submit_button("Set role"):
        try:
            changed = access.set_role(who, role)
            st.success(f"{changed.name} is now a {changed.role}.")
        except (ValueError, LookupError) as exc:
            st.error(str(exc))

st.subheader("Audit log")
st.caption("Destructive and access-changing actions, newest first (`quantplan audit` exports it).")
log = access.audit_log(limit=500)
if log:
    st.dataframe(pd.DataFrame([{"when": a.at, "who": a.actor, "action": a.action, "on": a.target,
                                "detail": a.detail} for a in log]), hide_index=True, width="stretch")
else:
    st.caption("Nothing yet.")
