"""Quantize, dequantize and fake-quantize tensors: amax -> scale -> quantize -> dequantize.

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

Special values (tested in tests/quantcore/test_quantize.py)
-------------------------------------------------------------
* NaN input: NaN output at the same position in ``fake_quantize`` (every format); the
  scale ignores it, so other elements are unaffected. ``quantize`` keeps NaN codes for the
  FP8 formats and raises ValueError for formats with no NaN code (int8, int4, fp4_e2m1,
  mxfp4, nvfp4).
* ±inf input: ignored by the dynamic scale and saturated to ±max·s (like torch's E4M3
  cast), counted as saturated.
* All-zero tensors or blocks get scale 1 (any scale is exact for zeros); -0 keeps its sign.

Granularity and scale shapes, for x of shape (..., K), rows R = prod(shape[:-1]):

========  ===========================  =======================================
tensor    one scale                    ()
channel   one per row (weight rows)    (*shape[:-1], 1)
token     one per row (tokens)         (*shape[:-1], 1)
group     G elements along K           (*shape[:-1], ceil(K / G))
block     (br, bc) tiles of (R, K)     (ceil(R / br), ceil(K / bc))
========  ===========================  =======================================

A K not divisible by G (or by the block) leaves a partial last group whose scale comes
from the elements it has. Block formats fix their own grouping (32 or 16 along K).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from quantcore.formats.catalog import E8M0_MAX_EXP, E8M0_MIN_EXP, Format, element_format, get_format
from quantcore.schemes.specs import Granularity, TensorSpec

F8E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448.0
F8E5M2_MAX = torch.finfo(torch.float8_e5m2).max  # 57344.0
F4E2M1_MAX = 6.0  # largest E2M1 magnitude [OCP MX v1.0, table 5]
NVFP4_TENSOR_SCALE_DIVISOR = F8E4M3_MAX * F4E2M1_MAX  # 2688.0: g = amax / (448 * 6)
SCALE_DTYPE = torch.float32  # every scale is fp32, as the kernels consume them
# Smallest scale we emit: the smallest normal fp32, 1.1755e-38. A nonzero amax so small that
# amax / max underflows would otherwise give a zero (or subnormal, flushed on some devices) scale
# and x / s = inf.
MIN_SCALE = torch.finfo(torch.float32).tiny

_TORCH_FLOAT8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_FP4_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # E2M1 magnitude for 3-bit codes 0b000..0b111
_FP4_SIGN_BIT = 0b1000  # bit 3 of an E2M1 nibble is the sign


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


# ---------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class _Layout:
    """How x (any shape) is viewed as a 4-D tensor (A, br, C, bc) with one scale per (A, C).

    The 2-D view is (rows, cols) = (prod(shape[:-1]), shape[-1]) (for TENSOR: (1, numel)),
    zero-padded to (rows + pad_rows, cols + pad_cols).
    """

    shape: tuple[int, ...]
    rows: int
    cols: int
    pad_rows: int
    pad_cols: int
    blocked: tuple[int, int, int, int]
    scale_shape: tuple[int, ...]


def _parse_granularity(
    fmt: Format, granularity: str | Granularity, group_size: int | None, block: tuple[int, int] | None
) -> tuple[Granularity, int | None, tuple[int, int] | None]:
    """Validate the granularity arguments; block formats resolve to GROUP of their block size."""
    try:
        gran = Granularity(granularity)
    except ValueError:
        valid = ", ".join(repr(g.value) for g in Granularity)
        raise ValueError(f"unknown granularity {granularity!r}; use one of {valid}") from None
    if fmt.is_block:
        if (
            gran not in (Granularity.TENSOR, Granularity.GROUP)
            or group_size not in (None, fmt.block_size)
            or block
        ):
            raise ValueError(
                f"{fmt.name} fixes its own scale blocks ({fmt.block_size} elements along the last dim); "
                f"leave granularity at 'tensor' or use 'group' with group_size={fmt.block_size} (or None)"
            )
        return Granularity.GROUP, fmt.block_size, None
    if gran is Granularity.GROUP:
        if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
            raise ValueError(
                f"granularity 'group' needs group_size, a positive int such as 128; got {group_size!r}"
            )
    elif group_size is not None:
        raise ValueError(f"group_size={group_size} is only used with granularity 'group'")
    if gran is Granularity.BLOCK:
        if block is None or len(block) != 2 or not all(isinstance(b, int) and b >= 1 for b in block):
            raise ValueError(
                f"granularity 'block' needs block=(rows, cols) of positive ints, e.g. (128, 128); got {block!r}"
            )
        block = (int(block[0]), int(block[1]))
    elif block is not None:
        raise ValueError(f"block={block} is only used with granularity 'block'")
    return gran, group_size, block


def _layout(
    shape: tuple[int, ...], gran: Granularity, group_size: int | None, block: tuple[int, int] | None
) -> _Layout:
    """The blocked view of a tensor of ``shape`` for one granularity (pure arithmetic on shapes)."""
    numel = math.prod(shape)
    if gran is Granularity.TENSOR:
        return _Layout(shape, 1, numel, 0, 0, (1, 1, 1, numel), ())
    if len(shape) == 0:
        raise ValueError(
            f"granularity {gran.value!r} needs a tensor with at least one dimension; use 'tensor' for a scalar"
        )
    cols = shape[-1]
    rows = numel // cols if cols else math.prod(shape[:-1])
    if gran in (Granularity.CHANNEL, Granularity.TOKEN):
        return _Layout(shape, rows, cols, 0, 0, (rows, 1, 1, cols), (*shape[:-1], 1))
    if gran is Granularity.GROUP:
        n_groups = -(-cols // group_size)  # ceil division
        pad_cols = n_groups * group_size - cols
        return _Layout(
            shape, rows, cols, 0, pad_cols, (rows, 1, n_groups, group_size), (*shape[:-1], n_groups)
        )
    br, bc = block
    n_r, n_c = -(-rows // br), -(-cols // bc)
    return _Layout(shape, rows, cols, n_r * br - rows, n_c * bc - cols, (n_r, br, n_c, bc), (n_r, n_c))


def _to_blocks(x: torch.Tensor, lay: _Layout) -> torch.Tensor:
    """x (lay.shape) -> (A, br, C, bc), zero-padded; a view when no padding is needed."""
    x2 = x.reshape(lay.rows, lay.cols)
    if lay.pad_rows or lay.pad_cols:
        x2 = F.pad(x2, (0, lay.pad_cols, 0, lay.pad_rows))
    return x2.reshape(lay.blocked)


def _from_blocks(xb: torch.Tensor, lay: _Layout) -> torch.Tensor:
    """Inverse of :func:`_to_blocks` (padding dropped)."""
    x2 = xb.reshape(lay.rows + lay.pad_rows, lay.cols + lay.pad_cols)
    if lay.pad_rows or lay.pad_cols:
        x2 = x2[: lay.rows, : lay.cols]
    return x2.reshape(lay.shape)


def _scale_to_blocks(scale: torch.Tensor, lay: _Layout) -> torch.Tensor:
    """Public scale shape -> (A, 1, C, 1) so it broadcasts over the blocked view."""
    return scale.reshape(lay.blocked[0], 1, lay.blocked[2], 1)


# ---------------------------------------------------------------------------- amax and scales


def _finite_abs(x: torch.Tensor) -> torch.Tensor:
    """|x| with NaN and ±inf replaced by 0, so one bad value cannot poison a whole scale."""
    return x.abs().nan_to_num_(nan=0.0, posinf=0.0)


@torch.no_grad()
def compute_amax(
    x: torch.Tensor,
    granularity: str | Granularity = "tensor",
    *,
    group_size: int | None = None,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """max |x| over each scale group, ignoring NaN and ±inf; float32, the scale shape of ``granularity``."""
    # any non-block format parses granularity the same way; block formats would force their own groups
    gran, group_size, block = _parse_granularity(get_format("int8"), granularity, group_size, block)
    lay = _layout(tuple(x.shape), gran, group_size, block)
    return _amax_blocked(_to_blocks(_check_float(x), lay)).reshape(lay.scale_shape)


def _amax_blocked(xb: torch.Tensor) -> torch.Tensor:
    """(A, br, C, bc) -> (A, 1, C, 1) float32 amax of the finite values (0 for an empty block)."""
    return _amax_checked(xb)[0]


def _amax_checked(xb: torch.Tensor) -> tuple[torch.Tensor, bool | None]:
    """:func:`_amax_blocked`, and True when every value of xb is known to be finite (else None)."""
    if xb.numel() == 0:
        empty = torch.zeros(xb.shape[0], 1, xb.shape[2], 1, dtype=SCALE_DTYPE, device=xb.device)
        return empty, True
    if _may_branch(xb):
        # max|x| = max(|max x|, |min x|): two read-only reductions instead of writing |x| out in
        # full and passing over it twice more (nan_to_num_, amax). Exact, signs of zero included
        # (abs_ of the reduced values). amax/amin propagate NaN and keep ±inf, so a non-finite
        # result means the data holds NaN or inf, and only then is the filtering path needed.
        amax = torch.maximum(
            xb.amax(dim=(1, 3), keepdim=True).abs_(), xb.amin(dim=(1, 3), keepdim=True).abs_()
        )
        if bool(torch.isfinite(amax).all()):
            return amax.to(SCALE_DTYPE), True
    return _finite_abs(xb).amax(dim=(1, 3), keepdim=True).to(SCALE_DTYPE), None


@torch.no_grad()
def scale_from_amax(amax: torch.Tensor | float, fmt: str | Format) -> torch.Tensor:
    """The fp32 scale that maps ``amax`` onto the format's max (elementwise over an amax tensor).

    int / fp8 / fp4:  s = amax / max                      (fp8_e4m3: amax / 448)
    nvfp4:            g = amax / (448 * 6)                (the fp32 tensor scale)
    mxfp8 / mxfp4:    s = 2**(floor(log2 amax) - emax_elem), clamped to the E8M0 range

    A zero amax gives scale 1 (exact for all-zero data). The division is done in float64
    and rounded once to fp32.
    """
    fmt = get_format(fmt)
    amax = torch.as_tensor(amax, dtype=SCALE_DTYPE)
    if fmt.scale == "e8m0":
        return _e8m0_scale(amax, element_format(fmt))
    divisor = NVFP4_TENSOR_SCALE_DIVISOR if fmt.name == "nvfp4" else fmt.max
    scale = (amax.double() / divisor).to(SCALE_DTYPE).clamp_(min=MIN_SCALE)
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def _e8m0_scale(amax: torch.Tensor, elem: Format, *, round_amax: bool = False) -> torch.Tensor:
    """OCP MX shared scale 2**(floor(log2 amax) - emax_elem), exponent clamped to [-127, 127].

    floor(log2 amax) comes from frexp (exact: amax = m * 2**e with m in [0.5, 1)), not from
    log2, which can round up just below a power of two. All-zero blocks get scale 1.
    ``round_amax``: compressed-tensors' rule for the weights it stores (:func:`mx_weight_scale`), the amax first
    rounded to a power of two, 1.75 * 2**e and above up to 2**(e + 1).
    """
    m, exp = torch.frexp(amax)
    if round_amax:
        exp = exp + (m >= 0.875).to(exp.dtype)  # m = 0.875: 1.75 * 2**(exp - 1)
    shared = (exp - 1 - elem.emax).clamp_(E8M0_MIN_EXP, E8M0_MAX_EXP)
    scale = torch.ldexp(torch.ones_like(amax), shared)
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def delayed_scale(
    amax_history: torch.Tensor, fmt: str | Format, *, margin: int = 0, algo: str = "max"
) -> torch.Tensor:
    """Delayed scaling (NVIDIA Transformer Engine): the scale for this step from past amaxes.

    amax_history: (window,) or (window, *scale_shape), newest first, as :class:`AmaxHistory` keeps it
    algo:         "max" (largest amax in the window, TE's default) or "most_recent"
    margin:       extra headroom in powers of two: s = amax * 2**margin / max

    Using last steps' amax avoids a reduction over the live tensor before its quantization;
    the price is saturation when the live tensor exceeds the window (check the report).
    """
    if algo not in ("max", "most_recent"):
        raise ValueError(f"algo must be 'max' or 'most_recent', got {algo!r}")
    if not isinstance(margin, int) or margin < 0:
        raise ValueError(f"margin must be a non-negative int (powers of two of headroom), got {margin!r}")
    if amax_history.dim() == 0 or amax_history.shape[0] == 0:
        raise ValueError("amax_history needs at least one entry along its first dim (the window)")
    amax = amax_history.amax(dim=0) if algo == "max" else amax_history[0]
    return scale_from_amax(amax.to(SCALE_DTYPE) * 2.0**margin, fmt)


class AmaxHistory:
    """A rolling window of amax values for delayed scaling.

    hist = AmaxHistory(window=16)
    s = hist.scale("fp8_e4m3")                  # from past steps (scale 1 before the first push)
    y, rep = fake_quantize_with_report(x, "fp8_e4m3", scale=s)
    hist.push(compute_amax(x))                   # record this step for the next one
    """

    def __init__(
        self, window: int = 16, scale_shape: tuple[int, ...] = (), device: torch.device | str | None = None
    ):
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive int (steps of history), got {window!r}")
        self.history = torch.zeros((window, *scale_shape), dtype=SCALE_DTYPE, device=device)

    def push(self, amax: torch.Tensor | float) -> None:
        """Record the newest amax (shifts the window by one; the oldest entry drops out)."""
        amax = torch.as_tensor(amax, dtype=SCALE_DTYPE, device=self.history.device)
        self.history = torch.cat([amax.reshape(1, *self.history.shape[1:]), self.history[:-1]])

    def scale(self, fmt: str | Format, *, margin: int = 0, algo: str = "max") -> torch.Tensor:
        """:func:`delayed_scale` of the current window."""
        return delayed_scale(self.history, fmt, margin=margin, algo=algo)


# ---------------------------------------------------------------------------- element rounding


def round_minifloat(y: torch.Tensor, man_bits: int, emin: int, max_value: float) -> torch.Tensor:
    """Round to the nearest value of a sign/exponent/mantissa grid, ties to even, saturating at ±max_value.

    man_bits: mantissa bits; emin: exponent of the smallest normal (subnormals below it are
    spaced 2**(emin - man_bits)). Exact: within one binade the grid step is a power of two, so
    ``a / step`` is an exact float and ``torch.round`` (half to even) rounds its mantissa.
    NaN stays NaN, -0 stays -0. Used for E2M1; tests check it against torch's E4M3/E5M2 casts.
    """
    a = y.abs().clamp(max=max_value)
    _, exp = torch.frexp(a)  # a = m * 2**exp, m in [0.5, 1): floor(log2 a) = exp - 1
    binade = (exp - 1).clamp_(min=emin)
    step = torch.ldexp(torch.ones_like(a), binade - man_bits)
    return torch.copysign(torch.round(a / step) * step, y)


def round_to_format(y: torch.Tensor, fmt: str | Format) -> torch.Tensor:
    """Round already-scaled values onto an element format's grid; returns values (y's dtype).

    Saturates at ±max first, so finite inputs stay finite (and ±inf become ±max).
    FP8: torch's cast; int: ``torch.round`` (half to even); E2M1: :func:`round_minifloat`.
    """
    elem = element_format(fmt)
    return _round_clamped(y.clamp(-elem.max, elem.max), elem)


def _round_inplace(y: torch.Tensor, elem: Format, *, nan_free: bool | None = None) -> torch.Tensor:
    """:func:`round_to_format` of a tensor of ours: clamps in place and reuses y's buffer where it can.

    nan_free: True when the caller knows y holds no NaN (None: find out when it matters).
    """
    return _round_clamped(y.clamp_(-elem.max, elem.max), elem, nan_free=nan_free)


def _round_clamped(clamped: torch.Tensor, elem: Format, *, nan_free: bool | None = None) -> torch.Tensor:
    """Round values already clamped to ±max; ``clamped`` is a private tensor (may be overwritten)."""
    if elem.kind == "int":
        return clamped.round_()
    # torch casts float64 to float8 through float32 (two roundings: x64 within 2**-29 of a midpoint
    # rounds differently); the emulation rounds once, so float64 keeps the cast to stay identical to it
    emulate = clamped.dtype == torch.float32 or (
        clamped.dtype == torch.float64 and elem.name not in _TORCH_FLOAT8
    )
    if emulate and _may_branch(clamped):
        if nan_free is None:  # one read-only pass; NaN is rare, and a sum of clamped values cannot overflow
            nan_free = not bool(torch.isnan(clamped.sum()))
        if nan_free:
            return _round_minifloat_(clamped, elem.man_bits, elem.emin)
    if elem.name in _TORCH_FLOAT8:
        return clamped.to(_TORCH_FLOAT8[elem.name]).to(clamped.dtype)
    return round_minifloat(clamped, elem.man_bits, elem.emin, elem.max)


_ROUND_CHUNK = 1 << 18  # elements per slice in _round_minifloat_ (1 MiB of float32, a few per L2/L3)
# float dtype -> (same-size int dtype, mantissa bits, exponent bias, exponent field mask)
_FLOAT_BITS = {
    torch.float32: (torch.int32, 23, 127, 0x7F800000),
    torch.float64: (torch.int64, 52, 1023, 0x7FF0000000000000),
}


def _round_minifloat_(y: torch.Tensor, man_bits: int, emin: int) -> torch.Tensor:
    """:func:`round_minifloat` in place, for float32 / float64 y already clamped to ±max and free of NaN.

    The same arithmetic (step = 2**(max(floor(log2|y|), emin) - man_bits), then round(y / step) * step,
    ties to even, every operation exact), with the step read from y's exponent bits instead of frexp /
    ldexp / copysign: one int temporary and a few in-place passes. On a CPU it stands in for torch's
    float8 casts, whose float8 -> float32 half runs element by element (about 6 ns per element with
    torch 2.13, the largest single cost of fake quantization before): same bits, checked against the
    casts on every float32 in [-max, max] (offline) and on grid points, midpoints and their neighbours
    (tests), about five times faster. Signs of zero are kept (round(-0.3) is -0.0).
    """
    int_dtype, frac_bits, bias, exp_mask = _FLOAT_BITS[y.dtype]
    # slices of a large tensor: the int temporary is then a small buffer the allocator reuses while
    # it is in cache, not a fresh allocation of y's size (whose page faults cost more than the maths)
    parts = y.view(-1).split(_ROUND_CHUNK) if y.is_contiguous() else (y,)
    for part in parts:
        step = part.view(int_dtype) & exp_mask  # 2**floor(log2|y|) as bits; 0 for zero, subnormals
        step.clamp_(min=(bias + emin) << frac_bits).sub_(man_bits << frac_bits)
        step = step.view(y.dtype)
        part.div_(step).round_().mul_(step)
    return y


def _encode(values: torch.Tensor, elem: Format) -> torch.Tensor:
    """Grid values -> storage codes: float8 tensor, int8 (int8 and int4), or uint8 E2M1 nibble (low 4 bits)."""
    if elem.name in _TORCH_FLOAT8:
        return values.to(_TORCH_FLOAT8[elem.name])  # exact: values are on the grid
    if elem.kind == "int":
        return values.to(torch.int8)
    grid = torch.tensor(_FP4_GRID, dtype=values.dtype, device=values.device)
    magnitude = torch.searchsorted(grid, values.abs().contiguous()).to(torch.uint8)
    return magnitude | (torch.signbit(values).to(torch.uint8) << 3)


def decode(codes: torch.Tensor, fmt: str | Format) -> torch.Tensor:
    """Storage codes of an element format (as :func:`quantize` returns them) -> float32 values."""
    elem = element_format(fmt)
    if elem.name in _TORCH_FLOAT8 or elem.kind == "int":
        return codes.to(torch.float32)
    grid = torch.tensor(_FP4_GRID, dtype=torch.float32, device=codes.device)
    magnitude = grid[(codes & 0b0111).long()]
    return torch.where((codes & _FP4_SIGN_BIT) != 0, -magnitude, magnitude)


# ---------------------------------------------------------------------------- the core


def _check_float(x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(
            f"expected a torch.Tensor, got {type(x).__name__}; wrap data with torch.as_tensor(...)"
        )
    if not x.is_floating_point():
        raise ValueError(
            f"expected a floating-point tensor (float32/bfloat16/float16/float64), got {x.dtype}; cast it first"
        )
    if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"input is already {x.dtype}; dequantize it to float32/bfloat16 first")
    return x


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 for 16/32-bit inputs, float64 for float64 (one rounding from the input's precision)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _static_scale(scale: torch.Tensor | float, lay: _Layout, device: torch.device) -> torch.Tensor:
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
        s = _scale_to_blocks(s, lay)
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


def _may_branch(t: torch.Tensor) -> bool:
    """Whether a shortcut may branch on values of ``t`` (read a 0-d result on the host).

    On a CPU that read is free, and a shortcut that skips a full-tensor pass when, say, no
    value is NaN pays for itself. On CUDA it would be a host sync per call, so accelerators
    keep the branch-free formulas (hot paths promise no sync); both give the same numbers.
    """
    return t.device.type == "cpu"


def _saturation(scaled: torch.Tensor, elem: Format) -> tuple[torch.Tensor, bool | None]:
    """(count of |scaled| > clip threshold as 0-d int64, whether scaled holds NaN or None if unknown).

    Must run before the scaled values are rounded in place. On a CPU one read-only pass finds
    the peak: when it is within the threshold nothing saturates and the per-element count is
    skipped (the common case for dynamic scales). NaN in ``scaled`` is NaN in x (every scale
    is finite and > 0), and it makes the peak NaN, so the same pass tells whether x has NaN.
    """
    threshold = elem.clip_threshold
    if _may_branch(scaled) and scaled.numel():
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
    lay: _Layout,
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
        amax, finite = _amax_checked(xb)
        s = _e8m0_scale(amax, elem)
    elif scale is None:
        amax, finite = _amax_checked(xb)
        s = scale_from_amax(amax, fmt)
    else:
        s = _static_scale(scale, lay, xb.device)
    s_work = s.to(xb.dtype)
    # same IEEE division either way; in place only when nobody reads xb afterwards
    scaled = xb.div_(s_work) if xb_is_ours and not want_report else xb / s_work
    n_sat, has_nan = _saturation(scaled, elem) if want_report else (None, None)
    values = _round_inplace(scaled, elem, nan_free=_nan_free(finite, has_nan))
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
    block_amax, finite = _amax_checked(xb)
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
                f"nvfp4 takes one finite, positive fp32 tensor scale; got {g.numel()} value(s): {g.flatten()[:4].tolist()}"
            )
        g = g.reshape(())
    s_b = (block_amax / F4E2M1_MAX / g).clamp_(max=F8E4M3_MAX).to(torch.float8_e4m3fn).to(SCALE_DTYPE)
    s_eff = s_b * g
    safe = torch.where(s_eff > 0, s_eff, torch.ones_like(s_eff)).to(xb.dtype)
    scaled = xb / safe
    fp4 = element_format("fp4_e2m1")
    n_sat, has_nan = _saturation(scaled, fp4) if want_report else (None, None)
    values = _round_inplace(scaled, fp4, nan_free=_nan_free(finite, has_nan))
    values.mul_(s_eff > 0)  # zero-scale blocks dequantize to 0
    return _Core(values, s_eff, n_sat, has_nan, s_b, g)


def _report_counts(x: torch.Tensor, core: _Core, deq: torch.Tensor, n_elements: int) -> torch.Tensor:
    """int64 [elements, nonzero, saturated, underflow, nan] on x's device (no host sync on CUDA).

    x is the blocked input (zero padding counts nowhere), deq its dequantized values.
    """
    if _may_branch(x):
        # Read-only counts instead of boolean masks summed through int64 copies. Exact because
        # x == 0 gives deq == 0, and deq is NaN exactly where x is, so the non-zero, non-NaN
        # inputs that dequantized to zero number nnz(x) - nnz(deq) (count_nonzero counts NaN).
        nnz_x = int(torch.count_nonzero(x))
        n_nan = int(torch.isnan(x).sum()) if core.has_nan is not False else 0
        underflow = nnz_x - int(torch.count_nonzero(deq))
        return torch.tensor(
            [n_elements, nnz_x - n_nan, int(core.n_saturated), underflow, n_nan], dtype=torch.int64
        )
    nan = torch.isnan(x)
    nonzero = (x != 0) & ~nan
    underflow = nonzero & (deq == 0)
    return torch.stack(
        [
            torch.tensor(n_elements, device=x.device),
            nonzero.sum(),
            core.n_saturated,
            underflow.sum(),
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
) -> tuple[torch.Tensor, _Core, _Layout, Format, torch.Tensor | None]:
    """Shared pipeline: returns (dequantized blocked tensor, core, layout, format, report counts).

    want_values: keep ``core.values`` (the grid values, for :func:`quantize`'s codes); otherwise
    the dequantized tensor is computed in their buffer.
    """
    x = _check_float(x)
    fmt = get_format(fmt)
    gran, group_size, block = _parse_granularity(fmt, granularity, group_size, block)
    if fmt.is_block and len(x.shape) == 0:
        raise ValueError(
            f"{fmt.name} quantizes blocks along the last dimension; pass a tensor with at least one dim"
        )
    lay = _layout(tuple(x.shape), gran, group_size, block)
    xw = x.to(_work_dtype(x))  # x itself when already in the work dtype, else a private copy
    xb = _to_blocks(xw, lay)
    ours = xw is not x or lay.pad_rows > 0 or lay.pad_cols > 0
    core = _quantize_blocked(xb, fmt, scale, lay, want_report=want_report, xb_is_ours=ours)
    s_work = core.scale.to(xb.dtype)
    deq = core.values * s_work if want_values else core.values.mul_(s_work)
    counts = _report_counts(xb, core, deq, x.numel()) if want_report else None
    return deq, core, lay, fmt, counts


def _public_scale(s: torch.Tensor, lay: _Layout) -> torch.Tensor:
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
    return _from_blocks(deq, lay).to(x.dtype)


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
    return _from_blocks(deq, lay).to(x.dtype), QuantReport.from_counts(counts, _public_scale(core.scale, lay))


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
    return _from_blocks(deq, lay).to(x.dtype), counts


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
    if elem.name not in _TORCH_FLOAT8 and bool(torch.isnan(_check_float(x)).any()):
        raise ValueError(
            f"{fmt_obj.name} has no NaN code, and the input contains NaN; clean the input "
            "(e.g. torch.nan_to_num) or use fake_quantize, which keeps NaN in place"
        )
    deq, core, lay, fmt_obj, counts = _run(
        x, fmt_obj, granularity, group_size, block, scale, want_report=True, want_values=True
    )
    values = _from_blocks(core.values, lay)
    scale_out = core.block_scale if fmt_obj.name == "nvfp4" else core.scale
    gran, group_size, block = _parse_granularity(fmt_obj, granularity, group_size, block)
    return QuantizedTensor(
        codes=_encode(values, elem),
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
    lay = _layout(q.shape, q.granularity, q.group_size, q.block)
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    values = _to_blocks(decode(q.codes, fmt).to(work), lay)
    scale = q.scale if q.tensor_scale is None else q.scale * q.tensor_scale
    if scale.dim() == 0:
        scale4 = scale.reshape(1, 1, 1, 1)
    else:
        scale4 = _scale_to_blocks(scale, lay)
    return _from_blocks(values * scale4.to(work), lay).to(dtype or q.dtype)


# ---------------------------------------------------------------------------- weights as checkpoints store them


@dataclass(frozen=True)
class IntWeightGrid:
    """The integer grid compressed-tensors stores a symmetric int weight on (``calculate_qparams``): scale
    ``amax / ((qmax - qmin) / 2)`` and codes ``qmin..qmax``, the most negative code included. INT8: amax / 127.5,
    codes -128..127; INT4: amax / 7.5, codes -8..7, so the largest positive weight of a group lands at 7.5 and
    clips by half a step, the largest negative one exactly on -8 (more on the grid in the README)."""

    qmin: int
    qmax: int

    @property
    def divisor(self) -> float:
        return (self.qmax - self.qmin) / 2


def int_weight_grid(fmt: str | Format) -> IntWeightGrid | None:
    """The :class:`IntWeightGrid` of an int format; None for the others (float and block formats store their
    weights as :func:`quantize` computes them)."""
    f = get_format(fmt)
    if f.kind != "int":
        return None
    qmax = int(f.max)
    return IntWeightGrid(qmin=-qmax - 1, qmax=qmax)


_HAIR = 1 + 2**-20  # relative slack for fp32 rounding in a saturation test


def _spec_args(spec: TensorSpec) -> dict:
    return {"granularity": spec.granularity, "group_size": spec.group_size, "block": spec.block}


@torch.no_grad()
def weight_scale(weight: torch.Tensor, spec: TensorSpec, *, tensor_scale: torch.Tensor | None = None) -> torch.Tensor:
    """A weight's scales as the serving checkpoint stores them, in the granularity's scale shape: amax over the
    divisor of its :class:`IntWeightGrid` for int formats, :func:`quantize`'s scales for the others (nvfp4: the
    effective block scales, E4M3 block scale × fp32 tensor scale; ``tensor_scale``: a given one, as a fusion
    group shares, :func:`fused_tensor_scale`)."""
    grid = int_weight_grid(spec.format)
    if grid is None and get_format(spec.format).scale == "e8m0":
        return mx_weight_scale(weight, spec)
    if grid is None:
        q = quantize(weight, spec.format, **_spec_args(spec), scale=tensor_scale)
        return q.scale if q.tensor_scale is None else q.scale * q.tensor_scale
    if not spec.symmetric:
        return _asym_scale(*_weight_min_max(weight, spec), grid)
    amax = compute_amax(weight, **_spec_args(spec))
    scale = (amax.double() / grid.divisor).to(SCALE_DTYPE).clamp_(min=MIN_SCALE)
    return torch.where(amax > 0, scale, torch.ones_like(scale))


@torch.no_grad()
def mx_weight_scale(weight: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """An MX weight's E8M0 block scales (one per 32 along K) as compressed-tensors stores them
    (``generate_mx_scales``, after vLLM's reference MXFP4): the block's amax first rounded to a power of two, up from
    1.75 · 2**e (its mantissa's top bits, ``round_to_power_2``), then divided by 2**emax_elem. The OCP rule that
    activations keep (:func:`_e8m0_scale`) takes floor(log2 amax) instead: for a block whose amax has a mantissa of
    1.75 or more the checkpoint's scale is twice the OCP one, so its top value lands near 4 of E2M1's 6 (or 224..256
    of E4M3's 448) instead of clipping at the maximum."""
    fmt = get_format(spec.format)
    if fmt.scale != "e8m0":
        raise ValueError(f"{fmt.name} has no E8M0 block scales")
    return _e8m0_scale(compute_amax(weight, **_spec_args(spec)), element_format(fmt), round_amax=True)


def _weight_min_max(weight: torch.Tensor, spec: TensorSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(min(w, 0), max(w, 0)) over each scale group of a weight, float32, in the granularity's scale shape: zero
    stays on the grid, as compressed-tensors' ``calculate_qparams`` makes sure (and a partial group's zero padding
    changes nothing)."""
    gran, group_size, block = _parse_granularity(get_format("int8"), spec.granularity, spec.group_size, spec.block)
    lay = _layout(tuple(weight.shape), gran, group_size, block)
    xb = _to_blocks(_check_float(weight), lay)
    lo = xb.amin(dim=(1, 3), keepdim=True).clamp(max=0).to(SCALE_DTYPE).reshape(lay.scale_shape)
    hi = xb.amax(dim=(1, 3), keepdim=True).clamp(min=0).to(SCALE_DTYPE).reshape(lay.scale_shape)
    return lo, hi


def _asym_scale(lo: torch.Tensor, hi: torch.Tensor, grid: IntWeightGrid) -> torch.Tensor:
    """The group's range over all its levels, (max - min) / 15 for int4 (1 for an all-zero group)."""
    span = hi - lo
    scale = (span.double() / (grid.qmax - grid.qmin)).to(SCALE_DTYPE).clamp_(min=MIN_SCALE)
    return torch.where(span > 0, scale, torch.ones_like(scale))


def _asym_zero_point(lo: torch.Tensor, scale: torch.Tensor, grid: IntWeightGrid) -> torch.Tensor:
    return torch.round(torch.clamp(grid.qmin - lo / scale, grid.qmin, grid.qmax))


@torch.no_grad()
def weight_zero_point(weight: torch.Tensor, spec: TensorSpec, scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """An asymmetric int weight's zero points, in the granularity's scale shape (None for a symmetric spec).

    compressed-tensors' ``calculate_qparams``: ``round(clamp(qmin - min / scale, qmin, qmax))``, so the group's
    minimum lands on ``qmin`` and zero on the integer ``zero_point``; codes are ``round(w / scale + zero_point)``
    clamped to ``qmin..qmax``, and ``(code - zero_point) * scale`` is the weight served. ``scale``: the group
    scales (default :func:`weight_scale`'s, from the weight itself).
    """
    if spec.symmetric:
        return None
    grid = int_weight_grid(spec.format)
    lo, hi = _weight_min_max(weight, spec)
    s = _asym_scale(lo, hi, grid) if scale is None else scale.to(device=weight.device, dtype=SCALE_DTYPE)
    return _asym_zero_point(lo, s, grid)


def fused_tensor_scale(weights: Iterable[torch.Tensor]) -> torch.Tensor:
    """The one NVFP4 fp32 tensor scale of a fusion group's weights (q/k/v, gate/up): from the largest |W| of them
    all, as llm-compressor's fused weight observers make it, because vLLM's fused GEMM reads one tensor scale
    for the whole group (its ``weight_global_scale.max()``)."""
    amax = torch.stack([w.detach().abs().amax().float() for w in weights]).amax()
    return scale_from_amax(amax, "nvfp4")


def element_scales(scale: torch.Tensor, spec: TensorSpec, shape: tuple[int, int]) -> torch.Tensor:
    """Scales in a granularity's scale shape, expanded to one per element of a 2-D weight of ``shape``."""
    n, k = shape
    s = scale.to(SCALE_DTYPE)
    g = Granularity(spec.granularity)
    if g is Granularity.TENSOR:
        return s.reshape(1, 1).expand(n, k)
    if g is Granularity.CHANNEL:
        return s.reshape(n, 1).expand(n, k)
    if g is Granularity.GROUP:
        return s.reshape(n, -1).repeat_interleave(spec.group_size, dim=1)[:, :k]
    if g is Granularity.BLOCK:
        br, bc = spec.block
        return s.repeat_interleave(br, dim=0)[:n].repeat_interleave(bc, dim=1)[:, :k]
    raise ValueError(f"weights cannot use granularity {g.value!r}")


def round_to_weight_grid(y: torch.Tensor, fmt: str | Format) -> torch.Tensor:
    """Round scaled weights onto the grid a checkpoint stores them on: an int format's
    :class:`IntWeightGrid` codes (``qmin..qmax``), :func:`round_to_format` for the others."""
    grid = int_weight_grid(fmt)
    if grid is None:
        return round_to_format(y, element_format(fmt))  # a block format's elements (nvfp4: E2M1)
    return y.round().clamp_(grid.qmin, grid.qmax)


@torch.no_grad()
def fake_quantize_weight(
    weight: torch.Tensor, spec: TensorSpec, *, scale: torch.Tensor | None = None, report: bool = True
) -> tuple[torch.Tensor, QuantReport]:
    """A linear weight (N, K) quantized and dequantized as the serving checkpoint stores it, with its report.

    Int formats: on their :class:`IntWeightGrid` (what llm-compressor writes and vLLM reads), scales from
    :func:`weight_scale` (or ``scale``, in the granularity's scale shape), and an asymmetric spec's zero points
    from :func:`weight_zero_point`. MX formats: their elements on :func:`mx_weight_scale`'s E8M0 scales, as
    compressed-tensors stores them. Other formats: :func:`fake_quantize`.
    The report counts saturation beyond half a step outside the grid, flushed non-zeros and NaN; with
    ``report=False`` its counts are all 0 and the passes that count are skipped.
    """
    grid = int_weight_grid(spec.format)
    mx = get_format(spec.format).scale == "e8m0"  # on compressed-tensors' E8M0 scales (mx_weight_scale)
    if (grid is None and not mx) or weight.dim() != 2:
        if report:
            return fake_quantize_with_report(weight, spec.format, **_spec_args(spec), scale=scale)
        return fake_quantize(weight, spec.format, **_spec_args(spec), scale=scale), QuantReport(0, 0, 0, 0, 0)
    zp = None
    if mx or spec.symmetric:
        s = weight_scale(weight, spec) if scale is None else scale.to(device=weight.device, dtype=SCALE_DTYPE)
    else:  # scale and zero point from one min / max pass
        lo, hi = _weight_min_max(weight, spec)
        s = _asym_scale(lo, hi, grid) if scale is None else scale.to(device=weight.device, dtype=SCALE_DTYPE)
        zp = _asym_zero_point(lo, s, grid)
    w = weight.to(_work_dtype(weight))
    S = element_scales(s, spec, tuple(w.shape)).to(w.dtype)
    y = w / S
    if zp is None:
        deq = round_to_weight_grid(y.clone(), spec.format) * S
    else:  # compressed-tensors' order: x / scale + zero_point, rounded and clamped, minus zero_point, times scale
        Z = element_scales(zp, spec, tuple(w.shape)).to(w.dtype)
        y += Z
        deq = (round_to_weight_grid(y.clone(), spec.format) - Z) * S
    if not report:
        return deq.to(weight.dtype), QuantReport(0, 0, 0, 0, 0)
    nan = torch.isnan(w)
    if grid is None:  # an MX element format: past its clip threshold
        over = y.abs() > element_format(spec.format).clip_threshold
    else:  # beyond half a step outside the grid; the fp32 rounding of amax / divisor may put the amax a hair past
        # qmax + 0.5 (7.5000005), which is the grid's own half-step clip, not saturation
        over = (y > (grid.qmax + 0.5) * _HAIR) | (y < (grid.qmin - 0.5) * _HAIR)
    counts = torch.stack([
        torch.tensor(w.numel(), device=w.device),
        ((w != 0) & ~nan).sum(),
        over.sum(),
        ((w != 0) & ~nan & (deq == 0)).sum(),
        nan.sum(),
    ])
    return deq.to(weight.dtype), QuantReport.from_counts(counts, s)


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
