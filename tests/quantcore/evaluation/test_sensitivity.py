"""Sensitivity sweep: a planted outlier layer ranks first, block replay equals a full forward,
identity is exactly 0, cancel raises and restores, unsupported models are refused."""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch import nn

from quantcore.algorithms.inputs import PlanInputs
from quantcore.errors import Cancelled, PlanError
from quantcore.evaluation.reference import ReferenceMismatch, compute_reference
from quantcore.evaluation.scoring import plan_applied
from quantcore.evaluation.sensitivity import (
    SweepPace,
    linear_layer_names,
    sensitivity_sweep,
    sweep_units,
    time_left_text,
)
from quantcore.formats.quantize import sqnr_db
from quantcore.models.decoder import find_decoder_blocks

SEQS, LENGTH = 4, 20  # evaluation tokens: 4 sequences of 20 tokens
HEAD_SHARPEN = 15.0  # lm_head scale: next-token entropy ~2.5 nats, like a trained LM
PLANT_CHANNEL = 5  # intermediate channel planted as an outlier
PLANT_FACTOR = 1000.0  # its size relative to the other channels of that down_proj input


def sharp_model(factory, arch: str, **kw):
    model = factory(arch, **kw)
    with torch.no_grad():
        model.lm_head.weight.mul_(HEAD_SHARPEN)
    return model


def eval_ids(seed: int = 11) -> torch.Tensor:
    return torch.randint(0, 128, (SEQS, LENGTH), generator=torch.Generator().manual_seed(seed))


def plant_down_proj_outlier(model, block: int) -> str:
    """Make one input channel of ``block``'s down_proj PLANT_FACTOR x larger, function unchanged.

    up_proj's output row c is multiplied by F and down_proj's input column c divided by F:
    the product is the same (up to rounding), but a per-tensor activation scale of that
    down_proj input is now set by channel c, which flushes every other channel.
    """
    mlp = model.model.layers[block].mlp
    with torch.no_grad():
        mlp.up_proj.weight[PLANT_CHANNEL] *= PLANT_FACTOR
        mlp.down_proj.weight[:, PLANT_CHANNEL] /= PLANT_FACTOR
    return f"model.layers.{block}.mlp.down_proj"


def assert_clean(model, before) -> None:
    after = model.state_dict()
    for k in before:
        assert torch.equal(before[k], after[k]), f"{k} changed"
    for name, m in model.named_modules():
        assert not m._forward_pre_hooks and not m._forward_hooks, f"hook left on {name}"
        assert "forward" not in m.__dict__, f"replayed forward left on {name}"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_planted_outlier_layer_ranks_first(arch, tiny_model_factory):
    model = sharp_model(tiny_model_factory, arch, plant_outliers=False)
    planted = plant_down_proj_outlier(model, block=0)
    ids = eval_ids()
    ref = compute_reference(model, ids, batch_size=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rows = sensitivity_sweep(model, "INT8_PER_TENSOR", ids, ref)
    assert_clean(model, before)
    assert rows[0].layer == planted, [(r.layer, round(r.kl_mean, 4)) for r in rows]
    assert rows[0].kl_mean > 3 * rows[1].kl_mean
    assert rows[0].sqnr_db == min(r.sqnr_db for r in rows)
    assert all(r.kl_mean > 0 and 0 <= r.top1_agree <= 1 for r in rows)
    assert [r.kl_mean for r in rows] == sorted((r.kl_mean for r in rows), reverse=True)
    # 2 blocks x (qkv, o, gate/up, down) + lm_head
    assert len(rows) == 9
    assert "model.layers.1.self_attn.{q,k,v}_proj" in {r.layer for r in rows}


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_sweep_equals_full_forward_of_one_unit_plans(arch, tiny_model_factory):
    """Replaying blocks 0..b-1 must give the same logits as running the whole model."""
    model = sharp_model(tiny_model_factory, arch)
    ids = eval_ids()
    ref = compute_reference(model, ids)
    scheme = "FP8_DYNAMIC"
    rows = {r.layer: r for r in sensitivity_sweep(model, scheme, ids, ref, groups=False)}
    with torch.no_grad():
        ref_logits = model(input_ids=ids, use_cache=False).logits[:, :-1].double()
    lr = torch.log_softmax(ref_logits, -1)
    for layer in ("model.layers.1.mlp.down_proj", "model.layers.0.self_attn.k_proj", "lm_head"):
        with plan_applied(model, {layer: scheme}), torch.no_grad():
            q = model(input_ids=ids, use_cache=False).logits[:, :-1].double()
        lq = torch.log_softmax(q, -1)
        golden = float((lr.exp() * (lr - lq)).sum(-1).mean())
        agree = float((q.argmax(-1) == ref_logits.argmax(-1)).double().mean())
        assert rows[layer].kl_mean == pytest.approx(golden, rel=1e-4, abs=1e-7), layer
        assert rows[layer].top1_agree == agree
        assert rows[layer].layers == [layer]


def test_a_sweep_on_two_gpus_quantizes_each_unit_as_served_there(tiny_model_factory):
    """``parallel=``: each unit is quantized as on that many GPUs, the KL of one-unit plans scored so; a
    row-parallel layer with a dynamic per-tensor scale (each GPU's half of its input on its own scale) moves, a
    column-parallel one and lm_head do not. The planted outlier sits in one half of down_proj's input, so the other
    GPU's half keeps its resolution and the sweep on two GPUs blames that layer less."""
    from quantcore.models.parallel import Parallelism

    model = sharp_model(tiny_model_factory, "llama", plant_outliers=False)
    planted = plant_down_proj_outlier(model, block=0)
    ids = eval_ids()
    ref = compute_reference(model, ids)
    two = Parallelism(2)
    one_gpu = {r.layer: r.kl_mean for r in sensitivity_sweep(model, "INT8_PER_TENSOR", ids, ref, groups=False)}
    rows = {r.layer: r for r in sensitivity_sweep(model, "INT8_PER_TENSOR", ids, ref, groups=False,
                                                  inputs=PlanInputs(parallel=two))}
    with torch.no_grad():
        lr = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[:, :-1].double(), -1)
    for layer in (planted, "model.layers.1.self_attn.o_proj", "lm_head"):
        with plan_applied(model, {layer: "INT8_PER_TENSOR"}, inputs=PlanInputs(parallel=two)), torch.no_grad():
            lq = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[:, :-1].double(), -1)
        golden = float((lr.exp() * (lr - lq)).sum(-1).mean())
        assert rows[layer].kl_mean == pytest.approx(golden, rel=1e-4, abs=1e-7), layer
    for layer, kl in one_gpu.items():
        if layer.endswith(("o_proj", "down_proj")):
            assert rows[layer].kl_mean != kl, layer
        else:
            assert rows[layer].kl_mean == kl, layer
    assert rows[planted].kl_mean < 0.75 * one_gpu[planted]


def test_local_sqnr_matches_direct_computation(tiny_model_factory):
    model = sharp_model(tiny_model_factory, "llama")
    ids = eval_ids()
    ref = compute_reference(model, ids, batch_size=SEQS)  # one batch: one SQNR over all tokens
    row = next(r for r in sensitivity_sweep(model, "INT8_W8A8", ids, ref, layers=["lm_head"]))
    captured = {}
    hook = model.lm_head.register_forward_pre_hook(lambda m, a: captured.setdefault("x", a[0].detach()))
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    hook.remove()
    x = captured["x"]
    with torch.no_grad():
        y = model.lm_head(x)
        with plan_applied(model, {"lm_head": "INT8_W8A8"}):
            y_q = model.lm_head(x)
    assert row.sqnr_db == pytest.approx(sqnr_db(y, y_q), abs=1e-6)
    assert 20 < row.sqnr_db < 60


def test_identity_scheme_is_exactly_zero(tiny_model_factory):
    model = sharp_model(tiny_model_factory, "gemma3")
    ids = eval_ids()
    ref = compute_reference(model, ids, batch_size=3)
    rows = sensitivity_sweep(model, "BF16", ids, ref, groups=False)
    assert len(rows) == 2 * 7 + 1
    assert all(r.kl_mean == 0.0 and r.top1_agree == 1.0 and r.sqnr_db == math.inf for r in rows)
    assert rows[0].to_dict()["sqnr_db"] is None


def test_cancel_raises_and_restores(tiny_model_factory):
    model = sharp_model(tiny_model_factory, "qwen2")
    ids = eval_ids()
    ref = compute_reference(model, ids)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calls = []

    def cancel_at_fourth_check() -> bool:
        calls.append(1)
        return len(calls) >= 4

    with pytest.raises(Cancelled, match="unit 3 of 9"):
        sensitivity_sweep(model, "INT8_W8A8", ids, ref, should_cancel=cancel_at_fourth_check)
    assert_clean(model, before)


def test_progress_and_layer_selection(tiny_model_factory):
    model = sharp_model(tiny_model_factory, "llama")
    ids = eval_ids()
    ref = compute_reference(model, ids, batch_size=2)
    seen: list[float] = []
    said: list[str] = []
    rows = sensitivity_sweep(
        model,
        "FP8_DYNAMIC",
        ids,
        ref,
        layers=["model.layers.0.self_attn.q_proj", "lm_head"],
        progress=lambda f, m: (seen.append(f), said.append(m)),
    )
    assert {r.layer for r in rows} == {"model.layers.0.self_attn.{q,k,v}_proj", "lm_head"}
    assert seen == sorted(seen) and seen[-1] == 1.0 and len(seen) == 2 * 2  # 2 batches x 2 units
    # each step says how far the sweep is and, until the last, how long the rest takes at its pace so far
    assert [m.split(" (")[1].split(",")[0].rstrip(")") for m in said] == ["1 of 4", "2 of 4", "3 of 4", "4 of 4"]
    assert all(re.search(r", about \d+ s left\)$", m) for m in said[:-1]) and said[-1] == "lm_head (4 of 4)"
    with pytest.raises(PlanError, match="model.layers.9.mlp.down_proj"):
        sensitivity_sweep(model, "FP8_DYNAMIC", ids, ref, layers=["model.layers.9.mlp.down_proj"])


def test_time_left_reads_in_the_unit_a_person_would_use():
    assert [time_left_text(t) for t in (0.2, 42.4, 89, 90, 1800, 5399, 5400, 9000)] == [
        ", about 1 s left", ", about 42 s left", ", about 89 s left", ", about 2 min left", ", about 30 min left",
        ", about 90 min left", ", about 1.5 h left", ", about 2.5 h left"]


def test_reference_of_other_weights_is_refused(tiny_model_factory):
    ids = eval_ids()
    ref = compute_reference(sharp_model(tiny_model_factory, "llama", seed=1), ids)
    with pytest.raises(ReferenceMismatch, match="recompute"):
        sensitivity_sweep(sharp_model(tiny_model_factory, "llama", seed=2), "FP8_DYNAMIC", ids, ref)


def test_a_reference_off_past_the_first_positions_is_refused_too(tiny_model_factory):
    """The first positions are checked before any unit runs, every position with the batch's first group of units:
    a cache off in the second sequence of the second batch only is refused all the same."""
    model = sharp_model(tiny_model_factory, "llama")
    ids = eval_ids()
    ref = compute_reference(model, ids, batch_size=2)
    ref.nll[3] += 0.01  # batch 2's mean gap 0.005, over the tolerance; its first sequence exact
    with pytest.raises(ReferenceMismatch, match="recompute"):
        sensitivity_sweep(model, "FP8_DYNAMIC", ids, ref)


def test_units_and_blocks(tiny_model_factory):
    model = tiny_model_factory("gemma3")
    names = linear_layer_names(model)
    assert names[-1] == "lm_head" and len(names) == 15
    grouped = sweep_units(names)
    assert grouped[0] == [f"model.layers.0.self_attn.{x}_proj" for x in "qkv"]
    assert len(grouped) == 9 and len(sweep_units(names, groups=False)) == 15
    stack = find_decoder_blocks(model)
    assert stack.prefix == "model.layers" and len(stack.blocks) == 2
    assert stack.block_of("model.layers.1.mlp.up_proj") == 1 and stack.block_of("lm_head") is None


def test_unsupported_architecture_is_named(tiny_model_factory):
    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)

    with pytest.raises(PlanError, match="Plain.*model.layers"):
        find_decoder_blocks(Plain())


def test_smoothquant_sweep_tames_the_planted_outlier(tiny_model_factory):
    """SmoothQuant folds 1/s into up_proj's rows: the planted down_proj outlier stops dominating."""
    from quantcore.evaluation.calibrate import calibrate

    model = sharp_model(tiny_model_factory, "llama", plant_outliers=False)
    planted = plant_down_proj_outlier(model, block=0)
    ids = eval_ids()
    ref = compute_reference(model, ids)
    stats = calibrate(model, ids)
    channel_max = {n: s.channel_max for n, s in stats.items()}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plain = {
        r.layer: r for r in sensitivity_sweep(model, "INT8_PER_TENSOR", ids, ref, layers=[planted, "lm_head"])
    }
    smooth = {
        r.layer: r
        for r in sensitivity_sweep(
            model, "INT8_PER_TENSOR_SQ", ids, ref, layers=[planted, "lm_head"],
            inputs=PlanInputs(act_channel_max=channel_max)
        )
    }
    assert_clean(model, before)
    assert smooth[planted].kl_mean < 0.2 * plain[planted].kl_mean, (smooth[planted], plain[planted])
    assert smooth[planted].sqnr_db > plain[planted].sqnr_db + 10
    assert smooth[planted].note == ""
    assert "SmoothQuant not applied" in smooth["lm_head"].note
    with pytest.raises(PlanError, match="calibrat"):
        sensitivity_sweep(model, "INT8_PER_TENSOR_SQ", ids, ref, layers=[planted])


@pytest.mark.parametrize("fmt", ["FP8_E5M2", "FP8_ATTN", "FP8_ATTN_HEAD"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_kv_sweep_equals_a_full_forward_with_every_other_layer_kept(arch, fmt, tiny_model_factory):
    """One attention layer's cache at a time: the replayed sweep gives the KL of a whole forward whose plan keeps
    every other layer out of the cache (kv_cache_skip), and the model is left as it was."""
    from quantcore.evaluation.kvcache import kv_amax_observed, kv_cache_quantized
    from quantcore.evaluation.sensitivity import kv_sensitivity_sweep
    from quantcore.models.decoder import attention_modules

    model = sharp_model(tiny_model_factory, arch)
    ids = eval_ids()
    ref = compute_reference(model, ids)
    with torch.no_grad(), kv_amax_observed(model) as amax:
        model(input_ids=eval_ids(3), use_cache=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rows = kv_sensitivity_sweep(model, fmt, ids, ref, amax=amax)
    assert_clean(model, before)
    assert model.config._attn_implementation == "sdpa"
    layers = list(attention_modules(model))
    assert sorted(r.layer for r in rows) == sorted(layers) and all(r.kl_mean > 0 for r in rows)
    assert [r.kl_mean for r in rows] == sorted((r.kl_mean for r in rows), reverse=True)
    with torch.no_grad():
        ref_logits = model(input_ids=ids, use_cache=False).logits[:, :-1].double()
    lr = torch.log_softmax(ref_logits, -1)
    for row in rows:
        with torch.no_grad(), kv_cache_quantized(model, fmt, amax=amax, skip=set(layers) - {row.layer}):
            q = model(input_ids=ids, use_cache=False).logits[:, :-1].double()
        golden = float((lr.exp() * (lr - torch.log_softmax(q, -1))).sum(-1).mean())
        assert row.kl_mean == pytest.approx(golden, rel=1e-4, abs=1e-7), row.layer
        assert math.isnan(row.sqnr_db) and row.to_dict()["sqnr_db"] is None
    with pytest.raises(PlanError, match="AUTO changes nothing"):
        kv_sensitivity_sweep(model, "AUTO", ids, ref)


def test_a_sweeps_time_left_follows_the_work_of_the_units_still_to_run():
    # 3 units of work 10, 6, 2 (blocks from their own on, plus the head), over 2 batches
    pace = SweepPace([10.0, 6.0, 2.0], batches=2)
    assert pace.left_s(0, 0) == 0.0  # nothing timed yet: nothing to pace by
    pace.timed(0, 1.0 + 0.5 * 10)  # each unit takes 1 s plus 0.5 s a block's worth of work
    assert pace.left_s(0, 0) == pytest.approx(6.0 * 5)  # one point: every unit left as long as the mean
    pace.timed(1, 1.0 + 0.5 * 6)
    # the line through the two: 1 + 0.5 w for the unit of work 2 left in this batch and all three of the next
    assert pace.left_s(0, 1) == pytest.approx((1 + 0.5 * 2) + (1 + 5) + (1 + 3) + (1 + 1))
    pace.timed(2, 1.0 + 0.5 * 2)
    assert pace.left_s(0, 2) == pytest.approx(6 + 4 + 2)
    assert pace.left_s(1, 2) == 0.0  # the last unit of the last batch
    flat = SweepPace([10.0, 6.0, 2.0], batches=1)
    flat.timed(0, 3.0)
    flat.timed(1, 3.5)  # slower on less work (noise): no slope, the mean for the unit left
    assert flat.left_s(0, 1) == pytest.approx(3.25)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_head_runs_a_chunk_of_positions_at_a_time(arch, tiny_model_factory, monkeypatch):
    """Issue #42: the sweep holds one chunk of logits, never ``[B, L, V]``. With a chunk of 3 positions' logits every
    call of the head (the reference's check and KL chunks, every unit's, the quantized head's own unit with its SQNR
    hooks) returns at most 3 rows, and the rows equal the one-chunk sweep's to float rounding; units compared alone
    or all in one group give the very same rows."""
    from quantcore.evaluation import batches, sweep_head

    model = sharp_model(tiny_model_factory, arch)
    ids = eval_ids()
    ref = compute_reference(model, ids, batch_size=2)
    inputs = PlanInputs(act_amax=None)
    seen: list[int] = []
    hook = model.lm_head.register_forward_hook(lambda _m, _a, out: seen.append(out.reshape(-1, out.shape[-1]).shape[0]))
    whole = sensitivity_sweep(model, "INT8_W8A8", ids, ref, inputs=inputs)
    assert max(seen) == 2 * LENGTH  # the default chunk holds the whole batch of this tiny model: one call a batch
    seen.clear()
    monkeypatch.setattr(batches, "LOGIT_CHUNK_ELEMENTS", 3 * 128)
    chunked = sensitivity_sweep(model, "INT8_W8A8", ids, ref, inputs=inputs)
    hook.remove()
    assert max(seen) == 3 and len(seen) > 9 * SEQS * LENGTH // 3
    assert [r.layer for r in chunked] == [r.layer for r in whole] and any(r.layer == "lm_head" for r in chunked)
    for a, b in zip(chunked, whole, strict=True):
        assert a.kl_mean == pytest.approx(b.kl_mean, rel=1e-4, abs=1e-7) and a.kl_mean > 0, a.layer
        assert a.top1_agree == b.top1_agree and a.sqnr_db == pytest.approx(b.sqnr_db, abs=1e-4), a.layer
    monkeypatch.setattr(sweep_head, "HEAD_GROUP_ELEMENTS", 1)  # every unit compared alone
    alone = sensitivity_sweep(model, "INT8_W8A8", ids, ref, inputs=inputs)
    assert [r.to_dict() for r in alone] == [r.to_dict() for r in chunked]


def test_only_the_heads_own_unit_keeps_a_head(tiny_model_factory, monkeypatch):
    """SmoothQuant on lm_head changes its weight in place and puts it back: the head's own unit keeps its head (and is
    compared at once), every other unit of every batch runs the model's own head and waits for its group."""
    from quantcore.evaluation import sweep_head

    model = sharp_model(tiny_model_factory, "gemma3")
    ids = eval_ids()
    ref = compute_reference(model, ids, batch_size=2)
    from quantcore.evaluation.calibrate import calibrate

    stats = calibrate(model, ids, batch_size=2)
    inputs = PlanInputs(act_amax={s.name: s.amax for s in stats.values()},
                        act_channel_max={s.name: s.channel_max for s in stats.values()})
    kept: list[tuple[int, bool]] = []
    add = sweep_head.HeadQueue.add

    def recording(self, unit, x, state, seconds):
        kept.append((unit, state is not None))
        add(self, unit, x, state, seconds)

    monkeypatch.setattr(sweep_head.HeadQueue, "add", recording)
    rows = sensitivity_sweep(model, "INT8_W8A8_SQ", ids, ref, inputs=inputs)
    assert all(r.kl_mean > 0 for r in rows)
    head_unit = len(rows) - 1  # lm_head is the last unit in model order
    assert len(kept) == 2 * len(rows)  # two batches
    assert [u for u, has in kept if has] == [head_unit, head_unit]
