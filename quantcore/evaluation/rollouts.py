"""Rollout drift: how far a low-precision copy of a policy drifts from it over whole generated sequences.

RL pipelines (PPO, GRPO) often sample their rollouts from a quantized copy of the policy (an FP8 vLLM engine) and
train the full-precision policy on them. The loss then weighs each rollout by the importance ratio of the two
models on the tokens that were sampled, and PPO clips that ratio to ``[1 - ε, 1 + ε]``. A per-token KL of 0.02 nats
looks harmless, yet over a 1,000-token rollout the log-ratio adds up to ~20 nats. This module measures that sum
instead of multiplying:

1. **Sample** ``count`` rollouts of ``length`` tokens from the quantized model (the plan applied), each from a
   prompt (the first tokens of an evaluation sequence), at temperature 1 with no truncation (as RL samples), with
   a seeded generator so the same inputs give the same rollouts. End-of-sequence tokens are sampled like any
   other and generation goes on: every rollout has exactly ``length`` tokens.
2. **Score both models teacher-forced** on the same token sequences (prompt + rollout): ``log p_q(t)`` under the
   plan, ``log p_ref(t)`` without it, for every generated token ``t``. Both sides go through the same forward pass
   (no KV cache), so an identity plan gives a log-ratio of exactly 0.
3. **Report** per rollout the sequence log-ratio ``Σ_t log p_q(t) − log p_ref(t)`` (its mean over tokens is an
   unbiased estimate of KL(q ‖ p_ref) per token, since the tokens were sampled from q), and the importance ratio
   ``exp(−Σ)`` = p_ref / p_q of the whole rollout: the share of rollouts outside PPO's clip range, and the share of
   tokens whose own ratio is outside it (PPO clips per token).

The standard error of the mean log-ratio is the standard deviation over rollouts / sqrt(count): rollouts are
independent samples, the tokens inside one are not.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from quantcore.algorithms.inputs import NO_INPUTS, PlanInputs
from quantcore.evaluation.batches import (
    Progress,
    ShouldCancel,
    as_token_batch,
    check_cancel,
    forward_logits,
    model_device,
    report_progress,
)
from quantcore.schemes.specs import Scheme

DEFAULT_ROLLOUT_LENGTH = 1000  # tokens a rollout generates (the reference text's example)
DEFAULT_CLIP_EPS = 0.2  # PPO's clip range ε (Schulman et al. 2017)
DEFAULT_PROMPT_TOKENS = 16  # tokens of an evaluation sequence a rollout starts from


@dataclass
class RolloutReport:
    """What a set of rollouts from the quantized model says about its drift from the reference.

    count, length, prompt_tokens, clip_eps, seed: what was measured (``length`` generated tokens each)
    log_ratio_mean, log_ratio_std, log_ratio_err: the sequence log-ratio Σ log p_q − log p_ref over rollouts
        (nats per rollout; err = std / sqrt(count), None for one rollout)
    log_ratio_p05, log_ratio_p50, log_ratio_p95: its percentiles over rollouts (numpy's linear interpolation)
    log_ratio_per_token: log_ratio_mean / length (nats per token: an estimate of KL(q ‖ p_ref))
    outside_clip: share of rollouts whose ratio p_ref / p_q is outside [1 − ε, 1 + ε]
    tokens_outside_clip: share of generated tokens whose own ratio is outside it
    log_ratios: the sequence log-ratio of each rollout, in order
    """

    count: int
    length: int
    prompt_tokens: int
    clip_eps: float
    seed: int
    log_ratio_mean: float
    log_ratio_std: float
    log_ratio_err: float | None
    log_ratio_p05: float
    log_ratio_p50: float
    log_ratio_p95: float
    log_ratio_per_token: float
    outside_clip: float
    tokens_outside_clip: float
    log_ratios: list[float]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RolloutReport:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__})


def summarize_rollouts(token_log_ratios: np.ndarray, *, prompt_tokens: int, clip_eps: float,
                       seed: int) -> RolloutReport:
    """The report of ``token_log_ratios`` ``[count, length]`` (log p_q − log p_ref of each generated token)."""
    lr = np.asarray(token_log_ratios, dtype=np.float64)
    if lr.ndim != 2 or lr.shape[0] < 1 or lr.shape[1] < 1:
        raise ValueError(f"token log-ratios must be [rollouts, tokens] with both >= 1, got shape {lr.shape}")
    count, length = lr.shape
    per_rollout = lr.sum(axis=1)
    std = float(per_rollout.std(ddof=1)) if count > 1 else 0.0
    lo, hi = math.log1p(-clip_eps), math.log1p(clip_eps)  # log of the clip range's ends
    ratio_log = -per_rollout  # log(p_ref / p_q): the importance weight of a rollout sampled from q
    outside = float(np.mean((ratio_log < lo) | (ratio_log > hi)))
    tokens_outside = float(np.mean((-lr < lo) | (-lr > hi)))
    p05, p50, p95 = (float(v) for v in np.quantile(per_rollout, [0.05, 0.5, 0.95]))
    return RolloutReport(
        count=count, length=length, prompt_tokens=prompt_tokens, clip_eps=clip_eps, seed=seed,
        log_ratio_mean=float(per_rollout.mean()), log_ratio_std=std,
        log_ratio_err=std / math.sqrt(count) if count > 1 else None,
        log_ratio_p05=p05, log_ratio_p50=p50, log_ratio_p95=p95,
        log_ratio_per_token=float(per_rollout.mean()) / length,
        outside_clip=outside, tokens_outside_clip=tokens_outside,
        log_ratios=[float(v) for v in per_rollout],
    )


def sample_rollouts(model: nn.Module, prompts: Tensor, length: int, *, seed: int = 0,
                    should_cancel: ShouldCancel | None = None) -> Tensor:
    """``prompts`` ``[R, P]`` each continued by ``length`` tokens sampled from ``model`` at temperature 1 (the full
    distribution, no top-k / top-p), one KV-cached step at a time: int64 ``[R, P + length]`` on the CPU."""
    import inspect

    dev = model_device(model)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = prompts.to(dev)
    out = [ids.cpu()]
    # transformers 5.24 names the KV cache `cache` (`past_key_values` is deprecated); older releases the latter
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        step = model(input_ids=ids, use_cache=True)
        for i in range(length):
            if i % 32 == 0:
                check_cancel(should_cancel, f"sampling rollouts (token {i} of {length})")
            probs = torch.softmax(step.logits[:, -1, :].float(), dim=-1).cpu()
            nxt = torch.multinomial(probs, 1, generator=gen)
            out.append(nxt)
            if i + 1 < length:
                step = model(input_ids=nxt.to(dev), use_cache=True, **{key: getattr(step, key)})
    return torch.cat(out, dim=1)


def generated_log_probs(model: nn.Module, sequences: Tensor, prompt_tokens: int) -> Tensor:
    """log p(token) of every generated token of ``sequences`` ``[R, P + length]`` (after the first ``prompt_tokens``)
    under ``model``, teacher-forced (no KV cache), one sequence at a time: float64 ``[R, length]``."""
    rows = []
    for seq in sequences:
        logits = forward_logits(model, seq.unsqueeze(0))[0, prompt_tokens - 1:-1]
        logp = torch.log_softmax(logits, dim=-1)
        targets = seq[prompt_tokens:].to(logp.device)
        rows.append(logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1).double().cpu())
        del logits, logp
    return torch.stack(rows)


def rollout_drift(
    model: nn.Module,
    plan: Mapping[str, Scheme | str],
    input_ids: Tensor,
    *,
    count: int,
    length: int = DEFAULT_ROLLOUT_LENGTH,
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
    clip_eps: float = DEFAULT_CLIP_EPS,
    seed: int = 0,
    inputs: PlanInputs = NO_INPUTS,
    progress: Progress | None = None,
    should_cancel: ShouldCancel | None = None,
) -> RolloutReport:
    """Sample ``count`` rollouts of ``length`` tokens from ``model`` under ``plan``, each from the first
    ``prompt_tokens`` tokens of a sequence of ``input_ids`` ``[S, L]`` (cycling through them when ``count`` > S), and
    measure their drift from the unquantized model (module docstring). The model is restored afterwards."""
    from quantcore.evaluation.scoring import plan_applied

    ids = as_token_batch(input_ids)
    if count < 1 or length < 1:
        raise ValueError(f"rollouts need a count and a length of at least 1, got {count} x {length}")
    if not 0.0 < clip_eps < 1.0:
        raise ValueError(f"PPO's clip range ε must be between 0 and 1, got {clip_eps}")
    prompt_tokens = max(1, min(prompt_tokens, ids.shape[1]))
    prompts = ids[torch.arange(count) % ids.shape[0], :prompt_tokens]
    report_progress(progress, 0.0, f"sampling {count} rollouts of {length} tokens from the quantized model")
    with plan_applied(model, plan, inputs=inputs):
        sequences = sample_rollouts(model, prompts, length, seed=seed, should_cancel=should_cancel)
        report_progress(progress, 0.5, "scoring the rollouts under the quantized model")
        logp_q = generated_log_probs(model, sequences, prompt_tokens)
    check_cancel(should_cancel, "scoring the rollouts")
    report_progress(progress, 0.75, "scoring the rollouts under the reference")
    logp_ref = generated_log_probs(model, sequences, prompt_tokens)
    report_progress(progress, 1.0, "rollouts scored")
    return summarize_rollouts((logp_q - logp_ref).numpy(), prompt_tokens=prompt_tokens, clip_eps=clip_eps,
                              seed=seed)
