"""The plan version chosen for a model, on the Plans page: which, who, when and why, the history of choices, and
(members and admins) the form that marks another (quantplan.services.choices)."""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
import streamlit as st

from app import auth
from quantplan.services import choices as choices_svc
from store.records import ModelRecord, PlanRecord

CHOSEN_SAID = "plan_chosen_said"  # what the last choice did, said once after the page reruns


def render(model: ModelRecord, plans: Sequence[PlanRecord]) -> None:
    """The model's chosen version (or that none is), its earlier choices, and the form to choose one."""
    st.subheader("Chosen version")
    if said := st.session_state.pop(CHOSEN_SAID, None):
        st.success(said)
    choice = choices_svc.chosen_for(model.id)
    if choice is not None:
        st.markdown(f"**{choice.label}** is the version chosen for {model.name}, by {choice.chosen_by} on "
                    f"{choice.chosen_at:%Y-%m-%d %H:%M} UTC. Why: {choice.why}")
        st.caption("Its exported recipe and vLLM command start with a comment saying so.")
    else:
        st.caption(f"No version is chosen for {model.name} yet: choosing one records who decided, when and why, "
                   "for the team's history and the plan's exports.")
    history = choices_svc.choice_history(model.id)
    if len(history) > 1 or (history and choice is None):
        with st.expander(f"Earlier choices ({len(history)})"):
            st.dataframe(pd.DataFrame(history), hide_index=True, width="stretch")
    if not plans or model.removed:
        return
    if not auth.may("choose_plan"):
        st.caption(auth.cannot("choose_plan"))
        return
    ids = [p.id for p in plans]
    labels = {p.id: p.label for p in plans}
    with st.form(f"choose_plan_{model.id}", enter_to_submit=False):
        c1, c2 = st.columns([1, 2])
        default = ids.index(choice.plan_id) if choice is not None and choice.plan_id in ids else len(ids) - 1
        plan_id = c1.selectbox("Version", ids, index=default, format_func=labels.get,
                               key=f"choose_version_{ids[-1]}")
        why = c2.text_input("Why this version", key=f"choose_why_{model.id}",
                            placeholder="lowest KL that fits one H100; shipped 2026-12-01")
        if st.form_submit_button("Mark as chosen"):
            try:
                new = choices_svc.choose_plan(int(plan_id), why)
            except (ValueError, LookupError) as exc:
                st.error(str(exc))
            else:
                st.session_state[CHOSEN_SAID] = f"{new.label} is now the version chosen for {model.name}."
                st.rerun()
