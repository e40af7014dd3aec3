"""Quantization schemes: what happens to one linear layer's weight and input (torch-free).

A :class:`TensorSpec` says how one operand is quantized (format, scale granularity, dynamic
or static scale). A :class:`Scheme` pairs a weight spec with an activation spec (``None``:
weight-only) and an optional SmoothQuant strength α. Presets are looked up by name, using
llm-compressor's names where they exist (compressed-tensors ``PRESET_SCHEMES``: FP8,
FP8_DYNAMIC, FP8_BLOCK, W8A16, W4A16, NVFP4, NVFP4A16, INT8_W8A8 ~ "W8A8"); the other names
are quantplan's own.

Granularity, for a weight W of shape (N, K) = (out_features, in_features) and an
activation X of shape (..., K) (leading dims = tokens); the scale shapes are those of
:func:`quantcore.formats.quantize.quantize`:

========  ================================  ====================================
value     scale per                          scale shape
========  ================================  ====================================
tensor    whole tensor                       ()
channel   weight output row                  (N, 1)
token     activation row (token)             (..., 1)
group     G consecutive elements along K     (..., ceil(K / G))
block     (br, bc) tile of the 2-D view      (ceil(rows / br), ceil(K / bc))
========  ================================  ====================================

For weights, "static" and "dynamic" make no difference: the scale is computed once from the
weight itself. For activations, static means one calibrated amax per tensor (a calibration
pass is needed); dynamic means a fresh scale on every forward.

Fusion groups: serving engines fuse the linears that read the same input (q/k/v of an
attention block, gate/up of a gated MLP) into one GEMM, so they must share one scheme and
SmoothQuant must treat their input as one. :func:`fusion_groups` finds them by name.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from quantcore.formats.catalog import get_format

SQ_DEFAULT_ALPHA = 0.5  # SmoothQuant migration strength used by the *_SQ presets [Xiao et al. 2022, sec. 4]
W4_GROUP_SIZE = 128  # INT4 weight group along K, as in compressed-tensors' W4A16 preset
# The W4A16_G64 presets: groups of 64 divide a K that 128 does not (SmolLM2's hidden size 576 = 9 x 64), and vLLM's
# Marlin kernels serve them (MARLIN_SUPPORTED_GROUP_SIZES: -1, 32, 64, 128).
W4_SMALL_GROUP_SIZE = 64
# The W4A16_G32 presets: the smallest group Marlin serves, for a K (or one GPU's share of it under tensor parallelism)
# that 64 does not divide: Qwen2.5-72B's down_proj at 4 GPUs reads 7,392 inputs each, 231 groups of 32.
W4_TINY_GROUP_SIZE = 32
FP8_BLOCK = (128, 128)  # DeepSeek-V3 weight tile (rows of N, columns of K)
FP8_ACT_GROUP = 128  # DeepSeek-V3 activation tile: 1 x 128 along K, per token
IDENTITY_BITS = 16  # bits reported for an unquantized operand (bf16 / fp16)
# What a stored score's numbers mean, for reading old scores beside new ones (ScoreReport.numerics):
#   1  int weights on a symmetric grid, the most negative code unused (scale amax / 127, amax / 7)
#   2  int weights on compressed-tensors' grid (amax / 127.5, amax / 7.5; codes -128..127, -8..7), as llm-compressor
#      writes them (quantcore.formats.quantize.fake_quantize_weight); the GPTQ presets. A stored score without it is 1.
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
# GPTQ as quantcore.algorithms.gptq runs it: llm-compressor 0.14's GPTQModifier defaults
GPTQ_BLOCK_SIZE = 128  # GPTQModifier.block_size: columns per lazy batch update
GPTQ_DAMPENING = 0.01  # GPTQModifier.dampening_frac: of mean(diag H), added to the diagonal
AWQ_N_GRID = 20  # AWQModifier.n_grid: candidate scales per mapping
AWQ_DUO_SCALING = True  # AWQModifier.duo_scaling: candidates from activation and weight means
GPTQ_ACTORDER = "static"  # GPTQModifier.actorder default (alias of "weight"): columns by descending diag(H)


class Granularity(str, Enum):  # noqa: UP042 - the contract: (str, Enum) as compressed-tensors
    """How many scales a tensor gets (see the module docstring for shapes)."""

    TENSOR = "tensor"
    CHANNEL = "channel"
    TOKEN = "token"
    GROUP = "group"
    BLOCK = "block"


@dataclass(frozen=True)
class TensorSpec:
    """How one operand (weight or activation) is quantized.

    format:      a registered format name (``quantcore.formats.catalog.list_formats()``)
    granularity: scale granularity; block formats (mxfp8/mxfp4/nvfp4) must use GROUP with
                 group_size equal to their block size (None is filled in)
    dynamic:     activation scales computed on every forward (True) or from a calibrated amax
                 (False: needs calibration; only per-tensor, or nvfp4's fp32 tensor scale).
                 Ignored for weights, whose scales always come from the weight itself; the
                 presets mark weights dynamic=False as compressed-tensors does.
    group_size:  G for GROUP granularity (elements along K per scale)
    block:       (rows, cols) tile for BLOCK granularity, e.g. (128, 128) for weights
    symmetric:   False: an int weight with a zero point per channel or group as well as a scale, so the
                 grid spans [min, max] of each group instead of [-amax, amax] (compressed-tensors'
                 ``symmetric: false``, its W4A16_ASYM; :func:`quantcore.formats.quantize.weight_zero_point`).
                 Only int formats with channel or group scales; activations are always symmetric.
    """

    format: str
    granularity: Granularity
    dynamic: bool = True
    group_size: int | None = None
    block: tuple[int, int] | None = None
    symmetric: bool = True

    def __post_init__(self) -> None:
        fmt = get_format(self.format)  # raises ValueError listing valid formats
        try:
            gran = Granularity(self.granularity)
        except ValueError:
            valid = ", ".join(g.value for g in Granularity)
            raise ValueError(f"unknown granularity {self.granularity!r}; use one of: {valid}") from None
        object.__setattr__(self, "granularity", gran)
        if self.block is not None:
            object.__setattr__(self, "block", tuple(self.block))
        if fmt.is_block:
            if gran is not Granularity.GROUP or self.group_size not in (None, fmt.block_size):
                raise ValueError(
                    f"{fmt.name} carries its own scale blocks of {fmt.block_size}: use "
                    f"granularity='group' with group_size={fmt.block_size} (or None)"
                )
            object.__setattr__(self, "group_size", fmt.block_size)
        if gran is Granularity.GROUP:
            if (
                not isinstance(self.group_size, int)
                or isinstance(self.group_size, bool)
                or self.group_size < 1
            ):
                raise ValueError(
                    f"granularity 'group' needs a positive integer group_size (e.g. 128), got {self.group_size!r}"
                )
        elif self.group_size is not None:
            raise ValueError(
                f"group_size={self.group_size} is only used with granularity 'group'; drop it or use 'group'"
            )
        if gran is Granularity.BLOCK:
            if (
                self.block is None
                or len(self.block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in self.block)
            ):
                raise ValueError(
                    f"granularity 'block' needs block=(rows, cols) of positive integers, e.g. (128, 128); got {self.block!r}"
                )
        elif self.block is not None:
            raise ValueError(
                f"block={self.block} is only used with granularity 'block'; drop it or use 'block'"
            )
        if not isinstance(self.symmetric, bool):
            raise ValueError(f"symmetric must be true or false, got {self.symmetric!r}")
        if not self.symmetric and (fmt.kind != "int" or gran not in (Granularity.CHANNEL, Granularity.GROUP)):
            raise ValueError(
                "asymmetric (zero-point) quantization is offered for int formats with 'channel' or 'group' scales, "
                f"not {fmt.name} with {gran.value!r} scales"
            )

    @property
    def bits(self) -> int:
        """Element bits of the format (8, 4)."""
        return get_format(self.format).bits

    @property
    def dynamic_over_k(self) -> bool:
        """A dynamic scale taken over every element of K (per tensor or per token), which a row-parallel layer's
        GPUs each take over their own share of K instead (quantcore.models.parallel.Parallelism.input_shards)."""
        return self.dynamic and self.granularity in (Granularity.TENSOR, Granularity.TOKEN)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict; :meth:`from_dict` inverts it. ``symmetric`` is written only when False, so a symmetric
        spec's dict (and every key derived from it) is what it was before zero points existed."""
        out = {
            "format": self.format,
            "granularity": self.granularity.value,
            "dynamic": self.dynamic,
            "group_size": self.group_size,
            "block": list(self.block) if self.block is not None else None,
        }
        if not self.symmetric:
            out["symmetric"] = False
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TensorSpec:
        """Build from :meth:`to_dict` output; unknown keys raise ValueError naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        extra = set(data) - known
        if extra:
            raise ValueError(f"unknown TensorSpec field(s) {sorted(extra)}; valid fields: {sorted(known)}")
        kwargs = dict(data)
        if kwargs.get("block") is not None:
            kwargs["block"] = tuple(kwargs["block"])
        return cls(**kwargs)

    def describe(self, *, show_static: bool = True) -> str:
        """Short text such as 'fp8_e4m3 per-channel' or 'int4 group 128' (' static' appended when static)."""
        gran = self.granularity
        if gran is Granularity.GROUP:
            where = f"group {self.group_size}"
        elif gran is Granularity.BLOCK:
            where = f"block {self.block[0]}x{self.block[1]}"
        else:
            where = f"per-{gran.value}"
        kind = " static" if show_static and not self.dynamic else ""
        asym = " asymmetric" if not self.symmetric else ""
        return f"{self.format} {where}{asym}{kind}"


@dataclass(frozen=True)
class Scheme:
    """Weight spec + activation spec (None: weight-only) + optional SmoothQuant α + weight rounding.

    A scheme with neither (``BF16``) leaves the layer unquantized. ``gptq``: the weights are rounded by
    GPTQ on calibration inputs (:mod:`quantcore.algorithms.gptq`, llm-compressor's ``GPTQModifier``) instead of to the
    nearest grid point; the format, the scales and so the checkpoint's layout are the same. ``awq``: before
    rounding to nearest, each input channel of a weight-only layer is scaled by a factor searched on
    calibration inputs and folded into the operator before it (:mod:`quantcore.algorithms.awq`, llm-compressor's
    ``AWQModifier``); the checkpoint's layout is again the same.
    """

    name: str
    weights: TensorSpec | None
    activations: TensorSpec | None
    smoothquant_alpha: float | None = None
    description: str = ""
    gptq: bool = False
    awq: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("a Scheme needs a non-empty name")
        if self.weights is None and self.activations is not None:
            raise ValueError(
                f"scheme {self.name!r} quantizes activations but not weights; activation-only schemes are not "
                "supported: add a weight spec"
            )
        if self.weights is not None and self.weights.granularity is Granularity.TOKEN:
            raise ValueError(
                f"scheme {self.name!r}: weights use 'channel' for one scale per output row, not 'token'"
            )
        if self.activations is not None and self.activations.granularity is Granularity.CHANNEL:
            raise ValueError(
                f"scheme {self.name!r}: activations use 'token' for one scale per row; a per-input-channel "
                "activation scale cannot be factored out of the GEMM (use SmoothQuant for channel outliers)"
            )
        acts = self.activations
        if acts is not None and not acts.symmetric:
            raise ValueError(
                f"scheme {self.name!r}: activations are quantized symmetrically; zero points are for weights"
            )
        if acts is not None and not acts.dynamic:
            fmt = get_format(acts.format)
            if fmt.is_block and fmt.scale == "e8m0":
                raise ValueError(
                    f"scheme {self.name!r}: {fmt.name} block scales are computed from each live block; "
                    "use dynamic=True for its activations"
                )
            if not fmt.is_block and acts.granularity is not Granularity.TENSOR:
                raise ValueError(
                    f"scheme {self.name!r}: a static (calibrated) activation scale is one amax per tensor; use "
                    f"granularity 'tensor' with dynamic=False, or dynamic=True for {acts.granularity.value!r} scales"
                )
        if not isinstance(self.gptq, bool):
            raise ValueError(f"scheme {self.name!r}: gptq must be true or false, got {self.gptq!r}")
        if self.gptq:
            why = gptq_unsupported(self.weights)
            if why:
                raise ValueError(f"scheme {self.name!r}: {why}")
        if not isinstance(self.awq, bool):
            raise ValueError(f"scheme {self.name!r}: awq must be true or false, got {self.awq!r}")
        if self.awq:
            why = awq_unsupported(self)
            if why:
                raise ValueError(f"scheme {self.name!r}: {why}")
        alpha = self.smoothquant_alpha
        if alpha is not None:
            if (
                isinstance(alpha, bool)
                or not isinstance(alpha, (int, float))
                or not 0.0 <= float(alpha) <= 1.0
            ):
                raise ValueError(
                    f"scheme {self.name!r}: smoothquant_alpha must be a number in [0, 1] (0.5 is usual), got {alpha!r}"
                )
            if self.activations is None:
                raise ValueError(
                    f"scheme {self.name!r}: SmoothQuant moves activation outliers into the weights and only helps "
                    "when activations are quantized; drop smoothquant_alpha or add an activation spec"
                )
            object.__setattr__(self, "smoothquant_alpha", float(alpha))

    @property
    def is_identity(self) -> bool:
        """Nothing is quantized (BF16)."""
        return self.weights is None and self.activations is None

    @property
    def weight_only(self) -> bool:
        """Weights quantized, activations left in 16 bits (W8A16, W4A16, NVFP4A16)."""
        return self.weights is not None and self.activations is None

    @property
    def weight_bits(self) -> int:
        """Element bits of the weights; 16 when they stay unquantized."""
        return self.weights.bits if self.weights is not None else IDENTITY_BITS

    @property
    def activation_bits(self) -> int:
        """Element bits of the activations; 16 when they stay unquantized."""
        return self.activations.bits if self.activations is not None else IDENTITY_BITS

    @property
    def int_weights(self) -> bool:
        """The weights are stored as integers (INT8, INT4): the formats whose grid changed in
        :data:`NUMERICS_INT_WEIGHT_GRID`."""
        return self.weights is not None and get_format(self.weights.format).kind == "int"

    @property
    def scaled_per_gpu_share(self) -> bool:
        """True when each GPU of a split row-parallel layer (o_proj, down_proj) takes the activation scale over its
        own share of the input: a dynamic per-tensor or per-token scale over K. Weight-only, static and group /
        block scales are the same on any number of GPUs."""
        return self.activations is not None and self.activations.dynamic_over_k

    @property
    def needs_hessians(self) -> bool:
        """True when applying the scheme needs GPTQ Hessians, i.e. forwards of calibration text."""
        return self.gptq and not self.is_identity

    @property
    def needs_awq(self) -> bool:
        """True when applying the scheme needs AWQ's searched factors, i.e. forwards of calibration text."""
        return self.awq and not self.is_identity

    @property
    def needs_calibration(self) -> bool:
        """True when applying the scheme needs calibration data: static activation scales or SmoothQuant."""
        static_acts = self.activations is not None and not self.activations.dynamic
        return static_acts or self.smoothquant_alpha is not None

    def with_alpha(self, alpha: float | None) -> Scheme:
        """A copy with SmoothQuant strength ``alpha`` (None removes smoothing); the name is kept."""
        return dataclasses.replace(self, smoothquant_alpha=alpha)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict (strings, numbers, lists, None); :meth:`from_dict` inverts it exactly."""
        return {
            "name": self.name,
            "weights": self.weights.to_dict() if self.weights is not None else None,
            "activations": self.activations.to_dict() if self.activations is not None else None,
            "smoothquant_alpha": self.smoothquant_alpha,
            "description": self.description,
            "gptq": self.gptq,
            "awq": self.awq,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Scheme:
        """Build from :meth:`to_dict` output; unknown keys raise ValueError naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        extra = set(data) - known
        if extra:
            raise ValueError(f"unknown Scheme field(s) {sorted(extra)}; valid fields: {sorted(known)}")
        if "name" not in data:
            raise ValueError("a Scheme dict needs a 'name'")
        weights = data.get("weights")
        acts = data.get("activations")
        return cls(
            name=data["name"],
            weights=TensorSpec.from_dict(weights) if weights is not None else None,
            activations=TensorSpec.from_dict(acts) if acts is not None else None,
            smoothquant_alpha=data.get("smoothquant_alpha"),
            description=data.get("description", ""),
            gptq=data.get("gptq", False),
            awq=data.get("awq", False),
        )

    def describe(self) -> str:
        """Short text such as 'W: fp8_e4m3 per-channel; A: fp8_e4m3 per-token'."""
        if self.is_identity:
            return "unquantized"
        parts = [f"W: {self.weights.describe(show_static=False)}"]
        parts.append(f"A: {self.activations.describe()}" if self.activations is not None else "A: 16-bit")
        if self.smoothquant_alpha is not None:
            parts.append(f"SmoothQuant α={self.smoothquant_alpha:g}")
        if self.gptq:
            parts.append("GPTQ")
        if self.awq:
            parts.append("AWQ")
        return "; ".join(parts)


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


def gptq_unsupported(spec: TensorSpec | None) -> str | None:
    """Why GPTQ cannot round weights of this spec, or None when it can (see :mod:`quantcore.algorithms.gptq`).

    GPTQ needs one fixed scale per weight element, known before it starts: the tensor, channel, group and
    block scales of the int and FP8 formats, and NVFP4's effective block scales (E4M3 block scale × fp32 tensor
    scale, from the original weight, as llm-compressor's GPTQ takes them from its observer). The MX formats are
    left out: quantplan emulates their power-of-two scales as a whole and has no GPTQ preset for them.
    """
    if spec is None:
        return "GPTQ rounds weights, and this scheme leaves them unquantized"
    fmt = get_format(spec.format)
    if fmt.is_block and fmt.name != "nvfp4":
        return f"GPTQ is not offered for {fmt.name}, whose power-of-two block scales quantplan emulates as a whole"
    return None


def awq_unsupported(scheme: Scheme) -> str | None:
    """Why AWQ cannot scale the layers of this scheme, or None when it can (see :mod:`quantcore.algorithms.awq`).

    AWQ protects salient input channels of weight-only layers whose weights are rounded to nearest with one
    scale per row or per group along K: INT8 / INT4 (W8A16, W4A16: what llm-compressor's AWQ examples and vLLM's
    Marlin kernels serve) and NVFP4 (NVFP4A16, its blocks of 16). A scheme that quantizes activations is
    SmoothQuant's case; GPTQ is the other way to round; a per-tensor scale would undo the per-channel scaling
    (llm-compressor refuses it).
    """
    if scheme.weights is None:
        return "AWQ scales weights before rounding them, and this scheme leaves them unquantized"
    if scheme.activations is not None:
        return ("AWQ is for weight-only schemes (W4A16, W8A16); for quantized activations use SmoothQuant "
                "(smoothquant_alpha)")
    if scheme.gptq:
        return "choose AWQ or GPTQ: they are two ways to round the same weights"
    if get_format(scheme.weights.format).kind != "int" and scheme.weights.format != "nvfp4":
        return f"AWQ is offered for integer and NVFP4 weights (int4, int8, nvfp4), not {scheme.weights.format}"
    if scheme.weights.granularity not in (Granularity.CHANNEL, Granularity.GROUP):
        return ("AWQ needs one weight scale per row or per group along K; "
                f"{scheme.weights.granularity.value} scales are not supported")
    return None


def _presets() -> dict[str, Scheme]:
    T, C, K, G, B = (
        Granularity.TENSOR,
        Granularity.CHANNEL,
        Granularity.TOKEN,
        Granularity.GROUP,
        Granularity.BLOCK,
    )
    fp8_w_tensor = TensorSpec("fp8_e4m3", T, dynamic=False)
    fp8_w_channel = TensorSpec("fp8_e4m3", C, dynamic=False)
    int8_w_channel = TensorSpec("int8", C, dynamic=False)
    int8_a_token = TensorSpec("int8", K)
    int8_a_tensor = TensorSpec("int8", T)
    int4_g128 = TensorSpec("int4", G, dynamic=False, group_size=W4_GROUP_SIZE)
    int4_g128_asym = dataclasses.replace(int4_g128, symmetric=False)
    # NVFP4 activations as compressed-tensors' NVFP4 preset has them (dynamic: local): the E4M3 block scales are
    # computed from each live block of 16, the fp32 tensor scale above them from the calibrated amax
    nvfp4_a = TensorSpec("nvfp4", G, dynamic=False)
    schemes = [
        Scheme(
            "FP8",
            fp8_w_tensor,
            TensorSpec("fp8_e4m3", T, dynamic=False),
            description="FP8 E4M3, per-tensor weights, static per-tensor activations (calibrated amax)",
        ),
        Scheme(
            "FP8_PER_TENSOR",
            fp8_w_tensor,
            TensorSpec("fp8_e4m3", T),
            description="FP8 E4M3, per-tensor weights, dynamic per-tensor activations",
        ),
        Scheme(
            "FP8_DYNAMIC",
            fp8_w_channel,
            TensorSpec("fp8_e4m3", K),
            description="FP8 E4M3, per-channel weights, dynamic per-token activations; no calibration",
        ),
        Scheme(
            "FP8_BLOCK",
            TensorSpec("fp8_e4m3", B, dynamic=False, block=FP8_BLOCK),
            TensorSpec("fp8_e4m3", G, group_size=FP8_ACT_GROUP),
            description="FP8 E4M3, 128x128 weight blocks, 1x128 dynamic activation groups (DeepSeek-V3)",
        ),
        Scheme(
            "FP8_E5M2",
            TensorSpec("fp8_e5m2", T, dynamic=False),
            TensorSpec("fp8_e5m2", T),
            description="FP8 E5M2, per-tensor weights, dynamic per-tensor activations (a training format; "
            "shown for comparison with FP8_PER_TENSOR)",
        ),
        Scheme(
            "INT8_PER_TENSOR",
            int8_w_channel,
            int8_a_tensor,
            description="INT8, per-channel weights, dynamic per-tensor activations",
        ),
        Scheme(
            "INT8_PER_TENSOR_SQ",
            int8_w_channel,
            int8_a_tensor,
            smoothquant_alpha=SQ_DEFAULT_ALPHA,
            description="INT8_PER_TENSOR after SmoothQuant (α = 0.5)",
        ),
        Scheme(
            "INT8_W8A8",
            int8_w_channel,
            int8_a_token,
            description="INT8, per-channel weights, dynamic per-token activations",
        ),
        Scheme(
            "INT8_W8A8_SQ",
            int8_w_channel,
            int8_a_token,
            smoothquant_alpha=SQ_DEFAULT_ALPHA,
            description="INT8_W8A8 after SmoothQuant (α = 0.5)",
        ),
        Scheme(
            "INT8_W8A8_GPTQ",
            int8_w_channel,
            int8_a_token,
            gptq=True,
            description="INT8_W8A8 with GPTQ-rounded weights",
        ),
        Scheme(
            "INT8_W8A8_SQ_GPTQ",
            int8_w_channel,
            int8_a_token,
            smoothquant_alpha=SQ_DEFAULT_ALPHA,
            gptq=True,
            description="INT8_W8A8 after SmoothQuant (α = 0.5), GPTQ-rounded weights: llm-compressor's W8A8 recipe",
        ),
        Scheme("W8A16", int8_w_channel, None, description="INT8 per-channel weights, 16-bit activations"),
        Scheme(
            "W8A16_GPTQ",
            int8_w_channel,
            None,
            gptq=True,
            description="W8A16 with GPTQ-rounded weights",
        ),
        Scheme(
            "W8A16_AWQ",
            int8_w_channel,
            None,
            awq=True,
            description="W8A16 with AWQ: input channels scaled by factors searched on calibration text, then "
            "rounded to nearest",
        ),
        Scheme(
            "W4A16",
            int4_g128,
            None,
            description="INT4 weights in groups of 128 along K, 16-bit activations (rounded to nearest)",
        ),
        Scheme(
            "W4A16_GPTQ",
            int4_g128,
            None,
            gptq=True,
            description="W4A16 with GPTQ-rounded weights: llm-compressor's W4A16 recipe",
        ),
        Scheme(
            "W4A16_AWQ",
            int4_g128,
            None,
            awq=True,
            description="W4A16 with AWQ: input channels scaled by factors searched on calibration text, then "
            "rounded to nearest (llm-compressor's AWQ recipe)",
        ),
        Scheme(
            "W4A16_ASYM",
            int4_g128_asym,
            None,
            description="INT4 weights in groups of 128 along K with a zero point per group, so each group's 16 "
            "levels span its own min..max; 16-bit activations (rounded to nearest; compressed-tensors' W4A16_ASYM)",
        ),
        Scheme(
            "W4A16_ASYM_GPTQ",
            int4_g128_asym,
            None,
            gptq=True,
            description="W4A16_ASYM with GPTQ-rounded weights",
        ),
        Scheme(
            "W4A16_ASYM_AWQ",
            int4_g128_asym,
            None,
            awq=True,
            description="W4A16_ASYM with AWQ: input channels scaled by factors searched on calibration text, then "
            "rounded to nearest (the scheme of llm-compressor's AWQ examples)",
        ),
        Scheme(
            "W4AFP8",
            int4_g128,
            TensorSpec("fp8_e4m3", K),
            description="INT4 weights in groups of 128 along K, FP8 E4M3 dynamic per-token activations: the 4-bit "
            "weight read of W4A16 with FP8 math (compressed-tensors' W4AFP8; vLLM's CUTLASS W4A8 kernel, Hopper)",
        ),
        Scheme(
            "W4AFP8_GPTQ",
            int4_g128,
            TensorSpec("fp8_e4m3", K),
            gptq=True,
            description="W4AFP8 with GPTQ-rounded weights: llm-compressor's W4AFP8 recipe",
        ),
        Scheme(
            "MXFP8",
            TensorSpec("mxfp8", G, dynamic=False),
            TensorSpec("mxfp8", G),
            description="OCP MXFP8: E4M3 with a power-of-two scale per 32, weights and activations",
        ),
        Scheme(
            "MXFP4",
            TensorSpec("mxfp4", G, dynamic=False),
            TensorSpec("mxfp4", G),
            description="OCP MXFP4: E2M1 with a power-of-two scale per 32, weights and activations",
        ),
        Scheme(
            "MXFP4A16",
            TensorSpec("mxfp4", G, dynamic=False),
            None,
            description="OCP MXFP4 weights (E2M1, a power-of-two scale per 32), 16-bit activations: gpt-oss's "
            "format and compressed-tensors' MXFP4A16; vLLM serves it with its FP4 Marlin kernel "
            "(CompressedTensorsW4A16Mxfp4, sm80+, bfloat16 activations)",
        ),
        Scheme(
            "NVFP4",
            TensorSpec("nvfp4", G, dynamic=False),
            nvfp4_a,
            description="NVFP4: E2M1, E4M3 scale per 16, fp32 tensor scale, weights and activations; the "
            "activations' tensor scale calibrated (llm-compressor's static_minmax), their block scales live",
        ),
        Scheme(
            "NVFP4_GPTQ",
            TensorSpec("nvfp4", G, dynamic=False),
            nvfp4_a,
            gptq=True,
            description="NVFP4 with GPTQ-rounded weights (the same block and tensor scales)",
        ),
        Scheme(
            "NVFP4A16",
            TensorSpec("nvfp4", G, dynamic=False),
            None,
            description="NVFP4 weights, 16-bit activations",
        ),
        Scheme(
            "NVFP4A16_GPTQ",
            TensorSpec("nvfp4", G, dynamic=False),
            None,
            gptq=True,
            description="NVFP4A16 with GPTQ-rounded weights (the same block and tensor scales)",
        ),
        Scheme(
            "NVFP4A16_AWQ",
            TensorSpec("nvfp4", G, dynamic=False),
            None,
            awq=True,
            description="NVFP4A16 with AWQ: input channels scaled by factors searched on calibration text, then "
            "rounded to nearest",
        ),
        Scheme("BF16", None, None, description="left unquantized"),
    ]
    at = next(i for i, s in enumerate(schemes) if s.name == "W4A16_ASYM_AWQ") + 1
    w4 = [s for s in schemes if s.name.startswith("W4A16")]
    schemes[at:at] = (_regrouped(w4, W4_SMALL_GROUP_SIZE) + _regrouped(w4, W4_TINY_GROUP_SIZE)
                      + _per_channel([s for s in w4 if s.weights.symmetric]))
    return {s.name: s for s in schemes}


def _per_channel(w4: list[Scheme]) -> list[Scheme]:
    """The symmetric W4A16 presets with one INT4 scale per output channel instead of per group, named
    ``W4A16_CHANNEL[_GPTQ|_AWQ]``: GPTQ's ``group_size: -1``, compressed-tensors' channel strategy. No group to
    divide K, so any K takes them, also one GPU's share of it under tensor parallelism, where no group fits
    (Qwen2.5-72B's down_proj at 8 GPUs: 3,696 inputs each); vLLM's Marlin serves them (group size -1)."""
    out = []
    for s in w4:
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


_PRESETS: dict[str, Scheme] = _presets()


def list_schemes() -> list[str]:
    """Names of every preset scheme, FP8 family first, BF16 last."""
    return list(_PRESETS)


def get_scheme(name: str | Scheme) -> Scheme:
    """The preset scheme called ``name`` (a Scheme passes through unchanged).

    Case-sensitive, like llm-compressor. Raises ValueError listing the valid names.
    """
    if isinstance(name, Scheme):
        return name
    try:
        return _PRESETS[name]
    except (KeyError, TypeError):
        hint = ""
        if isinstance(name, str) and name.upper() in _PRESETS:
            hint = f" (did you mean {name.upper()!r}? names are case-sensitive)"
        valid = ", ".join(_PRESETS)
        raise ValueError(f"unknown scheme {name!r}{hint}; valid schemes are: {valid}") from None


# ---------------------------------------------------------------- weight storage

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
        return n * -(-k // spec.group_size)
    if gran is Granularity.BLOCK:
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
        extra = GLOBAL_SCALE_BITS if fmt.name == "nvfp4" else 0
        return fmt.bits * n * k + BLOCK_SCALE_BITS[fmt.scale] * scales + extra
    # an asymmetric weight also stores a zero point per scale, packed at the weight's own width (compressed-tensors'
    # pack-quantized format: ``pack_to_int32(zero_point, num_bits)``)
    zero_points = 0 if spec.symmetric else fmt.bits * scales
    return fmt.bits * n * k + SCALE_BITS * scales + zero_points


# ---------------------------------------------------------------- fusion groups

# (leaf name pattern, group kind, canonical member order). A layer "a.b.q_proj" belongs to the
# group keyed by (its parent path "a.b", kind). Names follow Hugging Face transformers:
# Llama / Mistral / Qwen2 / Gemma / Gemma3 (q_proj, k_proj, v_proj; gate_proj, up_proj),
# Mixtral experts (w1 = gate, w3 = up) and BERT (attention.self.query / key / value).
_FUSION_RULES: tuple[tuple[re.Pattern[str], str, tuple[str, ...]], ...] = (
    (
        re.compile(r"^(?:(?P<parent>.*)\.)?(?P<leaf>q_proj|k_proj|v_proj)$"),
        "qkv",
        ("q_proj", "k_proj", "v_proj"),
    ),
    (re.compile(r"^(?:(?P<parent>.*)\.)?(?P<leaf>gate_proj|up_proj)$"), "gate_up", ("gate_proj", "up_proj")),
    (re.compile(r"^(?:(?P<parent>.*\.experts\.\d+)\.)(?P<leaf>w1|w3)$"), "w1_w3", ("w1", "w3")),
    (re.compile(r"^(?:(?P<parent>.*)\.)?(?P<leaf>query|key|value)$"), "bert_qkv", ("query", "key", "value")),
)


def _fusion_key(name: str) -> tuple[tuple[str, str], int] | None:
    """((parent path, group kind), member rank) of a layer name, or None if it fuses with nothing."""
    for pattern, kind, order in _FUSION_RULES:
        match = pattern.match(name)
        if match:
            return (match.group("parent") or "", kind), order.index(match.group("leaf"))
    return None


def fusion_groups(layer_names: Iterable[str]) -> list[list[str]]:
    """Groups of two or more layers that read the same input and are fused at serving time.

    Returns groups in order of first appearance, members in canonical order (q, k, v /
    gate, up). Layers that fuse with nothing are not listed; duplicates are ignored.

    >>> fusion_groups(["m.0.self_attn.q_proj", "m.0.self_attn.k_proj", "m.0.self_attn.v_proj", "m.0.self_attn.o_proj"])
    [['m.0.self_attn.q_proj', 'm.0.self_attn.k_proj', 'm.0.self_attn.v_proj']]
    """
    return [list(g) for g in _fusion_groups(tuple(layer_names))]


# A model's layer names are asked about again and again while a page draws (every check resolves the plan): the
# groups of the few models in play are kept. Names in, tuples out, so no caller can change what is kept.
_NAMES_CACHE = 16


@functools.lru_cache(maxsize=_NAMES_CACHE)
def _fusion_groups(layer_names: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    groups: dict[tuple[str, str], dict[str, int]] = {}
    for name in layer_names:
        keyed = _fusion_key(name)
        if keyed is None:
            continue
        key, rank = keyed
        groups.setdefault(key, {}).setdefault(name, rank)
    return tuple(tuple(sorted(members, key=lambda n, m=members: (m[n], n))) for members in groups.values()
                 if len(members) >= 2)


def fusion_group_of(name: str, layer_names: Iterable[str]) -> list[str]:
    """The fusion group containing ``name`` among ``layer_names``, or ``[name]`` if it fuses with nothing."""
    names = tuple(layer_names)
    index, known = _fusion_index(names)
    if name not in known:  # a name from elsewhere: the groups it would form with these
        index, _ = _fusion_index((*names, name))
    return list(index.get(name, (name,)))


@functools.lru_cache(maxsize=_NAMES_CACHE)
def _fusion_index(layer_names: tuple[str, ...]) -> tuple[dict[str, tuple[str, ...]], frozenset[str]]:
    """({member: its fusion group} of :func:`fusion_groups`, every name) of ``layer_names``."""
    return {m: g for g in _fusion_groups(layer_names) for m in g}, frozenset(layer_names)


# The routed experts of one MoE block (quantcore.models.moe names them <block>.experts.<e>.<gate|up|down>_proj, as
# llm-compressor does) are one fused MoE layer in vLLM, which quantizes every expert and projection of it with
# one method: a plan gives the whole block one scheme.
_EXPERT_RE = re.compile(r"^(?P<block>.*\.experts)\.\d+\.(?:gate_proj|up_proj|down_proj)$")


def expert_block(name: str) -> str | None:
    """The MoE block (``model.layers.3.mlp.experts``) whose routed expert ``name`` is, or None."""
    match = _EXPERT_RE.match(name)
    return match.group("block") if match else None


def expert_blocks(layer_names: Iterable[str]) -> dict[str, list[str]]:
    """{MoE block: its expert linears, in model order} of the routed experts among ``layer_names``."""
    return {block: list(names) for block, names in _expert_blocks(tuple(layer_names))}


@functools.lru_cache(maxsize=_NAMES_CACHE)
def _expert_blocks(layer_names: tuple[str, ...]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    blocks: dict[str, list[str]] = {}
    for name in dict.fromkeys(layer_names):
        block = expert_block(name)
        if block is not None:
            blocks.setdefault(block, []).append(name)
    return tuple((block, tuple(names)) for block, names in blocks.items())


def fusion_units(layer_names: Iterable[str]) -> list[list[str]]:
    """The units a plan is made of: every MoE block's experts, every fusion group, and every other layer
    alone, in model order (a unit sits at its first member's position)."""
    names = list(dict.fromkeys(layer_names))
    group_of: dict[str, list[str]] = {}
    for g in fusion_groups(names):
        for m in g:
            group_of[m] = g
    for g in expert_blocks(names).values():
        for m in g:
            group_of[m] = g
    units: list[list[str]] = []
    seen: set[str] = set()
    for n in names:
        if n in seen:
            continue
        unit = group_of.get(n, [n])
        seen.update(unit)
        units.append(list(unit))
    return units


def plan_unit_of(name: str, layer_names: Iterable[str]) -> list[str]:
    """The unit of :func:`fusion_units` holding ``name``: the layers that must share its scheme."""
    block = expert_block(name)
    names = tuple(layer_names)
    if block is not None:
        return list(dict(_expert_blocks(names)).get(block, (name,)))
    return fusion_group_of(name, names)
