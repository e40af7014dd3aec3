"""The exported rotation, run by the real llm-compressor (.venv-llmc, scripts/llmc_rotate.py) on a tiny Llama with
planted outlier channels, scored by quantplan against its own reference on the same tokens.

The recipe is what ``plan export --format llmcompressor`` writes for an MXFP4 plan with a Hadamard rotation
(R1 + R2 + R4, Sylvester: the matrices llm-compressor builds are the very ones quantplan builds): SpinQuantModifier
ahead of the QuantizationModifier. Three recipes run: the rotation alone, MXFP4 alone, MXFP4 rotated. Checks:

- the rotation alone: quantplan's rotated model scores KL ≈ 0; llm-compressor's does not, and its KL is exactly
  that of centring the embedding rows (SpinQuantModifier does it first; not function-preserving for an RMSNorm
  model) under quantplan's rotation: the gap and its cause, measured;
- MXFP4 plain and rotated as llm-compressor makes them score within a factor :data:`PREDICTION_FACTOR` of quantplan's
  predicted KL for each plan, and in the same order (on this tiny model the rotation does not help MXFP4: its
  32-wide scale blocks already isolate the planted outliers; on SmolLM2 it does, docs/results/rotations.md).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from quantcore.algorithms.inputs import PlanInputs
from quantcore.algorithms.rotation_spec import RotationSpec
from quantcore.evaluation.scoring import plan_applied
from quantcore.export.llmcompressor import to_llmcompressor_recipe
from quantcore.export.spinquant import widths_from_linears
from tests.factories import build_tiny_model, tiny_tokenizer

# every test of this module on one pytest-xdist worker (./dev.sh runs --dist loadgroup): its module fixture's
# setup, the slow part, then runs once instead of once on each worker
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("rotation_llmc")]

REPO = Path(__file__).resolve().parents[3]
LLMC_PYTHON = REPO / ".venv-llmc" / "bin" / "python"
TIMEOUT_S = 900
PREDICTION_FACTOR = 2.0  # llm-compressor's MXFP4 KL vs quantplan's predicted, either way (emulations differ slightly)
ROTATION = RotationSpec()  # plain Hadamard, R1 + R2 + R4; the tiny model's widths (64, 16, 128) are powers of two
QUIP = RotationSpec(rotations=("V",))  # QuIP's input rotation of every decoder linear: QuIPModifier (issue #46)


def _kl(ref: torch.Tensor, logq: torch.Tensor) -> float:
    return float((ref.exp() * (ref - logq)).sum(-1).mean())


@pytest.fixture(scope="module")
def produced(tmp_path_factory):
    if not LLMC_PYTHON.exists():
        pytest.skip("llm-compressor's environment .venv-llmc is not built (scripts/llmc_env.sh)")
    work = tmp_path_factory.mktemp("rotate-llmc")
    model = build_tiny_model("llama")
    folder = work / "tiny-llama"
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    gen = torch.Generator().manual_seed(0)
    ids = {"calibration": torch.randint(0, 128, (4, 32), generator=gen).tolist(),
           "evaluation": torch.randint(0, 128, (8, 32), generator=gen).tolist()}
    (work / "ids.json").write_text(json.dumps(ids))
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    linears = [{"name": n, "in_features": m.in_features} for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear)]
    widths = widths_from_linears(linears, 16)
    plans = {"rotation": (dict.fromkeys(names, "BF16"), ROTATION), "mxfp4": (_mxfp4(names), None),
             "mxfp4_rotated": (_mxfp4(names), ROTATION), "quip": (dict.fromkeys(names, "BF16"), QUIP),
             "mxfp4_quip": (_mxfp4(names), QUIP)}
    jobs = []
    for name, (plan, rot) in plans.items():
        recipe = work / f"{name}.yaml"
        recipe.write_text(to_llmcompressor_recipe(plan, layer_names=names, rotation=rot, rotation_widths=widths))
        jobs.append([name, str(recipe), str(work / f"{name}.safetensors")])
    (work / "jobs.json").write_text(json.dumps(jobs))
    run = subprocess.run([str(LLMC_PYTHON), str(REPO / "scripts" / "llmc_rotate.py"), str(folder),
                          str(work / "ids.json"), str(work / "jobs.json")], capture_output=True, text=True,
                         timeout=TIMEOUT_S, cwd=REPO)
    errors = {n: Path(out).with_suffix(".error").read_text() for n, _, out in jobs
              if Path(out).with_suffix(".error").exists()}
    assert run.returncode == 0 and not errors, (errors or run.stderr[-3000:])
    from safetensors.torch import load_file

    return model, plans, torch.tensor(ids["evaluation"]), {
        n: load_file(out)["logprobs"] for n, _, out in jobs}, {n: (work / f"{n}.yaml").read_text() for n in plans}


def _mxfp4(names):
    return {n: "BF16" if n == "lm_head" else "MXFP4" for n in names}


def test_the_exported_rotation_runs_in_oneshot_and_scores_as_predicted(produced):
    model, plans, ids, llmc, recipes = produced
    recipe = recipes["mxfp4_rotated"]
    assert "SpinQuantModifier" in recipe and recipe.index("SpinQuantModifier") < recipe.index("QuantizationModifier")
    with torch.no_grad():
        ref = torch.log_softmax(model(ids).logits, -1)
        predicted = {}
        for name, (plan, rot) in plans.items():
            with plan_applied(model, plan, PlanInputs(rotation=rot)):
                predicted[name] = _kl(ref, torch.log_softmax(model(ids).logits, -1))
    measured = {name: _kl(ref, logp) for name, logp in llmc.items()}
    print("predicted", predicted, "llm-compressor", measured)
    assert abs(predicted["rotation"]) < 1e-6  # quantplan's rotation is exact
    # llm-compressor's rotated model differs from the original by SpinQuantModifier's centring of the embedding rows,
    # and by nothing else: the same centring under quantplan's rotation gives the same KL
    assert measured["rotation"] > 1e-6
    assert measured["rotation"] == pytest.approx(_centred_kl(model, ids, ref), rel=0.02)
    # the rotated recipe's quantization: within a factor of the prediction, and the same direction against plain
    for name in ("mxfp4", "mxfp4_rotated", "mxfp4_quip"):
        assert predicted[name] / PREDICTION_FACTOR < measured[name] < predicted[name] * PREDICTION_FACTOR, (
            name, predicted, measured)
    assert (measured["mxfp4_rotated"] < measured["mxfp4"]) == (predicted["mxfp4_rotated"] < predicted["mxfp4"])

def test_the_exported_quip_rotation_is_exact_in_oneshot(produced):
    """QuIPModifier centres nothing: llm-compressor's QuIP-rotated model is the original to float tolerance, as
    quantplan's V rotation is."""
    model, plans, ids, llmc, recipes = produced
    quip = recipes["mxfp4_quip"]
    assert "QuIPModifier" in recipes["quip"] and quip.index("QuIPModifier") < quip.index("QuantizationModifier")
    with torch.no_grad():
        ref = torch.log_softmax(model(ids).logits, -1)
    assert abs(_kl(ref, llmc["quip"])) < 1e-6


def _centred_kl(model, ids, ref) -> float:
    """KL of the model with its embedding rows centred (what SpinQuantModifier does first), quantplan's rotation
    applied: the gap llm-compressor's rotated model should show."""
    emb = model.model.embed_tokens.weight
    saved = emb.detach().clone()
    try:
        with torch.no_grad():
            emb.sub_(emb.mean(dim=-1, keepdim=True))
            with plan_applied(model, {}, PlanInputs(rotation=ROTATION)):
                return _kl(ref, torch.log_softmax(model(ids).logits, -1))
    finally:
        with torch.no_grad():
            emb.copy_(saved)
