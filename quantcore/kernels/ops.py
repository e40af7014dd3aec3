"""The real low-precision GEMMs a benchmark times, built on one shape's operands, and their float64 emulation.

Weights are always quantized offline (not timed), as at serving time. Everything runs
in eager PyTorch: the INT8 epilogue and the activation quantization are separate,
unfused kernels, which is what a plain PyTorch serving path pays; fused kernels
(torchao, vLLM) would be faster, and these figures do not claim otherwise.

torch is imported inside the functions: importing this module stays cheap.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from quantcore.kernels.paths import (
    PATH_BASELINE,
    PATH_FP8_ROW,
    PATH_FP8_TENSOR,
    PATH_INT8_ROW,
    PATH_W8_ROW,
    W4_GROUP,
    W4_GROUPS,
    W4_INNER_K_TILES,
    W4_PER_CHANNEL,
    WEIGHT_ONLY_PATHS,
    base_path,
    kernel_padding,
    quantizes_activation,
)

if TYPE_CHECKING:
    import torch

E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
INT8_QMAX = 127  # symmetric INT8 grid [-127, 127]; -128 unused (SmoothQuant, torchao int8 dynamic)
SCALE_EPS = 1e-12  # amax floor so an all-zero row gets a finite scale (torchao float8_utils EPS)
INT4_QMAX = 7  # symmetric INT4 grid [-7, 7] (quantcore's int4), stored as q + 8 in [1, 15]
ERR_MAX_ROWS = 256  # rows of the output compared with the float64 emulation (evenly spaced)


def quantize_fp8(x: torch.Tensor, rowwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 codes and fp32 dequantization scale(s) of ``x`` [R, C].

    rowwise=False: one scale, shape [] (``amax / 448``); rowwise=True: one per row, [R, 1].
    ``codes * scale`` approximates ``x``; torch's cast saturates to ±448 (clamped anyway).
    """
    import torch

    xf = x.float()
    if rowwise:
        amax = xf.abs().amax(dim=1, keepdim=True)
    else:
        amax = xf.abs().amax()
    scale = amax.clamp(min=SCALE_EPS) / E4M3_MAX
    codes = (xf / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes, scale


def quantize_int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row INT8 codes in [-127, 127] and fp32 scales [R, 1] (``amax / 127``).

    Rounding is round-half-to-even (``torch.round``).
    """
    import torch

    xf = x.float()
    scale = xf.abs().amax(dim=1, keepdim=True).clamp(min=SCALE_EPS) / INT8_QMAX
    codes = torch.round(xf / scale).clamp(-INT8_QMAX, INT8_QMAX).to(torch.int8)
    return codes, scale


def quantize_int4_groups(w: torch.Tensor, kp: int, group: int = W4_GROUP,
                         per_channel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT4 codes in [-7, 7] of ``w`` [N, K] in groups of ``group`` along K, zero-padded
    to ``kp`` columns (a multiple of the group), and fp32 scales [kp / group, N] (``amax / 7``). With
    ``per_channel`` every group of a row carries the row's one scale (its amax over all of K)."""
    import torch

    n, k = w.shape
    wf = _pad2(w.float(), n, kp).reshape(n, kp // group, group)
    scale = wf.abs().amax(dim=2).clamp(min=SCALE_EPS) / INT4_QMAX  # [N, groups]
    if per_channel:
        scale = scale.amax(dim=1, keepdim=True).expand(n, kp // group)
    codes = torch.round(wf / scale[:, :, None]).clamp(-INT4_QMAX, INT4_QMAX).to(torch.int8)
    return codes.reshape(n, kp), scale.t().contiguous()


def pack_int4(codes: torch.Tensor, device_kind: str) -> torch.Tensor:
    """INT4 codes [N, K] in [-7, 7] in the layout of the device's weight-only INT4 kernel (stored as q + 8)."""
    import torch

    q = codes.to(torch.int32) + 8
    if device_kind == "cpu":
        return torch._convert_weight_to_int4pack_for_cpu(q, W4_INNER_K_TILES)
    # tinygemm: two codes a byte, the even column in the high nibble
    return torch._convert_weight_to_int4pack((q[:, 1::2] | (q[:, 0::2] << 4)).to(torch.uint8), W4_INNER_K_TILES)


def int4_weight_mm(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor,
                   device_kind: str, group: int = W4_GROUP) -> torch.Tensor:
    """``x @ W^T`` with ``W`` = (q - 8) * scale + zero per group of ``group`` along K, from :func:`pack_int4`."""
    import torch

    if device_kind == "cpu":
        return torch._weight_int4pack_mm_for_cpu(x, packed, group, scales_and_zeros)
    return torch._weight_int4pack_mm(x, packed, group, scales_and_zeros)


def _pad2(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Zero-pad a 2-D tensor at the bottom / right to [rows, cols] (no copy when already there)."""
    import torch.nn.functional as F

    r, c = t.shape
    if r == rows and c == cols:
        return t
    if t.dtype.is_floating_point and t.element_size() == 1:
        # float8: pad the raw bytes (0x00 is +0.0 in E4M3), so no float8 fill kernel is needed
        import torch

        return F.pad(t.view(torch.int8), (0, cols - c, 0, rows - r)).view(t.dtype)
    return F.pad(t, (0, cols - c, 0, rows - r))


# --------------------------------------------------------------------------- one shape


@dataclass
class Case:
    """One (M, N, K) x path case ready to run: the timed call, its float64 emulation and the shape as run."""

    fn: Callable[[], torch.Tensor]  # the timed call; returns the [M, N] output
    emulate: Callable[[torch.Tensor], torch.Tensor]  # rows index -> float64 [r, N] reference
    padded: tuple[int, int, int]  # (M, K, N) as run


class ShapeOperands:
    """Weights of one (N, K) shape in every form the paths need, built lazily."""

    def __init__(self, n: int, k: int, device: str, dtype: torch.dtype, gen: torch.Generator) -> None:
        import torch

        self.n, self.k, self.device, self.dtype = n, k, device, dtype
        # Weights ~ N(0, 1/K), like an initialised linear layer; activations ~ N(0, 1).
        self.w = (torch.randn(n, k, generator=gen) / math.sqrt(k)).to(device=device, dtype=dtype)
        self._cache: dict[tuple[str, int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def weight_codes(self, path: str, kp: int, np_: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes [Np, Kp], scale) of the weight for ``path``; scale [] or [1, Np]."""
        key = (base_path(path), kp, np_)
        if key not in self._cache:
            bp = base_path(path)
            if bp == PATH_FP8_TENSOR:
                codes, scale = quantize_fp8(self.w, rowwise=False)
                codes = _pad2(codes, np_, kp)
            elif bp == PATH_FP8_ROW:
                codes, scale = quantize_fp8(self.w, rowwise=True)
                codes, scale = _pad2(codes, np_, kp), _pad2(scale, np_, 1).t()
            elif bp == PATH_INT8_ROW:
                codes, scale = quantize_int8_rows(self.w)
                codes, scale = _pad2(codes, np_, kp), _pad2(scale, np_, 1).t()
            elif bp == PATH_W8_ROW:  # scales [N] in the activations' dtype, as _weight_int8pack_mm wants
                codes, scale = quantize_int8_rows(self.w)
                scale = scale.reshape(-1).to(self.dtype)
            elif bp in W4_GROUPS:  # scales [Kp/group, N]; padded rows get code 0, scale SCALE_EPS / 7
                codes, scale = quantize_int4_groups(_pad2(self.w, np_, self.k), kp, W4_GROUPS[bp],
                                                    per_channel=bp in W4_PER_CHANNEL)
            else:
                raise ValueError(f"no weight codes for path {path!r}")
            self._cache[key] = (codes.contiguous(), scale.contiguous())
        return self._cache[key]


def build_case(ops: ShapeOperands, path: str, x: torch.Tensor, device_kind: str) -> Case:
    """Prepare operands for ``path`` on activation ``x`` [M, K] and return the timed call."""
    import torch

    m, k = x.shape
    n = ops.n
    out_dtype = ops.dtype
    mp, kp, np_ = kernel_padding(path, m, k, n, device_kind)
    bp = base_path(path)
    dyn = quantizes_activation(path)

    if bp == PATH_BASELINE:
        wt = ops.w.t()
        return Case(lambda: torch.mm(x, wt), lambda rows: x[rows].double() @ ops.w.double().t(), (m, k, n))

    wq, sw = ops.weight_codes(path, kp, np_)
    if bp in WEIGHT_ONLY_PATHS:
        return _weight_only_case(bp, x, wq, sw, (mp, kp, np_), n, device_kind)
    wq_t = wq.t()  # [Kp, Np] column-major view, the layout cuBLASLt wants for mat2

    if bp in (PATH_FP8_TENSOR, PATH_FP8_ROW):
        rowwise = bp == PATH_FP8_ROW

        def quant_act() -> tuple[torch.Tensor, torch.Tensor]:
            xq, sx = quantize_fp8(x, rowwise=rowwise)
            xq = _pad2(xq, mp, kp)
            if rowwise:
                sx = _pad2(sx, mp, 1)  # padded rows: scale 0, codes 0
            return xq, sx

        def gemm(xq: torch.Tensor, sx: torch.Tensor) -> torch.Tensor:
            out = torch._scaled_mm(xq, wq_t, scale_a=sx, scale_b=sw, out_dtype=out_dtype)
            return out[:m, :n]

    else:  # int8_row

        def quant_act() -> tuple[torch.Tensor, torch.Tensor]:
            xq, sx = quantize_int8_rows(x)
            return _pad2(xq, mp, kp), _pad2(sx, mp, 1)

        def gemm(xq: torch.Tensor, sx: torch.Tensor) -> torch.Tensor:
            acc = torch._int_mm(xq, wq_t)  # int32 [Mp, Np]
            out = (acc.to(torch.float32) * sx * sw).to(out_dtype)  # the scale epilogue
            return out[:m, :n]

    xq0, sx0 = quant_act()  # the codes every call sees (quantization is deterministic)

    if dyn:

        def fn() -> torch.Tensor:
            return gemm(*quant_act())

    else:

        def fn() -> torch.Tensor:
            return gemm(xq0, sx0)

    def emulate(rows: torch.Tensor) -> torch.Tensor:
        a = xq0[:m][rows, :k].double()
        b = wq[:n, :k].double()
        sa = sx0.double() if sx0.dim() == 0 else sx0[:m][rows].double()
        sb = sw.double() if sw.dim() == 0 else sw[:, :n].double()
        return (a @ b.t()) * sa * sb

    return Case(fn, emulate, (mp, kp, np_))


def _weight_only_case(bp: str, x: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor,
                      padded: tuple[int, int, int], n: int, device_kind: str) -> Case:
    """A weight-only path: 16-bit (CPU: fp32) activations times weights dequantized inside the kernel."""
    import torch

    m, k = x.shape
    _, kp, _ = padded
    if bp == PATH_W8_ROW:
        return Case(lambda: torch._weight_int8pack_mm(x, wq, sw),
                    lambda rows: x[rows].double() @ (wq.double() * sw.double()[:, None]).t(), padded)

    scale = sw.to(x.dtype)  # the kernel reads its scales in the activations' dtype: emulate those
    scales_and_zeros = torch.stack([scale, torch.zeros_like(scale)], dim=-1).contiguous()
    packed = pack_int4(wq, device_kind)
    xp = _pad2(x, m, kp)  # zero columns times padded weights add nothing; prepared outside the timing

    group = W4_GROUPS[bp]

    def fn() -> torch.Tensor:
        return int4_weight_mm(xp, packed, scales_and_zeros, device_kind, group)[:, :n]

    def emulate(rows: torch.Tensor) -> torch.Tensor:
        w = wq.double() * scale.double().t().repeat_interleave(group, dim=1)  # [Np, Kp]
        return (xp[rows].double() @ w.t())[:, :n]

    return Case(fn, emulate, padded)


def max_rel_err(out: torch.Tensor, emu: torch.Tensor) -> float:
    """max |out - emu| / max |emu| (0 when both are zero, inf when only the emulation is)."""
    denom = float(emu.abs().max()) if emu.numel() else 0.0
    diff = float((out.double() - emu).abs().max()) if emu.numel() else 0.0
    if denom == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / denom


def err_rows(m: int, device: str) -> torch.Tensor:
    """The output rows compared with the emulation: all of them up to ERR_MAX_ROWS, else that many evenly spaced."""
    import torch

    if m <= ERR_MAX_ROWS:
        return torch.arange(m, device=device)
    return torch.linspace(0, m - 1, ERR_MAX_ROWS, device=device).round().long()
