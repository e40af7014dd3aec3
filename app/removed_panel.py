"""The models removed and not purged, on the Models page: who removed each and when (their history stays readable
on the History, Results and Jobs pages), and, for an admin, the purge that deletes one for good
(quantplan.services.models.purge_model)."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from app import auth
from quantplan.services import models as models_svc

PURGED = "models_purged"  # what the last purge deleted, said once after the page reruns


def render() -> None:
    """Nothing where no model is removed; else their table and (admins) the purge."""
    if said := st.session_state.pop(PURGED, None):
        st.success(said)
    gone = models_svc.removed_models()
    if not gone:
        return
    with st.expander(f"Removed models ({len(gone)})"):
        st.caption("Their files are deleted; their plans, scores, calibrations, sweeps, jobs and notes stay readable, "
                   "marked removed. Registering the same checkpoint again brings one back with them.")
        st.dataframe(pd.DataFrame([{"id": m.id, "name": m.name, "architecture": m.architecture,
                                    "removed by": m.removed_by, "removed": m.removed_at} for m in gone]),
                     hide_index=True, width="stretch")
        if not auth.may("purge_model"):
            return
        ids = [m.id for m in gone]
        names = {m.id: f"#{m.id} {m.name}" for m in gone}
        which = st.selectbox("Purge", ids, format_func=names.get, key="purge_model")
        usage = {k: v for k, v in models_svc.model_usage(int(which)).items() if k != "active"}
        what = ", ".join(f"{v} {k}" for k, v in usage.items())
        st.warning(f"Purging {names[which]} deletes it for good with {what}; its jobs stay in the history, naming it.")
        sure = st.checkbox(f"Yes, purge {names[which]}", key=f"purge_sure_{which}")
        if st.button("Purge model", disabled=not sure, key=f"purge_{which}"):
            try:
                purged = models_svc.purge_model(int(which))
            except (ValueError, LookupError) as exc:
                st.error(str(exc))
            else:
                st.session_state[PURGED] = f"Purged {purged.name} ({what})."
                st.rerun()
