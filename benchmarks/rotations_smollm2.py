"""Outlier fixes side by side on the real demo model (SmolLM2-135M-Instruct): plain, SmoothQuant, Hadamard rotation,
both; KL of each against the unquantized model, and down_proj's outlier ratio before and after.

    .venv/bin/python benchmarks/rotations_smollm2.py [--n-cal 8] [--n-eval 8] [--seq-len 128] [--block-size 64]

For the unrotated model and for the model rotated R1 + R2 + R4 (:mod:`quantcore.algorithms.rotation`, a plain
Hadamard, one matrix of the whole width unless ``--block-size``), calibrates on the packaged calibration text (with
the rotation applied: the static scales, the SmoothQuant maxima and the outlier statistics are those of the rotated
model), then scores every linear but lm_head in each scheme, plain and with SmoothQuant at the α quantplan suggests
for that scheme (:func:`quantcore.evaluation.alpha.suggest_alpha`, one α per fusion group), on the same evaluation
tokens against the unquantized model. KL is the mean over positions of KL(p_ref || p_plan) in nats, ± the standard
error over sequences. An identity plan with the rotation is scored too: the rotation alone must give KL ≈ 0.

Prints one table (markdown) and, with --json, writes the figures. No GPU needed (minutes on a laptop CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time
from datetime import UTC, datetime

import numpy as np
import torch

from quantcore.algorithms.inputs import PlanInputs
from quantcore.algorithms.rotation import rotation_applied
from quantcore.algorithms.rotation_spec import RotationSpec
from quantcore.evaluation import alpha as al
from quantcore.evaluation.calibrate import calibrate
from quantcore.evaluation.rotation_view import kurtosis
from quantcore.evaluation.scoring import plan_applied
from quantcore.evaluation.stats import LayerStats
from quantcore.evaluation.text import default_calibration_text, default_eval_text, load_documents, token_batches
from quantcore.formats.granularity import Granularity
from quantcore.models.intake import converted_gguf_folder, demo_gguf_path
from quantcore.models.loading import load_model
from quantcore.models.validation import default_cache_dir
from quantcore.schemes.fusion import fusion_group_of
from quantcore.schemes.presets import get_scheme
from quantcore.schemes.specs import Scheme, TensorSpec

# W4A4 (MXFP4, NVFP4, INT4 per-token), W8A8 per-tensor INT8 and FP8
SCHEMES = ("MXFP4", "NVFP4", "INT4_W4A4", "INT8_PER_TENSOR", "FP8_PER_TENSOR")
# not a preset (no serving kernel quantplan targets takes it): QuaRot's W4A4 INT4 setting, per-channel symmetric
# weights rounded to nearest and dynamic per-token activations
LOCAL_SCHEMES = {"INT4_W4A4": Scheme("INT4_W4A4", TensorSpec("int4", Granularity.CHANNEL, dynamic=False),
                                     TensorSpec("int4", Granularity.TOKEN),
                                     description="INT4 per-channel weights, INT4 dynamic per-token activations")}
FOCUS = "model.layers.11.mlp.down_proj"  # the Outliers page's Done-when example


def kl_per_sequence(model, plan, inputs: PlanInputs, ids: torch.Tensor, ref: torch.Tensor) -> np.ndarray:
    """Mean KL(p_ref || p_plan) over each sequence's positions (nats), [S]."""
    out = []
    with plan_applied(model, plan, inputs), torch.no_grad():
        for i in range(0, ids.shape[0], 4):
            logq = torch.log_softmax(model(ids[i:i + 4]).logits.float(), dim=-1)
            r = ref[i:i + 4]
            out.append((r.exp() * (r - logq)).sum(dim=-1).mean(dim=-1).double().numpy())
    return np.concatenate(out)


def suggested_alphas(stats: dict[str, LayerStats], names: list[str], scheme: Scheme) -> dict[str, float]:
    out: dict[str, float] = {}
    for name in names:
        if name not in out:
            group = fusion_group_of(name, names)
            out.update(dict.fromkeys(group, al.suggest_alpha([stats[m] for m in group], scheme)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-cal", type=int, default=8)
    ap.add_argument("--n-eval", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    t0 = time.perf_counter()
    model, tok = load_model(converted_gguf_folder(demo_gguf_path(), cache_dir=default_cache_dir()))
    model.eval()
    cal = token_batches(tok, load_documents(default_calibration_text()), n_samples=args.n_cal, seq_len=args.seq_len)
    ids = token_batches(tok, load_documents(default_eval_text()), n_samples=args.n_eval, seq_len=args.seq_len)
    ref = torch.cat([torch.log_softmax(model(ids[i:i + 4]).logits.float(), dim=-1) for i in range(0, len(ids), 4)])
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    spec = RotationSpec(block_size=args.block_size)
    rows, outliers, inputs, stats_of = [], {}, {}, {}
    downs = [n for n in names if n.endswith("down_proj")]
    for label, rot in (("none", None), ("rotation", spec)):  # calibrated as scored: rotated for the rotated plans
        with rotation_applied(model, rot):
            stats = calibrate(model, cal, batch_size=4)
        stats_of[label] = stats
        outliers[label] = {
            "focus_outlier_ratio": stats[FOCUS].outlier_ratio, "focus_kurtosis": kurtosis(stats[FOCUS]),
            "down_outlier_ratio_median": float(np.median([stats[n].outlier_ratio for n in downs])),
            "down_outlier_ratio_max": float(max(stats[n].outlier_ratio for n in downs)),
            "down_kurtosis_median": float(np.median([kurtosis(stats[n]) for n in downs]))}
        inputs[label] = PlanInputs(act_amax={n: s.amax for n, s in stats.items()},
                                   act_channel_max={n: s.channel_max for n, s in stats.items()}, rotation=rot)
        print(f"{label}: {outliers[label]}", flush=True)

    def score(scheme: str, fix: str, plan: dict, label: str, alpha: float | None = None) -> None:
        kl = kl_per_sequence(model, plan, inputs[label], ids, ref)
        se = float(kl.std(ddof=1) / np.sqrt(len(kl)))
        rows.append({"scheme": scheme, "fix": fix, "kl": float(kl.mean()), "se": se, "alpha_median": alpha,
                     "per_sequence": kl.tolist()})
        print(f"{scheme:16s} {fix:24s} KL {rows[-1]['kl']:.5f} ± {rows[-1]['se']:.5f}", flush=True)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"rows": rows, "outliers": outliers}, fh, indent=1)

    score("BF16 (identity)", "rotation", dict.fromkeys(names, "BF16"), "rotation")
    for scheme in args.schemes.split(","):
        base = LOCAL_SCHEMES.get(scheme) or get_scheme(scheme)
        score(scheme, "plain", dict.fromkeys(names, base), "none")
        score(scheme, "rotation", dict.fromkeys(names, base), "rotation")
        for label, fix in (("none", "SmoothQuant"), ("rotation", "SmoothQuant + rotation")):
            alphas = suggested_alphas(stats_of[label], names, base)
            score(scheme, fix, {n: dataclasses.replace(base, smoothquant_alpha=alphas[n]) for n in names}, label,
                  float(np.median(list(alphas.values()))))
    meta = {"date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "machine": platform.processor()
            or platform.machine(), "cpus": torch.get_num_threads(), "torch": torch.__version__,
            "tokens_scored": int(ids.numel()), "rotation": spec.label(), "seconds": round(time.perf_counter() - t0)}
    print(f"\n{meta}\n\n| scheme | fix | KL (nats) | ± s.e. |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['scheme']} | {r['fix']} | {r['kl']:.5f} | {r['se']:.5f} |")
    print("\n| down_proj inputs | outlier ratio L11 | kurtosis L11 | outlier ratio median / max (30 layers) |"
          " kurtosis median |\n|---|---|---|---|---|")
    for k, o in outliers.items():
        print(f"| {k} | {o['focus_outlier_ratio']:.1f} | {o['focus_kurtosis']:.1f} | "
              f"{o['down_outlier_ratio_median']:.1f} / {o['down_outlier_ratio_max']:.1f} | "
              f"{o['down_kurtosis_median']:.1f} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"meta": meta, "rows": rows, "outliers": outliers}, fh, indent=1)


if __name__ == "__main__":
    main()
