"""The Outliers page's MoE section: how many calibration tokens the router sent to each expert, block by block,
and which experts' statistics rest on too few of them (issue 43). Included from ``app/views/outliers.py``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import streamlit as st

from app.charts import moe as moe_charts
from quantcore.evaluation.experts import MIN_EXPERT_TOKENS, thin_experts


@st.cache_data(show_spinner=False, max_entries=8)
def coverage_spec(job_id: int, coverage: Mapping[str, Any]) -> dict:
    """The heatmap's Vega-Lite spec, once per calibration (a finished job's result never changes)."""
    return moe_charts.coverage_chart(moe_charts.coverage_frame(coverage)).to_dict()


def render(cal: Any) -> None:
    """The section for calibration job ``cal`` (a JobRecord); nothing for a dense model."""
    coverage = (cal.result or {}).get("experts")
    if not coverage:
        return
    st.subheader("MoE experts: calibration tokens per expert")
    st.vega_lite_chart(coverage_spec(cal.id, coverage), width="content")
    thin = thin_experts(coverage)
    total = sum(len(r.get("counts") or []) for r in coverage.values())
    st.caption("Calibration runs every expert on every token (as llm-compressor does), but serving sends each "
               "expert only the tokens its router picks: an expert routed few calibration tokens has static scales, "
               "GPTQ Hessians and outlier figures measured on inputs it rarely sees. "
               + (f"**{len(thin)} of {total} experts were routed fewer than {MIN_EXPERT_TOKENS} tokens** "
                  f"(outlined; e.g. {thin[0][0]} expert {thin[0][1]}: {thin[0][2]}): calibrate on more text, or "
                  "keep those blocks in a scheme with dynamic scales." if thin
                  else f"Every expert was routed at least {MIN_EXPERT_TOKENS} tokens."))
