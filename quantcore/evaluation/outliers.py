"""Outlier analysis from calibration statistics alone: thresholds, SmoothQuant, "what will break".

numpy only (no torch, no pandas): the Streamlit app imports this module to draw the
Outliers page, so everything here works on :class:`quantcore.evaluation.stats.LayerStats` and
plain arrays. Tables are returned as *columns* (``dict[str, np.ndarray]``, every
column the same length) so ``pandas.DataFrame(columns)`` turns them into a frame
without this module importing pandas.

The picture this module computes (see ``shared/reference``): a few input channels of
an LLM's linear layers are hundreds or thousands of times the median channel. Under a
per-tensor scale ``s = amax / fmt.max`` a value ``x`` is stored as
``s * round_fmt(x / s)``:

* INT8: the step is ``s = amax / 127``; ``round`` sends ``|x| <= s / 2`` to zero, so a
  channel whose max is at most ``amax / 254`` is flushed entirely.
* FP8 E4M3 (fn): the smallest positive value is the subnormal ``2**-9``, i.e.
  ``2**-9 * amax / 448`` after scaling; values at or below half of it flush.

Rounding is round-half-to-even, as in ``torch.round`` and torch's float8 casts: a
value exactly half-way between 0 and the smallest positive value rounds to 0, so the
flush test is ``x <= threshold``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from quantcore.evaluation.stats import LayerStats, hist_edges
from quantcore.formats.catalog import Format, element_format, get_format, representable_values

Columns = dict[str, np.ndarray]
"""A table as named, equal-length numpy columns (``pandas.DataFrame(columns)`` reads it)."""

# ---------------------------------------------------------------------------------------------
# Named constants
# ---------------------------------------------------------------------------------------------
INT8_MAX = 127.0  # largest INT8 magnitude used by symmetric quantization (-127..127)
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
E4M3_MIN_SUBNORMAL = 2.0**-9  # 0.001953125: smallest positive E4M3 (fn) value
SMOOTHQUANT_EPS = 1e-5  # clamp of channel maxima before the power, as in the reference's smooth()
DEFAULT_MAX_POINTS = 2000  # channel points per chart: "a few thousand" marks at most
DEFAULT_TOP_K = 10  # channels always kept by downsampling (and labelled in charts)
DEFAULT_ALPHAS = tuple(i / 20 for i in range(21))  # 0, 0.05, ..., 1: the SmoothQuant sweep
DEFAULT_BREAKAGE_FORMATS = ("int8", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1")
GRANULARITIES = ("tensor", "token", "group", "block")  # schemes.Granularity values this analysis reads
DEFAULT_BLOCK_SIZE = 128  # 1x128 activation tiles (DeepSeek-V3 recipe) for element formats
DEFAULT_STATIC_SCALE_SOURCE = "p99"  # token_max key a static scale is set from, for saturation
TYPICAL_TOKEN_KEY = "p50"  # token_max key standing for "a typical token" under per-token scales

# Names a model uses for the list of its transformer blocks: the integer after one of
# these in a module path is the block index (model.layers.11, encoder.layer.3, transformer.h.0).
_BLOCK_CONTAINERS = frozenset({"layers", "layer", "h", "blocks", "block", "decoder_layers"})
# Leaf names too generic to tell projections apart: the path after the block index is kept
# (BERT: attention.output.dense vs output.dense; GPT-2: attn.c_proj vs mlp.c_proj).
_GENERIC_LEAVES = frozenset({"dense", "c_proj", "proj", "linear", "fc", "out", "output"})
_INT_RE = re.compile(r"^\d+$")
_LOG2_EDGES = np.log2(hist_edges())  # the shared histogram grid, in octaves


# ---------------------------------------------------------------------------------------------
# Format helpers
# ---------------------------------------------------------------------------------------------
@lru_cache(maxsize=64)
def _grid(name: str) -> np.ndarray:
    """Sorted non-negative representable magnitudes of the element format of ``name`` (float64)."""
    grid = np.unique(np.abs(np.asarray(representable_values(name), dtype=np.float64)))
    grid = grid[np.isfinite(grid)]
    grid.setflags(write=False)
    return grid


def _min_positive(name: str) -> float:
    """Smallest positive representable magnitude of the element format (1 for ints, min subnormal for floats)."""
    grid = _grid(name)
    return float(grid[grid > 0][0])


# ---------------------------------------------------------------------------------------------
# Layer names
# ---------------------------------------------------------------------------------------------
def parse_layer_name(name: str) -> tuple[int | None, str]:
    """Split a module path into (block index, projection type).

    >>> parse_layer_name("model.layers.11.mlp.down_proj")
    (11, 'down_proj')
    >>> parse_layer_name("encoder.layer.3.attention.self.query")
    (3, 'query')
    >>> parse_layer_name("lm_head")
    (None, 'lm_head')

    The block index is the integer after a block container (``layers``, ``layer``,
    ``h``, ``blocks``), or else the first integer in the path. Mixture-of-experts paths
    (``model.layers.3.mlp.experts.7.down_proj``) keep the block index and fold every
    expert into the projection type ``down_proj``. Generic leaf names (``dense``,
    ``c_proj``...) keep the path after the block index so that BERT's
    ``attention.output.dense`` and ``output.dense`` stay apart.
    """
    parts = [p for p in name.split(".") if p]
    if not parts:
        return None, name
    block_pos: int | None = None
    for i, part in enumerate(parts):
        if _INT_RE.match(part) and i > 0 and parts[i - 1] in _BLOCK_CONTAINERS:
            block_pos = i
            break
    if block_pos is None:
        block_pos = next((i for i, p in enumerate(parts) if _INT_RE.match(p)), None)
    leaf = parts[-1]
    if block_pos is None:
        return None, leaf
    block = int(parts[block_pos])
    if leaf in _GENERIC_LEAVES:
        tail = [p for p in parts[block_pos + 1 :] if not _INT_RE.match(p)]
        return block, ".".join(tail) if tail else leaf
    return block, leaf


def _as_list(stats: Iterable[LayerStats] | Mapping[str, LayerStats]) -> list[LayerStats]:
    if isinstance(stats, Mapping):
        return list(stats.values())
    return list(stats)


def shared_expert_inputs(
    stats: Iterable[LayerStats] | Mapping[str, LayerStats],
) -> tuple[list[LayerStats], dict[str, int]]:
    """The statistics with each MoE block's routed-expert gate/up inputs shown once.

    Calibration runs every expert on every token (:func:`quantcore.models.moe.all_experts`), so the gate_proj and
    up_proj of all E experts of a block read one tensor, the block's input, and carry the same input statistics 2·E
    times. Returns (the statistics in their order with each such block's gate/up kept only as its first one, {kept
    layer: how many expert linears it stands for}). A block whose gate/up inputs differ (a calibration made before every
    expert saw every token) is left as it is.
    """
    from quantcore.schemes.fusion import expert_block  # torch-free, like this module

    rows = _as_list(stats)
    blocks: dict[str, list[LayerStats]] = {}
    for st in rows:
        block = expert_block(st.name)
        if block is not None and not st.name.endswith(".down_proj"):
            blocks.setdefault(block, []).append(st)
    drop: set[str] = set()
    stands_for: dict[str, int] = {}
    for members in blocks.values():
        first = members[0]
        if len(members) > 1 and all(np.array_equal(m.channel_max, first.channel_max) for m in members[1:]):
            drop.update(m.name for m in members[1:])
            stands_for[first.name] = len(members)
    return [st for st in rows if st.name not in drop], stands_for


# ---------------------------------------------------------------------------------------------
# Overview
# ---------------------------------------------------------------------------------------------
def overview_table(stats: Iterable[LayerStats] | Mapping[str, LayerStats]) -> Columns:
    """One row per linear layer: layer, block, proj, in_features, outlier_ratio, amax, median_channel_max.

    ``block`` is -1 for layers outside the repeated blocks (``lm_head``), so the column
    stays an integer; ``outlier_ratio`` is ``max / median`` of the per-channel max
    (``inf`` when the median channel is exactly 0).
    """
    rows = _as_list(stats)
    blocks, projs = zip(*(parse_layer_name(s.name) for s in rows), strict=True) if rows else ((), ())
    medians = [float(np.median(s.channel_max)) if s.channel_max.size else float("nan") for s in rows]
    return {
        "layer": np.array([s.name for s in rows], dtype=object),
        "block": np.array([-1 if b is None else b for b in blocks], dtype=np.int64),
        "proj": np.array(projs, dtype=object),
        "in_features": np.array([s.in_features for s in rows], dtype=np.int64),
        "outlier_ratio": np.array([s.outlier_ratio for s in rows], dtype=np.float64),
        "amax": np.array([s.amax for s in rows], dtype=np.float64),
        "median_channel_max": np.array(medians, dtype=np.float64),
    }


# ---------------------------------------------------------------------------------------------
# Thresholds
# ---------------------------------------------------------------------------------------------
def int8_flush_threshold(amax: float) -> float:
    """Largest |x| that INT8 with a per-tensor scale ``amax / 127`` rounds to zero: half a step."""
    return float(amax) / INT8_MAX / 2.0


def e4m3_min_subnormal_under_scale(amax: float) -> float:
    """Smallest positive E4M3 value after a per-tensor scale ``amax / 448``: ``2**-9 * amax / 448``."""
    return E4M3_MIN_SUBNORMAL * float(amax) / E4M3_MAX


def scale_for(fmt_name: str, amax: float) -> float:
    """The per-tensor scale that maps ``amax`` onto the largest value of the (element) format."""
    return float(amax) / float(element_format(fmt_name).max)


def min_positive_under_scale(fmt_name: str, amax: float) -> float:
    """Smallest positive value the format represents under the per-tensor scale of ``amax``."""
    return _min_positive(fmt_name) * scale_for(fmt_name, amax)


def flush_threshold(fmt_name: str, amax: float) -> float:
    """Largest |x| flushed to zero under a per-tensor scale from ``amax``: half the smallest positive step.

    INT8: ``amax / 127 / 2``; FP8 E4M3: ``2**-10 * amax / 448``; FP4 E2M1: ``0.25 * amax / 6``.
    Block formats are evaluated on their element format (the block scale plays ``amax``).
    """
    return min_positive_under_scale(fmt_name, amax) / 2.0


def relative_error_bound(fmt_name: str, x_scaled: np.ndarray | float) -> np.ndarray:
    """Worst-case relative rounding error of values of magnitude ``x_scaled`` (already divided by the scale).

    * int formats: ``0.5 / x`` (half a unit step over the value);
    * float formats: ``2**-(m+1)`` in the normal range (the bound within a binade),
      ``min_subnormal / 2 / x`` in the subnormal range;
    * 1.0 for a value that flushes to zero (``x <= half the smallest step``) or is 0.

    Values above the format's max are not rounding but saturation and are reported
    with the bound at the max.
    """
    elem = element_format(fmt_name)
    x = np.minimum(np.abs(np.asarray(x_scaled, dtype=np.float64)), float(elem.max))
    half_min = _min_positive(fmt_name) / 2.0
    with np.errstate(divide="ignore", invalid="ignore"):
        if elem.kind == "int":
            err = 0.5 / x
        else:
            normal_bound = 2.0 ** -(int(elem.man_bits) + 1)
            sub = float(elem.min_subnormal) / 2.0 / x
            err = np.where(x >= float(elem.min_normal), normal_bound, sub)
    err = np.where(x <= half_min, 1.0, np.minimum(err, 1.0))
    return err


# ---------------------------------------------------------------------------------------------
# Scale sources per granularity
# ---------------------------------------------------------------------------------------------
def _check_granularity(granularity: str) -> str:
    """The granularity as a plain string, ``group`` folded into ``block``; ValueError when unknown.

    Accepts ``quantcore.formats.granularity.Granularity`` members too (a ``str`` enum). For activations
    a per-group scale along K and a 1 x block tile are the same thing here: one scale per
    ``block_size`` consecutive channels of a token row.
    """
    value = str(getattr(granularity, "value", granularity))
    if value not in GRANULARITIES:
        raise ValueError(
            f"unknown granularity {value!r} for the activation analysis; choose one of {list(GRANULARITIES)}"
        )
    return "block" if value == "group" else value


def representative_amax(stat: LayerStats, granularity: str = "tensor") -> float:
    """The amax a scale of this granularity is set from, for one layer's activations.

    * ``tensor``: the calibrated amax (static per-tensor scale);
    * ``token``: the median token's max (``token_max["p50"]``), a typical dynamic per-token
      scale (falls back to the amax when the summary lacks it);
    * ``block``: the median over 1 x block tiles of the tile's max channel max (see
      :func:`channel_scales_amax`).
    """
    granularity = _check_granularity(granularity)
    if granularity == "tensor":
        return stat.amax
    if granularity == "token":
        return float(stat.token_max.get(TYPICAL_TOKEN_KEY, stat.amax))
    per_channel = channel_scales_amax(stat.channel_max, "block", DEFAULT_BLOCK_SIZE, stat.token_max)
    return float(np.median(per_channel)) if per_channel.size else 0.0


def channel_scales_amax(
    channel_max: np.ndarray,
    granularity: str,
    block_size: int = DEFAULT_BLOCK_SIZE,
    token_max: Mapping[str, float] | None = None,
) -> np.ndarray:
    """For every input channel, the amax its scale is set from (float64 [K]).

    ``block``: channels are tiled along K in groups of ``block_size`` (a 1 x block tile
    of one token row); a tile's amax is estimated by its largest channel max, which
    assumes the channels peak on the same token (an upper bound of the live tile max,
    so flush estimates are on the pessimistic side).
    """
    granularity = _check_granularity(granularity)
    cm = np.asarray(channel_max, dtype=np.float64)
    if granularity == "tensor":
        return np.full(cm.shape, cm.max() if cm.size else 0.0)
    if granularity == "token":
        typical = (token_max or {}).get(TYPICAL_TOKEN_KEY)
        return np.full(cm.shape, float(typical) if typical is not None else (cm.max() if cm.size else 0.0))
    if block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size}")
    pad = (-cm.size) % block_size
    tiles = np.pad(cm, (0, pad)).reshape(-1, block_size).max(axis=1)
    return np.repeat(tiles, block_size)[: cm.size]


def _block_scale(fmt: Format, amax: np.ndarray) -> np.ndarray:
    """Scale of a block format's block from its amax.

    E8M0 (OCP MX v1.0): ``2**(floor(log2(amax)) - emax_elem)``, a power of two, so the
    block's largest element may clip (the clip point ``max * scale`` lies between 0.75
    and 1.5 times the amax). Other scales (NVFP4's E4M3 scale under its fp32 tensor
    scale) are taken as the ideal ``amax / max``; rounding the scale to E4M3 moves it by
    at most 2**-4 relative, which this estimate ignores.
    """
    elem = element_format(fmt)
    amax = np.asarray(amax, dtype=np.float64)
    if (fmt.scale or "").lower() == "e8m0":
        with np.errstate(divide="ignore"):
            exp = np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - elem.emax
        return np.exp2(exp)
    return amax / float(elem.max)


def _scales(fmt_name: str, amax_per_channel: np.ndarray) -> np.ndarray:
    fmt = get_format(fmt_name)
    if fmt.kind == "block":
        return _block_scale(fmt, amax_per_channel)
    return amax_per_channel / float(fmt.max)


# ---------------------------------------------------------------------------------------------
# Saturation under a static scale
# ---------------------------------------------------------------------------------------------
def fraction_above(stat: LayerStats, threshold: float) -> float:
    """Fraction of all calibrated |x| values above ``threshold``, from the log-binned histogram.

    A bin that straddles the threshold contributes the share of its width above it,
    measured in log2 (values are assumed log-uniform within a quarter-octave bin).
    Exact zeros count in the denominator.
    """
    counts = np.asarray(stat.hist_counts, dtype=np.float64)
    total = counts.sum() + float(stat.zeros)
    if total <= 0 or not np.isfinite(threshold):
        return 0.0
    if threshold <= 0:
        return float(counts.sum() / total)
    lo, hi = _LOG2_EDGES[:-1], _LOG2_EDGES[1:]
    share = np.clip((hi - math.log2(threshold)) / (hi - lo), 0.0, 1.0)
    return float((counts * share).sum() / total)


def expected_saturation(stat: LayerStats, source: str = DEFAULT_STATIC_SCALE_SOURCE) -> float:
    """Share of values a static scale set from ``token_max[source]`` would clip.

    Convention: a static activation scale calibrated on the full data from its amax
    clips nothing *of that data* by construction, so the risk is estimated by setting
    the scale from a percentile of the per-token max (default the p99 token, the usual
    percentile calibration, and a stand-in for "calibration that missed the rarest 1% of
    tokens") and counting, from the |x| histogram, the values above that clipping
    point. 0 when the summary lacks ``source`` or the clipping point is at the amax.
    """
    clip = stat.token_max.get(source)
    if clip is None or clip >= stat.amax:
        return 0.0
    return fraction_above(stat, float(clip))


# ---------------------------------------------------------------------------------------------
# What will break
# ---------------------------------------------------------------------------------------------
BREAKAGE_COLUMNS = (
    "layer",
    "block",
    "proj",
    "format",
    "granularity",
    "scale_amax",
    "flush_threshold",
    "frac_channels_flushed",
    "worst_rel_error",
    "median_rel_error",
    "expected_saturation",
    "dead_channels",
)


@dataclass(frozen=True)
class _LayerSummary:
    """What every format's breakage row of one layer shares (computed once per layer)."""

    stat: LayerStats
    cm: np.ndarray  # float64 channel maxima
    live_sorted: np.ndarray  # ascending maxima of live (non-zero) channels
    block: int
    proj: str
    saturation: float  # expected_saturation under a static per-tensor scale


def _summarize(stat: LayerStats, saturation_source: str) -> _LayerSummary:
    cm = np.asarray(stat.channel_max, dtype=np.float64)
    block, proj = parse_layer_name(stat.name)
    return _LayerSummary(
        stat=stat,
        cm=cm,
        live_sorted=np.sort(cm[cm > 0]),
        block=-1 if block is None else block,
        proj=proj,
        saturation=expected_saturation(stat, saturation_source),
    )


def _breakage_row(
    summary: _LayerSummary, fmt_name: str, granularity: str, block_size: int | None
) -> dict[str, Any]:
    fmt = get_format(fmt_name)
    if fmt.kind == "block":
        granularity = "block"
        assert fmt.block_size is not None  # a block format has its block
        block_size = int(fmt.block_size)
    live = summary.live_sorted
    n_live = live.size
    half_min = _min_positive(fmt_name) / 2.0
    if granularity == "block":
        size = int(block_size or DEFAULT_BLOCK_SIZE)
        cm = summary.cm
        scale_amax = channel_scales_amax(cm, "block", size)
        scales = _scales(fmt_name, scale_amax)
        thresholds = half_min * scales
        mask = cm > 0
        with np.errstate(divide="ignore", invalid="ignore"):
            x_scaled = np.where(scales > 0, cm / scales, 0.0)[mask]
        errors = relative_error_bound(fmt_name, x_scaled)
        # each channel has its own scale: the worst and the median are taken over channels
        worst = float(errors.max()) if n_live else 0.0
        median = float(np.median(errors)) if n_live else 0.0
        frac = float(np.count_nonzero(cm[mask] <= thresholds[mask]) / n_live) if n_live else 0.0
        amax_value = float(np.median(scale_amax)) if scale_amax.size else 0.0
        threshold = float(np.median(thresholds)) if thresholds.size else 0.0
    else:
        tensor_amax = float(summary.cm.max()) if summary.cm.size else 0.0
        if granularity == "token":
            amax_value = float(summary.stat.token_max.get(TYPICAL_TOKEN_KEY, tensor_amax))
        else:
            amax_value = tensor_amax
        scale = float(_scales(fmt_name, np.asarray([amax_value]))[0])
        threshold = half_min * scale
        if n_live and scale > 0:
            # one shared scale: the bound falls with |x|, so the worst is at the smallest live
            # channel and the median bound is the bound at the median live channel
            worst = float(relative_error_bound(fmt_name, live[0] / scale))
            median = float(relative_error_bound(fmt_name, float(np.median(live)) / scale))
            frac = float(np.searchsorted(live, threshold, side="right") / n_live)
        elif n_live:  # a zero scale (e.g. a zero typical token) flushes everything
            worst = median = frac = 1.0
        else:
            worst = median = frac = 0.0
    return {
        "layer": summary.stat.name,
        "block": summary.block,
        "proj": summary.proj,
        "format": fmt_name,
        "granularity": granularity,
        "scale_amax": amax_value,
        "flush_threshold": threshold,
        "frac_channels_flushed": frac,
        "worst_rel_error": worst,
        "median_rel_error": median,
        "expected_saturation": summary.saturation if granularity == "tensor" else 0.0,
        "dead_channels": int(summary.cm.size - n_live),
    }


def layer_breakage(
    stat: LayerStats,
    fmt_name: str,
    granularity: str = "tensor",
    block_size: int | None = None,
    saturation_source: str = DEFAULT_STATIC_SCALE_SOURCE,
) -> dict[str, Any]:
    """The "what will break" numbers of one layer's activations in one format.

    frac_channels_flushed: share of live channels (max > 0) whose max is at or below
        half the smallest positive step under their scale: the whole channel becomes 0.
    worst_rel_error: the largest :func:`relative_error_bound` over live channel maxima
        (under one shared scale: the bound at the smallest live channel max).
    median_rel_error: under one shared scale the bound at the median live channel max;
        under block scales the median of the per-channel bounds.
    expected_saturation: :func:`expected_saturation` for a static per-tensor scale;
        0 for dynamic granularities (``token``, ``block``), which never clip.
    dead_channels: channels that are exactly 0 on all calibration tokens (they lose nothing).
    scale_amax / flush_threshold: the amax the scale comes from (see
        :func:`channel_scales_amax`) and the flush threshold under it; for ``block``,
        the medians over tiles.

    Block formats (MXFP4, NVFP4...) always use their own block size and block scale.
    """
    granularity = _check_granularity(granularity)
    return _breakage_row(_summarize(stat, saturation_source), fmt_name, granularity, block_size)


def breakage_table(
    stats: Iterable[LayerStats] | Mapping[str, LayerStats],
    formats: Sequence[str] = DEFAULT_BREAKAGE_FORMATS,
    granularity: str = "tensor",
    block_size: int | None = None,
    saturation_source: str = DEFAULT_STATIC_SCALE_SOURCE,
) -> Columns:
    """One row per layer x format with the columns of :data:`BREAKAGE_COLUMNS` (see :func:`layer_breakage`)."""
    granularity = _check_granularity(granularity)
    summaries = [_summarize(s, saturation_source) for s in _as_list(stats)]
    rows = [_breakage_row(summary, f, granularity, block_size) for summary in summaries for f in formats]
    out: Columns = {}
    for col in BREAKAGE_COLUMNS:
        values = [r[col] for r in rows]
        if col in ("layer", "proj", "format", "granularity"):
            out[col] = np.array(values, dtype=object)
        elif col in ("block", "dead_channels"):
            out[col] = np.array(values, dtype=np.int64)
        else:
            out[col] = np.array(values, dtype=np.float64)
    return out


# ---------------------------------------------------------------------------------------------
# SmoothQuant
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SmoothQuantView:
    """Per-channel maxima before and after smoothing, and the per-tensor steps that result.

    ``act_after = act / s`` and ``weight_after = weight * s``; steps are ``max / levels``
    (``levels = 127`` for INT8).
    """

    alpha: float
    levels: int
    s: np.ndarray
    act_before: np.ndarray
    act_after: np.ndarray
    weight_before: np.ndarray
    weight_after: np.ndarray
    act_step_before: float
    act_step_after: float
    weight_step_before: float
    weight_step_after: float


def smoothing_factors(act_max: np.ndarray, weight_max: np.ndarray, alpha: float) -> np.ndarray:
    """SmoothQuant's ``s_j = max|X_j|**alpha / max|W_j|**(1 - alpha)`` (maxima clamped at 1e-5)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1] (the paper uses 0.5, up to ~0.85), got {alpha}")
    a = np.maximum(np.asarray(act_max, dtype=np.float64), SMOOTHQUANT_EPS)
    w = np.maximum(np.asarray(weight_max, dtype=np.float64), SMOOTHQUANT_EPS)
    if a.shape != w.shape:
        raise ValueError(f"activation and weight maxima differ in shape: {a.shape} vs {w.shape}")
    return a**alpha / w ** (1.0 - alpha)


def smoothquant_view(
    act_max: np.ndarray, weight_max: np.ndarray, alpha: float, levels: int = int(INT8_MAX)
) -> SmoothQuantView:
    """Smooth per-channel maxima with ``alpha`` and report the per-tensor steps before and after.

    The reference's worked example (alpha 0.5, X max (1.3, 0.9, 58), W max (0.42, 0.55,
    0.020)) gives s = (1.759, 1.279, 53.85) and, with 4-bit levels 7, both steps ~0.154.
    """
    s = smoothing_factors(act_max, weight_max, alpha)
    a = np.asarray(act_max, dtype=np.float64)
    w = np.asarray(weight_max, dtype=np.float64)
    a_after = a / s
    w_after = w * s

    def step(v: np.ndarray) -> float:
        return float(v.max()) / levels if v.size else 0.0

    return SmoothQuantView(
        alpha=float(alpha),
        levels=int(levels),
        s=s,
        act_before=a,
        act_after=a_after,
        weight_before=w,
        weight_after=w_after,
        act_step_before=step(a),
        act_step_after=step(a_after),
        weight_step_before=step(w),
        weight_step_after=step(w_after),
    )


def alpha_sweep(
    act_max: np.ndarray,
    weight_max: np.ndarray,
    alphas: Sequence[float] | np.ndarray = DEFAULT_ALPHAS,
    levels: int = int(INT8_MAX),
) -> Columns:
    """For each alpha: per-tensor steps and the share of activation / weight channels flushed.

    A channel flushes when its (smoothed) max is at or below half the per-tensor step.
    Helps pick alpha: small alpha leaves activation channels flushed, large alpha
    flushes weight columns instead.
    """
    cols: dict[str, list[float]] = {
        k: [] for k in ("alpha", "act_step", "weight_step", "act_flushed", "weight_flushed")
    }
    for alpha in alphas:
        v = smoothquant_view(act_max, weight_max, float(alpha), levels)
        cols["alpha"].append(float(alpha))
        cols["act_step"].append(v.act_step_after)
        cols["weight_step"].append(v.weight_step_after)
        cols["act_flushed"].append(float(np.mean(v.act_after <= v.act_step_after / 2)) if v.s.size else 0.0)
        cols["weight_flushed"].append(
            float(np.mean(v.weight_after <= v.weight_step_after / 2)) if v.s.size else 0.0
        )
    return {k: np.asarray(v, dtype=np.float64) for k, v in cols.items()}


# ---------------------------------------------------------------------------------------------
# Histogram and format grid
# ---------------------------------------------------------------------------------------------
def histogram_frame(stat: LayerStats) -> Columns:
    """The |x| histogram as columns lo, hi, center (geometric), count; empty head and tail bins dropped.

    Exact zeros have no log bin and are not included (they are ``stat.zeros``).
    """
    counts = np.asarray(stat.hist_counts, dtype=np.int64)
    edges = hist_edges()
    nz = np.flatnonzero(counts)
    if nz.size == 0:
        empty = np.zeros(0, dtype=np.float64)
        return {"lo": empty, "hi": empty, "center": empty, "count": np.zeros(0, dtype=np.int64)}
    first, last = int(nz[0]), int(nz[-1]) + 1
    lo, hi = edges[first:last], edges[first + 1 : last + 1]
    return {"lo": lo, "hi": hi, "center": np.sqrt(lo * hi), "count": counts[first:last]}


@dataclass(frozen=True)
class FormatGrid:
    """Representable magnitudes of a format under the scale of one amax.

    values:  sorted positive representable magnitudes times the scale (0 left out);
    clip:    the clipping point, ``max * scale`` (the amax itself for an ideal scale;
             0.75 to 1.5 times the amax under an MX power-of-two scale);
    flush:   largest magnitude rounded to 0 (half the smallest positive value);
    scale:   the scale itself.
    """

    format: str
    granularity: str
    amax: float
    scale: float
    clip: float
    flush: float
    values: np.ndarray


def format_grid(fmt_name: str, amax: float, granularity: str = "tensor") -> FormatGrid:
    """The grid of ``fmt_name`` under the scale that ``amax`` sets.

    ``granularity`` says what ``amax`` stands for (the tensor, a typical token, a block;
    see :func:`representative_amax`); it does not change the arithmetic except that
    block formats use their own block-scale rule (E8M0 power of two for MX formats).
    """
    granularity = _check_granularity(granularity)
    fmt = get_format(fmt_name)
    if fmt.kind == "block":
        scale = float(_block_scale(fmt, np.asarray([amax]))[0])
    else:
        scale = float(amax) / float(fmt.max)
    grid = _grid(fmt_name)
    values = grid[grid > 0] * scale
    elem = element_format(fmt_name)
    return FormatGrid(
        format=fmt_name,
        granularity=granularity,
        amax=float(amax),
        scale=scale,
        clip=float(elem.max) * scale,
        flush=_min_positive(fmt_name) * scale / 2.0,
        values=values,
    )


# ---------------------------------------------------------------------------------------------
# Downsampling for charts
# ---------------------------------------------------------------------------------------------
def downsample_channels(
    channel_max: np.ndarray, max_points: int = DEFAULT_MAX_POINTS, top_k: int = DEFAULT_TOP_K
) -> np.ndarray:
    """Indices (sorted) of at most ``max_points`` channels that keep the picture of ``channel_max``.

    The ``top_k`` largest channels are always kept; the remaining budget splits the
    channel axis into contiguous buckets and keeps each bucket's largest channel
    (max-preserving: no spike disappears, the overall max is always kept).
    Returns every index when ``K <= max_points``.
    """
    cm = np.asarray(channel_max, dtype=np.float64)
    k = cm.size
    if max_points < 1:
        raise ValueError(f"max_points must be positive, got {max_points}")
    if k <= max_points:
        return np.arange(k)
    top_k = max(0, min(top_k, max_points - 1))
    top = np.argpartition(-cm, top_k)[:top_k] if top_k else np.zeros(0, dtype=np.int64)
    n_buckets = max_points - top_k
    bounds = np.linspace(0, k, n_buckets + 1).astype(np.int64)
    starts = bounds[:-1]
    bucket_argmax = np.array(
        [s + int(np.argmax(cm[s:e])) for s, e in zip(starts, bounds[1:], strict=True) if e > s],
        dtype=np.int64,
    )
    return np.union1d(top, bucket_argmax)


def depth_table(
    stats: Iterable[LayerStats] | Mapping[str, LayerStats],
    proj: str,
    max_points: int = 3000,
) -> Columns:
    """Block x channel-bin table of channel max for one projection type (for the depth heatmap).

    Columns: block, layer, bin, ch_lo, ch_hi (channel range, end exclusive), channel_max
    (the bin's max), argmax_channel. Bins are contiguous channel ranges shared by every
    block (so a channel that stays massive stays in one column), sized so that
    ``blocks x bins <= max_points``; taking the max keeps every spike.
    """
    layers = [s for s in _as_list(stats) if parse_layer_name(s.name)[1] == proj]
    layers.sort(key=lambda s: (parse_layer_name(s.name)[0] or -1, s.name))
    empty_i = np.zeros(0, dtype=np.int64)
    if not layers:
        return {
            "block": empty_i,
            "layer": np.zeros(0, dtype=object),
            "bin": empty_i,
            "ch_lo": empty_i,
            "ch_hi": empty_i,
            "channel_max": np.zeros(0, dtype=np.float64),
            "argmax_channel": empty_i,
        }
    k = min(s.channel_max.size for s in layers)
    n_bins = max(1, min(k, max_points // len(layers)))
    bounds = np.linspace(0, k, n_bins + 1).astype(np.int64)
    cols: dict[str, list[Any]] = {c: [] for c in ("block", "layer", "bin", "ch_lo", "ch_hi")}
    maxes: list[np.ndarray] = []
    argmaxes: list[np.ndarray] = []
    for s in layers:
        cm = np.asarray(s.channel_max[:k], dtype=np.float64)
        m = np.maximum.reduceat(cm, bounds[:-1])
        a = np.array([lo + int(np.argmax(cm[lo:hi])) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)])
        b = parse_layer_name(s.name)[0]
        cols["block"].extend([-1 if b is None else b] * n_bins)
        cols["layer"].extend([s.name] * n_bins)
        cols["bin"].extend(range(n_bins))
        cols["ch_lo"].extend(bounds[:-1].tolist())
        cols["ch_hi"].extend(bounds[1:].tolist())
        maxes.append(m)
        argmaxes.append(a)
    return {
        "block": np.asarray(cols["block"], dtype=np.int64),
        "layer": np.asarray(cols["layer"], dtype=object),
        "bin": np.asarray(cols["bin"], dtype=np.int64),
        "ch_lo": np.asarray(cols["ch_lo"], dtype=np.int64),
        "ch_hi": np.asarray(cols["ch_hi"], dtype=np.int64),
        "channel_max": np.concatenate(maxes),
        "argmax_channel": np.concatenate(argmaxes).astype(np.int64),
    }
