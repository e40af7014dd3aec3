"""quantplan's predicted KL of an AWQ plan against the KL of what llm-compressor's AWQ really makes of it, on SmolLM2.

    .venv/bin/python scripts/awq_against_llmc.py [--scheme W4A16_AWQ] [--rest BF16] [--cal 16x256] [--eval 16x256]

1. Here: the demo model (SmolLM2-135M, converted once and cached), calibration tokens of the built-in
   lee_background.cor (as a score job takes them), and the exported llm-compressor recipe of the plan: ``SCHEME`` on
   every linear whose K its groups divide, lm_head in BF16, the rest ``REST`` (weight-only).
2. In .venv-llmc (scripts/llmc_env.sh): llm-compressor's own ``oneshot`` with that recipe on exactly those tokens
   (its AWQModifier, then its QuantizationModifier); the fake-quantized linear weights and every norm weight (AWQ
   folds 1/s into them) are saved.
3. Here: KL against the unquantized model on the evaluation text (lee.cor) of (a) quantcore's emulation of the plan
   (quantcore.algorithms.awq's search, then rounding to nearest), (b) the plan without AWQ (round to nearest) and (c)
   llm-compressor's weights loaded into the model. Also: how far apart the two searches' scales are. Prints one
   table; takes a few minutes on 2 CPU cores.

Not a test (too slow for CI): the figures are in the README.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LLMC_PART = r'''
import json, sys, torch
from datasets import Dataset
from llmcompressor import oneshot
import llmcompressor.pipelines.cache as cache
# its AWQ pins cached inputs in page-locked memory, which torch refuses without an accelerator: a speed-up only
cache.IntermediatesCache.pin_memory = lambda self, batch_index: None
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, recipe, ids_path, out = sys.argv[1:5]
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
tok = AutoTokenizer.from_pretrained(folder)
ids = json.load(open(ids_path))
data = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(r) for r in ids]})
oneshot(model=model, processor=tok, recipe=recipe, dataset=data, num_calibration_samples=len(ids),
        max_seq_length=len(ids[0]), shuffle_calibration_samples=False)
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
state = {}
for n, m in model.named_modules():
    if isinstance(m, torch.nn.Linear):
        w = m.weight.detach()
        if getattr(m, "quantization_scheme", None) is not None and getattr(m, "weight_scale", None) is not None:
            w = fake_quantize(w, m.weight_scale, getattr(m, "weight_zero_point", None), m.quantization_scheme.weights,
                              global_scale=getattr(m, "weight_global_scale", None))
        state[n + ".weight"] = w.float().contiguous()
    elif n.endswith("norm") and getattr(m, "weight", None) is not None:
        state[n + ".weight"] = m.weight.detach().float().contiguous()
save_file(state, out)
'''


def shape(text: str) -> tuple[int, int]:
    n, _, length = text.partition("x")
    return int(n), int(length)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scheme", default="W4A16_AWQ", help="the AWQ preset (default W4A16_AWQ)")
    ap.add_argument("--rest", default="BF16", help="weight-only scheme of the other linears (default BF16)")
    ap.add_argument("--cal", type=shape, default=(16, 256), help="calibration sequences x tokens (default 16x256)")
    ap.add_argument("--eval", type=shape, default=(16, 256), help="evaluation sequences x tokens (default 16x256)")
    args = ap.parse_args(argv)

    from safetensors.torch import load_file

    from quantcore.algorithms.awq import awq_search
    from quantcore.algorithms.inputs import PlanInputs
    from quantcore.evaluation.reference import compute_reference
    from quantcore.evaluation.scoring import score_plan
    from quantcore.evaluation.text import (
        default_calibration_text,
        default_eval_text,
        load_documents,
        token_batches,
    )
    from quantcore.export.llmcompressor import to_llmcompressor_recipe
    from quantcore.models.intake import demo_gguf_path, register_checkpoint
    from quantcore.models.loading import load_model
    from quantcore.models.validation import default_cache_dir
    from quantcore.schemes.presets import get_scheme

    scheme, rest = get_scheme(args.scheme), get_scheme(args.rest)
    if not scheme.awq:
        ap.error(f"--scheme {scheme.name} does not scale with AWQ")
    if rest.activations is not None:
        ap.error(f"--rest {rest.name} quantizes activations; the loaded oneshot weights are scored weight-only")
    work = Path(tempfile.mkdtemp(prefix="awq-vs-llmc-"))
    _, folder, _ = register_checkpoint(demo_gguf_path(), work / "models", max_bytes=2 * 1024**3,
                                         cache_dir=default_cache_dir())
    model, tok = load_model(folder)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    group = scheme.weights.group_size or 1
    plan = {n: get_scheme("BF16") if n == "lm_head" else scheme if m.in_features % group == 0 else rest
            for n, m in linears.items()}
    count = sum(s is scheme for s in plan.values())
    cal = token_batches(tok, load_documents(default_calibration_text()), n_samples=args.cal[0], seq_len=args.cal[1])
    ev = token_batches(tok, load_documents(default_eval_text()), n_samples=args.eval[0], seq_len=args.eval[1])
    recipe = work / "recipe.yaml"
    recipe.write_text(to_llmcompressor_recipe(plan, layer_names=list(linears)))
    ids_path = work / "cal.json"
    ids_path.write_text(json.dumps(cal.tolist()))
    weights = work / "llmc.safetensors"
    subprocess.run(["bash", str(ROOT / "scripts" / "llmc_env.sh")], check=True)
    subprocess.run([str(ROOT / ".venv-llmc" / "bin" / "python"), "-c", LLMC_PART, str(folder), str(recipe),
                    str(ids_path), str(weights)], check=True, cwd=work)

    ref = compute_reference(model, ev, batch_size=4)
    started = time.perf_counter()
    found = awq_search(model, plan, cal)
    searched_s = time.perf_counter() - started
    rtn = get_scheme(scheme.name.removesuffix("_AWQ"))
    rows = [(f"quantcore {scheme.name} (its AWQ search, then round to nearest)",
             score_plan(model, plan, ev, ref, inputs=PlanInputs(awq=found))),
            (f"quantcore {rtn.name} (round to nearest, no AWQ)",
             score_plan(model, {n: rtn if s is scheme else s for n, s in plan.items()}, ev, ref))]
    params = dict(model.named_parameters())  # a tied lm_head is the embedding's, which AWQ never changes
    theirs = {n: w for n, w in load_file(weights).items() if n in params}
    params = dict(model.named_parameters())
    with torch.no_grad():
        saved = {n: params[n].detach().clone() for n in theirs}
        for n, w in theirs.items():
            params[n].copy_(w)
        rows.append(("llm-compressor oneshot (its AWQ, its scales)", score_plan(model, {}, ev, ref)))
        for n, w in saved.items():
            params[n].copy_(w)
    print(f"\nSmolLM2-135M, {scheme.name} on {count} linears, the rest {rest.name}, lm_head BF16; calibration "
          f"{args.cal[0]} x {args.cal[1]} tokens of lee_background.cor, evaluation {args.eval[0]} x {args.eval[1]} "
          f"of lee.cor; {len(found.errors)} AWQ mappings searched, {len(found.skipped)} layer(s) left unscaled\n")
    print("| weights | KL mean | KL p99 | top-1 agree | perplexity |\n|---|---:|---:|---:|---:|")
    for label, r in rows:
        print(f"| {label} | {r.kl_mean:.4f} | {r.kl_p99:.3f} | {r.top1_agree:.3f} | {r.ppl:.2f} "
              f"(ref {r.ppl_ref:.2f}) |")
    ratios = sorted(best / first for first, best, _ in found.errors.values() if first > 0)
    if ratios:
        print(f"\nquantcore's search ({searched_s:.0f} s): best / unscaled output error per mapping, median "
              f"{ratios[len(ratios) // 2]:.3f}, min {ratios[0]:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
