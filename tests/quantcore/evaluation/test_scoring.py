"""Scoring: exact zero for the identity plan, KL against an independent float64 computation,
the float16 reference cache's error, cancellation, restore, and the cache file itself."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from quantcore.algorithms.inputs import PlanInputs
from quantcore.errors import Cancelled, PlanError
from quantcore.evaluation.reference import (
    ReferenceCache,
    ReferenceMismatch,
    compute_reference,
    eval_key_for,
    reference_cache_path,
)
from quantcore.evaluation.scoring import KL_HIST_EDGES, ScoreReport, plan_applied, score_plan, summarize
from quantcore.evaluation.sensitivity import linear_layer_names

SEQS, LENGTH = 6, 24  # evaluation tokens of these tests: 6 sequences of 24 tokens
BATCH = 4  # not a divisor of SEQS, so the last batch is short


# lm_head scale: next-token entropy ~2.5 nats like a real LM, instead of ~4.8 (uniform) at random init
HEAD_SHARPEN = 15.0


def sharp_model(factory, arch: str, **kw):
    """A tiny model whose next-token distributions are peaked like a trained LM's."""
    model = factory(arch, **kw)
    with torch.no_grad():
        model.lm_head.weight.mul_(HEAD_SHARPEN)
    return model


def eval_ids(vocab: int = 128, seed: int = 7) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (SEQS, LENGTH), generator=gen)


def whole_plan(model, scheme: str) -> dict[str, str]:
    return {n: scheme for n in linear_layer_names(model)}


def state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_state(model, before) -> None:
    after = model.state_dict()
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), f"{k} changed"
    for name, m in model.named_modules():
        assert not m._forward_pre_hooks and not m._forward_hooks, f"hook left on {name}"


def exact_kl(ref_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """Per-position KL(p_ref || p_q) in float64 straight from the definition: [S, L-1]."""
    lr = torch.log_softmax(ref_logits[:, :-1].double(), -1)
    lq = torch.log_softmax(q_logits[:, :-1].double(), -1)
    return (lr.exp() * (lr - lq)).sum(-1)


def act_amax_of(model, ids) -> dict[str, float]:
    """Per-layer max |input| over ``ids``: the static activation amax a calibration would store."""
    amax: dict[str, float] = {}
    hooks = []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):

            def hook(_m, args, _n=name):
                amax[_n] = max(amax.get(_n, 0.0), float(args[0].abs().max()))

            hooks.append(m.register_forward_pre_hook(hook))
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    for h in hooks:
        h.remove()
    return amax


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_bf16_plan_is_exactly_zero(arch, tiny_model_factory):
    model = sharp_model(tiny_model_factory, arch)
    ids = eval_ids()
    ref = compute_reference(model, ids, batch_size=BATCH)
    report = score_plan(model, whole_plan(model, "BF16"), ids, ref)
    assert report.kl_mean == 0.0 and report.kl_max == 0.0 and report.kl_p99 == 0.0
    assert report.top1_agree == 1.0
    assert report.ppl == report.ppl_ref
    assert report.tokens == SEQS * (LENGTH - 1)
    assert report.kl_hist["counts"][0] == report.tokens


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_kl_agrees_with_float64_definition_and_model_is_restored(arch, tiny_model_factory):
    model = sharp_model(tiny_model_factory, arch)
    ids = eval_ids()
    with torch.no_grad():
        ref_logits = model(input_ids=ids, use_cache=False).logits
    before = state(model)
    plan = whole_plan(model, "FP8_DYNAMIC")
    with plan_applied(model, plan):
        with torch.no_grad():
            q_logits = model(input_ids=ids, use_cache=False).logits
    assert_same_state(model, before)
    golden = exact_kl(ref_logits, q_logits)  # [S, L-1]
    assert float(golden.mean()) > 1e-4, "the perturbation is too small to test anything"

    ref32 = compute_reference(model, ids, batch_size=BATCH, logprob_dtype=torch.float32)
    report = score_plan(model, plan, ids, ref32, position_buckets=3)
    assert_same_state(model, before)
    assert report.kl_mean == pytest.approx(float(golden.mean()), rel=1e-4)
    assert report.kl_max == pytest.approx(float(golden.max()), rel=1e-4)
    assert report.kl_p90 == pytest.approx(float(np.quantile(golden.numpy(), 0.9)), rel=1e-3)
    agree = (q_logits[:, :-1].argmax(-1) == ref_logits[:, :-1].argmax(-1)).double().mean()
    assert report.top1_agree == pytest.approx(float(agree))
    hf_loss = F.cross_entropy(
        q_logits[:, :-1].reshape(-1, q_logits.shape[-1]).double(), ids[:, 1:].reshape(-1)
    )
    assert report.ppl == pytest.approx(math.exp(float(hf_loss)), rel=1e-5)
    assert report.ppl_ref == pytest.approx(ref32.ppl) and report.ppl != report.ppl_ref
    # position buckets: 23 positions in 3 buckets, each the mean of its columns
    assert [(b["bucket_start"], b["bucket_end"]) for b in report.kl_by_position] == [
        (0, 8),
        (8, 15),
        (15, 23),
    ]
    for b in report.kl_by_position:
        cols = golden[:, b["bucket_start"] : b["bucket_end"]]
        assert b["kl_mean"] == pytest.approx(float(cols.mean()), rel=1e-3)


def test_float16_compression_error_is_small(tiny_model_factory):
    """The float16 cache moves a W8A8-class mean KL by < 0.2 % (measured ~1e-4; bfloat16 storage: ~1.6e-2)."""
    model = sharp_model(tiny_model_factory, "llama")
    ids = eval_ids()
    plan = whole_plan(model, "INT8_W8A8")
    exact = score_plan(model, plan, ids, compute_reference(model, ids, logprob_dtype=torch.float32))
    compact = score_plan(model, plan, ids, compute_reference(model, ids))
    assert exact.kl_mean > 1e-4
    assert abs(compact.kl_mean - exact.kl_mean) < 0.002 * exact.kl_mean
    assert abs(compact.kl_p50 - exact.kl_p50) < 0.02 * exact.kl_p50
    assert compact.top1_agree == exact.top1_agree and compact.ppl == exact.ppl


def test_static_scales_need_calibration_and_use_it(tiny_model_factory):
    model = sharp_model(tiny_model_factory, "qwen2")
    ids = eval_ids()
    ref = compute_reference(model, ids)
    plan = whole_plan(model, "FP8")  # static per-tensor activation scales
    report = score_plan(model, plan, ids, ref, inputs=PlanInputs(act_amax=act_amax_of(model, ids)))
    assert 0.0 < report.kl_mean < 1.0


def test_cancel_raises_and_restores(tiny_model_factory):
    model = sharp_model(tiny_model_factory, "llama")
    ids = eval_ids()
    ref = compute_reference(model, ids, batch_size=2)
    before = state(model)
    calls = []

    def cancel_on_second_batch() -> bool:
        calls.append(1)
        return len(calls) >= 2

    with pytest.raises(Cancelled, match="batch 2 of 3"):
        score_plan(model, whole_plan(model, "INT8_W8A8"), ids, ref, should_cancel=cancel_on_second_batch)
    assert_same_state(model, before)
    with pytest.raises(Cancelled):
        compute_reference(model, ids, should_cancel=lambda: True)


def test_progress_reaches_one(tiny_model_factory):
    model = sharp_model(tiny_model_factory, "llama")
    ids = eval_ids()
    seen: list[float] = []
    ref = compute_reference(model, ids, batch_size=BATCH, progress=lambda f, m: seen.append(f))
    assert seen == [0.5, 1.0]
    seen.clear()
    score_plan(model, whole_plan(model, "BF16"), ids, ref, progress=lambda f, m: seen.append(f))
    assert seen == sorted(seen) and seen[-1] == 1.0


def test_unknown_scheme_in_plan_is_plan_error(tiny_model_factory):
    model = sharp_model(tiny_model_factory, "llama")
    ids = eval_ids()
    ref = compute_reference(model, ids)
    with pytest.raises(PlanError, match="lm_head.*FP12"):
        score_plan(model, {"lm_head": "FP12"}, ids, ref)


def test_smoothquant_without_statistics_is_plan_error(tiny_model_factory):
    model = sharp_model(tiny_model_factory, "llama")
    ids = eval_ids()
    ref = compute_reference(model, ids)
    before = state(model)
    with pytest.raises(PlanError, match="calibrat"):
        score_plan(model, whole_plan(model, "INT8_W8A8_SQ"), ids, ref)
    assert_same_state(model, before)


def test_reference_cache_file_round_trip(tmp_path, tiny_model_factory):
    model = sharp_model(tiny_model_factory, "gemma3")
    ids = eval_ids()
    ref = compute_reference(model, ids, batch_size=BATCH, model_sha="abc123")
    path = reference_cache_path(tmp_path, "abc123", ref.eval_key)
    assert path == tmp_path / "reference" / "abc123" / f"{eval_key_for(ids)}.safetensors"
    ref.save(path)
    assert path.read_bytes()[:8] != b"\x80\x04\x95"[:8]  # not a pickle
    loaded = ReferenceCache.load(path)
    for field in ("input_ids", "logprobs", "lognorm", "nll", "argmax"):
        assert torch.equal(getattr(loaded, field), getattr(ref, field)), field
    assert (loaded.batch_size, loaded.model_sha, loaded.eval_key) == (BATCH, "abc123", ref.eval_key)
    assert loaded.logprobs.dtype == torch.float16 and loaded.logprobs.shape == (SEQS, LENGTH - 1, 128)
    # a loaded cache scores identically
    plan = whole_plan(model, "W8A16")
    assert score_plan(model, plan, ids, loaded).to_dict() == score_plan(model, plan, ids, ref).to_dict()


def test_reference_cache_errors(tmp_path, tiny_model_factory):
    model = sharp_model(tiny_model_factory, "llama")
    ids = eval_ids()
    ref = compute_reference(model, ids)
    with pytest.raises(ReferenceMismatch, match="other tokens"):
        score_plan(model, whole_plan(model, "BF16"), eval_ids(seed=8), ref)
    with pytest.raises(ReferenceMismatch, match="no reference cache"):
        ReferenceCache.load(tmp_path / "nope.safetensors")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"garbage")
    with pytest.raises(ReferenceMismatch, match="unreadable"):
        ReferenceCache.load(bad)
    for key in ("../x", "a/b", "", ".hidden"):
        with pytest.raises(ValueError, match="file name"):
            reference_cache_path(tmp_path, key, "k")


def test_summarize_and_report_dict_round_trip():
    gen = torch.Generator().manual_seed(0)
    kl = torch.rand(5, 40, generator=gen) ** 4
    kl[0, 0] = 0.0
    kl[1, 1] = 500.0  # above the last histogram edge: counted in the last bin
    agree = torch.rand(5, 40, generator=gen) > 0.1
    nll = torch.rand(5, 40, generator=gen) + 2
    report = summarize(kl, agree, nll, nll - 0.5, position_buckets=4)
    flat = kl.double().numpy().ravel()
    assert report.kl_p50 == pytest.approx(float(np.quantile(flat, 0.5)))
    assert report.kl_p99 == pytest.approx(float(np.quantile(flat, 0.99)))
    assert report.kl_max == 500.0
    assert sum(report.kl_hist["counts"]) == 200 and report.kl_hist["counts"][-1] >= 1
    assert report.kl_hist["edges"] == list(KL_HIST_EDGES)
    assert [b["bucket_start"] for b in report.kl_by_position] == [0, 10, 20, 30]
    assert report.ppl / report.ppl_ref == pytest.approx(math.exp(0.5))
    assert ScoreReport.from_dict(report.to_dict()) == report


def calibration(model, ids):
    """(act_amax, act_channel_max) as the worker passes them, from quantcore.evaluation.calibrate."""
    from quantcore.evaluation.calibrate import calibrate

    stats = calibrate(model, ids)
    return {n: s.amax for n, s in stats.items()}, {n: s.channel_max for n, s in stats.items()}


def test_smoothquant_helps_per_tensor_int8_and_restores(tiny_model_factory):
    """The tiny models carry planted norm-output outliers (conftest): SmoothQuant must lower the KL
    of per-tensor INT8 activations, as in the SmoothQuant paper, and leave the model untouched."""
    model = sharp_model(tiny_model_factory, "llama")
    ids = eval_ids()
    ref = compute_reference(model, ids)
    amax, channel_max = calibration(model, ids)
    before = state(model)
    plain = score_plan(model, whole_plan(model, "INT8_PER_TENSOR"), ids, ref)
    smoothed = score_plan(
        model, whole_plan(model, "INT8_PER_TENSOR_SQ"), ids, ref,
        inputs=PlanInputs(act_amax=amax, act_channel_max=channel_max)
    )
    assert_same_state(model, before)
    assert smoothed.kl_mean < 0.7 * plain.kl_mean, (smoothed.kl_mean, plain.kl_mean)
    # lm_head has no foldable predecessor: said so, not hidden
    assert any(n.startswith("lm_head: SmoothQuant not applied") for n in smoothed.notes)


def test_static_scale_of_a_smoothed_layer_is_its_smoothed_amax(tiny_model_factory):
    """For a static activation scale behind SmoothQuant the amax must be that of the smoothed input:
    max_j(channel_max_j / s_j). Checked against the amax measured on the smoothed model itself."""
    from quantcore.algorithms.apply import apply_plan
    from quantcore.algorithms.smoothquant import smooth_model
    from quantcore.schemes.presets import get_scheme
    from quantcore.schemes.specs import Scheme

    fp8 = get_scheme("FP8")  # static per-tensor activations
    fp8_sq = Scheme("FP8_SQ", fp8.weights, fp8.activations, smoothquant_alpha=0.5)
    model = sharp_model(tiny_model_factory, "qwen2")
    ids = eval_ids()
    ref32 = compute_reference(model, ids, logprob_dtype=torch.float32)
    amax, channel_max = calibration(model, ids)
    layers = [n for n in linear_layer_names(model) if n != "lm_head"]
    plan = {n: fp8_sq for n in layers}
    report = score_plan(model, plan, ids, ref32, inputs=PlanInputs(act_amax=amax, act_channel_max=channel_max))

    handle = smooth_model(model, {n: channel_max[n] for n in layers}, 0.5, layers=layers)
    measured = act_amax_of(model, ids)  # the real amax of every smoothed input
    for n in layers:
        assert float((torch.as_tensor(channel_max[n]) / handle.factors[n].cpu()).max()) == pytest.approx(
            measured[n], rel=1e-4
        ), n
    applied = apply_plan(model, {n: fp8_sq.with_alpha(None) for n in layers}, PlanInputs(act_amax=measured))
    with torch.no_grad():
        q_logits = model(input_ids=ids, use_cache=False).logits
    applied.restore()
    handle.restore()
    with torch.no_grad():
        ref_logits = model(input_ids=ids, use_cache=False).logits
    assert report.kl_mean == pytest.approx(float(exact_kl(ref_logits, q_logits).mean()), rel=1e-2)


def test_static_scales_that_clip_are_reported(tiny_model_factory):
    model = sharp_model(tiny_model_factory, "llama")
    ids = eval_ids()
    ref = compute_reference(model, ids)
    amax = act_amax_of(model, ids)
    plan = whole_plan(model, "FP8")
    fitted = score_plan(model, plan, ids, ref, inputs=PlanInputs(act_amax=amax))
    # calibrated on this very text: only upstream quantization error can push an input past its amax
    assert set(fitted.act_saturation) == set(plan) and max(fitted.act_saturation.values()) < 1e-3
    assert not fitted.notes
    # a calibration that saw a tenth of the real range clips the live inputs
    short = {k: v / 10 for k, v in amax.items()}
    clipped = score_plan(model, plan, ids, ref, inputs=PlanInputs(act_amax=short))
    assert sum(clipped.act_saturation.values()) / len(plan) > 1e-2
    assert clipped.kl_mean > fitted.kl_mean
    assert any("clipped live traffic" in n for n in clipped.notes)
    dynamic = score_plan(model, whole_plan(model, "FP8_DYNAMIC"), ids, ref)
    assert dynamic.act_saturation == {}


def test_token_stats_do_not_depend_on_the_block_size(monkeypatch):
    # blocks are a speed choice (cache-sized on a CPU); every reduction runs along one row, so the
    # stored form, NLL, argmax (ties included) and KL must be bit-identical for any block size
    from quantcore.evaluation import reference
    gen = torch.Generator().manual_seed(3)
    vocab, n = 1000, 37
    ref_logits = torch.randn(n, vocab, generator=gen) * 4
    ref_logits[:, 5:9] = 30.0  # ties: the first maximal index wins
    logits = ref_logits + 0.1 * torch.randn(n, vocab, generator=gen)
    targets = torch.randint(0, vocab, (n,), generator=gen)
    results = []
    for elements in (1, 3 * vocab, 1 << 22):
        monkeypatch.setattr(reference, "KL_CHUNK_ELEMENTS_CPU", elements)
        ref = reference.token_stats(ref_logits, targets)
        results.append((ref, reference.token_stats(logits, targets, ref.stored, ref.lognorm)))
    for ref, got in results[1:]:
        for field in ("stored", "lognorm", "nll", "argmax"):
            assert torch.equal(getattr(ref, field), getattr(results[0][0], field)), field
        assert torch.equal(got.kl, results[0][1].kl) and torch.equal(got.argmax, results[0][1].argmax)
    assert torch.equal(results[0][0].argmax, ref_logits.argmax(dim=-1))
    assert (results[0][0].argmax == 5).all()


def test_score_reports_say_which_numerics_made_them():
    from quantcore.evaluation.scoring import ScoreReport
    from quantcore.schemes.numerics import NUMERICS

    rep = ScoreReport(0.1, 0.1, 0.1, 0.1, 0.1, 0.9, 10.0, 11.0, 100)
    assert rep.numerics == NUMERICS >= 2 and rep.to_dict()["numerics"] == NUMERICS
    stored = {k: v for k, v in rep.to_dict().items() if k != "numerics"}  # written before the field existed
    assert ScoreReport.from_dict(stored).numerics == 1
    assert ScoreReport.from_dict(rep.to_dict()) == rep
