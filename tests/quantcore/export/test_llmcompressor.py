"""Exported recipes against the real llm-compressor 0.14.0.1 (in its own virtual environment).

llmcompressor pins transformers<=5.17 while quantplan uses 5.24, so it lives in ``.venv-llmc``
(``scripts/llmc_env.sh`` creates it, idempotently). ``scripts/llmc_check.py`` runs there: it loads
every recipe with ``Recipe.create_instance``, applies each quantization modifier's config to a
tiny random Llama with compressed-tensors' own ``apply_quantization_config`` and resolves each
SmoothQuantModifier's mappings on it with llm-compressor's own resolver. These tests compare that
with the plan that was exported: what every layer really gets, which layers are smoothed with
which strength into which norm, and the preset tables quantplan embeds.

The first run builds the environment (about 1.5 GB, 2-4 minutes here); later runs reuse it.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from quantcore.algorithms.inputs import PlanInputs
from quantcore.evaluation.kvcache import get_kv_format
from quantcore.export.llmcompressor import to_llmcompressor_recipe
from quantcore.export.quant_args import CT_ARG_KEYS, CT_PRESETS, kv_cache_scheme, scheme_from_ct_args
from quantcore.export.vllm import to_vllm_command
from quantcore.schemes.presets import get_scheme
from quantcore.schemes.specs import Scheme
from tests.factories import EXPRESSIBLE, LAYERS, N_BLOCKS, uniform

# every test of this module on one pytest-xdist worker (./dev.sh runs --dist loadgroup): its module fixture's
# setup, the slow part, then runs once instead of once on each worker
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("llmcompressor")]

REPO = Path(__file__).resolve().parents[3]
LLMC_PYTHON = REPO / ".venv-llmc" / "bin" / "python"
ENV_TIMEOUT_S = 1800  # a first build on a slow mirror; a warm environment returns at once
CHECK_TIMEOUT_S = 600  # one llmc_check.py run: ~20 s to import llmcompressor, then milliseconds per recipe


def mixed_preset_plan() -> dict[str, Scheme]:
    plan = uniform("FP8_DYNAMIC")
    for n in LAYERS:
        if n.startswith("model.layers.1.self_attn.") and not n.endswith("o_proj"):
            plan[n] = get_scheme("W4A16")
        if n.endswith("down_proj"):
            plan[n] = get_scheme("INT8_W8A8")
    plan["model.layers.2.mlp.down_proj"] = get_scheme("NVFP4A16")
    return plan


def mixed_explicit_plan() -> dict[str, Scheme]:
    """W8A16 (per channel) and FP8_PER_TENSOR have no llm-compressor preset: explicit config_groups."""
    plan = uniform("W8A16")
    for n in LAYERS:
        if n.endswith(("gate_proj", "up_proj")):
            plan[n] = get_scheme("FP8_PER_TENSOR")
    plan["model.layers.0.self_attn.o_proj"] = get_scheme("BF16")
    return plan


def smoothquant_plan() -> dict[str, Scheme]:
    """Two strengths; some blocks smoothed, others not: per-block mappings and two SmoothQuantModifiers."""
    plan = uniform("INT8_W8A8")
    for n in LAYERS:
        if n.startswith("model.layers.0.") and not n.endswith("o_proj"):
            plan[n] = get_scheme("INT8_W8A8_SQ")
        if n.endswith("down_proj") and ".0." not in n:
            plan[n] = get_scheme("INT8_W8A8_SQ").with_alpha(0.8)
    plan["model.layers.2.mlp.gate_proj"] = plan["model.layers.2.mlp.up_proj"] = get_scheme(
        "FP8_DYNAMIC"
    ).with_alpha(0.6)
    return plan


# cases exported with a KV cache format: FP8's calibrated scales are a kv_cache_scheme in the recipe
KV_CASES = {"kv-fp8-with-fp8-dynamic": "FP8", "kv-fp8-alone": "FP8", "kv-e5m2-with-w4a16": "FP8_E5M2",
            "kv-fp8-per-head-with-fp8-dynamic": "FP8_ATTN_HEAD", "kv-fp8-with-w4a16-gptq": "FP8",
            "kv-fp8-with-mixed-gptq": "FP8"}


def cases() -> dict[str, dict[str, Scheme]]:
    out = {f"uniform-{name}": uniform(name) for name in EXPRESSIBLE}
    out["mixed-presets"] = mixed_preset_plan()
    out["mixed-explicit"] = mixed_explicit_plan()
    out["smoothquant"] = smoothquant_plan()
    out["kv-fp8-with-fp8-dynamic"] = uniform("FP8_DYNAMIC")
    out["kv-fp8-alone"] = uniform("BF16")
    out["kv-e5m2-with-w4a16"] = uniform("W4A16")
    out["kv-fp8-per-head-with-fp8-dynamic"] = uniform("FP8_DYNAMIC")
    out["mixed-gptq"] = mixed_gptq_plan()
    out["kv-fp8-with-w4a16-gptq"] = uniform("W4A16_GPTQ")
    out["kv-fp8-with-mixed-gptq"] = mixed_gptq_plan()
    out["awq"] = awq_plan()
    out["awq-with-gptq-o-proj"] = {n: get_scheme("W4A16_GPTQ") if n.endswith("o_proj") else sc
                                   for n, sc in uniform("W4A16_AWQ").items()}
    return out


def awq_plan(base: str = "W4A16") -> dict[str, Scheme]:
    """AWQ on every layer of block 1 and on every down_proj, ``base`` rounded to nearest elsewhere, lm_head BF16."""
    plan = uniform(base)
    for n in LAYERS:
        if n.startswith("model.layers.1.") or n.endswith("down_proj"):
            plan[n] = get_scheme(f"{base}_AWQ")
    return plan


def mixed_gptq_plan() -> dict[str, Scheme]:
    """GPTQ on the MLPs, FP8 rounded to nearest elsewhere: one GPTQModifier for every quantized layer."""
    plan = uniform("FP8_DYNAMIC")
    for n in LAYERS:
        if ".mlp." in n:
            plan[n] = get_scheme("W4A16_GPTQ")
    return plan


@pytest.fixture(scope="module")
def llmc(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any]]:
    """(cases: name -> (plan, recipe text), llmc_check.py's JSON summary)."""
    env = subprocess.run(
        ["bash", str(REPO / "scripts" / "llmc_env.sh")],
        capture_output=True,
        text=True,
        timeout=ENV_TIMEOUT_S,
        cwd=REPO,
    )
    assert env.returncode == 0, f"scripts/llmc_env.sh failed:\n{env.stdout[-3000:]}\n{env.stderr[-3000:]}"
    folder = tmp_path_factory.mktemp("recipes")
    made: dict[str, Any] = {}
    for name, plan in cases().items():
        text = to_llmcompressor_recipe(plan, layer_names=LAYERS, kv_cache=KV_CASES.get(name))
        path = folder / f"{name}.yaml"
        path.write_text(text, encoding="utf-8")
        made[name] = (plan, text, str(path))
    cmd = [
        str(LLMC_PYTHON),
        str(REPO / "scripts" / "llmc_check.py"),
        *(p for _, _, p in made.values()),
        "--llama-blocks",
        str(N_BLOCKS),
        "--presets",
        *CT_PRESETS,
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S, cwd=REPO)
    assert run.stdout.strip(), f"llmc_check.py printed nothing (rc {run.returncode}):\n{run.stderr[-3000:]}"
    summary = json.loads(run.stdout)
    errors = {p: r["error"] for p, r in summary["recipes"].items() if "error" in r}
    assert not errors and run.returncode == 0, f"llm-compressor refused exported recipes: {errors}"
    return made, summary


def modifiers(summary: dict[str, Any], path: str, kind: str) -> list[dict[str, Any]]:
    return [m for m in summary["recipes"][path]["modifiers"] if m["type"] == kind]


def test_versions_are_the_pinned_ones(llmc) -> None:
    _, summary = llmc
    assert summary["versions"]["llmcompressor"] == "0.14.0.1"
    assert summary["versions"]["compressed-tensors"] == "0.19.0"


@pytest.mark.parametrize("name", list(cases()))
def test_every_layer_gets_the_planned_quantization(llmc, name: str) -> None:
    made, summary = llmc
    plan, _, path = made[name]
    gptq = modifiers(summary, path, "GPTQModifier")
    rtn = modifiers(summary, path, "QuantizationModifier")
    # GPTQ layers go to a GPTQModifier, the others to a QuantizationModifier (or its KV cache scheme)
    assert len(gptq) == any(s.gptq for s in plan.values())
    kv_alone = name in KV_CASES and all(s.is_identity for s in plan.values())
    assert len(rtn) == (any(not s.gptq and not s.is_identity for s in plan.values()) or kv_alone)
    if all(s.is_identity for s in plan.values()) and name not in KV_CASES:
        assert gptq == rtn == []
        return
    for mod in gptq + rtn:
        assert set(mod["layers"]) == set(LAYERS)
    for layer in LAYERS:
        want = plan[layer]
        # a KV-cache-only recipe attaches an empty scheme (no weights, no activations) to the linears
        got = [(mod["type"], mod["layers"][layer]) for mod in gptq + rtn
               if mod["layers"][layer] not in (None, {"weights": None, "input_activations": None})]
        if want.is_identity:
            assert got == [], f"{layer} should stay BF16, llm-compressor quantizes it"
            continue
        assert len(got) == 1, f"{layer} should be {want.name}, llm-compressor quantizes it {len(got)} times"
        (mod_type, args), = got
        # what compressed-tensors attached to the module, read back as a quantplan scheme
        real = scheme_from_ct_args(args["weights"], args["input_activations"], alpha=want.smoothquant_alpha,
                                   gptq=mod_type == "GPTQModifier", awq=want.awq)
        assert real == want, f"{layer}: planned {want.name}, llm-compressor applies {real.name} ({mod_type})"


@pytest.mark.parametrize("name", [n for n, p in cases().items() if any(s.gptq for s in p.values())])
def test_gptq_modifier_runs_gptq_as_quantcore_does(llmc, name: str) -> None:
    """block size, dampening and activation order of the exported GPTQModifier are quantcore.algorithms.gptq's."""
    from quantcore.schemes.specs import GPTQ_ACTORDER, GPTQ_BLOCK_SIZE, GPTQ_DAMPENING

    made, summary = llmc
    _, text, path = made[name]
    (mod,) = modifiers(summary, path, "GPTQModifier")
    assert mod["gptq"] == {"block_size": GPTQ_BLOCK_SIZE, "dampening_frac": GPTQ_DAMPENING}
    assert mod["requires_calibration_data"] and "needs a dataset" in text
    orders = {g["weights"]["actorder"] for g in mod["config_groups"].values() if g["weights"]}
    assert orders <= {GPTQ_ACTORDER, "weight"}, orders  # llm-compressor resolves "static" to its alias "weight"
    assert orders


@pytest.mark.parametrize("name", ["awq", "uniform-W4A16_AWQ", "awq-with-gptq-o-proj"])
def test_awq_modifier_searches_exactly_the_planned_folds(llmc, name: str) -> None:
    """The exported AWQModifier runs quantcore.algorithms.awq's grid and resolves to exactly the folds quantcore
    searches for the plan's AWQ layers: q/k/v into input_layernorm, gate/up into post_attention_layernorm, down_proj
    into up_proj, and no v_proj -> o_proj (grouped-query attention, skipped by both)."""
    from quantcore.schemes.specs import AWQ_DUO_SCALING, AWQ_N_GRID

    made, summary = llmc
    plan, text, path = made[name]
    (mod,) = modifiers(summary, path, "AWQModifier")
    assert mod["awq"] == {"duo_scaling": AWQ_DUO_SCALING, "n_grid": AWQ_N_GRID}
    assert mod["requires_calibration_data"] and "needs a dataset" in text
    kinds = {"q_proj": "input_layernorm", "gate_proj": "post_attention_layernorm"}
    want = []
    for n, s in plan.items():
        leaf, block = n.rsplit(".", 1)[-1], n.rsplit(".", 2)[0]
        if not s.awq:
            continue
        if leaf in kinds:
            sub = n.rsplit(".", 1)[0]
            members = [f"{sub}.{x}" for x in (("q_proj", "k_proj", "v_proj") if leaf == "q_proj"
                                               else ("gate_proj", "up_proj"))]
            want.append([f"{block}.{kinds[leaf]}", members])
        elif leaf == "down_proj":
            want.append([n.rsplit(".", 1)[0] + ".up_proj", [n]])
    assert sorted(mod["resolved_mappings"]) == sorted(want)
    # and the QuantizationModifier after it rounds every AWQ layer as the plan's W4A16
    (quant,) = modifiers(summary, path, "QuantizationModifier")
    layers = quant["layers"]
    assert all(layers[n]["weights"]["num_bits"] == 4 for n, s in plan.items() if s.awq)


@pytest.mark.parametrize("name", list(cases()))
def test_smoothing_strengths_and_resolved_mappings(llmc, name: str) -> None:
    made, summary = llmc
    plan, text, path = made[name]
    ours = [
        g["SmoothQuantModifier"]
        for k, g in yaml.safe_load(text)["quant_stage"].items()
        if "SmoothQuantModifier" in g
    ]
    theirs = modifiers(summary, path, "SmoothQuantModifier")
    assert [(m["smoothing_strength"], m["mappings"]) for m in theirs] == [
        (m["smoothing_strength"], m["mappings"]) for m in ours
    ]
    smoothed: dict[str, float] = {}
    for m in theirs:
        for smooth, balance in m["resolved_mappings"]:
            for layer in balance:
                assert layer not in smoothed, f"{layer} smoothed twice"
                smoothed[layer] = m["smoothing_strength"]
                leaf = layer.rsplit(".", 1)[-1]
                block = layer.rsplit(".", 2)[0]
                expected = {
                    "q_proj": f"{block}.input_layernorm",
                    "k_proj": f"{block}.input_layernorm",
                    "v_proj": f"{block}.input_layernorm",
                    "gate_proj": f"{block}.post_attention_layernorm",
                    "up_proj": f"{block}.post_attention_layernorm",
                    "down_proj": layer.rsplit(".", 1)[0] + ".up_proj",
                }[leaf]
                assert smooth == expected, f"{layer} is smoothed into {smooth}, not {expected}"
    assert smoothed == {n: s.smoothquant_alpha for n, s in plan.items() if s.smoothquant_alpha is not None}


@pytest.mark.parametrize("name", list(CT_PRESETS))
def test_embedded_preset_table_matches_compressed_tensors(llmc, name: str) -> None:
    _, summary = llmc
    real = summary["presets"][name]
    ours = CT_PRESETS[name]
    keys = CT_ARG_KEYS
    for role in ("weights", "input_activations"):
        if ours[role] is None or real[role] is None:
            assert ours[role] is None and real[role] is None, f"{name} {role}"
            continue
        want = {k: ours[role].get(k) for k in keys}
        got = {k: real[role].get(k) for k in keys}
        assert got == want, f"{name} {role}"


@pytest.mark.parametrize("name", list(cases()))
def test_calibration_note_of_the_vllm_command_agrees_with_llmcompressor(llmc, name: str) -> None:
    made, summary = llmc
    plan, _, path = made[name]
    quant = modifiers(summary, path, "QuantizationModifier") + modifiers(summary, path, "GPTQModifier")
    smooth = modifiers(summary, path, "SmoothQuantModifier")
    awq = modifiers(summary, path, "AWQModifier")
    needs = bool(smooth) or any(m["requires_calibration_data"] for m in quant + awq)
    cmd = to_vllm_command(plan, model_path="/m", layer_names=LAYERS, kv_cache=KV_CASES.get(name))
    if "--quantization fp8" in cmd or not quant:
        assert not needs
    else:
        assert ("needs calibration data" in cmd) == needs, cmd


@pytest.mark.parametrize("name", list(cases()))
def test_kv_cache_scheme_is_what_llm_compressor_calibrates(llmc, name: str) -> None:
    made, summary = llmc
    _, _, path = made[name]
    # one quantization modifier carries the KV cache scheme, when there are two (GPTQ and not) the second
    quant = [m for m in modifiers(summary, path, "GPTQModifier") + modifiers(summary, path, "QuantizationModifier")
             if m["kv_cache_scheme"] is not None]
    kv = KV_CASES.get(name)
    want = kv_cache_scheme(kv)
    if want is None:  # AUTO, or a scale-1.0 format that is vLLM's flag alone
        assert quant == []
        return
    (mod,) = quant
    got = mod["kv_cache_scheme"]
    assert {k: got[k] for k in want} == want
    assert mod["requires_calibration_data"], "static K/V scales need calibration data"
    # the scales compressed-tensors makes on a tiny Llama (2 KV heads): one per layer, or one per KV head
    shapes = mod["kv_scale_shapes"]
    assert sorted(shapes) == [f"model.layers.{b}.self_attn" for b in range(N_BLOCKS)]
    per_layer = [[1, 1, 1], [1], []]  # the scalar shapes compressed-tensors may use for strategy tensor
    for layer, kv_shapes in shapes.items():
        for tensor, shape in kv_shapes.items():
            assert (shape == [2, 1, 1]) if get_kv_format(kv).per_head else (shape in per_layer), (layer, tensor, shape)


def off_grid(a: Any, b: Any) -> float:
    """Share of weights on another grid point (the same grid point may differ in its last bit)."""
    import torch

    return float((~torch.isclose(a, b, rtol=1e-4, atol=1e-7)).float().mean())


GPTQ_ONESHOT = ["W4A16_GPTQ", "W4A16_CHANNEL_GPTQ", "NVFP4A16_GPTQ", "W4AFP8_GPTQ"]
AWQ_ONESHOT = ["W4A16", "W4A16_ASYM", "NVFP4A16"]
RTN_ONESHOT = ["NVFP4A16", "MXFP4A16", "MXFP8", "W4A16", "W4A16_G64", "W4A16_G32", "W4A16_CHANNEL", "W4A16_ASYM",
               "FP8_DYNAMIC", "W4AFP8"]
ONESHOT_TIMEOUT_S = 1200  # every case below in one process: ~5 s to import llmcompressor, 1-3 s a case here


def gptq_oneshot_plan(gptq: str) -> dict[str, Scheme]:
    return {n: get_scheme(gptq) if s.gptq else s for n, s in mixed_gptq_plan().items()}


def moe_oneshot_plan() -> dict[str, Scheme]:
    schemes = {"layers.0.mlp.experts.": "W4A16_G64", "layers.1.mlp.experts.": "W4A16", "lm_head": "BF16"}
    return {n: get_scheme(next((s for k, s in schemes.items() if k in n), "FP8_DYNAMIC"))
            for n in tiny_moe_layer_names()}


def moe_awq_oneshot_plan() -> dict[str, Scheme]:
    return {n: get_scheme("BF16" if n == "lm_head" else "W4A16_AWQ" if ".experts." in n else "W4A16")
            for n in tiny_moe_layer_names()}


def oneshot_cases() -> dict[str, tuple[dict[str, Scheme], str]]:
    """Every plan the tests below run through llm-compressor's oneshot, by case name: (plan, model arch)."""
    cases = {f"gptq-{g}": (gptq_oneshot_plan(g), "llama") for g in GPTQ_ONESHOT}
    cases |= {f"awq-{b}": (awq_plan(b), "llama") for b in AWQ_ONESHOT}
    cases |= {f"rtn-{n}": (uniform(n), "llama") for n in RTN_ONESHOT}
    cases |= {"moe": (moe_oneshot_plan(), "qwen3_moe"), "moe-awq": (moe_awq_oneshot_plan(), "qwen3_moe")}
    return cases


@pytest.fixture(scope="module")
def oneshots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """Each case of ``oneshot_cases`` exported and run by llm-compressor's oneshot on scripts/llmc_oneshot.py's tiny
    Llama (or, for arch qwen3_moe, its tiny Qwen3-MoE), all in one ``--batch`` process (one import of llmcompressor
    instead of one a case): case name -> (its workdir, the process's stderr). A workdir holds the recipe,
    oneshot.json and oneshot.safetensors beside the tiny model, or oneshot.error when that case raised."""
    env = subprocess.run(["bash", str(REPO / "scripts" / "llmc_env.sh")], capture_output=True, text=True,
                         timeout=ENV_TIMEOUT_S, cwd=REPO)
    assert env.returncode == 0, env.stderr[-3000:]
    root = tmp_path_factory.mktemp("oneshot")
    jobs, workdirs = [], {}
    for name, (plan, arch) in oneshot_cases().items():
        workdir = workdirs[name] = root / name
        workdir.mkdir()
        recipe = workdir / "recipe.yaml"
        recipe.write_text(to_llmcompressor_recipe(plan, layer_names=list(plan) if arch != "llama" else LAYERS),
                          encoding="utf-8")
        jobs.append([str(recipe), str(workdir), arch])
    (root / "jobs.json").write_text(json.dumps(jobs))
    run = subprocess.run([str(LLMC_PYTHON), str(REPO / "scripts" / "llmc_oneshot.py"), "--batch",
                          str(root / "jobs.json")], capture_output=True, text=True, timeout=ONESHOT_TIMEOUT_S, cwd=REPO)
    return {name: (workdir, run.stderr) for name, workdir in workdirs.items()}


def run_oneshot(
    oneshots: dict[str, tuple[Path, str]], case: str, plan: dict[str, Scheme]
) -> tuple[dict[str, Any], Path]:
    """Case ``case``'s oneshot.json and workdir (oneshot.safetensors and the tiny model lie there); ``plan`` is the
    plan the test means, which must be the one that ran."""
    ran, _ = oneshot_cases()[case]
    assert ran == plan, case
    workdir, stderr = oneshots[case]
    error = workdir / "oneshot.error"
    assert not error.exists(), error.read_text()[-3000:]
    assert (workdir / "oneshot.json").exists(), stderr[-3000:]
    return json.loads((workdir / "oneshot.json").read_text()), workdir


@pytest.mark.parametrize("gptq", GPTQ_ONESHOT)
def test_exported_gptq_recipe_runs_in_oneshot(oneshots, gptq) -> None:
    """The whole way: a mixed FP8_DYNAMIC + GPTQ plan, exported, quantizes a tiny Llama with llm-compressor's own
    oneshot: every linear ends up with the planned args, int weights on their grid, the GPTQ layers moved off
    round-to-nearest by GPTQ (on calibration data) and the FP8 layers rounded to nearest, as scored."""
    plan = gptq_oneshot_plan(gptq)
    got, _ = run_oneshot(oneshots, f"gptq-{gptq}", plan)
    assert got["modifiers"] == ["GPTQModifier", "QuantizationModifier"]
    for layer in LAYERS:
        real = got["layers"][layer]
        if plan[layer].is_identity:
            assert real is None, layer
            continue
        assert scheme_from_ct_args(real["weights"], real["input_activations"], gptq=plan[layer].gptq) == plan[layer]
    int_layers = [n for n in LAYERS if plan[n].int_weights]
    assert got["weights_on_grid"] == dict.fromkeys(int_layers, True)
    quantized = [n for n in LAYERS if not plan[n].is_identity]
    assert got["rounded_to_nearest"] == {n: not plan[n].gptq for n in quantized}


@pytest.mark.parametrize("base", AWQ_ONESHOT)
def test_exported_awq_recipe_makes_quantcores_weights_in_oneshot(oneshots, base: str) -> None:
    """The whole way for AWQ: the exported recipe (AWQ on block 1 and every down_proj, W4A16 elsewhere) through
    llm-compressor's own oneshot on a tiny Llama with outlier channels, and quantcore's search on the same model and
    calibration tokens. Every scale llm-compressor folds is one of quantcore's candidates; where both pick the same
    one, the checkpoints agree (norm gains to the last bits, each weight on the same grid point but for a rare tie);
    where they part, llm-compressor's pick is within 3 % of quantcore's best loss: the two candidates are that close,
    and a last-bit difference in the inputs' mean (the batches they are summed in) sends a few weights of the
    outlier channel to the neighbouring grid point, which is enough to reorder them (quantcore's own pick there
    moves with its batch size)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from quantcore.algorithms.awq import awq_search, candidates, weight_means
    from quantcore.evaluation.scoring import plan_applied
    from quantcore.formats.weights import fake_quantize_weight

    plan = awq_plan(base)
    got, workdir = run_oneshot(oneshots, f"awq-{base}", plan)
    assert got["modifiers"] == ["AWQModifier", "QuantizationModifier"]
    quantized = [n for n in LAYERS if not plan[n].is_identity]
    # AWQ scaled weights are no longer the original rounded to nearest, nor are the up_proj rows a down_proj's
    # factors were folded into; the rest are, the GQA o_proj of block 1 too (neither tool can scale it)
    scaled = {n for n in quantized if plan[n].awq and not n.endswith("o_proj")}
    scaled |= {n.replace("down_proj", "up_proj") for n in scaled if n.endswith("down_proj")}
    assert got["rounded_to_nearest"] == {n: n not in scaled for n in quantized}

    theirs = load_file(workdir / "oneshot.safetensors")
    model = AutoModelForCausalLM.from_pretrained(workdir / "tiny-llama", dtype=torch.float32).eval()
    ids = torch.tensor(got["calibration_ids"])
    inputs: dict[str, list[torch.Tensor]] = {}
    firsts = {"q_proj": "input_layernorm", "gate_proj": "post_attention_layernorm", "down_proj": "mlp.up_proj"}
    hooks = [m.register_forward_pre_hook(lambda _m, a, _n=n: inputs.setdefault(_n, []).append(a[0].detach()))
             for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in firsts]
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    for h in hooks:
        h.remove()
    originals = {n: p.detach().clone() for n, p in model.named_parameters()}
    found = awq_search(model, plan, ids)
    assert len(found.errors) == 1 + 1 + 3  # block 1's q/k/v and gate/up folds, and the three down_proj

    spec = get_scheme(base).weights
    agree: dict[str, str] = {}  # mapping label -> its first balance layer, where both picked the same scale
    for label, history in found.history.items():
        smooth, leaves = label.split(" -> ")
        block = smooth.rsplit(".", 2)[0] if smooth.endswith(".mlp.up_proj") else smooth.rsplit(".", 1)[0]
        members = [n for n in found.factors if n.startswith(block + ".") and n.rsplit(".", 1)[-1] in leaves.split(", ")]
        first = members[0]
        x = torch.cat([t.reshape(-1, t.shape[-1]) for t in inputs[first]])
        w_mean = weight_means([originals[m + ".weight"] for m in members], spec)
        w0 = originals[first + ".weight"]
        def rounded(sc: torch.Tensor, _first: str = first, _w0: torch.Tensor = w0) -> torch.Tensor:
            # NVFP4: the tensor scale the checkpoint stores (its group's, after every fold of the block)
            stored_g = theirs.get(_first + ".weight_global_scale")
            g = None if stored_g is None else (1.0 / stored_g).reshape(())
            return fake_quantize_weight((_w0 * sc).float(), spec, report=False, scale=g)[0]

        picks = [r for r, sc in candidates(x.abs().float().sum(0) / x.shape[0], w_mean)
                 if off_grid(rounded(sc), theirs[first + ".weight"]) < 0.002]
        assert picks, f"{label}: llm-compressor folded a scale that is none of quantcore's candidates"
        loss, (_, best, ours_r) = dict(history), found.errors[label]
        assert loss[picks[0]] <= 1.03 * best, (f"{label}: llm-compressor's pick r={picks[0]:.3f} loses "
                                              f"{loss[picks[0]] / best - 1:.1%} more than quantcore's r={ours_r:.3f}")
        if ours_r in picks:
            agree[label] = first
    assert len(agree) >= len(found.errors) - 1, f"only {sorted(agree)} picked the same scale"
    with plan_applied(model, plan, inputs=PlanInputs(awq=found)):
        ours = {n: p.detach().clone() for n, p in model.named_parameters() if n in theirs}
    for label, first in agree.items():
        assert off_grid(ours[first + ".weight"], theirs[first + ".weight"]) < 0.002, first
        smooth = label.split(" -> ")[0]
        if smooth.endswith("norm"):
            torch.testing.assert_close(ours[smooth + ".weight"], theirs[smooth + ".weight"], rtol=1e-5, atol=1e-6)
    for n in quantized:  # rounded to nearest by both, untouched by any fold: the same checkpoint
        if n not in scaled:
            assert off_grid(ours[n + ".weight"], theirs[n + ".weight"]) < 0.002, n


@pytest.mark.parametrize("name", RTN_ONESHOT)
def test_round_to_nearest_checkpoint_is_quantcores_emulation(oneshots, name: str) -> None:
    """A data-free recipe through oneshot on the tiny Llama: every linear weight it stores is what quantcore's
    emulation of the plan holds, grid point for grid point. For NVFP4 that takes one fp32 tensor scale per fusion
    group (q/k/v, gate/up), from the group's largest |W|, as llm-compressor's fused observers store it and vLLM's
    fused GEMM reads it; with each layer's own, k/v and gate/up land elsewhere."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import quantcore.algorithms.apply as apply_mod
    from quantcore.evaluation.scoring import plan_applied

    plan = uniform(name)
    _, workdir = run_oneshot(oneshots, f"rtn-{name}", plan)
    theirs = load_file(workdir / "oneshot.safetensors")
    model = AutoModelForCausalLM.from_pretrained(workdir / "tiny-llama", dtype=torch.float32).eval()

    def emulated() -> dict[str, torch.Tensor]:
        with plan_applied(model, plan):
            return {n: m.weight.detach().clone() for n, m in model.named_modules() if n in plan}

    def off(ours: dict[str, torch.Tensor], layer: str) -> float:
        return off_grid(ours[layer], theirs[layer + ".weight"])

    ours = emulated()
    for layer in LAYERS:
        assert off(ours, layer) < 0.002, f"{layer}: {off(ours, layer):.2%} of the weights on another grid point"
    if name == "NVFP4A16":  # with the per-layer tensor scale quantcore used before, the members of a group whose
        # |W| is not the group's largest would part: gate_proj beside the up_proj whose row 7 carries an outlier
        real = apply_mod._fused_tensor_scales
        apply_mod._fused_tensor_scales = lambda *_: {}
        try:
            own = emulated()
        finally:
            apply_mod._fused_tensor_scales = real
        assert off(own, "model.layers.0.mlp.gate_proj") > 0.01 and off(own, "model.layers.0.mlp.up_proj") < 0.002
        assert max(off(own, f"model.layers.0.self_attn.{p}_proj") for p in "qkv") > 0.01


def tiny_moe_layer_names() -> list[str]:
    """The linears quantcore sees in scripts/llmc_oneshot.py's tiny Qwen3-MoE (its experts split), from the config
    on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantcore.models.moe import split_experts

    cfg = AutoConfig.for_model("qwen3_moe", vocab_size=128, hidden_size=128, intermediate_size=256,
                               moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg)
    split_experts(meta)
    return [n for n, m in meta.named_modules() if isinstance(m, torch.nn.Linear)]


def test_an_moe_plan_quantizes_each_expert_in_oneshot_as_quantcore_emulates_it(oneshots) -> None:
    """A tiny Qwen3-MoE: quantcore splits its fused experts into one linear per expert under llm-compressor's own
    names, so the exported recipe reaches exactly the experts the plan gives a scheme (one block's experts in
    W4A16_G64, the other's in W4A16, attention in FP8_DYNAMIC, the head left out), and every expert weight oneshot
    stores is quantcore's emulation of it, grid point for grid point."""
    from safetensors.torch import load_file

    from quantcore.evaluation.scoring import plan_applied
    from quantcore.models.loading import load_model

    names = tiny_moe_layer_names()
    plan = moe_oneshot_plan()
    got, workdir = run_oneshot(oneshots, "moe", plan)
    assert set(got["layers"]) == set(names)  # oneshot's linears are quantcore's, name for name
    for layer in names:
        real = got["layers"][layer]
        if plan[layer].is_identity:
            assert real is None, layer
        else:
            assert scheme_from_ct_args(real["weights"], real["input_activations"]) == plan[layer], layer
    theirs = load_file(workdir / "oneshot.safetensors")
    model, _ = load_model(workdir / "tiny-moe")
    with plan_applied(model, plan):
        ours = {n: m.weight.detach().clone() for n, m in model.named_modules() if n in plan}
    experts = [n for n in names if ".experts." in n]
    assert len(experts) == 2 * 4 * 3
    for layer in names:
        assert off_grid(ours[layer], theirs[layer + ".weight"]) < 0.002, layer


def test_an_moe_awq_recipe_scales_the_experts_as_quantcore_does(oneshots) -> None:
    """AWQ on a tiny Qwen3-MoE's experts: the exported recipe maps the norm before each MoE block to the router and
    every expert's gate/up (llm-compressor's MoE mapping; the router's weight is scaled, never quantized), and each
    expert's up_proj to its own down_proj. llm-compressor's oneshot searches them with every expert run on every
    token, and quantcore's search on the same tokens does the same: every scale llm-compressor folds is one of
    quantcore's candidates, within 3 % of quantcore's best loss, and where both picked the same one the stored
    weights are the same grid points (and the norms and routers the same numbers).

    llm-compressor 0.14.0.1 (with its transformers 5.17) runs this model's attention without the causal mask
    inside oneshot: block 0's o_proj outputs there equal a forward with bidirectional attention, not the model's
    own (a tiny Llama's match its own). quantplan calibrates causally, as the model serves; to compare the AWQ
    arithmetic on the same inputs, quantcore's forwards here attend bidirectionally too."""
    import contextlib

    import torch
    from safetensors.torch import load_file
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    from quantcore.algorithms.awq import awq_mappings, awq_search, candidates, weight_means
    from quantcore.evaluation.scoring import plan_applied
    from quantcore.formats.weights import fake_quantize_weight
    from quantcore.models.loading import load_model
    from quantcore.models.moe import all_experts

    names = tiny_moe_layer_names()
    plan = moe_awq_oneshot_plan()
    got, workdir = run_oneshot(oneshots, "moe-awq", plan)
    assert got["modifiers"] == ["AWQModifier", "QuantizationModifier"]
    experts = [n for n in names if ".experts." in n]
    quantized = [n for n in names if n != "lm_head"]
    assert got["rounded_to_nearest"] == {n: n not in experts for n in quantized}  # every expert linear scaled

    theirs = load_file(workdir / "oneshot.safetensors")
    model, _ = load_model(workdir / "tiny-moe")
    ids = torch.tensor(got["calibration_ids"])

    @contextlib.contextmanager
    def as_oneshot_attends():  # see the docstring
        kind = model.config._attn_implementation
        causal = ALL_ATTENTION_FUNCTIONS[kind]
        # in the global table, as transformers' own registrations are: an item set on ALL_ATTENTION_FUNCTIONS itself
        # stays in its local table after the test and shadows the global one for every later test of the process
        # (tests/quantcore/evaluation/test_kvcache.py's spy patches the global table)
        AttentionInterface._global_mapping[kind] = lambda module, q, k, v, mask, **kw: causal(
            module, q, k, v, None, **{**kw, "is_causal": False})
        try:
            yield
        finally:
            AttentionInterface._global_mapping[kind] = causal

    mappings = {f"{m.smooth} -> {', '.join(x.rsplit('.', 1)[-1] for x in m.balance)}": m
                for m in awq_mappings(model, experts)[0]}
    inputs: dict[str, list[torch.Tensor]] = {}
    hooks = [model.get_submodule(m.balance[0]).register_forward_pre_hook(
        lambda _m, a, _n=m.balance[0]: inputs.setdefault(_n, []).append(a[0].detach())) for m in mappings.values()]
    with torch.no_grad(), all_experts(), as_oneshot_attends():
        model(input_ids=ids, use_cache=False)
    for h in hooks:
        h.remove()
    originals = {n: p.detach().clone() for n, p in model.named_parameters()}
    with as_oneshot_attends():
        found = awq_search(model, plan, ids)
    assert set(found.errors) == set(mappings) and len(mappings) == 2 * (1 + 4)  # per block: gate/up, 4 down_proj
    spec = get_scheme("W4A16").weights
    agree: list[str] = []  # mappings where both picked the same scale
    for label, history in found.history.items():
        first = mappings[label].balance[0]
        x = torch.cat([t.reshape(-1, t.shape[-1]) for t in inputs[first]])
        w0 = originals[first + ".weight"]
        w_mean = weight_means([originals[b + ".weight"] for b in mappings[label].balance], spec)
        picks = [r for r, sc in candidates(x.abs().float().sum(0) / x.shape[0], w_mean)
                 if off_grid(fake_quantize_weight((w0 * sc).float(), spec, report=False)[0],
                             theirs[first + ".weight"]) < 0.002]
        assert picks, f"{label}: llm-compressor folded a scale that is none of quantcore's candidates"
        loss, (_, best, ours_r) = dict(history), found.errors[label]
        assert loss[picks[0]] <= 1.03 * best, label
        if ours_r in picks:
            agree.append(label)
    assert len(agree) >= len(mappings) - 1, f"only {sorted(agree)} picked the same scale"
    with plan_applied(model, plan, inputs=PlanInputs(awq=found)):
        ours = {n: p.detach().clone() for n, p in model.named_parameters() if n in theirs}
        routers = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")}
    for label in agree:
        for layer in mappings[label].balance:
            assert off_grid(ours[layer + ".weight"], theirs[layer + ".weight"]) < 0.002, layer
        smooth = mappings[label].smooth
        if smooth.endswith("norm"):
            torch.testing.assert_close(ours[smooth + ".weight"], theirs[smooth + ".weight"], rtol=1e-5, atol=1e-6)
            router = smooth.rsplit(".", 1)[0] + ".mlp.gate.weight"
            torch.testing.assert_close(routers[router], theirs[router], rtol=1e-5, atol=1e-6)
    for n in quantized:  # rounded to nearest by both, untouched by any fold: the same checkpoint
        if n not in experts:
            assert off_grid(ours[n + ".weight"], theirs[n + ".weight"]) < 0.002, n
