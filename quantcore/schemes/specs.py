"""Quantization schemes: what happens to one linear layer's weight and input (torch-free).

A :class:`TensorSpec` says how one operand is quantized (format, scale granularity, dynamic
or static scale). A :class:`Scheme` pairs a weight spec with an activation spec (``None``:
weight-only) and an optional SmoothQuant strength α. A scheme's weight rounding
(:class:`Rounding`: to nearest, GPTQ or AWQ) picks the algorithm that rounds its weights
(:mod:`quantcore.algorithms.registry`). The presets are in :mod:`quantcore.schemes.presets`, fusion
groups in :mod:`quantcore.schemes.fusion`, storage sizes in :mod:`quantcore.schemes.storage`.


Granularity (:class:`quantcore.formats.granularity.Granularity`), for a weight W of shape (N, K) =
(out_features, in_features) and an activation X of shape (..., K) (leading dims = tokens); the scale shapes are those of
:func:`quantcore.formats.quantize.quantize`, tabled on :class:`~quantcore.formats.granularity.Granularity`.

For weights, "static" and "dynamic" make no difference: the scale is computed once from the
weight itself. For activations, static means one calibrated amax per tensor (a calibration
pass is needed); dynamic means a fresh scale on every forward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from quantcore.formats.catalog import get_format
from quantcore.formats.granularity import Granularity

IDENTITY_BITS = 16  # bits reported for an unquantized operand (bf16 / fp16)
# GPTQ as quantcore.algorithms.gptq runs it: llm-compressor 0.14's GPTQModifier defaults
GPTQ_BLOCK_SIZE = 128  # GPTQModifier.block_size: columns per lazy batch update
GPTQ_DAMPENING = 0.01  # GPTQModifier.dampening_frac: of mean(diag H), added to the diagonal
AWQ_N_GRID = 20  # AWQModifier.n_grid: candidate scales per mapping
AWQ_DUO_SCALING = True  # AWQModifier.duo_scaling: candidates from activation and weight means
GPTQ_ACTORDER = "static"  # GPTQModifier.actorder default (alias of "weight"): columns by descending diag(H)


class Rounding(str, Enum):  # noqa: UP042 - travels through UI, database and JSON as its value
    """How a scheme's weights are rounded onto their grid (the scales and the checkpoint's layout are the same).

    RTN: to the nearest grid point. GPTQ: column by column on calibration Hessians (:mod:`quantcore.algorithms.gptq`).
    AWQ: input channels scaled by factors searched on calibration inputs, then to nearest
    (:mod:`quantcore.algorithms.awq`). Each has its handler in :mod:`quantcore.algorithms.registry`.
    """

    RTN = "rtn"
    GPTQ = "gptq"
    AWQ = "awq"


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
                 ``symmetric: false``, its W4A16_ASYM; :func:`quantcore.formats.weights.weight_zero_point`).
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
                    "granularity 'block' needs block=(rows, cols) of positive integers, e.g. (128, 128); "
                    f"got {self.block!r}"
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
            assert self.block is not None  # validated at construction
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

    def weight_spec(self) -> TensorSpec:
        """``weights``, for code that handles quantized weights only; ValueError for a scheme that leaves them in
        16 bits (BF16), which such code must not be handed."""
        if self.weights is None:
            raise ValueError(f"scheme {self.name!r} leaves the weights unquantized; it has no weight spec")
        return self.weights

    def activation_spec(self) -> TensorSpec:
        """``activations``, for code that handles quantized activations only; ValueError for a weight-only or
        identity scheme, which such code must not be handed."""
        if self.activations is None:
            raise ValueError(f"scheme {self.name!r} leaves the activations unquantized; it has no activation spec")
        return self.activations

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
    def rounding(self) -> Rounding:
        """How the weights are rounded: :attr:`Rounding.GPTQ`, :attr:`Rounding.AWQ` or to nearest (``RTN``)."""
        if self.gptq:
            return Rounding.GPTQ
        if self.awq:
            return Rounding.AWQ
        return Rounding.RTN

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
        assert self.weights is not None  # activation-only schemes are refused at construction
        parts = [f"W: {self.weights.describe(show_static=False)}"]
        parts.append(f"A: {self.activations.describe()}" if self.activations is not None else "A: 16-bit")
        if self.smoothquant_alpha is not None:
            parts.append(f"SmoothQuant α={self.smoothquant_alpha:g}")
        if self.gptq:
            parts.append("GPTQ")
        if self.awq:
            parts.append("AWQ")
        return "; ".join(parts)


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


__all__ = [
    "AWQ_DUO_SCALING",
    "AWQ_N_GRID",
    "GPTQ_ACTORDER",
    "GPTQ_BLOCK_SIZE",
    "GPTQ_DAMPENING",
    "IDENTITY_BITS",
    "Granularity",
    "Rounding",
    "Scheme",
    "TensorSpec",
    "awq_unsupported",
    "gptq_unsupported",
]
