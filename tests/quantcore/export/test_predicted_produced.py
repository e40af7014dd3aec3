"""Predicted equals produced: quantplan's score of a plan against the checkpoint llm-compressor really writes for it.

For each plan family that exports to llm-compressor (FP8_DYNAMIC, FP8_BLOCK, INT8_W8A8 with and without
SmoothQuant, W4A16 with GPTQ, NVFP4) on the real SmolLM2-135M:

* predicted: quantplan's own score of the plan (``score_plan``: its calibration, its SmoothQuant factors, its GPTQ
  on one-pass Hessians, its fake quantization) on the evaluation tokens, against the unquantized reference;
* produced: the exported recipe run through the real llm-compressor ``oneshot`` in ``.venv-llmc``
  (``scripts/llmc_produce.py``) on the SAME calibration ids, its checkpoint decompressed to float (every quantized
  weight fake-quantized with the scales ``oneshot`` stored, the norms SmoothQuant folded into), loaded into the model
  and scored on the same evaluation tokens against the same reference, with the plan's activation quantization
  only: what a serving engine does with that checkpoint. The weights are exactly the checkpoint's (handed to
  quantcore's ``apply_plan`` as already-rounded weights, through its ``gptq_cache``, so nothing rounds them again);
  dynamic activation scales are computed per token / group at run time as the engine does; NVFP4's calibrated
  activation tensor scale is the checkpoint's own ``input_global_scale``.

The two KL means are compared sequence by sequence (the paired difference of per-sequence KL means and its
standard error): equal within ``3 x paired error + ABS_TOL``, or, where the docs table
(docs/results/predicted-vs-produced.md) states a gap and its cause, within the bound it states (``KNOWN_GAPS``).
Run with ``-s`` to print the table's rows and the timings. About 65 s here (2 cores, other jobs beside it).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from quantcore.algorithms.gptq import collect_hessians
from quantcore.algorithms.inputs import PlanInputs
from quantcore.evaluation.calibrate import calibrate
from quantcore.evaluation.reference import ReferenceCache, compute_reference
from quantcore.evaluation.scoring import ScoreReport, score_plan
from quantcore.evaluation.text import default_calibration_text, default_eval_text, load_documents, token_batches
from quantcore.export.llmcompressor import to_llmcompressor_recipe
from quantcore.formats.scales import NVFP4_TENSOR_SCALE_DIVISOR
from quantcore.models.intake import converted_gguf_folder, demo_gguf_path
from quantcore.models.loading import load_model
from quantcore.schemes.presets import get_scheme
from quantcore.schemes.specs import Scheme

# every test of this module on one pytest-xdist worker (./dev.sh runs --dist loadgroup): its module fixture's
# setup, the slow part, then runs once instead of once on each worker
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("predicted_produced")]

REPO = Path(__file__).resolve().parents[3]
LLMC_PYTHON = REPO / ".venv-llmc" / "bin" / "python"
ENV_TIMEOUT_S = 1800  # a first build of .venv-llmc on a slow mirror; a warm one returns at once
PRODUCE_TIMEOUT_S = 900  # every family in one process: ~40 s here, import included
N_CAL, N_EVAL, SEQ_LEN = 8, 8, 64  # calibration and evaluation sequences x tokens
# Equal means |produced - predicted| <= 3 paired standard errors + ABS_TOL. ABS_TOL covers what the paired error
# cannot: where both sides hold the very same weights (the round-to-nearest families: measured difference 0, bit
# for bit), every sequence's difference and so the paired error are 0, and the only noise left is float order: a
# scale computed in fp32 by compressed-tensors and in float64-then-fp32 by quantcore can put a weight that sits on
# a rounding tie on the other grid point in another torch or compressed-tensors version. 2e-4 nats is under 1 % of
# the smallest KL here and far below any difference of method (the SmoothQuant gap is 0.02).
ABS_TOL = 2e-4


def everywhere(preset: str) -> Callable[[list[str]], dict[str, Scheme]]:
    """``preset`` on every decoder linear, lm_head (tied to the embedding) left in BF16."""
    return lambda names: {n: get_scheme(preset if n != "lm_head" else "BF16") for n in names}


def smoothquant(names: list[str]) -> dict[str, Scheme]:
    """INT8_W8A8_SQ everywhere but o_proj (INT8_W8A8: llm-compressor's SmoothQuant cannot fold o_proj into v_proj
    under grouped-query attention), lm_head in BF16."""
    return {n: get_scheme("BF16" if n == "lm_head" else "INT8_W8A8" if n.endswith("o_proj") else "INT8_W8A8_SQ")
            for n in names}


def gptq_down(names: list[str]) -> dict[str, Scheme]:
    """W4A16_GPTQ on the 30 down_proj (K = 1536; its groups of 128 divide no other K of SmolLM2, and llm-compressor
    refuses those layers), the rest in BF16."""
    return {n: get_scheme("W4A16_GPTQ" if n.endswith("down_proj") else "BF16") for n in names}


FAMILIES: dict[str, Callable[[list[str]], dict[str, Scheme]]] = {
    "FP8_DYNAMIC": everywhere("FP8_DYNAMIC"),
    "FP8_BLOCK": everywhere("FP8_BLOCK"),
    "INT8_W8A8": everywhere("INT8_W8A8"),
    "INT8_W8A8_SQ": smoothquant,
    "W4A16_GPTQ": gptq_down,
    "NVFP4": everywhere("NVFP4"),
}

# Families whose checkpoint truly differs from the prediction: family -> (bound on |produced - predicted| KL mean
# relative to the predicted KL mean, cause). The docs table states the same bound and cause.
KNOWN_GAPS: dict[str, tuple[float, str]] = {
    "INT8_W8A8_SQ": (1.6, "llm-compressor's SmoothQuantModifier takes s_j from the activation's range max_j - min_j "
                          "(of up_proj's output for down_proj) against 2 max|W_j|, quantplan from max|x_j| against "
                          "max|W_j| (the paper's formula)"),
    # measured +0.0383 +- 0.0111 (+15.7 %) on 2026-12-05 with a fresh .venv-llmc, at this commit and the one before
    "W4A16_GPTQ": (0.25, "llm-compressor collects GPTQ's Hessians block by block through the blocks it already "
                         "rounded (its sequential pipeline), quantplan in one pass of the unquantized model"),
}
# Families whose gap the test explains: quantplan's score with the statistics llm-compressor reads (see
# llmc_smoothing_statistics) must equal the produced checkpoint's within the paired error.
EXPLAINED = ("INT8_W8A8_SQ",)


def llmc_smoothing_statistics(model: torch.nn.Module, plan: dict[str, Scheme],
                               cal: torch.Tensor) -> dict[str, torch.Tensor]:
    """{smoothed layer: (max_j - min_j) / 2} of the tensor llm-compressor 0.14's SmoothQuantModifier observes for
    it on the calibration tokens: the layer's input for q/k/v and gate/up (the norm's output), up_proj's output for
    down_proj (its mapping's smooth layer; down_proj's input is act(gate) * up). Given to quantplan as
    ``act_channel_max``, its SmoothQuant folds llm-compressor's factors: theirs are range_j^a / (2 max|W_j|)^(1-a)
    = (range_j / 2)^a / max|W_j|^(1-a) * 2^(2a-1), a constant 2^(2a-1) (1 at a = 0.5) that a per-token activation
    scale and a per-channel weight scale cancel."""
    modules = dict(model.named_modules())
    smoothed = [n for n, s in plan.items() if s.smoothquant_alpha is not None]
    lo: dict[str, torch.Tensor] = {}
    hi: dict[str, torch.Tensor] = {}

    def observe(name: str, x: torch.Tensor) -> None:
        rows = x.detach().reshape(-1, x.shape[-1])
        mn, mx = rows.amin(0), rows.amax(0)
        lo[name] = torch.minimum(lo[name], mn) if name in lo else mn
        hi[name] = torch.maximum(hi[name], mx) if name in hi else mx

    handles = []
    for n in smoothed:
        if n.endswith("mlp.down_proj"):
            up = modules[n.removesuffix("down_proj") + "up_proj"]
            handles.append(up.register_forward_hook(lambda _m, _a, out, n=n: observe(n, out)))
        else:
            handles.append(modules[n].register_forward_pre_hook(lambda _m, args, n=n: observe(n, args[0])))
    try:
        with torch.no_grad():
            for i in range(0, cal.shape[0], 4):
                model(input_ids=cal[i:i + 4])
    finally:
        for h in handles:
            h.remove()
    return {n: (hi[n] - lo[n]) / 2 for n in smoothed}


@dataclasses.dataclass
class Side:
    """One side of a comparison: its ScoreReport and its per-sequence KL means."""

    report: ScoreReport
    kl_seq: np.ndarray

    @property
    def err(self) -> float:
        return float(self.kl_seq.std(ddof=1) / np.sqrt(len(self.kl_seq)))


def per_sequence_kl(report: ScoreReport) -> np.ndarray:
    """The report's per-sequence KL means (every sequence has SEQ_LEN - 1 scored positions, so their mean is
    kl_mean)."""
    assert report.kl_by_sequence is not None and len(report.kl_by_sequence) == N_EVAL
    seq = np.asarray(report.kl_by_sequence, dtype=np.float64)
    assert abs(seq.mean() - report.kl_mean) <= 1e-6 * max(report.kl_mean, 1e-9)
    return seq


def paired(pred: Side, prod: Side) -> tuple[float, float]:
    """(mean of produced - predicted per-sequence KL, its standard error over the sequences)."""
    d = prod.kl_seq - pred.kl_seq
    return float(d.mean()), float(d.std(ddof=1) / np.sqrt(len(d)))


@pytest.fixture(scope="module")
def compared(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Side, Side, Side | None]]:
    """family -> (predicted, produced, explained), all on the same evaluation tokens against the same reference;
    explained: for the families of EXPLAINED, quantplan's score with the statistics llm-compressor reads."""
    started = time.monotonic()
    env = subprocess.run(["bash", str(REPO / "scripts" / "llmc_env.sh")], capture_output=True, text=True,
                         timeout=ENV_TIMEOUT_S, cwd=REPO)
    assert env.returncode == 0, f"scripts/llmc_env.sh failed:\n{env.stderr[-3000:]}"
    folder = converted_gguf_folder(demo_gguf_path())  # float32 safetensors, converted once and cached
    model, tok = load_model(folder)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    cal = token_batches(tok, load_documents(default_calibration_text()), n_samples=N_CAL, seq_len=SEQ_LEN)
    ev = token_batches(tok, load_documents(default_eval_text()), n_samples=N_EVAL, seq_len=SEQ_LEN)
    assert cal.shape == (N_CAL, SEQ_LEN) and ev.shape == (N_EVAL, SEQ_LEN)

    root = tmp_path_factory.mktemp("produced")
    (root / "calibration.json").write_text(json.dumps(cal.tolist()))
    plans = {family: make(names) for family, make in FAMILIES.items()}
    jobs = []
    for family, plan in plans.items():
        workdir = root / family
        workdir.mkdir()
        (workdir / "recipe.yaml").write_text(to_llmcompressor_recipe(plan, layer_names=names), encoding="utf-8")
        jobs.append([family, str(workdir / "recipe.yaml"), str(workdir)])
    (root / "jobs.json").write_text(json.dumps(jobs))
    # llm-compressor's process runs while quantplan predicts, one core each (two torch thread pools on two cores
    # would spin against each other): its imports, model loads and file writes overlap our forwards. quantplan
    # stays on one thread to the end: its checkpoint scores ran 2-3x slower on two threads of a shared 2-core box
    # its log goes to a file: a pipe nobody reads until the end would fill and stall it
    log = root / "llmc.log"
    with log.open("w") as sink:
        llmc = subprocess.Popen([str(LLMC_PYTHON), str(REPO / "scripts" / "llmc_produce.py"), str(folder),
                                 str(root / "calibration.json"), str(root / "jobs.json")],
                                stdout=sink, stderr=subprocess.STDOUT, cwd=REPO,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _compare(model, plans, root, llmc, log, cal, ev, started)
    finally:
        torch.set_num_threads(threads)
        if llmc.poll() is None:
            llmc.kill()


def _compare(model: torch.nn.Module, plans: dict[str, dict[str, Scheme]], root: Path, llmc: subprocess.Popen,
             log: Path, cal: torch.Tensor, ev: torch.Tensor,
             started: float) -> dict[str, tuple[Side, Side, Side | None]]:
    """The predictions (while ``llmc`` runs), then the scores of the checkpoints it wrote under ``root``."""
    stats = calibrate(model, cal)
    inputs = PlanInputs(act_amax={n: st.amax for n, st in stats.items()},
                        act_channel_max={n: st.channel_max for n, st in stats.items()},
                        weight_hessians=collect_hessians(
                            model, [n for p in plans.values() for n, s in p.items() if s.gptq], cal))
    ref = compute_reference(model, ev)
    predicted = {family: score_plan(model, plan, ev, ref, inputs=inputs) for family, plan in plans.items()}
    explained = {family: score_plan(model, plans[family], ev, ref, inputs=dataclasses.replace(
        inputs, act_channel_max=llmc_smoothing_statistics(model, plans[family], cal))) for family in EXPLAINED}
    predicted_s = time.monotonic() - started
    llmc.wait(timeout=PRODUCE_TIMEOUT_S)
    produced_s = time.monotonic() - started
    errors = {f: (root / f / "produce.error").read_text()[-2000:] for f in plans
              if (root / f / "produce.error").exists()}
    assert not errors and llmc.returncode == 0, f"llm-compressor failed: {errors or log.read_text()[-3000:]}"
    out = {}
    for family, plan in plans.items():
        meta = json.loads((root / family / "produced.json").read_text())
        check_layers(plan, meta["layers"])
        weights = root / family / "produced.safetensors"
        produced = score_produced(model, plan, load_file(weights), ev, ref)
        weights.unlink()  # 425 MB a family in float32: pytest keeps its last three temporary folders
        why = explained.get(family)
        out[family] = (Side(predicted[family], per_sequence_kl(predicted[family])),
                       Side(produced, per_sequence_kl(produced)),
                       None if why is None else Side(why, per_sequence_kl(why)))
    print(f"\npredicted vs produced: predictions done at {predicted_s:.0f} s, oneshot at {produced_s:.0f} s, "
          f"scores of the checkpoints at {time.monotonic() - started:.0f} s")
    return out


def check_layers(plan: dict[str, Scheme], layers: dict[str, Any]) -> None:
    """oneshot quantized exactly the plan's quantized layers, weights in the plan's format."""
    quantized = {n for n, s in plan.items() if not s.is_identity}
    assert set(layers) == quantized
    for n in quantized:
        spec, got = plan[n].weight_spec(), layers[n]["weights"]
        bits = {"int8": 8, "int4": 4, "fp8_e4m3": 8, "nvfp4": 4}[spec.format]
        assert got["num_bits"] == bits and (got["type"] == "int") == spec.format.startswith("int"), (n, got)
        assert (layers[n]["input_activations"] is None) == (plan[n].activations is None), n


def score_produced(model: torch.nn.Module, plan: dict[str, Scheme], tensors: dict[str, torch.Tensor],
                   ev: torch.Tensor, ref: ReferenceCache) -> ScoreReport:
    """The produced checkpoint scored as served: its weights verbatim, its norms (SmoothQuant's folds), the plan's
    activation quantization with the checkpoint's static activation scales. The weights go to ``apply_plan`` as
    already-rounded GPTQ weights (its ``gptq_cache``: a layer found there is taken as is, never rounded again);
    the schemes keep their formats for the activations and lose SmoothQuant (already folded into the checkpoint).
    The model's own norm weights are put back afterwards."""
    modules = dict(model.named_modules())
    quantized = {n: s for n, s in plan.items() if not s.is_identity}
    served = {n: dataclasses.replace(s, gptq=True, awq=False, smoothquant_alpha=None) for n, s in quantized.items()}
    cache = {n: tensors[n + ".weight"] for n in quantized}
    act_amax = {}
    for n, s in quantized.items():
        if s.activations is not None and not s.activations.dynamic:
            assert s.activations.format == "nvfp4", f"{n}: only NVFP4's static activation scale is read here"
            act_amax[n] = float(NVFP4_TENSOR_SCALE_DIVISOR / tensors[n + ".input_global_scale"].reshape(()))
    norms = {k.removesuffix(".weight"): w for k, w in tensors.items()
             if k.endswith(".weight") and k.removesuffix(".weight") not in quantized}
    saved = {n: modules[n].weight.detach().clone() for n in norms}
    try:
        with torch.no_grad():
            for n, w in norms.items():
                modules[n].weight.copy_(w)
        return score_plan(model, served, ev, ref, inputs=PlanInputs(act_amax=act_amax, gptq_cache=cache))
    finally:
        with torch.no_grad():
            for n, w in saved.items():
                modules[n].weight.copy_(w)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_produced_checkpoint_scores_what_quantplan_predicted(compared, family: str) -> None:
    """The checkpoint llm-compressor writes for the exported plan scores the KL quantplan predicted for it: equal
    within the paired error, or within the gap the docs table states for this family (KNOWN_GAPS)."""
    pred, prod, why = compared[family]
    diff, err = paired(pred, prod)
    print(f"| {family} | {pred.report.kl_mean:.4f} ± {pred.err:.4f} | {prod.report.kl_mean:.4f} ± {prod.err:.4f} "
          f"| {diff:+.5f} ± {err:.5f} | top-1 {pred.report.top1_agree:.3f} / {prod.report.top1_agree:.3f} |")
    if why is not None:
        rest, rest_err = paired(why, prod)
        print(f"| {family}, llm-compressor's statistics | {why.report.kl_mean:.4f} ± {why.err:.4f} | | "
              f"{rest:+.5f} ± {rest_err:.5f} | top-1 {why.report.top1_agree:.3f} |")
    assert prod.report.kl_mean > 0  # the checkpoint is quantized: a load that missed the weights scores 0
    if family in KNOWN_GAPS:
        bound, cause = KNOWN_GAPS[family]
        assert abs(diff) <= bound * pred.report.kl_mean, f"{family}: {diff:+.5f} beyond the stated gap ({cause})"
    else:
        assert abs(diff) <= 3 * err + ABS_TOL, f"{family}: produced - predicted = {diff:+.5f} ± {err:.5f}"
    if why is not None:  # the stated cause accounts for the whole gap
        assert abs(rest) <= 3 * rest_err + ABS_TOL, f"{family}: {rest:+.5f} ± {rest_err:.5f} left unexplained"
