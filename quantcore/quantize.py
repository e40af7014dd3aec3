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
  for integers, and an exact emulation for E2M1 (no torch dtype).
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
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from quantcore.formats import E8M0_MAX_EXP, E8M0_MIN_EXP, Format, element_format, get_format
from quantcore.schemes import Granularity, TensorSpec

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
    if xb.numel() == 0:
        return torch.zeros(xb.shape[0], 1, xb.shape[2], 1, dtype=SCALE_DTYPE, device=xb.device)
    return _finite_abs(xb).amax(dim=(1, 3), keepdim=True).to(SCALE_DTYPE)


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


def _e8m0_scale(amax: torch.Tensor, elem: Format) -> torch.Tensor:
    """OCP MX shared scale 2**(floor(log2 amax) - emax_elem), exponent clamped to [-127, 127].

    floor(log2 amax) comes from frexp (exact: amax = m * 2**e with m in [0.5, 1)), not from
    log2, which can round up just below a power of two. All-zero blocks get scale 1.
    """
    _, exp = torch.frexp(amax)
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
    clamped = y.clamp(-elem.max, elem.max)
    if elem.name in _TORCH_FLOAT8:
        return clamped.to(_TORCH_FLOAT8[elem.name]).to(y.dtype)
    if elem.kind == "int":
        return torch.round(clamped)
    return round_minifloat(clamped, elem.man_bits, elem.emin, elem.max)


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
    """Result of quantizing a blocked tensor: grid values, scales, scaled input (for reports)."""

    values: torch.Tensor  # (A, br, C, bc) grid values in the work dtype
    scale: torch.Tensor  # (A, 1, C, 1) effective fp32 scale: x_hat = values * scale
    scaled: torch.Tensor  # (A, br, C, bc) x / scale before rounding
    block_scale: torch.Tensor | None = None  # nvfp4: E4M3-rounded block scales (A, 1, C, 1)
    tensor_scale: torch.Tensor | None = None  # nvfp4: fp32 tensor scale g, 0-d


def _quantize_blocked(
    xb: torch.Tensor, fmt: Format, scale: torch.Tensor | float | None, lay: _Layout
) -> _Core:
    """Scale and round one blocked tensor (work dtype) per its format."""
    elem = element_format(fmt)
    if fmt.name == "nvfp4":
        return _quantize_nvfp4(xb, scale)
    if fmt.scale == "e8m0":
        if scale is not None:
            raise ValueError(
                f"{fmt.name} computes its power-of-two scales from each block; do not pass scale="
            )
        s = _e8m0_scale(_amax_blocked(xb), elem)
    elif scale is None:
        s = scale_from_amax(_amax_blocked(xb), fmt)
    else:
        s = _static_scale(scale, lay, xb.device)
    scaled = xb / s.to(xb.dtype)
    return _Core(round_to_format(scaled, elem), s, scaled)


def _quantize_nvfp4(xb: torch.Tensor, tensor_scale: torch.Tensor | float | None) -> _Core:
    """NVFP4 two-level scaling on a (A, 1, C, 16) view.

    g = amax / (448 * 6) (fp32, dynamic, or given as ``tensor_scale``); block scale
    s_b = e4m3(amax_b / 6 / g) (saturating at 448); elements E2M1(x / (s_b * g)).
    A block whose scale rounds to 0 in E4M3 dequantizes to zero (counted as underflow).
    """
    block_amax = _amax_blocked(xb)
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
    values = round_to_format(scaled, "fp4_e2m1") * (s_eff > 0)  # zero-scale blocks dequantize to 0
    return _Core(values, s_eff, scaled, s_b, g)


def _report_counts(
    x: torch.Tensor, core: _Core, deq: torch.Tensor, fmt: Format, n_elements: int
) -> torch.Tensor:
    """int64 [elements, nonzero, saturated, underflow, nan] on x's device (no host sync)."""
    nan = torch.isnan(x)
    nonzero = (x != 0) & ~nan
    saturated = core.scaled.abs() > element_format(fmt).clip_threshold
    underflow = nonzero & (deq == 0)
    return torch.stack(
        [
            torch.tensor(n_elements, device=x.device),
            nonzero.sum(),
            saturated.sum(),
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
) -> tuple[torch.Tensor, _Core, _Layout, Format, torch.Tensor | None]:
    """Shared pipeline: returns (dequantized blocked tensor, core, layout, format, report counts)."""
    x = _check_float(x)
    fmt = get_format(fmt)
    gran, group_size, block = _parse_granularity(fmt, granularity, group_size, block)
    if fmt.is_block and len(x.shape) == 0:
        raise ValueError(
            f"{fmt.name} quantizes blocks along the last dimension; pass a tensor with at least one dim"
        )
    lay = _layout(tuple(x.shape), gran, group_size, block)
    xb = _to_blocks(x.to(_work_dtype(x)), lay)
    core = _quantize_blocked(xb, fmt, scale, lay)
    deq = core.values * core.scale.to(xb.dtype)
    counts = _report_counts(xb, core, deq, fmt, x.numel()) if want_report else None
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
    fmt:         a format name from :func:`quantcore.formats.list_formats`
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
    """:func:`fake_quantize` with the format and granularity of a :class:`~quantcore.schemes.TensorSpec`."""
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
        x, fmt_obj, granularity, group_size, block, scale, want_report=True
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
