"""Exported rotated recipes run by the real llm-compressor on SmolLM2-135M, scored by quantplan (issue #46, item 5).

    .venv/bin/python benchmarks/rotation_llmc_smollm2.py [--n-cal 4] [--n-eval 8] [--seq-len 64] [--json out.json]

The SmolLM2 counterpart of ``tests/quantcore/export/test_rotation_llmc.py`` (tiny Llama). For the demo model
(:func:`quantcore.models.intake.converted_gguf_folder` of :func:`demo_gguf_path`, float32) it writes, with the code
``plan export --format llmcompressor`` runs (:func:`quantcore.export.llmcompressor.to_llmcompressor_recipe` over
:func:`quantcore.export.spinquant.widths_from_linears`), the recipes

- ``rotation``: R1 + R2 + R4, plain Hadamard in blocks of 64 (576 and 1536 are not powers of two, and
  llm-compressor's Hadamard is Sylvester only), every linear BF16: SpinQuantModifier alone;
- ``mxfp4``: MXFP4 (W4A4) on every linear but lm_head;
- ``mxfp4_rotated``: the two together (SpinQuantModifier ahead of the QuantizationModifier);
- QuIP (``rotations: [V]``): the whole-width rotation, which the export refuses (its text is printed), then the same
  in blocks of 64, alone and with MXFP4 (QuIPModifier),

runs them through llm-compressor's ``oneshot`` in ``.venv-llmc`` (``scripts/llmc_rotate.py``; never in quantplan's
environment) on ``--n-cal`` × ``--seq-len`` tokens of the packaged calibration text, and scores the model each leaves
against quantplan's own float32 reference on ``--n-eval`` × ``--seq-len`` tokens of the packaged evaluation text:
KL(p_ref ‖ p) in nats, mean over positions, ± the standard error over sequences, beside quantplan's predicted KL for
the same plan (:func:`quantcore.evaluation.scoring.plan_applied`). For the SpinQuant recipes it also scores
quantplan's plan with the embedding rows centred first (what ``SpinQuantModifier`` does before rotating; untied from
lm_head, as llm-compressor unties them): the part of the gap that centring explains. And, as a diagnostic of the
rest, each MXFP4 plan once more with quantplan's activation block scales on compressed-tensors' E8M0 rule (the block
amax rounded to a power of two, up from 1.75 · 2**e, as ``generate_mx_scales`` does for the dynamic activations in
llm-compressor's forward) instead of OCP's floor(log2 amax), which quantplan keeps for activations
(:func:`quantcore.formats.scales.e8m0_scale`; its weights already take compressed-tensors' rule): a patch of
``quantcore.formats.quantize.e8m0_scale`` for the duration of that one score, not a product path.

Minutes on a 2-core CPU; no GPU needed. ``.venv-llmc`` must exist (scripts/llmc_env.sh builds it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch

import quantcore.formats.quantize as quantize_mod
from quantcore.algorithms.inputs import PlanInputs
from quantcore.algorithms.rotation_spec import RotationSpec
from quantcore.errors import PlanError
from quantcore.evaluation.scoring import plan_applied
from quantcore.evaluation.text import default_calibration_text, default_eval_text, load_documents, token_batches
from quantcore.export.llmcompressor import to_llmcompressor_recipe
from quantcore.export.spinquant import widths_from_linears
from quantcore.models.intake import converted_gguf_folder, demo_gguf_path
from quantcore.models.loading import load_model
from quantcore.models.validation import default_cache_dir

REPO = Path(__file__).resolve().parents[1]
LLMC_PYTHON = REPO / ".venv-llmc" / "bin" / "python"
BLOCK = 64  # divides 576 (hidden) and 1536 (intermediate); R2 takes head_dim (64) anyway
ROTATION = RotationSpec(block_size=BLOCK)
QUIP_WHOLE = RotationSpec(rotations=("V",))
QUIP = RotationSpec(rotations=("V",), block_size=BLOCK)


def kl_rows(ref: torch.Tensor, logq: torch.Tensor) -> np.ndarray:
    """Mean KL(p_ref || q) over each sequence's positions (nats), [S]."""
    return (ref.exp() * (ref - logq)).sum(-1).mean(-1).double().numpy()


def mean_se(x: np.ndarray) -> tuple[float, float]:
    return float(x.mean()), float(x.std(ddof=1) / np.sqrt(len(x))) if len(x) > 1 else float("nan")


def logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.log_softmax(model(ids[i:i + 4]).logits.float(), dim=-1)
                      for i in range(0, ids.shape[0], 4)])


@contextmanager
def embedding_centred(model):
    """The embedding rows centred (each row minus its mean) as SpinQuantModifier does first, untied from lm_head (as
    llm-compressor unties them before centring); the original Parameter put back after."""
    emb = model.get_input_embeddings()
    saved = emb.weight
    emb.weight = torch.nn.Parameter(saved.detach() - saved.detach().mean(dim=-1, keepdim=True), requires_grad=False)
    try:
        yield
    finally:
        emb.weight = saved


@contextmanager
def ct_activation_scales():
    """Diagnostic only: quantplan's MX activation block scales on compressed-tensors' rounded-amax rule (see the
    module docstring) while inside; the OCP rule put back after."""
    original = quantize_mod.e8m0_scale

    def rounded(amax, elem, *, round_amax=False):
        return original(amax, elem, round_amax=True)

    quantize_mod.e8m0_scale = rounded
    try:
        yield
    finally:
        quantize_mod.e8m0_scale = original


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-cal", type=int, default=4)
    ap.add_argument("--n-eval", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--work", default=None, help="folder for the recipes and llm-compressor's outputs (default: temp)")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    if not LLMC_PYTHON.exists():
        sys.exit(f"llm-compressor's environment {LLMC_PYTHON.parent.parent} is not built (scripts/llmc_env.sh)")
    torch.set_grad_enabled(False)
    t0 = time.perf_counter()
    work = Path(args.work or tempfile.mkdtemp(prefix="rotation-llmc-"))
    work.mkdir(parents=True, exist_ok=True)
    folder = converted_gguf_folder(demo_gguf_path(), cache_dir=default_cache_dir())
    model, tok = load_model(folder)
    cal = token_batches(tok, load_documents(default_calibration_text()), n_samples=args.n_cal, seq_len=args.seq_len)
    ids = token_batches(tok, load_documents(default_eval_text()), n_samples=args.n_eval, seq_len=args.seq_len)
    ref = logprobs(model, ids)

    mods = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    names = [n for n, _ in mods]
    head_dim = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
    widths = widths_from_linears([{"name": n, "in_features": m.in_features} for n, m in mods], head_dim)
    bf16 = dict.fromkeys(names, "BF16")
    mxfp4 = {n: "BF16" if n == "lm_head" else "MXFP4" for n in names}
    plans = {"rotation": (bf16, ROTATION), "mxfp4": (mxfp4, None), "mxfp4_rotated": (mxfp4, ROTATION),
             "quip_whole": (mxfp4, QUIP_WHOLE), "quip": (bf16, QUIP), "mxfp4_quip": (mxfp4, QUIP)}
    jobs, refused = [], {}
    for name, (plan, rot) in plans.items():
        try:
            text = to_llmcompressor_recipe(plan, layer_names=names, rotation=rot, rotation_widths=widths)
        except PlanError as e:
            refused[name] = str(e)
            print(f"{name}: the export refuses it:\n{e}\n", flush=True)
            continue
        recipe = work / f"{name}.yaml"
        recipe.write_text(text)
        out = work / f"{name}.safetensors"
        out.with_suffix(".error").unlink(missing_ok=True)
        jobs.append([name, str(recipe), str(out)])
    (work / "ids.json").write_text(json.dumps({"calibration": cal.tolist(), "evaluation": ids.tolist()}))
    (work / "jobs.json").write_text(json.dumps(jobs))
    t1 = time.perf_counter()
    run = subprocess.run([str(LLMC_PYTHON), str(REPO / "scripts" / "llmc_rotate.py"), str(folder),
                          str(work / "ids.json"), str(work / "jobs.json")], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": ""})
    llmc_s = time.perf_counter() - t1
    print(f"llm-compressor: {len(jobs)} oneshot runs in {llmc_s:.0f} s (exit {run.returncode})", flush=True)

    from safetensors.torch import load_file

    rows = []
    for name, _recipe, out_file in jobs:
        plan, rot = plans[name]
        inputs = PlanInputs(rotation=rot)
        with plan_applied(model, plan, inputs):
            predicted = kl_rows(ref, logprobs(model, ids))
        row = {"recipe": name, "rotation": rot.label() if rot else None,
               "predicted": mean_se(predicted), "predicted_per_sequence": predicted.tolist()}
        if rot is not None and "V" not in rot.rotations:  # SpinQuantModifier centres the embedding first
            with embedding_centred(model), plan_applied(model, plan, inputs):
                row["predicted_centred"] = mean_se(kl_rows(ref, logprobs(model, ids)))
        if any(v == "MXFP4" for v in plan.values()):
            with ct_activation_scales():
                with plan_applied(model, plan, inputs):
                    row["predicted_ct_scales"] = mean_se(kl_rows(ref, logprobs(model, ids)))
                if "predicted_centred" in row:
                    with embedding_centred(model), plan_applied(model, plan, inputs):
                        row["predicted_ct_scales_centred"] = mean_se(kl_rows(ref, logprobs(model, ids)))
        err = Path(out_file).with_suffix(".error")
        if err.exists():
            row["error"] = err.read_text()
            print(f"{name}: llm-compressor failed:\n{row['error'][-3000:]}", flush=True)
        else:
            measured = kl_rows(ref, load_file(out_file)["logprobs"])
            row["measured"] = mean_se(measured)
            row["measured_per_sequence"] = measured.tolist()
            row["difference"] = mean_se(measured - predicted)  # paired over the same sequences
        rows.append(row)
    if run.returncode and not any("error" in r for r in rows):
        print(run.stderr[-3000:], flush=True)

    meta = {"date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "machine": platform.processor()
            or platform.machine(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "calibration_tokens": int(cal.numel()), "evaluation_tokens": int(ids.numel()),
            "llmc_seconds": round(llmc_s), "seconds": round(time.perf_counter() - t0), "work": str(work)}
    print(f"\n{meta}\n\n| recipe | quantplan predicts | llm-compressor's model | ratio | difference (paired) | "
          "quantplan, embedding centred | quantplan, CT activation scales (centred) |\n|---|---|---|---|---|---|---|")

    def fmt(v) -> str:
        return f"{v[0]:.4g} ± {v[1]:.2g}" if v else "—"

    for r in rows:
        p, m = r["predicted"], r.get("measured")
        ratio = f"{m[0] / p[0]:.3f}" if m and abs(p[0]) > 1e-6 else "—"
        ct = fmt(r.get("predicted_ct_scales"))
        if "predicted_ct_scales_centred" in r:
            ct += f" ({fmt(r['predicted_ct_scales_centred'])})"
        print(f"| {r['recipe']} ({r['rotation'] or 'no rotation'}) | {fmt(p)} | "
              f"{fmt(m) if m else 'failed (see above)'} | {ratio} | {fmt(r.get('difference'))} | "
              f"{fmt(r.get('predicted_centred'))} | {ct} |")
    for name, text in refused.items():
        print(f"\nrefused at export ({name}):\n{text}")
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows, "refused": refused}, indent=1))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
