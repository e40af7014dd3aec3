"""quantplan's predicted KL of a GPTQ plan against the KL of what llm-compressor really makes of it, on SmolLM2.

    .venv/bin/python scripts/gptq_against_llmc.py [--scheme W4A16_GPTQ] [--rest BF16] [--sequential] [--spread]
                                                  [--cal 16x256] [--eval 16x256]

1. Here: the demo model (SmolLM2-135M, converted once and cached), its calibration tokens (the built-in
   lee_background.cor, as a score job takes them) and the exported llm-compressor recipe of the plan
   ``SCHEME`` on every linear whose K its groups divide (llm-compressor refuses the others), lm_head in BF16 and
   the rest in ``REST`` (a weight-only scheme: W8A16 makes a mixed plan, a GPTQModifier beside a
   QuantizationModifier).
2. In .venv-llmc (scripts/llmc_env.sh): llm-compressor's own ``oneshot`` with that recipe on exactly those tokens
   (its sequential GPTQ pipeline, its observers' scales); the fake-quantized linear weights are saved.
3. Here: KL against the unquantized model on the evaluation text (lee.cor) of (a) quantcore's emulation of the plan
   (one-pass Hessians, quantcore's scales), (b) the same plan rounded to nearest, (c) with a weight-only REST that
   has a GPTQ preset, the REST layers GPTQ-rounded too (what a single GPTQModifier would make), (e) quantcore's GPTQ
   with the Hessians llm-compressor's GPTQ used (kept from its run) and (f) llm-compressor's weights loaded into
   the model. Prints one table. Takes a few minutes on 2 CPU cores.
   ``--sequential`` adds (d): quantcore's GPTQ with Hessians collected the way llm-compressor's sequential pipeline
   collects them, block by block, each block fed by the blocks before it with their GPTQ layers already rounded
   (weights only: the pipeline runs with activation quantization off); about 2 more minutes. ``--spread`` adds
   quantcore's GPTQ calibrated on subsets of the calibration tokens: how far the KL moves with the sample.

Not a test (too slow for CI): the figures are in the README.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LLMC_PART = r'''
import json, sys, torch
from datasets import Dataset
from llmcompressor import oneshot
import llmcompressor.modifiers.gptq.base as gptq_base
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, recipe, ids_path, out, hess_out = sys.argv[1:6]
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
tok = AutoTokenizer.from_pretrained(folder)
names, hessians, prepare = {id(m): n for n, m in model.named_modules()}, {}, gptq_base.prepare_batch
def keep_hessians(batch, qparams, by_module, counts):  # the Hessians its GPTQ is about to use
    hessians.update({names[id(m)]: (by_module[m] / counts[m]).contiguous() for m in batch})
    return prepare(batch, qparams, by_module, counts)
gptq_base.prepare_batch = keep_hessians
ids = json.load(open(ids_path))
data = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(r) for r in ids]})
oneshot(model=model, processor=tok, recipe=recipe, dataset=data, num_calibration_samples=len(ids),
        max_seq_length=len(ids[0]), shuffle_calibration_samples=False)
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
# what the compressed checkpoint stores: GPTQ left its layers' weights on their grid, a QuantizationModifier's
# layers keep theirs until compression rounds them with the scales it observed
save_file({n + ".weight": fake_quantize(m.weight.detach(), m.weight_scale, getattr(m, "weight_zero_point", None),
                                        m.quantization_scheme.weights,
                                        global_scale=getattr(m, "weight_global_scale", None)).float().contiguous()
           for n, m in model.named_modules()
           if isinstance(m, torch.nn.Linear) and getattr(m, "quantization_scheme", None) is not None}, out)
save_file(hessians, hess_out)
'''


def shape(text: str) -> tuple[int, int]:
    n, _, length = text.partition("x")
    return int(n), int(length)


def sequential_hessians(model, plan, cal, rounded: dict | None = None) -> tuple[dict, dict]:
    """(Hessians, rounded weights) of ``plan``'s GPTQ layers (all inside decoder blocks ``*.layers.N``), block by
    block: block N's from a forward that stops after it, with the GPTQ layers of the blocks before it already
    rounded: by quantcore's GPTQ, or to the weights ``rounded`` gives (llm-compressor's)."""
    from quantcore.algorithms.gptq import collect_hessians, gptq_quantize

    modules = dict(model.named_modules())
    layers = [n for n, s in plan.items() if s.gptq]
    blocks = list(dict.fromkeys(n.rsplit(".", 2)[0] for n in layers))  # model.layers.N.mlp.down_proj -> ...N
    hess, originals, out = {}, {}, {}
    try:
        for block in blocks:
            mine = [n for n in layers if n.startswith(block + ".")]
            hess.update(collect_hessians(model, mine, cal, stop_after=modules[block]))
            for n in mine:
                originals[n] = modules[n].weight
                out[n] = (rounded[n] if rounded is not None else
                          gptq_quantize(originals[n].detach(), hess[n], plan[n].weights).weight)
                modules[n].weight = torch.nn.Parameter(out[n], requires_grad=False)
    finally:
        for n, w in originals.items():
            modules[n].weight = w
    return hess, out


def hessians_against_theirs(ours: dict, theirs: dict, tokens_per_sequence: int) -> list[float]:
    """Relative Frobenius distance of each Hessian from llm-compressor's, which divides 2XᵀX by the number of
    sequences where quantcore divides by the number of tokens."""
    return [float((h * tokens_per_sequence - theirs[n]).norm() / theirs[n].norm()) for n, h in ours.items()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scheme", default="W4A16_GPTQ")
    ap.add_argument("--rest", default="BF16", help="the scheme of the linears SCHEME does not fit (weight-only)")
    ap.add_argument("--sequential", action="store_true", help="also score sequentially collected Hessians")
    ap.add_argument("--spread", action="store_true", help="also score quantcore's GPTQ calibrated without one of "
                    "the sequences (the 1st, 6th, 11th, 16th), and on half of them")
    ap.add_argument("--cal", type=shape, default=(16, 256), help="calibration sequences x tokens (default 16x256)")
    ap.add_argument("--eval", type=shape, default=(16, 256), help="evaluation sequences x tokens (default 16x256)")
    args = ap.parse_args(argv)

    from quantcore.algorithms.gptq import collect_hessians
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
    from quantcore.schemes.presets import get_scheme, list_schemes

    work = Path(tempfile.mkdtemp(prefix="gptq-vs-llmc-"))
    _, folder, _ = register_checkpoint(demo_gguf_path(), work / "models", max_bytes=2 * 1024**3,
                                         cache_dir=default_cache_dir())
    model, tok = load_model(folder)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    scheme = get_scheme(args.scheme)
    group = scheme.weights.group_size or 1
    fits = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m.in_features % group == 0}
    rest = get_scheme(args.rest)
    if rest.activations is not None:
        ap.error(f"--rest {rest.name} quantizes activations; the loaded oneshot weights are scored weight-only")
    plan = {n: get_scheme("BF16") if n == "lm_head" else scheme if n in fits else rest for n in names}
    where = "every linear but lm_head" if len(fits) == len(names) else (
        f"the {sum(s is scheme for s in plan.values())} linears whose K its groups of {group} divide")
    cal = token_batches(tok, load_documents(default_calibration_text()), n_samples=args.cal[0], seq_len=args.cal[1])
    ev = token_batches(tok, load_documents(default_eval_text()), n_samples=args.eval[0], seq_len=args.eval[1])

    recipe = work / "recipe.yaml"
    recipe.write_text(to_llmcompressor_recipe(plan, layer_names=names))
    ids_path = work / "cal.json"
    ids_path.write_text(json.dumps(cal.tolist()))
    weights, their_hess = work / "llmc.safetensors", work / "llmc-hessians.safetensors"
    subprocess.run(["bash", str(ROOT / "scripts" / "llmc_env.sh")], check=True)
    subprocess.run([str(ROOT / ".venv-llmc" / "bin" / "python"), "-c", LLMC_PART, str(folder), str(recipe),
                    str(ids_path), str(weights), str(their_hess)], check=True, cwd=work)

    from safetensors.torch import load_file

    ref = compute_reference(model, ev, batch_size=4)
    gptq_rest = get_scheme(f"{rest.name}_GPTQ") if f"{rest.name}_GPTQ" in list_schemes() else rest
    rest_too = scheme.gptq and gptq_rest is not rest  # also score the REST layers GPTQ-rounded
    gptq_layers = [n for n, s in plan.items() if s.gptq]
    needed = gptq_layers + ([n for n, s in plan.items() if s is rest] if rest_too else [])
    hess = collect_hessians(model, needed, cal) if needed else {}
    their_h, their_w = load_file(their_hess), load_file(weights)  # the Hessians its GPTQ used, the weights it wrote
    rows = [(f"quantcore {scheme.name}", score_plan(model, plan, ev, ref, inputs=PlanInputs(weight_hessians=hess)))]
    rtn = get_scheme(scheme.name.removesuffix("_GPTQ"))
    if rtn != scheme:
        rows.append((f"quantcore {rtn.name} (round to nearest)",
                     score_plan(model, {n: rtn if s is scheme else s for n, s in plan.items()}, ev, ref)))
    if rest_too:
        rows.append((f"quantcore, {rest.name} layers GPTQ-rounded too (a single GPTQModifier)",
                     score_plan(model, {n: gptq_rest if s is rest else s for n, s in plan.items()}, ev, ref,
                                inputs=PlanInputs(weight_hessians=hess))))
    notes = []
    if args.spread and scheme.gptq:
        for i in range(0, len(cal), 5):
            some = torch.cat([cal[:i], cal[i + 1:]])
            rows.append((f"quantcore, calibrated without sequence {i + 1} of {len(cal)}",
                         score_plan(model, plan, ev, ref,
                                    inputs=PlanInputs(weight_hessians=collect_hessians(model, gptq_layers, some)))))
        rows.append((f"quantcore, calibrated on the first {len(cal) // 2} sequences",
                     score_plan(model, plan, ev, ref,
                                inputs=PlanInputs(weight_hessians=collect_hessians(model, gptq_layers,
                                                                                   cal[: len(cal) // 2])))))
    if args.sequential:
        seq, rounded = sequential_hessians(model, plan, cal)
        rows.append(("quantcore, Hessians block by block (llm-compressor's sequential pipeline)",
                     score_plan(model, plan, ev, ref, inputs=PlanInputs(weight_hessians=seq))))
        if scheme.gptq:
            forced, _ = sequential_hessians(model, plan, cal, {n: their_w[n + ".weight"] for n in seq})
            fmt = lambda xs: ", ".join(f"{x:.0e}" for x in xs[:4])  # noqa: E731
            notes.append(f"Hessians block by block against llm-compressor's, relative distance, first 4 GPTQ blocks: "
                         f"{fmt(hessians_against_theirs(seq, their_h, cal.shape[1]))} "
                         "with quantcore's own roundings before them, "
                         f"{fmt(hessians_against_theirs(forced, their_h, cal.shape[1]))} with llm-compressor's")
            differ = [float((rounded[n] != their_w[n + ".weight"]).float().mean()) for n in seq]
            notes.append("share of weights rounded differently from llm-compressor, first 4 GPTQ blocks: "
                         + ", ".join(f"{d:.2%}" for d in differ[:4]))
    if scheme.gptq:  # GPTQ is invariant to the Hessian's scale: theirs is 2XᵀX / sequences, ours / tokens
        rows.append(("quantcore's GPTQ with llm-compressor's own Hessians",
                     score_plan(model, plan, ev, ref, inputs=PlanInputs(weight_hessians=their_h))))
    modules = dict(model.named_modules())
    with torch.no_grad():
        saved = {n: modules[n[: -len(".weight")]].weight.detach().clone() for n in their_w}
        for n, w in their_w.items():
            modules[n[: -len(".weight")]].weight.copy_(w)
        rows.append(("llm-compressor oneshot (its GPTQ, its scales)", score_plan(model, {}, ev, ref)))
        for n, w in saved.items():
            modules[n[: -len(".weight")]].weight.copy_(w)
    print(f"\nSmolLM2-135M, {args.scheme} on {where}, the rest {rest.name}; calibration {args.cal[0]} x {args.cal[1]} "
          f"tokens of lee_background.cor, evaluation {args.eval[0]} x {args.eval[1]} of lee.cor\n")
    print("| weights | KL mean | KL p99 | top-1 agree | perplexity |\n|---|---:|---:|---:|---:|")
    for label, r in rows:
        print(f"| {label} | {r.kl_mean:.4f} | {r.kl_p99:.3f} | {r.top1_agree:.3f} | {r.ppl:.2f} "
              f"(ref {r.ppl_ref:.2f}) |")
    for note in notes:
        print(f"\n{note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
