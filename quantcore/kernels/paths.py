"""The kernel paths a benchmark times, the shapes it times them on, and the path that serves a scheme.

torch-free: the Streamlit app reads :data:`PATHS`; the benchmark (:mod:`quantcore.kernels.bench`), the step estimate
(:mod:`quantcore.kernels.estimate`) and the automatic planner name paths by these constants.

For a linear layer ``y = x @ W^T`` with ``x`` [M, K] and ``W`` [N, K], each *path* is one way to run the GEMM.
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
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from quantcore.schemes.presets import W4_GROUP_SIZE, W4_SMALL_GROUP_SIZE, W4_TINY_GROUP_SIZE

if TYPE_CHECKING:
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


def base_path(path: str) -> str:
    """``"fp8_row+q"`` -> ``"fp8_row"``; base paths are returned unchanged."""
    return path[: -len(QUANT_ACT_SUFFIX)] if path.endswith(QUANT_ACT_SUFFIX) else path


def quantizes_activation(path: str) -> bool:
    """Whether ``path`` times the on-the-fly activation quantization (the ``+q`` variants)."""
    return path.endswith(QUANT_ACT_SUFFIX)


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
