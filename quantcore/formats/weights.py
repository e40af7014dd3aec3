"""Weights as serving checkpoints store them: compressed-tensors' integer grid (with zero points for an
asymmetric spec), the E8M0 scales it stores for MX weights, and NVFP4's one tensor scale per fusion group."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from quantcore.formats.blocks import block_layout, check_float, parse_granularity, to_blocks, work_dtype
from quantcore.formats.catalog import Format, element_format, get_format
from quantcore.formats.granularity import Granularity
from quantcore.formats.quantize import QuantReport, fake_quantize, fake_quantize_with_report, quantize
from quantcore.formats.rounding import round_inplace, round_to_format
from quantcore.formats.scales import MIN_SCALE, SCALE_DTYPE, compute_amax, e8m0_scale, scale_from_amax

if TYPE_CHECKING:
    from quantcore.schemes.specs import TensorSpec


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
    activations keep (:func:`e8m0_scale`) takes floor(log2 amax) instead: for a block whose amax has a mantissa of
    1.75 or more the checkpoint's scale is twice the OCP one, so its top value lands near 4 of E2M1's 6 (or 224..256
    of E4M3's 448) instead of clipping at the maximum."""
    fmt = get_format(spec.format)
    if fmt.scale != "e8m0":
        raise ValueError(f"{fmt.name} has no E8M0 block scales")
    return e8m0_scale(compute_amax(weight, **_spec_args(spec)), element_format(fmt), round_amax=True)


def _weight_min_max(weight: torch.Tensor, spec: TensorSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(min(w, 0), max(w, 0)) over each scale group of a weight, float32, in the granularity's scale shape: zero
    stays on the grid, as compressed-tensors' ``calculate_qparams`` makes sure (and a partial group's zero padding
    changes nothing)."""
    gran, group_size, block = parse_granularity(get_format("int8"), spec.granularity, spec.group_size, spec.block)
    lay = block_layout(tuple(weight.shape), gran, group_size, block)
    xb = to_blocks(check_float(weight), lay)
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
    assert grid is not None  # TensorSpec allows asymmetric int formats only
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
    if g is Granularity.GROUP and spec.group_size is not None:  # TensorSpec requires it for GROUP
        return s.reshape(n, -1).repeat_interleave(spec.group_size, dim=1)[:, :k]
    if g is Granularity.BLOCK and spec.block is not None:  # and for BLOCK
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


def _round_in_place(y: torch.Tensor, fmt: str | Format) -> torch.Tensor:
    """:func:`round_to_weight_grid` of a tensor of ours, in its memory: the same values."""
    grid = int_weight_grid(fmt)
    if grid is None:
        return round_inplace(y, element_format(fmt))
    return y.round_().clamp_(grid.qmin, grid.qmax)


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
        assert grid is not None  # not mx: an int format
        lo, hi = _weight_min_max(weight, spec)
        s = _asym_scale(lo, hi, grid) if scale is None else scale.to(device=weight.device, dtype=SCALE_DTYPE)
        zp = _asym_zero_point(lo, s, grid)
    w = weight.to(work_dtype(weight))
    shape = (w.shape[0], w.shape[1])
    S = element_scales(s, spec, shape).to(w.dtype)
    y = w / S
    if not report:  # y is read no more: rounded and scaled back in its own memory (the same operations, no copies)
        if zp is None:
            return _round_in_place(y, spec.format).mul_(S).to(weight.dtype), QuantReport(0, 0, 0, 0, 0)
        Z = element_scales(zp, spec, shape).to(w.dtype)
        deq = _round_in_place(y.add_(Z), spec.format).sub_(Z).mul_(S)
        return deq.to(weight.dtype), QuantReport(0, 0, 0, 0, 0)
    if zp is None:
        deq = round_to_weight_grid(y.clone() if report else y, spec.format) * S  # y is read again for the report
    else:  # compressed-tensors' order: x / scale + zero_point, rounded and clamped, minus zero_point, times scale
        Z = element_scales(zp, spec, shape).to(w.dtype)
        y += Z
        deq = (round_to_weight_grid(y.clone() if report else y, spec.format) - Z) * S
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
