"""The Results page's outlier fixes side by side (issue #46): scored plans that differ only in the fix (none,
SmoothQuant at an α, a Hadamard rotation, both), each with its KL ± error and top-1, and its difference from the
plan without a fix (paired over the same sequences where both scores kept them). Included from
``app/views/results.py``; nothing when no two scores differ only in the fix."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd
import streamlit as st

from app.charts import rotation as rotation_charts
from app.charts.base import vega_spec
from quantplan.services import fixes as fixes_svc
from quantplan.services import scoring as scoring_svc


def group_frame(group: fixes_svc.FixGroup) -> pd.DataFrame:
    """One row per fix: fix, plan, job, KL ± error, top-1 ± error, KL and top-1 against the unfixed plan."""
    dkl = fixes_svc.versus_unfixed(group, "kl_mean")
    dtop = fixes_svc.versus_unfixed(group, "top1_agree")
    return pd.DataFrame([{"fix": fix, "plan": s.plan_label, "job": s.job_id,
                          "KL ± error": scoring_svc.pm_text(s.kl_mean, s.kl_mean_err),
                          "top-1": scoring_svc.pm_text(s.top1_agree, s.top1_agree_err, ".3f"),
                          "KL − none's": "" if d is None else d.text(".3g"),
                          "top-1 − none's": "" if t is None else t.text(".3f")}
                         for fix, s, d, t in zip(group.fixes, group.scores, dkl, dtop, strict=True)])


def chart_frame(group: fixes_svc.FixGroup) -> pd.DataFrame:
    rows = []
    for fix, s in zip(group.fixes, group.scores, strict=True):
        err = s.kl_mean_err or 0.0
        rows.append({"fix": fix, "kl_mean": s.kl_mean, "kl_lo": s.kl_mean - err, "kl_hi": s.kl_mean + err})
    return pd.DataFrame(rows)


def render(scores: Sequence[Any]) -> None:
    """The section for the model's ``scores`` (newest first)."""
    groups = fixes_svc.fix_groups(scores)
    if not groups:
        return
    st.subheader("Outlier fixes side by side")
    label = {i: f"{g.title} · {g.dataset}, {g.tokens:,} positions · {len(g.scores)} fixes" for i, g in
             enumerate(groups)}
    i = st.selectbox("Plans that differ only in the fix", list(label), format_func=label.get,
                     key="results_fix_group")  # the newest comparison first
    group = groups[i if i is not None and i < len(groups) else 0]
    st.vega_lite_chart(vega_spec(rotation_charts.fix_kl_chart(chart_frame(group))), width="stretch")
    st.dataframe(group_frame(group), hide_index=True, width="stretch")
    st.caption("Scores of plans that quantize the same way and differ only in their outlier fix (SmoothQuant's α, "
               "the `*_SQ` presets, a `transforms: rotation`), on the same evaluation tokens; the newest score of "
               "each fix. The differences from the plan without a fix are paired over the same sequences where both "
               "scores kept them (far sharper than the two errors apart); a difference within about two standard "
               "errors is not one this many sequences can tell.")
