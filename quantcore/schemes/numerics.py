"""Versions of quantcore's numerics: what a stored score's numbers mean, for reading old scores beside new ones."""

from __future__ import annotations

from quantcore.formats.granularity import Granularity
from quantcore.schemes.presets import get_scheme
from quantcore.schemes.specs import Scheme

# What a stored score's numbers mean, for reading old scores beside new ones (ScoreReport.numerics):
#   1  int weights on a symmetric grid, the most negative code unused (scale amax / 127, amax / 7)
#   2  int weights on compressed-tensors' grid (amax / 127.5, amax / 7.5; codes -128..127, -8..7), as llm-compressor
#      writes them (quantcore.formats.weights.fake_quantize_weight); the GPTQ presets. A stored score without it is 1.
#   3  NVFP4 activations with their fp32 tensor scale calibrated (compressed-tensors' dynamic: local), not taken from
#      each forward's own amax
#   4  per-tensor E4M3 weights of a fusion group (q/k/v, gate/up) requantized to the group's largest scale, as vLLM
#      loads them for its merged GEMM (quantcore.algorithms.apply._requantize_fused_fp8)
#   5  dynamic per-tensor activation scales of routed experts taken over the whole MoE block, as vLLM's fused MoE
#      takes them (quantcore.models.moe.LinearExperts._forward_block_scaled), not over each expert's own tokens
#   6  MX weights (MXFP4, MXFP8) on the E8M0 block scales compressed-tensors stores (quantcore.formats.quantize.
#      mx_weight_scale: the amax rounded to a power of two first), not OCP's floor(log2 amax)
#   7  a plan served on several GPUs (tensor_parallel): row-parallel layers (o_proj, down_proj, split routed
#      experts' down_proj) take dynamic per-tensor / per-token activation scales over each GPU's share of K
NUMERICS = 7
NUMERICS_INT_WEIGHT_GRID = 2  # the first version with int weights on compressed-tensors' grid
NUMERICS_NVFP4_CALIBRATED_ACTS = 3  # the first version with NVFP4 activations' tensor scale calibrated
NUMERICS_FUSED_FP8_TENSOR = 4  # the first version with fused per-tensor FP8 weights on one shared scale
NUMERICS_MOE_BLOCK_DYNAMIC = 5  # the first version with routed experts' dynamic per-tensor scales block-wide
NUMERICS_MX_WEIGHT_SCALES = 6  # the first version with MX weights on compressed-tensors' E8M0 scales
NUMERICS_TP_INPUT_SHARES = 7  # the first version scoring a plan's row-parallel dynamic scales per GPU's share


def numerics_changes(scheme: Scheme | str, numerics: int | None, *, expert: bool = False,
                     input_shares: int = 1) -> list[str]:
    """How a result that quantcore numerics version ``numerics`` (None: a result stored before versions, 1) made
    of ``scheme`` differs from one made now, one phrase per change; [] when it would be the same. ``expert``: the
    result covers routed experts of an MoE block (some changes concern only them); ``input_shares``: the GPUs the
    layer's input is cut among in the plan scored (quantcore.models.parallel.Parallelism.input_shards)."""
    scheme = get_scheme(scheme)
    version = int(numerics or 1)
    out = []
    if scheme.int_weights and version < NUMERICS_INT_WEIGHT_GRID:
        out.append("int weights on a -7..7 / -127..127 grid instead of the -8..7 / -128..127 (scale amax / 7.5, "
                   "amax / 127.5) llm-compressor stores and quantplan uses now")
    acts = scheme.activations
    if acts is not None and acts.format == "nvfp4" and not acts.dynamic and version < NUMERICS_NVFP4_CALIBRATED_ACTS:
        out.append("NVFP4 activations whose fp32 tensor scale came from each forward's own amax instead of the "
                   "calibrated one llm-compressor stores and vLLM reads")
    w = scheme.weights
    if (w is not None and w.format == "fp8_e4m3" and w.granularity is Granularity.TENSOR
            and version < NUMERICS_FUSED_FP8_TENSOR):
        out.append("per-tensor FP8 weights of q/k/v and gate/up each on its own scale instead of the group's largest, "
                   "to which vLLM requantizes them for its merged GEMM")
    if w is not None and w.format in ("mxfp4", "mxfp8") and version < NUMERICS_MX_WEIGHT_SCALES:
        out.append("MX weights on OCP's E8M0 scales (floor(log2 amax)) instead of the ones llm-compressor stores, "
                   "whose block amax is first rounded to a power of two (twice the scale for a block whose amax has "
                   "a mantissa of 1.75 or more)")
    if (expert and acts is not None and acts.dynamic and acts.granularity is Granularity.TENSOR
            and version < NUMERICS_MOE_BLOCK_DYNAMIC):
        out.append("routed experts whose dynamic per-tensor activation scale came from each expert's own tokens "
                   "instead of the whole block, as vLLM's fused MoE takes it")
    if input_shares > 1 and scheme.scaled_per_gpu_share and version < NUMERICS_TP_INPUT_SHARES:
        out.append(f"a dynamic activation scale over the whole input of a row-parallel layer instead of over each of "
                   f"the {input_shares} GPUs' shares, as each GPU quantizes its own")
    return out
