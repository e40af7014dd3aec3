"""The sensitivity sweep streamed (quantcore.evaluation.streamed_sweep) against the whole-model sweep: on a CPU every
row (KL, its error, top-1 agreement, SQNR, notes) must be bit-identical, whatever holds the hidden states."""

from __future__ import annotations

import pytest
import torch

from quantcore.algorithms.inputs import PlanInputs
from quantcore.errors import Cancelled, PlanError
from quantcore.evaluation.calibrate import calibrate
from quantcore.evaluation.reference import compute_reference
from quantcore.evaluation.sensitivity import kv_sensitivity_sweep, sensitivity_sweep
from quantcore.evaluation.streamed_sweep import streamed_kv_sensitivity_sweep, streamed_sensitivity_sweep
from quantcore.models.loading import load_model
from quantcore.models.streaming import StreamedModel
from tests.factories import TINY_VOCAB
from tests.quantcore.evaluation.test_streamed import BATCH, eval_ids, save


def rows_of(rows) -> list[dict]:
    return [r.to_dict() for r in rows]


@pytest.mark.parametrize(("arch", "scheme", "groups"), [("llama", "INT8_PER_TENSOR", True), ("qwen2", "W4A16", False),
                                                        ("gemma3", "INT8_W8A8_SQ", True)])
def test_streamed_sweep_equals_whole(tmp_path, arch, scheme, groups):
    """Static activation scales, a weight-only scheme over single layers and SmoothQuant, every unit from block 0 to
    the (tied, on Gemma) head: the same rows in the same order; progress says which block."""
    folder = save(tmp_path / arch, arch)
    whole, _ = load_model(folder)
    ids = eval_ids(3)  # two batches
    stats = calibrate(whole, ids, batch_size=BATCH)
    inputs = PlanInputs(act_amax={s.name: s.amax for s in stats.values()},
                        act_channel_max={s.name: s.channel_max for s in stats.values()})
    ref = compute_reference(whole, ids, batch_size=BATCH)
    expected = rows_of(sensitivity_sweep(whole, scheme, ids, ref, groups=groups, inputs=inputs))
    streamed = StreamedModel(folder)
    messages: list[str] = []
    got = rows_of(streamed_sensitivity_sweep(streamed, scheme, ids, ref, groups=groups, inputs=inputs,
                                             progress=lambda f, m: messages.append(m)))
    assert got == expected
    assert any(r["layer"] == "lm_head" for r in got) and all(r["kl_mean"] > 0 for r in got)
    assert any(m.startswith("streamed, block 2/2") for m in messages)
    assert all(p.device.type == "meta" for b in streamed.stack.blocks for p in b.parameters())


def test_streamed_kv_sweep_equals_whole(tmp_path):
    from quantcore.evaluation.kvcache import kv_amax_observed

    folder = save(tmp_path / "m", "gemma3")
    whole, _ = load_model(folder)
    ids = eval_ids(3)  # two batches
    with kv_amax_observed(whole) as amax:
        calibrate(whole, ids, batch_size=BATCH)
    ref = compute_reference(whole, ids, batch_size=BATCH)
    for kv in ("FP8", "FP8_ATTN"):
        expected = rows_of(kv_sensitivity_sweep(whole, kv, ids, ref, amax=amax))
        got = rows_of(streamed_kv_sensitivity_sweep(StreamedModel(folder), kv, ids, ref, amax=amax))
        assert got == expected and len(got) == 2 and expected[0]["kl_mean"] > 0, kv


def test_streamed_sweep_equals_whole_a_chunk_of_positions_at_a_time(tmp_path, monkeypatch):
    """Issue #42: with a chunk of 3 positions' logits (the head's output never more rows than that, its own unit's
    SQNR taken a chunk at a time) and the units' head inputs compared in groups of two, the streamed rows are still
    the whole sweep's, bit for bit."""
    from quantcore.evaluation import batches, sweep_head

    folder = save(tmp_path / "m", "llama")
    whole, _ = load_model(folder)
    ids = eval_ids(3)  # two batches
    ref = compute_reference(whole, ids, batch_size=BATCH)
    monkeypatch.setattr(batches, "LOGIT_CHUNK_ELEMENTS", 3 * TINY_VOCAB)
    monkeypatch.setattr(sweep_head, "HEAD_GROUP_ELEMENTS", 2 * BATCH * ids.shape[1] * whole.config.hidden_size)
    seen: list[int] = []
    hook = whole.lm_head.register_forward_hook(lambda _m, _a, out: seen.append(out.reshape(-1, out.shape[-1]).shape[0]))
    expected = rows_of(sensitivity_sweep(whole, "INT8_W8A8", ids, ref))
    hook.remove()
    assert max(seen) == 3
    got = rows_of(streamed_sensitivity_sweep(StreamedModel(folder), "INT8_W8A8", ids, ref))
    assert got == expected and len(got) == 9 and all(r["kl_mean"] > 0 for r in got)


def test_states_in_scratch_files_same_rows_and_removed(tmp_path):
    """A budget with room for no state beside one block: every unit's states in a scratch file, the rows unchanged,
    the folder empty afterwards (also after a cancel); a shard's part of the units sweeps only those."""
    folder = save(tmp_path / "m", "llama")
    whole, _ = load_model(folder)
    ids = eval_ids(3)  # two batches
    ref = compute_reference(whole, ids, batch_size=BATCH)
    part = ["model.layers.1.mlp.down_proj", "lm_head"]
    expected = rows_of(sensitivity_sweep(whole, "FP8_DYNAMIC", ids, ref, layers=part))
    probe = StreamedModel(folder)
    scratch = tmp_path / "scratch"
    tight = StreamedModel(folder, budget=probe.resident_bytes() + probe.block_bytes(0) + 1024, scratch=scratch)
    files: list[int] = []

    def progress(_f: float, _m: str) -> None:
        files.append(sum(1 for d in scratch.iterdir() for _ in d.iterdir()))

    assert rows_of(streamed_sensitivity_sweep(tight, "FP8_DYNAMIC", ids, ref, layers=part, progress=progress)) \
        == expected
    assert max(files) == 2  # the reference's states and down_proj's; lm_head's start at the head
    assert list(scratch.iterdir()) == []
    calls = iter(range(100))
    with pytest.raises(Cancelled):
        streamed_sensitivity_sweep(tight, "FP8_DYNAMIC", ids, ref, should_cancel=lambda: next(calls) > 3)
    assert list(scratch.iterdir()) == []
    assert all(p.device.type == "meta" for b in tight.stack.blocks for p in b.parameters())


def cal_ids(n: int = 5, length: int = 16) -> torch.Tensor:
    return torch.randint(0, TINY_VOCAB, (n, length), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize(("scheme", "groups", "passes"), [("W4A16_GPTQ", True, 1), ("NVFP4A16_GPTQ", False, 3)])
def test_streamed_gptq_sweep_equals_whole(tmp_path, scheme, groups, passes):
    """GPTQ rounded block by block before the sweep: the whole sweep's rows (Hessians from collect_hessians on the
    whole model). Fusion groups round in one pass; single layers of NVFP4 (one tensor scale per applied group) in one
    pass per q/k/v member, each rounded as its unit alone; a cache holding every rounding needs no pass."""
    from quantcore.algorithms.gptq import collect_hessians
    from quantcore.evaluation.sensitivity import linear_layer_names

    folder = save(tmp_path / "m", "llama")
    whole, _ = load_model(folder)
    ids, cal = eval_ids(3), cal_ids()
    ref = compute_reference(whole, ids, batch_size=BATCH)
    hessians = collect_hessians(whole, linear_layer_names(whole), cal, batch_size=4)
    whole_cache: dict[str, torch.Tensor] = {}
    expected = rows_of(sensitivity_sweep(whole, scheme, ids, ref, groups=groups,
                                         inputs=PlanInputs(weight_hessians=hessians, gptq_cache=whole_cache)))
    streamed = StreamedModel(folder)
    cache: dict[str, torch.Tensor] = {}
    messages: list[str] = []
    got = rows_of(streamed_sensitivity_sweep(streamed, scheme, ids, ref, groups=groups, calibration_ids=cal,
                                             inputs=PlanInputs(gptq_cache=cache),
                                             progress=lambda f, m: messages.append(m)))
    assert got == expected and all(r["kl_mean"] > 0 for r in got)
    assert sorted(cache) == sorted(whole_cache) and len(cache) == 15  # the head too
    assert all(torch.equal(cache[n], whole_cache[n]) for n in cache)
    assert sum(m.startswith("GPTQ: Hessians and rounding, streamed, block 1/2") for m in messages) == passes
    with pytest.raises(PlanError, match="calibration_ids"):
        streamed_sensitivity_sweep(streamed, scheme, ids, ref, groups=groups)
    messages.clear()  # every rounding at hand: no pass
    again = streamed_sensitivity_sweep(streamed, scheme, ids, ref, groups=groups, inputs=PlanInputs(gptq_cache=cache),
                                       progress=lambda f, m: messages.append(m))
    assert rows_of(again) == expected and not any(m.startswith("GPTQ") for m in messages)


def test_streamed_awq_sweep_equals_whole(tmp_path):
    """AWQ's factors searched streamed: the whole sweep's rows with the whole model's search; none given: refused."""
    from quantcore.algorithms.awq import awq_search
    from quantcore.algorithms.streamed_rounding import awq_search_streamed
    from quantcore.evaluation.sensitivity import linear_layer_names

    folder = save(tmp_path / "m", "llama")
    whole, _ = load_model(folder)
    ids, cal = eval_ids(3), cal_ids()
    ref = compute_reference(whole, ids, batch_size=BATCH)
    plan = dict.fromkeys(linear_layer_names(whole), "W4A16_AWQ")
    expected = rows_of(sensitivity_sweep(whole, "W4A16_AWQ", ids, ref, groups=False,
                                         inputs=PlanInputs(awq=awq_search(whole, plan, cal))))
    streamed = StreamedModel(folder)
    awq = awq_search_streamed(streamed, plan, cal)
    got = rows_of(streamed_sensitivity_sweep(streamed, "W4A16_AWQ", ids, ref, groups=False,
                                             inputs=PlanInputs(awq=awq)))
    assert got == expected and len(got) == 15 and all(r["kl_mean"] > 0 for r in got)
    with pytest.raises(PlanError, match="AWQ"):
        streamed_sensitivity_sweep(streamed, "W4A16_AWQ", ids, ref)


@pytest.mark.slow
def test_smollm2_streamed_sweep_equals_whole():
    """SmolLM2-135M (its GGUF converted to safetensors as registration stores it): a sweep of units in the last two
    blocks and the tied head bit-identical streamed and whole (late units and one batch keep it cheap: every unit
    runs the blocks from its own on; batches and KV sweeps are compared on the tiny models)."""
    from quantcore.models.intake import converted_gguf_folder, demo_gguf_path
    from quantcore.models.validation import default_cache_dir

    folder = converted_gguf_folder(demo_gguf_path(), cache_dir=default_cache_dir())
    whole, _ = load_model(folder)
    ids = torch.randint(0, 49152, (2, 32), generator=torch.Generator().manual_seed(0))  # one batch: kept cheap
    ref = compute_reference(whole, ids, batch_size=BATCH, topk=64)
    part = ["model.layers.28.mlp.down_proj", "model.layers.29.self_attn.q_proj", "lm_head"]  # cheap: late units
    streamed = StreamedModel(folder)
    expected = rows_of(sensitivity_sweep(whole, "INT8_W8A8", ids, ref, layers=part))
    assert rows_of(streamed_sensitivity_sweep(streamed, "INT8_W8A8", ids, ref, layers=part)) == expected
    assert len(expected) == 3 and all(r["kl_mean"] > 0 for r in expected)
