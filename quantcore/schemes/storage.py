"""Bits a serving checkpoint stores for a linear weight under a scheme (torch-free)."""

from __future__ import annotations

from quantcore.formats.catalog import get_format
from quantcore.formats.granularity import Granularity
from quantcore.schemes.presets import get_scheme
from quantcore.schemes.specs import IDENTITY_BITS, Scheme, TensorSpec

#: Bits of one stored weight scale. compressed-tensors creates weight scales in the checkpoint's own
#: dtype (``initialize_qparams``: bf16 / fp16 for a 16-bit model), whatever the granularity; the block
#: formats instead carry their own scale type (E8M0 for MX, E4M3 for NVFP4).
SCALE_BITS = IDENTITY_BITS
BLOCK_SCALE_BITS = {"e8m0": 8, "fp8_e4m3": 8}
GLOBAL_SCALE_BITS = 32  # NVFP4's fp32 per-tensor scale on top of its E4M3 block scales


def weight_scale_count(spec: TensorSpec, n: int, k: int) -> int:
    """Number of scales stored for an (N, K) weight quantized with ``spec`` (module docstring table)."""
    gran = spec.granularity
    if gran is Granularity.TENSOR:
        return 1
    if gran is Granularity.CHANNEL:
        return n
    if gran is Granularity.GROUP:
        assert spec.group_size is not None  # validated at construction
        return n * -(-k // spec.group_size)
    if gran is Granularity.BLOCK:
        assert spec.block is not None  # validated at construction
        rows, cols = spec.block
        return -(-n // rows) * -(-k // cols)
    raise ValueError(f"granularity {gran.value!r} is an activation granularity: a weight has no tokens")


def weight_storage_bits(scheme: Scheme | str, n: int, k: int) -> int:
    """Bits a serving checkpoint stores for one (N, K) linear weight under ``scheme``.

    Elements at the format's width, plus the scales (:data:`SCALE_BITS` each, or the block
    format's own scale type), plus NVFP4's fp32 tensor scale, plus an asymmetric weight's zero points. An
    unquantized weight is 16 bits per element. SmoothQuant changes no storage (the factors fold into the
    previous layer), and biases are left out (they stay 16-bit whatever the scheme). This is the weight memory a GPU
    holds and, in a memory-bound decode step, the bytes it reads per token.
    """
    scheme = get_scheme(scheme)
    spec = scheme.weights
    if spec is None:
        return IDENTITY_BITS * n * k
    fmt = get_format(spec.format)
    scales = weight_scale_count(spec, n, k)
    if fmt.is_block:
        assert fmt.scale is not None  # every block format names its scale type
        extra = GLOBAL_SCALE_BITS if fmt.name == "nvfp4" else 0
        return fmt.bits * n * k + BLOCK_SCALE_BITS[fmt.scale] * scales + extra
    # an asymmetric weight also stores a zero point per scale, packed at the weight's own width (compressed-tensors'
    # pack-quantized format: ``pack_to_int32(zero_point, num_bits)``)
    zero_points = 0 if spec.symmetric else fmt.bits * scales
    return fmt.bits * n * k + SCALE_BITS * scales + zero_points
