"""Export a resolved plan to serving tools, and import it back (torch-free).

Three targets, all describing the same thing — which quantization every linear layer gets:

- an **llm-compressor recipe** (YAML): a ``QuantizationModifier`` with a preset ``scheme``
  or explicit ``config_groups``, ``targets`` and an ``ignore`` list, preceded by one
  ``SmoothQuantModifier`` per SmoothQuant strength the plan uses;
- a **compressed-tensors** ``quantization_config`` (the JSON that llm-compressor writes into
  a compressed checkpoint's ``config.json`` and vLLM reads);
- the matching **vLLM** ``serve`` command line.

and the plan's KV cache format (:mod:`quantcore.evaluation.kvcache`): ``FP8`` and ``FP8_ATTN`` are a
``kv_cache_scheme`` (static per-tensor E4M3, calibrated, so the recipe needs calibration data; vLLM
reads the ``k_scale`` / ``v_scale`` it writes) plus ``--kv-cache-dtype fp8``, ``FP8_ATTN_HEAD`` the
same with ``strategy: attn_head`` (a scale per KV head, read by vLLM's FlashAttention backend only); ``FP8_UNSCALED``,
``FP8_ATTN_UNSCALED`` and ``FP8_E5M2`` are the vLLM flag alone (``fp8`` / ``fp8_e5m2``, scale 1.0).
Whether attention itself runs in FP8 (the ``FP8_ATTN`` formats) is vLLM's attention backend, not
the checkpoint: the vLLM command says which backend computes what the score emulated.

quantplan writes no attention config group (llm-compressor's way to calibrate a ``q_scale``):
with llmcompressor 0.14.0.1 its calibration context forces eager attention (``use_eager_attention``)
over compressed-tensors' hooked attention, so the query observer never runs and ``q_scale`` is saved
uninitialized (seen here on a tiny Llama: 0, 1.4e-19, 59711.6, with the warning "Attempted to
calibrate a module q without statistics"). Without a ``q_scale`` vLLM runs Q at 1.0, which is what
``FP8_ATTN`` emulates.

Facts this module relies on (compressed-tensors 0.19.0 / llmcompressor 0.14.0.1, read in
their sources, and vLLM's compressed-tensors loader):

- ``QuantizationArgs``: ``num_bits``, ``type`` ("int" | "float"), ``strategy`` ("tensor",
  "channel", "token", "group", "block", "tensor_group"), ``symmetric``, ``dynamic`` (bool,
  or "local" = block scales dynamic, global scale calibrated; NVFP4 activations),
  ``group_size``, ``block_structure`` ([rows, cols]), ``scale_dtype``. A float with
  ``num_bits: 8`` is always E4M3 (``FP8_E4M3_DATA``): **E5M2 cannot be expressed**.
  4-bit floats exist only block-scaled: NVFP4 (``tensor_group``, 16, E4M3 scales) and
  MXFP4 (``group``, 32, ``scale_dtype: torch.uint8`` = E8M0). MXFP8 is 8-bit float,
  ``group`` 32, ``torch.uint8`` scales. Activations cannot use ``block``.
- Preset names (``PRESET_SCHEMES``) and what they mean are in :data:`CT_PRESETS`. Two
  look alike but differ: compressed-tensors' ``W8A16`` is INT8 weights in *groups of
  128*, quantplan's ``W8A16`` is INT8 *per channel*; presets are therefore matched by
  their arguments, never by name.
- Target matching (``compressed_tensors.utils.match``): a target is an exact module
  name, a ``re:`` regular expression applied with ``re.match`` (anchored at the start
  only), or a class name such as ``Linear``. A module matched by several targets takes
  the first of: exact names, then regexes (sorted as strings), then class names.
- vLLM looks up a fused layer (``qkv_proj``, ``gate_up_proj``) by *class name before its
  shards' names*, so a plan with several config groups never uses the class target
  ``Linear`` (it would capture every fused layer); such plans target layers by name.

Layer names
    ``layer_names`` must be every ``nn.Linear`` of the model, ``lm_head`` included (the
    list :mod:`quantcore.evaluation.calibrate` and the sensitivity sweep use): a single-scheme
    export targets the class ``Linear`` and relies on ``ignore`` for the BF16 layers.

Import (``from_llmcompressor_recipe``, ``from_compressed_tensors_config``) gives each
layer the quantplan preset whose weight and activation specs match its config group,
with the SmoothQuant strength of the mapping that covers it. A smoothed layer gets the
``*_SQ`` preset when one exists (``INT8_W8A8_SQ``; alpha kept when it differs from 0.5),
otherwise its base preset with the alpha. Hence ``export → import`` returns the same
plan for every plan of presets (``INT8_W8A8`` given an alpha comes back as
``INT8_W8A8_SQ`` with that alpha: the same numerics under its canonical name).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from quantcore.errors import PlanError
from quantcore.errors import format_problems as _format
from quantcore.errors import name_list as _cut
from quantcore.evaluation.kvcache import AUTO as KV_AUTO
from quantcore.evaluation.kvcache import KvCacheFormat, get_kv_format, normalize_kv_skip
from quantcore.formats.catalog import get_format
from quantcore.planning.plans import TextDumper, group_label, is_w4afp8, scheme_label
from quantcore.schemes.specs import (
    AWQ_DUO_SCALING,
    AWQ_N_GRID,
    GPTQ_ACTORDER,
    GPTQ_BLOCK_SIZE,
    GPTQ_DAMPENING,
    Granularity,
    Scheme,
    TensorSpec,
    expert_block,
    expert_blocks,
    fusion_groups,
    get_scheme,
    list_schemes,
)

# ------------------------------------------------------------------ constants (compressed-tensors)

CT_QUANT_METHOD = "compressed-tensors"  # quantization_config["quant_method"]
CT_STATUS_COMPRESSED = "compressed"  # status of a checkpoint written by llm-compressor
LINEAR_CLASS = "Linear"  # class-name target matching every nn.Linear
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

# llm-compressor recipe layout: <stage>_stage -> <group>_modifiers -> {ModifierType: args}
RECIPE_STAGE = "quant_stage"
RECIPE_QUANT_GROUP = "quant_modifiers"
RECIPE_SMOOTH_GROUP = "smoothing_modifiers"  # "smoothing_<i>_modifiers" when several alphas
QUANT_MODIFIERS = ("QuantizationModifier", "GPTQModifier")  # GPTQ: same config, GPTQ-rounded weights
GPTQ_MODIFIER = QUANT_MODIFIERS[1]
# what quantcore.algorithms.gptq runs, written out so that a later llm-compressor default cannot change the recipe
GPTQ_RECIPE_ARGS = {"block_size": GPTQ_BLOCK_SIZE, "dampening_frac": GPTQ_DAMPENING, "actorder": GPTQ_ACTORDER}
AWQ_MODIFIER = "AWQModifier"  # llm-compressor 0.14: a transform before the quantization modifier that rounds
# what quantcore.algorithms.awq runs, written out so that a later llm-compressor default cannot change the recipe
AWQ_RECIPE_ARGS = {"duo_scaling": AWQ_DUO_SCALING, "n_grid": AWQ_N_GRID}
# AWQ mappings of Llama-style blocks (llm-compressor's default_mappings): leaf of the smooth layer (the norm's name
# for the MLP is mlp_norm), leaves of the balance layers, and the submodule that holds them
AWQ_KINDS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("input_layernorm", ("q_proj", "k_proj", "v_proj"), "self_attn"),
    ("v_proj", ("o_proj",), "self_attn"),
    ("<mlp_norm>", ("gate_proj", "up_proj"), "mlp"),
    ("up_proj", ("down_proj",), "mlp"),
)
SMOOTH_MODIFIER = "SmoothQuantModifier"
SQ_DEFAULT_STRENGTH = 0.5  # SmoothQuantModifier.smoothing_strength default

# SmoothQuant mappings for Llama-style models: [[balance layers], smooth layer]. The first two are
# llm-compressor's DEFAULT_SMOOTHQUANT_MAPPINGS (used when a recipe gives none); the third folds
# 1/s of down_proj's input into up_proj's output rows (exact: down's input is SiLU(gate) * up).
SQ_KIND_ATTN = "attn"
SQ_KIND_MLP = "mlp"
SQ_KIND_DOWN = "down"
SQ_LEAVES = {
    "q_proj": SQ_KIND_ATTN,
    "k_proj": SQ_KIND_ATTN,
    "v_proj": SQ_KIND_ATTN,
    "gate_proj": SQ_KIND_MLP,
    "up_proj": SQ_KIND_MLP,
    "down_proj": SQ_KIND_DOWN,
}
LLAMA_SQ_MAPPINGS: dict[str, list[Any]] = {
    SQ_KIND_ATTN: [["re:.*q_proj", "re:.*k_proj", "re:.*v_proj"], "re:.*input_layernorm"],
    SQ_KIND_MLP: [["re:.*gate_proj", "re:.*up_proj"], "re:.*post_attention_layernorm"],
    SQ_KIND_DOWN: [["re:.*down_proj"], "re:.*up_proj"],
}
MLP_NORM_LLAMA = "post_attention_layernorm"  # norm before the MLP: Llama, Mistral, Qwen2/3
MLP_NORM_GEMMA = "pre_feedforward_layernorm"  # Gemma2/Gemma3 (their post_attention_layernorm is not it)
MLP_NORMS = (MLP_NORM_LLAMA, MLP_NORM_GEMMA)
LLM_COMPRESSOR_DEFAULT_SQ_MAPPINGS = [LLAMA_SQ_MAPPINGS[SQ_KIND_ATTN], LLAMA_SQ_MAPPINGS[SQ_KIND_MLP]]

# vLLM
VLLM_ONLINE_FP8_SCHEME = "FP8_PER_TENSOR"  # `--quantization fp8`: E4M3 per-tensor weights, dynamic
#                                            per-tensor activations, every Linear except lm_head
VLLM_UNQUANTIZED_HEAD = "lm_head"  # vLLM's online FP8 never quantizes the output head
# llm-compressor / compressed-tensors kv_cache_scheme of quantplan's FP8 KV cache: E4M3, one static
# (calibrated) scale per layer for K and for V; vLLM reads the k_scale / v_scale it writes
KV_CACHE_FP8_ARGS: dict[str, Any] = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                                     "symmetric": True}
# FP8_ATTN_HEAD: the same with one scale per KV head (compressed-tensors' attn_head strategy: k_scale / v_scale of
# shape (kv heads, 1, 1)), which vLLM reads with its FlashAttention backend only
KV_CACHE_FP8_HEAD_ARGS: dict[str, Any] = {**KV_CACHE_FP8_ARGS, "strategy": "attn_head"}
DEFAULT_RECIPE_FILE = "recipe.yaml"
COMPRESSED_SUFFIX = "-quantplan"  # default output folder of the compression step: <model><suffix>

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
_SCHEME_KEYS = ("targets", "weights", "input_activations", "output_activations", "format")


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
#: tests/quantcore/test_llmcompressor.py.
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


def _scheme_args_key(weights: Mapping[str, Any] | None, acts: Mapping[str, Any] | None) -> tuple[Any, Any]:
    return (_args_key(weights), _args_key(acts))


_CT_PRESET_BY_KEY: dict[tuple[Any, Any], str] = {}
for _name, _preset in CT_PRESETS.items():
    _CT_PRESET_BY_KEY.setdefault(
        _scheme_args_key(_preset["weights"], _preset["input_activations"]),
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
    if gran is Granularity.BLOCK:
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
        bits, qtype, strategy, group_size, block, symmetric, dynamic, scale_dtype = _args_key(args)
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


def _scheme_args(scheme: Scheme) -> tuple[dict[str, Any] | None, dict[str, Any] | None, list[str]]:
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
    w, a, problems = _scheme_args(s)
    if problems:
        return None
    return _CT_PRESET_BY_KEY.get(_scheme_args_key(w, a))


def ct_args(scheme: Scheme | str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(weights, input_activations) QuantizationArgs dicts of ``scheme``; PlanError when inexpressible.

    BF16 gives ``(None, None)``. The SmoothQuant alpha is not part of the args.
    """
    s = get_scheme(scheme) if isinstance(scheme, str) else scheme
    w, a, problems = _scheme_args(s)
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
    s = _scheme_for(weights, input_activations, alpha, "these quantization args", problems, gptq, awq)
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


# ------------------------------------------------------------------ plan checks and grouping


@dataclass
class _Group:
    """Layers sharing one set of quantization args (one config group)."""

    weights: dict[str, Any] | None
    acts: dict[str, Any] | None
    layers: list[str]
    schemes: list[str]  # scheme names, in order of appearance
    gptq: bool = False  # its weights are GPTQ-rounded (only when grouped with split_gptq)

    @property
    def preset(self) -> str | None:
        return _CT_PRESET_BY_KEY.get(_scheme_args_key(self.weights, self.acts))

    @property
    def format(self) -> str | None:
        return ct_format(self.weights, self.acts)


def _as_plan(plan: Mapping[str, Scheme | str], layer_names: Sequence[str]) -> dict[str, Scheme]:
    """Check that ``plan`` gives every layer of ``layer_names`` (and nothing else) a scheme."""
    names = list(layer_names)
    problems: list[str] = []
    out: dict[str, Scheme] = {}
    for layer in names:
        if layer not in plan:
            continue
        s = plan[layer]
        if isinstance(s, str):
            try:
                s = get_scheme(s)
            except ValueError as exc:
                problems.append(f"layer {layer!r}: {exc}")
                continue
        out[layer] = s
    missing = [n for n in names if n not in plan]
    known = set(names)
    extra = [n for n in plan if n not in known]
    if missing:
        problems.append(
            f"layer(s) without a scheme: {_cut(missing)}; give every linear layer a scheme "
            "(resolve_plan does) or BF16 to leave it unquantized"
        )
    if extra:
        problems.append(f"plan names layer(s) the model does not have: {_cut(extra)}")
    if not names:
        problems.append("the model has no linear layers (layer_names is empty)")
    if problems:
        raise PlanError(_format("This plan cannot be exported", problems))
    return out


def _group_plan(
    plan: Mapping[str, Scheme], layer_names: Sequence[str], *, split_gptq: bool = False
) -> tuple[list[_Group], list[str]]:
    """Config groups (by quantization args; ``split_gptq``: and by GPTQ or round-to-nearest weights) and the
    BF16 layers; PlanError for what cannot be expressed."""
    problems: dict[str, list[str]] = {}
    groups: dict[tuple[Any, ...], _Group] = {}
    unquantized: list[str] = []
    for layer in layer_names:
        s = plan[layer]
        if s.is_identity:
            unquantized.append(layer)
            continue
        w, a, why = _scheme_args(s)
        if why:
            problems.setdefault(f"{s.name}: {'; '.join(why)}", []).append(layer)
            continue
        gptq = split_gptq and s.gptq
        g = groups.setdefault((*_scheme_args_key(w, a), gptq), _Group(w, a, [], [], gptq))
        g.layers.append(layer)
        if s.name not in g.schemes:
            g.schemes.append(s.name)
    msgs = [f"{reason} (layers: {_cut(layers)})" for reason, layers in problems.items()]
    for members in fusion_groups(layer_names):
        labels = {scheme_label(plan[m]) for m in members}
        if len(labels) > 1:
            msgs.append(
                f"fusion group {group_label(members)} mixes schemes "
                f"({', '.join(f'{m}={scheme_label(plan[m])}' for m in members)}); a serving engine runs it as "
                "one GEMM: give its members one scheme"
            )
    if msgs:
        raise PlanError(_format("This plan cannot be written for llm-compressor / compressed-tensors", msgs))
    return list(groups.values()), unquantized


# ------------------------------------------------------------------ target patterns

_NUM_PART = re.compile(r"^\d+$")


def _template(name: str) -> tuple[str, str, str] | None:
    """(prefix, index, suffix) around the first all-digit path component, or None."""
    parts = name.split(".")
    for i, p in enumerate(parts):
        if _NUM_PART.match(p) and 0 < i < len(parts) - 1:
            return ".".join(parts[:i]), p, ".".join(parts[i + 1 :])
    return None


def _re_matches(pattern: str, name: str) -> bool:
    """compressed-tensors' name matching: exact, or ``re:`` with ``re.match``."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == name


def compact_targets(members: Sequence[str], universe: Sequence[str]) -> list[str]:
    """Target strings that match exactly ``members`` among ``universe`` (compressed-tensors matching).

    Layers repeated across decoder blocks collapse into one ``re:`` pattern: the leaf name
    (``re:.*\\.down_proj$``) when every such layer is a member, a block-index alternation
    (``re:model\\.layers\\.(?:0|5)\\.mlp\\.down_proj$``) when only some are; the routed experts of whole
    MoE blocks into one pattern over every expert (``re:.*\\.experts\\.\\d+\\.(?:down_proj|gate_proj|up_proj)$``)
    or over some blocks; anything else is listed by its exact name. Every pattern is checked against ``universe``.
    """
    member_set = set(members)
    universe = list(universe)
    covered: set[str] = set()
    out: list[str] = []

    def ok(pattern: str) -> set[str] | None:
        hits = {u for u in universe if _re_matches(pattern, u)}
        return hits if hits and hits <= member_set else None

    # the routed experts of MoE blocks (a plan gives a block's experts one scheme): one pattern for the blocks
    blocks = {block: layers for block, layers in expert_blocks(universe).items() if set(layers) <= member_set}
    if blocks:
        leaves = "|".join(sorted({m.rsplit(".", 1)[-1] for b in blocks.values() for m in b}))
        names = {m for b in blocks.values() for m in b}
        templates = {_template(block) for block in blocks}
        candidates = [f"re:.*\\.experts\\.\\d+\\.(?:{leaves})$"]
        if len({(t[0], t[2]) for t in templates if t is not None}) == 1 and None not in templates:
            prefix, _, suffix = next(iter(templates))
            idx = "|".join(t[1] for t in sorted(templates, key=lambda t: int(t[1])))
            candidates.append(f"re:{re.escape(prefix)}\\.(?:{idx})\\.{re.escape(suffix)}\\.\\d+\\.(?:{leaves})$")
        for pattern in candidates:
            hits = ok(pattern)
            if hits is not None and names <= hits:
                out.append(pattern)
                covered |= hits
                break

    by_template: dict[tuple[str, str], list[str]] = {}
    for u in universe:
        t = _template(u)
        if t is not None:
            by_template.setdefault((t[0], t[2]), []).append(u)
    for name in members:
        if name in covered:
            continue
        t = _template(name)
        if t is None:
            out.append(name)
            covered.add(name)
            continue
        prefix, _, suffix = t
        same = by_template[(prefix, suffix)]
        chosen = [m for m in same if m in member_set]
        candidates: list[str] = []
        if len(chosen) == len(same):
            leaf = suffix.rsplit(".", 1)[-1]
            candidates += [
                f"re:.*\\.{re.escape(leaf)}$",
                f"re:.*\\.{re.escape(suffix)}$",
                f"re:{re.escape(prefix)}\\.\\d+\\.{re.escape(suffix)}$",
            ]
        if len(chosen) > 1:
            idx = "|".join(_template(m)[1] for m in chosen)
            candidates.append(f"re:{re.escape(prefix)}\\.(?:{idx})\\.{re.escape(suffix)}$")
        for pattern in candidates:
            hits = ok(pattern)
            if hits is not None and set(chosen) <= hits:
                out.append(pattern)
                covered |= hits
                break
        else:
            out.append(name)
            covered.add(name)
    return out


@dataclass(frozen=True)
class _Matcher:
    """Targets (or ignore entries) ready to match layer after layer: exact names in a set, so a config that lists
    thousands of experts by name matches in linear time."""

    exact: frozenset[str]
    patterns: tuple[str, ...]  # re: entries, sorted
    linear: bool  # the class name LINEAR_CLASS is among them

    @classmethod
    def of(cls, targets: Iterable[str]) -> _Matcher:
        targets = list(targets)
        return cls(frozenset(t for t in targets if not t.startswith("re:") and t != LINEAR_CLASS),
                   tuple(sorted(t for t in targets if t.startswith("re:"))), LINEAR_CLASS in targets)

    def first(self, layer: str) -> str | None:
        """The most specific target matching a linear layer (exact, then regex in sorted order, then the class),
        as compressed-tensors ranks them; None when none does."""
        if layer in self.exact:
            return layer
        hit = next((t for t in self.patterns if _re_matches(t, layer)), None)
        return hit if hit is not None else (LINEAR_CLASS if self.linear else None)


# ------------------------------------------------------------------ SmoothQuant mappings


def _smoothquant_layers(plan: Mapping[str, Scheme], layer_names: Sequence[str]) -> dict[float, list[str]]:
    """{alpha: layers smoothed with it}, in order of first appearance. A routed expert's gate/up is never
    smoothed (quantcore.algorithms.smoothquant folds nothing into them: the norm before them also feeds the router), so no
    mapping may name them, or llm-compressor would smooth what was scored unsmoothed; its down_proj is (into its
    own up_proj)."""
    out: dict[float, list[str]] = {}
    for layer in layer_names:
        a = plan[layer].smoothquant_alpha
        if a is not None and (expert_block(layer) is None or layer.endswith(".down_proj")):
            out.setdefault(float(a), []).append(layer)
    return out


def smoothquant_unmapped(layer: str) -> bool:
    """Whether the Llama-style SmoothQuant mappings of the recipes this module writes cannot smooth ``layer``: they
    smooth q/k/v_proj (into input_layernorm), gate/up_proj (into the MLP input norm) and down_proj (into up_proj),
    not o_proj (llm-compressor divides v_proj's rows by one scale per o_proj input channel, which breaks with
    grouped-query attention; quantplan ties the scales across each KV head group instead), nor lm_head."""
    return SQ_LEAVES.get(layer.rsplit(".", 1)[-1]) is None or len(layer.split(".")) < 3


def smoothquant_unexportable(plan: Mapping[str, Scheme | str]) -> list[str]:
    """The layers of ``plan`` (every layer, {layer: scheme}) whose SmoothQuant an llm-compressor recipe cannot carry
    (:func:`smoothquant_unmapped`), in plan order: a recipe of the plan is refused, and no served checkpoint holds
    the smoothing that was scored. A routed expert's gate/up counts for nothing (quantcore smooths none)."""
    resolved = {n: get_scheme(s) if isinstance(s, str) else s for n, s in plan.items()}
    return [n for layers in _smoothquant_layers(resolved, list(resolved)).values() for n in layers
            if smoothquant_unmapped(n)]


def smoothquant_unexportable_message(layers: Sequence[str]) -> str:
    """One sentence for :func:`smoothquant_unexportable`'s layers (the export's refusal, the Plans page's warning)."""
    why = (" (llm-compressor's SmoothQuantModifier divides v_proj rows by one scale per o_proj input channel, which "
           "breaks with grouped-query attention; quantplan ties the scales across each kv head group instead)"
           if any(n.endswith("o_proj") for n in layers) else "")
    return (f"SmoothQuant on {len(layers)} layer(s) the Llama-style mappings cannot smooth ({_cut(layers)}): they "
            f"smooth q/k/v_proj (into input_layernorm), gate/up_proj (into the MLP input norm) and down_proj (into "
            f"up_proj) only{why}; give those layers a scheme without SmoothQuant (e.g. INT8_W8A8 for INT8_W8A8_SQ) "
            "or pass smoothquant_mappings")


def _llama_mappings(
    smoothed: Sequence[str], layer_names: Sequence[str], mlp_norm: str = MLP_NORM_LLAMA
) -> tuple[list[list[Any]], list[str]]:
    """Llama-style SmoothQuant mappings covering exactly ``smoothed``; (mappings, problems)."""
    unmapped = [layer for layer in smoothed if smoothquant_unmapped(layer)]
    problems = [smoothquant_unexportable_message(unmapped)] if unmapped else []
    by_kind: dict[str, list[str]] = {}
    for layer in smoothed:
        if not smoothquant_unmapped(layer):
            by_kind.setdefault(SQ_LEAVES[layer.rsplit(".", 1)[-1]], []).append(layer)
    mappings: list[list[Any]] = []
    for kind in (SQ_KIND_ATTN, SQ_KIND_MLP, SQ_KIND_DOWN):
        members = by_kind.get(kind)
        if not members:
            continue
        all_of_kind = [n for n in layer_names if SQ_LEAVES.get(n.rsplit(".", 1)[-1]) == kind]
        if set(members) == set(all_of_kind):
            generic = LLAMA_SQ_MAPPINGS[kind]
            if kind == SQ_KIND_MLP:
                generic = [generic[0], f"re:.*{mlp_norm}"]
            mappings.append(generic)
            continue
        by_parent: dict[str, list[str]] = {}
        for m in members:
            by_parent.setdefault(m.rsplit(".", 1)[0], []).append(m)
        for parent, ms in by_parent.items():
            balance = [f"re:{re.escape(m)}$" for m in ms]
            if kind == SQ_KIND_DOWN:
                smooth = f"{parent}.up_proj"
            else:
                block = parent.rsplit(".", 1)[0]
                smooth = f"{block}.input_layernorm" if kind == SQ_KIND_ATTN else f"{block}.{mlp_norm}"
            mappings.append([balance, f"re:{re.escape(smooth)}$"])
    return mappings, problems


def _expand_mappings(mappings: Sequence[Any], layer_names: Sequence[str]) -> set[str]:
    """Linear layers named as balance layers by SmoothQuant ``mappings``."""
    out: set[str] = set()
    for mapping in mappings:
        if not isinstance(mapping, (list, tuple)) or len(mapping) != 2:
            raise PlanError(f"SmoothQuant mapping {mapping!r} must be [[balance layers...], smooth layer]")
        balance = mapping[0] if isinstance(mapping[0], (list, tuple)) else [mapping[0]]
        for pattern in balance:
            out |= {n for n in layer_names if _re_matches(str(pattern), n)}
    return out


# ------------------------------------------------------------------ AWQ mappings


def _awq_mappings(awq_layers: Sequence[str], layer_names: Sequence[str], mlp_norm: str) -> list[dict[str, Any]]:
    """AWQModifier mappings covering exactly the AWQ layers' folds: one per kind (q/k/v, o_proj, gate/up,
    down_proj), llm-compressor's own regexes when every block has AWQ there, else the blocks named."""
    chosen = set(awq_layers)
    out = []
    for smooth_leaf, leaves, sub in AWQ_KINDS:
        smooth_leaf = mlp_norm if smooth_leaf == "<mlp_norm>" else smooth_leaf
        blocks_all: list[str] = []
        blocks_awq: list[str] = []
        for n in layer_names:
            block, _, rest = n.rpartition(f".{sub}.")
            if rest == leaves[0] and block:
                blocks_all.append(block)
                if any(f"{block}.{sub}.{leaf}" in chosen for leaf in leaves):
                    blocks_awq.append(block)
        if not blocks_awq:
            continue
        smooth_at = sub + "." if smooth_leaf in ("v_proj", "up_proj") else ""
        if blocks_awq == blocks_all:
            prefix = ".*"
        else:
            prefix = "^(?:" + "|".join(re.escape(b) for b in blocks_awq) + ")\\."
        out.append({
            "smooth_layer": f"re:{prefix}{re.escape(smooth_at)}{smooth_leaf}$",
            "balance_layers": _Flow([f"re:{prefix}{sub}\\.{leaf}$" for leaf in leaves]),
        })
    # routed experts (a plan gives a block's experts one scheme): their gate/up into the norm before the block's
    # MLP, with its router (llm-compressor's MoE mapping), and each expert's down_proj into its own up_proj
    blocks_all = list(dict.fromkeys(b for n in layer_names if (b := expert_block(n))))
    blocks_awq = [b for b in blocks_all if b in {expert_block(n) for n in chosen}]
    if blocks_awq:
        if blocks_awq == blocks_all:
            experts, owner = ".*\\.experts", ".*"
        else:
            experts = "^(?:" + "|".join(re.escape(b) for b in blocks_awq) + ")"
            owner = "^(?:" + "|".join(re.escape(b.removesuffix(".mlp.experts")) for b in blocks_awq) + ")\\."
        out.append({"smooth_layer": f"re:{owner}{mlp_norm}$",
                    "balance_layers": _Flow([f"re:{owner}mlp\\.gate$", f"re:{experts}\\.\\d+\\.gate_proj$",
                                             f"re:{experts}\\.\\d+\\.up_proj$"])})
        out.append({"smooth_layer": f"re:{experts}\\.\\d+\\.up_proj$",
                    "balance_layers": _Flow([f"re:{experts}\\.\\d+\\.down_proj$"])})
    return out


def _awq_covered(mappings: Any, layer_names: Sequence[str], where: str, problems: list[str]) -> set[str]:
    """The linear layers an AWQModifier's ``mappings`` name as balance layers (None: llm-compressor's defaults)."""
    if mappings is None:
        mappings = _awq_mappings(layer_names, layer_names, MLP_NORM_LLAMA)
    out: set[str] = set()
    if not isinstance(mappings, (list, tuple)):
        problems.append(f"{where}: mappings must be a list of {{smooth_layer, balance_layers}}, got {mappings!r}")
        return out
    for m in mappings:
        balance = m.get("balance_layers") if isinstance(m, Mapping) else None
        if isinstance(balance, str):
            balance = [balance]
        if not isinstance(balance, (list, tuple)) or not isinstance(m.get("smooth_layer"), str):
            problems.append(f"{where}: mapping {m!r} needs smooth_layer (a name) and balance_layers (a list)")
            continue
        for pattern in balance:
            out |= {n for n in layer_names if _re_matches(str(pattern), n)}
    return out


# ------------------------------------------------------------------ export


class _Flow(list):
    """A list written in YAML flow style (``[a, b]``): keeps each SmoothQuant mapping on one line."""


class _RecipeDumper(TextDumper):
    """The plan files' dumper, writing :class:`_Flow` lists inline."""


_RecipeDumper.add_representer(
    _Flow, lambda dumper, data: dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True)
)


def _quant_modifier(
    groups: Sequence[_Group], unquantized: Sequence[str], layer_names: Sequence[str], *, every_quantized: bool = True
) -> dict[str, Any]:
    """One quantization modifier's arguments for ``groups``; ``every_quantized``: they hold every quantized layer
    of the plan, so a single group may target the class ``Linear`` (else each group names its layers)."""
    ignore = compact_targets(unquantized, layer_names)
    if len(groups) == 1 and every_quantized:
        g = groups[0]
        body: dict[str, Any] = {"targets": [LINEAR_CLASS]}
        if g.preset is not None:
            body["scheme"] = g.preset
        else:
            body = {"config_groups": {"group_0": _config_group(g, [LINEAR_CLASS])}}
        body["ignore"] = ignore
        return body
    if all(g.preset is not None for g in groups):
        return {
            "scheme": {g.preset: compact_targets(g.layers, layer_names) for g in groups},
            "ignore": ignore,
        }
    return {
        "config_groups": {
            f"group_{i}": _config_group(g, compact_targets(g.layers, layer_names))
            for i, g in enumerate(groups)
        },
        "ignore": ignore,
    }


def _config_group(g: _Group, targets: list[str], *, with_format: bool = False) -> dict[str, Any]:
    d: dict[str, Any] = {
        "targets": targets,
        "weights": dict(g.weights) if g.weights else None,
        "input_activations": dict(g.acts) if g.acts else None,
    }
    if with_format:
        d["output_activations"] = None
        d["format"] = g.format
    return d


def to_llmcompressor_recipe(
    plan: Mapping[str, Scheme | str],
    *,
    layer_names: Sequence[str],
    smoothquant_mappings: Sequence[Any] | None = None,
    mlp_norm: str = MLP_NORM_LLAMA,
    kv_cache: str | KvCacheFormat | None = None,
) -> str:
    """An llm-compressor recipe (YAML text) that quantizes the model as ``plan`` says.

    One ``QuantizationModifier``: ``scheme: <preset>`` with ``targets: [Linear]`` when every
    quantized layer shares one llm-compressor preset; ``scheme: {preset: targets}`` when every
    group is a preset; else explicit ``config_groups``. BF16 layers go to ``ignore``. Layers with
    GPTQ schemes (``W4A16_GPTQ``...) go to a ``GPTQModifier`` instead, written the same way; a plan
    with both gets both, the GPTQModifier first, each naming its own layers (llm-compressor runs
    them one after the other, so the round-to-nearest layers stay round-to-nearest). Layers
    with a SmoothQuant alpha get a ``SmoothQuantModifier`` per distinct alpha (its
    ``smoothing_strength``), placed before the quantization, with Llama-style mappings
    (q/k/v <- input_layernorm, gate/up <- post_attention_layernorm, down <- up_proj) limited
    to the smoothed layers, or ``smoothquant_mappings`` verbatim (one alpha only).
    ``mlp_norm`` names the norm before the MLP: ``post_attention_layernorm`` (Llama,
    Mistral, Qwen2) or ``pre_feedforward_layernorm`` (Gemma2/3, whose
    ``post_attention_layernorm`` sits after attention and must not be smoothed).
    ``kv_cache`` ``FP8`` adds ``kv_cache_scheme`` (static per-tensor E4M3, calibrated: the
    recipe then needs calibration data); the unscaled KV formats are a vLLM flag, not a recipe
    entry, and are named in the header.

    Raises PlanError for layers llm-compressor cannot express (FP8 E5M2, plain FP4, 2-D
    activation blocks), split fusion groups, and SmoothQuant on layers no mapping covers.
    """
    names = list(layer_names)
    if mlp_norm not in MLP_NORMS:
        raise PlanError(
            f"mlp_norm {mlp_norm!r} is not a known MLP input norm; use one of {', '.join(MLP_NORMS)}, or "
            "pass smoothquant_mappings"
        )
    resolved = _as_plan(plan, names)
    groups, unquantized = _group_plan(resolved, names, split_gptq=True)
    stage: dict[str, Any] = {}
    smooth = _smoothquant_layers(resolved, names)
    problems: list[str] = []
    if smooth and not groups:
        problems.append("SmoothQuant without any quantized layer")
    if smoothquant_mappings is not None and len(smooth) > 1:
        problems.append(
            f"custom smoothquant_mappings apply to one alpha, but the plan uses {sorted(smooth)}; give "
            "the smoothed layers one alpha"
        )
    for i, (alpha, layers) in enumerate(smooth.items()):
        if smoothquant_mappings is not None:
            mappings = [list(m) for m in smoothquant_mappings]
            covered = _expand_mappings(mappings, names)
            if covered != set(layers):
                problems.append(
                    f"smoothquant_mappings cover {_cut(sorted(covered - set(layers)) or ['(none extra)'])} beyond "
                    f"and miss {_cut(sorted(set(layers) - covered)) or '(none)'} of the layers smoothed with "
                    f"alpha {alpha:g}; make the mappings' balance layers exactly those layers"
                )
        else:
            mappings, why = _llama_mappings(layers, names, mlp_norm)
            problems += why
        group = RECIPE_SMOOTH_GROUP if len(smooth) == 1 else f"smoothing_{i}_modifiers"
        stage[group] = {
            SMOOTH_MODIFIER: {
                "smoothing_strength": alpha,
                "mappings": [_Flow([_Flow(m[0]), m[1]]) for m in mappings],
            }
        }
    if problems:
        raise PlanError(_format("This plan's SmoothQuant cannot be written for llm-compressor", problems))
    kv = get_kv_format(kv_cache)
    kv_args = kv_cache_scheme(kv)
    gptq = [n for n in names if resolved[n].gptq]
    awq = [n for n in names if resolved[n].needs_awq]
    rtn = [n for n in names if not resolved[n].gptq and not resolved[n].is_identity]
    if groups:
        # GPTQ layers go to a GPTQModifier, the others to a QuantizationModifier: llm-compressor (0.8+) runs
        # several modifiers one after the other (its "independent" pipeline), each on its own targets
        mods: dict[str, dict[str, Any]] = {}
        if awq:  # a transform: it scales, the QuantizationModifier after it rounds
            mods[AWQ_MODIFIER] = {**AWQ_RECIPE_ARGS, "mappings": _awq_mappings(awq, names, mlp_norm)}
        for mod_type, mine in ((GPTQ_MODIFIER, [g for g in groups if g.gptq]),
                               (QUANT_MODIFIERS[0], [g for g in groups if not g.gptq])):
            if mine:
                mods[mod_type] = _quant_modifier(mine, unquantized, names, every_quantized=len(mine) == len(groups))
        if gptq:
            mods[GPTQ_MODIFIER].update(GPTQ_RECIPE_ARGS)
        if kv_args is not None:
            mods[list(mods)[-1]]["kv_cache_scheme"] = kv_args
        stage[RECIPE_QUANT_GROUP] = mods
    elif kv_args is not None:
        stage[RECIPE_QUANT_GROUP] = {QUANT_MODIFIERS[0]: {"kv_cache_scheme": kv_args}}
    summary = ", ".join(f"{s} x{n}" for s, n in _scheme_counts(resolved).items())
    if not kv.is_identity:
        summary += f"; KV cache {kv.name}"
    header = (
        f"# quantplan plan export: llm-compressor recipe ({summary})\n"
        "# apply: from llmcompressor import oneshot; oneshot(model=..., recipe=<this file>, output_dir=...)\n"
    )
    if kv_args is not None:
        header += ("# the KV cache scales are calibrated: oneshot needs calibration data (dataset=..., "
                   "num_calibration_samples=...); serve with --kv-cache-dtype fp8\n")
        if kv.per_head:
            header += ("# one K and one V scale per KV head (strategy attn_head): vLLM reads them with its "
                       "FlashAttention backend only, whose FP8 path is FlashAttention 3 on Hopper\n")
        if kv.attention:
            header += ("# FP8 attention (Q at scale 1.0, softmax probabilities in E4M3) is what vLLM's FlashAttention 3 "
                       "backend does with that cache; nothing of it is in the recipe\n")
    elif not kv.is_identity:
        header += (f"# KV cache {kv.name} is not in the recipe: it is vLLM's --kv-cache-dtype {kv.vllm_dtype} "
                   "(scale 1.0)\n")
    if not groups and kv_args is None:
        header += "# every layer stays unquantized: there is nothing for llm-compressor to do\n"
    if gptq:
        header += ("# GPTQModifier rounds the weights with GPTQ on the calibration data: oneshot needs a dataset "
                   "(dataset=..., num_calibration_samples=...)\n")
    if awq:
        header += (f"# AWQModifier searches input scales for {len(awq)} layer(s) on the calibration data (oneshot needs a "
                   "dataset) and folds them into the norms and projections before them; the QuantizationModifier "
                   "then rounds to nearest\n")
    if gptq and rtn:
        header += (f"# two quantization modifiers, run one after the other: GPTQModifier rounds the {len(gptq)} GPTQ "
                   f"layer(s), QuantizationModifier the other {len(rtn)} to nearest, as scored\n")
    body = yaml.dump(
        {RECIPE_STAGE: stage},
        Dumper=_RecipeDumper,
        sort_keys=False,
        default_flow_style=None,
        width=100,
        allow_unicode=True,
    )
    return header + body


def to_compressed_tensors_config(
    plan: Mapping[str, Scheme | str], *, layer_names: Sequence[str], kv_cache: str | KvCacheFormat | None = None
) -> dict[str, Any]:
    """The compressed-tensors ``quantization_config`` of the checkpoint llm-compressor makes from ``plan``.

    JSON-able dict: ``quant_method``, ``format`` (one CompressionFormat or
    ``mixed-precision``), ``quantization_status: compressed``, ``config_groups`` (each with
    targets, weights, input_activations and its own ``format``), ``ignore`` (BF16 layers),
    ``kv_cache_scheme`` (the FP8 args for a calibrated FP8 KV cache, else None). SmoothQuant
    leaves no trace here: it is folded into the weights before quantization.
    """
    names = list(layer_names)
    resolved = _as_plan(plan, names)
    groups, unquantized = _group_plan(resolved, names)
    if len(groups) == 1:
        config_groups = {"group_0": _config_group(groups[0], [LINEAR_CLASS], with_format=True)}
    else:
        config_groups = {
            f"group_{i}": _config_group(g, compact_targets(g.layers, names), with_format=True)
            for i, g in enumerate(groups)
        }
    formats = {g.format for g in groups}
    fmt = "dense" if not formats else (formats.pop() if len(formats) == 1 else FORMAT_MIXED)
    return {
        "quant_method": CT_QUANT_METHOD,
        "format": fmt,
        "quantization_status": CT_STATUS_COMPRESSED,
        "config_groups": config_groups,
        "ignore": compact_targets(unquantized, names),
        "kv_cache_scheme": kv_cache_scheme(kv_cache),
        "global_compression_ratio": None,
    }


def serves_online_fp8(plan: Mapping[str, Scheme | str], layer_names: Sequence[str],
                      kv_cache: str | KvCacheFormat | None = None) -> bool:
    """True when vLLM applies the plan itself at load time (``--quantization fp8``): every layer but lm_head in
    FP8_PER_TENSOR, lm_head (if any) unquantized, and no calibrated KV cache scales to carry in a checkpoint."""
    online_fp8 = get_scheme(VLLM_ONLINE_FP8_SCHEME)
    body = [n for n in layer_names if n != VLLM_UNQUANTIZED_HEAD]
    return (not get_kv_format(kv_cache).calibrated and bool(body)
            and all(get_scheme(plan[n]) == online_fp8 for n in body)
            and all(get_scheme(plan[n]).is_identity for n in layer_names if n == VLLM_UNQUANTIZED_HEAD))


def to_vllm_command(
    plan: Mapping[str, Scheme | str],
    *,
    model_path: str,
    layer_names: Sequence[str],
    compressed_path: str | None = None,
    recipe_path: str = DEFAULT_RECIPE_FILE,
    kv_cache: str | KvCacheFormat | None = None,
    kv_skip: Sequence[str] = (),
    tensor_parallel: int = 1,
    expert_parallel: bool = False,
) -> str:
    """The ``vllm serve`` command line for ``plan``, with ``#`` comment lines that say how.

    - every layer but ``lm_head`` in ``FP8_PER_TENSOR``, ``lm_head`` (if any) BF16: vLLM's
      online dynamic FP8 is exactly that plan: ``vllm serve <model_path> --quantization fp8``;
    - every layer BF16: ``vllm serve <model_path>``;
    - anything else needs a compressed checkpoint: comment lines give the llm-compressor
      step (with ``recipe_path``; whether calibration data is needed), then
      ``vllm serve <compressed_path> --quantization compressed-tensors``
      (``compressed_path`` defaults to ``<model_path>-quantplan``).

    ``kv_cache`` (:mod:`quantcore.evaluation.kvcache`) adds ``--kv-cache-dtype``: ``FP8_UNSCALED`` and
    ``FP8_E5M2`` are that flag alone (scale 1.0); ``FP8``'s calibrated scales come from the
    llm-compressor checkpoint, so a plan with it always goes through the compression step.
    ``kv_skip`` (a plan's ``kv_cache_skip``: layer indices, ``sliding_window``) adds
    ``--kv-cache-dtype-skip-layers``: those layers keep the model's dtype.
    ``tensor_parallel`` above 1 (a plan's ``tensor_parallel``) adds ``--tensor-parallel-size``, ``expert_parallel``
    ``--enable-expert-parallel``.
    Raises PlanError for plans llm-compressor cannot express.
    """
    names = list(layer_names)
    resolved = _as_plan(plan, names)
    groups, unquantized = _group_plan(resolved, names)  # raises for what cannot be expressed
    kvf = get_kv_format(kv_cache)
    skip = [] if kvf.is_identity else normalize_kv_skip(kv_skip)
    flags = [] if kvf.is_identity else ["--kv-cache-dtype", kvf.vllm_dtype]
    if skip:
        flags += ["--kv-cache-dtype-skip-layers", *skip]
    if tensor_parallel > 1:
        flags += ["--tensor-parallel-size", str(tensor_parallel)]
    if expert_parallel:
        flags.append("--enable-expert-parallel")
    counts = ", ".join(f"{s} x{n}" for s, n in _scheme_counts(resolved).items())
    if not kvf.is_identity:
        counts += f"; KV cache {kvf.name}" + (f" except layers {', '.join(skip)}" if skip else "")
    lines = [f"# quantplan plan for {model_path}: {counts}"]
    if skip:
        lines.append(f"# --kv-cache-dtype-skip-layers keeps the cache of {', '.join(skip)} in the model's dtype "
                     "(a recent vLLM flag: check that yours has it)")
    if kvf.element == "fp8_e4m3" and not kvf.calibrated:
        lines.append("# FP8 KV cache without calibrated scales: vLLM's K and V scales default to 1.0, so |K|, |V| "
                     "above 448 saturate (the plan's score shows whether they do)")
    if kvf.per_head:
        lines.append("# per-head K/V scales (kv_cache_scheme strategy attn_head): only vLLM's FlashAttention backend "
                     "reads them, and its FP8 path is FlashAttention 3 on Hopper (sm90); elsewhere score kv_cache FP8 "
                     "(one scale per layer)")
        lines.append("# FP8 attention: FlashAttention 3 quantizes Q (scale 1.0: no q_scale in the checkpoint) and the "
                     "softmax probabilities to E4M3 with this cache, as the plan's score emulated")
    elif kvf.attention:
        lines.append("# FP8 attention: vLLM's FlashAttention 3 backend (its default on Hopper) quantizes Q (scale 1.0: "
                     "no q_scale in the checkpoint) and the softmax probabilities to E4M3 with this cache, as the "
                     "plan's score emulated; a backend that dequantizes the cache (FlashInfer, Triton) keeps "
                     f"attention in BF16, which is kv_cache {kvf.name.replace('_ATTN', '')}")
    elif kvf.element == "fp8_e4m3":
        lines.append(f"# kv_cache {kvf.name} was scored with attention in BF16 (a backend that dequantizes the cache); "
                     "on Hopper vLLM's FlashAttention 3 backend runs attention itself in FP8 with this cache (Q at "
                     f"scale 1.0, softmax probabilities in E4M3): score kv_cache {kvf.name.replace('FP8', 'FP8_ATTN')} "
                     "to see that")
    w4afp8 = [n for n in names if is_w4afp8(resolved[n])]
    if w4afp8:
        lines.append(f"# W4AFP8 ({len(w4afp8)} layer(s)): vLLM serves INT4 weights with FP8 activations by its CUTLASS "
                     "W4A8 kernel alone, built for Hopper (sm90): on any other GPU this checkpoint does not load")
    if not groups and not kvf.calibrated:
        lines.append("# every layer stays unquantized: serve the model as it is")
        cmd = ["vllm", "serve", model_path, *flags]
    elif serves_online_fp8(resolved, names, kvf):
        lines.append(
            "# vLLM applies this plan at load time (online dynamic FP8: E4M3 per-tensor weight scales, "
            "dynamic per-tensor activation scales, lm_head unquantized); no calibration, no checkpoint"
        )
        cmd = ["vllm", "serve", model_path, "--quantization", "fp8", *flags]
    else:
        out = compressed_path or model_path.rstrip("/") + COMPRESSED_SUFFIX
        needs_data = kvf.calibrated or any(
            s.needs_calibration or s.needs_hessians or s.needs_awq or (s.activations is not None and s.activations.format == "nvfp4")
            for s in resolved.values()
        )
        lines += [
            "# vLLM cannot apply this plan at load time: serve the compressed-tensors checkpoint that llm-compressor",
            f"# makes with the exported recipe ({recipe_path}):",
            f'#   python -c "from llmcompressor import oneshot; oneshot(model={model_path!r}, '
            f"recipe={recipe_path!r}, output_dir={out!r}"
            + (', dataset=..., num_calibration_samples=512)"' if needs_data else ')"'),
        ]
        if needs_data:
            lines.append(
                "#   (needs calibration data: static activation or KV cache scales, NVFP4 global scales, "
                "SmoothQuant, GPTQ or AWQ)"
            )
        else:
            lines.append("#   (runs without calibration data: weights only and dynamic activation scales)")
        cmd = ["vllm", "serve", out, "--quantization", "compressed-tensors", *flags]
    lines.append(shlex.join(cmd))
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ import


def _preset_schemes() -> dict[tuple[Any, Any], list[Scheme]]:
    """quantplan presets keyed by their (weights, activations) args; several share a key (X / X_SQ)."""
    out: dict[tuple[Any, Any], list[Scheme]] = {}
    for name in list_schemes():
        s = get_scheme(name)
        if s.is_identity:
            continue
        w, a, problems = _scheme_args(s)
        if not problems:
            out.setdefault(_scheme_args_key(w, a), []).append(s)
    return out


def _scheme_for(
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
    specs = []
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
    candidates = _preset_schemes().get(_scheme_args_key(w_args, a_args), []) if not (why_w or why_a) else []
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


_GroupArgs = tuple[str, list[str], "Mapping[str, Any] | None", "Mapping[str, Any] | None"]  # label, targets, W, A


@dataclass
class _Claim:
    """The config groups one quantization modifier (or one compressed-tensors config) applies, with its ignore."""

    label: str
    groups: list[_GroupArgs]
    ignore: list[str]
    gptq: bool = False  # a GPTQModifier's: see :func:`_scheme_for`


def _assign(
    layer_names: Sequence[str],
    claims: Sequence[_Claim],
    alphas: Mapping[str, float],
    problems: list[str],
    awq: set[str] | frozenset[str] = frozenset(),
) -> dict[str, Scheme]:
    """Give every layer the scheme of the config group that claims it (compressed-tensors precedence within
    one claim); a layer two claims quantize is a problem, one no claim quantizes is BF16."""
    owners: list[dict[str, int]] = []
    for claim in claims:
        owner: dict[str, int] = {}
        for gi, (_, targets, _, _) in enumerate(claim.groups):
            for t in targets:
                owner.setdefault(t, gi)
        owners.append(owner)
    known = set(layer_names)
    for t in dict.fromkeys(t for owner in owners for t in owner):
        if "." in t and not t.startswith("re:") and t not in known:
            problems.append(
                f"target {t!r} names no linear layer of this model; layer names look like "
                f"{_cut(list(layer_names)[:3])}"
            )
    cache: dict[tuple[int, int, float | None, bool], Scheme | None] = {}
    out: dict[str, Scheme] = {}
    twice: dict[tuple[str, ...], list[str]] = {}
    bf16 = get_scheme("BF16")
    matchers = [(_Matcher.of(owner), _Matcher.of(claim.ignore)) for claim, owner in zip(claims, owners, strict=True)]
    for layer in layer_names:
        found = []  # (claim index, group index)
        for ci, (targets, ignore) in enumerate(matchers):
            hit = None if ignore.first(layer) is not None else targets.first(layer)
            if hit is not None:
                found.append((ci, owners[ci][hit]))
        alpha = alphas.get(layer)
        if not found:
            if alpha is not None:
                problems.append(
                    f"layer {layer!r} is smoothed (alpha {alpha:g}) but not quantized; remove it from the "
                    "SmoothQuant mappings or quantize it"
                )
            out[layer] = bf16
            continue
        if len(found) > 1:
            twice.setdefault(tuple(claims[ci].label for ci, _ in found), []).append(layer)
            continue
        ci, gi = found[0]
        key = (ci, gi, alpha, layer in awq)
        if key not in cache:
            label, _, w, a = claims[ci].groups[gi]
            cache[key] = _scheme_for(w, a, alpha, label, problems, claims[ci].gptq, layer in awq)
        scheme = cache[key]
        if scheme is not None:
            out[layer] = scheme
    for labels, layers in twice.items():
        problems.append(
            f"layer(s) {_cut(layers)} are quantized by {' and '.join(labels)}; target each layer from one "
            "quantization modifier"
        )
    if not problems:
        for members in fusion_groups(layer_names):
            labels = {scheme_label(out[m]) for m in members}
            if len(labels) > 1:
                problems.append(
                    f"fusion group {group_label(members)} gets mixed schemes "
                    f"({', '.join(f'{m}={scheme_label(out[m])}' for m in members)})"
                )
    return out


def _targets_list(value: Any, where: str, problems: list[str]) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(value)
    problems.append(f"{where} must be a target name or a list of them, got {value!r}")
    return []


def _ct_groups(config_groups: Any, where: str, problems: list[str]) -> list[_GroupArgs]:
    """(label, targets, weights args, activation args) for each compressed-tensors config group."""
    out = []
    if not isinstance(config_groups, Mapping):
        problems.append(
            f"{where}config_groups must be a mapping of group name -> scheme, got {config_groups!r}"
        )
        return out
    for name, g in config_groups.items():
        label = f"{where}config group {name!r}"
        if isinstance(g, (list, tuple, str)):  # {PRESET_NAME: targets}
            preset = CT_PRESETS.get(str(name).upper())
            if preset is None:
                problems.append(
                    f"{label}: a target list needs a preset name as group name; presets: "
                    f"{', '.join(CT_PRESETS)}"
                )
                continue
            out.append(
                (
                    label,
                    _targets_list(g, f"{label} targets", problems),
                    preset["weights"],
                    preset["input_activations"],
                )
            )
            continue
        if not isinstance(g, Mapping):
            problems.append(
                f"{label} must be a mapping with targets / weights / input_activations, got {g!r}"
            )
            continue
        unknown = [k for k in g if k not in _SCHEME_KEYS]
        if unknown:
            problems.append(f"{label}: unknown key(s) {unknown}; valid: {list(_SCHEME_KEYS)}")
            continue
        if g.get("output_activations") is not None:
            problems.append(f"{label}: output activation quantization is not something quantplan plans")
            continue
        targets = _targets_list(g.get("targets"), f"{label} targets", problems)
        if not targets:
            problems.append(f"{label} has no targets")
            continue
        out.append((label, targets, g.get("weights"), g.get("input_activations")))
    return out


def from_compressed_tensors_config(
    cfg: Mapping[str, Any], *, layer_names: Sequence[str]
) -> dict[str, Scheme]:
    """The per-layer plan a compressed-tensors ``quantization_config`` describes.

    ``cfg`` is the ``quantization_config`` dict or a whole ``config.json`` holding one.
    Every layer of ``layer_names`` gets a scheme (BF16 when ignored or not targeted).
    Raises PlanError naming each config group or layer quantplan cannot represent.
    """
    if isinstance(cfg, Mapping) and "quantization_config" in cfg:
        cfg = cfg["quantization_config"]
    if not isinstance(cfg, Mapping):
        raise PlanError(f"a quantization_config must be a mapping, got {type(cfg).__name__}")
    problems: list[str] = []
    method = cfg.get("quant_method", CT_QUANT_METHOD)
    if method != CT_QUANT_METHOD:
        raise PlanError(f"quant_method is {method!r}; quantplan imports {CT_QUANT_METHOD!r} configs only")
    kv_cache_from_args(cfg.get("kv_cache_scheme"), "quantization_config", problems)
    if cfg.get("sparsity_config"):
        problems.append("sparsity_config is set: quantplan plans quantization only")
    groups = _ct_groups(cfg.get("config_groups", {}), "", problems)
    ignore = _targets_list(cfg.get("ignore"), "ignore", problems)
    plan = _assign(list(layer_names), [_Claim("quantization_config", groups, ignore)], {}, problems)
    if problems:
        raise PlanError(_format("This compressed-tensors config cannot be imported", problems))
    return plan


def kv_cache_of_config(cfg: Mapping[str, Any]) -> str:
    """The KV cache format of a compressed-tensors ``quantization_config`` (or a ``config.json`` holding
    one): ``FP8`` for static per-tensor E4M3 K/V scales, else ``AUTO``. Check the layers with
    :func:`from_compressed_tensors_config`, which refuses a kv_cache_scheme quantplan cannot represent."""
    if isinstance(cfg, Mapping) and "quantization_config" in cfg:
        cfg = cfg["quantization_config"]
    return kv_cache_from_args(cfg.get("kv_cache_scheme") if isinstance(cfg, Mapping) else None, "", [])


def kv_cache_of_recipe(text: str) -> str:
    """The KV cache format an llm-compressor recipe asks for (``FP8`` or ``AUTO``), read like
    :func:`from_llmcompressor_recipe`, which refuses what quantplan cannot represent."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        return KV_AUTO
    for _, mod_type, args in _recipe_modifiers(data, []):
        if mod_type in QUANT_MODIFIERS and isinstance(args, Mapping):
            return kv_cache_from_args(args.get("kv_cache_scheme"), "", [])
    return KV_AUTO


def _recipe_modifiers(data: Any, problems: list[str]) -> list[tuple[str, str, Mapping[str, Any]]]:
    """(where, modifier type, args) in recipe order, read the way llm-compressor's Recipe.from_dict does."""
    out = []
    if not isinstance(data, Mapping):
        problems.append(f"a recipe must be a mapping of '<name>_stage' entries, got {type(data).__name__}")
        return out
    for stage_key, stage in data.items():
        if not (isinstance(stage_key, str) and stage_key.endswith("_stage") and isinstance(stage, Mapping)):
            continue
        for group_key, group in stage.items():
            if not (
                isinstance(group_key, str) and group_key.endswith("_modifiers") and isinstance(group, Mapping)
            ):
                continue
            for mod_type, args in group.items():
                out.append((f"{stage_key}.{group_key}.{mod_type}", str(mod_type), args or {}))
    if not any(
        isinstance(k, str) and k.endswith("_stage") and isinstance(v, Mapping) for k, v in data.items()
    ):
        # a stage without modifiers is an unquantized plan; no stage at all is a malformed file
        problems.append(
            "the recipe has no stage, so no modifiers: llm-compressor reads '<name>_stage: "
            "{<name>_modifiers: {ModifierType: {...}}}'"
        )
    return out


def _modifier_claim(where: str, mod_type: str, args: Any, problems: list[str]) -> _Claim:
    """The layers one quantization modifier of a recipe quantizes, and with what."""
    groups: list[_GroupArgs] = []
    if not isinstance(args, Mapping):
        problems.append(f"{where} must be a mapping of arguments")
        return _Claim(where, groups, [], mod_type == GPTQ_MODIFIER)
    kv_cache_from_args(args.get("kv_cache_scheme"), where, problems)
    ignore = _targets_list(args.get("ignore"), f"{where} ignore", problems)
    targets = _targets_list(args.get("targets", [LINEAR_CLASS]), f"{where} targets", problems)
    scheme = args.get("scheme")
    if scheme is not None and args.get("config_groups") is not None:
        problems.append(f"{where}: give either 'scheme' or 'config_groups', not both (llm-compressor refuses both)")
    elif isinstance(scheme, str):
        preset = CT_PRESETS.get(scheme.upper())
        if preset is None:
            problems.append(f"{where}: unknown preset scheme {scheme!r}; presets: {', '.join(CT_PRESETS)}")
        else:
            groups.append((f"{where} scheme {scheme}", targets, preset["weights"], preset["input_activations"]))
    elif isinstance(scheme, Mapping):
        groups = _ct_groups(scheme, f"{where} ", problems)
    elif scheme is not None:
        problems.append(f"{where}: scheme must be a preset name or {{preset: targets}}, got {scheme!r}")
    elif args.get("config_groups") is not None:
        groups = _ct_groups(args["config_groups"], f"{where} ", problems)
    return _Claim(where, groups, ignore, mod_type == GPTQ_MODIFIER)


def from_llmcompressor_recipe(text: str, *, layer_names: Sequence[str]) -> dict[str, Scheme]:
    """The per-layer plan an llm-compressor recipe (YAML or JSON text) applies to a model.

    Reads each ``QuantizationModifier`` and ``GPTQModifier`` (same formats, GPTQ rounding: its groups get
    quantplan's ``*_GPTQ`` presets where there is one; no layer may be targeted by two of them), an
    ``AWQModifier`` (the balance layers of its ``mappings``, llm-compressor's defaults when it gives none, get the
    ``*_AWQ`` preset of their format)
    with ``scheme`` (preset name, or ``{preset: targets}``) + ``targets``, or
    ``config_groups``; ``ignore``; and any ``SmoothQuantModifier`` (``smoothing_strength``,
    default 0.5; ``mappings``, default llm-compressor's q/k/v and gate/up mappings), whose
    balance layers get that alpha. Raises PlanError for anything it cannot represent,
    naming the modifier, group or layer.
    """
    names = list(layer_names)
    problems: list[str] = []
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        from quantcore.planning.plans import yaml_problem

        raise PlanError(f"the recipe is not valid YAML or JSON: {yaml_problem(exc)}") from exc
    modifiers = _recipe_modifiers(data, problems)
    quant = [(w, t, a) for w, t, a in modifiers if t in QUANT_MODIFIERS]
    alphas: dict[str, float] = {}
    awq: set[str] = set()
    for where, mod_type, args in modifiers:
        if mod_type == AWQ_MODIFIER:
            if not isinstance(args, Mapping):
                problems.append(f"{where} must be a mapping of arguments")
                continue
            differ = {k: args[k] for k, v in AWQ_RECIPE_ARGS.items() if k in args and args[k] != v}
            if differ:
                problems.append(f"{where}: quantplan's AWQ search runs with {AWQ_RECIPE_ARGS}, not {differ}")
            awq |= _awq_covered(args.get("mappings"), names, where, problems)
        elif mod_type == SMOOTH_MODIFIER:
            if not isinstance(args, Mapping):
                problems.append(f"{where} must be a mapping of arguments")
                continue
            strength = args.get("smoothing_strength", SQ_DEFAULT_STRENGTH)
            if isinstance(strength, bool) or not isinstance(strength, (int, float)) or not 0 <= strength <= 1:
                problems.append(f"{where}: smoothing_strength must be a number in [0, 1], got {strength!r}")
                continue
            if args.get("ignore"):
                problems.append(
                    f"{where}: SmoothQuantModifier.ignore is not supported by the importer; list the "
                    "layers to smooth in its mappings instead"
                )
                continue
            mappings = args.get("mappings") or LLM_COMPRESSOR_DEFAULT_SQ_MAPPINGS
            try:
                covered = _expand_mappings(mappings, names)
            except PlanError as exc:
                problems.append(f"{where}: {exc}")
                continue
            for layer in names:
                if layer in covered:
                    if layer in alphas and alphas[layer] != float(strength):
                        problems.append(
                            f"layer {layer!r} is smoothed twice (alpha {alphas[layer]:g} and "
                            f"{float(strength):g})"
                        )
                    alphas[layer] = float(strength)
        elif mod_type not in QUANT_MODIFIERS:
            problems.append(
                f"{where}: modifier {mod_type} is not something quantplan plans; supported: "
                f"{', '.join(QUANT_MODIFIERS + (SMOOTH_MODIFIER, AWQ_MODIFIER))}"
            )
    claims = [_modifier_claim(where, mod_type, args, problems) for where, mod_type, args in quant]
    plan = _assign(names, claims, alphas, problems, awq)
    if problems:
        raise PlanError(_format("This llm-compressor recipe cannot be imported", problems))
    return plan


# ------------------------------------------------------------------ helpers



def _scheme_counts(plan: Mapping[str, Scheme]) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in plan.values():
        label = scheme_label(s)
        out[label] = out.get(label, 0) + 1
    return out




__all__ = [
    "CT_PRESETS",
    "compact_targets",
    "ct_args",
    "ct_format",
    "ct_preset_name",
    "from_compressed_tensors_config",
    "from_llmcompressor_recipe",
    "scheme_from_ct_args",
    "to_compressed_tensors_config",
    "to_llmcompressor_recipe",
    "to_vllm_command",
]
