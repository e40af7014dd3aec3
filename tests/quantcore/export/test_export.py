"""Export of plans to llm-compressor / compressed-tensors / vLLM, and import back.

Golden values come from compressed-tensors 0.19.0's PRESET_SCHEMES and llm-compressor
0.14.0.1's recipe format (read in their sources); test_llmcompressor.py checks the same
exports against the real packages.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from quantcore.errors import PlanError
from quantcore.export.compressed_tensors import (
    from_compressed_tensors_config,
    kv_cache_of_config,
    to_compressed_tensors_config,
)
from quantcore.export.llmcompressor import (
    LLAMA_SQ_MAPPINGS,
    from_llmcompressor_recipe,
    kv_cache_of_recipe,
    to_llmcompressor_recipe,
)
from quantcore.export.quant_args import (
    CT_PRESETS,
    KV_CACHE_FP8_ARGS,
    KV_CACHE_FP8_HEAD_ARGS,
    ct_args,
    ct_preset_name,
    scheme_from_ct_args,
)
from quantcore.export.vllm import to_vllm_command
from quantcore.planning.plans import diff_plans, resolve_plan, spec_from_plan
from quantcore.schemes.fusion import fusion_groups
from quantcore.schemes.presets import get_scheme, list_schemes
from quantcore.schemes.specs import Scheme
from quantcore.schemes.targets import compact_targets
from tests.factories import EXPRESSIBLE, LAYERS, uniform

SQ_PRESETS = [s for s in list_schemes() if get_scheme(s).smoothquant_alpha is not None]


def without_alpha(plan: dict[str, Scheme]) -> dict[str, Scheme]:
    """What a compressed checkpoint says: SmoothQuant is folded into the weights, its alpha is gone, and so is
    how the weights were rounded (GPTQ, AWQ's scaling or to nearest)."""
    out = {}
    for n, s in plan.items():
        if s.awq:
            s = get_scheme(s.name.removesuffix("_AWQ"))
        if s.gptq:
            s = get_scheme(s.name.removesuffix("_GPTQ")).with_alpha(s.smoothquant_alpha)
        if s.smoothquant_alpha is None:
            out[n] = s
        else:
            base = s.name.removesuffix("_SQ")
            out[n] = get_scheme(base) if base in list_schemes() else s.with_alpha(None)
    return out


def quant_modifier(text: str) -> dict:
    return yaml.safe_load(text)["quant_stage"]["quant_modifiers"]["QuantizationModifier"]


# ----------------------------------------------------------------- round trips


@pytest.mark.parametrize("name", EXPRESSIBLE)
def test_recipe_round_trip_every_preset(name: str) -> None:
    plan = uniform(name)
    text = to_llmcompressor_recipe(plan, layer_names=LAYERS)
    assert from_llmcompressor_recipe(text, layer_names=LAYERS) == plan


@pytest.mark.parametrize("name", EXPRESSIBLE)
def test_compressed_tensors_round_trip_every_preset(name: str) -> None:
    plan = uniform(name)
    cfg = to_compressed_tensors_config(plan, layer_names=LAYERS)
    cfg = json.loads(json.dumps(cfg))  # what a config.json holds
    assert from_compressed_tensors_config(cfg, layer_names=LAYERS) == without_alpha(plan)
    # a whole config.json works as well
    assert from_compressed_tensors_config({"quantization_config": cfg}, layer_names=LAYERS) == without_alpha(
        plan
    )


def test_w4a16_asym_is_compressed_tensors_w4a16_asym() -> None:
    """llm-compressor's AWQ examples quantize with the W4A16_ASYM preset: it imports as quantplan's W4A16_ASYM_AWQ,
    and exports back under that preset name."""
    text = """
default_stage:
  default_modifiers:
    AWQModifier: {}
    QuantizationModifier: {targets: [Linear], scheme: W4A16_ASYM, ignore: [lm_head]}
"""
    plan = from_llmcompressor_recipe(text, layer_names=LAYERS)
    assert plan["model.layers.0.mlp.down_proj"] == get_scheme("W4A16_ASYM_AWQ")
    assert ct_preset_name("W4A16_ASYM") == "W4A16_ASYM" and ct_preset_name("W4A16_G64_ASYM") is None
    assert ct_args("W4A16_G64_ASYM")[0] == {"num_bits": 4, "type": "int", "strategy": "group", "symmetric": False,
                                             "dynamic": False, "group_size": 64}
    plan = uniform("W4A16_ASYM")
    assert "scheme: W4A16_ASYM" in to_llmcompressor_recipe(plan, layer_names=LAYERS)


def test_w4a16_g64_is_written_as_int4_groups_of_64() -> None:
    """No compressed-tensors preset has INT4 groups of 64: the recipe spells the args out, and vLLM reads them."""
    plan = uniform("W4A16_G64")
    recipe = yaml.safe_load(to_llmcompressor_recipe(plan, layer_names=LAYERS))
    text = json.dumps(recipe)
    assert '"group_size": 64' in text and '"num_bits": 4' in text and '"W4A16"' not in text
    assert ct_args("W4A16_G64")[0]["group_size"] == 64 and ct_args("W4A16")[0]["group_size"] == 128


@pytest.mark.parametrize("name", SQ_PRESETS)
def test_recipe_round_trip_keeps_a_changed_alpha(name: str) -> None:
    plan = uniform(name)
    for n in LAYERS:
        if ".1." in n and not n.endswith("o_proj"):
            plan[n] = get_scheme(name).with_alpha(0.8)
    text = to_llmcompressor_recipe(plan, layer_names=LAYERS)
    back = from_llmcompressor_recipe(text, layer_names=LAYERS)
    assert diff_plans(plan, back) == []
    assert back == plan


def expressible_scheme() -> st.SearchStrategy[Scheme]:
    plain = st.sampled_from(EXPRESSIBLE).map(get_scheme)
    smoothed = st.tuples(st.sampled_from(SQ_PRESETS), st.sampled_from([0.5, 0.25, 0.75, 0.85])).map(
        lambda t: get_scheme(t[0]).with_alpha(t[1])
    )
    return st.one_of(plain, smoothed)


@st.composite
def mixed_plans(draw: st.DrawFn) -> dict[str, Scheme]:
    """A per-layer plan that respects fusion groups, over every expressible preset and some alphas."""
    plan: dict[str, Scheme] = {}
    grouped = {m: g for g in fusion_groups(LAYERS) for m in g}
    for n in LAYERS:
        if n in plan:
            continue
        s = draw(expressible_scheme())
        for m in grouped.get(n, [n]):
            plan[m] = s
    # SmoothQuant only where the Llama mappings can fold it (not o_proj, not lm_head)
    for n in ("lm_head", *[x for x in LAYERS if x.endswith("o_proj")]):
        if plan[n].smoothquant_alpha is not None:
            plan[n] = (
                plan[n].with_alpha(None)
                if plan[n].name not in SQ_PRESETS
                else get_scheme(plan[n].name.replace("_SQ", ""))
            )
    # AWQ likewise (lm_head has no operator before it to fold into: scored and exported rounded to nearest)
    if plan["lm_head"].awq:
        plan["lm_head"] = get_scheme(plan["lm_head"].name.removesuffix("_AWQ"))
    return plan


@settings(max_examples=60, deadline=None)
@given(mixed_plans())
def test_mixed_plan_round_trips_through_recipe_and_config(plan: dict[str, Scheme]) -> None:
    text = to_llmcompressor_recipe(plan, layer_names=LAYERS)
    assert from_llmcompressor_recipe(text, layer_names=LAYERS) == plan
    assert ("GPTQModifier" in text) == any(s.gptq for s in plan.values())
    assert ("QuantizationModifier" in text) == any(not s.gptq and not s.is_identity for s in plan.values())
    cfg = json.loads(json.dumps(to_compressed_tensors_config(plan, layer_names=LAYERS)))
    assert from_compressed_tensors_config(cfg, layer_names=LAYERS) == without_alpha(plan)


def test_round_trip_through_a_plan_file() -> None:
    """export -> import -> plan file -> resolve gives the same resolved plan."""
    plan = uniform("FP8_DYNAMIC")
    for n in LAYERS:
        if n.endswith("down_proj"):
            plan[n] = get_scheme("INT8_W8A8_SQ").with_alpha(0.6)
    back = from_llmcompressor_recipe(to_llmcompressor_recipe(plan, layer_names=LAYERS), layer_names=LAYERS)
    assert resolve_plan(spec_from_plan(back), LAYERS) == plan


# ----------------------------------------------------------------- recipe layout


def test_uniform_preset_uses_scheme_name_targets_linear_and_ignores_bf16() -> None:
    mod = quant_modifier(to_llmcompressor_recipe(uniform("FP8_DYNAMIC"), layer_names=LAYERS))
    assert mod == {"targets": ["Linear"], "scheme": "FP8_DYNAMIC", "ignore": ["lm_head"]}


def test_seen_here_recipe_imports() -> None:
    """The recipe shape SEEN-HERE.md records as loading in the real llmcompressor."""
    text = ("quant_stage: {quant_modifiers: {QuantizationModifier: "
            "{targets: [Linear], scheme: FP8_DYNAMIC, ignore: [lm_head]}}}")
    assert from_llmcompressor_recipe(text, layer_names=LAYERS) == uniform("FP8_DYNAMIC")


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        ("FP8", "FP8"),
        ("FP8_DYNAMIC", "FP8_DYNAMIC"),
        ("FP8_BLOCK", "FP8_BLOCK"),
        ("INT8_W8A8", "W8A8"),
        ("INT8_W8A8_SQ", "W8A8"),
        ("W4A16", "W4A16"),
        ("NVFP4", "NVFP4"),
        ("NVFP4A16", "NVFP4A16"),
        ("MXFP4", "MXFP4"),
        ("MXFP8", "MXFP8"),
        ("W8A16", None),
        ("W4A16_G64", None),  # compressed-tensors' W4A16 is groups of 128: the recipe writes the args out
        ("FP8_PER_TENSOR", None),
        ("INT8_PER_TENSOR", None),
        ("BF16", None),
    ],
)
def test_preset_names_match_by_arguments_not_by_name(ours: str, theirs: str | None) -> None:
    assert ct_preset_name(ours) == theirs


@pytest.mark.parametrize("name", [n for n in EXPRESSIBLE if n != "BF16"])
def test_args_of_every_preset_round_trip(name: str) -> None:
    s = get_scheme(name)
    assert scheme_from_ct_args(*ct_args(s), alpha=s.smoothquant_alpha, gptq=s.gptq, awq=s.awq) == s
    # without the GPTQModifier / AWQModifier, the same args are the preset rounded to nearest
    assert scheme_from_ct_args(*ct_args(s), alpha=s.smoothquant_alpha) == get_scheme(
        name.removesuffix("_GPTQ").removesuffix("_AWQ"))


def test_w8a16_is_per_channel_not_the_group_128_preset() -> None:
    """compressed-tensors' W8A16 preset is INT8 in groups of 128; quantplan's is per channel."""
    assert CT_PRESETS["W8A16"]["weights"]["strategy"] == "group"
    mod = quant_modifier(to_llmcompressor_recipe(uniform("W8A16"), layer_names=LAYERS))
    assert "scheme" not in mod
    (group,) = mod["config_groups"].values()
    assert group["targets"] == ["Linear"]
    assert group["weights"] == {
        "num_bits": 8,
        "type": "int",
        "strategy": "channel",
        "symmetric": True,
        "dynamic": False,
    }
    assert group["input_activations"] is None
    assert mod["ignore"] == ["lm_head"]


def test_nvfp4_activations_are_dynamic_local_with_e4m3_scales() -> None:
    cfg = to_compressed_tensors_config(uniform("NVFP4"), layer_names=LAYERS)
    (group,) = cfg["config_groups"].values()
    assert group["input_activations"] == {
        "num_bits": 4,
        "type": "float",
        "strategy": "tensor_group",
        "symmetric": True,
        "dynamic": "local",
        "group_size": 16,
        "scale_dtype": "torch.float8_e4m3fn",
    }
    assert group["format"] == cfg["format"] == "nvfp4-pack-quantized"


@pytest.mark.parametrize(
    ("name", "fmt"),
    [
        ("FP8_DYNAMIC", "float-quantized"),
        ("FP8_BLOCK", "float-quantized"),
        ("INT8_W8A8", "int-quantized"),
        ("W4A16", "pack-quantized"),
        ("W8A16", "pack-quantized"),
        ("NVFP4A16", "nvfp4-pack-quantized"),
        ("MXFP4", "mxfp4-pack-quantized"),
        ("MXFP8", "mxfp8-quantized"),
    ],
)
def test_compressed_tensors_format_per_scheme(name: str, fmt: str) -> None:
    cfg = to_compressed_tensors_config(uniform(name), layer_names=LAYERS)
    assert cfg["format"] == fmt
    assert cfg["quant_method"] == "compressed-tensors"
    assert cfg["kv_cache_scheme"] is None


def test_mixed_plan_targets_layers_by_name_never_by_class() -> None:
    """vLLM matches a fused qkv_proj by class name before its shards: several groups must not use 'Linear'."""
    plan = uniform("FP8_DYNAMIC")
    for n in LAYERS:
        if n.startswith("model.layers.1.self_attn.") and not n.endswith("o_proj"):
            plan[n] = get_scheme("W4A16")
    cfg = to_compressed_tensors_config(plan, layer_names=LAYERS)
    assert cfg["format"] == "mixed-precision"
    targets = [t for g in cfg["config_groups"].values() for t in g["targets"]]
    assert "Linear" not in targets
    by_group = {g["format"]: g["targets"] for g in cfg["config_groups"].values()}
    assert by_group["pack-quantized"] == [
        "model.layers.1.self_attn.q_proj",
        "model.layers.1.self_attn.k_proj",
        "model.layers.1.self_attn.v_proj",
    ]
    mod = quant_modifier(to_llmcompressor_recipe(plan, layer_names=LAYERS))
    assert set(mod["scheme"]) == {"FP8_DYNAMIC", "W4A16"}  # every group is a preset: {preset: targets}


def test_smoothquant_on_every_norm_fed_and_down_layer() -> None:
    plan = uniform("INT8_W8A8_SQ")
    stage = yaml.safe_load(to_llmcompressor_recipe(plan, layer_names=LAYERS))["quant_stage"]
    assert list(stage) == ["smoothing_modifiers", "quant_modifiers"]  # smoothing runs first
    sq = stage["smoothing_modifiers"]["SmoothQuantModifier"]
    assert sq["smoothing_strength"] == 0.5
    assert sq["mappings"] == [
        [["re:.*q_proj", "re:.*k_proj", "re:.*v_proj"], "re:.*input_layernorm"],
        [["re:.*gate_proj", "re:.*up_proj"], "re:.*post_attention_layernorm"],
        [["re:.*down_proj"], "re:.*up_proj"],
    ]
    assert stage["quant_modifiers"]["QuantizationModifier"]["scheme"] == "W8A8"


def test_smoothquant_on_o_proj_is_refused_naming_the_layers() -> None:
    plan = uniform("INT8_W8A8_SQ")
    plan["model.layers.1.self_attn.o_proj"] = get_scheme("INT8_W8A8_SQ")
    with pytest.raises(PlanError) as err:
        to_llmcompressor_recipe(plan, layer_names=LAYERS)
    msg = str(err.value)
    assert "model.layers.1.self_attn.o_proj" in msg and "grouped-query" in msg and "INT8_W8A8" in msg
    assert "model.layers.0.self_attn.o_proj" not in msg


def test_gemma_mlp_norm() -> None:
    stage = yaml.safe_load(
        to_llmcompressor_recipe(
            uniform("INT8_W8A8_SQ"), layer_names=LAYERS, mlp_norm="pre_feedforward_layernorm"
        )
    )["quant_stage"]
    mappings = stage["smoothing_modifiers"]["SmoothQuantModifier"]["mappings"]
    assert mappings[1] == [["re:.*gate_proj", "re:.*up_proj"], "re:.*pre_feedforward_layernorm"]
    with pytest.raises(PlanError, match="mlp_norm"):
        to_llmcompressor_recipe(uniform("INT8_W8A8_SQ"), layer_names=LAYERS, mlp_norm="ln_2")


def test_smoothquant_on_some_blocks_only_maps_those_blocks() -> None:
    plan = uniform("INT8_W8A8")
    for n in (
        "model.layers.2.mlp.down_proj",
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.k_proj",
        "model.layers.0.self_attn.v_proj",
    ):
        plan[n] = get_scheme("INT8_W8A8_SQ")
    stage = yaml.safe_load(to_llmcompressor_recipe(plan, layer_names=LAYERS))["quant_stage"]
    mappings = stage["smoothing_modifiers"]["SmoothQuantModifier"]["mappings"]
    assert mappings == [
        [
            [
                r"re:model\.layers\.0\.self_attn\.q_proj$",
                r"re:model\.layers\.0\.self_attn\.k_proj$",
                r"re:model\.layers\.0\.self_attn\.v_proj$",
            ],
            r"re:model\.layers\.0\.input_layernorm$",
        ],
        [[r"re:model\.layers\.2\.mlp\.down_proj$"], r"re:model\.layers\.2\.mlp\.up_proj$"],
    ]


def test_two_alphas_give_two_smoothquant_modifiers() -> None:
    plan = uniform("INT8_W8A8")
    plan["model.layers.0.mlp.down_proj"] = get_scheme("INT8_W8A8_SQ")
    plan["model.layers.1.mlp.down_proj"] = get_scheme("INT8_W8A8_SQ").with_alpha(0.75)
    stage = yaml.safe_load(to_llmcompressor_recipe(plan, layer_names=LAYERS))["quant_stage"]
    strengths = [
        g["SmoothQuantModifier"]["smoothing_strength"] for k, g in stage.items() if k.startswith("smoothing")
    ]
    assert strengths == [0.5, 0.75]


def test_custom_smoothquant_mappings_are_used_verbatim() -> None:
    plan = uniform("INT8_W8A8")
    for n in LAYERS:
        if n.endswith(("gate_proj", "up_proj")):
            plan[n] = get_scheme("INT8_W8A8_SQ")
    custom = [[["re:.*gate_proj", "re:.*up_proj"], "re:.*pre_feedforward_layernorm"]]  # Gemma3 naming
    stage = yaml.safe_load(to_llmcompressor_recipe(plan, layer_names=LAYERS, smoothquant_mappings=custom))
    assert stage["quant_stage"]["smoothing_modifiers"]["SmoothQuantModifier"]["mappings"] == custom
    with pytest.raises(PlanError, match="balance layers"):
        to_llmcompressor_recipe(plan, layer_names=LAYERS, smoothquant_mappings=[LLAMA_SQ_MAPPINGS["attn"]])


# ----------------------------------------------------------------- what cannot be expressed


def test_e5m2_is_refused_naming_layers_and_reason() -> None:
    plan = uniform("FP8_DYNAMIC")
    plan["model.layers.1.mlp.down_proj"] = get_scheme("FP8_E5M2")
    for export in (to_llmcompressor_recipe, to_compressed_tensors_config):
        with pytest.raises(PlanError) as err:
            export(plan, layer_names=LAYERS)
        msg = str(err.value)
        assert "model.layers.1.mlp.down_proj" in msg and "E5M2" in msg and "E4M3" in msg
    with pytest.raises(PlanError, match="E5M2"):
        to_vllm_command(plan, model_path="/m", layer_names=LAYERS)


def test_custom_schemes_that_compressed_tensors_cannot_store() -> None:
    from quantcore.formats.granularity import Granularity
    from quantcore.schemes.specs import TensorSpec

    fp4 = Scheme("FP4_CHANNEL", TensorSpec("fp4_e2m1", Granularity.CHANNEL, dynamic=False), None)
    block_acts = Scheme(
        "FP8_2D_ACTS",
        TensorSpec("fp8_e4m3", Granularity.BLOCK, dynamic=False, block=(128, 128)),
        TensorSpec("fp8_e4m3", Granularity.BLOCK, block=(1, 128)),
    )
    for scheme, words in ((fp4, "NVFP4"), (block_acts, "2-D block")):
        plan = uniform("FP8_DYNAMIC")
        plan["model.layers.0.self_attn.o_proj"] = scheme
        with pytest.raises(PlanError, match=words) as err:
            to_compressed_tensors_config(plan, layer_names=LAYERS)
        assert "model.layers.0.self_attn.o_proj" in str(err.value)


def test_split_fusion_group_is_refused() -> None:
    plan = uniform("FP8_DYNAMIC")
    plan["model.layers.0.self_attn.k_proj"] = get_scheme("W4A16")
    with pytest.raises(PlanError, match=r"model\.layers\.0\.self_attn\.\{q,k,v\}_proj"):
        to_llmcompressor_recipe(plan, layer_names=LAYERS)


def test_plan_must_cover_exactly_the_layers() -> None:
    plan = uniform("FP8_DYNAMIC")
    del plan["model.layers.2.mlp.down_proj"]
    plan["model.layers.9.mlp.down_proj"] = get_scheme("BF16")
    with pytest.raises(PlanError) as err:
        to_compressed_tensors_config(plan, layer_names=LAYERS)
    assert "model.layers.2.mlp.down_proj" in str(err.value) and "model.layers.9.mlp.down_proj" in str(
        err.value
    )


# ----------------------------------------------------------------- import of foreign files


def test_import_third_party_static_fp8_config_groups_with_observers() -> None:
    text = """
quant_stage:
  quant_modifiers:
    QuantizationModifier:
      ignore: [lm_head]
      config_groups:
        group_0:
          weights: {num_bits: 8, type: float, strategy: tensor, dynamic: false, symmetric: true, observer: minmax}
          input_activations: {num_bits: 8, type: float, strategy: tensor, dynamic: false, symmetric: true}
          targets: [Linear]
"""
    assert from_llmcompressor_recipe(text, layer_names=LAYERS) == uniform("FP8")


def test_import_gptq_recipe_and_preset_group_names_in_config() -> None:
    text = "s_stage: {q_modifiers: {GPTQModifier: {ignore: [lm_head], scheme: W4A16, targets: Linear}}}"
    assert from_llmcompressor_recipe(text, layer_names=LAYERS) == uniform("W4A16_GPTQ")
    # FP8 has no GPTQ preset: a GPTQModifier's FP8 layers come back rounded to nearest
    text = "s_stage: {q_modifiers: {GPTQModifier: {ignore: [lm_head], scheme: FP8_DYNAMIC, targets: Linear}}}"
    assert from_llmcompressor_recipe(text, layer_names=LAYERS) == uniform("FP8_DYNAMIC")
    cfg = {"config_groups": {"FP8_DYNAMIC": ["re:.*mlp.*"]}, "ignore": []}
    plan = from_compressed_tensors_config(cfg, layer_names=LAYERS)
    assert {n for n, s in plan.items() if s.name == "FP8_DYNAMIC"} == {n for n in LAYERS if ".mlp." in n}
    assert all(s.name == "BF16" for n, s in plan.items() if ".mlp." not in n)


def test_mixed_gptq_plan_exports_a_gptq_and_a_round_to_nearest_modifier() -> None:
    """GPTQ layers go to a GPTQModifier, the others to a QuantizationModifier, each naming its own layers, so
    oneshot rounds the others to nearest as they were scored; W4A16 and W4A16_GPTQ share args yet part ways."""
    plan = uniform("W4A16")
    for n in LAYERS:
        if n.endswith("down_proj"):
            plan[n] = get_scheme("W4A16_GPTQ")
        if ".self_attn." in n:
            plan[n] = get_scheme("FP8_DYNAMIC")
    text = to_llmcompressor_recipe(plan, layer_names=LAYERS, kv_cache="FP8")
    mods = yaml.safe_load(text)["quant_stage"]["quant_modifiers"]
    assert list(mods) == ["GPTQModifier", "QuantizationModifier"]
    gptq, rtn = mods["GPTQModifier"], mods["QuantizationModifier"]
    assert gptq["scheme"] == {"W4A16": [r"re:.*\.down_proj$"]} and gptq["dampening_frac"] == 0.01
    assert rtn["scheme"] == {"W4A16": [r"re:.*\.gate_proj$", r"re:.*\.up_proj$"],
                             "FP8_DYNAMIC": [r"re:.*\.q_proj$", r"re:.*\.k_proj$", r"re:.*\.v_proj$",
                                             r"re:.*\.o_proj$"]}
    assert "targets" not in gptq and "targets" not in rtn  # never the class Linear: it would take every layer
    assert "kv_cache_scheme" not in gptq and rtn["kv_cache_scheme"]["num_bits"] == 8
    assert "GPTQModifier rounds the 3 GPTQ layer(s), QuantizationModifier the other 18 to nearest" in text
    assert from_llmcompressor_recipe(text, layer_names=LAYERS) == plan
    # all GPTQ: one GPTQModifier on the class Linear, as before
    only = yaml.safe_load(to_llmcompressor_recipe(uniform("W8A16_GPTQ"), layer_names=LAYERS))
    assert list(only["quant_stage"]["quant_modifiers"]) == ["GPTQModifier"]


def test_import_refuses_a_layer_two_quantization_modifiers_target() -> None:
    text = """
quant_stage:
  quant_modifiers:
    GPTQModifier: {scheme: {W4A16: ['re:.*mlp.*']}, ignore: [lm_head]}
    QuantizationModifier: {scheme: FP8_DYNAMIC, targets: [Linear], ignore: [lm_head]}
"""
    with pytest.raises(PlanError) as err:
        from_llmcompressor_recipe(text, layer_names=LAYERS)
    msg = str(err.value)
    assert "quant_stage.quant_modifiers.GPTQModifier and quant_stage.quant_modifiers.QuantizationModifier" in msg
    assert "model.layers.0.mlp.gate_proj" in msg and "self_attn" not in msg
    # the same two modifiers with the MLPs ignored by the second: each layer has one owner
    fixed = text.replace("targets: [Linear], ignore: [lm_head]", "targets: [Linear], ignore: [lm_head, 're:.*mlp.*']")
    plan = from_llmcompressor_recipe(fixed, layer_names=LAYERS)
    assert {s.name for n, s in plan.items() if ".mlp." in n} == {"W4A16_GPTQ"}
    assert {s.name for n, s in plan.items() if ".self_attn." in n} == {"FP8_DYNAMIC"}


def test_import_default_smoothquant_mappings_cover_qkv_and_gate_up() -> None:
    text = """
default_stage:
  default_modifiers:
    SmoothQuantModifier: {smoothing_strength: 0.8}
    QuantizationModifier: {targets: [Linear], scheme: W8A8, ignore: [lm_head]}
"""
    plan = from_llmcompressor_recipe(text, layer_names=LAYERS)
    smoothed = {n for n, s in plan.items() if s.smoothquant_alpha == 0.8}
    assert smoothed == {
        n for n in LAYERS if n.endswith(("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))
    }
    assert all(s.name == "INT8_W8A8_SQ" for n, s in plan.items() if n in smoothed)
    assert plan["model.layers.0.mlp.down_proj"] == get_scheme("INT8_W8A8")


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (  # zero points are for int weights (W4A16_ASYM imports), not for activations
            "q_stage: {q_modifiers: {QuantizationModifier: {ignore: [lm_head], config_groups: {g: {targets: [Linear], "
            "weights: {num_bits: 8, type: int, strategy: channel}, input_activations: {num_bits: 8, type: int, "
            "strategy: token, dynamic: true, symmetric: false}}}}}}",
            "asymmetric (zero-point) quantization: quantplan plans it for int weights",
        ),
        (
            "q_stage: {q_modifiers: {QuantizationModifier: {ignore: [lm_head], config_groups: {g: {targets: [Linear], "
            "weights: {num_bits: 8, type: float, strategy: channel, symmetric: false}}}}}}",
            "not 8-bit float weights",
        ),
        (
            "q_stage: {q_modifiers: {QuantizationModifier: {scheme: W4A8, ignore: [lm_head]}}}",
            "no quantplan scheme",
        ),
        ("q_stage: {q_modifiers: {QuantizationModifier: {scheme: FP9}}}", "unknown preset scheme 'FP9'"),
        (
            "q_stage: {q_modifiers: {QuantizationModifier: {scheme: FP8_DYNAMIC, kv_cache_scheme: {num_bits: 8}}}}",
            "KV cache",
        ),
        (
            "q_stage: {q_modifiers: {QuantizationModifier: {scheme: {FP8_DYNAMIC: [model.layers.7.mlp.up_proj]}}}}",
            "'model.layers.7.mlp.up_proj' names no linear layer",
        ),
        ("q_stage: {q_modifiers: {AWQModifier: {}, QuantizationModifier: {scheme: FP8_DYNAMIC}}}",
         "quantplan has AWQ only for W8A16_AWQ, W4A16_AWQ"),
        ("q_stage: {q_modifiers: {AWQModifier: {n_grid: 10}, QuantizationModifier: {scheme: W4A16}}}",
         "quantplan's AWQ search runs with"),
        ("q_stage: {q_modifiers: {AWQModifier: {mappings: [{smooth_layer: x}]}, QuantizationModifier: {}}}",
         "needs smooth_layer (a name) and balance_layers"),
        ("q_stage: {q_modifiers: {AutoRoundModifier: {}, QuantizationModifier: {scheme: W4A16}}}",
         "AutoRoundModifier"),
        ("QuantizationModifier: {scheme: FP8}", "no stage"),
        (
            "q_stage: {q_modifiers: {SmoothQuantModifier: {}, QuantizationModifier: {scheme: W4A16}}}",
            "quantizes no activations",
        ),
    ],
)
def test_import_errors_name_the_culprit(text: str, words: str) -> None:
    with pytest.raises(PlanError, match=re.escape(words)):
        from_llmcompressor_recipe(text, layer_names=LAYERS)


def test_import_split_fusion_group_is_refused() -> None:
    cfg = {"config_groups": {"W4A16": ["model.layers.0.self_attn.q_proj"], "FP8_DYNAMIC": ["Linear"]}}
    with pytest.raises(PlanError, match=r"fusion group model\.layers\.0\.self_attn\.\{q,k,v\}_proj"):
        from_compressed_tensors_config(cfg, layer_names=LAYERS)


def test_import_precedence_exact_name_over_regex_over_class() -> None:
    cfg = {
        "config_groups": {
            "FP8_DYNAMIC": ["Linear"],
            "W4A16": ["re:.*down_proj$"],
            "NVFP4A16": ["model.layers.1.mlp.down_proj"],
        },
        "ignore": ["lm_head"],
    }
    plan = from_compressed_tensors_config(cfg, layer_names=LAYERS)
    assert plan["model.layers.1.mlp.down_proj"].name == "NVFP4A16"
    assert plan["model.layers.0.mlp.down_proj"].name == "W4A16"
    assert plan["model.layers.0.mlp.up_proj"].name == "FP8_DYNAMIC"
    assert plan["lm_head"].name == "BF16"


# ----------------------------------------------------------------- target patterns


@settings(max_examples=200, deadline=None)
@given(st.sets(st.sampled_from(LAYERS), min_size=1))
def test_compact_targets_match_exactly_the_members(members: set[str]) -> None:
    chosen = [n for n in LAYERS if n in members]
    targets = compact_targets(chosen, LAYERS)
    matched = {n for n in LAYERS for t in targets if (re.match(t[3:], n) if t.startswith("re:") else t == n)}
    assert matched == members
    assert len(targets) <= len(chosen)


def test_compact_targets_collapse_repeated_layers() -> None:
    downs = [n for n in LAYERS if n.endswith("down_proj")]
    assert compact_targets(downs, LAYERS) == [r"re:.*\.down_proj$"]
    assert compact_targets(downs[:2], LAYERS) == [r"re:model\.layers\.(?:0|1)\.mlp\.down_proj$"]


# ----------------------------------------------------------------- vLLM


def test_vllm_online_fp8_for_the_per_tensor_dynamic_plan() -> None:
    cmd = to_vllm_command(uniform("FP8_PER_TENSOR"), model_path="/models/llama 8b", layer_names=LAYERS)
    assert cmd.splitlines()[-1] == "vllm serve '/models/llama 8b' --quantization fp8"
    assert "load time" in cmd


def test_vllm_online_fp8_not_used_when_the_head_is_quantized() -> None:
    cmd = to_vllm_command(
        uniform("FP8_PER_TENSOR", head="FP8_PER_TENSOR"), model_path="/m", layer_names=LAYERS
    )
    assert cmd.splitlines()[-1] == "vllm serve /m-quantplan --quantization compressed-tensors"


def test_vllm_compressed_checkpoint_for_calibrated_plans() -> None:
    cmd = to_vllm_command(
        uniform("FP8"),
        model_path="/m",
        layer_names=LAYERS,
        compressed_path="/ckpt/fp8",
        recipe_path="plan.yaml",
    )
    lines = cmd.splitlines()
    assert lines[-1] == "vllm serve /ckpt/fp8 --quantization compressed-tensors"
    assert all(line.startswith("#") for line in lines[:-1])
    assert "recipe='plan.yaml'" in cmd and "needs calibration data" in cmd
    dyn = to_vllm_command(uniform("FP8_DYNAMIC"), model_path="/m", layer_names=LAYERS)
    assert "without calibration data" in dyn and "needs calibration data" not in dyn


def test_vllm_command_says_a_w4afp8_checkpoint_loads_on_hopper_only() -> None:
    plan = {**uniform("FP8_DYNAMIC"), "model.layers.0.mlp.down_proj": get_scheme("W4AFP8_GPTQ")}
    cmd = to_vllm_command(plan, model_path="/m", layer_names=LAYERS)
    [note] = [line for line in cmd.splitlines() if "W4AFP8" in line and "Hopper" in line]
    assert note.startswith("# W4AFP8 (1 layer(s)): ") and "sm90" in note
    assert "needs calibration data" in cmd  # GPTQ's Hessians
    assert "Hopper (sm90)" not in to_vllm_command(uniform("W4A16"), model_path="/m", layer_names=LAYERS)


def test_vllm_kv_cache_flag_follows_the_plans_kv_cache() -> None:
    plan = uniform("FP8_PER_TENSOR")
    assert "--kv-cache-dtype" not in to_vllm_command(plan, model_path="/m", layer_names=LAYERS)
    assert "--kv-cache-dtype" not in to_vllm_command(plan, model_path="/m", layer_names=LAYERS, kv_cache="AUTO")
    # unscaled formats are the flag alone: vLLM's online FP8 still applies the layer plan at load time
    cmd = to_vllm_command(plan, model_path="/m", layer_names=LAYERS, kv_cache="FP8_UNSCALED")
    assert cmd.splitlines()[-1] == "vllm serve /m --quantization fp8 --kv-cache-dtype fp8"
    assert "default to 1.0" in cmd and "448" in cmd
    cmd = to_vllm_command(plan, model_path="/m", layer_names=LAYERS, kv_cache="fp8_e5m2")
    assert cmd.splitlines()[-1] == "vllm serve /m --quantization fp8 --kv-cache-dtype fp8_e5m2"
    # calibrated K/V scales live in the checkpoint: the compression step, with calibration data
    cmd = to_vllm_command(plan, model_path="/m", layer_names=LAYERS, kv_cache="FP8")
    assert cmd.splitlines()[-1] == "vllm serve /m-quantplan --quantization compressed-tensors --kv-cache-dtype fp8"
    assert "needs calibration data" in cmd
    bf16 = to_vllm_command(uniform("BF16"), model_path="/m", layer_names=LAYERS, kv_cache="FP8")
    assert bf16.splitlines()[-1].startswith("vllm serve /m-quantplan ") and "needs calibration data" in bf16
    with pytest.raises(PlanError, match="unknown KV cache format 'int4'"):
        to_vllm_command(plan, model_path="/m", layer_names=LAYERS, kv_cache="int4")


def test_fp8_attention_is_the_fp8_cache_plus_what_the_vllm_command_says_about_the_backend() -> None:
    """FP8 attention is vLLM's FlashAttention 3 backend, not the checkpoint: FP8_ATTN exports the very recipe and
    config of FP8 (kv_cache_scheme, no q_scale), FP8_ATTN_UNSCALED the flag of FP8_UNSCALED; the command says
    which backend computes what the score emulated, and a cache-only format says where attention runs in FP8."""
    plan = uniform("FP8_DYNAMIC")
    for attn, cache in (("FP8_ATTN", "FP8"), ("FP8_ATTN_UNSCALED", "FP8_UNSCALED")):
        assert quant_modifier(to_llmcompressor_recipe(plan, layer_names=LAYERS, kv_cache=attn)) == \
            quant_modifier(to_llmcompressor_recipe(plan, layer_names=LAYERS, kv_cache=cache))
        assert to_compressed_tensors_config(plan, layer_names=LAYERS, kv_cache=attn) == \
            to_compressed_tensors_config(plan, layer_names=LAYERS, kv_cache=cache)
        cmd = to_vllm_command(plan, model_path="/m", layer_names=LAYERS, kv_cache=attn)
        assert cmd.splitlines()[-1] == to_vllm_command(plan, model_path="/m", layer_names=LAYERS,
                                                       kv_cache=cache).splitlines()[-1]
        assert "FlashAttention 3 backend (its default on Hopper) quantizes Q (scale 1.0" in cmd
        assert f"keeps attention in BF16, which is kv_cache {cache}" in cmd
        assert "scored with attention in BF16" not in cmd  # an FP8 attention format was not
        plain = to_vllm_command(plan, model_path="/m", layer_names=LAYERS, kv_cache=cache)
        assert "scored with attention in BF16" in plain and f"score kv_cache {attn} to see that" in plain
    assert "FlashAttention" not in to_vllm_command(plan, model_path="/m", layer_names=LAYERS, kv_cache="FP8_E5M2")
    recipe = to_llmcompressor_recipe(plan, layer_names=LAYERS, kv_cache="FP8_ATTN")
    assert "nothing of it is in the recipe" in recipe and kv_cache_of_recipe(recipe) == "FP8"


def test_per_head_kv_scales_are_the_attn_head_strategy_and_round_trip() -> None:
    """FP8_ATTN_HEAD: compressed-tensors' attn_head kv_cache_scheme (a scale per KV head), calibrated like FP8;
    imported back as FP8_ATTN_HEAD; the command says only FlashAttention (Hopper) reads per-head scales."""
    plan = uniform("FP8_DYNAMIC")
    assert KV_CACHE_FP8_HEAD_ARGS == {**KV_CACHE_FP8_ARGS, "strategy": "attn_head"}
    recipe = to_llmcompressor_recipe(plan, layer_names=LAYERS, kv_cache="FP8_ATTN_HEAD")
    assert quant_modifier(recipe)["kv_cache_scheme"] == KV_CACHE_FP8_HEAD_ARGS
    assert "strategy attn_head" in recipe.split("quant_stage")[0] and "calibration data" in recipe
    assert kv_cache_of_recipe(recipe) == "FP8_ATTN_HEAD"
    assert from_llmcompressor_recipe(recipe, layer_names=LAYERS) == plan
    cfg = json.loads(json.dumps(to_compressed_tensors_config(plan, layer_names=LAYERS, kv_cache="FP8_ATTN_HEAD")))
    assert cfg["kv_cache_scheme"] == KV_CACHE_FP8_HEAD_ARGS and kv_cache_of_config(cfg) == "FP8_ATTN_HEAD"
    cmd = to_vllm_command(plan, model_path="/m", layer_names=LAYERS, kv_cache="FP8_ATTN_HEAD")
    assert cmd.splitlines()[-1] == "vllm serve /m-quantplan --quantization compressed-tensors --kv-cache-dtype fp8"
    assert "only vLLM's FlashAttention backend reads them" in cmd and "score kv_cache FP8 (one scale per layer)" in cmd
    assert "quantizes Q (scale 1.0" in cmd and "dataset=..." in cmd and "scored with attention in BF16" not in cmd


def test_layers_kept_out_of_the_cache_are_vllms_skip_flag() -> None:
    plan = uniform("FP8_PER_TENSOR")
    cmd = to_vllm_command(plan, model_path="/m", layer_names=LAYERS, kv_cache="FP8_UNSCALED",
                          kv_skip=["sliding_window", 0])
    assert cmd.splitlines()[-1] == ("vllm serve /m --quantization fp8 --kv-cache-dtype fp8 "
                                    "--kv-cache-dtype-skip-layers sliding_window 0")
    assert "KV cache FP8_UNSCALED except layers sliding_window, 0" in cmd and "check that yours has it" in cmd
    # nothing quantized, nothing to skip: no flag
    assert "skip" not in to_vllm_command(plan, model_path="/m", layer_names=LAYERS, kv_skip=["0"])


def test_recipe_kv_cache_scheme_round_trips() -> None:
    plan = uniform("FP8_DYNAMIC")
    text = to_llmcompressor_recipe(plan, layer_names=LAYERS, kv_cache="FP8")
    mod = quant_modifier(text)
    assert mod["kv_cache_scheme"] == KV_CACHE_FP8_ARGS and mod["scheme"] == "FP8_DYNAMIC"
    assert "calibration data" in text.split("quant_stage")[0]
    assert from_llmcompressor_recipe(text, layer_names=LAYERS) == plan
    assert kv_cache_of_recipe(text) == "FP8"
    assert kv_cache_of_recipe(to_llmcompressor_recipe(plan, layer_names=LAYERS)) == "AUTO"
    # a KV cache alone is a quantization modifier with nothing but kv_cache_scheme
    only = yaml.safe_load(to_llmcompressor_recipe(uniform("BF16"), layer_names=LAYERS, kv_cache="FP8"))
    assert only["quant_stage"]["quant_modifiers"]["QuantizationModifier"] == {"kv_cache_scheme": KV_CACHE_FP8_ARGS}
    # unscaled formats are a vLLM flag: no recipe entry, a header line that says so
    e5 = to_llmcompressor_recipe(plan, layer_names=LAYERS, kv_cache="FP8_E5M2")
    assert "kv_cache_scheme" not in quant_modifier(e5) and "--kv-cache-dtype fp8_e5m2" in e5


def test_compressed_tensors_kv_cache_scheme_round_trips() -> None:
    cfg = json.loads(json.dumps(to_compressed_tensors_config(uniform("W4A16"), layer_names=LAYERS, kv_cache="FP8")))
    assert cfg["kv_cache_scheme"] == KV_CACHE_FP8_ARGS
    assert kv_cache_of_config(cfg) == kv_cache_of_config({"quantization_config": cfg}) == "FP8"
    assert from_compressed_tensors_config(cfg, layer_names=LAYERS) == uniform("W4A16")
    assert to_compressed_tensors_config(uniform("W4A16"), layer_names=LAYERS)["kv_cache_scheme"] is None
    # compressed-tensors writes every QuantizationArgs field; the ones that do not change the format are ignored
    full = {**KV_CACHE_FP8_ARGS, "group_size": None, "block_structure": None, "observer": "minmax",
            "observer_kwargs": {}, "actorder": None}
    assert kv_cache_of_config({**cfg, "kv_cache_scheme": full}) == "FP8"


@pytest.mark.parametrize("args", [
    {"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False, "symmetric": True},
    {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False, "symmetric": True},
    {"num_bits": 4, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True},
    "fp8",
])
def test_kv_cache_schemes_quantplan_cannot_represent_are_refused(args) -> None:
    cfg = {**to_compressed_tensors_config(uniform("FP8_DYNAMIC"), layer_names=LAYERS), "kv_cache_scheme": args}
    with pytest.raises(PlanError, match="kv_cache_scheme"):
        from_compressed_tensors_config(cfg, layer_names=LAYERS)
    recipe = {"q_stage": {"q_modifiers": {"QuantizationModifier": {"scheme": "FP8_DYNAMIC", "kv_cache_scheme": args}}}}
    with pytest.raises(PlanError, match="kv_cache_scheme"):
        from_llmcompressor_recipe(yaml.safe_dump(recipe), layer_names=LAYERS)


def test_vllm_unquantized_plan() -> None:
    cmd = to_vllm_command(uniform("BF16"), model_path="/m", layer_names=LAYERS)
    assert cmd.splitlines()[-1] == "vllm serve /m"


# ----------------------------------------------------------------- import discipline


def test_export_and_autoplan_are_torch_free() -> None:
    code = (
        "import sys, quantcore.export.llmcompressor, quantcore.export.compressed_tensors, quantcore.export.vllm, "
        "quantcore.planning.autoplan; "
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_plan_for_several_gpus_says_so_on_the_command_line() -> None:
    plan = uniform("FP8_PER_TENSOR")
    cmd = to_vllm_command(plan, model_path="/m", layer_names=LAYERS, kv_cache="FP8_UNSCALED", tensor_parallel=4)
    assert cmd.splitlines()[-1] == "vllm serve /m --quantization fp8 --kv-cache-dtype fp8 --tensor-parallel-size 4"
    cmd = to_vllm_command(uniform("W4A16"), model_path="/m", layer_names=LAYERS, tensor_parallel=2)
    assert cmd.splitlines()[-1] == "vllm serve /m-quantplan --quantization compressed-tensors --tensor-parallel-size 2"
    assert "--tensor-parallel-size" not in to_vllm_command(plan, model_path="/m", layer_names=LAYERS, tensor_parallel=1)
    cmd = to_vllm_command(uniform("FP8_BLOCK"), model_path="/m", layer_names=LAYERS, tensor_parallel=4,
                          expert_parallel=True)
    assert cmd.splitlines()[-1].endswith("--tensor-parallel-size 4 --enable-expert-parallel")


def test_smoothquant_on_every_o_proj_is_one_problem_naming_the_layers() -> None:
    """A plan smoothed on every o_proj (an automatic plan made before it avoided them did that) is refused in one
    line that names the layers and the fix, not one near-identical line per layer."""
    from quantcore.models.mappings import smoothquant_unexportable

    plan = uniform("INT8_W8A8_SQ")
    o_projs = [n for n in LAYERS if n.endswith("o_proj")]
    for n in o_projs:
        plan[n] = get_scheme("INT8_W8A8_SQ")
    assert smoothquant_unexportable(plan) == o_projs
    assert smoothquant_unexportable(uniform("INT8_W8A8_SQ")) == []
    with pytest.raises(PlanError) as err:
        to_llmcompressor_recipe(plan, layer_names=LAYERS)
    msg = str(err.value)
    assert msg.count("\n") == 0 and f"SmoothQuant on {len(o_projs)} layer(s)" in msg
    assert all(n in msg for n in o_projs[:3]) and "e.g. INT8_W8A8 for INT8_W8A8_SQ" in msg
