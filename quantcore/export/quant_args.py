"""compressed-tensors ``QuantizationArgs`` <-> quantplan's :class:`TensorSpec`, the presets of compressed-tensors, and
the constants the export targets share (torch-free).

Facts this module relies on (compressed-tensors 0.19.0 / llmcompressor 0.14.0.1, read in their sources, and vLLM's
compressed-tensors loader) are listed in the docstring of the :mod:`quantcore.export` package.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from quantcore.errors import PlanError
from quantcore.evaluation.kvcache import AUTO as KV_AUTO
from quantcore.evaluation.kvcache import KvCacheFormat, get_kv_format
from quantcore.formats.catalog import get_format
from quantcore.formats.granularity import Granularity
from quantcore.schemes.presets import get_scheme, list_schemes
from quantcore.schemes.specs import Scheme, TensorSpec

# ------------------------------------------------------------------ constants (compressed-tensors)

CT_QUANT_METHOD = "compressed-tensors"  # quantization_config["quant_method"]
CT_STATUS_COMPRESSED = "compressed"  # status of a checkpoint written by llm-compressor
E8M0_SCALE_DTYPE = "torch.uint8"  # compressed-tensors stores MX (E8M0) block scales as uint8
E4M3_SCALE_DTYPE = "torch.float8_e4m3fn"  # NVFP4 block scales
DYNAMIC_LOCAL = "local"  # DynamicType.LOCAL: block scales live, global scale calibrated (NVFP4)
FP4_BITS = 4
FP8_BITS = 8
NVFP4_GROUP = 16  # elements per NVFP4 scale
MX_GROUP = 32  # elements per MX scale

# CompressionFormat values, as compressed-tensors infers them for a Linear (first match wins:
# mxfp4 > mxfp8 > nvfp4 > int-quantized > pack-quantized > float-quantized > naive-quantized)
FORMAT_MXFP4 = "mxfp4-pack-quantized"
FORMAT_MXFP8 = "mxfp8-quantized"
FORMAT_NVFP4 = "nvfp4-pack-quantized"
FORMAT_INT = "int-quantized"  # INT weights with quantized activations (W8A8)
FORMAT_PACK = "pack-quantized"  # INT weights, 16-bit activations (W4A16, W8A16), packed into int32
FORMAT_FLOAT = "float-quantized"  # FP8 weights with FP8 activations
FORMAT_NAIVE = "naive-quantized"  # anything else with quantized weights
FORMAT_MIXED = "mixed-precision"  # several formats in one checkpoint

# llm-compressor / compressed-tensors kv_cache_scheme of quantplan's FP8 KV cache: E4M3, one static
# (calibrated) scale per layer for K and for V; vLLM reads the k_scale / v_scale it writes
KV_CACHE_FP8_ARGS: dict[str, Any] = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                                     "symmetric": True}
# FP8_ATTN_HEAD: the same with one scale per KV head (compressed-tensors' attn_head strategy: k_scale / v_scale of
# shape (kv heads, 1, 1)), which vLLM reads with its FlashAttention backend only
KV_CACHE_FP8_HEAD_ARGS: dict[str, Any] = {**KV_CACHE_FP8_ARGS, "strategy": "attn_head"}


# the QuantizationArgs fields that define a stored format (compressed-tensors)
CT_ARG_KEYS = (
    "num_bits",
    "type",
    "strategy",
    "group_size",
    "block_structure",
    "symmetric",
    "dynamic",
    "scale_dtype",
)
# keys a QuantizationArgs dict may carry that do not change the stored format
_ARG_KEYS_IGNORED = ("actorder", "observer", "observer_kwargs", "zp_dtype")
CT_SCHEME_KEYS = ("targets", "weights", "input_activations", "output_activations", "format")


# ------------------------------------------------------------------ quantization args


def _int_wnam(weight_bits: int, act_bits: int = 16) -> dict[str, Any]:
    """compressed-tensors' ``_int_wnam``: INT weights in groups of 128, INT per-token activations."""
    out: dict[str, Any] = {
        "weights": {
            "num_bits": weight_bits,
            "type": "int",
            "strategy": "group",
            "group_size": 128,
            "symmetric": True,
            "dynamic": False,
        },
        "input_activations": None,
    }
    if act_bits < 16:
        out["input_activations"] = {
            "num_bits": act_bits,
            "type": "int",
            "strategy": "token",
            "symmetric": True,
            "dynamic": True,
        }
    return out


def _fp(
    bits: int,
    strategy: str,
    *,
    dynamic: bool | str = False,
    group_size: int | None = None,
    block: list[int] | None = None,
    scale_dtype: str | None = None,
) -> dict[str, Any]:
    d: dict[str, Any] = {
        "num_bits": bits,
        "type": "float",
        "strategy": strategy,
        "symmetric": True,
        "dynamic": dynamic,
    }
    if group_size is not None:
        d["group_size"] = group_size
    if block is not None:
        d["block_structure"] = block
    if scale_dtype is not None:
        d["scale_dtype"] = scale_dtype
    return d


#: compressed-tensors 0.19.0 ``PRESET_SCHEMES`` (quant_scheme.py), as plain args. Observers are
#: left out (they change calibration, not the stored format). Checked against the real package by
#: tests/quantcore/export/test_llmcompressor.py.
CT_PRESETS: dict[str, dict[str, Any]] = {
    "UNQUANTIZED": {"weights": None, "input_activations": None},
    "W4A16_ASYM": {
        "weights": {
            "num_bits": 4,
            "type": "int",
            "strategy": "group",
            "group_size": 128,
            "symmetric": False,
            "dynamic": False,
        },
        "input_activations": None,
    },
    "W8A8": {
        "weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True, "dynamic": False},
        "input_activations": {
            "num_bits": 8,
            "type": "int",
            "strategy": "token",
            "symmetric": True,
            "dynamic": True,
        },
    },
    "W4AFP8": {"weights": _int_wnam(4)["weights"], "input_activations": _fp(8, "token", dynamic=True)},
    "FP8": {"weights": _fp(8, "tensor"), "input_activations": _fp(8, "tensor")},
    "FP8_DYNAMIC": {"weights": _fp(8, "channel"), "input_activations": _fp(8, "token", dynamic=True)},
    "FP8_BLOCK": {
        "weights": _fp(8, "block", block=[128, 128]),
        "input_activations": _fp(8, "group", dynamic=True, group_size=128),
    },
    "NVFP4A16": {
        "weights": _fp(4, "tensor_group", group_size=16, scale_dtype=E4M3_SCALE_DTYPE),
        "input_activations": None,
    },
    "NVFP4": {
        "weights": _fp(4, "tensor_group", group_size=16, scale_dtype=E4M3_SCALE_DTYPE),
        "input_activations": _fp(
            4, "tensor_group", dynamic=DYNAMIC_LOCAL, group_size=16, scale_dtype=E4M3_SCALE_DTYPE
        ),
    },
    "MXFP4A16": {
        "weights": _fp(4, "group", group_size=32, scale_dtype=E8M0_SCALE_DTYPE),
        "input_activations": None,
    },
    "MXFP4": {
        "weights": _fp(4, "group", group_size=32, scale_dtype=E8M0_SCALE_DTYPE),
        "input_activations": _fp(4, "group", dynamic=True, group_size=32, scale_dtype=E8M0_SCALE_DTYPE),
    },
    "MXFP8A16": {
        "weights": _fp(8, "group", group_size=32, scale_dtype=E8M0_SCALE_DTYPE),
        "input_activations": None,
    },
    "MXFP8": {
        "weights": _fp(8, "group", group_size=32, scale_dtype=E8M0_SCALE_DTYPE),
        "input_activations": _fp(8, "group", dynamic=True, group_size=32, scale_dtype=E8M0_SCALE_DTYPE),
    },
    **{
        f"W{w}A{a}": _int_wnam(w, a)
        for w, a in (
            (2, 4),
            (2, 8),
            (2, 16),
            (3, 4),
            (3, 8),
            (3, 16),
            (4, 4),
            (4, 8),
            (4, 16),
            (5, 8),
            (5, 16),
            (6, 8),
            (6, 16),
            (7, 8),
            (7, 16),
            (8, 16),
        )
    },
}
CT_PRESETS["INT8"] = CT_PRESETS["W8A8"]  # alias in PRESET_SCHEMES
# Preferred name when several preset names carry the same args (the alias loses).
_CT_PRESET_ALIASES = {"INT8": "W8A8"}


def _norm_dtype(value: Any) -> str | None:
    if value is None:
        return None
    text = str(value)
    return text if text.startswith("torch.") else f"torch.{text}"


def _args_key(args: Mapping[str, Any] | None) -> tuple[Any, ...] | None:
    """Canonical comparable form of a QuantizationArgs dict (format-relevant fields only)."""
    if args is None:
        return None
    strategy = args.get("strategy")
    group_size = args.get("group_size")
    if strategy is None:  # compressed-tensors infers it from group_size
        strategy = "tensor" if group_size is None else ("channel" if group_size == -1 else "group")
    if strategy == "channel" and group_size == -1:
        group_size = None
    block = args.get("block_structure")
    if isinstance(block, str):
        block = [int(x) for x in block.split("x")]
    dynamic = args.get("dynamic", False)
    if isinstance(dynamic, str):
        dynamic = dynamic.lower()
    return (
        int(args.get("num_bits", 8)),
        str(args.get("type", "int")).lower(),
        str(strategy).lower(),
        group_size,
        tuple(block) if block is not None else None,
        bool(args.get("symmetric", True)),
        dynamic,
        _norm_dtype(args.get("scale_dtype")),
    )


def scheme_args_key(weights: Mapping[str, Any] | None, acts: Mapping[str, Any] | None) -> tuple[Any, Any]:
    return (_args_key(weights), _args_key(acts))


CT_PRESET_BY_KEY: dict[tuple[Any, Any], str] = {}
for _name, _preset in CT_PRESETS.items():
    CT_PRESET_BY_KEY.setdefault(
        scheme_args_key(_preset["weights"], _preset["input_activations"]),
        _CT_PRESET_ALIASES.get(_name, _name),
    )


def kv_cache_scheme(kv: str | KvCacheFormat | None) -> dict[str, Any] | None:
    """The ``kv_cache_scheme`` llm-compressor needs for a KV cache format: the FP8 args for the calibrated
    formats (their scales live in the checkpoint; per KV head for ``FP8_ATTN_HEAD``), None for the others
    (AUTO quantizes nothing; the unscaled formats are a vLLM flag alone)."""
    kvf = get_kv_format(kv)
    if not kvf.calibrated:
        return None
    return dict(KV_CACHE_FP8_HEAD_ARGS if kvf.per_head else KV_CACHE_FP8_ARGS)


def kv_cache_from_args(args: Any, where: str, problems: list[str]) -> str:
    """The KV cache format a ``kv_cache_scheme`` stands for: AUTO when absent, FP8 for static per-tensor
    FP8 E4M3, FP8_ATTN_HEAD for static per-head FP8 E4M3 (only FlashAttention 3 reads those, and it runs
    attention in FP8); anything else is a problem (and AUTO is returned)."""
    if args is None:
        return KV_AUTO
    if not isinstance(args, Mapping):
        problems.append(f"{where}: kv_cache_scheme must be a mapping of QuantizationArgs, got {args!r}")
        return KV_AUTO
    for name, known in (("FP8", KV_CACHE_FP8_ARGS), ("FP8_ATTN_HEAD", KV_CACHE_FP8_HEAD_ARGS)):
        try:
            if _args_key(args) == _args_key(known):
                return name
        except (TypeError, ValueError):
            break
    problems.append(
        f"{where}: kv_cache_scheme {dict(args)!r} is not one quantplan represents; it plans the KV cache as "
        f"FP8 with static per-tensor scales ({KV_CACHE_FP8_ARGS}) or per-head ones (strategy attn_head), "
        "or leaves it unquantized"
    )
    return KV_AUTO


def _spec_to_args(spec: TensorSpec, role: str) -> tuple[dict[str, Any] | None, str | None]:
    """(QuantizationArgs dict, None) for one operand, or (None, reason it cannot be expressed)."""
    fmt = get_format(spec.format)
    gran = spec.granularity
    weights = role == "weights"
    if fmt.name == "fp8_e5m2":
        return None, (
            "FP8 E5M2 cannot be expressed: compressed-tensors' 8-bit float type is E4M3 only "
            "(FP8_E4M3_DATA); use an E4M3 scheme such as FP8_PER_TENSOR or FP8_DYNAMIC"
        )
    if fmt.name == "fp4_e2m1":
        return None, (
            "plain FP4 E2M1 without block scales cannot be expressed: compressed-tensors stores 4-bit "
            "floats only as NVFP4 (16-element E4M3 scales) or MXFP4 (32-element E8M0 scales); use NVFP4 "
            "or MXFP4"
        )
    if not weights and gran is Granularity.BLOCK:
        return None, (
            "2-D block activation scales cannot be expressed: compressed-tensors quantizes activations "
            "per tensor, token or group (use granularity 'group', e.g. 1x128 as in FP8_BLOCK)"
        )
    dynamic: bool | str = False if weights else bool(spec.dynamic)
    if fmt.name == "nvfp4":
        if not weights and spec.dynamic:
            return None, (
                "NVFP4 activations with a dynamic fp32 tensor scale cannot be expressed: compressed-tensors' NVFP4 "
                "calibrates that scale and computes only the block scales live (dynamic: local); use dynamic=False"
            )
        if not weights:
            dynamic = DYNAMIC_LOCAL  # llm-compressor calibrates the fp32 tensor scale, block scales are live
        return _fp(
            FP4_BITS, "tensor_group", dynamic=dynamic, group_size=NVFP4_GROUP, scale_dtype=E4M3_SCALE_DTYPE
        ), None
    if fmt.name in ("mxfp4", "mxfp8"):
        return _fp(
            fmt.bits, "group", dynamic=dynamic, group_size=MX_GROUP, scale_dtype=E8M0_SCALE_DTYPE
        ), None
    args: dict[str, Any] = {
        "num_bits": fmt.bits,
        "type": "float" if fmt.kind == "float" else "int",
        "strategy": gran.value,
        "symmetric": spec.symmetric,
        "dynamic": dynamic,
    }
    if gran is Granularity.GROUP:
        args["group_size"] = spec.group_size
    if gran is Granularity.BLOCK and spec.block is not None:  # validated at construction
        args["block_structure"] = list(spec.block)
    return args, None


def _args_to_spec(args: Mapping[str, Any], role: str) -> tuple[TensorSpec | None, str | None]:
    """(TensorSpec, None) for a QuantizationArgs dict, or (None, reason quantplan cannot represent it)."""
    unknown = [k for k in args if k not in CT_ARG_KEYS and k not in _ARG_KEYS_IGNORED]
    if unknown:
        return (
            None,
            f"unknown QuantizationArgs field(s) {unknown}; valid: {list(CT_ARG_KEYS + _ARG_KEYS_IGNORED)}",
        )
    try:
        bits, qtype, strategy, group_size, block, symmetric, dynamic, scale_dtype = _args_key(args) or ()
    except (TypeError, ValueError) as exc:
        return None, f"malformed QuantizationArgs {dict(args)!r}: {exc}"
    weights = role == "weights"
    if not symmetric and not (weights and qtype == "int" and bits in (8, 4) and strategy in ("channel", "group")):
        return None, ("asymmetric (zero-point) quantization: quantplan plans it for int weights with channel or group "
                      f"scales (W4A16_ASYM), not {bits}-bit {qtype} {role} with strategy {strategy!r}")
    # "local" (NVFP4 activations): the block scales are live, the fp32 tensor scale is calibrated, as a static
    # nvfp4 TensorSpec has it
    live = False if weights else dynamic is True
    if qtype == "float" and bits == FP4_BITS:
        if group_size == NVFP4_GROUP and strategy in ("tensor_group", "group"):
            fmt = "nvfp4"
        elif group_size == MX_GROUP and strategy == "group":
            fmt = "mxfp4"
        else:
            return None, (
                f"4-bit float with strategy {strategy!r}, group_size {group_size}: quantplan knows NVFP4 "
                f"(tensor_group, {NVFP4_GROUP}) and MXFP4 (group, {MX_GROUP})"
            )
        return _make_spec(fmt, Granularity.GROUP, live, group_size=group_size)
    if qtype == "float" and bits == FP8_BITS:
        if scale_dtype == E8M0_SCALE_DTYPE:
            if strategy == "group" and group_size == MX_GROUP:
                return _make_spec("mxfp8", Granularity.GROUP, live, group_size=group_size)
            return (
                None,
                f"8-bit float with E8M0 scales needs strategy 'group' and group_size {MX_GROUP} (MXFP8)",
            )
        fmt = "fp8_e4m3"
    elif qtype == "int" and bits in (8, 4):
        fmt = f"int{bits}"
    else:
        return (
            None,
            f"{bits}-bit {qtype}: quantplan's formats are FP8 E4M3, INT8, INT4, NVFP4, MXFP4 and MXFP8",
        )
    if strategy == "tensor_group":
        return None, "strategy 'tensor_group' is only used by NVFP4 (4-bit float, group 16)"
    if strategy == "attn_head":
        return (
            None,
            "strategy 'attn_head' (per attention head) is not a linear-layer granularity quantplan plans",
        )
    try:
        gran = Granularity(strategy)
    except ValueError:
        return None, f"unknown strategy {strategy!r}"
    return _make_spec(
        fmt,
        gran,
        live,
        group_size=group_size if gran is Granularity.GROUP else None,
        block=block if gran is Granularity.BLOCK else None,
        symmetric=symmetric,
    )


def _make_spec(
    fmt: str,
    gran: Granularity,
    dynamic: bool,
    *,
    group_size: int | None = None,
    block: tuple[int, int] | None = None,
    symmetric: bool = True,
) -> tuple[TensorSpec | None, str | None]:
    try:
        return TensorSpec(fmt, gran, dynamic=dynamic, group_size=group_size, block=block,
                          symmetric=symmetric), None
    except ValueError as exc:
        return None, str(exc)


def scheme_args(scheme: Scheme) -> tuple[dict[str, Any] | None, dict[str, Any] | None, list[str]]:
    """(weights args, input_activations args, reasons it cannot be expressed)."""
    problems: list[str] = []
    w = a = None
    if scheme.weights is not None:
        w, why = _spec_to_args(scheme.weights, "weights")
        if why:
            problems.append(f"weights: {why}")
    if scheme.activations is not None:
        a, why = _spec_to_args(scheme.activations, "activations")
        if why and not any(why in p for p in problems):  # E5M2 / FP4 give one reason for both operands
            problems.append(f"activations: {why}")
    return w, a, problems


def ct_preset_name(scheme: Scheme | str) -> str | None:
    """The compressed-tensors / llm-compressor preset name whose args equal ``scheme``'s, or None.

    Matched by arguments, not by name (``INT8_W8A8`` -> ``"W8A8"``; quantplan's per-channel
    ``W8A16`` -> None, since compressed-tensors' ``W8A16`` uses groups of 128). The
    SmoothQuant alpha is not part of the preset (it becomes a SmoothQuantModifier).
    """
    s = get_scheme(scheme) if isinstance(scheme, str) else scheme
    if s.is_identity:
        return None
    w, a, problems = scheme_args(s)
    if problems:
        return None
    return CT_PRESET_BY_KEY.get(scheme_args_key(w, a))


def ct_args(scheme: Scheme | str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(weights, input_activations) QuantizationArgs dicts of ``scheme``; PlanError when inexpressible.

    BF16 gives ``(None, None)``. The SmoothQuant alpha is not part of the args.
    """
    s = get_scheme(scheme) if isinstance(scheme, str) else scheme
    w, a, problems = scheme_args(s)
    if problems:
        raise PlanError(f"scheme {s.name} cannot be written for compressed-tensors: {'; '.join(problems)}")
    return w, a


def scheme_from_ct_args(
    weights: Mapping[str, Any] | None,
    input_activations: Mapping[str, Any] | None,
    *,
    alpha: float | None = None,
    gptq: bool = False,
    awq: bool = False,
) -> Scheme:
    """The quantplan preset quantizing like these QuantizationArgs (``alpha``: SmoothQuant strength; ``gptq``:
    from a GPTQModifier, so the ``*_GPTQ`` preset where there is one; ``awq``: an AWQModifier scales the layer,
    so the ``*_AWQ`` preset).

    Inverse of :func:`ct_args` for presets (``INT8_W8A8`` with an alpha -> ``INT8_W8A8_SQ``);
    PlanError when no preset matches.
    """
    problems: list[str] = []
    s = scheme_for(weights, input_activations, alpha, "these quantization args", problems, gptq, awq)
    if problems or s is None:
        raise PlanError("; ".join(problems))
    return s


def ct_format(weights: Mapping[str, Any] | None, acts: Mapping[str, Any] | None) -> str | None:
    """The CompressionFormat compressed-tensors infers for a Linear with these args (None: not quantized)."""
    if weights is None:
        return None
    bits, qtype = int(weights.get("num_bits", 8)), str(weights.get("type", "int"))
    group = weights.get("group_size")
    if qtype == "float" and bits == FP4_BITS and group == MX_GROUP:
        return FORMAT_MXFP4
    if (
        qtype == "float"
        and bits == FP8_BITS
        and group == MX_GROUP
        and _norm_dtype(weights.get("scale_dtype")) == E8M0_SCALE_DTYPE
    ):
        return FORMAT_MXFP8
    if qtype == "float" and bits == FP4_BITS and group == NVFP4_GROUP:
        return FORMAT_NVFP4
    if qtype == "int" and acts is not None:
        return FORMAT_INT
    if qtype == "int" and 1 <= bits <= 8 and (acts is None or acts.get("type") != "float"):
        return FORMAT_PACK
    if qtype == "float" and acts is not None:
        return FORMAT_FLOAT
    return FORMAT_NAIVE


def preset_schemes() -> dict[tuple[Any, Any], list[Scheme]]:
    """quantplan presets keyed by their (weights, activations) args; several share a key (X / X_SQ)."""
    out: dict[tuple[Any, Any], list[Scheme]] = {}
    for name in list_schemes():
        s = get_scheme(name)
        if s.is_identity:
            continue
        w, a, problems = scheme_args(s)
        if not problems:
            out.setdefault(scheme_args_key(w, a), []).append(s)
    return out


def scheme_for(
    weights: Mapping[str, Any] | None,
    acts: Mapping[str, Any] | None,
    alpha: float | None,
    where: str,
    problems: list[str],
    gptq: bool = False,
    awq: bool = False,
) -> Scheme | None:
    """The quantplan scheme for a config group's args and a SmoothQuant alpha (None after a problem).

    gptq: the group comes from a ``GPTQModifier``: the GPTQ preset of those args where quantplan has one
    (W4A16_GPTQ, ...), else the round-to-nearest one (FP8 formats have no GPTQ preset).
    awq: an ``AWQModifier`` scales the layer: the AWQ preset of those args (the ``*_AWQ`` presets); a problem
    where there is none.
    """
    if weights is None and acts is None:
        return get_scheme("BF16")
    specs: list[TensorSpec | None] = []
    for role, args in (("weights", weights), ("activations", acts)):
        if args is None:
            specs.append(None)
            continue
        if not isinstance(args, Mapping):
            problems.append(f"{where}: {role} must be a mapping of QuantizationArgs, got {args!r}")
            return None
        spec, why = _args_to_spec(args, role)
        if why:
            problems.append(f"{where}: {role}: {why}")
            return None
        specs.append(spec)
    w_args, why_w = _spec_to_args(specs[0], "weights") if specs[0] else (None, None)
    a_args, why_a = _spec_to_args(specs[1], "activations") if specs[1] else (None, None)
    candidates = preset_schemes().get(scheme_args_key(w_args, a_args), []) if not (why_w or why_a) else []
    if awq:
        found = [s for s in candidates if s.awq]
        if not found and candidates:
            problems.append(
                f"{where}: the AWQModifier scales these layers, but quantplan has AWQ only for "
                f"{', '.join(n for n in list_schemes() if get_scheme(n).awq)} (AWQ with GPTQ or with quantized "
                "activations is not planned); leave them out of its mappings"
            )
            return None
        candidates = found
    candidates = [s for s in candidates if s.gptq == gptq and s.awq == awq] or [
        s for s in candidates if not s.gptq and not s.awq]
    if not candidates:
        text = f"W: {specs[0].describe() if specs[0] else '16-bit'}; A: {specs[1].describe() if specs[1] else '16-bit'}"
        problems.append(
            f"{where}: no quantplan scheme quantizes like this ({text}); quantplan's schemes are: "
            f"{', '.join(list_schemes())}"
        )
        return None
    base = next((s for s in candidates if s.smoothquant_alpha is None), candidates[0])
    if alpha is None:
        return base
    if base.activations is None:
        problems.append(
            f"{where}: SmoothQuant covers it, but its scheme {base.name} quantizes no activations; "
            "remove it from the SmoothQuant mappings"
        )
        return None
    smoothed = next((s for s in candidates if s.smoothquant_alpha is not None), base)
    return smoothed if smoothed.smoothquant_alpha == alpha else smoothed.with_alpha(alpha)
