"""The compact reference (top-k, tail mass, tail sample) and logits a chunk of positions at a time.

Tiny models with a large random vocabulary, so that the reference's tail outside the top k carries real mass:
the compact estimate of the KL must hold the full-vocabulary KL (float64, from the definition) within the bound it
reports, its exact part must never exceed it, and an identity plan must still score exactly 0.
"""

from __future__ import annotations

import pytest
import torch

from quantcore.evaluation.batches import forward_logits, iter_logits
from quantcore.evaluation.compact import compact_bytes, reference_rows, score_rows, tail_bound
from quantcore.evaluation.reference import (
    ReferenceCache,
    ReferenceMismatch,
    choose_topk,
    compact_topk,
    compute_reference,
    full_cache_bytes,
)
from quantcore.evaluation.scoring import plan_applied, score_plan
from quantcore.evaluation.sensitivity import linear_layer_names

BIG_VOCAB = 8192
SEQS, LENGTH = 4, 24


def big_vocab_model(arch: str, *, vocab: int = BIG_VOCAB, seed: int = 0, softcap: float | None = None,
                    sharpen: float = 12.0):
    """A 2-layer model whose 8k-token head gives next-token distributions with a heavy tail outside the top 64."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Gemma3ForCausalLM(Gemma3TextConfig(**common, head_dim=16, sliding_window=8,
                                                   layer_types=["sliding_attention", "full_attention"],
                                                   final_logit_softcapping=softcap))
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    return model.eval().requires_grad_(False)


def eval_ids(vocab: int = BIG_VOCAB, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, vocab, (SEQS, LENGTH), generator=torch.Generator().manual_seed(seed))


def whole(model, scheme: str) -> dict[str, str]:
    return {n: scheme for n in linear_layer_names(model)}


def exact_kl(ref_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    lr = torch.log_softmax(ref_logits[:, :-1].double(), -1)
    lq = torch.log_softmax(q_logits[:, :-1].double(), -1)
    return (lr.exp() * (lr - lq)).sum(-1)


def act_amax_of(model, ids) -> dict[str, float]:
    amax: dict[str, float] = {}
    hooks = [m.register_forward_pre_hook(lambda _m, args, _n=n: amax.__setitem__(
        _n, max(amax.get(_n, 0.0), float(args[0].abs().max()))))
        for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    forward_logits(model, ids)
    for h in hooks:
        h.remove()
    return amax


@pytest.mark.parametrize(("arch", "softcap"), [("llama", None), ("gemma3", None), ("gemma3", 5.0)])
def test_chunked_logits_equal_the_whole_forward(arch, softcap):
    model = big_vocab_model(arch, softcap=softcap)
    ids = eval_ids()
    whole_logits = forward_logits(model, ids)
    seen = torch.zeros(SEQS, LENGTH - 1, dtype=torch.int64)
    for j, a, b, logits in iter_logits(model, ids, chunk_elements=5 * BIG_VOCAB):  # 5 positions a chunk
        assert b - a <= 5 and logits.dtype == torch.float32
        torch.testing.assert_close(logits, whole_logits[j, a:b], rtol=1e-5, atol=1e-5)
        seen[j, a:b] += 1
    assert torch.equal(seen, torch.ones_like(seen))  # every predicted position exactly once
    if softcap is not None:
        assert float(whole_logits.abs().max()) <= softcap


def test_head_quantized_per_tensor_sees_the_whole_hidden_state():
    """A dynamic per-tensor activation scale on lm_head is taken over the whole batch, as in the model's forward."""
    model = big_vocab_model("llama")
    ids = eval_ids()
    plan = {"lm_head": "FP8_PER_TENSOR"}
    with plan_applied(model, plan):
        whole_logits = forward_logits(model, ids)
        for j, a, b, logits in iter_logits(model, ids, chunk_elements=3 * BIG_VOCAB):
            torch.testing.assert_close(logits, whole_logits[j, a:b], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_identity_plan_is_exactly_zero_against_a_compact_reference(arch):
    model = big_vocab_model(arch)
    ids = eval_ids()
    ref = compute_reference(model, ids, batch_size=3, topk=16)
    assert ref.kind == "topk" and ref.topk == 16 and ref.logprobs is None
    report = score_plan(model, whole(model, "BF16"), ids, ref)
    assert report.kl_mean == 0.0 and report.kl_max == 0.0 and report.kl_tail_bound == 0.0
    assert report.top1_agree == 1.0 and report.ppl == report.ppl_ref
    assert report.dp_mean == 0.0 and report.dp_max == 0.0
    assert (report.reference_kind, report.topk) == ("topk", 16)


@pytest.mark.parametrize("scheme", ["FP8_DYNAMIC", "INT8_W8A8", "NVFP4"])
def test_compact_kl_holds_the_full_vocabulary_kl_within_its_bound(scheme):
    model = big_vocab_model("llama")
    ids = eval_ids()
    ref_logits = forward_logits(model, ids)
    plan = whole(model, scheme)
    amax = act_amax_of(model, ids)
    from quantcore.algorithms.inputs import PlanInputs

    inputs = PlanInputs(act_amax=amax)
    with plan_applied(model, plan, inputs=inputs):
        q_logits = forward_logits(model, ids)
    truth = exact_kl(ref_logits, q_logits)
    full = score_plan(model, plan, ids, compute_reference(model, ids), inputs=inputs)
    compact = score_plan(model, plan, ids, compute_reference(model, ids, topk=64), inputs=inputs)
    tail = float(torch.log_softmax(ref_logits[:, :-1].double(), -1).exp().topk(64, -1).values.sum(-1).mean())
    assert 1 - tail > 0.2  # the tail outside the top 64 carries real mass: the test is about it
    true_mean = float(truth.mean())
    assert full.reference_kind == "full" and full.kl_tail_bound == 0.0
    assert full.kl_mean == pytest.approx(true_mean, rel=2e-2)  # float16 storage: the module docstring
    assert compact.reference_kind == "topk" and compact.topk == 64
    assert compact.kl_lower is not None and compact.kl_lower <= true_mean * (1 + 1e-5)
    assert 0 < compact.kl_tail_bound < 0.1 * true_mean
    assert abs(compact.kl_mean - true_mean) <= compact.kl_tail_bound, (compact.kl_mean, true_mean)
    # top-1, perplexity and Δp come from the same record: the same figures as the full reference gives
    assert compact.top1_agree == full.top1_agree
    assert compact.ppl == pytest.approx(full.ppl, rel=1e-5) and compact.ppl_ref == pytest.approx(full.ppl_ref, rel=1e-5)
    assert compact.dp_mean == pytest.approx(full.dp_mean, abs=1e-6)


def test_the_exact_part_alone_misses_the_within_tail_divergence():
    """Without the tail sample (m = 0) the compact KL is the log-sum-inequality lower bound: below the truth."""
    model = big_vocab_model("llama")
    ids = eval_ids()
    ref_logits = forward_logits(model, ids)[:, :-1].reshape(-1, BIG_VOCAB)
    with plan_applied(model, whole(model, "INT8_W8A8")):
        q_logits = forward_logits(model, ids)[:, :-1].reshape(-1, BIG_VOCAB)
    targets = ids[:, 1:].reshape(-1)
    lp, lq = torch.log_softmax(ref_logits.double(), -1), torch.log_softmax(q_logits.double(), -1)
    truth = (lp.exp() * (lp - lq)).sum(-1)
    bare_ref = reference_rows(ref_logits, targets, topk=64, tail_samples=0)
    sampled_ref = reference_rows(ref_logits, targets, topk=64, tail_samples=64,
                                 generator=torch.Generator().manual_seed(1))
    bare = score_rows(q_logits, targets, bare_ref.argmax, bare_ref.rows)
    sampled = score_rows(q_logits, targets, sampled_ref.argmax, sampled_ref.rows)
    assert torch.all(bare.kl <= truth.float() * (1 + 1e-3) + 1e-6)
    assert float(bare.kl.mean()) < 0.97 * float(truth.mean())  # the within-tail part is real
    assert abs(float(sampled.kl.double().mean() - truth.mean())) <= tail_bound(sampled.tail_var)
    assert torch.equal(sampled.kl_lower, bare.kl)
    # NLL and top-1 from the record are the full computation's
    torch.testing.assert_close(sampled.nll.double(), -lq.gather(-1, targets.unsqueeze(-1)).squeeze(-1),
                               rtol=1e-5, atol=1e-5)
    assert torch.equal(sampled_ref.argmax, ref_logits.argmax(-1))


def test_compact_cache_round_trip_and_size(tmp_path):
    model = big_vocab_model("gemma3")
    ids = eval_ids()
    ref = compute_reference(model, ids, topk=32, tail_samples=16, model_sha="m1")
    path = ref.save(tmp_path / "ref.safetensors")
    loaded = ReferenceCache.load(path)
    assert loaded.kind == "topk" and loaded.topk == 32 and loaded.vocab == BIG_VOCAB
    assert loaded.compact is not None and ref.compact is not None
    for name in ("topk_ids", "topk_logprobs", "tail_logmass", "sample_ids", "sample_logprobs"):
        assert torch.equal(getattr(loaded.compact, name), getattr(ref.compact, name)), name
    positions = SEQS * (LENGTH - 1)
    assert loaded.nbytes <= compact_bytes(positions, 32, 16) + positions * 20 + ids.numel() * 8
    assert path.stat().st_size < 0.05 * full_cache_bytes(SEQS, LENGTH, BIG_VOCAB)
    plan = whole(model, "FP8_DYNAMIC")
    assert score_plan(model, plan, ids, loaded).to_dict() == score_plan(model, plan, ids, ref).to_dict()
    # the reference's own top tokens are sorted, its tail mass is what the top k leave
    c = ref.compact
    assert torch.all(c.topk_logprobs[..., :-1] >= c.topk_logprobs[..., 1:])
    mass = c.topk_logprobs.double().exp().sum(-1) + c.tail_logmass.double().exp()
    torch.testing.assert_close(mass, torch.ones_like(mass), rtol=0, atol=1e-5)
    # tail samples are never top-k tokens
    assert not torch.any((c.sample_ids.unsqueeze(-1) == c.topk_ids.unsqueeze(-2)).any(-1))


def test_a_v1_cache_is_recomputed_not_misread(tmp_path):
    from safetensors.torch import save_file

    old = tmp_path / "old.safetensors"
    save_file({"input_ids": torch.zeros(1, 2, dtype=torch.int64)}, str(old),
              metadata={"format": "quantplan.reference.v1"})
    with pytest.raises(ReferenceMismatch, match="format"):
        ReferenceCache.load(old)


def test_choose_topk_keeps_small_references_full_and_sizes_k_by_the_vocabulary():
    assert choose_topk(8, 128, 49_152, full_max_bytes=128 * 2**20) is None  # 95 MiB: full, exact
    assert choose_topk(8, 128, 262_144, full_max_bytes=128 * 2**20) == 1024  # 508 MiB: compact, V / 256
    assert choose_topk(16, 256, 49_152, full_max_bytes=128 * 2**20) == 192
    assert choose_topk(16, 256, 8_192, full_max_bytes=0) == 64  # at least 64
    assert choose_topk(16, 256, 262_144, full_max_bytes=0, topk=64) == 64  # at most the setting
    assert full_cache_bytes(8, 128, 262_144) == 8 * 127 * 262_144 * 2
    for vocab in (32_000, 49_152, 128_256, 151_936, 262_144):  # the compact record stays <= 5 % of the full one
        k = compact_topk(vocab)
        assert compact_bytes(1000, k, k) <= 0.05 * full_cache_bytes(1, 1001, vocab)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_chunked_logits_of_moe_models_equal_the_whole_forward(arch):
    """MoE heads split too (Qwen3-MoE, Mixtral); a model type not known to be head(body) runs whole (DeepSeek-V3)."""
    from quantcore.evaluation.batches import HEAD_SPLIT_MODEL_TYPES
    from tests.factories import tiny_moe

    model = tiny_moe(arch)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    whole_logits = forward_logits(model, ids)
    for j, a, b, logits in iter_logits(model, ids, chunk_elements=3 * whole_logits.shape[-1]):
        torch.testing.assert_close(logits, whole_logits[j, a:b], rtol=1e-5, atol=1e-5)
    assert (arch in HEAD_SPLIT_MODEL_TYPES) == (arch != "deepseek_v3")
