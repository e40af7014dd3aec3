"""What every chart of the pages shares: the bounds on what a chart embeds, sizes, the one colour palette, the order
of projection types, and the checks of a frame's columns."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TypeVar

import altair as alt
import numpy as np
import pandas as pd

from quantcore.evaluation import outliers as ol

# ---------------------------------------------------------------------------------------------
# Named constants
# ---------------------------------------------------------------------------------------------
MAX_MARKS = 5000  # hard bound on data rows embedded in one chart (Altair's own default limit)
DEFAULT_MAX_POINTS = ol.DEFAULT_MAX_POINTS  # 2000 points per chart (layers of the overview, positions)
CHANNEL_POINTS = 800  # channel points of a per-channel chart: max-preserving (every outlier kept); more only cost
# the browser its drawing (a 1,536-channel layer reads the same at 800 points)
SMOOTH_POINTS = 400  # points of the two SmoothQuant panels together (each tensor's 100 channels a panel, max-
# preserving): an α step redraws them all, and at 800 Vega's update and the SVG's layout were most of a step
DEFAULT_TOP_K = 5  # channels labelled in the channels chart
HEATMAP_MAX_CELLS = 1500  # blocks x channel bins in the depth heatmap (50 bins at 30 blocks: every spike kept, as
# each bin is its channels' max; 3,000 cells were half of what the browser spent drawing the Outliers page)
OUTLIER_RATIO_CAP = 1e6  # plotted in place of an infinite ratio (median channel exactly 0)
KL_FLOOR = 1e-6  # KL values below this are drawn at it (log axes cannot show 0)
KL_BINS = 40  # log bins of the per-token KL histogram
SENSITIVITY_TOP_N = 40  # bars in the sensitivity chart
SELECTION_NAME = "layer_pick"  # point selection of the overview; Streamlit returns it on rerun
CHART_HEIGHT = 320
KERNEL_COLUMN_PX = 110  # width of one kernel-path column of the kernel heatmap
KERNEL_ROW_PX = 26  # height of one GEMM-shape row
KERNEL_MIN_EXTENT = 2.0  # the speed-up colour scale spans at least 0.5x .. 2x
KERNEL_DARK_SHARE = 0.6  # cells beyond this share of the log extent are dark: white text
OVERVIEW_HEIGHT = 420  # Streamlit fits a stretched chart into its height overall: its axes and labels take part of it
SMOOTH_WIDTH = 360  # each of the two SmoothQuant panels: both fit a wide page's column with their axes
LABEL_FLIP_AT = 0.8  # channels chart: labels of points past this share of the channels read leftwards
LABEL_SPAN = 0.12  # channels chart: the share of the channel axis one label covers ("ch 1229: 3.12e+03")
LABEL_DECADES = 0.4  # ... and the decades of the log y axis it covers: labels closer on both stack upwards
LABEL_STEP_PX = 13  # ... by this many pixels a level
OVERVIEW_WIDTH = 720  # fixed: a band per projection x an offset per block would otherwise grow with depth

# ---------------------------------------------------------------------------------------------
# Colours: one colour-blind-safe palette for every chart (Okabe & Ito's eight, "Color Universal Design"), told
# apart by people with any common colour-vision deficiency; the order puts the most distinct pairs first, so the
# first runs compared never get two near blues. Sequential scales read viridis / inferno, diverging blue-orange.
# ---------------------------------------------------------------------------------------------
PALETTE = (
    "#0072B2",  # blue
    "#E69F00",  # orange
    "#009E73",  # bluish green
    "#D55E00",  # vermillion
    "#CC79A7",  # reddish purple
    "#56B4E9",  # sky blue
    "#F0E442",  # yellow
    "#000000",  # black
)
BLUE, ORANGE, GREEN, VERMILLION, PURPLE, SKY, YELLOW, BLACK = PALETTE
NEUTRAL = "#999999"  # what is context, not a series: representable grid values, plans off the front
OUTSIDE_BLOCKS_COLOR = NEUTRAL  # lm_head and other layers outside the decoder blocks
SEQUENTIAL_SCHEME = "viridis"  # ordered values (depth)
MAGNITUDE_SCHEME = "inferno"  # magnitudes on a log colour scale (channel max, KL)
DIVERGING_SCHEME = "blueorange"  # around a midpoint (speed-up 1x): blue faster, orange slower

INT8_FLUSH_LABEL = "INT8 per-tensor flush"
E4M3_SUBNORMAL_LABEL = "E4M3 min subnormal"
THRESHOLD_COLORS = {INT8_FLUSH_LABEL: VERMILLION, E4M3_SUBNORMAL_LABEL: GREEN}
SERIES_COLORS = {"activation": BLUE, "weight": ORANGE}
GRID_KIND_COLORS = {"representable": NEUTRAL, "clipping point": VERMILLION, "flush to zero": ORANGE}

# Projection types in data-flow order; others follow alphabetically.
PROJ_ORDER = (
    "q_proj",
    "k_proj",
    "v_proj",
    "qkv_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "gate_up_proj",
    "down_proj",
    "lm_head",
)


def proj_sort(projs: Iterable[str]) -> list[str]:
    """Projection types in model order; a fusion group ("q_proj/k_proj/v_proj") sorts as its first member."""

    def key(p: str) -> tuple[int, str]:
        first = p.split("/")[0]
        return (PROJ_ORDER.index(first) if first in PROJ_ORDER else len(PROJ_ORDER), p)

    return sorted(set(projs), key=key)


_Chart = TypeVar("_Chart", bound=alt.TopLevelMixin)


def vega_spec(chart: alt.TopLevelMixin) -> dict:
    """The chart's Vega-Lite spec as the pages embed it (st.vega_lite_chart), not validated against the schema again:
    the builders' specs are validated in the tests, and a page caches the spec per stored result. Its marks carry no
    ARIA description each (:func:`quiet_marks`)."""
    return quiet_marks(chart.to_dict(validate=False))


def quiet_marks(spec: dict) -> dict:
    """``spec`` with ``config.mark.aria`` false unless it says otherwise: Vega-Lite otherwise gives every point, bar
    and cell an ARIA label built from its fields, an expression the browser evaluates per mark (Streamlit's CSP-safe
    interpreter: a tenth of an Outliers visit's script time) for a list no screen reader reads hundreds of; the axes,
    legends and titles keep theirs. Streamlit itself does the same above 5,000 marks."""
    config = spec.setdefault("config", {})
    config.setdefault("mark", {}).setdefault("aria", False)
    return spec


def on_canvas(chart: _Chart) -> _Chart:
    """``chart`` drawn on a canvas instead of SVG (Vega embed's renderer, which Streamlit reads from the spec's
    usermeta): for a chart of many marks no tooltip test reads in the DOM (Streamlit's own switch is at 2,000)."""
    return chart.properties(usermeta={"embedOptions": {"renderer": "canvas"}})


def category_scale(domain: Sequence[str] | None = None) -> alt.Scale:
    """The palette as a nominal colour scale: the categories of ``domain`` in its order (each its own colour up to
    len(PALETTE), then repeating), or in the data's order where no domain is given."""
    if domain is None:
        return alt.Scale(range=list(PALETTE))
    domain = list(dict.fromkeys(domain))
    return alt.Scale(domain=domain, range=[PALETTE[i % len(PALETTE)] for i in range(len(domain))])


def check_columns(df: pd.DataFrame, required: Sequence[str], what: str) -> None:
    """ValueError naming the columns ``what`` needs that ``df`` lacks."""
    missing = [c for c in required if c not in df.columns]
    if missing:
        raise ValueError(f"{what} needs columns {list(required)}; missing {missing} (got {list(df.columns)})")


def positive_floor(values: Iterable[float], default: float = 1e-12) -> float:
    """The smallest finite positive value (``default`` where there is none): the floor of a log axis."""
    arr = np.asarray(list(values), dtype=np.float64)
    arr = arr[np.isfinite(arr) & (arr > 0)]
    return float(arr.min()) if arr.size else default
