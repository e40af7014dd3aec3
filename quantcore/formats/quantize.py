"""Quantize, dequantize and fake-quantize tensors: amax -> scale -> quantize -> dequantize.

The chain, one idea per module: :mod:`quantcore.formats.blocks` views a tensor as scale blocks,
:mod:`quantcore.formats.scales` turns amaxes into scales, :mod:`quantcore.formats.rounding` rounds scaled values
onto a format's grid and encodes them; this module runs the chain and reports what it did, and
:mod:`quantcore.formats.weights` stores weights as serving checkpoints do.

Every function here is pure (no module state), runs under ``torch.no_grad()``, and works
on any device (CPU and CUDA alike; the float64 scale division needs a device with float64).

Conventions
-----------
* A scale ``s`` maps real values onto the format's grid: ``codes = round_F(x / s)``,
  ``x_hat = codes * s``. For per-tensor / channel / token / group / block scales,
  ``s = amax / fmt.max`` so that the largest |x| lands exactly on the format's max.
* OCP MX (mxfp8, mxfp4): one power-of-two E8M0 scale per 32 elements along the last dim,
  ``s = 2**(floor(log2(amax)) - emax_elem)`` clamped to [2**-127, 2**127]
  [OCP MX v1.0, section 6.3]. By design this may clip the top of a block (E2M1: values
  in (6, 8)·s saturate to 6·s); the report counts it.
* NVFP4: an fp32 tensor scale ``g = amax / (448 * 6)`` and, per 16 elements, an E4M3
  block scale ``e4m3(amax_b / 6 / g)``; elements are E2M1 of ``x / (s_b * g)``
  [NVIDIA, "Pretraining LLMs with NVFP4", 2025; the reference text's ``nvfp4``].
* Scales are float32. Values are scaled and rounded in float32 (float64 for float64
  inputs), whatever the input dtype, so a bfloat16 input is not rounded twice.
* Rounding is round-half-to-even everywhere: torch's own float8 casts for E4M3/E5M2
  (so results are bit-identical to ``(x / s).to(torch.float8_e4m3fn)``), ``torch.round``
  for integers, and an exact emulation for E2M1 (no torch dtype). On a CPU the float8
  casts of float32 values are replaced by that emulation, which gives the same bits
  (checked on every float32 in range) about five times faster.
* Saturation, not overflow: scaled values are clamped to ±max before the cast, so a
  finite input never produces inf or NaN (torch's E5M2 cast alone would give inf).

Special values (tested in tests/quantcore/formats/test_quantize.py)
---------------------------------------------------------------------
* NaN input: NaN output at the same position in ``fake_quantize`` (every format); the
  scale ignores it, so other elements are unaffected. ``quantize`` keeps NaN codes for the
  FP8 formats and raises ValueError for formats with no NaN code (int8, int4, fp4_e2m1,
  mxfp4, nvfp4).
* ±inf input: ignored by the dynamic scale and saturated to ±max·s (like torch's E4M3
  cast), counted as saturated.
* All-zero tensors or blocks get scale 1 (any scale is exact for zeros); -0 keeps its sign.

Granularity and the shape of its scales (one per tensor, row, group of G along K or 2-D block; a partial last
group takes its scale from the elements it has): the table in :mod:`quantcore.formats.blocks`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from quantcore.formats.blocks import (
    BlockLayout,
    block_layout,
    check_float,
    from_blocks,
    may_branch,
    parse_granularity,
    scale_to_blocks,
    to_blocks,
    work_dtype,
)
from quantcore.formats.catalog import E8M0_MIN_EXP, Format, element_format, get_format
from quantcore.formats.granularity import Granularity
from quantcore.formats.rounding import TORCH_FLOAT8, decode, encode, round_inplace
from quantcore.formats.scales import (
    F4E2M1_MAX,
    F8E4M3_MAX,
    SCALE_DTYPE,
    amax_checked,
    e8m0_scale,
    scale_from_amax,
)

if TYPE_CHECKING:
    from quantcore.schemes.specs import TensorSpec


# ---------------------------------------------------------------------------- reports


@dataclass
class QuantReport:
    """What one quantization did to its input: counts, fractions and the scale(s) used.

    n_elements:  elements quantized (padding excluded)
    n_nonzero:   inputs that were neither zero nor NaN
    n_saturated: inputs clipped at the format's max: |x / s| beyond max + half the top grid
                 step (``Format.clip_threshold``: 464 for E4M3, 127.5 for int8), ±inf included.
                 Below that threshold rounding to max is ordinary rounding, so a dynamic scale
                 (whose fp32 rounding can put amax / s a hair above max) reports 0.
    n_underflow: non-zero inputs that dequantized to zero (flushed)
    n_nan:       NaN inputs
    scale:       the scale tensor (shape per granularity; nvfp4: effective block scales
                 s_b * g), or None for reports summed over many calls
    """

    n_elements: int
    n_nonzero: int
    n_saturated: int
    n_underflow: int
    n_nan: int = 0
    scale: torch.Tensor | None = field(default=None, repr=False)

    @property
    def saturation(self) -> float:
        """Fraction of elements clipped at the format's max (0.0 for an empty tensor)."""
        return self.n_saturated / self.n_elements if self.n_elements else 0.0

    @property
    def underflow(self) -> float:
        """Fraction of non-zero inputs flushed to zero (0.0 when there are none)."""
        return self.n_underflow / self.n_nonzero if self.n_nonzero else 0.0

    def __add__(self, other: QuantReport) -> QuantReport:
        """Sum of counts (e.g. over forward calls); the scale is dropped."""
        return QuantReport(
            self.n_elements + other.n_elements,
            self.n_nonzero + other.n_nonzero,
            self.n_saturated + other.n_saturated,
            self.n_underflow + other.n_underflow,
            self.n_nan + other.n_nan,
        )

    @classmethod
    def from_counts(cls, counts: torch.Tensor, scale: torch.Tensor | None = None) -> QuantReport:
        """Build from the int64 vector [elements, nonzero, saturated, underflow, nan] (one host sync)."""
        n, nz, sat, und, nan = (int(v) for v in counts.tolist())
        return cls(n, nz, sat, und, nan, scale)


def _static_scale(scale: torch.Tensor | float, lay: BlockLayout, device: torch.device) -> torch.Tensor:
    """A caller-given scale (float or tensor of the granularity's scale shape) -> (A, 1, C, 1) fp32."""
    if isinstance(scale, (int, float)):
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(
                f"a static scale must be finite and > 0, got {scale!r}; use scale_from_amax(amax, fmt)"
            )
        return torch.full((1, 1, 1, 1), float(scale), dtype=SCALE_DTYPE, device=device)
    s = torch.as_tensor(scale).to(device=device, dtype=SCALE_DTYPE)
    if s.numel() == 1:
        s = s.reshape(1, 1, 1, 1)
    elif s.numel() == lay.blocked[0] * lay.blocked[2]:
        s = scale_to_blocks(s, lay)
    else:
        raise ValueError(
            f"static scale has {s.numel()} values; this granularity needs 1 or shape {lay.scale_shape}"
        )
    if not bool(torch.isfinite(s).all() and (s > 0).all()):
        raise ValueError(
            "a static scale must be finite and > 0 everywhere; derive it with scale_from_amax(amax, fmt)"
        )
    return s


@dataclass
class _Core:
    """Result of quantizing a blocked tensor: grid values, scales, and the saturation count (for reports)."""

    values: torch.Tensor  # (A, br, C, bc) grid values in the work dtype (a fresh tensor, ours to reuse)
    scale: torch.Tensor  # (A, 1, C, 1) effective fp32 scale: x_hat = values * scale
    n_saturated: torch.Tensor | None = None  # 0-d int64: |x / scale| > clip threshold (want_report only)
    has_nan: bool | None = None  # CPU reports: whether x holds NaN (None: unknown, count it)
    block_scale: torch.Tensor | None = None  # nvfp4: E4M3-rounded block scales (A, 1, C, 1)
    tensor_scale: torch.Tensor | None = None  # nvfp4: fp32 tensor scale g, 0-d


def _saturation(scaled: torch.Tensor, elem: Format) -> tuple[torch.Tensor, bool | None]:
    """(count of |scaled| > clip threshold as 0-d int64, whether scaled holds NaN or None if unknown).

    Must run before the scaled values are rounded in place. On a CPU one read-only pass finds
    the peak: when it is within the threshold nothing saturates and the per-element count is
    skipped (the common case for dynamic scales). NaN in ``scaled`` is NaN in x (every scale
    is finite and > 0), and it makes the peak NaN, so the same pass tells whether x has NaN.
    """
    threshold = elem.clip_threshold
    if may_branch(scaled) and scaled.numel():
        lo, hi = torch.aminmax(scaled)
        peak = torch.maximum(lo.abs(), hi.abs())
        has_nan = bool(torch.isnan(peak))
        if bool(peak <= threshold):  # compared as the per-element test below compares (scaled's dtype)
            return torch.zeros((), dtype=torch.int64), has_nan
        return torch.count_nonzero(scaled.abs() > threshold), has_nan
    return (scaled.abs() > threshold).sum().to(torch.int64), None


def _quantize_blocked(
    xb: torch.Tensor,
    fmt: Format,
    scale: torch.Tensor | float | None,
    lay: BlockLayout,
    *,
    want_report: bool,
    xb_is_ours: bool = False,
) -> _Core:
    """Scale and round one blocked tensor (work dtype) per its format.

    xb_is_ours: xb is a private copy (dtype conversion or padding) that may be overwritten,
    which saves one full-size allocation when no report needs it afterwards.
    """
    elem = element_format(fmt)
    if fmt.name == "nvfp4":
        return _quantize_nvfp4(xb, scale, want_report=want_report)
    finite = None  # every input finite (so no NaN to keep): known from a dynamic amax
    if fmt.scale == "e8m0":
        if scale is not None:
            raise ValueError(
                f"{fmt.name} computes its power-of-two scales from each block; do not pass scale="
            )
        amax, finite = amax_checked(xb)
        s = e8m0_scale(amax, elem)
    elif scale is None:
        amax, finite = amax_checked(xb)
        s = scale_from_amax(amax, fmt)
    else:
        s = _static_scale(scale, lay, xb.device)
    s_work = s.to(xb.dtype)
    # same IEEE division either way; in place only when nobody reads xb afterwards
    scaled = xb.div_(s_work) if xb_is_ours and not want_report else xb / s_work
    n_sat, has_nan = _saturation(scaled, elem) if want_report else (None, None)
    values = round_inplace(scaled, elem, nan_free=_nan_free(finite, has_nan))
    return _Core(values, s, n_sat, has_nan)


def _nan_free(finite: bool | None, has_nan: bool | None) -> bool | None:
    """True / False when the input is known to hold no NaN / some NaN; None when unknown."""
    if finite or has_nan is False:
        return True
    return False if has_nan else None


def _quantize_nvfp4(
    xb: torch.Tensor, tensor_scale: torch.Tensor | float | None, *, want_report: bool
) -> _Core:
    """NVFP4 two-level scaling on a (A, 1, C, 16) view.

    g = amax / (448 * 6) (fp32, dynamic, or given as ``tensor_scale``); block scale
    s_b = e4m3(amax_b / 6 / g) (saturating at 448); elements E2M1(x / (s_b * g)).
    A block whose scale rounds to 0 in E4M3 dequantizes to zero (counted as underflow).
    """
    block_amax, finite = amax_checked(xb)
    if tensor_scale is None:
        g = scale_from_amax(block_amax.amax(), "nvfp4")
    elif isinstance(tensor_scale, (int, float)):
        if not (math.isfinite(tensor_scale) and tensor_scale > 0):
            raise ValueError(
                f"nvfp4 tensor scale must be finite and > 0, got {tensor_scale!r}; use scale_from_amax(amax, 'nvfp4')"
            )
        g = torch.tensor(float(tensor_scale), dtype=SCALE_DTYPE, device=xb.device)
    else:
        g = torch.as_tensor(tensor_scale).to(device=xb.device, dtype=SCALE_DTYPE)
        if g.numel() != 1 or not bool(torch.isfinite(g).all() and (g > 0).all()):
            raise ValueError(
                "nvfp4 takes one finite, positive fp32 tensor scale; "
                f"got {g.numel()} value(s): {g.flatten()[:4].tolist()}"
            )
        g = g.reshape(())
    s_b = (block_amax / F4E2M1_MAX / g).clamp_(max=F8E4M3_MAX).to(torch.float8_e4m3fn).to(SCALE_DTYPE)
    s_eff = s_b * g
    safe = torch.where(s_eff > 0, s_eff, torch.ones_like(s_eff)).to(xb.dtype)
    scaled = xb / safe
    fp4 = element_format("fp4_e2m1")
    n_sat, has_nan = _saturation(scaled, fp4) if want_report else (None, None)
    values = round_inplace(scaled, fp4, nan_free=_nan_free(finite, has_nan))
    values.mul_(s_eff > 0)  # zero-scale blocks dequantize to 0
    return _Core(values, s_eff, n_sat, has_nan, s_b, g)


def _report_counts(x: torch.Tensor, core: _Core, deq: torch.Tensor, n_elements: int) -> torch.Tensor:
    """int64 [elements, nonzero, saturated, underflow, nan] on x's device (no host sync on CUDA).

    x is the blocked input (zero padding counts nowhere), deq its dequantized values.
    """
    if may_branch(x):
        # Read-only counts instead of boolean masks summed through int64 copies. Exact because
        # x == 0 gives deq == 0, and deq is NaN exactly where x is, so the non-zero, non-NaN
        # inputs that dequantized to zero number nnz(x) - nnz(deq) (count_nonzero counts NaN).
        nnz_x = int(torch.count_nonzero(x))
        n_nan = int(torch.isnan(x).sum()) if core.has_nan is not False else 0
        n_below = nnz_x - int(torch.count_nonzero(deq))
        assert core.n_saturated is not None  # counted whenever a report is wanted
        return torch.tensor(
            [n_elements, nnz_x - n_nan, int(core.n_saturated), n_below, n_nan], dtype=torch.int64
        )
    nan = torch.isnan(x)
    nonzero = (x != 0) & ~nan
    flushed = nonzero & (deq == 0)
    assert core.n_saturated is not None  # counted whenever a report is wanted
    return torch.stack(
        [
            torch.tensor(n_elements, device=x.device),
            nonzero.sum(),
            core.n_saturated,
            flushed.sum(),
            nan.sum(),
        ]
    ).to(torch.int64)


def _run(
    x: torch.Tensor,
    fmt: str | Format,
    granularity: str | Granularity,
    group_size: int | None,
    block: tuple[int, int] | None,
    scale: torch.Tensor | float | None,
    want_report: bool,
    want_values: bool = False,
) -> tuple[torch.Tensor, _Core, BlockLayout, Format, torch.Tensor | None]:
    """Shared pipeline: returns (dequantized blocked tensor, core, layout, format, report counts).

    want_values: keep ``core.values`` (the grid values, for :func:`quantize`'s codes); otherwise
    the dequantized tensor is computed in their buffer.
    """
    x = check_float(x)
    fmt = get_format(fmt)
    gran, group_size, block = parse_granularity(fmt, granularity, group_size, block)
    if fmt.is_block and len(x.shape) == 0:
        raise ValueError(
            f"{fmt.name} quantizes blocks along the last dimension; pass a tensor with at least one dim"
        )
    lay = block_layout(tuple(x.shape), gran, group_size, block)
    xw = x.to(work_dtype(x))  # x itself when already in the work dtype, else a private copy
    xb = to_blocks(xw, lay)
    ours = xw is not x or lay.pad_rows > 0 or lay.pad_cols > 0
    core = _quantize_blocked(xb, fmt, scale, lay, want_report=want_report, xb_is_ours=ours)
    s_work = core.scale.to(xb.dtype)
    deq = core.values * s_work if want_values else core.values.mul_(s_work)
    counts = _report_counts(xb, core, deq, x.numel()) if want_report else None
    return deq, core, lay, fmt, counts


def _public_scale(s: torch.Tensor, lay: BlockLayout) -> torch.Tensor:
    """A (A, 1, C, 1) or (1, 1, 1, 1) scale in the granularity's public shape (a 0-d tensor for TENSOR)."""
    if s.numel() == 1 and lay.blocked[0] * lay.blocked[2] != 1:
        s = s.expand(lay.blocked[0], 1, lay.blocked[2], 1)
    return s.reshape(lay.scale_shape)


# ---------------------------------------------------------------------------- public API


@torch.no_grad()
def fake_quantize(
    x: torch.Tensor,
    fmt: str | Format,
    granularity: str | Granularity = "tensor",
    *,
    group_size: int | None = None,
    block: tuple[int, int] | None = None,
    scale: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Quantize then dequantize: a tensor of x's shape and dtype holding exactly representable values.

    x:           floating tensor, shape (..., K); any device
    fmt:         a format name from :func:`quantcore.formats.catalog.list_formats`
    granularity: "tensor" | "channel" | "token" | "group" | "block" (block formats fix their own)
    group_size:  G for "group"
    block:       (rows, cols) for "block", e.g. (128, 128)
    scale:       static scale (float, or tensor of the granularity's scale shape, see module
                 docstring); for nvfp4 the fp32 tensor scale g. None: dynamic, from x itself.
    """
    deq, _, lay, _, _ = _run(x, fmt, granularity, group_size, block, scale, want_report=False)
    return from_blocks(deq, lay).to(x.dtype)


@torch.no_grad()
def fake_quantize_with_report(
    x: torch.Tensor,
    fmt: str | Format,
    granularity: str | Granularity = "tensor",
    *,
    group_size: int | None = None,
    block: tuple[int, int] | None = None,
    scale: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, QuantReport]:
    """:func:`fake_quantize` plus a :class:`QuantReport` (saturation, underflow, scales); one host sync."""
    deq, core, lay, _, counts = _run(x, fmt, granularity, group_size, block, scale, want_report=True)
    assert counts is not None  # want_report
    return from_blocks(deq, lay).to(x.dtype), QuantReport.from_counts(counts, _public_scale(core.scale, lay))


@torch.no_grad()
def fake_quantize_with_counts(
    x: torch.Tensor,
    fmt: str | Format,
    granularity: str | Granularity = "tensor",
    *,
    group_size: int | None = None,
    block: tuple[int, int] | None = None,
    scale: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fake_quantize` plus the raw report counts, without a host sync (for hot paths).

    Returns (y, counts) with counts an int64 tensor on x's device:
    [elements, nonzero, saturated, underflow, nan]. Sum them over calls and build a
    :class:`QuantReport` with :meth:`QuantReport.from_counts` when needed.
    """
    deq, _, lay, _, counts = _run(x, fmt, granularity, group_size, block, scale, want_report=True)
    assert counts is not None  # want_report
    return from_blocks(deq, lay).to(x.dtype), counts


@torch.no_grad()
def fake_quantize_spec(
    x: torch.Tensor, spec: TensorSpec, *, scale: torch.Tensor | float | None = None
) -> torch.Tensor:
    """:func:`fake_quantize` with the format and granularity of a :class:`~quantcore.schemes.specs.TensorSpec`."""
    return fake_quantize(
        x, spec.format, spec.granularity, group_size=spec.group_size, block=spec.block, scale=scale
    )


@dataclass
class QuantizedTensor:
    """Codes and scales for the kernel path; :func:`dequantize` inverts it.

    codes:        shape of the input. float8_e4m3fn / float8_e5m2 for the FP8 formats and mxfp8;
                  int8 for int8 and int4 (values -7..7); uint8 for E2M1 (fp4_e2m1, mxfp4, nvfp4),
                  one 4-bit code per byte in the low nibble (bit 3 = sign, bits 0-2 index
                  0, 0.5, 1, 1.5, 2, 3, 4, 6) — unpacked; pack two per byte for storage.
    scale:        fp32, the granularity's scale shape (see the module docstring). mxfp*: powers
                  of two (E8M0-representable). nvfp4: the E4M3-representable block scales s_b,
                  to be multiplied by ``tensor_scale``.
    tensor_scale: nvfp4 only: the fp32 tensor scale g (0-d); None otherwise.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    format: str
    granularity: Granularity
    group_size: int | None
    block: tuple[int, int] | None
    shape: tuple[int, ...]
    dtype: torch.dtype
    tensor_scale: torch.Tensor | None = None
    report: QuantReport | None = None

    @property
    def scale_codes(self) -> torch.Tensor:
        """Scales in their storage format: E8M0 as uint8 (exponent + 127) for mx*, float8_e4m3fn for nvfp4,
        the fp32 scales themselves otherwise."""
        fmt = get_format(self.format)
        if fmt.scale == "e8m0":
            _, exp = torch.frexp(self.scale)
            return (exp - 1 - E8M0_MIN_EXP).to(torch.uint8)
        if fmt.scale == "fp8_e4m3":
            return self.scale.to(torch.float8_e4m3fn)
        return self.scale


@torch.no_grad()
def quantize(
    x: torch.Tensor,
    fmt: str | Format,
    granularity: str | Granularity = "tensor",
    *,
    group_size: int | None = None,
    block: tuple[int, int] | None = None,
    scale: torch.Tensor | float | None = None,
) -> QuantizedTensor:
    """Codes and scales (see :class:`QuantizedTensor`), with a :class:`QuantReport`; arguments as :func:`fake_quantize`.

    For fp8_e4m3 / fp8_e5m2 the codes are bit-identical to torch's cast of the scaled input,
    ``(x.float() / s).clamp(-max, max).to(dtype)`` (the clamp matters only for E5M2, where
    torch would overflow to inf). NaN raises ValueError for formats with no NaN code.
    """
    fmt_obj = get_format(fmt)
    elem = element_format(fmt_obj)
    if elem.name not in TORCH_FLOAT8 and bool(torch.isnan(check_float(x)).any()):
        raise ValueError(
            f"{fmt_obj.name} has no NaN code, and the input contains NaN; clean the input "
            "(e.g. torch.nan_to_num) or use fake_quantize, which keeps NaN in place"
        )
    deq, core, lay, fmt_obj, counts = _run(
        x, fmt_obj, granularity, group_size, block, scale, want_report=True, want_values=True
    )
    values = from_blocks(core.values, lay)
    scale_out = core.block_scale if core.block_scale is not None else core.scale  # nvfp4: its E4M3 block scales
    assert counts is not None  # want_report
    gran, group_size, block = parse_granularity(fmt_obj, granularity, group_size, block)
    return QuantizedTensor(
        codes=encode(values, elem),
        scale=_public_scale(scale_out, lay),
        format=fmt_obj.name,
        granularity=gran,
        group_size=group_size,
        block=block,
        shape=tuple(x.shape),
        dtype=x.dtype,
        tensor_scale=core.tensor_scale,
        report=QuantReport.from_counts(counts, _public_scale(core.scale, lay)),
    )


@torch.no_grad()
def dequantize(q: QuantizedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """codes * scale(s) -> a tensor of the original shape, in ``dtype`` (default: the original dtype).

    Equal to :func:`fake_quantize` of the same input with the same arguments.
    """
    fmt = get_format(q.format)
    lay = block_layout(q.shape, q.granularity, q.group_size, q.block)
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    values = to_blocks(decode(q.codes, fmt).to(work), lay)
    scale = q.scale if q.tensor_scale is None else q.scale * q.tensor_scale
    if scale.dim() == 0:
        scale4 = scale.reshape(1, 1, 1, 1)
    else:
        scale4 = scale_to_blocks(scale, lay)
    return from_blocks(values * scale4.to(work), lay).to(dtype or q.dtype)


# ---------------------------------------------------------------------------- weights as checkpoints store them


@torch.no_grad()
def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio, 10·log10(Σ ref² / Σ (ref − approx)²), in dB, computed in float64.

    +inf when approx equals ref; -inf when ref is all zero and approx is not. About 6 dB per
    bit for a uniform quantizer: INT8 per-tensor on Gaussian data gives roughly 38-40 dB.
    """
    if ref.shape != approx.shape:
        raise ValueError(
            f"sqnr_db needs tensors of one shape, got {tuple(ref.shape)} and {tuple(approx.shape)}"
        )
    r = ref.detach().to(torch.float64)
    noise = float((r - approx.detach().to(torch.float64)).pow(2).sum())
    signal = float(r.pow(2).sum())
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)
