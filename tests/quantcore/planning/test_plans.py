"""Plan files: parsing, exact round trips, resolution order, and errors that name the culprit."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quantcore.errors import PlanError
from quantcore.planning.footprint import plan_footprint
from quantcore.planning.plans import (
    PlanSpec,
    Rule,
    diff_plans,
    group_label,
    load_plan_file,
    plan_from_scheme,
    resolve_plan,
    save_plan_file,
    scheme_label,
    spec_from_plan,
)
from quantcore.schemes.presets import get_scheme, list_schemes
from quantcore.schemes.storage import weight_storage_bits


def llama_layer_names(n_blocks: int = 2) -> list[str]:
    """Linear layer names of a Llama-style model with ``n_blocks`` decoder blocks, in module order."""
    names = []
    for b in range(n_blocks):
        p = f"model.layers.{b}"
        names += [f"{p}.self_attn.{x}_proj" for x in "qkvo"]
        names += [f"{p}.mlp.{x}_proj" for x in ("gate", "up", "down")]
    return names + ["lm_head"]


LAYERS = llama_layer_names()

EXAMPLE = textwrap.dedent(
    r"""
    model: HuggingFaceTB/SmolLM2-135M-Instruct
    name: mixed
    description: FP8 everywhere, INT8 SmoothQuant on down_proj, head in BF16
    default: FP8_DYNAMIC
    smoothquant_alpha: 0.6
    rules:
      - match: 'mlp\.down_proj$'
        scheme: INT8_W8A8_SQ
      - match: 'layers\.1\.mlp\.down_proj$'
        scheme: INT8_W8A8
    layers:
      lm_head: BF16
      model.layers.0.mlp.down_proj: {scheme: INT8_W8A8_SQ, smoothquant_alpha: 0.8}
    """
)


def test_example_file_resolves_with_documented_precedence():
    spec = PlanSpec.from_yaml(EXAMPLE)
    plan = resolve_plan(spec, LAYERS)
    assert list(plan) == LAYERS
    assert plan["model.layers.0.self_attn.q_proj"] == get_scheme("FP8_DYNAMIC")
    # explicit layer entry with its own alpha wins over rule and global alpha
    assert plan["model.layers.0.mlp.down_proj"].name == "INT8_W8A8_SQ"
    assert plan["model.layers.0.mlp.down_proj"].smoothquant_alpha == 0.8
    # the later rule wins over the earlier one
    assert plan["model.layers.1.mlp.down_proj"] == get_scheme("INT8_W8A8")
    assert plan["lm_head"] == get_scheme("BF16")


def test_global_alpha_only_touches_smoothing_schemes():
    spec = PlanSpec(default="FP8_DYNAMIC", rules=[Rule(r"down_proj$", "INT8_W8A8_SQ")], smoothquant_alpha=0.7)
    plan = resolve_plan(spec, LAYERS)
    assert plan["model.layers.1.mlp.down_proj"].smoothquant_alpha == 0.7
    assert plan["model.layers.1.mlp.up_proj"].smoothquant_alpha is None


def test_layer_alpha_alone_turns_on_smoothing_for_an_activation_scheme():
    spec = PlanSpec.from_yaml(
        "model: m\ndefault: INT8_W8A8\nlayers:\n  model.layers.0.mlp.down_proj: {smoothquant_alpha: 0.55}\n"
    )
    assert spec.layers == {} and spec.layer_alpha == {"model.layers.0.mlp.down_proj": 0.55}
    plan = resolve_plan(spec, LAYERS)
    assert plan["model.layers.0.mlp.down_proj"] == get_scheme("INT8_W8A8").with_alpha(0.55)
    assert plan["model.layers.1.mlp.down_proj"] == get_scheme("INT8_W8A8")


def test_alpha_on_weight_only_layer_is_an_error_naming_it():
    spec = PlanSpec(default="W4A16", layer_alpha={"model.layers.0.mlp.down_proj": 0.5})
    with pytest.raises(PlanError, match=r"model\.layers\.0\.mlp\.down_proj.*W4A16"):
        resolve_plan(spec, LAYERS)


def test_all_problems_are_reported_at_once():
    spec = PlanSpec(
        model="m",
        default="FP9",
        rules=[Rule("attn_out", "FP8"), Rule("mlp(", "FP8"), Rule("down_proj", "INT3")],
        layers={"model.layers.7.mlp.down_proj": "FP8", "lm_head": "bf16"},
        smoothquant_alpha=1.5,
    )
    with pytest.raises(PlanError) as info:
        resolve_plan(spec, LAYERS)
    msg = str(info.value)
    for needle in (
        "'FP9'",  # unknown default
        "'INT3'",  # unknown scheme in a rule
        "'bf16'",  # unknown (case) in layers; the valid list follows
        "'attn_out'",  # rule matching nothing
        "'mlp('",  # invalid regex
        "model.layers.7.mlp.down_proj",  # unknown layer
        "1.5",  # alpha out of range
        "BF16",  # the valid names are listed
    ):
        assert needle in msg, f"{needle!r} missing from:\n{msg}"
    assert "7 problems" in msg


def test_fusion_group_split_is_an_error_naming_group_and_schemes():
    spec = PlanSpec(default="FP8_DYNAMIC", layers={"model.layers.1.self_attn.k_proj": "INT8_W8A8"})
    with pytest.raises(PlanError) as info:
        resolve_plan(spec, LAYERS)
    msg = str(info.value)
    assert "model.layers.1.self_attn.{q,k,v}_proj" in msg
    assert "k_proj=INT8_W8A8" in msg and "q_proj=FP8_DYNAMIC" in msg
    assert "set them together" in msg
    # the same plan passes when fusion is not enforced
    plan = resolve_plan(spec, LAYERS, enforce_fusion=False)
    assert plan["model.layers.1.self_attn.k_proj"].name == "INT8_W8A8"


def test_a_rule_that_splits_every_blocks_group_the_same_way_is_one_problem_with_the_rule_that_mends_it():
    """A rule matching q_proj alone splits every block's q/k/v: one line names the groups and the rule that sets
    each group whole; applying that rule resolves."""
    import re

    spec = PlanSpec(default="BF16", rules=[Rule("q_proj", "INT8_W8A8")])
    with pytest.raises(PlanError) as info:
        resolve_plan(spec, LAYERS)
    msg = str(info.value)
    blocks = len({n.split(".")[2] for n in LAYERS if n.endswith("q_proj")})
    assert "\n" not in msg and f"{blocks} fusion groups ('model.layers.0.self_attn.{{q,k,v}}_proj'" in msg
    assert "(q_proj=INT8_W8A8, k_proj=BF16, v_proj=BF16)" in msg
    (match,) = re.findall(r"\{match: '([^']+)', scheme: INT8_W8A8\}", msg)
    mended = resolve_plan(PlanSpec(default="BF16", rules=[Rule(match, "INT8_W8A8")]), LAYERS)
    assert {n for n, s in mended.items() if s.name == "INT8_W8A8"} == {
        n for n in LAYERS if n.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj")}
    # a rule that splits only blocks 0 and 1: the rule offered sets exactly those groups, not every block's
    spec = PlanSpec(default="BF16", rules=[Rule(r"layers\.[01]\.self_attn\.q_proj", "INT8_W8A8")])
    with pytest.raises(PlanError) as info:
        resolve_plan(spec, LAYERS)
    (match,) = re.findall(r"\{match: '([^']+)', scheme: INT8_W8A8\}", str(info.value))
    mended = resolve_plan(PlanSpec(default="BF16", rules=[Rule(match, "INT8_W8A8")]), LAYERS)
    assert {n for n, s in mended.items() if s.name == "INT8_W8A8"} == {
        f"model.layers.{b}.self_attn.{p}_proj" for b in (0, 1) for p in "qkv"}
    # a group whose members differ only in their alpha: one alpha for the group, not a scheme rule
    spec = PlanSpec(default="INT8_W8A8_SQ", layer_alpha={f"model.layers.{b}.self_attn.q_proj": 0.8 for b in (0, 1)})
    with pytest.raises(PlanError) as info:
        resolve_plan(spec, LAYERS)
    assert "2 fusion group(s)" in str(info.value) and "give the whole group one smoothquant_alpha" in str(info.value)
    assert "match:" not in str(info.value)


def test_fusion_group_with_different_alphas_is_an_error():
    spec = PlanSpec(default="INT8_W8A8_SQ", layer_alpha={"model.layers.0.mlp.gate_proj": 0.8})
    with pytest.raises(PlanError, match=r"model\.layers\.0\.mlp\.\{gate,up\}_proj.*alpha=0\.8"):
        resolve_plan(spec, LAYERS)


@pytest.mark.parametrize(
    "text, needle",
    [
        ("default: FP8\nextra: 1\n", "'extra'"),
        ("default: FP8\nrules: {a: b}\n", "'rules' must be a list"),
        ("default: FP8\nrules:\n  - {match: x}\n", "rule 1"),
        ("default: FP8\nlayers:\n  lm_head: [FP8]\n", "lm_head"),
        ("default: FP8\nsmoothquant_alpha: high\n", "smoothquant_alpha"),
        ("default: [1, 2\n", "not valid YAML"),
        ("", "empty"),
        ("- FP8\n", "mapping"),
    ],
)
def test_malformed_files_are_plan_errors(text, needle):
    with pytest.raises(PlanError, match=None) as info:
        PlanSpec.from_yaml(text)
    assert needle in str(info.value)


def test_a_yaml_mistake_is_told_in_one_line_with_the_file_and_where(tmp_path):
    from quantcore.planning.plans import load_plan_file

    path = tmp_path / "typo.yaml"
    path.write_text('default: FP8\nrules:\n  - {match: "layers\\.(0|29)", scheme: BF16}\n')
    with pytest.raises(PlanError) as info:
        load_plan_file(path)
    said = str(info.value)
    assert "\n" not in said and said.startswith(f"plan file {str(path)!r} is not valid YAML: found unknown escape")
    assert "at line 3, column 21" in said and "single quotes" in said
    path.write_text("default: FP8\nrules:\n  - {match: 'layers\\.(0|29)', scheme: BF16}\n")  # as it says
    assert load_plan_file(path).rules[0].match == "layers\\.(0|29)"


def test_a_misspelt_kv_cache_is_one_problem_not_two():
    with pytest.raises(PlanError) as info:
        PlanSpec.from_yaml("default: FP8\nkv_cache: FP8_E4M3\nkv_cache_skip: [0]\n")
    assert "unknown KV cache format 'FP8_E4M3'" in str(info.value) and "is AUTO" not in str(info.value)
    for kv in ("", "kv_cache: AUTO\n"):  # a skip list with no cache format, or with AUTO said
        with pytest.raises(PlanError, match="but 'kv_cache' is AUTO"):
            PlanSpec.from_yaml(f"default: FP8\n{kv}kv_cache_skip: [0]\n")


def test_yaml_never_builds_python_objects():
    with pytest.raises(PlanError):
        PlanSpec.from_yaml("default: !!python/object/apply:os.system ['true']\n")


def test_file_round_trip(tmp_path):
    spec = PlanSpec.from_yaml(EXAMPLE)
    path = save_plan_file(spec, tmp_path / "plan.yaml")
    again = load_plan_file(path)
    assert again == spec
    assert again.to_yaml() == spec.to_yaml()
    assert PlanSpec.from_dict(spec.to_dict()).to_dict() == spec.to_dict()
    with pytest.raises(PlanError, match="missing.yaml"):
        load_plan_file(tmp_path / "missing.yaml")


_names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz._0123456789", min_size=1, max_size=20)
_schemes = st.sampled_from(list_schemes())
_alphas = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)


@st.composite
def plan_specs(draw):
    layers = draw(st.dictionaries(_names, _schemes, max_size=5))
    alpha_keys = draw(st.lists(_names, max_size=3, unique=True))
    return PlanSpec(
        model=draw(st.none() | _names),
        default=draw(_schemes),
        rules=[Rule(m, s) for m, s in draw(st.lists(st.tuples(_names, _schemes), max_size=4))],
        layers=layers,
        smoothquant_alpha=draw(st.none() | _alphas),
        layer_alpha={k: draw(_alphas) for k in alpha_keys},
        name=draw(st.none() | _names),
        description=draw(st.text(max_size=30)),
    )


@pytest.mark.parametrize("text", ["\x85", "a\u2028b", "x\u2029", " \x85 ", "a\x85\nb", "é × ü", "plain"])
def test_text_with_unicode_line_breaks_round_trips(text):
    # PyYAML writes these breaks raw inside a quoted scalar and reads them back as a space
    spec = PlanSpec(default="FP8_DYNAMIC", name="p", description=text)
    assert PlanSpec.from_yaml(spec.to_yaml()).description == text
    assert ("\\N" in spec.to_yaml()) == ("\x85" in text)


@settings(max_examples=60, deadline=None)
@given(plan_specs())
def test_round_trip_is_exact_for_any_spec(spec):
    assert PlanSpec.from_dict(spec.to_dict()) == spec
    assert PlanSpec.from_yaml(spec.to_yaml()) == spec


def test_plan_from_scheme_and_unknown_scheme():
    spec = plan_from_scheme("NVFP4", LAYERS, model="m")
    assert set(s.name for s in resolve_plan(spec, LAYERS).values()) == {"NVFP4"}
    with pytest.raises(PlanError, match="'FP7'.*FP8"):
        plan_from_scheme("FP7")


def test_spec_from_plan_inverts_resolve():
    plan = resolve_plan(PlanSpec.from_yaml(EXAMPLE), LAYERS)
    spec = spec_from_plan(plan, model="m")
    assert spec.default == "FP8_DYNAMIC"
    assert resolve_plan(spec, LAYERS) == plan
    custom = get_scheme("FP8_DYNAMIC").__class__("MINE", None, None)
    with pytest.raises(PlanError, match="'MINE'"):
        spec_from_plan({"lm_head": custom})


def test_diff_plans_lists_only_changed_layers_with_alpha_labels():
    a = {"x": get_scheme("FP8"), "y": get_scheme("INT8_W8A8_SQ"), "z": "BF16"}
    b = {"x": "FP8", "y": get_scheme("INT8_W8A8_SQ").with_alpha(0.6), "w": "FP8"}
    assert diff_plans(a, b) == [
        ("y", "INT8_W8A8_SQ", "INT8_W8A8_SQ (alpha=0.6)"),
        ("z", "BF16", None),
        ("w", None, "FP8"),
    ]
    assert diff_plans(a, a) == []
    assert scheme_label(get_scheme("INT8_W8A8_SQ")) == "INT8_W8A8_SQ"


def test_group_label():
    assert group_label(["a.q_proj", "a.k_proj", "a.v_proj"]) == "a.{q,k,v}_proj"
    assert group_label(["m.mlp.gate_proj", "m.mlp.up_proj"]) == "m.mlp.{gate,up}_proj"
    assert group_label(["lm_head"]) == "lm_head"


def test_plans_module_is_torch_free():
    code = "import sys, quantcore.planning.plans; assert 'torch' not in sys.modules, 'plans imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------- weight footprint


def _llama_shapes(names):
    """(N, K) of a small Llama: hidden 64, kv 32, intermediate 128, vocab 100."""
    leaf = {"q_proj": (64, 64), "k_proj": (32, 64), "v_proj": (32, 64), "o_proj": (64, 64),
            "gate_proj": (128, 64), "up_proj": (128, 64), "down_proj": (64, 128), "lm_head": (100, 64)}
    return {n: leaf[n.rsplit(".", 1)[-1]] for n in names}


def test_plan_footprint_sums_every_layer_by_scheme():
    shapes = _llama_shapes(LAYERS)
    spec = PlanSpec.from_dict({"default": "FP8_DYNAMIC", "rules": [{"match": "lm_head", "scheme": "BF16"},
                                                                   {"match": "mlp", "scheme": "NVFP4A16"}],
                               "layers": {"model.layers.1.mlp.down_proj": {"scheme": "INT8_W8A8_SQ",
                                                                           "smoothquant_alpha": 0.7}}})
    resolved = resolve_plan(spec, LAYERS)
    fp = plan_footprint(resolved, shapes)
    rows = {r.scheme: r for r in fp.rows}
    assert set(rows) == {"FP8_DYNAMIC", "NVFP4A16", "BF16", "INT8_W8A8_SQ (alpha=0.7)"}
    assert rows["FP8_DYNAMIC"].layers == 8 and rows["NVFP4A16"].layers == 5 and rows["BF16"].layers == 1
    assert sum(r.layers for r in fp.rows) == len(LAYERS)
    assert fp.params == sum(n * k for n, k in shapes.values())
    assert fp.bf16_bits == 16 * fp.params
    expected = sum(weight_storage_bits(resolved[n], *shapes[n]) for n in LAYERS)
    assert fp.bits == expected and fp.ratio == pytest.approx(expected / fp.bf16_bits)
    assert [r.bits for r in fp.rows] == sorted((r.bits for r in fp.rows), reverse=True)
    assert rows["BF16"].bits_per_weight == 16.0
    d = fp.to_dict()
    assert d["bytes"] == fp.bits / 8 and [x["scheme"] for x in d["schemes"]] == [r.scheme for r in fp.rows]
    # an all-BF16 plan keeps everything; a 4-bit one keeps about a quarter plus the scales
    assert plan_footprint(dict.fromkeys(LAYERS, get_scheme("BF16")), shapes).ratio == 1.0
    nv = plan_footprint(dict.fromkeys(LAYERS, get_scheme("NVFP4")), shapes)
    assert 4 / 16 < nv.ratio < 4.6 / 16


def test_plan_footprint_names_layers_without_a_shape():
    shapes = _llama_shapes(LAYERS)
    del shapes["lm_head"]
    with pytest.raises(ValueError, match="lm_head"):
        plan_footprint(dict.fromkeys(LAYERS, get_scheme("FP8")), shapes)


def test_pareto_front_keeps_the_plans_no_other_plan_beats():
    from quantcore.planning.plans import pareto_front

    # (cost, KL): BF16 is the best KL, W4 the cheapest, FP8 in between; INT8 costs more than FP8 for more KL
    points = [(100.0, 0.0), (50.0, 0.05), (52.0, 0.9), (25.0, 0.95)]
    assert pareto_front(points) == [True, True, False, True]
    assert pareto_front([(1.0, 1.0), (1.0, 1.0)]) == [True, True]  # equal points: neither beats the other
    assert pareto_front([(1.0, 2.0), (1.0, 1.0)]) == [False, True]  # same cost, lower KL wins
    assert pareto_front([(2.0, 1.0), (1.0, 1.0)]) == [False, True]  # same KL, lower cost wins
    # no cost (no kernel time measured): never on the front, and beats nothing
    assert pareto_front([(None, 0.0), (float("nan"), 0.0), (5.0, 1.0)]) == [False, False, True]
    assert pareto_front([]) == []


def test_group_misfits_name_the_layers_a_group_kernel_cannot_serve():
    from quantcore.planning.serving import group_misfit_layers, group_misfits

    shapes = {"a.q_proj": (576, 576), "a.down_proj": (576, 1536), "lm_head": (49152, 576)}
    # W4A16 groups of 128: 576 = 4.5 groups (a partial one), 1536 = 12 groups
    [msg] = group_misfits({n: "W4A16" for n in shapes}, shapes)
    assert msg.startswith("W4A16: groups of 128 do not divide K of 2 layer(s) (K = 576, e.g. a.q_proj)")
    assert "another scheme" in msg
    # NVFP4's groups of 16 (weights and activations) and per-channel schemes fit every K here
    assert group_misfits({n: "NVFP4" for n in shapes}, shapes) == []
    assert group_misfits({n: "FP8_DYNAMIC" for n in shapes}, shapes) == []
    mixed = {"a.q_proj": "FP8_DYNAMIC", "a.down_proj": "W4A16", "lm_head": "W4A16"}
    [msg] = group_misfits(mixed, shapes)
    assert "of 1 layer(s) (K = 576, e.g. lm_head)" in msg
    assert group_misfit_layers(mixed, shapes) == {"lm_head"}
    assert group_misfit_layers({n: "W4A16" for n in shapes}, shapes) == {"a.q_proj", "lm_head"}
    # a K smaller than the group is not a whole group either
    assert group_misfits({"tiny": "W4A16"}, {"tiny": (64, 64)})


@pytest.mark.parametrize("suffix", ["", "_GPTQ", "_AWQ"])
def test_group_misfits_point_at_the_preset_whose_groups_fit(suffix):
    """A W4A16 plan on SmolLM2 (K = 576 = 9 x 64) is told which preset serves: the same rounding in groups of 64."""
    from quantcore.planning.serving import group_misfits

    shapes = {"a.q_proj": (576, 576), "a.down_proj": (576, 1536)}
    [msg] = group_misfits({n: f"W4A16{suffix}" for n in shapes}, shapes)
    assert msg.endswith(f"keep those layers in another scheme, such as W4A16_G64{suffix}, whose groups of 64 "
                        "divide them")
    assert group_misfits({n: f"W4A16_G64{suffix}" for n in shapes}, shapes) == []
    # neither 128 nor 64 divides K = 96, 32 does; no group divides 100: one scale per output channel takes any K
    [msg] = group_misfits({"odd": f"W4A16{suffix}"}, {"odd": (64, 96)})
    assert msg.endswith(f"another scheme, such as W4A16_G32{suffix}, whose groups of 32 divide them")
    [msg] = group_misfits({"odd": f"W4A16{suffix}"}, {"odd": (64, 100)})
    assert msg.endswith(f"another scheme, such as W4A16_CHANNEL{suffix}, with one scale per output channel, which "
                        "any K takes")
    assert group_misfits({"odd": f"W4A16_CHANNEL{suffix}"}, {"odd": (64, 100)}) == []
    # with zero points there is no per-channel preset: the message says so without a suggestion
    [msg] = group_misfits({"odd": f"W4A16_ASYM{suffix}"}, {"odd": (64, 100)})
    assert msg.endswith("keep those layers in another scheme")



def test_regroup_fixes_name_the_preset_for_exactly_the_layers_it_mends():
    from quantcore.planning.serving import regroup_fixes

    shapes = {"a.q_proj": (576, 576), "a.k_proj": (192, 576), "a.down_proj": (576, 1536), "b": (64, 96),
              "c": (64, 100), "d": (64, 100)}
    plan = {**dict.fromkeys(shapes, "W4A16_GPTQ"), "d": "W4A16_ASYM"}
    assert regroup_fixes(plan, shapes) == {"W4A16_G64_GPTQ": ["a.q_proj", "a.k_proj"], "W4A16_G32_GPTQ": ["b"],
                                           "W4A16_CHANNEL_GPTQ": ["c"]}  # d: no per-channel preset with zero points
    # FP8_BLOCK's misfit is its activations' groups: no weight regrouping mends that
    assert regroup_fixes({"a.q_proj": "FP8_BLOCK"}, shapes) == {}
    assert regroup_fixes(dict.fromkeys(shapes, "FP8_DYNAMIC"), shapes) == {}


def test_fp8_block_misfits_name_merged_layers_whose_n_the_blocks_do_not_divide():
    """vLLM's validate_fp8_block_shape: every output partition of a merged q/k/v or gate/up GEMM but the last must be
    a whole number of 128-row blocks; a layer loaded alone (o_proj, down_proj) takes any N on one GPU."""
    from quantcore.planning.serving import fp8_block_misfits, fp8_block_untileable, group_misfits

    p = "model.layers.0"
    shapes = {f"{p}.self_attn.q_proj": (2048, 2048), f"{p}.self_attn.k_proj": (256, 2048),
              f"{p}.self_attn.v_proj": (256, 2048), f"{p}.self_attn.o_proj": (2000, 2048),
              f"{p}.mlp.gate_proj": (5632, 2048), f"{p}.mlp.up_proj": (5632, 2048), f"{p}.mlp.down_proj": (2048, 5632)}
    assert fp8_block_misfits({n: "FP8_BLOCK" for n in shapes}, shapes) == []  # o_proj's 2000 is loaded alone
    shapes[f"{p}.self_attn.k_proj"] = shapes[f"{p}.self_attn.v_proj"] = (64, 2048)
    [msg] = fp8_block_misfits({n: "FP8_BLOCK" for n in shapes}, shapes)
    assert msg.startswith("FP8 blocks of 128 rows do not divide N of 1 layer(s) vLLM loads merged with the next "
                          f"(q/k/v, gate/up; the last member may end in a partial block) (N = 64, e.g. "
                          f"{p}.self_attn.k_proj)")  # v_proj, the last of q/k/v, may end in a partial block
    # the layers it is about: the whole merged q/k/v, which vLLM refuses as one layer
    assert fp8_block_untileable({n: "FP8_BLOCK" for n in shapes}, shapes) == {
        f"{p}.self_attn.{x}_proj" for x in "qkv"}
    shapes[f"{p}.self_attn.k_proj"] = (256, 2048)
    assert fp8_block_misfits({n: "FP8_BLOCK" for n in shapes}, shapes) == []  # only v_proj's 64 is partial
    shapes[f"{p}.self_attn.k_proj"] = (64, 2048)
    assert fp8_block_misfits({n: "FP8_DYNAMIC" for n in shapes}, shapes) == []
    # FP8_BLOCK's groups are its activations' (1 x 128): llm-compressor takes any K, vLLM's activation quant does not
    shapes[f"{p}.mlp.down_proj"] = (2048, 5400)
    [msg] = group_misfits({n: "FP8_BLOCK" for n in shapes}, shapes)
    assert "K = 5400" in msg and "llm-compressor accepts the recipe" in msg and "per_token_group_quant_fp8" in msg
    [msg] = group_misfits({f"{p}.mlp.down_proj": "W4A16"}, shapes)
    assert "llm-compressor's oneshot refuses such a recipe" in msg  # a group of weights


def test_activations_vllm_runs_otherwise_than_scored_are_named():
    """vLLM's INT8 W8A8 takes calibrated per-tensor or dynamic per-token activation scales only; its checkpoint FP8
    quantizes every dynamic activation per token; its online FP8 (the whole plan FP8_PER_TENSOR) per tensor."""
    from quantcore.export.vllm import serves_online_fp8
    from quantcore.planning.serving import vllm_activation_misfits

    layers = ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj", "lm_head"]
    [msg] = vllm_activation_misfits({n: "INT8_PER_TENSOR_SQ" for n in layers})
    assert msg.startswith("INT8 with dynamic per-tensor activations on 3 layer(s)") and "does not load" in msg
    assert vllm_activation_misfits({n: s for n, s in zip(layers, ["INT8_W8A8", "INT8_W8A8_SQ", "FP8"],
                                                          strict=True)}) == []  # per token, and calibrated FP8
    online = {**dict.fromkeys(layers, "FP8_PER_TENSOR"), "lm_head": "BF16"}
    assert serves_online_fp8(online, layers) and vllm_activation_misfits(online, online_fp8=True) == []
    mixed = {**online, "model.layers.0.mlp.down_proj": "FP8_DYNAMIC"}
    assert not serves_online_fp8(mixed, layers) and not serves_online_fp8(online, layers, "FP8")  # a checkpoint
    [msg] = vllm_activation_misfits(mixed)
    assert msg.startswith("FP8 with dynamic per-tensor activations on 1 layer(s) ('model.layers.0.self_attn.q_proj')")
    assert "per token" in msg
    experts = {"model.layers.0.mlp.experts.0.down_proj": "INT8_PER_TENSOR"}  # moe_unserved's message, not this one
    assert vllm_activation_misfits(experts) == []


def test_w4afp8_misfits_count_n_as_vllm_fuses_the_layers():
    """vLLM's CUTLASS W4A8 kernel wants N and K multiples of 128 for the layer it loads: q/k/v as one qkv_proj."""
    from quantcore.planning.serving import w4afp8_misfits

    p = "model.layers.0"
    shapes = {f"{p}.self_attn.q_proj": (2048, 2048), f"{p}.self_attn.k_proj": (64, 2048),
              f"{p}.self_attn.v_proj": (64, 2048), f"{p}.self_attn.o_proj": (2048, 2048),
              f"{p}.mlp.gate_proj": (5440, 2048), f"{p}.mlp.up_proj": (5440, 2048), f"{p}.mlp.down_proj": (2048, 5440)}
    # qkv: 2048 + 64 + 64 = 2176 = 17 x 128 fits, though k_proj alone (64) would not; gate/up: 10,880 = 85 x 128
    assert w4afp8_misfits({n: "W4AFP8" for n in shapes}, shapes) == []
    shapes[f"{p}.self_attn.k_proj"] = shapes[f"{p}.self_attn.v_proj"] = (96, 2048)  # qkv N = 2240
    shapes[f"{p}.mlp.down_proj"] = (2000, 5440)
    [msg] = w4afp8_misfits({n: "W4AFP8_GPTQ" for n in shapes}, shapes)
    assert msg.startswith("W4AFP8 on 2 layer(s) as vLLM loads them (q/k/v and gate/up fused) whose output width N "
                          f"is not a multiple of 128 (N = 2000, 2240, e.g. {p}.self_attn.{{q,k,v}}_proj)")
    # only W4AFP8 layers count: W4A16 is served by Marlin, which pads N
    assert w4afp8_misfits({n: "W4A16" for n in shapes}, shapes) == []
    assert "down_proj" in w4afp8_misfits({f"{p}.mlp.down_proj": "W4AFP8"}, shapes)[0]


def test_a_quantized_head_is_warned_about_and_a_tied_one_costs_its_embedding_again():
    from quantcore.planning.serving import quantized_head, untied_embedding_bits

    shapes = {"b.mlp.down_proj": (576, 1536), "lm_head": (49152, 576)}
    bf16_head = {"b.mlp.down_proj": "W4A16", "lm_head": "BF16"}
    assert quantized_head(bf16_head, shapes, ["lm_head"]) == []
    assert untied_embedding_bits(bf16_head, shapes, ["lm_head"]) == 0
    q_head = {"b.mlp.down_proj": "W4A16", "lm_head": "W4A16_G64"}
    # untied: the serving engine must load a quantized head, nothing more
    [msg] = quantized_head(q_head, shapes, [])
    assert msg.startswith("lm_head is quantized (W4A16_G64): check that your serving engine loads a quantized head")
    assert "vllm-project/vllm#37291" in msg and "ties" not in msg
    assert untied_embedding_bits(q_head, shapes, []) == 0
    # tied (SmolLM2): llm-compressor unties, the 16-bit embedding stays beside the quantized head
    assert untied_embedding_bits(q_head, shapes, ["lm_head"]) == 16 * 49152 * 576
    [msg] = quantized_head(q_head, shapes, ["lm_head"])
    assert "ties lm_head to its input embeddings" in msg and "54.0 MiB more" in msg


def test_awq_unscaled_names_layers_awq_has_nothing_to_fold_into():
    from quantcore.planning.serving import awq_unscaled

    gqa = {"b.self_attn.v_proj": (128, 576), "b.self_attn.o_proj": (576, 576), "b.mlp.down_proj": (576, 1536),
           "lm_head": (1000, 576)}
    mha = dict(gqa, **{"b.self_attn.v_proj": (576, 576)})
    plan = dict.fromkeys(gqa, "W4A16_AWQ")
    (msg,) = awq_unscaled(plan, gqa)
    assert "2 layer(s)" in msg and "b.self_attn.o_proj" in msg and "lm_head" in msg
    (msg,) = awq_unscaled(plan, mha)  # without GQA, o_proj's factors fold into v_proj's rows
    assert "1 layer(s) ('lm_head')" in msg
    assert awq_unscaled({**plan, "lm_head": "W4A16"}, mha) == []
    assert awq_unscaled(dict.fromkeys(gqa, "W4A16"), gqa) == []
