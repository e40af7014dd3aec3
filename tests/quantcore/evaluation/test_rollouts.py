"""Rollout drift (quantcore.evaluation.rollouts): sequences sampled from the quantized model, both models' log-probs
of them, the sequence log-ratio and PPO's clip range — against independent computations."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from quantcore.evaluation.rollouts import generated_log_probs, rollout_drift, sample_rollouts, summarize_rollouts
from quantcore.schemes.presets import get_scheme
from tests.factories import build_tiny_model


def test_the_summary_against_a_loop_over_rollouts_and_tokens() -> None:
    """Sequence log-ratios, their error over rollouts, and both clip shares, recomputed one rollout and one token
    at a time with the ratio p_ref / p_q itself (not its log)."""
    rng = np.random.default_rng(0)
    lr = rng.normal(0.004, 0.05, size=(12, 40))
    lr[3] += 0.02  # one rollout drifts: its ratio leaves the clip range
    rep = summarize_rollouts(lr, prompt_tokens=8, clip_eps=0.2, seed=5)
    sums = [sum(row) for row in lr.tolist()]
    mean = sum(sums) / len(sums)
    std = math.sqrt(sum((s - mean) ** 2 for s in sums) / (len(sums) - 1))
    assert rep.log_ratios == pytest.approx(sums) and rep.log_ratio_mean == pytest.approx(mean)
    assert rep.log_ratio_std == pytest.approx(std) and rep.log_ratio_err == pytest.approx(std / math.sqrt(12))
    assert rep.log_ratio_per_token == pytest.approx(mean / 40)
    outside = [not (0.8 <= math.exp(-s) <= 1.2) for s in sums]
    assert rep.outside_clip == pytest.approx(sum(outside) / 12) and 0 < rep.outside_clip < 1
    tokens = [not (0.8 <= math.exp(-x) <= 1.2) for row in lr.tolist() for x in row]
    assert rep.tokens_outside_clip == pytest.approx(sum(tokens) / len(tokens))
    assert (rep.count, rep.length, rep.prompt_tokens, rep.seed) == (12, 40, 8, 5)
    assert type(rep).from_dict(rep.to_dict()) == rep
    one = summarize_rollouts(lr[:1], prompt_tokens=8, clip_eps=0.2, seed=0)
    assert one.log_ratio_err is None  # one rollout: no spread to estimate an error from


def test_teacher_forced_log_probs_are_the_models_next_token_probabilities() -> None:
    """Each generated token's log-prob equals the model's own softmax at that position, from a forward pass over
    the prefix alone (no shared computation with the function under test)."""
    model = build_tiny_model("llama")
    seqs = torch.randint(0, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(3))
    got = generated_log_probs(model, seqs, prompt_tokens=4)
    assert got.shape == (2, 6)
    with torch.no_grad():
        for r in range(2):
            for t in range(4, 10):
                logits = model(input_ids=seqs[r:r + 1, :t]).logits[0, -1].double()
                want = torch.log_softmax(logits, -1)[seqs[r, t]]
                assert float(got[r, t - 4]) == pytest.approx(float(want), abs=1e-4)


def test_sampling_is_seeded_and_follows_the_model() -> None:
    """The same seed gives the same rollouts, another seed others; the prompt is kept; over many samples of one
    step, each token's frequency matches the model's probability (a sampler that ignored the model would not)."""
    model = build_tiny_model("llama")
    prompts = torch.randint(0, model.config.vocab_size, (3, 5), generator=torch.Generator().manual_seed(1))
    a = sample_rollouts(model, prompts, 6, seed=7)
    assert a.shape == (3, 11) and torch.equal(a[:, :5], prompts)
    assert torch.equal(a, sample_rollouts(model, prompts, 6, seed=7))
    assert not torch.equal(a, sample_rollouts(model, prompts, 6, seed=8))
    many = sample_rollouts(model, prompts[:1].repeat(4000, 1), 1, seed=0)[:, -1]
    with torch.no_grad():
        p = torch.softmax(model(input_ids=prompts[:1]).logits[0, -1].double(), -1)
    freq = torch.bincount(many, minlength=p.numel()).double() / many.numel()
    assert float((freq - p).abs().max()) < 0.04
    # the second token follows the model given the first (the KV cache carries the first token and its position):
    # its counts match the model's next-token probabilities after each sampled first token, summed (a chi-square
    # test; the head is sharpened so that the context matters: a sampler that lost the cache scores ~1,900 here)
    with torch.no_grad():
        model.lm_head.weight.mul_(8)
    two = sample_rollouts(model, prompts[:1].repeat(3000, 1), 2, seed=1)
    with torch.no_grad():
        expected = torch.softmax(model(input_ids=two[:, :6]).logits[:, -1].double(), -1).sum(0)
    counts = torch.bincount(two[:, 6], minlength=expected.numel()).double()
    keep = expected > 0.5
    chi2 = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    df = int(keep.sum()) - 1
    assert chi2 < df + 6 * math.sqrt(2 * df), (chi2, df)


def test_an_identity_plan_drifts_not_at_all_and_a_quantized_ones_drift_matches_its_exact_kl() -> None:
    """No scheme: every log-ratio is exactly 0 and no rollout leaves the clip range. A 4-bit weight plan: the mean
    sequence log-ratio of rollouts sampled from it estimates Σ_t KL(q || p_ref) along them, which is computed here
    exactly from both models' full distributions on the same sequences: the two agree within the estimate's error
    (a sampler that did not sample from q, or log-probs of the wrong positions, would not). The model is restored."""
    from quantcore.evaluation.scoring import plan_applied

    model = build_tiny_model("llama")
    ids = torch.randint(0, model.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(2))
    same = rollout_drift(model, {}, ids, count=4, length=24, prompt_tokens=8)
    assert same.log_ratios == [0.0] * 4 and same.outside_clip == 0.0 and same.tokens_outside_clip == 0.0
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = {name: get_scheme("W4A16") for name, mod in model.named_modules()
            if isinstance(mod, torch.nn.Linear) and name != "lm_head"}
    drift = rollout_drift(model, plan, ids, count=64, length=32, prompt_tokens=8, seed=1)
    assert drift.count == 64 and drift.length == 32 and len(drift.log_ratios) == 64
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert drift.log_ratio_err is not None and drift.log_ratio_std > 0
    # the same rollouts again (same seed), and KL(q || p_ref) summed over their generated positions, exactly
    with plan_applied(model, plan):
        seqs = sample_rollouts(model, ids[torch.arange(64) % 4, :8], 32, seed=1)
        with torch.no_grad():
            log_q = torch.log_softmax(model(input_ids=seqs).logits.double(), -1)
    with torch.no_grad():
        log_p = torch.log_softmax(model(input_ids=seqs).logits.double(), -1)
    exact = (log_q.exp() * (log_q - log_p)).sum(-1)[:, 7:-1].sum(1).mean().item()
    assert exact > 0 and abs(drift.log_ratio_mean - exact) < 4 * drift.log_ratio_err, (drift.log_ratio_mean, exact)


def test_bad_requests_are_refused() -> None:
    model = build_tiny_model("llama")
    ids = torch.zeros((1, 4), dtype=torch.int64)
    with pytest.raises(ValueError, match="count and a length of at least 1"):
        rollout_drift(model, {}, ids, count=0)
    with pytest.raises(ValueError, match="clip range"):
        rollout_drift(model, {}, ids, count=1, length=2, clip_eps=1.5)
