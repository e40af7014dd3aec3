"""The Outliers page's MoE chart: a block x expert heatmap of the calibration tokens the router sent to each
expert (:mod:`quantcore.evaluation.experts`), experts below the threshold outlined."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import altair as alt
import pandas as pd

from app.charts.base import CHART_HEIGHT, MAGNITUDE_SCHEME, VERMILLION
from quantcore.evaluation.experts import MIN_EXPERT_TOKENS, coverage_rows

CELL_PX = 18  # one expert's column; a block's row
MAX_WIDTH_PX = 900  # wider: cells narrow so that the chart fits a page


def coverage_frame(coverage: Mapping[str, Mapping[str, Any]] | None,
                   min_tokens: int = MIN_EXPERT_TOKENS) -> pd.DataFrame:
    """One row per block and expert: block, expert, tokens, share, mean_weight, thin."""
    return pd.DataFrame(coverage_rows(coverage, min_tokens),
                        columns=["block", "expert", "tokens", "share", "mean_weight", "thin"])


def coverage_chart(frame: pd.DataFrame, min_tokens: int = MIN_EXPERT_TOKENS) -> alt.LayerChart:
    """Tokens routed per block (rows, model order) and expert (columns), log colour; thin experts outlined."""
    blocks = list(dict.fromkeys(frame["block"]))
    experts = int(frame["expert"].max()) + 1 if len(frame) else 1
    width = min(MAX_WIDTH_PX, CELL_PX * experts)
    data = frame.assign(plotted=frame["tokens"].clip(lower=0.5))  # a log scale cannot show 0 tokens
    base = alt.Chart(data).encode(
        x=alt.X("expert:O", title="expert"),
        y=alt.Y("block:N", sort=blocks, title=None),
        tooltip=[alt.Tooltip("block:N"), alt.Tooltip("expert:O"), alt.Tooltip("tokens:Q", title="tokens routed"),
                 alt.Tooltip("share:Q", format=".1%", title="share of the block's routed tokens"),
                 alt.Tooltip("mean_weight:Q", format=".3f", title="mean routing weight")],
    )
    cells = base.mark_rect().encode(
        color=alt.Color("plotted:Q", title="tokens routed", scale=alt.Scale(type="log", scheme=MAGNITUDE_SCHEME)))
    thin = base.transform_filter(alt.datum.thin).mark_rect(fill=None, stroke=VERMILLION, strokeWidth=2)
    height = min(CHART_HEIGHT * 2, max(CELL_PX * 3, CELL_PX * len(blocks)))
    return alt.layer(cells, thin).properties(
        width=width, height=height,
        title=f"Calibration tokens routed to each expert (outlined: fewer than {min_tokens})")
