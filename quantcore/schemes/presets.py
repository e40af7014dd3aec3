"""The preset schemes, by name (torch-free), as compressed-tensors' ``PRESET_SCHEMES``: each preset a named module
constant, all of them gathered in one table, :data:`PRESET_SCHEMES`, in the order pages list them (FP8 family first,
BF16 last). llm-compressor's names are used where they exist (FP8, FP8_DYNAMIC, FP8_BLOCK, W8A16, W4A16, NVFP4,
NVFP4A16, INT8_W8A8 ~ "W8A8"); the other names are quantplan's own. The INT4 presets come again with groups of 64
and 32 and per output channel (``W4A16_G64*``, ``W4A16_G32*``, ``W4A16_CHANNEL*``), derived from the W4A16 family.
"""

from __future__ import annotations

import dataclasses

from quantcore.formats.granularity import Granularity
from quantcore.schemes.specs import Scheme, TensorSpec

SQ_DEFAULT_ALPHA = 0.5  # SmoothQuant migration strength used by the *_SQ presets [Xiao et al. 2022, sec. 4]
W4_GROUP_SIZE = 128  # INT4 weight group along K, as in compressed-tensors' W4A16 preset
# The W4A16_G64 presets: groups of 64 divide a K that 128 does not (SmolLM2's hidden size 576 = 9 x 64), and vLLM's
# Marlin kernels serve them (MARLIN_SUPPORTED_GROUP_SIZES: -1, 32, 64, 128).
W4_SMALL_GROUP_SIZE = 64
# The W4A16_G32 presets: the smallest group Marlin serves, for a K (or one GPU's share of it under tensor parallelism)
# that 64 does not divide: Qwen2.5-72B's down_proj at 4 GPUs reads 7,392 inputs each, 231 groups of 32.
W4_TINY_GROUP_SIZE = 32
FP8_BLOCK_TILE = (128, 128)  # DeepSeek-V3 weight tile (rows of N, columns of K), the FP8_BLOCK preset's
FP8_ACT_GROUP = 128  # DeepSeek-V3 activation tile: 1 x 128 along K, per token

T, C, K, G, B = (
    Granularity.TENSOR,
    Granularity.CHANNEL,
    Granularity.TOKEN,
    Granularity.GROUP,
    Granularity.BLOCK,
)
_fp8_w_tensor = TensorSpec("fp8_e4m3", T, dynamic=False)
_fp8_w_channel = TensorSpec("fp8_e4m3", C, dynamic=False)
_int8_w_channel = TensorSpec("int8", C, dynamic=False)
_int8_a_token = TensorSpec("int8", K)
_int8_a_tensor = TensorSpec("int8", T)
_int4_g128 = TensorSpec("int4", G, dynamic=False, group_size=W4_GROUP_SIZE)
_int4_g128_asym = dataclasses.replace(_int4_g128, symmetric=False)
# NVFP4 activations as compressed-tensors' NVFP4 preset has them (dynamic: local): the E4M3 block scales are
# computed from each live block of 16, the fp32 tensor scale above them from the calibrated amax
_nvfp4_a = TensorSpec("nvfp4", G, dynamic=False)

FP8 = Scheme(
    "FP8",
    _fp8_w_tensor,
    TensorSpec("fp8_e4m3", T, dynamic=False),
    description="FP8 E4M3, per-tensor weights, static per-tensor activations (calibrated amax)",
)
FP8_PER_TENSOR = Scheme(
    "FP8_PER_TENSOR",
    _fp8_w_tensor,
    TensorSpec("fp8_e4m3", T),
    description="FP8 E4M3, per-tensor weights, dynamic per-tensor activations",
)
FP8_DYNAMIC = Scheme(
    "FP8_DYNAMIC",
    _fp8_w_channel,
    TensorSpec("fp8_e4m3", K),
    description="FP8 E4M3, per-channel weights, dynamic per-token activations; no calibration",
)
FP8_BLOCK = Scheme(
    "FP8_BLOCK",
    TensorSpec("fp8_e4m3", B, dynamic=False, block=FP8_BLOCK_TILE),
    TensorSpec("fp8_e4m3", G, group_size=FP8_ACT_GROUP),
    description="FP8 E4M3, 128x128 weight blocks, 1x128 dynamic activation groups (DeepSeek-V3)",
)
FP8_E5M2 = Scheme(
    "FP8_E5M2",
    TensorSpec("fp8_e5m2", T, dynamic=False),
    TensorSpec("fp8_e5m2", T),
    description="FP8 E5M2, per-tensor weights, dynamic per-tensor activations (a training format; "
    "shown for comparison with FP8_PER_TENSOR)",
)
INT8_PER_TENSOR = Scheme(
    "INT8_PER_TENSOR",
    _int8_w_channel,
    _int8_a_tensor,
    description="INT8, per-channel weights, dynamic per-tensor activations",
)
INT8_PER_TENSOR_SQ = Scheme(
    "INT8_PER_TENSOR_SQ",
    _int8_w_channel,
    _int8_a_tensor,
    smoothquant_alpha=SQ_DEFAULT_ALPHA,
    description="INT8_PER_TENSOR after SmoothQuant (α = 0.5)",
)
INT8_W8A8 = Scheme(
    "INT8_W8A8",
    _int8_w_channel,
    _int8_a_token,
    description="INT8, per-channel weights, dynamic per-token activations",
)
INT8_W8A8_SQ = Scheme(
    "INT8_W8A8_SQ",
    _int8_w_channel,
    _int8_a_token,
    smoothquant_alpha=SQ_DEFAULT_ALPHA,
    description="INT8_W8A8 after SmoothQuant (α = 0.5)",
)
INT8_W8A8_GPTQ = Scheme(
    "INT8_W8A8_GPTQ",
    _int8_w_channel,
    _int8_a_token,
    gptq=True,
    description="INT8_W8A8 with GPTQ-rounded weights",
)
INT8_W8A8_SQ_GPTQ = Scheme(
    "INT8_W8A8_SQ_GPTQ",
    _int8_w_channel,
    _int8_a_token,
    smoothquant_alpha=SQ_DEFAULT_ALPHA,
    gptq=True,
    description="INT8_W8A8 after SmoothQuant (α = 0.5), GPTQ-rounded weights: llm-compressor's W8A8 recipe",
)
W8A16 = Scheme("W8A16", _int8_w_channel, None, description="INT8 per-channel weights, 16-bit activations")
W8A16_GPTQ = Scheme(
    "W8A16_GPTQ",
    _int8_w_channel,
    None,
    gptq=True,
    description="W8A16 with GPTQ-rounded weights",
)
W8A16_AWQ = Scheme(
    "W8A16_AWQ",
    _int8_w_channel,
    None,
    awq=True,
    description="W8A16 with AWQ: input channels scaled by factors searched on calibration text, then "
    "rounded to nearest",
)
W4A16 = Scheme(
    "W4A16",
    _int4_g128,
    None,
    description="INT4 weights in groups of 128 along K, 16-bit activations (rounded to nearest)",
)
W4A16_GPTQ = Scheme(
    "W4A16_GPTQ",
    _int4_g128,
    None,
    gptq=True,
    description="W4A16 with GPTQ-rounded weights: llm-compressor's W4A16 recipe",
)
W4A16_AWQ = Scheme(
    "W4A16_AWQ",
    _int4_g128,
    None,
    awq=True,
    description="W4A16 with AWQ: input channels scaled by factors searched on calibration text, then "
    "rounded to nearest (llm-compressor's AWQ recipe)",
)
W4A16_ASYM = Scheme(
    "W4A16_ASYM",
    _int4_g128_asym,
    None,
    description="INT4 weights in groups of 128 along K with a zero point per group, so each group's 16 "
    "levels span its own min..max; 16-bit activations (rounded to nearest; compressed-tensors' W4A16_ASYM)",
)
W4A16_ASYM_GPTQ = Scheme(
    "W4A16_ASYM_GPTQ",
    _int4_g128_asym,
    None,
    gptq=True,
    description="W4A16_ASYM with GPTQ-rounded weights",
)
W4A16_ASYM_AWQ = Scheme(
    "W4A16_ASYM_AWQ",
    _int4_g128_asym,
    None,
    awq=True,
    description="W4A16_ASYM with AWQ: input channels scaled by factors searched on calibration text, then "
    "rounded to nearest (the scheme of llm-compressor's AWQ examples)",
)
W4AFP8 = Scheme(
    "W4AFP8",
    _int4_g128,
    TensorSpec("fp8_e4m3", K),
    description="INT4 weights in groups of 128 along K, FP8 E4M3 dynamic per-token activations: the 4-bit "
    "weight read of W4A16 with FP8 math (compressed-tensors' W4AFP8; vLLM's CUTLASS W4A8 kernel, Hopper)",
)
W4AFP8_GPTQ = Scheme(
    "W4AFP8_GPTQ",
    _int4_g128,
    TensorSpec("fp8_e4m3", K),
    gptq=True,
    description="W4AFP8 with GPTQ-rounded weights: llm-compressor's W4AFP8 recipe",
)
MXFP8 = Scheme(
    "MXFP8",
    TensorSpec("mxfp8", G, dynamic=False),
    TensorSpec("mxfp8", G),
    description="OCP MXFP8: E4M3 with a power-of-two scale per 32, weights and activations",
)
MXFP4 = Scheme(
    "MXFP4",
    TensorSpec("mxfp4", G, dynamic=False),
    TensorSpec("mxfp4", G),
    description="OCP MXFP4: E2M1 with a power-of-two scale per 32, weights and activations",
)
MXFP4A16 = Scheme(
    "MXFP4A16",
    TensorSpec("mxfp4", G, dynamic=False),
    None,
    description="OCP MXFP4 weights (E2M1, a power-of-two scale per 32), 16-bit activations: gpt-oss's "
    "format and compressed-tensors' MXFP4A16; vLLM serves it with its FP4 Marlin kernel "
    "(CompressedTensorsW4A16Mxfp4, sm80+, bfloat16 activations)",
)
NVFP4 = Scheme(
    "NVFP4",
    TensorSpec("nvfp4", G, dynamic=False),
    _nvfp4_a,
    description="NVFP4: E2M1, E4M3 scale per 16, fp32 tensor scale, weights and activations; the "
    "activations' tensor scale calibrated (llm-compressor's static_minmax), their block scales live",
)
NVFP4_GPTQ = Scheme(
    "NVFP4_GPTQ",
    TensorSpec("nvfp4", G, dynamic=False),
    _nvfp4_a,
    gptq=True,
    description="NVFP4 with GPTQ-rounded weights (the same block and tensor scales)",
)
NVFP4A16 = Scheme(
    "NVFP4A16",
    TensorSpec("nvfp4", G, dynamic=False),
    None,
    description="NVFP4 weights, 16-bit activations",
)
NVFP4A16_GPTQ = Scheme(
    "NVFP4A16_GPTQ",
    TensorSpec("nvfp4", G, dynamic=False),
    None,
    gptq=True,
    description="NVFP4A16 with GPTQ-rounded weights (the same block and tensor scales)",
)
NVFP4A16_AWQ = Scheme(
    "NVFP4A16_AWQ",
    TensorSpec("nvfp4", G, dynamic=False),
    None,
    awq=True,
    description="NVFP4A16 with AWQ: input channels scaled by factors searched on calibration text, then "
    "rounded to nearest",
)
BF16 = Scheme("BF16", None, None, description="left unquantized")


def _per_channel(w4: list[Scheme]) -> list[Scheme]:
    """The symmetric W4A16 presets with one INT4 scale per output channel instead of per group, named
    ``W4A16_CHANNEL[_GPTQ|_AWQ]``: GPTQ's ``group_size: -1``, compressed-tensors' channel strategy. No group to
    divide K, so any K takes them, also one GPU's share of it under tensor parallelism, where no group fits
    (Qwen2.5-72B's down_proj at 8 GPUs: 3,696 inputs each); vLLM's Marlin serves them (group size -1)."""
    out = []
    for s in w4:
        assert s.weights is not None  # the W4A16 family quantizes weights
        name = s.name.replace("W4A16", "W4A16_CHANNEL", 1)
        if s.gptq:
            description = "W4A16_CHANNEL with GPTQ-rounded weights (GPTQ's group_size -1)"
        elif s.awq:
            description = ("W4A16_CHANNEL with AWQ: input channels scaled by factors searched on calibration text, "
                           "then rounded to nearest")
        else:
            description = ("INT4 weights with one scale per output channel, 16-bit activations (rounded to nearest): "
                           "the fewest scales of any INT4 preset and no group that K must divide, at the cost of "
                           "one scale spanning a whole row's outliers")
        weights = dataclasses.replace(s.weights, granularity=Granularity.CHANNEL, group_size=None)
        out.append(dataclasses.replace(s, name=name, weights=weights, description=description))
    return out


_W4_GROUPS = (W4_GROUP_SIZE, W4_SMALL_GROUP_SIZE, W4_TINY_GROUP_SIZE)  # the INT4 groups of the presets, largest first
_TIMES = {2: "twice", 4: "four times"}


def _regrouped(w4: list[Scheme], group: int) -> list[Scheme]:
    """The W4A16 presets again with int4 groups of ``group`` along K, named ``W4A16_G<group>[_ASYM][_GPTQ|_AWQ]``."""
    tag = f"_G{group}"
    out = []
    for s in w4:
        assert s.weights is not None  # the W4A16 family quantizes weights
        name = s.name.replace("W4A16", f"W4A16{tag}", 1)
        base = f"W4A16{tag}" + ("_ASYM" if not s.weights.symmetric else "")
        if s.gptq:
            description = f"{base} with GPTQ-rounded weights"
        elif s.awq:
            description = (f"{base} with AWQ: input channels scaled by factors searched on calibration text, "
                           "then rounded to nearest")
        else:
            zero = " with a zero point per group" if not s.weights.symmetric else ""
            description = (f"INT4 weights in groups of {group} along K{zero}, 16-bit activations (rounded to "
                           f"nearest); {_TIMES[W4_GROUP_SIZE // group]} the scales of groups of {W4_GROUP_SIZE}, "
                           f"for a K that {' or '.join(str(g) for g in _W4_GROUPS if g > group)} does not divide")
        weights = dataclasses.replace(s.weights, group_size=group)
        out.append(dataclasses.replace(s, name=name, weights=weights, description=description))
    return out


_W4 = [W4A16, W4A16_GPTQ, W4A16_AWQ, W4A16_ASYM, W4A16_ASYM_GPTQ, W4A16_ASYM_AWQ]  # derived families below

_IN_ORDER: list[Scheme] = [
    FP8, FP8_PER_TENSOR, FP8_DYNAMIC, FP8_BLOCK, FP8_E5M2, INT8_PER_TENSOR, INT8_PER_TENSOR_SQ, INT8_W8A8,
    INT8_W8A8_SQ, INT8_W8A8_GPTQ, INT8_W8A8_SQ_GPTQ, W8A16, W8A16_GPTQ, W8A16_AWQ, W4A16, W4A16_GPTQ,
    W4A16_AWQ, W4A16_ASYM, W4A16_ASYM_GPTQ, W4A16_ASYM_AWQ,
    *_regrouped(_W4, W4_SMALL_GROUP_SIZE),
    *_regrouped(_W4, W4_TINY_GROUP_SIZE),
    *_per_channel([s for s in _W4 if s.weights is not None and s.weights.symmetric]),
    W4AFP8, W4AFP8_GPTQ, MXFP8, MXFP4, MXFP4A16, NVFP4, NVFP4_GPTQ, NVFP4A16, NVFP4A16_GPTQ, NVFP4A16_AWQ,
    BF16,
]
#: Every preset by name, in the order :func:`list_schemes` gives them.
PRESET_SCHEMES: dict[str, Scheme] = {s.name: s for s in _IN_ORDER}
del T, C, K, G, B


def list_schemes() -> list[str]:
    """Names of every preset scheme, FP8 family first, BF16 last."""
    return list(PRESET_SCHEMES)


def get_scheme(name: str | Scheme) -> Scheme:
    """The preset scheme called ``name`` (a Scheme passes through unchanged).

    Case-sensitive, like llm-compressor. Raises ValueError listing the valid names.
    """
    if isinstance(name, Scheme):
        return name
    try:
        return PRESET_SCHEMES[name]
    except (KeyError, TypeError):
        hint = ""
        if isinstance(name, str) and name.upper() in PRESET_SCHEMES:
            hint = f" (did you mean {name.upper()!r}? names are case-sensitive)"
        valid = ", ".join(PRESET_SCHEMES)
        raise ValueError(f"unknown scheme {name!r}{hint}; valid schemes are: {valid}") from None
