"""Rounding scaled values onto an element format's grid, and the storage codes of grid values.

Rounding is round-half-to-even everywhere: torch's own float8 casts for E4M3/E5M2 (so results are
bit-identical to ``(x / s).to(torch.float8_e4m3fn)``), ``torch.round`` for integers, and an exact
emulation for E2M1 (no torch dtype). On a CPU the float8 casts of float32 values are replaced by that
emulation, which gives the same bits (checked on every float32 in range) about five times faster.
Saturation, not overflow: values are clamped to ±max before the cast, so a finite input never
produces inf or NaN (torch's E5M2 cast alone would give inf).
"""

from __future__ import annotations

import torch

from quantcore.formats.blocks import may_branch
from quantcore.formats.catalog import Format, element_format

TORCH_FLOAT8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_FP4_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # E2M1 magnitude for 3-bit codes 0b000..0b111
_FP4_SIGN_BIT = 0b1000  # bit 3 of an E2M1 nibble is the sign


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


def round_inplace(y: torch.Tensor, elem: Format, *, nan_free: bool | None = None) -> torch.Tensor:
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
        clamped.dtype == torch.float64 and elem.name not in TORCH_FLOAT8
    )
    if emulate and may_branch(clamped):
        if nan_free is None:  # one read-only pass; NaN is rare, and a sum of clamped values cannot overflow
            nan_free = not bool(torch.isnan(clamped.sum()))
        if nan_free:
            return _round_minifloat_(clamped, elem.man_bits, elem.emin)
    if elem.name in TORCH_FLOAT8:
        return clamped.to(TORCH_FLOAT8[elem.name]).to(clamped.dtype)
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


def encode(values: torch.Tensor, elem: Format) -> torch.Tensor:
    """Grid values -> storage codes: float8 tensor, int8 (int8 and int4), or uint8 E2M1 nibble (low 4 bits)."""
    if elem.name in TORCH_FLOAT8:
        return values.to(TORCH_FLOAT8[elem.name])  # exact: values are on the grid
    if elem.kind == "int":
        return values.to(torch.int8)
    grid = torch.tensor(_FP4_GRID, dtype=values.dtype, device=values.device)
    magnitude = torch.searchsorted(grid, values.abs().contiguous()).to(torch.uint8)
    return magnitude | (torch.signbit(values).to(torch.uint8) << 3)


def decode(codes: torch.Tensor, fmt: str | Format) -> torch.Tensor:
    """Storage codes of an element format (as :func:`quantize` returns them) -> float32 values."""
    elem = element_format(fmt)
    if elem.name in TORCH_FLOAT8 or elem.kind == "int":
        return codes.to(torch.float32)
    grid = torch.tensor(_FP4_GRID, dtype=torch.float32, device=codes.device)
    magnitude = grid[(codes & 0b0111).long()]
    return torch.where((codes & _FP4_SIGN_BIT) != 0, -magnitude, magnitude)


# ---------------------------------------------------------------------------- the core
