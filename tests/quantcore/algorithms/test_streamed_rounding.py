"""GPTQ's Hessians and rounding, and AWQ's search, streamed block by block (quantcore.algorithms.streamed_rounding)
against the whole-model functions: on a CPU, with the same batches, bit-identical."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from quantcore.algorithms.apply import quantized_model
from quantcore.algorithms.awq import awq_search
from quantcore.algorithms.gptq import collect_hessians
from quantcore.algorithms.inputs import PlanInputs
from quantcore.algorithms.streamed_rounding import SpilledWeights, awq_search_streamed, round_gptq_streamed
from quantcore.errors import Cancelled
from quantcore.models.loading import load_model
from quantcore.models.streaming import StreamedModel
from quantcore.schemes.presets import get_scheme
from tests.factories import TINY_VOCAB, build_tiny_model, tiny_tokenizer

BATCH = 2


def save(folder: Path, arch: str) -> Path:
    build_tiny_model(arch).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def cal_ids(n: int = 5, length: int = 16) -> torch.Tensor:
    return torch.randint(0, TINY_VOCAB, (n, length), generator=torch.Generator().manual_seed(7))


def block_linears(model) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]


def whole_gptq(model, plan, ids) -> dict[str, torch.Tensor]:
    hess = collect_hessians(model, [n for n, s in plan.items() if s.needs_hessians], ids, batch_size=BATCH)
    cache: dict[str, torch.Tensor] = {}
    with quantized_model(model, plan, PlanInputs(weight_hessians=hess, gptq_cache=cache), track_stats=False):
        pass
    return cache


@pytest.mark.parametrize(("arch", "scheme"), [("llama", "W4A16_GPTQ"), ("qwen2", "W4A16_GPTQ")])
def test_streamed_gptq_rounds_every_layer_as_the_whole_model_does(tmp_path, arch, scheme):
    folder = save(tmp_path / arch, arch)
    whole, _ = load_model(folder)
    ids = cal_ids()
    # the second block's gate/up rounded with GPTQ and the rest of it RTN: a plan mixing both, per block
    plan = {n: get_scheme(scheme if (".0." in n or "mlp" in n) else "W4A16") for n in block_linears(whole)}
    expected = whole_gptq(whole, plan, ids)
    streamed = StreamedModel(folder)
    cache = SpilledWeights(tmp_path / "rounded")
    messages: list[str] = []
    done = round_gptq_streamed(streamed, plan, ids, cache=cache, batch_size=BATCH,
                               progress=lambda f, m: messages.append(m))
    assert sorted(done) == sorted(expected) and sorted(cache) == sorted(expected)
    for name, weight in expected.items():
        assert torch.equal(cache[name], weight), name
    assert len(list((tmp_path / "rounded").glob("*.safetensors"))) == len(expected)  # on disk, not in memory
    assert all(p.device.type == "meta" for b in streamed.stack.blocks for p in b.parameters())  # every block freed
    assert any("GPTQ: Hessians and rounding, streamed, block" in m for m in messages)
    # a second call finds every layer rounded and reads no block
    assert round_gptq_streamed(streamed, plan, ids, cache=cache, batch_size=BATCH) == []


def test_streamed_score_with_gptq_equals_the_whole_score(tmp_path):
    """The rounded weights in the cache are what the streamed score applies: its report equals the whole one."""
    from quantcore.evaluation.reference import compute_reference
    from quantcore.evaluation.scoring import score_plan
    from quantcore.evaluation.streamed import score_streamed

    folder = save(tmp_path / "llama", "llama")
    whole, _ = load_model(folder)
    ids = cal_ids()
    plan = {n: get_scheme("W4A16_GPTQ") for n, m in whole.named_modules() if isinstance(m, torch.nn.Linear)}
    assert "lm_head" in plan  # the head too: its Hessian from the final hidden states
    hess = collect_hessians(whole, list(plan), ids, batch_size=BATCH)
    ref = compute_reference(whole, ids, batch_size=BATCH)
    expected = score_plan(whole, plan, ids, ref, inputs=PlanInputs(weight_hessians=hess, gptq_cache={}))
    streamed = StreamedModel(folder)
    cache = SpilledWeights(tmp_path / "rounded")
    round_gptq_streamed(streamed, plan, ids, cache=cache, batch_size=BATCH)
    got = score_streamed(streamed, plan, ids, ref, inputs=PlanInputs(gptq_cache=cache))
    assert got.kl_mean == expected.kl_mean and got.top1_agree == expected.top1_agree and got.ppl == expected.ppl
    assert got.kl_mean > 0


def test_streamed_awq_search_equals_the_whole_search(tmp_path):
    arch = "llama"
    folder = save(tmp_path / arch, arch)
    whole, _ = load_model(folder)
    ids = cal_ids()
    # AWQ in block 0 only and in both: blocks after the last mapping are never read
    for names in ([n for n in block_linears(whole) if ".0." in n], block_linears(whole)):
        plan = {n: "W4A16_AWQ" for n in names}
        expected = awq_search(whole, plan, ids, batch_size=BATCH, n_grid=4)
        streamed = StreamedModel(folder)
        read: list[int] = []
        load = streamed.load_block
        streamed.load_block = lambda i, _load=load, _read=read: (_read.append(i), _load(i))[1]  # type: ignore
        got = awq_search_streamed(streamed, plan, ids, batch_size=BATCH, n_grid=4)
        assert sorted(got.factors) == sorted(expected.factors) and got.factors
        for name in expected.factors:
            assert torch.equal(got.factors[name], expected.factors[name]), name
        assert got.errors == expected.errors and got.skipped == expected.skipped
        assert read == list(range(max(int(n.split(".")[2]) for n in names) + 1))
        assert all(p.device.type == "meta" for b in streamed.stack.blocks for p in b.parameters())


def test_a_cancelled_streamed_awq_search_stops(tmp_path):
    folder = save(tmp_path / "llama", "llama")
    streamed = StreamedModel(folder)
    plan = {n: "W4A16_AWQ" for n in block_linears(streamed.model)}
    with pytest.raises(Cancelled):
        awq_search_streamed(streamed, plan, cal_ids(), batch_size=BATCH, n_grid=2, should_cancel=lambda: True)
    assert all(p.device.type == "meta" for b in streamed.stack.blocks for p in b.parameters())
