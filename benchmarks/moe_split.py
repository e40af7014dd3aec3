"""What splitting an MoE model's experts into linears costs a forward pass, side by side in one run.

quantplan splits transformers' fused experts (3-D parameters) into one nn.Linear per expert and projection
(quantcore/models/moe.py) so a plan, a calibration and a score can reach them, and runs every expert on every token
in calibration passes (llm-compressor's ``moe_calibrate_all_experts``). This times, on one random Qwen3-MoE
built from a config (no download), batch by batch and in alternating order:

- fused:   transformers' own forward (its default experts implementation),
- split:   the same model after ``split_experts``, tokens routed as in serving (scoring runs this),
- all:     the split model inside ``all_experts()`` (calibration runs this),

and prints split / fused and all / split (median of the per-batch ratios). Logits of split and fused are
checked to agree first.

    python benchmarks/moe_split.py [--experts 32] [--top-k 4] [--layers 4] [--tokens 512] [--repeats 7]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

try:
    import quantcore  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch


def build(experts: int, top_k: int, layers: int, hidden: int, inter: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("qwen3_moe", hidden_size=hidden, intermediate_size=4 * hidden,
                               moe_intermediate_size=inter, num_experts=experts, num_experts_per_tok=top_k,
                               num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2,
                               head_dim=hidden // 8, vocab_size=4096)
    return AutoModelForCausalLM.from_config(cfg).eval()


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict[str, float]:
    from quantcore.models.moe import all_experts, split_experts

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--inter", type=int, default=256, help="each expert's intermediate size")
    ap.add_argument("--tokens", type=int, default=512, help="tokens per forward (one sequence)")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)

    fused = build(args.experts, args.top_k, args.layers, args.hidden, args.inter)
    split = copy.deepcopy(fused)
    split_experts(split)
    ids = torch.randint(0, 4096, (1, args.tokens), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (fused(ids).logits - split(ids).logits).abs().max().item()
    print(f"Qwen3-MoE {args.layers} layers, {args.experts} experts (top-{args.top_k}), hidden {args.hidden}, "
          f"expert MLP {args.inter}; {args.tokens} tokens; max |logit difference| split vs fused {diff:.2e}")

    def run(model, every: bool = False):
        def go():
            with torch.no_grad():
                if every:
                    with all_experts():
                        model(ids)
                else:
                    model(ids)
        return go

    cases = {"fused": run(fused), "split": run(split), "all": run(split, every=True)}
    for go in cases.values():  # warm-up
        go()
    times: dict[str, list[float]] = {k: [] for k in cases}
    for i in range(args.repeats):
        order = list(cases) if i % 2 == 0 else list(reversed(cases))
        for name in order:
            times[name].append(timed(cases[name]))
    ratios = {
        "split / fused": statistics.median(s / f for s, f in zip(times["split"], times["fused"], strict=True)),
        "all / split": statistics.median(a / s for a, s in zip(times["all"], times["split"], strict=True)),
    }
    for name, t in times.items():
        print(f"  {name:6s} median {statistics.median(t) * 1e3:8.1f} ms")
    for name, r in ratios.items():
        print(f"  {name:14s} {r:.2f}x")
    print(f"  (all experts on every token does {args.experts / args.top_k:.0f}x the experts' work of routing)")
    return ratios


if __name__ == "__main__":
    main()
