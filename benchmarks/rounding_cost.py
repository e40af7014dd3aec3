"""Cost of the calibrated weight roundings, relative to a plain forward pass over the same calibration tokens.

Usage:
    python benchmarks/rounding_cost.py                       # CPU, 16 x 256 tokens, W4A16 on the 30 down_proj
    python benchmarks/rounding_cost.py --layers all --seqs 8  # every linear but lm_head (AWQ: 90 mappings)
    python benchmarks/rounding_cost.py --device cuda

Model and tokens as ``scoring_cost.py`` (SmolLM2-135M's real weights when installed, else its shape with random
weights; the packaged evaluation text when a tokenizer is available, which times the same as calibration text).
Timed side by side in one run (``--repeats``
rounds, the median of each):

- plain: ``model(input_ids)`` over the calibration tokens, 4 sequences per forward
- gptq:  ``collect_hessians`` + ``gptq_quantize`` of every planned layer (what a ``*_GPTQ`` score job adds)
- awq:   ``awq_search`` of the planned layers (what a ``*_AWQ`` score job adds): per fold, 20 candidate scales,
         each a fake-quantization of the fold's weights and a replay of the module holding them on every token

Prints each as a multiple of the plain pass. No target: the figures say what a GPTQ or AWQ score costs on top
of the scoring itself, and which one to expect to wait for.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.scoring_cost import bench_model, bench_tokens  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--layers", choices=["down_proj", "all"], default="down_proj",
                    help="W4A16 on the down_proj layers (whose K its groups of 128 divide) or on every linear")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from quantcore.algorithms.awq import awq_search
    from quantcore.algorithms.gptq import collect_hessians, gptq_quantize
    from quantcore.schemes.presets import get_scheme

    model, tokenizer, what = bench_model(args.device)
    ids, source = bench_tokens(tokenizer, model.config.vocab_size, args.seqs, args.seq_len)
    ids = ids.to(args.device)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"
             and (args.layers == "all" or n.endswith("down_proj"))]
    spec = get_scheme("W4A16").weights
    modules = dict(model.named_modules())

    def plain() -> None:
        with torch.no_grad():
            for i in range(0, ids.shape[0], 4):
                model(input_ids=ids[i:i + 4], use_cache=False)

    def gptq() -> None:
        hess = collect_hessians(model, names, ids)
        for n in names:
            gptq_quantize(modules[n].weight.detach(), hess[n], spec)

    def awq() -> None:
        awq_search(model, dict.fromkeys(names, "W4A16_AWQ"), ids)

    def timed(fn) -> float:
        if args.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if args.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    rounds: dict[str, list[float]] = {"plain": [], "gptq": [], "awq": []}
    for _ in range(args.repeats):
        for key, fn in (("plain", plain), ("gptq", gptq), ("awq", awq)):
            rounds[key].append(timed(fn))
    t = {k: statistics.median(v) for k, v in rounds.items()}
    print(f"model: {what}\ntokens: {args.seqs} x {args.seq_len} of the {source}; device {args.device}; "
          f"{torch.get_num_threads()} torch thread(s); W4A16 on {len(names)} linear(s) ({args.layers})")
    print(f"plain forward          {t['plain']:8.2f} s   1.00x")
    print(f"GPTQ (Hessians+round)  {t['gptq']:8.2f} s   {t['gptq'] / t['plain']:.2f}x")
    print(f"AWQ search             {t['awq']:8.2f} s   {t['awq'] / t['plain']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
