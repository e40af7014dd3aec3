"""quantcore.schemes.specs: presets, validation, JSON round trip and fusion groups."""

from __future__ import annotations

import dataclasses
import json

import pytest

from quantcore.formats.granularity import Granularity
from quantcore.schemes.fusion import fusion_group_of, fusion_groups
from quantcore.schemes.presets import get_scheme, list_schemes
from quantcore.schemes.specs import Scheme, TensorSpec
from quantcore.schemes.storage import weight_scale_count, weight_storage_bits

ISSUE_PRESETS = [
    "FP8", "FP8_PER_TENSOR", "FP8_DYNAMIC", "FP8_BLOCK", "FP8_E5M2", "INT8_PER_TENSOR",
    "INT8_PER_TENSOR_SQ", "INT8_W8A8", "INT8_W8A8_SQ", "W8A16", "W4A16", "MXFP8", "MXFP4",
    "NVFP4", "NVFP4A16", "BF16",
]  # fmt: skip
# the same formats with GPTQ-rounded weights (quantcore.algorithms.gptq): llm-compressor's GPTQModifier recipes
AWQ_PRESETS = ["W8A16_AWQ", "W4A16_AWQ", "W4A16_ASYM_AWQ", "W4A16_G64_AWQ", "W4A16_G64_ASYM_AWQ", "W4A16_G32_AWQ",
               "W4A16_G32_ASYM_AWQ", "W4A16_CHANNEL_AWQ", "NVFP4A16_AWQ"]
GPTQ_PRESETS = ["INT8_W8A8_GPTQ", "INT8_W8A8_SQ_GPTQ", "W8A16_GPTQ", "W4A16_GPTQ", "W4A16_ASYM_GPTQ", "W4A16_G64_GPTQ",
                "W4A16_G64_ASYM_GPTQ", "W4A16_G32_GPTQ", "W4A16_G32_ASYM_GPTQ", "W4A16_CHANNEL_GPTQ", "NVFP4_GPTQ",
                "NVFP4A16_GPTQ", "W4AFP8_GPTQ"]
# W4A16 in groups of 64 and 32, for a K that 128 does not divide (SmolLM2's 576; one GPU's share of Qwen2.5-72B's
# down_proj at 4 GPUs, 7,392): vLLM's Marlin serves -1, 32, 64, 128; one scale per channel (group -1), which any K
# takes; and with a zero point per group (compressed-tensors' W4A16_ASYM, the scheme of llm-compressor's AWQ examples)
G64_PRESETS = ["W4A16_G64", "W4A16_G32", "W4A16_CHANNEL"]
ASYM_PRESETS = ["W4A16_ASYM", "W4A16_G64_ASYM", "W4A16_G32_ASYM"]
# INT4 weights with FP8 activations: compressed-tensors' W4AFP8 (vLLM's CUTLASS W4A8 kernel on Hopper)
W4A8_PRESETS = ["W4AFP8"]
# MXFP4 weights alone (gpt-oss's format): compressed-tensors' MXFP4A16, vLLM's CompressedTensorsW4A16Mxfp4
MX_WEIGHT_ONLY_PRESETS = ["MXFP4A16"]
W4_PRESETS = [n for n in GPTQ_PRESETS + AWQ_PRESETS + G64_PRESETS + ASYM_PRESETS if n.startswith("W4A16")]


def test_every_preset_of_the_issue_is_registered():
    assert sorted(list_schemes()) == sorted(ISSUE_PRESETS + GPTQ_PRESETS + AWQ_PRESETS + G64_PRESETS + ASYM_PRESETS
                                         + W4A8_PRESETS + MX_WEIGHT_ONLY_PRESETS)


def test_each_preset_is_a_named_constant_gathered_in_one_table():
    from quantcore.schemes import presets

    assert list(presets.PRESET_SCHEMES) == list_schemes()
    for name in ("FP8", "INT8_W8A8_SQ", "W4A16_ASYM_AWQ", "NVFP4A16_GPTQ", "BF16"):
        assert getattr(presets, name) is presets.PRESET_SCHEMES[name] is get_scheme(name)
    assert presets.PRESET_SCHEMES["W4A16_G64_GPTQ"].weights.group_size == presets.W4_SMALL_GROUP_SIZE


def test_mxfp4a16_is_mxfp4s_weights_alone():
    mx, w4a4 = get_scheme("MXFP4A16"), get_scheme("MXFP4")
    assert mx.weights == w4a4.weights and mx.activations is None
    assert not mx.needs_calibration and mx.describe() == "W: mxfp4 group 32; A: 16-bit"
    # 4 bits and one E8M0 byte per 32: 4.25 bits a weight, as MXFP4's
    assert weight_storage_bits("MXFP4A16", 576, 576) == weight_storage_bits("MXFP4", 576, 576) == 576 * 576 * 4.25


def test_w4afp8_is_w4a16_weights_with_fp8_per_token_activations():
    w4, w4a8 = get_scheme("W4A16"), get_scheme("W4AFP8")
    assert w4a8.weights == w4.weights  # INT4, symmetric, groups of 128 along K: the same stored weights
    a = w4a8.activations
    assert (a.format, a.granularity, a.dynamic) == ("fp8_e4m3", Granularity.TOKEN, True)
    assert not w4a8.needs_calibration and not w4a8.needs_hessians and get_scheme("W4AFP8_GPTQ").needs_hessians
    # the weights cost exactly what W4A16's do: the activations are not stored
    assert weight_storage_bits("W4AFP8", 512, 1024) == weight_storage_bits("W4A16", 512, 1024)
    assert w4a8.describe() == "W: int4 group 128; A: fp8_e4m3 per-token"


def test_w4a16_asym_is_compressed_tensors_w4a16_asym():
    for suffix in ("", "_GPTQ", "_AWQ"):
        sym, asym = get_scheme(f"W4A16{suffix}"), get_scheme(f"W4A16_ASYM{suffix}")
        assert sym.weights.symmetric and not asym.weights.symmetric
        assert dataclasses.replace(asym.weights, symmetric=True) == sym.weights
        assert (asym.gptq, asym.awq, asym.activations) == (sym.gptq, sym.awq, None)
        assert "asymmetric" in asym.describe() and "asymmetric" not in sym.describe()
    # a zero point per group, packed at 4 bits as compressed-tensors stores them: 4 + 16/128 + 4/128 bits a weight
    assert weight_storage_bits("W4A16_ASYM", 512, 1024) == weight_storage_bits("W4A16", 512, 1024) + 512 * 8 * 4
    # a symmetric spec's dict is what it always was (cache keys are made from such dicts); an asymmetric one says so
    assert "symmetric" not in get_scheme("W4A16").weights.to_dict()
    assert get_scheme("W4A16_ASYM").weights.to_dict()["symmetric"] is False


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(format="fp8_e4m3", granularity="channel", symmetric=False), "int formats"),
        (dict(format="nvfp4", granularity="group", symmetric=False), "int formats"),
        (dict(format="int8", granularity="tensor", symmetric=False), "'channel' or 'group'"),
        (dict(format="int8", granularity="channel", symmetric=0), "true or false"),
    ],
)
def test_zero_points_only_for_int_weights_with_channel_or_group_scales(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TensorSpec(**kwargs)


def test_activations_are_never_asymmetric():
    with pytest.raises(ValueError, match="zero points are for weights"):
        Scheme("X", TensorSpec("int8", "channel"), TensorSpec("int8", "group", group_size=128, symmetric=False))


@pytest.mark.parametrize("suffix", ["", "_GPTQ", "_AWQ"])
@pytest.mark.parametrize("asym", ["", "_ASYM"])
def test_w4a16_g64_is_w4a16_with_groups_of_64(suffix, asym):
    g128, g64 = get_scheme(f"W4A16{asym}{suffix}"), get_scheme(f"W4A16_G64{asym}{suffix}")
    assert g128.weights.group_size == 128 and g64.weights.group_size == 64
    assert dataclasses.replace(g64.weights, group_size=128) == g128.weights
    assert (g64.gptq, g64.awq, g64.activations) == (g128.gptq, g128.awq, g128.activations)
    assert g64.description and "64" in g64.description and g64.description != g128.description
    assert ("ASYM" in g64.description or "zero point" in g64.description) == bool(asym)
    assert list_schemes().index(f"W4A16_G64{asym}{suffix}") > list_schemes().index("W4A16_ASYM_AWQ")
    # twice the scales: 4 + 16/64 = 4.25 bits per weight against 4.125 (16-bit scales); a zero point adds 4 more
    zp = 4 if asym else 0
    assert weight_storage_bits(g64, 576, 576) == 576 * 576 * 4 + 576 * 9 * (16 + zp)
    assert weight_storage_bits(g128, 576, 640) == 576 * 640 * 4 + 576 * 5 * (16 + zp)


@pytest.mark.parametrize("suffix", ["", "_GPTQ", "_AWQ"])
@pytest.mark.parametrize("asym", ["", "_ASYM"])
def test_w4a16_g32_is_w4a16_with_groups_of_32(suffix, asym):
    g128, g32 = get_scheme(f"W4A16{asym}{suffix}"), get_scheme(f"W4A16_G32{asym}{suffix}")
    assert dataclasses.replace(g32.weights, group_size=128) == g128.weights and g32.weights.group_size == 32
    assert (g32.gptq, g32.awq, g32.activations) == (g128.gptq, g128.awq, g128.activations)
    assert list_schemes().index(f"W4A16_G32{asym}{suffix}") > list_schemes().index(f"W4A16_G64{asym}{suffix}")
    if not suffix:
        assert "four times the scales" in g32.description and "128 or 64 does not divide" in g32.description
    # four times the scales: 4 + 16/32 = 4.5 bits per weight (16-bit scales); a zero point adds 4/32 more
    zp = 4 if asym else 0
    assert weight_storage_bits(g32, 576, 576) == 576 * 576 * 4 + 576 * 18 * (16 + zp)


@pytest.mark.parametrize("suffix", ["", "_GPTQ", "_AWQ"])
def test_w4a16_channel_is_w4a16_with_one_scale_per_row(suffix):
    g128, ch = get_scheme(f"W4A16{suffix}"), get_scheme(f"W4A16_CHANNEL{suffix}")
    w = ch.weights
    assert (w.format, w.granularity, w.group_size, w.symmetric) == ("int4", Granularity.CHANNEL, None, True)
    assert (ch.gptq, ch.awq, ch.activations) == (g128.gptq, g128.awq, None)
    assert ch.describe().startswith("W: int4 per-channel; A: 16-bit")
    assert "W4A16_CHANNEL_ASYM" not in list_schemes()  # GPTQ's group_size -1 checkpoints are symmetric
    # one 16-bit scale a row: 4 + 16 / K bits per weight, the fewest of any INT4 preset
    assert weight_storage_bits(ch, 576, 1536) == 576 * 1536 * 4 + 576 * 16
    assert weight_storage_bits(ch, 576, 1536) < weight_storage_bits(g128, 576, 1536)


# (weights format, weights granularity, acts format or None, acts granularity, acts dynamic, alpha),
# from issue 3 and, where the name exists there, compressed-tensors' PRESET_SCHEMES.
PRESET_TABLE = {
    "FP8": ("fp8_e4m3", "tensor", "fp8_e4m3", "tensor", False, None),
    "FP8_PER_TENSOR": ("fp8_e4m3", "tensor", "fp8_e4m3", "tensor", True, None),
    "FP8_DYNAMIC": ("fp8_e4m3", "channel", "fp8_e4m3", "token", True, None),
    "FP8_BLOCK": ("fp8_e4m3", "block", "fp8_e4m3", "group", True, None),
    "FP8_E5M2": ("fp8_e5m2", "tensor", "fp8_e5m2", "tensor", True, None),
    "INT8_PER_TENSOR": ("int8", "channel", "int8", "tensor", True, None),
    "INT8_PER_TENSOR_SQ": ("int8", "channel", "int8", "tensor", True, 0.5),
    "INT8_W8A8": ("int8", "channel", "int8", "token", True, None),
    "INT8_W8A8_SQ": ("int8", "channel", "int8", "token", True, 0.5),
    "W8A16": ("int8", "channel", None, None, None, None),
    "W4A16": ("int4", "group", None, None, None, None),
    "W4A16_G64": ("int4", "group", None, None, None, None),
    "W4A16_ASYM": ("int4", "group", None, None, None, None),
    "W4A16_G64_ASYM": ("int4", "group", None, None, None, None),
    "MXFP8": ("mxfp8", "group", "mxfp8", "group", True, None),
    "MXFP4": ("mxfp4", "group", "mxfp4", "group", True, None),
    "MXFP4A16": ("mxfp4", "group", None, None, None, None),
    "NVFP4": ("nvfp4", "group", "nvfp4", "group", False, None),  # a calibrated tensor scale, live block scales
    "NVFP4A16": ("nvfp4", "group", None, None, None, None),
}


@pytest.mark.parametrize("name", sorted(PRESET_TABLE))
def test_preset_contents(name):
    wf, wg, af, ag, adyn, alpha = PRESET_TABLE[name]
    s = get_scheme(name)
    assert (s.weights.format, s.weights.granularity.value) == (wf, wg)
    if af is None:
        assert s.activations is None and s.weight_only
    else:
        assert (s.activations.format, s.activations.granularity.value, s.activations.dynamic) == (
            af,
            ag,
            adyn,
        )
    assert s.smoothquant_alpha == alpha
    assert s.description


def test_preset_details():
    assert get_scheme("W4A16").weights.group_size == 128
    assert get_scheme("FP8_BLOCK").weights.block == (128, 128)
    assert get_scheme("FP8_BLOCK").activations.group_size == 128
    assert get_scheme("MXFP4").weights.group_size == 32
    assert get_scheme("NVFP4").activations.group_size == 16


def test_bits_identity_and_calibration_flags():
    bf16 = get_scheme("BF16")
    assert bf16.is_identity and not bf16.weight_only
    assert (bf16.weight_bits, bf16.activation_bits) == (16, 16)
    assert (get_scheme("W4A16").weight_bits, get_scheme("W4A16").activation_bits) == (4, 16)
    assert (get_scheme("NVFP4").weight_bits, get_scheme("NVFP4").activation_bits) == (4, 4)
    assert (get_scheme("FP8_DYNAMIC").weight_bits, get_scheme("FP8_DYNAMIC").activation_bits) == (8, 8)
    needing = {n for n in list_schemes() if get_scheme(n).needs_calibration}
    # NVFP4's activations: the fp32 tensor scale is calibrated, as compressed-tensors' NVFP4 (dynamic: local) has it
    assert needing == {"FP8", "INT8_PER_TENSOR_SQ", "INT8_W8A8_SQ", "INT8_W8A8_SQ_GPTQ", "NVFP4", "NVFP4_GPTQ"}
    assert {n for n in list_schemes() if get_scheme(n).needs_hessians} == set(GPTQ_PRESETS)


@pytest.mark.parametrize("name", ISSUE_PRESETS + GPTQ_PRESETS + AWQ_PRESETS + G64_PRESETS + ASYM_PRESETS + W4A8_PRESETS)
def test_to_dict_is_json_safe_and_round_trips(name):
    scheme = get_scheme(name)
    data = json.loads(json.dumps(scheme.to_dict()))
    assert Scheme.from_dict(data) == scheme


def test_numerics_changes_name_what_an_older_quantplan_did_differently():
    from quantcore.schemes.numerics import NUMERICS, numerics_changes

    assert numerics_changes("W4A16", None) and numerics_changes("INT8_W8A8", 1)  # the former int grid
    assert numerics_changes("W4A16", 2) == numerics_changes("FP8_DYNAMIC", 1) == []
    [why] = numerics_changes("NVFP4", 2)  # the activations' tensor scale was taken per forward before version 3
    assert "calibrated" in why
    assert numerics_changes("NVFP4A16", 2) == []  # weight-only: the same numbers
    [why] = numerics_changes("FP8", 3)  # per-tensor FP8 weights of a fusion group share one scale since version 4
    assert "largest" in why and numerics_changes("FP8_DYNAMIC", 3) == [] and numerics_changes("FP8_E5M2", 3) == []
    # routed experts' dynamic per-tensor scales are block-wide since version 5: only an expert's result changed
    assert numerics_changes("FP8_PER_TENSOR", 4) == [] and numerics_changes("FP8_DYNAMIC", 4, expert=True) == []
    [why] = numerics_changes("FP8_PER_TENSOR", 4, expert=True)
    assert "whole block" in why
    # MX weights on compressed-tensors' E8M0 scales since version 6: MXFP4, MXFP4A16 and MXFP8 changed, nothing else
    for name in ("MXFP4", "MXFP4A16", "MXFP8"):
        [why] = numerics_changes(name, 5)
        assert "E8M0" in why and "rounded to a power of two" in why
    assert numerics_changes("NVFP4A16", 5) == numerics_changes("W4A16", 5) == []
    # a row-parallel layer on several GPUs: dynamic per-tensor / per-token scales per GPU's share since version 7
    for name in ("INT8_PER_TENSOR", "INT8_W8A8", "FP8_DYNAMIC"):
        [why] = numerics_changes(name, 6, input_shares=4)
        assert "4 GPUs' shares" in why and numerics_changes(name, 6) == []
    assert numerics_changes("FP8", 6, input_shares=4) == numerics_changes("W4A16", 6, input_shares=4) == []
    assert numerics_changes("MXFP8", 6, input_shares=4) == []  # group scales: a valid split never cuts a group
    assert all(numerics_changes(n, NUMERICS, input_shares=8) == [] for n in list_schemes())


def test_with_alpha_keeps_name_and_can_remove_smoothing():
    s = get_scheme("INT8_W8A8").with_alpha(0.8)
    assert s.smoothquant_alpha == 0.8 and s.name == "INT8_W8A8" and s.needs_calibration
    assert get_scheme("INT8_W8A8_SQ").with_alpha(None).smoothquant_alpha is None
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        get_scheme("INT8_W8A8").with_alpha(1.5)


def test_unknown_scheme_lists_valid_names_and_hints_case():
    with pytest.raises(ValueError) as err:
        get_scheme("fp8_dynamic")
    assert "FP8_DYNAMIC" in str(err.value) and "case-sensitive" in str(err.value)
    for name in list_schemes():
        assert name in str(err.value)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(format="fp9", granularity="tensor"), "valid formats"),
        (dict(format="int8", granularity="row"), "granularity"),
        (dict(format="int4", granularity="group"), "group_size"),
        (dict(format="int4", granularity="group", group_size=0), "group_size"),
        (dict(format="int4", granularity="tensor", group_size=128), "only used with granularity 'group'"),
        (dict(format="fp8_e4m3", granularity="block"), r"block=\(rows, cols\)"),
        (dict(format="fp8_e4m3", granularity="block", block=(128,)), r"block=\(rows, cols\)"),
        (dict(format="fp8_e4m3", granularity="tensor", block=(1, 128)), "only used with granularity 'block'"),
        (dict(format="mxfp4", granularity="tensor"), "group_size=32"),
        (dict(format="nvfp4", granularity="group", group_size=32), "group_size=16"),
    ],
)
def test_tensor_spec_validation_messages(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TensorSpec(**kwargs)


def test_tensor_spec_normalises_strings_and_block_format_group():
    spec = TensorSpec("mxfp8", "group")
    assert spec.granularity is Granularity.GROUP and spec.group_size == 32
    assert TensorSpec("fp8_e4m3", "block", block=[128, 128]).block == (128, 128)


def test_scheme_validation_messages():
    w = TensorSpec("int8", "channel")
    with pytest.raises(ValueError, match="activation-only"):
        Scheme("X", None, TensorSpec("int8", "token"))
    with pytest.raises(ValueError, match="'channel' for one scale per output row"):
        Scheme("X", TensorSpec("int8", "token"), None)
    with pytest.raises(ValueError, match="use 'token'"):
        Scheme("X", w, TensorSpec("int8", "channel"))
    with pytest.raises(ValueError, match="one amax per tensor"):
        Scheme("X", w, TensorSpec("int8", "token", dynamic=False))
    with pytest.raises(ValueError, match="dynamic=True"):
        Scheme("X", w, TensorSpec("mxfp4", "group", dynamic=False))
    with pytest.raises(ValueError, match="only helps when activations are quantized"):
        Scheme("X", w, None, smoothquant_alpha=0.5)
    with pytest.raises(ValueError, match="unknown Scheme field"):
        Scheme.from_dict({"name": "X", "weights": None, "activations": None, "alpha": 0.5})
    # static nvfp4 activations: a calibrated fp32 tensor scale, blocks still dynamic
    assert Scheme(
        "X", TensorSpec("nvfp4", "group"), TensorSpec("nvfp4", "group", dynamic=False)
    ).needs_calibration


LLAMA_BLOCK = [
    "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj",
    "model.layers.0.self_attn.o_proj", "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj",
    "model.layers.0.mlp.down_proj",
]  # fmt: skip


def test_fusion_groups_llama_qwen_gemma_mistral_naming():
    names = LLAMA_BLOCK + [n.replace(".0.", ".1.") for n in LLAMA_BLOCK] + ["lm_head"]
    groups = fusion_groups(reversed(names))  # canonical member order regardless of input order
    assert groups == [
        ["model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"],
        [
            "model.layers.1.self_attn.q_proj",
            "model.layers.1.self_attn.k_proj",
            "model.layers.1.self_attn.v_proj",
        ],
        ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"],
        [
            "model.layers.0.self_attn.q_proj",
            "model.layers.0.self_attn.k_proj",
            "model.layers.0.self_attn.v_proj",
        ],
    ]


def test_fusion_groups_bert_and_singletons():
    bert = [f"encoder.layer.0.attention.self.{p}" for p in ("query", "key", "value")]
    bert.append("encoder.layer.0.attention.output.dense")
    assert fusion_groups(bert) == [bert[:3]]
    assert fusion_group_of("encoder.layer.0.attention.output.dense", bert) == [
        "encoder.layer.0.attention.output.dense"
    ]
    assert fusion_group_of("model.layers.0.self_attn.o_proj", LLAMA_BLOCK) == [
        "model.layers.0.self_attn.o_proj"
    ]
    assert fusion_group_of("model.layers.0.self_attn.k_proj", LLAMA_BLOCK) == LLAMA_BLOCK[:3]


def test_fusion_groups_match_a_real_model(tiny_gemma3):
    import torch

    names = [n for n, m in tiny_gemma3.named_modules() if isinstance(m, torch.nn.Linear)]
    groups = fusion_groups(names)
    assert len(groups) == 4  # 2 blocks x (qkv, gate/up)
    assert sum(len(g) for g in groups) == 2 * (3 + 2)


# ---------------------------------------------------------------- weight storage

STORAGE_SHAPES = [(64, 256), (48, 200), (130, 129), (1, 16)]  # K not a multiple of 128 / 32 / 16 too


@pytest.mark.parametrize("name", [s for s in list_schemes() if get_scheme(s).weights is not None])
@pytest.mark.parametrize("shape", STORAGE_SHAPES)
def test_weight_scale_count_is_the_number_of_scales_quantize_makes(name, shape):
    """The footprint counts exactly the scales quantcore.formats.quantize produces for that weight."""
    import torch

    from quantcore.formats.quantize import quantize

    spec = get_scheme(name).weights
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    q = quantize(w, spec.format, spec.granularity.value, group_size=spec.group_size, block=spec.block)
    assert weight_scale_count(spec, *shape) == q.scale.numel()
    assert (q.tensor_scale is not None) == (spec.format == "nvfp4")  # the extra fp32 NVFP4 stores


def test_weight_storage_bits_counts_elements_and_scales():
    n, k = 16, 40
    assert weight_storage_bits("BF16", n, k) == 16 * n * k
    assert weight_storage_bits("FP8", n, k) == 8 * n * k + 16  # one per-tensor scale
    assert weight_storage_bits("FP8_DYNAMIC", n, k) == 8 * n * k + 16 * n  # a scale per output row
    assert weight_storage_bits("INT8_W8A8_SQ", n, k) == weight_storage_bits("INT8_W8A8", n, k)  # smoothing folds
    assert weight_storage_bits("W4A16", n, k) == 4 * n * k + 16 * n * 1  # K=40: one group of 128 per row
    assert weight_storage_bits("FP8_BLOCK", 200, 300) == 8 * 200 * 300 + 16 * 2 * 3  # 128x128 tiles, ceil
    assert weight_storage_bits("MXFP4", n, k) == 4 * n * k + 8 * n * 2  # E8M0 per 32: ceil(40/32) = 2
    assert weight_storage_bits("NVFP4", n, k) == 4 * n * k + 8 * n * 3 + 32  # E4M3 per 16 + fp32 tensor scale
    assert weight_storage_bits("NVFP4A16", n, k) == weight_storage_bits("NVFP4", n, k)  # weights alike
    # bits per weight on a large layer: the overheads a serving engineer knows
    big = 4096 * 4096
    assert weight_storage_bits("W4A16", 4096, 4096) / big == pytest.approx(4.125)
    assert weight_storage_bits("MXFP4", 4096, 4096) / big == pytest.approx(4.25)
    assert weight_storage_bits("NVFP4", 4096, 4096) / big == pytest.approx(4.5, abs=1e-5)


def test_a_token_granularity_weight_has_no_scale_count():
    with pytest.raises(ValueError, match="activation granularity"):
        weight_scale_count(TensorSpec("int8", Granularity.TOKEN), 4, 4)
