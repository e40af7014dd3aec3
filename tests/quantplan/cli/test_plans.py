"""`quantplan plan ...`: automatic plans (with a KV cache, on several GPUs, verified here or waited for), a plan's
summary, export to serving tools and import of plan files, on dense and MoE models."""

from __future__ import annotations

import re

import pytest
import yaml

from tests.factories import run_cli as run
from tests.factories import run_cli_json as run_json


def test_asking_the_same_automatic_plan_twice_keeps_one_version(tiny_model, capsys):
    run_json(capsys, "sensitivity", "tiny", "--scheme", "INT8_PER_TENSOR", "--local", "--samples", "2",
             "--seq-len", "32", "--json")
    args = ("plan", "auto", "tiny", "--kl-budget", "1000", "--target", "h100", "--json")
    first = run_json(capsys, *args)  # queues its verification (no worker here: it stays queued)
    second = run_json(capsys, *args)
    assert second["plan_id"] == first["plan_id"]
    assert second["plan_label"] == first["plan_label"] == "auto-h100-kl1000 v1"
    assert second["verify_job"] == first["verify_job"]  # the verification already asked for is reused
    assert any("no new version" in n for n in second["notes"])
    from quantplan.services import models as models_svc
    from quantplan.services import plans as plans_svc

    stored = plans_svc.list_plans(models_svc.get_model("tiny").id)
    assert [p.version for p in stored if p.name == "auto-h100-kl1000"] == [1]
    spaced = run_json(capsys, *args, "--candidates", "INT8_PER_TENSOR, BF16", "--no-verify")  # as people type lists
    assert spaced["plan_id"] == first["plan_id"]


def test_plan_show_prints_the_weight_memory_of_a_plan(tiny_model, capsys, tmp_path):
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text("model: tiny\ndefault: FP8_DYNAMIC\nrules:\n  - {match: 'lm_head', scheme: BF16}\n"
                         "  - {match: 'mlp', scheme: W4A16}\n")
    shown = run_json(capsys, "plan", "show", str(plan_file), "--json")
    from quantplan.services import models as models_svc

    shapes = models_svc.layer_shapes(models_svc.get_model("tiny"))
    assert shown["model"] == "tiny" and shown["params"] == sum(n * k for n, k in shapes.values())
    assert shown["bf16_bytes"] == 2 * shown["params"] and shown["bytes"] < shown["bf16_bytes"]
    by = {r["scheme"]: r for r in shown["schemes"]}
    assert by["BF16"]["layers"] == 1 and by["W4A16"]["layers"] == 2 * 3 and by["FP8_DYNAMIC"]["layers"] == 2 * 4
    assert sum(r["bytes"] for r in shown["schemes"]) == shown["bytes"]

    imported = run_json(capsys, "plan", "import", str(plan_file), "--name", "w4", "--json")
    code, out, err = run(capsys, "plan", "show", f"w4@v{imported['version']}")
    assert code == 0, err
    assert "of BF16" in out and "W4A16" in out and "bits/weight" in out

    bounds = run_json(capsys, "plan", "show", str(plan_file), "--target", "a100", "--prompt", "4096", "--json")
    decode, prefill = bounds["ideal"]
    assert (decode["step"], decode["m"], prefill["step"], prefill["m"]) == ("decode", 1, "prefill", 4096)
    assert decode["ms"] < decode["bf16_ms"] and decode["memory_bound"] == decode["layers"] == len(shapes)
    assert prefill["ms"] == pytest.approx(prefill["bf16_ms"])  # an A100 runs FP8 as weight-only: bf16 math
    assert decode["not_native"] == 2 * 4  # the FP8_DYNAMIC layers: no FP8 tensor cores on an A100
    code, out, _ = run(capsys, "plan", "show", str(plan_file), "--target", "h100")
    assert code == 0 and "ideal step on NVIDIA H100" in out and "vs BF16" in out
    w4a8 = tmp_path / "w4afp8.yaml"
    w4a8.write_text("model: tiny\ndefault: W4AFP8\n")
    on_ada = run_json(capsys, "plan", "show", str(w4a8), "--target", "l40s", "--json")["ideal"][0]
    assert on_ada["unsupported"] == on_ada["not_native"] == len(shapes)  # W4AFP8's one kernel is Hopper's
    code, out, _ = run(capsys, "plan", "show", str(w4a8), "--target", "l40s")
    assert code == 0 and "cannot be served there" in out
    assert "  W4AFP8: unsupported on NVIDIA L40S" in out and "Hopper" in out  # and why
    assert run_json(capsys, "plan", "show", str(w4a8), "--target", "h100", "--json")["ideal"][0]["unsupported"] == 0
    fp4 = tmp_path / "fp4.yaml"
    fp4.write_text("model: tiny\ndefault: MXFP4\n")
    on_hopper = run_json(capsys, "plan", "show", str(fp4), "--target", "h100", "--json")["ideal"][0]
    assert on_hopper["unsupported"] == 0 and on_hopper["not_native"] == len(shapes)  # served as W4A16 there
    code, out, _ = run(capsys, "plan", "show", str(fp4), "--target", "h100")
    assert "  MXFP4: emulated on NVIDIA H100" in out and "W4A16 weight-only via Marlin" in out
    code, _, err = run(capsys, "plan", "show", str(plan_file), "--target", "v100")
    assert code == 1 and "unknown GPU target 'v100'" in err

    bad = tmp_path / "bad.yaml"
    bad.write_text("model: tiny\ndefault: FP9\n")
    code, _, err = run(capsys, "plan", "show", str(bad))
    assert code == 1 and "FP9" in err and "does not resolve" in err


def test_a_plan_with_an_fp8_kv_cache_is_scored_shown_exported_and_imported(tiny_model, capsys, tmp_path):
    from quantplan.services import calibration as calibration_svc
    from quantplan.services import models as models_svc
    from quantplan.services import scoring as scoring_svc

    args = ("--local", "--samples", "2", "--seq-len", "32", "--json")
    # a calibration records the largest K and V of every attention layer with the linears' statistics
    calibrated = run_json(capsys, "calibrate", "tiny", *args)
    cal = calibration_svc.calibrations(models_svc.get_model("tiny").id)[0]
    assert calibrated["kv_amax"] == cal.result["kv_amax"] and set(calibrated["kv_amax"]["k_head"]) == {
        "model.layers.0.self_attn", "model.layers.1.self_attn"}
    code, out, _ = run(capsys, "calibrate", "tiny", *args[:-1])
    assert code == 0 and "largest |K| " in out and "largest |Q| " in out and "KV heads of one layer differ" in out
    assert set(cal.result["kv_amax"]["k"]) == set(cal.result["kv_amax"]["v"]) == {
        "model.layers.0.self_attn", "model.layers.1.self_attn"}
    assert all(v > 0 for v in cal.result["kv_amax"]["k"].values())
    plain = run_json(capsys, "score", "tiny", "--scheme", "FP8_DYNAMIC", *args)
    assert plain["kv_cache"] == "AUTO" and plain["plan"] == "FP8_DYNAMIC"
    e5m2 = run_json(capsys, "score", "tiny", "--scheme", "FP8_DYNAMIC", "--kv-cache", "fp8_e5m2", *args)
    assert e5m2["kv_cache"] == "FP8_E5M2" and e5m2["plan"] == "FP8_DYNAMIC + KV FP8_E5M2"
    assert e5m2["kl_mean"] != plain["kl_mean"]  # same tokens, same reference: the cache format changed the logits
    code, out, _ = run(capsys, "score", "tiny", "--scheme", "FP8_DYNAMIC", "--kv-cache", "FP8_E5M2", *args[:-1])
    assert code == 0 and " FP8_DYNAMIC + KV FP8_E5M2 on tiny: KL mean" in out  # the format is named once
    code, _, err = run(capsys, "score", "tiny", "--scheme", "FP8_DYNAMIC", "--kv-cache", "int4", *args)
    assert code == 1 and "unknown KV cache format 'int4'" in err and "FP8_E5M2" in err

    plan_file = tmp_path / "kv.yaml"
    plan_file.write_text("model: tiny\nname: fp8-kv\ndefault: FP8_DYNAMIC\nkv_cache: FP8\n"
                         "rules:\n  - {match: 'lm_head', scheme: BF16}\n")
    # a calibrated KV cache: the job calibrates the K/V scales on the calibration text (never on the text it
    # evaluates, here an uploaded one), then scores
    eval_text = tmp_path / "eval.txt"
    eval_text.write_text("\n".join(["the cat sat on the mat and the dog ran to the park"] * 40))
    fp8 = run_json(capsys, "score", "tiny", "--plan", str(plan_file), "--text", str(eval_text), *args)
    assert fp8["kv_cache"] == "FP8" and fp8["plan"] == "fp8-kv" and fp8["kl_mean"] > 0
    code, out, _ = run(capsys, "score", "tiny", "--plan", str(plan_file), "--text", str(eval_text), *args[:-1])
    assert code == 0 and " fp8-kv (KV cache FP8) on tiny: KL mean" in out  # a stored plan's own cache is named
    assert fp8["kv_calibration_text"] == "builtin:lee_background.cor"
    stored = next(s for s in scoring_svc.list_scores(models_svc.get_model("tiny").id) if s.job_id == fp8["job"])
    assert stored.kv_cache == "FP8" and stored.plan_body["kv_cache"] == "FP8"
    assert set(stored.details["kv_saturation"]) == {"model.layers.0.self_attn", "model.layers.1.self_attn"}
    # the cache's memory is a cost beside the weights': half of BF16's per token for the FP8 formats
    plans = {r["plan"]: r for r in run_json(capsys, "scores", "tiny", "--json")["plans"]}
    assert plans["FP8_DYNAMIC"]["kv_cache"] == "AUTO" and plans["FP8_DYNAMIC"]["kv_kib"] == 2 * 128 / 1024
    assert plans["FP8_DYNAMIC + KV FP8_E5M2"]["kv_kib"] == 128 / 1024
    assert plans["FP8_DYNAMIC + KV FP8_E5M2"]["front_kv_kib"]  # the least cache memory
    assert plans["FP8_DYNAMIC"]["front_kv_kib"]  # the lowest KL
    assert not plans["FP8_DYNAMIC + KV FP8_E5M2"]["front_weight_mib"]  # same weights, more KL: beaten there
    code, out, _ = run(capsys, "scores", "tiny")
    assert code == 0 and "KV KiB/token" in out
    # serving 8 sequences of 1,000 tokens: the same weights, and the FP8 cache holds 128 bytes a token less
    served = {r["plan"]: r for r in run_json(capsys, "scores", "tiny", "--serve", "8", "1000", "--json")["plans"]}
    saved = served["FP8_DYNAMIC"]["serving_gib"] - served["FP8_DYNAMIC + KV FP8_E5M2"]["serving_gib"]
    assert saved == pytest.approx(8 * 1000 * 128 / 2**30)
    assert served["FP8_DYNAMIC + KV FP8_E5M2"]["front_serving_gib"]
    code, out, _ = run(capsys, "scores", "tiny", "--serve", "8", "1000")
    assert code == 0 and "serving GiB (8×1000)" in out

    shown = run_json(capsys, "plan", "show", str(plan_file), "--target", "h100", "--json")["kv_cache"]
    elements = 2 * 2 * (2 * 16)  # 2 blocks × (K and V) × 2 KV heads of head_dim 16
    assert shown["kv_cache"] == "FP8" and shown["bytes_per_token"] == elements  # one byte each
    assert shown["bf16_bytes_per_token"] == 2 * shown["bytes_per_token"]
    assert shown["tokens"] > shown["bf16_tokens"] > 0
    code, out, _ = run(capsys, "plan", "show", str(plan_file), "--target", "h100")
    assert code == 0 and "KV cache FP8: 0.1 KiB per token (BF16 0.2 KiB)" in out and "tokens of cache" in out
    assert "Score FP8_ATTN to see what FlashAttention 3 costs" in out  # an E4M3 cache on Hopper
    # a decode step at a long context reads the whole cache: the FP8 cache reads half the bytes of BF16's
    dec = run_json(capsys, "plan", "show", str(plan_file), "--target", "h100", "--batch", "8", "--context",
                   "100000", "--json")["kv_cache"]["decode_with_cache"]
    assert dec["kv_ms"] == pytest.approx(elements * 8 * 100_000 / 3.35e12 * 1e3)
    assert dec["bf16_kv_ms"] == pytest.approx(2 * dec["kv_ms"]) and dec["ms"] == dec["linear_ms"] + dec["kv_ms"]
    code, out, _ = run(capsys, "plan", "show", str(plan_file), "--target", "h100", "--context", "4096")
    assert code == 0 and "1 sequence(s) × 4,096 tokens of context" in out

    code, recipe, _ = run(capsys, "plan", "export", str(plan_file), "--format", "llmcompressor")
    assert code == 0 and "kv_cache_scheme: {num_bits: 8, type: float, strategy: tensor" in recipe
    code, vllm, _ = run(capsys, "plan", "export", str(plan_file), "--format", "vllm")
    assert code == 0 and vllm.rstrip().endswith("--kv-cache-dtype fp8")
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(recipe)
    back = run_json(capsys, "plan", "import", str(recipe_file), "--model", "tiny", "--name", "from-recipe", "--json")
    assert back["body"]["kv_cache"] == "FP8" and back["body"]["default"] == "FP8_DYNAMIC"


def test_gptq_schemes_are_scored_swept_exported_and_imported(tiny_model, capsys, tmp_path):
    """GPTQ presets through the job bodies: Hessians from the calibration text, never the evaluated one."""
    from quantplan.services import jobs as jobs_svc
    from quantplan.services import models as models_svc
    from quantplan.services import scoring as scoring_svc
    from quantplan.services import sweeps as sweeps_svc

    args = ("--local", "--samples", "2", "--seq-len", "32", "--json")
    rtn = run_json(capsys, "score", "tiny", "--scheme", "W8A16", *args)
    gptq = run_json(capsys, "score", "tiny", "--scheme", "W8A16_GPTQ", *args)
    assert gptq["gptq_calibration_text"] == "builtin:lee_background.cor" and "gptq_calibration_text" not in rtn
    assert gptq["plan"] == "W8A16_GPTQ" and gptq["kl_mean"] > 0 and gptq["kl_mean"] != rtn["kl_mean"]
    assert gptq["calibration_tokens"] == [16, 256]  # the job's default
    code, out, _ = run(capsys, "score", "tiny", "--scheme", "W8A16_GPTQ", *args[:-1])
    assert code == 0 and ("GPTQ rounded its weights with the input Hessians of builtin:lee_background.cor "
                          "(16 × 256 tokens)") in out
    # the user's own calibration text and size: other Hessians, so another score
    cal = tmp_path / "calibration.txt"
    cal.write_text("\n\n".join(f"Calibration document {i}: the quick brown fox jumps over the lazy dog, again and "
                               f"again, {i} times over." for i in range(40)))
    own = run_json(capsys, "score", "tiny", "--scheme", "W8A16_GPTQ", *args, "--cal-text", str(cal),
                   "--cal-samples", "4", "--cal-seq-len", "32")
    assert own["calibration_tokens"] == [4, 32] and own["gptq_calibration_text"] != gptq["gptq_calibration_text"]
    assert own["kl_mean"] != gptq["kl_mean"]
    stored = {s.job_id: s.details.get("calibration") for s in scoring_svc.list_scores(models_svc.get_model("tiny").id)}
    assert stored[own["job"]] == f"{own['gptq_calibration_text']}, 4 × 32 tokens"
    assert stored[rtn["job"]] is None  # W8A16 rounds to nearest: no calibration text
    listed = {r["job"]: r["calibration"] for r in run_json(capsys, "scores", "tiny", "--json")["plans"]}
    assert listed[own["job"]] == stored[own["job"]] and listed[rtn["job"]] is None
    code, out, _ = run(capsys, "scores", "tiny")
    assert code == 0 and f"calibrated on: #{own['job']} W8A16_GPTQ: {stored[own['job']]}" in out
    with pytest.raises(SystemExit) as refused:  # refused when parsed, by the spec's rule (jobs.specs.CAL_SAMPLES)
        run(capsys, "score", "tiny", "--scheme", "W8A16_GPTQ", *args, "--cal-samples", "0")
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "argument --cal-samples: cal_samples must be between 1 and" in err
    # with a calibrated KV cache too: both calibrate on the same text, GPTQ rounding each layer once for the job
    import quantcore.algorithms.gptq as gptq_mod

    rounded: list[int] = []
    real = gptq_mod.gptq_quantize
    gptq_mod.gptq_quantize = lambda *a, **k: rounded.append(1) or real(*a, **k)
    try:
        kv = run_json(capsys, "score", "tiny", "--scheme", "W8A16_GPTQ", "--kv-cache", "FP8", *args,
                      "--cal-samples", "4")
    finally:
        gptq_mod.gptq_quantize = real
    assert kv["kv_calibration_text"] == kv["gptq_calibration_text"] == "builtin:lee_background.cor"
    assert kv["kv_cache"] == "FP8" and kv["kl_mean"] > 0
    assert len(rounded) == len(models_svc.get_model("tiny").linears)  # each linear once, lm_head too
    sweep = run_json(capsys, "sensitivity", "tiny", "--scheme", "W4A16_GPTQ", *args, "--cal-samples", "4")
    assert jobs_svc.get_job(sweep["job"]).result["calibration_tokens"] == [4, 256]
    assert sweep["scheme"] == "W4A16_GPTQ" and len(sweep["layers"]) == 2 * 4 + 1  # q/k/v, o, gate/up, down; head
    kls, _ = sweeps_svc.sensitivity_map(models_svc.get_model("tiny"))
    assert len(kls["W4A16_GPTQ"]) == 9 and all(v > 0 for v in kls["W4A16_GPTQ"].values())

    recipe, vllm, _ = export_and_import(capsys, tmp_path, "W8A16_GPTQ")
    assert "GPTQModifier:" in recipe and "dampening_frac: 0.01" in recipe and "GPTQ" in vllm


def export_and_import(capsys, tmp_path, default: str) -> tuple[str, str, dict]:
    """A plan file of ``default`` (lm_head in BF16) exported as a recipe and a vLLM command, and the recipe imported
    back: (recipe, vLLM command, imported body); asserts the import resolves to the plan and both need data."""
    from quantplan.services import models as models_svc
    from quantplan.services import plans as plans_svc

    plan_file = tmp_path / f"{default}.yaml"
    plan_file.write_text(f"model: tiny\nname: {default.lower()}\ndefault: {default}\n"
                         "rules:\n  - {match: 'lm_head', scheme: BF16}\n")
    code, recipe, _ = run(capsys, "plan", "export", str(plan_file), "--format", "llmcompressor")
    assert code == 0
    code, vllm, _ = run(capsys, "plan", "export", str(plan_file), "--format", "vllm")
    assert code == 0 and "needs calibration data" in vllm
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(recipe)
    back = run_json(capsys, "plan", "import", str(recipe_file), "--model", "tiny", "--name", f"{default}-back",
                    "--json")
    model = models_svc.get_model("tiny")
    original = yaml.safe_load(plan_file.read_text())
    assert plans_svc.resolve(model, back["body"])[0] == plans_svc.resolve(model, original)[0]
    return recipe, vllm, back["body"]


def test_a_plan_keeps_layers_out_of_its_kv_cache(tiny_model, capsys, tmp_path):
    from quantplan.services import models as models_svc
    from quantplan.services import plans as plans_svc
    from quantplan.services import scoring as scoring_svc

    args = ("--local", "--samples", "2", "--seq-len", "32", "--json")
    plan_file = tmp_path / "skip.yaml"
    plan_file.write_text("model: tiny\nname: e5m2-but-1\ndefault: BF16\nkv_cache: FP8_E5M2\nkv_cache_skip: [1]\n")
    every = run_json(capsys, "score", "tiny", "--scheme", "BF16", "--kv-cache", "FP8_E5M2", *args)
    kept = run_json(capsys, "score", "tiny", "--plan", str(plan_file), *args)
    assert 0 < kept["kl_mean"] < every["kl_mean"]  # layer 1 keeps its BF16 cache
    # what an automatic plan takes off its budget for the format is the format on every layer, not this plan
    assert scoring_svc.kv_alone_score(models_svc.get_model("tiny"), "FP8_E5M2").job_id == every["job"]
    stored = next(s for s in scoring_svc.list_scores(models_svc.get_model("tiny").id) if s.job_id == kept["job"])
    assert stored.plan_body["kv_cache_skip"] == [1] and set(stored.details["kv_saturation"]) == {
        "model.layers.0.self_attn"}
    # its cost: layer 1 at two bytes an element, layer 0 at one
    plans = {r["plan"]: r for r in run_json(capsys, "scores", "tiny", "--json")["plans"]}
    per_layer = 2 * 2 * 16  # K and V × 2 KV heads × head_dim 16
    assert plans["e5m2-but-1"]["kv_kib"] == (per_layer + 2 * per_layer) / 1024
    assert plans["e5m2-but-1"]["kv_cache"] == "FP8_E5M2 except 1"
    shown = run_json(capsys, "plan", "show", str(plan_file), "--target", "h100", "--json")["kv_cache"]
    assert shown["bytes_per_token"] == 3 * per_layer and shown["skipped_layers"] == 1
    code, out, _ = run(capsys, "plan", "show", str(plan_file), "--target", "h100")
    assert code == 0 and "KV cache FP8_E5M2 except 1:" in out and "1 layer(s) keep their cache in BF16" in out
    code, vllm, _ = run(capsys, "plan", "export", str(plan_file), "--format", "vllm")
    assert code == 0 and vllm.rstrip().endswith("--kv-cache-dtype fp8_e5m2 --kv-cache-dtype-skip-layers 1")
    # the same plan scored with the cache in AUTO: nothing quantized, and the stored plan drops its skip list
    auto = run_json(capsys, "score", "tiny", "--plan", str(plan_file), "--kv-cache", "AUTO", *args)
    assert auto["kl_mean"] == 0 and auto["kv_cache"] == "AUTO"
    stored_auto = next(s for s in scoring_svc.list_scores(models_svc.get_model("tiny").id) if s.job_id == auto["job"])
    assert "kv_cache_skip" not in stored_auto.plan_body
    assert plans_svc.resolve(models_svc.get_model("tiny"), stored_auto.plan_body)[0]
    # a layer the model does not have, or sliding windows it does not use: refused before anything runs, and
    # never stored
    for entry, message in (("[7]", "KV cache skip 7: the model's attention layers are 0..1"),
                           ("[sliding_window]", "no sliding-window attention layer")):
        plan_file.write_text(f"model: tiny\ndefault: BF16\nkv_cache: FP8_E5M2\nkv_cache_skip: {entry}\n")
        code, _, err = run(capsys, "plan", "show", str(plan_file))
        assert code == 1 and message in err, err
        code, _, err = run(capsys, "score", "tiny", "--plan", str(plan_file), *args)
        assert code == 1 and message in err, err
        code, _, err = run(capsys, "plan", "import", str(plan_file), "--model", "tiny", "--name", "bad-skip")
        assert code == 1 and message in err, err
    assert not any(p.name == "bad-skip" for p in plans_svc.list_plans(models_svc.get_model("tiny").id))


def test_an_automatic_plan_with_a_kv_cache_spends_part_of_the_budget_on_it(tiny_model, capsys):
    args = ("--local", "--samples", "2", "--seq-len", "32", "--json")
    run_json(capsys, "sensitivity", "tiny", "--scheme", "INT8_PER_TENSOR", *args)
    auto = ("plan", "auto", "tiny", "--target", "h100", "--no-verify", "--json")
    code, _, err = run(capsys, *auto, "--kl-budget", "1000", "--kv-cache", "FP8_E5M2")
    assert code == 1 and "score it alone first" in err and "--scheme BF16 --kv-cache FP8_E5M2" in err
    alone = run_json(capsys, "score", "tiny", "--scheme", "BF16", "--kv-cache", "FP8_E5M2", *args)
    kv_kl = alone["kl_mean"]
    assert kv_kl > 0
    code, _, err = run(capsys, *auto, "--kl-budget", str(kv_kl / 2), "--kv-cache", "FP8_E5M2")
    assert code == 1 and "no less than the budget" in err
    code, _, err = run(capsys, *auto, "--kl-budget", "1", "--kv-cache", "int4")
    assert code == 1 and "unknown KV cache format 'int4'" in err

    from quantplan.services import plans as plans_svc

    plain = run_json(capsys, *auto, "--kl-budget", "1000")
    with_kv = run_json(capsys, *auto, "--kl-budget", "1000", "--kv-cache", "fp8_e5m2")
    assert with_kv["plan_label"] == "auto-h100-kl1000-kv-fp8_e5m2 v1"
    assert plans_svc.get_plan(with_kv["plan_id"]).body["kv_cache"] == "FP8_E5M2"
    assert "kv_cache" not in plans_svc.get_plan(plain["plan_id"]).body
    assert with_kv["predicted_kl"] == pytest.approx(plain["predicted_kl"] + kv_kl)  # an unbinding budget: same linears
    assert any(f"KL {kv_kl:.4g} measured alone (score job #{alone['job']})" in n for n in with_kv["notes"])
    # a budget the cache nearly fills: nothing is left for the linears, which stay BF16
    only_cache = run_json(capsys, *auto, "--kl-budget", str(kv_kl * (1 + 1e-9)), "--kv-cache", "FP8_E5M2")
    assert set(only_cache["plan"].values()) == {"BF16"} and only_cache["predicted_kl"] == pytest.approx(kv_kl)


def test_awq_schemes_are_scored_swept_exported_and_imported(tiny_model, capsys, tmp_path):
    """AWQ presets through the job bodies: scales searched on the calibration text, reported with the score."""
    from quantplan.services import jobs as jobs_svc
    from quantplan.services import models as models_svc
    from quantplan.services import scoring as scoring_svc
    from quantplan.services import serving as serving_svc

    args = ("--local", "--samples", "2", "--seq-len", "32", "--json")
    rtn = run_json(capsys, "score", "tiny", "--scheme", "W4A16", *args)
    awq = run_json(capsys, "score", "tiny", "--scheme", "W4A16_AWQ", *args, "--cal-samples", "4", "--cal-seq-len", "32")
    assert awq["awq_calibration_text"] == "builtin:lee_background.cor" and "awq_calibration_text" not in rtn
    assert awq["calibration_tokens"] == [4, 32] and awq["kl_mean"] < rtn["kl_mean"]
    # the tiny model's 2 blocks: q/k/v, gate/up and down_proj each; o_proj (GQA) and lm_head left unscaled
    assert awq["awq"]["mappings"] == 6 and awq["awq"]["unscaled_layers"] == 3
    assert 0 < awq["awq"]["median_error_ratio"] <= 1 and not awq["awq"]["cached"]
    # the same AWQ layers on the same calibration tokens: the search is read back, and scores the same
    code, out, _ = run(capsys, "score", "tiny", "--scheme", "W4A16_AWQ", *args[:-1], "--cal-samples", "4",
                       "--cal-seq-len", "32")
    assert code == 0 and "AWQ reused the input scales of 6 mapping(s) on builtin:lee_background.cor (4 × 32" in out
    assert f"KL mean {awq['kl_mean']:.4g}" in out
    other = run_json(capsys, "score", "tiny", "--scheme", "W4A16_AWQ", *args, "--cal-samples", "3",
                     "--cal-seq-len", "32")
    assert not other["awq"]["cached"] and other["kl_mean"] != awq["kl_mean"]  # other tokens: searched again
    assert "3 layer(s) left unscaled" in out
    stored = {s.job_id: s.details for s in scoring_svc.list_scores(models_svc.get_model("tiny").id)}
    assert stored[awq["job"]]["calibration"] == "builtin:lee_background.cor, 4 × 32 tokens"
    notes = [n for n in stored[awq["job"]]["notes"] if "AWQ not applied" in n]
    assert len(notes) == 2 and "to 2 layer(s)" in notes[0] and "to 1 layer(s) ('lm_head')" in notes[1]
    sweep = run_json(capsys, "sensitivity", "tiny", "--scheme", "W4A16_AWQ", *args, "--cal-samples", "4",
                     "--cal-seq-len", "32")
    assert sweep["scheme"] == "W4A16_AWQ" and len(sweep["layers"]) == 2 * 4 + 1
    job = jobs_svc.get_job(sweep["job"]).result
    assert job["calibration_tokens"] == [4, 32] and job["awq"]["cached"]  # the preset's score searched the same

    recipe, vllm, back = export_and_import(capsys, tmp_path, "W4A16_AWQ")
    assert "AWQModifier:" in recipe and "n_grid: 20" in recipe and "scheme: W4A16" in recipe and "AWQ" in vllm
    warnings = serving_svc.serving_warnings(models_svc.get_model("tiny"), back)
    assert any("AWQ cannot scale 2 layer(s)" in w for w in warnings)


def test_a_mixture_of_experts_model_is_planned_expert_by_expert(qp_settings, capsys, tmp_path):
    """A tiny Qwen3-MoE (16 experts, one per token: a small calibration leaves most experts without a routed
    token): every expert linear is listed, calibrated, scored with static scales and GPTQ, swept as one unit per
    block, costed by its share of a step and exported under llm-compressor's names."""
    from quantcore.models.routing import Routing
    from quantplan.services import models as models_svc
    from quantplan.services import plans as plans_svc
    from quantplan.services import serving as serving_svc
    from tests.factories import save_tiny_moe

    folder = save_tiny_moe(tmp_path / "moe", num_experts=16, num_experts_per_tok=1)
    res = run_json(capsys, "models", "add", str(folder), "--name", "moe", "--json")
    assert res["linears"] == 2 * (4 + 16 * 3) + 1
    model = models_svc.get_model("moe")
    assert model.moe["experts"] == 16 and model.moe["top_k"] == 1 and model.unsplit_experts == []
    experts = [n for n in models_svc.layer_names(model) if ".experts." in n]

    cal = run_json(capsys, "calibrate", "moe", "--local", "--samples", "1", "--seq-len", "4", "--json")
    layers = {r["name"]: r for r in cal["layers"]}
    assert all(layers[n]["outlier_ratio"] >= 1 for n in experts)  # every expert saw the 4 tokens

    args = ("--local", "--samples", "2", "--seq-len", "8", "--json")
    static = run_json(capsys, "score", "moe", "--scheme", "INT8_PER_TENSOR", *args)
    gptq = run_json(capsys, "score", "moe", "--scheme", "W4A16_G64_GPTQ", *args, "--cal-samples", "1",
                    "--cal-seq-len", "4")
    for score in (static, gptq):
        assert 0 < score["kl_mean"] < 1 and score["top1_agree"] > 0
    code, out, _ = run(capsys, "score", "moe", "--scheme", "W4A16_G64_AWQ", *args[:-1], "--cal-samples", "2",
                       "--cal-seq-len", "16")
    # per block: q/k/v, every expert's gate/up (into the norm, with the router), every expert's down_proj (into its
    # own up_proj); the GQA o_proj has no factor per input, lm_head nothing before it
    assert code == 0 and "AWQ searched the input scales of 36 mapping(s)" in out
    assert "3 layer(s) left unscaled" in out
    sweep = run_json(capsys, "sensitivity", "moe", "--scheme", "FP8_DYNAMIC", *args)
    assert len(sweep["layers"]) == 2 * 3 + 1  # per block q/k/v, o_proj and all its experts as one unit; lm_head

    from quantcore.kernels.roofline import step_bound

    body = {"default": "FP8_DYNAMIC", "rules": [{"match": "lm_head", "scheme": "BF16"}]}
    routed = models_svc.routed_layers(model)
    assert set(routed) == set(experts) and set(routed.values()) == {Routing(16, 1)}
    decode = serving_svc.step_bound(model, body, "h100", 1)  # one expert of 16 read per token
    counted_densely = step_bound(plans_svc.resolve(model, body)[0], models_svc.layer_shapes(model), "h100", 1)
    assert decode.memory_ms == pytest.approx(
        step_bound(plans_svc.resolve(model, body)[0], models_svc.layer_shapes(model), "h100", 1, routed).memory_ms)
    assert decode.memory_ms < counted_densely.memory_ms / 4
    # over 2 GPUs, experts split (each GPU a half of all 16) or whole (each GPU 8 of them): the same weights a GPU
    # reads; split, each GPU also reads every expert's whole input, a little more
    auto = ("plan", "auto", "moe", "--kl-budget", "1000", "--target", "h100", "--cost", "ideal", "--m", "1",
            "--candidates", "FP8_DYNAMIC", "--tp", "2", "--no-verify", "--json")
    split, whole = run_json(capsys, *auto), run_json(capsys, *auto, "--expert-parallel")
    assert whole["cost"] == pytest.approx(split["cost"], rel=0.05) and whole["cost"] < split["cost"]
    assert whole["plan"] == split["plan"]
    assert whole["plan_label"].startswith("auto-h100-kl1000-ideal-m1-tp2-ep ")
    assert plans_svc.get_plan(whole["plan_id"]).body["expert_parallel"] is True

    records = run_json(capsys, "bench", "moe", "--local", "--m", "1,16", "--budget", "5", "--json")
    assert {r["m"] for r in records} == {1, 2, 16}  # 16 tokens over 16 experts: ~1.55 per touched expert

    plan_file = tmp_path / "moe.yaml"
    plan_file.write_text("model: moe\ndefault: FP8_DYNAMIC\nrules:\n  - {match: 'lm_head', scheme: BF16}\n"
                         "  - {match: 'layers\\.1\\.mlp\\.experts\\.', scheme: W4A16_G64}\n")
    code, recipe, _ = run(capsys, "plan", "export", str(plan_file), "--format", "llmcompressor")
    assert code == 0 and r"'re:model\.layers\.(?:1)\.mlp\.experts\.\d+\.(?:down_proj|gate_proj|up_proj)$'" in recipe
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(recipe)
    back = run_json(capsys, "plan", "import", str(recipe_file), "--model", "moe", "--json")
    original = yaml.safe_load(plan_file.read_text())
    assert plans_svc.resolve(model, back["body"])[0] == plans_svc.resolve(model, original)[0]
    # registered by a quantplan that did not split experts: its next job lists them
    from store import repo
    from store.db import session_scope

    with session_scope(qp_settings) as s:
        row = s.get(repo.m.Model, model.id)
        row.summary = {**{k: v for k, v in row.summary.items() if k not in ("moe", "unsplit_experts")},
                       "linears": [lin for lin in row.summary["linears"] if ".experts." not in lin["name"]]}
    assert models_svc.get_model("moe").moe is None and len(models_svc.get_model("moe").linears) == 9
    import worker.bodies.shared

    worker.bodies.shared._MODEL_CACHE.clear()  # a worker started after the upgrade loads the model afresh
    run_json(capsys, "calibrate", "moe", "--local", "--samples", "1", "--seq-len", "4", "--json")
    assert models_svc.get_model("moe").moe == model.moe and models_svc.get_model("moe").linears == model.linears

    split = tmp_path / "split.yaml"
    split.write_text("model: moe\ndefault: FP8_DYNAMIC\nrules:\n  - {match: 'experts\\.0\\.', scheme: BF16}\n")
    code, _, err = run(capsys, "plan", "show", str(split))
    assert code != 0 and "the experts of model.layers.0.mlp.experts mix schemes" in err


def test_a_plan_checked_and_exported_for_several_gpus(tiny_model, capsys, tmp_path):
    """--tensor-parallel: the tiny Llama's 4 heads split over 2 GPUs but not 3; its down_proj (K = 128) holds 64
    inputs a GPU at 2, half a group of 128; the vLLM command carries the size."""
    import dataclasses

    from quantplan.services import models as models_svc

    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text("model: tiny\ndefault: W4A16\nrules:\n  - {match: 'lm_head', scheme: BF16}\n")
    assert run_json(capsys, "plan", "show", str(plan_file), "--json")["tensor_parallel"] == 1
    shown = run_json(capsys, "plan", "show", str(plan_file), "--tp", "2", "--target", "h100", "--json")
    assert shown["tensor_parallel"] == 2
    [warning] = [w for w in shown["serving_warnings"] if "tensor_parallel 2" in w]
    assert warning.startswith("W4A16 at tensor_parallel 2: each GPU holds K / 2 = 64 inputs of 2 row-parallel layer(s)")
    one_gpu = run_json(capsys, "plan", "show", str(plan_file), "--target", "h100", "--json")["ideal"][0]
    assert shown["ideal"][0]["ms"] < one_gpu["ms"]  # each GPU reads half the weights
    assert any("the model has 4 attention heads, which 3 GPUs cannot share evenly" in w
               for w in run_json(capsys, "plan", "show", str(plan_file), "--tp", "3", "--json")["serving_warnings"])
    code, out, err = run(capsys, "plan", "export", str(plan_file), "--format", "vllm", "--tp", "2")
    assert code == 0 and out.splitlines()[-1].endswith("--quantization compressed-tensors --tensor-parallel-size 2")
    assert "K / 2 = 64" in err  # the warning goes to stderr beside the command
    code, out, _ = run(capsys, "plan", "export", str(plan_file), "--format", "vllm", "--tp", "2", "--expert-parallel")
    assert code == 0 and out.splitlines()[-1].endswith("--tensor-parallel-size 2 --enable-expert-parallel")
    with pytest.raises(SystemExit) as refused:  # refused when parsed, in the words a plan file's 0 is refused in
        run(capsys, "plan", "show", str(plan_file), "--tp", "0")
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "tensor_parallel must be between 1 and 1024 GPUs, got 0" in err
    # a model registered before its heads were kept: they come from the config.json quantplan stored
    model = models_svc.get_model("tiny")
    older = dataclasses.replace(model, summary={k: v for k, v in model.summary.items() if k != "attention_heads"})
    assert models_svc.attention_heads(older) == models_svc.attention_heads(model)
    assert model.attention_heads["heads"] == 4


def test_plan_auto_wait_says_when_its_verifying_score_did_not_succeed(tiny_model, capsys, monkeypatch):
    """`plan auto --wait` whose score job fails (here: marked failed as a worker would) says so, rather than
    formatting a missing KL."""
    import jobs.client
    from quantplan.services import models as models_svc
    from store import repo
    from store.db import session_scope

    model = models_svc.get_model("tiny")
    with session_scope() as s:
        job = repo.create_job(s, kind="sensitivity", params={"scheme": "INT8_W8A8"}, queue="cpu", user=None,
                              model_id=model.id)
        repo.save_sensitivity(s, job_id=job.id, model_id=model.id, scheme="INT8_W8A8",
                              rows=[{"layer": lin["name"], "layers": [lin["name"]], "kl_mean": 1e-4,
                                     "top1_agree": 0.99, "sqnr_db": 30.0} for lin in model.linears])
        repo.finish_job(s, job.id, status="succeeded", result={"scheme": "INT8_W8A8"})

    def failed(job_id, **_):
        with session_scope() as s:
            repo.finish_job(s, job_id, status="failed", message="failed", error="out of memory")
            return repo.get_job(s, job_id)

    monkeypatch.setattr(jobs.client, "wait_for", failed)
    code, out, err = run(capsys, "plan", "auto", "tiny", "--kl-budget", "1", "--target", "h100", "--wait")
    assert code == 0, err
    assert re.search(r"verification: score job #\d+ failed \(see `quantplan jobs`\)", out), out


def test_plan_auto_local_verifies_here_and_names_what_it_could_not_use(tiny_model, capsys):
    """--local runs the verifying score in this process; the plan is printed before it runs. A candidate the
    planner cannot use is named with its reason; when none of them can be used, nothing is saved."""
    from quantplan.services import jobs as jobs_svc
    from quantplan.services import models as models_svc
    from quantplan.services import plans as plans_svc

    run_json(capsys, "sensitivity", "tiny", "--scheme", "INT8_W8A8", "--local", "--samples", "2", "--seq-len", "32",
             "--json")
    plans = len(plans_svc.list_plans(models_svc.get_model("tiny").id))
    code, out, err = run(capsys, "plan", "auto", "tiny", "--kl-budget", "1000", "--target", "h100",
                         "--candidates", "W4A16_G64")
    assert code == 1 and "no candidate scheme can be used on tiny for h100: no sensitivity results for W4A16_G64" in err
    assert len(plans_svc.list_plans(models_svc.get_model("tiny").id)) == plans  # no all-BF16 plan saved in its name
    code, out, err = run(capsys, "plan", "auto", "tiny", "--kl-budget", "1000", "--target", "h100", "--candidates",
                         "INT8_W8A8,W4A16_G64", "--local")
    assert code == 0, err
    assert "note: W4A16_G64 not used: no sensitivity results for W4A16_G64" in out
    job = max(jobs_svc.list_jobs(kind="score"), key=lambda j: j.id)
    assert job.queue == "local" and job.status == "succeeded" and job.plan_id is not None
    measured = re.search(r"verified by score job #(\d+): measured KL ([\d.e-]+)", out)
    assert measured and int(measured.group(1)) == job.id
    assert out.index("layers INT8_W8A8") < out.index("verified by")  # the plan first, then its verification
    code, out, err = run(capsys, "plan", "auto", "tiny", "--kl-budget", "1000", "--target", "a100", "--candidates",
                         "INT8_W8A8,FP8_DYNAMIC", "--no-verify")
    assert code == 0 and "note: FP8_DYNAMIC not used:" in out  # an A100 has no FP8 tensor cores


def test_expert_parallelism_asked_of_a_dense_model_is_warned_about(tiny_model, capsys, tmp_path):
    plan_file = tmp_path / "ep.yaml"
    plan_file.write_text("model: tiny\ndefault: FP8_DYNAMIC\ntensor_parallel: 2\nexpert_parallel: true\n")
    code, _, err = run(capsys, "plan", "export", str(plan_file), "--format", "vllm")
    assert code == 0 and "quantplan: warning: expert_parallel: tiny has no routed experts (a dense model)" in err
    plan_file.write_text("model: tiny\ndefault: FP8_DYNAMIC\ntensor_parallel: 2\n")
    code, _, err = run(capsys, "plan", "export", str(plan_file), "--format", "vllm")
    assert code == 0 and "expert_parallel" not in err


def test_importing_a_compressed_tensors_config_says_what_it_cannot_carry(tiny_model, capsys, tmp_path):
    """A compressed-tensors config holds formats, not SmoothQuant's α: the import keeps INT8 W8A8 without the
    smoothing and says so; a recipe's import keeps the smoothing and says nothing."""
    from quantplan.services import models as models_svc
    from quantplan.services import plans as plans_svc

    plan_file = tmp_path / "sq.yaml"
    plan_file.write_text("model: tiny\nname: sq\ndefault: INT8_W8A8_SQ\nrules:\n  - {match: 'lm_head', scheme: BF16}\n"
                         "  - {match: 'o_proj', scheme: INT8_W8A8}\n")  # a recipe cannot smooth o_proj under GQA
    code, config, _ = run(capsys, "plan", "export", str(plan_file), "--format", "compressed-tensors")
    assert code == 0
    (tmp_path / "quantization_config.json").write_text(config)
    code, out, err = run(capsys, "plan", "import", str(tmp_path / "quantization_config.json"), "--model", "tiny",
                         "--name", "from-config")
    assert code == 0 and "imported plan" in out and "note: a compressed-tensors config holds the formats only" in err
    model = models_svc.get_model("tiny")
    back = plans_svc.resolve(model, plans_svc.get_plan("from-config").body)[0]
    assert {s.smoothquant_alpha for s in back.values()} == {None}  # what the note says is lost is lost
    code, recipe, err = run(capsys, "plan", "export", str(plan_file), "--format", "llmcompressor")
    assert code == 0, err
    (tmp_path / "recipe.yaml").write_text(recipe)
    code, out, err = run(capsys, "plan", "import", str(tmp_path / "recipe.yaml"), "--model", "tiny", "--name", "r")
    assert code == 0 and "note:" not in err, err
    kept = plans_svc.resolve(model, plans_svc.get_plan("r").body)[0]
    assert kept["model.layers.0.mlp.down_proj"].smoothquant_alpha is not None  # a recipe keeps the smoothing
