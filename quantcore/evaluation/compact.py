"""The compact reference: per position the reference's top-k log-probs, its tail mass and a sample of its tail.

A full-vocabulary reference costs ``2 x V`` bytes a position (float16): 512 KB for Gemma 3's 262,144 tokens, 509 MB
for 8 x 128 evaluation tokens. The compact record keeps, per predicted position (``k`` = ``topk``, ``m`` =
``tail_samples``):

- ``topk_ids`` / ``topk_logprobs``: the k most probable tokens and their log p_ref (float32, exact);
- ``tail_logmass``: log P, P = the reference's probability outside those k (computed as the log-sum-exp of the
  other V - k log-probs, not as 1 - sum, so a tiny tail keeps its digits);
- ``sample_ids`` / ``sample_logprobs``: m tokens drawn from the reference's tail distribution p~ = p / P outside
  the top k (systematic sampling on a seeded offset) and their log p_ref.

That is ``8 (k + m) + 4`` bytes a position: 1 KB at k = m = 64, 0.2 % of Gemma's full record.

KL from the record (docs/scoring.md, "The compact reference and its bound")
    With T the top k and p~, q~ the two models' distributions renormalized outside T, the chain rule splits

        KL(p || q) = sum_T p_i log(p_i / q_i)  +  P log(P / Q)  +  P KL(p~ || q~)

    (Q: the quantized model's mass outside T, from its full logits). The first two terms are exact from the
    record; by the log-sum inequality they are a lower bound of the KL. The third is estimated without bias from the
    tail sample: with rho = q~(x) / p~(x) for x drawn from p~, ``E[rho - 1 - log rho] = KL(p~ || q~)`` and every
    term is >= 0 ("k3", Schulman 2020). Its standard error is estimated from the sample spread per position;
    :data:`TAIL_BOUND_SIGMAS` of them over a score's positions is the score's ``kl_tail_bound`` on the KL mean.

Exactness
    The reference and a scored plan compute log-probs with the same function from float32 logits, so an identity
    plan gives bit-equal values at the stored tokens and the same tail log-sum-exp: every term is exactly 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

DEFAULT_TOPK = 1024  # the most tokens kept per position (settings: reference_topk; reference.compact_topk)
DEFAULT_TAIL_SAMPLES = 64  # tail tokens sampled per position
TAIL_BOUND_SIGMAS = 4.0  # kl_tail_bound = this many standard errors of the tail estimate of the KL mean
# rows of logits processed at once (the callers pass quantcore.evaluation.reference.chunk_rows: a block of about
# 1 MB that stays in a CPU core's cache); the results do not depend on it, every reduction runs along one row
DEFAULT_BLOCK_ROWS = 4
SAMPLE_SEED = 20_260_205  # the tail sample's offsets are drawn from this seed: a reference is reproducible


@dataclass
class CompactRows:
    """The compact record of ``n`` positions (see the module docstring); ids int32, the rest float32."""

    topk_ids: Tensor
    topk_logprobs: Tensor
    tail_logmass: Tensor
    sample_ids: Tensor
    sample_logprobs: Tensor


@dataclass
class RowStats:
    """What one side computes from its logits ``[n, V]``, full precision: -log p(next token), the top-1 token, and
    for the reference its compact record; for a scored plan, log q(reference's top 1) and the KL terms."""

    nll: Tensor
    argmax: Tensor
    picked: Tensor  # reference: log p(its top 1); plan: log q(the reference's top 1)
    rows: CompactRows | None = None
    kl: Tensor | None = None
    kl_lower: Tensor | None = None
    tail_var: Tensor | None = None


def _blocks(logits: Tensor, block: int) -> tuple[int, Tensor]:
    """(rows a block, one float32 work buffer of that many rows)."""
    n, vocab = logits.shape
    step = max(1, block)
    return step, torch.empty((min(n, step), vocab), dtype=torch.float32, device=logits.device)


def reference_rows(logits: Tensor, targets: Tensor, *, topk: int = DEFAULT_TOPK,
                   tail_samples: int = DEFAULT_TAIL_SAMPLES, generator: torch.Generator | None = None,
                   block: int = DEFAULT_BLOCK_ROWS) -> RowStats:
    """The reference side of ``n`` positions: its logits ``[n, V]``, the next tokens ``targets`` ``[n]``.

    A block of rows at a time, in one float32 work buffer: max and top-1, log-sum-exp, the top k, then the top k
    set to -inf in place for the tail's log-sum-exp, and the tail's probabilities (exp, in place) accumulated for
    systematic sampling: m points ``(j + u) / m`` of the tail CDF, u uniform per position from ``generator``."""
    n, vocab = logits.shape
    dev = logits.device
    k, m = min(topk, vocab), tail_samples
    step, work = _blocks(logits, block)
    out = RowStats(nll=torch.empty(n, device=dev), argmax=torch.empty(n, dtype=torch.int64, device=dev),
                   picked=torch.empty(n, device=dev),
                   rows=CompactRows(topk_ids=torch.empty((n, k), dtype=torch.int32, device=dev),
                                    topk_logprobs=torch.empty((n, k), device=dev),
                                    tail_logmass=torch.empty(n, device=dev),
                                    sample_ids=torch.zeros((n, m), dtype=torch.int32, device=dev),
                                    sample_logprobs=torch.zeros((n, m), device=dev)))
    rows = out.rows
    assert rows is not None
    offsets = torch.rand((n, 1), generator=generator, dtype=torch.float64).to(dev) if m else None
    grid = torch.arange(m, dtype=torch.float64, device=dev).unsqueeze(0) if m else None
    targets = targets.to(dev)
    for s in range(0, n, step):
        e = min(s + step, n)
        x = work[: e - s].copy_(logits[s:e])
        best = x.max(dim=-1).indices  # the first maximal index, as argmax
        lse = torch.logsumexp(x, dim=-1)
        out.argmax[s:e] = best
        out.picked[s:e] = x.gather(-1, best.unsqueeze(-1)).squeeze(-1) - lse
        out.nll[s:e] = lse - x.gather(-1, targets[s:e].unsqueeze(-1)).squeeze(-1)
        top = x.topk(k, dim=-1)
        rows.topk_ids[s:e] = top.indices
        rows.topk_logprobs[s:e] = top.values - lse.unsqueeze(-1)
        x.scatter_(-1, top.indices, float("-inf"))
        tail = torch.logsumexp(x, dim=-1)  # log of the tail's unnormalized mass
        rows.tail_logmass[s:e] = tail - lse
        if m and k < vocab:
            assert offsets is not None and grid is not None
            prob = x.sub_(tail.unsqueeze(-1)).exp_()  # the tail distribution p~ (top k: exp(-inf) = 0)
            cdf = prob.cumsum_(dim=-1)  # float32 and monotone: each token is drawn with its own increment
            total = cdf[:, -1:]
            points = ((grid + offsets[s:e]) / m * total.double()).float()
            # strictly below the total, so the first cdf entry above a point is a token with mass (a tail token)
            points = torch.minimum(points, torch.nextafter(total, torch.zeros_like(total)))
            picked = torch.searchsorted(cdf, points.contiguous(), right=True)
            rows.sample_ids[s:e] = picked
            rows.sample_logprobs[s:e] = logits[s:e].float().gather(-1, picked) - lse.unsqueeze(-1)
    return out


def score_rows(logits: Tensor, targets: Tensor, ref_argmax: Tensor, ref: CompactRows, *,
               block: int = DEFAULT_BLOCK_ROWS) -> RowStats:
    """A scored plan's side of ``n`` positions against the reference's compact record of them (module
    docstring): exactly the reference's operations on the plan's logits, then the KL terms on ``[n, k]`` and
    ``[n, m]`` values. Passes over the logits: a copy, max, log-sum-exp, and the tail's log-sum-exp."""
    n, vocab = logits.shape
    dev = logits.device
    step, work = _blocks(logits, block)
    ids = ref.topk_ids.to(dev, torch.int64)
    s_ids = ref.sample_ids.to(dev, torch.int64)
    lq_t = torch.empty(ids.shape, device=dev)
    lq_s = torch.empty(s_ids.shape, device=dev)
    log_q = torch.empty(n, device=dev)
    out = RowStats(nll=torch.empty(n, device=dev), argmax=torch.empty(n, dtype=torch.int64, device=dev),
                   picked=torch.empty(n, device=dev))
    targets, ref_argmax = targets.to(dev), ref_argmax.to(dev)
    for s in range(0, n, step):
        e = min(s + step, n)
        x = work[: e - s].copy_(logits[s:e])
        out.argmax[s:e] = x.max(dim=-1).indices
        lse = torch.logsumexp(x, dim=-1)
        out.picked[s:e] = x.gather(-1, ref_argmax[s:e].unsqueeze(-1)).squeeze(-1) - lse
        out.nll[s:e] = lse - x.gather(-1, targets[s:e].unsqueeze(-1)).squeeze(-1)
        lq_t[s:e] = x.gather(-1, ids[s:e]) - lse.unsqueeze(-1)
        lq_s[s:e] = x.gather(-1, s_ids[s:e]) - lse.unsqueeze(-1)
        x.scatter_(-1, ids[s:e], float("-inf"))
        log_q[s:e] = torch.logsumexp(x, dim=-1) - lse
    kl = _kl_terms(ref, lq_t, log_q, lq_s)
    out.kl, out.kl_lower, out.tail_var = kl.kl, kl.kl_lower, kl.tail_var
    return out


@dataclass
class CompactKL:
    """KL of ``n`` positions against a compact record.

    kl:       float32 ``[n]``, the estimate (exact top-k part + tail bucket + sampled within-tail part), >= 0
    kl_lower: float32 ``[n]``, its exact part alone: a lower bound of the true KL (log-sum inequality)
    tail_var: float32 ``[n]``, the variance of the sampled part's estimate (P^2 s^2 / m)
    """

    kl: Tensor
    kl_lower: Tensor
    tail_var: Tensor


def _kl_terms(ref: CompactRows, lq_t: Tensor, log_q: Tensor, lq_s: Tensor) -> CompactKL:
    """The KL terms from the plan's log-probs at the top k (``lq_t``), at the tail sample (``lq_s``) and its tail
    mass ``log_q``, against the reference's record ``ref``."""
    dev = lq_t.device
    lp_t = ref.topk_logprobs.to(dev)
    log_p = ref.tail_logmass.to(dev)
    head = (lp_t.exp() * (lp_t - lq_t)).sum(dim=-1)
    mass = log_p.exp()
    bucket = torch.where(mass > 0, mass * (log_p - log_q), torch.zeros_like(mass))
    lower = (head + bucket).clamp_min(0.0)
    m = lq_s.shape[-1]
    if m == 0:
        return CompactKL(kl=lower, kl_lower=lower, tail_var=torch.zeros_like(lower))
    lp_s = ref.sample_logprobs.to(dev)
    # log rho = log q~(x) - log p~(x); rho - 1 - log rho >= 0, its mean over the sample = KL(p~ || q~) in expectation
    d = (lq_s - log_q.unsqueeze(-1)) - (lp_s - log_p.unsqueeze(-1))
    k3 = torch.expm1(d) - d
    k3 = torch.where(mass.unsqueeze(-1) > 0, k3, torch.zeros_like(k3))  # no tail: nothing was sampled
    within = mass * k3.mean(dim=-1)
    var = mass.square() * (k3.var(dim=-1) if m > 1 else torch.zeros_like(within)) / m
    return CompactKL(kl=(head + bucket + within).clamp_min(0.0), kl_lower=lower, tail_var=var)


def tail_bound(tail_var: Tensor) -> float:
    """The score's bound on its KL mean from the per-position variances of the sampled tail part:
    :data:`TAIL_BOUND_SIGMAS` standard errors of the mean over all positions."""
    n = tail_var.numel()
    if n == 0:
        return 0.0
    return float(TAIL_BOUND_SIGMAS * tail_var.double().sum().sqrt() / n)


def compact_bytes(positions: int, topk: int = DEFAULT_TOPK, tail_samples: int = DEFAULT_TAIL_SAMPLES) -> int:
    """Bytes of the compact record of ``positions`` positions (ids int32, log-probs float32, the tail mass)."""
    return positions * (8 * (topk + tail_samples) + 4)
