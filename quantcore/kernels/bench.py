"""Real low-precision GEMM benchmarks on a model's own linear shapes, checked against emulation.

For a linear layer ``y = x @ W^T`` with ``x`` [M, K] and ``W`` [N, K], each *path* below
is timed on the device and compared with an emulation of the very same quantized
operands (codes dequantized to float64 and multiplied), so a large ``max_rel_err``
means a kernel bug, never quantization error.

Paths (string constants; a ``+q`` suffix adds on-the-fly activation quantization):

==================  =====================================================================
``baseline``        ``x @ W^T`` in bf16 on CUDA, fp32 on CPU
``fp8_tensor``      ``torch._scaled_mm``, E4M3 codes, one fp32 scale per tensor (W and x)
``fp8_row``         ``torch._scaled_mm``, E4M3 codes, per-token x scales [M,1], per-channel W
                    scales [1,N]
``int8_row``        ``torch._int_mm`` (int8 x int8 -> int32) plus the scale epilogue
                    ``acc * s_x[M,1] * s_w[1,N]``, symmetric codes in [-127, 127]
``w8_row``          weight-only INT8 (W8A16): ``torch._weight_int8pack_mm``, per-channel INT8
                    weights dequantized inside the kernel, activations in the baseline dtype
``w4_g128``         weight-only INT4 (W4A16): ``torch._weight_int4pack_mm`` (CUDA tinygemm, bf16)
                    or ``torch._weight_int4pack_mm_for_cpu``, symmetric codes in [-7, 7] in
                    groups of 128 along K, packed two per byte offline
``<path>+q``        the same, with the activation quantized inside the timed region
                    (amax, scale, divide, clamp, cast, and any row padding); without ``+q``
                    the activation codes are prepared beforehand and only the GEMM (and,
                    for INT8, its epilogue) is timed. The weight-only paths have no ``+q``:
                    their activations are never quantized
==================  =====================================================================

Weight-only kernels do the same FLOPs as the baseline; what they save is the weight
traffic, which is what bounds a decode step (small M). That is why, on a GPU, they are
expected to win at batch 1 and to pay their dequantization work at large M; on a CPU
whose fp32 GEMM is strong they may not win at all. Either way they are timed here rather
than assumed to run at the baseline's speed.

Weights are always quantized offline (not timed), as at serving time. Everything runs
in eager PyTorch: the INT8 epilogue and the activation quantization are separate,
unfused kernels, which is what a plain PyTorch serving path pays; fused kernels
(torchao, vLLM) would be faster, and these figures do not claim otherwise.

Timing: on CUDA, CUDA events around each call, warm-up first, the L2 cache flushed
before every timed call, median of the repeats; on CPU, ``time.perf_counter`` and the
median, the last-level cache flushed the same way (a decode GEMM's weights come from memory
when served, and a CPU's 32 MB L3 holds a 4096 x 4096 INT8 weight but not its fp32 one: on a
2-thread EPYC, INT8 timed warm was 20x faster than fp32 at M = 1 x 4096 x 4096, flushed 7x).
Each (N, K) shape has a wall-clock budget; a case predicted (from the rates already
measured) not to fit in what is left is not run and comes back with
``skipped="over budget: ..."``. A path the device cannot run comes back with
``skipped="not supported on <device>: ..."`` and ``native=False``, never a time.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from quantcore.errors import Cancelled
from quantcore.models.routing import Routing, case_m, step_share
from quantcore.schemes.specs import W4_GROUP_SIZE, W4_SMALL_GROUP_SIZE, W4_TINY_GROUP_SIZE

if TYPE_CHECKING:  # torch is imported inside functions: importing this module stays cheap
    import torch

    from quantcore.kernels.hardware import DeviceInfo
    from quantcore.models.parallel import Parallelism

# --------------------------------------------------------------------------- paths

PATH_BASELINE = "baseline"
PATH_FP8_TENSOR = "fp8_tensor"
PATH_FP8_ROW = "fp8_row"
PATH_INT8_ROW = "int8_row"
PATH_W8_ROW = "w8_row"
PATH_W4_G128 = "w4_g128"
PATH_W4_G64 = "w4_g64"
PATH_W4_G32 = "w4_g32"
PATH_W4_CH = "w4_ch"
QUANT_ACT_SUFFIX = "+q"

#: How a case's ``skipped`` reason begins; the store and the app tell the three apart by these prefixes:
#: the device cannot run the path (final), the case did not fit its time budget, or the kernel raised.
SKIP_NOT_SUPPORTED = "not supported"
SKIP_OVER_BUDGET = "over budget"
SKIP_FAILED = "failed"

#: Paths whose activations stay in the baseline dtype (no ``+q`` variant).
WEIGHT_ONLY_PATHS: tuple[str, ...] = (PATH_W8_ROW, PATH_W4_G128, PATH_W4_G64, PATH_W4_G32, PATH_W4_CH)
BASE_PATHS: tuple[str, ...] = (PATH_BASELINE, PATH_FP8_TENSOR, PATH_FP8_ROW, PATH_INT8_ROW, *WEIGHT_ONLY_PATHS)
#: Every benchmark path, baseline first.
PATHS: tuple[str, ...] = (
    PATH_BASELINE,
    PATH_FP8_TENSOR,
    PATH_FP8_TENSOR + QUANT_ACT_SUFFIX,
    PATH_FP8_ROW,
    PATH_FP8_ROW + QUANT_ACT_SUFFIX,
    PATH_INT8_ROW,
    PATH_INT8_ROW + QUANT_ACT_SUFFIX,
    PATH_W8_ROW,
    PATH_W4_G128,
    PATH_W4_G64,
    PATH_W4_G32,
    PATH_W4_CH,
)

#: Peak-table key (``quantcore.kernels.hardware.GpuTarget.peak_tflops``) of each base path on CUDA: the
#: weight-only kernels do their math in bf16.
PEAK_KEY: dict[str, str] = {
    PATH_BASELINE: "bf16",
    PATH_FP8_TENSOR: "fp8",
    PATH_FP8_ROW: "fp8",
    PATH_INT8_ROW: "int8",
    PATH_W8_ROW: "bf16",
    PATH_W4_G128: "bf16",
    PATH_W4_G64: "bf16",
    PATH_W4_G32: "bf16",
    PATH_W4_CH: "bf16",
}

# --------------------------------------------------------------------------- constants

E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
INT8_QMAX = 127  # symmetric INT8 grid [-127, 127]; -128 unused (SmoothQuant, torchao int8 dynamic)
SCALE_EPS = 1e-12  # amax floor so an all-zero row gets a finite scale (torchao float8_utils EPS)

# CUDA shape rules, from aten/src/ATen/native/cuda/Blas.cpp (checked by TORCH_CHECK there):
INT_MM_MIN_M_CUDA = 17  # _int_mm_out_cuda: "self.size(0) needs to be greater than 16"
INT_MM_MULTIPLE_CUDA = 8  # _int_mm_out_cuda: K and N "a multiple of 8"
SCALED_MM_MULTIPLE_CUDA = 16  # _scaled_mm: "trailing dimension of mat1 ... divisible by 16",
#                               "mat2 shape (KxN) must be divisible by 16"
# torch's CPU kernels have no such limits (checked here with torch 2.13: M=1, K=63, N=30 run),
# except the INT4 weight-only one:
W4_GROUP = W4_GROUP_SIZE  # the group of the W4A16 preset; K must be a multiple
# each INT4 path's group as the kernel reads it (W4A16, W4A16_G64, W4A16_G32). torch's INT4 kernel has no per-channel
# mode: w4_ch (W4A16_CHANNEL) runs it in groups of 128 that all carry their row's one scale, the same product; it
# reads K / 128 scales a row where Marlin's channelwise kernel reads one, so its time errs slightly high.
W4_GROUPS = {PATH_W4_G128: W4_GROUP, PATH_W4_G64: W4_SMALL_GROUP_SIZE, PATH_W4_G32: W4_TINY_GROUP_SIZE,
             PATH_W4_CH: W4_GROUP}
W4_PER_CHANNEL = (PATH_W4_CH,)  # INT4 paths whose scales are one per row
W4_INNER_K_TILES = 8  # tinygemm's packing: K a multiple of 8 x 16 = 128 on CUDA
W4_N_MULTIPLE = {"cpu": 16, "cuda": 8}  # "_convert_weight_to_int4pack_cpu: expect N to be dividable by 16"
INT4_QMAX = 7  # symmetric INT4 grid [-7, 7] (quantcore's int4), stored as q + 8 in [1, 15]

# How run_benchmarks times a case; records carry it (KernelRecord.timing) and a benchmark job reuses only stored
# records timed the same way. 1: caches flushed before every timed call on CPU as on CUDA (before: CUDA only).
TIMING = "cold-caches-1"
L2_FLUSH_BYTES = 256 * 1024 * 1024  # triton.testing.do_bench zeroes a 256 MB buffer to clear L2
CPU_FLUSH_MIN_BYTES = 64 * 1024 * 1024  # at least this much on a CPU, twice its last-level caches where larger
CPU_FLUSH_MAX_BYTES = 2 * 1024**3  # and at most this (a two-socket server's L3s together can pass 1 GiB)
CPU_SYSFS = "/sys/devices/system/cpu"
ERR_MAX_ROWS = 256  # rows of the output compared with the float64 emulation (evenly spaced)

DEFAULT_MS: tuple[int, ...] = (1, 16, 128, 2048)
DEFAULT_BUDGET_S = 60.0  # wall-clock seconds per (N, K) shape, all M and paths together
DEFAULT_REPEATS = {"cpu": 5, "cuda": 50}
DEFAULT_WARMUP = {"cpu": 1, "cuda": 10}
MIN_REPEATS = 3  # fewer timed calls than this and the median means little: skip instead
_PROBE_ROWS = 16  # rows of the cheap call that estimates a path's rate before its first case
_PROBE_STEP = 4  # a case's cost is predicted from a rate measured at no less than 1/4 of its M


def base_path(path: str) -> str:
    """``"fp8_row+q"`` -> ``"fp8_row"``; base paths are returned unchanged."""
    return path[: -len(QUANT_ACT_SUFFIX)] if path.endswith(QUANT_ACT_SUFFIX) else path


def quantizes_activation(path: str) -> bool:
    """Whether ``path`` times the on-the-fly activation quantization (the ``+q`` variants)."""
    return path.endswith(QUANT_ACT_SUFFIX)


def parse_ms(text: str) -> list[int]:
    """The M values (batch x tokens) a person types, ``"1,16,128"``: sorted, each once, empty items passed over.
    ValueError says which item is not a positive integer, before any job is queued."""
    ms: set[int] = set()
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        try:
            value = int(item)
        except ValueError:
            value = 0
        if value < 1:
            raise ValueError(f"M values are positive integers separated by commas (batch x tokens), e.g. "
                             f"1,16,128: {item!r} is not one")
        ms.add(value)
    if not ms:
        raise ValueError("no M value given: type positive integers separated by commas, e.g. 1,16,128")
    return sorted(ms)


def check_paths(paths: Iterable[str]) -> list[str]:
    """``paths`` in the order given, each once; ValueError names one that is not a benchmark path."""
    out = []
    for p in paths:
        if p not in PATHS:
            raise ValueError(f"unknown kernel path {p!r}; choose from: {', '.join(PATHS)}")
        if p not in out:
            out.append(p)
    return out


def bench_paths(paths: Iterable[str] | None) -> list[str]:
    """The paths a benchmark asked for ``paths`` (None: all) times: those, and the baseline, in :data:`PATHS` order."""
    want = check_paths(paths if paths is not None else PATHS)
    return sorted({PATH_BASELINE, *want}, key=PATHS.index)


def cases_per_shape(ms: Sequence[int] | None, paths: Iterable[str] | None) -> int:
    """The cases a benchmark asked for M values ``ms`` (None: :data:`DEFAULT_MS`) and ``paths`` times per (N, K)
    shape, all sharing its budget per shape: what a stored skip for time is weighed by (store.repo)."""
    return len(ms or DEFAULT_MS) * len(bench_paths(paths))


# --------------------------------------------------------------------------- records


@dataclass
class KernelRecord:
    """One timed GEMM case: shape (M, N, K) x path on one device.

    device:       ``"cpu"`` or ``"cuda"``
    device_name:  CPU description or GPU name
    ms:           median time of one call in milliseconds (None when skipped)
    tflops:       2*M*N*K / time, on the logical (unpadded) shape, in TFLOP/s (TOPS for INT8)
    pct_peak:     tflops as a percentage of the device's dense peak for the path's dtype
                  (None: device not in the peak table, e.g. any CPU)
    speedup:      baseline ms / this ms at the same shape (None without a baseline time)
    native:       the path's low-precision math is hardware-accelerated on this device
    max_rel_err:  max |kernel - emulation| / max |emulation| on up to ERR_MAX_ROWS rows
    padded_m/k/n: the padded size where a kernel required padding, else None
    skipped:      why there is no time: ``"not supported on <device>: ..."``,
                  ``"over budget: ..."`` or ``"failed on <device>: ..."``; None when timed
    timing:       how it was timed (:data:`TIMING` for what :func:`run_benchmarks` measures now; None: before
                  quantplan recorded it, when a CPU's cache was not flushed between calls)
    """

    device: str
    device_name: str
    torch_version: str
    m: int
    n: int
    k: int
    path: str
    ms: float | None
    tflops: float | None
    pct_peak: float | None
    speedup: float | None
    native: bool
    max_rel_err: float | None
    padded_m: int | None
    skipped: str | None
    padded_k: int | None = None
    padded_n: int | None = None
    timing: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every field (JSON-friendly)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> KernelRecord:
        """Inverse of :meth:`to_dict`; unknown keys (e.g. a database id) are ignored."""
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in names})


def distinct_shapes(linears: Iterable[tuple[str, int, int]]) -> dict[tuple[int, int], list[str]]:
    """Map each distinct GEMM shape (N, K) to the layer names that have it.

    ``linears`` yields ``(name, in_features, out_features)``, i.e. K then N, as
    ``nn.Linear`` stores them; the result is keyed (N, K) = (out_features, in_features),
    in order of first appearance.
    """
    out: dict[tuple[int, int], list[str]] = {}
    for name, in_features, out_features in linears:
        k, n = int(in_features), int(out_features)
        if k <= 0 or n <= 0:
            raise ValueError(f"layer {name!r} has a non-positive shape: in={in_features}, out={out_features}")
        out.setdefault((n, k), []).append(name)
    return out


def bench_shapes(shapes: Mapping[str, tuple[int, int]], par: Parallelism) -> list[tuple[int, int]]:
    """The distinct (N, K) a benchmark of a model times, in order of first appearance: from ``shapes``
    ({layer: (N, K)}), each layer's share on one GPU of ``par`` (the layers themselves on one GPU)."""
    return list(distinct_shapes((name, k, n) for name, (n, k) in par.shards(shapes).items()))


def kernel_padding(path: str, m: int, k: int, n: int, device_kind: str) -> tuple[int, int, int]:
    """(M, K, N) after the padding ``path`` needs on ``device_kind`` (``"cpu"`` or ``"cuda"``).

    CUDA: ``torch._int_mm`` needs M > 16 and K, N multiples of 8; ``torch._scaled_mm``
    needs K and N multiples of 16. The INT4 weight-only kernels need K a multiple of the
    group (128, 64 or 32) on a CPU and of 128 on CUDA (tinygemm's tiles, whatever the group), and N a
    multiple of 16 on a CPU, 8 on CUDA. Zero padding
    of K leaves the product unchanged; extra rows / columns of the output are dropped.
    Other CPU kernels need no padding.
    """
    if device_kind not in ("cpu", "cuda"):
        raise ValueError(f"unknown device kind {device_kind!r}; use 'cpu' or 'cuda'")
    if base_path(path) in W4_GROUPS:
        group = W4_GROUPS[base_path(path)]
        k_multiple = group if device_kind == "cpu" else math.lcm(group, W4_INNER_K_TILES * 16)
        return m, _round_up(k, k_multiple), _round_up(n, W4_N_MULTIPLE[device_kind])
    if device_kind == "cpu" or base_path(path) in (PATH_BASELINE, PATH_W8_ROW):
        return m, k, n
    if base_path(path) == PATH_INT8_ROW:
        mult = INT_MM_MULTIPLE_CUDA
        return max(m, INT_MM_MIN_M_CUDA), _round_up(k, mult), _round_up(n, mult)
    mult = SCALED_MM_MULTIPLE_CUDA
    return m, _round_up(k, mult), _round_up(n, mult)


def _round_up(x: int, mult: int) -> int:
    return -(-x // mult) * mult


# --------------------------------------------------------------------------- quantizers


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
class _Case:
    fn: Callable[[], torch.Tensor]  # the timed call; returns the [M, N] output
    emulate: Callable[[torch.Tensor], torch.Tensor]  # rows index -> float64 [r, N] reference
    padded: tuple[int, int, int]  # (M, K, N) as run


class _ShapeOperands:
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


def _build_case(ops: _ShapeOperands, path: str, x: torch.Tensor, device_kind: str) -> _Case:
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

        def fn() -> torch.Tensor:
            return torch.mm(x, wt)

        def emulate(rows: torch.Tensor) -> torch.Tensor:
            return x[rows].double() @ ops.w.double().t()

        return _Case(fn, emulate, (m, k, n))

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

    return _Case(fn, emulate, (mp, kp, np_))


def _weight_only_case(bp: str, x: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor,
                      padded: tuple[int, int, int], n: int, device_kind: str) -> _Case:
    """A weight-only path: 16-bit (CPU: fp32) activations times weights dequantized inside the kernel."""
    import torch

    m, k = x.shape
    _, kp, _ = padded
    if bp == PATH_W8_ROW:

        def fn() -> torch.Tensor:
            return torch._weight_int8pack_mm(x, wq, sw)

        def emulate(rows: torch.Tensor) -> torch.Tensor:
            return x[rows].double() @ (wq.double() * sw.double()[:, None]).t()

        return _Case(fn, emulate, padded)

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

    return _Case(fn, emulate, padded)


# --------------------------------------------------------------------------- timing


def cpu_cache_bytes(sysfs: str = CPU_SYSFS) -> int | None:
    """Every last-level cache of the machine together, from Linux's sysfs: each instance once (CPUs that share one
    list the same ``shared_cpu_list``), so a many-CCD EPYC or a two-socket server counts all of its L3s, which a
    multi-threaded flush writes through in parallel. None where sysfs does not say."""
    from pathlib import Path

    units = {"K": 1024, "M": 1024**2, "G": 1024**3}
    top, instances = 0, {}
    for d in Path(sysfs).glob("cpu[0-9]*/cache/index[0-9]*"):
        try:
            if (d / "type").read_text().strip() == "Instruction":
                continue
            level = int((d / "level").read_text())
            text = (d / "size").read_text().strip()
            size = int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text)
            shared = (d / "shared_cpu_list").read_text().strip()
        except (OSError, ValueError, KeyError):  # a sandbox's partial or unreadable sysfs
            continue
        if level > top:
            top, instances = level, {}
        if level == top:
            instances[shared] = size
    return sum(instances.values()) or None


def flush_bytes(kind: str) -> int:
    """How much a timer writes before each timed call to evict the operands from the caches."""
    if kind == "cuda":
        return L2_FLUSH_BYTES
    return min(CPU_FLUSH_MAX_BYTES, max(CPU_FLUSH_MIN_BYTES, 2 * (cpu_cache_bytes() or 0)))


class _Timer:
    """Times a call on one device: CUDA events or perf_counter, the caches flushed before each call."""

    def __init__(self, device: str, kind: str) -> None:
        import torch

        self.kind = kind
        self.device = device
        self._flush = torch.empty(flush_bytes(kind) // 4, dtype=torch.int32, device=device)
        self._flush.zero_()  # the first write pays the pages' allocation
        self.flush_s = self.once_s(self._flush.zero_)  # what each timed call's flush adds to a case's wall time

    def sync(self) -> None:
        import torch

        if self.kind == "cuda":
            torch.cuda.synchronize(self.device)

    def once_s(self, fn: Callable[[], Any]) -> float:
        """Wall seconds of one call, synchronised (also serves as a warm-up call)."""
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t0

    def median_ms(self, fn: Callable[[], Any], repeats: int) -> float:
        import torch

        if self.kind == "cuda":
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
            for i in range(repeats):
                self._flush.zero_()  # evict the operands from L2
                starts[i].record()
                fn()
                ends[i].record()
            torch.cuda.synchronize(self.device)
            return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))
        times = []
        for _ in range(repeats):
            self._flush.zero_()  # evict the operands from the last-level cache
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def _max_rel_err(out: torch.Tensor, emu: torch.Tensor) -> float:
    denom = float(emu.abs().max()) if emu.numel() else 0.0
    diff = float((out.double() - emu).abs().max()) if emu.numel() else 0.0
    if denom == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / denom


def _err_rows(m: int, device: str) -> torch.Tensor:
    import torch

    if m <= ERR_MAX_ROWS:
        return torch.arange(m, device=device)
    return torch.linspace(0, m - 1, ERR_MAX_ROWS, device=device).round().long()


# --------------------------------------------------------------------------- driver


def _resolve_device(device: str) -> tuple[str, str]:
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        index = (
            dev.index
            if dev.index is not None
            else (torch.cuda.current_device() if torch.cuda.is_available() else 0)
        )
        return f"cuda:{index}", "cuda"
    if dev.type == "cpu":
        return "cpu", "cpu"
    raise ValueError(f"unsupported device {device!r}; use 'cpu' or 'cuda[:index]'")


def run_benchmarks(
    shapes: Iterable[tuple[int, int]],
    ms: Sequence[int] = DEFAULT_MS,
    *,
    device: str = "cpu",
    paths: Sequence[str] | None = None,
    budget_s_per_shape: float = DEFAULT_BUDGET_S,
    repeats: int | None = None,
    warmup: int | None = None,
    seed: int = 0,
    progress: Callable[[float, str], None] | None = None,
    should_cancel: Callable[[], bool] | None = None,
) -> list[KernelRecord]:
    """Time every path on every (M, N, K) with (N, K) from ``shapes`` and M from ``ms``.

    The baseline is always timed (speed-ups need it), whatever ``paths`` says. Cases run
    shape by shape; within a shape's budget the baselines of every M come first, then the
    paths the device runs natively, then the emulated ones, each M ascending: a budget
    cuts the emulated paths and the largest M first. A case runs only when its predicted cost fits its share:
    its FLOPs over the path's rate, measured at no less than a quarter of its M (single calls at growing M
    learn it, so a small M's fixed cost per call is never scaled up to a large one). A first pass gives each case
    but the baselines an even share of what is left (time a case leaves unused goes to those after it; a
    baseline may take all that is left, as every speed-up needs one); a case that needs more is
    put off to a second pass, which gives the cases put off, in the same order, all that is left: one slow case
    (weight-only INT8 at a prefill M, a quarter of a second a call) cannot starve every case after it. Records
    come back in (shape, M, path) order whatever order they ran in.
    Repeats and warm-up default to 50 / 10 on CUDA and 5 / 1 on CPU; fewer repeats are
    run when the budget is tight, never fewer than MIN_REPEATS (the case is skipped), and warm-up calls
    beyond the first stop once they would fill a quarter of the case's share.

    Returns one record per (shape, M, path), timed or skipped with a reason. Raises
    quantcore.errors.Cancelled when ``should_cancel()`` turns True (checked between cases),
    quantcore.errors.UnsupportedOnDevice when ``device`` is CUDA and there is none.
    """
    import torch

    from quantcore.kernels.hardware import device_paths, probe_device, torch_error_text

    want = bench_paths(paths)
    m_list = sorted({int(m) for m in ms})
    if not m_list or m_list[0] <= 0:
        raise ValueError(f"M values must be positive integers, got {list(ms)!r}")
    shape_list: list[tuple[int, int]] = []
    for n, k in shapes:
        n, k = int(n), int(k)
        if n <= 0 or k <= 0:
            raise ValueError(f"shape (N={n}, K={k}) must be positive")
        if (n, k) not in shape_list:
            shape_list.append((n, k))
    if budget_s_per_shape <= 0:
        raise ValueError("budget_s_per_shape must be > 0 seconds")

    dev, kind = _resolve_device(device)
    info: DeviceInfo = probe_device(dev)  # raises UnsupportedOnDevice without CUDA
    support = device_paths(info)
    n_rep = int(repeats if repeats is not None else DEFAULT_REPEATS[kind])
    n_warm = int(warmup if warmup is not None else DEFAULT_WARMUP[kind])
    if n_rep < 1 or n_warm < 0:
        raise ValueError("repeats must be >= 1 and warmup >= 0")
    min_rep = min(MIN_REPEATS, n_rep)
    dtype = torch.bfloat16 if kind == "cuda" else torch.float32
    peaks = info.peak_tflops or {}
    peak_key = dict(PEAK_KEY)
    if kind == "cpu":
        peak_key[PATH_BASELINE] = "fp32"

    total = len(shape_list) * len(m_list) * len(want)
    done = 0
    records: list[KernelRecord] = []
    rates: dict[str, tuple[int, float]] = {}  # path -> (M, FLOP/s measured at that M), to predict case costs
    timer = _Timer(dev, kind)

    def learn_rate(ops: _ShapeOperands, x: torch.Tensor, path: str, left_s: Callable[[], float]) -> None:
        """``rates[path]`` measured near ``x``'s M, by single calls at M growing _PROBE_STEP-fold from the
        largest M timed so far (the first at _PROBE_ROWS rows), each made only while its cost predicted from the
        last fits a quarter of what is left. A rate is FLOP/s, which a small M's fixed cost per call drags down:
        scaled from M = 1 to M = 2^17 it can predict a minute for a 20 ms call and skip a case that fits."""
        m, n, k = x.shape[0], ops.n, ops.k

        def probe(rows: int, calls: int = 1) -> None:  # the rate of the last of ``calls`` calls at ``rows``
            fn = _build_case(ops, path, x[:rows], kind).fn
            for _ in range(calls - 1):
                fn()
            rates[path] = (rows, 2.0 * rows * n * k / max(timer.once_s(fn), 1e-9))

        if path not in rates:
            probe(min(m, _PROBE_ROWS), calls=2)  # the very first call pays library set-up
        while (rows := rates[path][0] * _PROBE_STEP) < m:
            if 2.0 * rows * n * k / rates[path][1] > left_s() / 4:
                break  # the case's need comes from the last rate: an upper bound
            probe(rows)

    def warm_calls(call_s: float, left: float) -> int:
        """Warm-up calls for a case whose call takes ``call_s``: ``n_warm``, but no more than fill a quarter of
        the ``left`` seconds (at least the first call, which also measures it)."""
        return max(min(n_warm, int(left / 4 / max(call_s, 1e-9))), min(n_warm, 1))

    def measure(
        ops: _ShapeOperands, x: torch.Tensor, path: str, left_s: Callable[[], float]
    ) -> dict[str, Any]:
        """Record fields of one case: the timing, or why there is none."""
        m, k, n = x.shape[0], ops.k, ops.n
        bp = base_path(path)
        sup = support[bp]
        if not sup.runs:
            return {"native": False, "skipped": f"{SKIP_NOT_SUPPORTED} on {kind}: {sup.note}"}
        flops = 2.0 * m * n * k
        budget = f"{budget_s_per_shape:g} s for shape N={n} K={k}"
        try:
            learn_rate(ops, x, path, left_s)
            call_s = flops / rates[path][1]
            need = call_s * (warm_calls(call_s, left_s()) + min_rep + 1) + min_rep * timer.flush_s
            if need > (left := left_s()):
                return {
                    "native": sup.native,
                    "skipped": (f"{SKIP_OVER_BUDGET}: ~{_secs(need)} needed, " + (f"{_secs(left)} left of {budget}"
                                if left > 0 else f"the shape's earlier cases took all {budget}")),
                }
            case = _build_case(ops, path, x, kind)
            t1 = timer.once_s(case.fn)  # first call: a warm-up, and the real cost of one call
            for _ in range(warm_calls(t1, left_s()) - 1):
                case.fn()
            rates[path] = (m, flops / max(t1, 1e-9))
            reps = min(n_rep, int(left_s() / max(t1 + timer.flush_s, 1e-9)))
            if reps < min_rep:
                return {
                    "native": sup.native,
                    "skipped": (
                        f"{SKIP_OVER_BUDGET}: one call takes {t1:.2f} s, {min_rep} repeats do not fit in the "
                        f"{max(left_s(), 0):.1f} s left of {budget}"
                    ),
                }
            t_ms = timer.median_ms(case.fn, reps)
            rows = _err_rows(m, dev)
            err = _max_rel_err(case.fn()[rows], case.emulate(rows))
        except (RuntimeError, ValueError) as exc:  # a kernel this torch build or shape refuses
            return {"native": False, "skipped": f"{SKIP_FAILED} on {kind}: {torch_error_text(exc)}"}
        rates[path] = (m, flops / (t_ms * 1e-3))
        tflops = flops / (t_ms * 1e-3) / 1e12
        peak = peaks.get(peak_key[bp]) if kind == "cuda" else None
        return {
            "ms": t_ms,
            "tflops": tflops,
            "pct_peak": (100.0 * tflops / peak) if peak else None,
            "native": sup.native,
            "max_rel_err": err,
        }

    def case_order(case: tuple[int, str]) -> tuple[int, int, int]:
        """Within a shape's budget: every baseline first (each speed-up needs one), then the paths the
        device accelerates, then the ones it only emulates, each M ascending; so a slow emulated path
        can never starve the cases that serve a step estimate, and a budget cuts the largest M first."""
        m, path = case
        phase = 0 if path == PATH_BASELINE else 1 if support[base_path(path)].native else 2
        return phase, m, PATHS.index(path)

    def bench_shape(n: int, k: int) -> list[KernelRecord]:
        """Every case of one (N, K) shape within its budget, in (M, path) order."""
        t_shape = time.perf_counter()

        def left_s() -> float:
            return budget_s_per_shape - (time.perf_counter() - t_shape)

        gen = torch.Generator().manual_seed(seed + 1_000_003 * n + k)
        ops = _ShapeOperands(n, k, dev, dtype, gen)
        xs: dict[int, torch.Tensor] = {}
        shape_records: list[KernelRecord] = []

        def run_case(m: int, path: str, share: float) -> dict[str, Any]:
            if should_cancel is not None and should_cancel():
                raise Cancelled("kernel benchmark cancelled")
            if progress is not None:
                progress(done / total, f"N={n} K={k} M={m} {path}")
            if m not in xs:  # activations ~ N(0, 1), the same for every path at this M
                xs[m] = torch.randn(m, k, generator=torch.Generator().manual_seed(gen.initial_seed() + m))
                xs[m] = xs[m].to(device=dev, dtype=dtype)
            t_case = time.perf_counter()
            return measure(ops, xs[m], path, lambda: share - (time.perf_counter() - t_case))

        def keep(m: int, path: str, fields: dict[str, Any]) -> None:
            nonlocal done
            done += 1
            pm, pk, pn = kernel_padding(path, m, k, n, kind)
            shape_records.append(
                KernelRecord(
                    device=kind,
                    device_name=info.name,
                    torch_version=info.torch_version,
                    m=m,
                    n=n,
                    k=k,
                    path=path,
                    ms=fields.get("ms"),
                    tflops=fields.get("tflops"),
                    pct_peak=fields.get("pct_peak"),
                    speedup=None,  # filled in once the baselines are known
                    native=bool(fields["native"]),
                    max_rel_err=fields.get("max_rel_err"),
                    padded_m=pm if pm != m else None,
                    skipped=fields.get("skipped"),
                    padded_k=pk if pk != k else None,
                    padded_n=pn if pn != n else None,
                    timing=TIMING,
                )
            )

        cases = sorted(((m, p) for m in m_list for p in want), key=case_order)
        put_off: list[tuple[int, str]] = []
        for i, (m, path) in enumerate(cases):  # first pass: an even share of what is left each, but a baseline
            share = left_s() if path == PATH_BASELINE else left_s() / (len(cases) - i)  # (speed-ups need it)
            fields = run_case(m, path, share)
            over = (fields.get("skipped") or "").startswith(SKIP_OVER_BUDGET)
            if over and path != PATH_BASELINE and i < len(cases) - 1:
                put_off.append((m, path))  # the second pass gives it whatever the others leave
            else:
                keep(m, path, fields)
        for m, path in put_off:
            keep(m, path, run_case(m, path, left_s()))
        return sorted(shape_records, key=lambda r: (r.m, PATHS.index(r.path)))

    with torch.inference_mode():
        for n, k in shape_list:
            records.extend(bench_shape(n, k))
            if kind == "cuda":
                torch.cuda.empty_cache()

    _fill_speedups(records)
    if progress is not None:
        progress(1.0, "kernel benchmark done")
    return records


def _secs(s: float) -> str:
    """'0.042 s', '3.1 s', '120 s': a duration in a skip reason, never in exponent notation."""
    return f"{s:.2g} s" if s < 1 else f"{s:.1f} s" if s < 100 else f"{s:.0f} s"


def duration_bound(shapes: int, budget_s: float) -> str:
    """'at most 5 shapes × 60 s ≈ 5 min': the longest a benchmark of ``shapes`` (N, K) shapes times, each shape's M
    values and paths within ``budget_s`` (its last case may run over by one call), before loading and probing."""
    total = shapes * budget_s
    about = _secs(total) if total < 120 else f"{total / 60:.0f} min" if total < 7200 else f"{total / 3600:.1f} h"
    return f"at most {shapes} shape{'s' * (shapes != 1)} × {_secs(budget_s)} ≈ {about}"


def has_time(record: KernelRecord) -> bool:
    """Whether a record carries a usable time (not skipped; a NaN from a table counts as none)."""
    return record.ms is not None and math.isfinite(record.ms) and record.ms > 0


def _fill_speedups(records: list[KernelRecord]) -> None:
    base = {
        (r.device_name, r.m, r.n, r.k): r.ms for r in records if r.path == PATH_BASELINE and has_time(r)
    }
    for r in records:
        b = base.get((r.device_name, r.m, r.n, r.k))
        if b is not None and has_time(r):
            r.speedup = b / r.ms


# --------------------------------------------------------------------------- plans


def _norm_gran(g: str | None) -> str | None:
    if g is None:
        return None
    g = str(g).strip().lower().replace("-", "_")
    return g[4:] if g.startswith("per_") else g


def scheme_to_path(
    weight_format: str | None,
    act_format: str | None,
    act_granularity: str | None,
    *,
    weight_granularity: str | None = None,
    group_size: int | None = None,
) -> str | None:
    """The benchmark path that would serve a scheme, or None (baseline speed / emulated).

    - FP8 weights and FP8 activations (E4M3 or E5M2, not both E5M2): per-tensor
      activation scales -> ``fp8_tensor``; per-token -> ``fp8_row``.
    - INT8 weights and INT8 activations, per-token or per-tensor activation scales ->
      ``int8_row`` (a per-tensor scale is a constant column of per-token scales: same
      kernel, same time).
    - Weight-only (no activation format): INT8 per-channel weights -> ``w8_row``; INT4
      weights in groups of 128 -> ``w4_g128``, of 64 -> ``w4_g64``, of 32 -> ``w4_g32``, per channel -> ``w4_ch``.
      Both need ``weight_granularity`` (and
      ``group_size``) to say so; without them a weight-only scheme gets None.
    - Anything else -> None: per-group / block activation or weight scales (they do not
      factor out of the GEMM, so ``_scaled_mm`` / ``_int_mm`` cannot serve them), FP4
      and MX formats, mixed formats.

    Otherwise the weight granularity does not change the kernel: its scales are applied
    in the epilogue either way. Granularity spellings ``per_token``, ``per-token``,
    ``token`` are all accepted.
    """
    g = _norm_gran(act_granularity)
    if act_format is None:
        wg = _norm_gran(weight_granularity)
        if weight_format == "int8" and wg == "channel":
            return PATH_W8_ROW
        if weight_format == "int4" and wg == "channel":
            return PATH_W4_CH
        if weight_format == "int4" and wg == "group":
            return next((p for p, g in W4_GROUPS.items() if g == group_size and p not in W4_PER_CHANNEL), None)
        return None
    fp8 = ("fp8_e4m3", "fp8_e5m2")
    if weight_format in fp8 and act_format in fp8:
        if weight_format == "fp8_e5m2" and act_format == "fp8_e5m2":
            return None
        if g == "tensor":
            return PATH_FP8_TENSOR
        if g == "token":
            return PATH_FP8_ROW
        return None
    if weight_format == "int8" and act_format == "int8" and g in ("token", "tensor"):
        return PATH_INT8_ROW
    return None


def scheme_path(scheme: Any) -> str | None:
    """:func:`scheme_to_path` of a :class:`quantcore.schemes.specs.Scheme` (``None`` weights: identity).

    An asymmetric INT4 weight (W4A16_ASYM) is timed on its group's ``w4_g*`` path: the INT4 kernel dequantizes
    ``(q - 8) * scale + zero`` with a zero per group either way (the benchmark's zeros are 0, which costs the same),
    as vLLM's Marlin serves zero points. Other asymmetric weights get None (``_weight_int8pack_mm`` has no zeros)."""
    w, a = scheme.weights, scheme.activations
    if w is None:
        return None
    if not w.symmetric and not (w.format == "int4" and a is None):
        return None  # zero points: only the INT4 weight-only kernel reads them (its scales_and_zeros)
    return scheme_to_path(w.format, a.format if a else None, a.granularity.value if a else None,
                          weight_granularity=w.granularity.value, group_size=w.group_size)


def timed_path(path: str, quant_act: bool = True) -> str:
    """The path a layer is timed on at serving: with ``quant_act``, a path that quantizes its
    activations takes its ``+q`` variant (serving pays for that); the baseline and the
    weight-only paths, whose activations stay 16-bit, are their own."""
    if quant_act and path != PATH_BASELINE and path not in WEIGHT_ONLY_PATHS and not quantizes_activation(path):
        return path + QUANT_ACT_SUFFIX
    return path


def step_estimate(
    records: Iterable[KernelRecord],
    layer_shapes: Mapping[str, tuple[int, int]],
    layer_paths: Mapping[str, str | None],
    *,
    m_prefill: int,
    m_decode: int,
    quant_act: bool = True,
    routed: Mapping[str, Routing] | None = None,
) -> dict[str, Any]:
    """Estimated GEMM time of one prefill and one decode step for a plan.

    ``layer_shapes`` maps every linear layer to its (N, K); ``layer_paths`` maps a layer to
    its kernel path (a missing layer or None = ``baseline``). With ``quant_act`` (default)
    a base path is timed through its ``+q`` variant, since serving with quantized
    activations pays for quantizing them; a path given with ``+q`` is used as is.

    The step time is the sum over layers of the measured time at that layer's (M, N, K)
    and path, M = ``m_prefill`` or ``m_decode`` (batch x tokens); no interpolation: a
    layer whose case was not measured (absent or skipped) is listed under ``missing_*``
    and left out of the sum. A routed expert of an MoE model (``routed``: {layer:
    :class:`quantcore.models.routing.Routing`}) counts its expected share: the time at the M of one
    touched expert (``Routing.expert_m``, which the benchmark of an MoE model times) times the
    chance the step touches it. Returns::

        {"m_prefill", "m_decode",
         "prefill_ms", "decode_ms",                    # plan, measured layers only
         "baseline_prefill_ms", "baseline_decode_ms",  # every layer at baseline
         "speedup_prefill", "speedup_decode",          # over layers measured both ways
         "common_baseline_prefill_ms", "common_baseline_decode_ms",  # baseline over those layers (the speed-up's)
         "missing_prefill", "missing_decode",          # layers without a plan-path time
         "skipped_prefill", "skipped_decode",          # {missing layer: why its case has no time}, where recorded
         "missing_baseline",                           # layers without a baseline time
         "complete": bool,                             # nothing missing anywhere
         "per_layer": {name: {"path", "prefill_ms", "decode_ms"}}}

    Records from more than one device raise ValueError (times from different devices do
    not add up).
    """
    recs = list(records)
    devices = {(r.device, r.device_name) for r in recs}
    if len(devices) > 1:
        names = ", ".join(sorted(d[1] for d in devices))
        raise ValueError(f"records come from several devices ({names}); estimate one device at a time")
    times = {(r.m, r.n, r.k, r.path): r.ms for r in recs if has_time(r)}
    skips = {(r.m, r.n, r.k, r.path): r.skipped for r in recs if not has_time(r) and r.skipped}
    valid = set(PATHS)

    out: dict[str, Any] = {"m_prefill": int(m_prefill), "m_decode": int(m_decode), "per_layer": {}}
    tot = {"prefill": 0.0, "decode": 0.0, "base_prefill": 0.0, "base_decode": 0.0}
    common = {"prefill": [0.0, 0.0], "decode": [0.0, 0.0]}  # [plan, baseline] over layers with both
    missing: dict[str, list[str]] = {"prefill": [], "decode": [], "baseline": []}
    skipped: dict[str, dict[str, str]] = {"prefill": {}, "decode": {}}
    routed = routed or {}
    for name, (n, k) in layer_shapes.items():
        path = layer_paths.get(name) or PATH_BASELINE
        if path not in valid:
            raise ValueError(f"layer {name!r}: unknown kernel path {path!r}; choose from: {', '.join(PATHS)}")
        path = timed_path(path, quant_act)
        entry: dict[str, Any] = {"path": path}
        for step, m in (("prefill", m_prefill), ("decode", m_decode)):
            t = step_share(times, int(m), int(n), int(k), path, routed.get(name))
            b = step_share(times, int(m), int(n), int(k), PATH_BASELINE, routed.get(name))
            entry[f"{step}_ms"] = t
            if t is None:
                missing[step].append(name)
                if (why := skips.get((case_m(int(m), routed.get(name)), int(n), int(k), path))) is not None:
                    skipped[step][name] = why
            else:
                tot[step] += t
            if b is None:
                if name not in missing["baseline"]:
                    missing["baseline"].append(name)
            else:
                tot[f"base_{step}"] += b
            if t is not None and b is not None:
                common[step][0] += t
                common[step][1] += b
        out["per_layer"][name] = entry
    out["prefill_ms"] = tot["prefill"]
    out["decode_ms"] = tot["decode"]
    out["baseline_prefill_ms"] = tot["base_prefill"]
    out["baseline_decode_ms"] = tot["base_decode"]
    for step in ("prefill", "decode"):
        plan_t, base_t = common[step]
        out[f"speedup_{step}"] = (base_t / plan_t) if plan_t > 0 else None
        out[f"common_baseline_{step}_ms"] = base_t
        out[f"skipped_{step}"] = skipped[step]
    out["missing_prefill"] = missing["prefill"]
    out["missing_decode"] = missing["decode"]
    out["missing_baseline"] = missing["baseline"]
    out["complete"] = not any(missing.values())
    return out


# --------------------------------------------------------------------------- text


def format_records(records: Iterable[KernelRecord]) -> str:
    """A fixed-width text table of records (for logs and the benchmark script)."""
    head = (
        f"{'M':>6} {'N':>6} {'K':>6} {'path':<13} {'ms':>10} {'TFLOP/s':>9} {'%peak':>6} "
        f"{'speedup':>7} {'native':>6} {'max_rel_err':>11} {'pad':>8}  note"
    )
    lines = [head, "-" * len(head)]

    def f(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    for r in records:
        pad = []
        if r.padded_m:
            pad.append(f"M{r.padded_m}")
        if r.padded_k:
            pad.append(f"K{r.padded_k}")
        if r.padded_n:
            pad.append(f"N{r.padded_n}")
        lines.append(
            f"{r.m:>6} {r.n:>6} {r.k:>6} {r.path:<13} {f(r.ms, '.4f'):>10} {f(r.tflops, '.4f'):>9} "
            f"{f(r.pct_peak, '.1f'):>6} {f(r.speedup, '.2f'):>7} {('yes' if r.native else 'no'):>6} "
            f"{f(r.max_rel_err, '.2e'):>11} {','.join(pad) or '-':>8}  {r.skipped or ''}"
        )
    return "\n".join(lines)


def _fmt_ratio(x: float) -> str:
    """Two decimals, or two significant digits below 0.1 (a CPU's FP8 path can be 0.0021×)."""
    return f"{x:.2f}" if x >= 0.1 else f"{x:.2g}"


def format_markdown(records: Iterable[KernelRecord]) -> str:
    """Speed-ups as a Markdown table (one row per shape and M), for the README and reports.

    Each path cell reads ``1.52× · 41%``: speed-up over the baseline at that shape, then
    percent of the device's dense peak for the path's dtype (left out where the device is
    not in the peak table); ``skip`` where the case has no time. The baseline column gives
    its own time and percent of peak. A last line gives the largest kernel-vs-emulation
    difference per path. Records from more than one device raise ValueError.
    """
    recs = list(records)
    if not recs:
        return "(no records)"
    names = sorted({r.device_name for r in recs})
    if len(names) > 1:
        raise ValueError(f"records come from several devices ({', '.join(names)}); one table per device")
    paths = [p for p in PATHS if any(r.path == p for r in recs)]
    by_case = {(r.n, r.k, r.m, r.path): r for r in recs}
    rows = sorted({(r.n, r.k, r.m) for r in recs}, key=lambda t: (t[1], t[0], t[2]))

    def pct(r: KernelRecord) -> str:
        return "" if r.pct_peak is None else f" · {r.pct_peak:.0f}%"

    def cell(r: KernelRecord | None) -> str:
        if r is None:
            return ""
        if not has_time(r):
            return "skip"
        if r.path == PATH_BASELINE:
            return f"{r.ms:.4f} ms{pct(r)}"
        return ("-" if r.speedup is None else f"{_fmt_ratio(r.speedup)}×") + pct(r)

    head = ["N × K", "M"] + [p if p != PATH_BASELINE else "baseline ms" for p in paths]
    lines = [
        f"{names[0]} · torch {recs[0].torch_version}",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---:" if i else "---" for i in range(len(head))) + "|",
    ]
    for n, k, m in rows:
        cells = [f"{n} × {k}", str(m)] + [cell(by_case.get((n, k, m, p))) for p in paths]
        lines.append("| " + " | ".join(cells) + " |")
    errs = []
    for p in paths:
        vals = [r.max_rel_err for r in recs if r.path == p and r.max_rel_err is not None]
        if vals:
            errs.append(f"{p} {max(vals):.1e}")
    if errs:
        lines += ["", "max kernel-vs-emulation difference: " + ", ".join(errs)]
    return "\n".join(lines)
