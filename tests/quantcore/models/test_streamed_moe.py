"""MoE checkpoints streamed block by block (quantcore.models.streaming): the experts split on meta as the whole-model
load splits them (quantcore.models.moe), each read tensor by tensor under the checkpoint's own names (Mixtral's
``block_sparse_moe.experts.N.w1``); calibration, expert coverage, a score and GPTQ's rounding bit-identical to the
whole model on a CPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from quantcore.algorithms.inputs import PlanInputs
from quantcore.evaluation.calibrate import calibrate
from quantcore.evaluation.experts import expert_coverage_observed
from quantcore.evaluation.reference import compute_reference
from quantcore.evaluation.scoring import score_plan
from quantcore.evaluation.streamed import calibrate_streamed, score_streamed
from quantcore.models.loading import load_model
from quantcore.models.moe import LinearExperts
from quantcore.models.streaming import StreamedModel
from tests.factories import tiny_moe, tiny_tokenizer

BATCH = 2


def saved(folder: Path, arch: str) -> Path:
    tiny_moe(arch).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_a_streamed_moe_calibrates_and_scores_as_the_whole_model(tmp_path, arch):
    folder = saved(tmp_path / arch, arch)
    whole, _ = load_model(folder)
    ids = torch.randint(0, whole.config.vocab_size, (3, 16), generator=torch.Generator().manual_seed(1))
    streamed = StreamedModel(folder)
    assert sum(isinstance(m, LinearExperts) for m in streamed.model.modules()) == 2  # split on meta
    with expert_coverage_observed(whole) as cov_whole:
        expected = calibrate(whole, ids, batch_size=BATCH)
    with expert_coverage_observed(streamed.model) as cov_streamed:
        got = calibrate_streamed(streamed, ids, batch_size=BATCH)
    assert list(got) == list(expected) and any(".experts.3.down_proj" in n for n in got)
    for name in expected:
        np.testing.assert_array_equal(got[name].channel_max, expected[name].channel_max, err_msg=name)
        np.testing.assert_array_equal(got[name].weight_channel_max, expected[name].weight_channel_max, err_msg=name)
    assert cov_streamed.to_dict() == cov_whole.to_dict() and len(cov_whole.to_dict()) == 2
    ref = compute_reference(whole, ids, batch_size=BATCH)
    inputs = PlanInputs(act_amax={s.name: s.amax for s in expected.values()})
    plan = {n: "FP8" for n in expected if n != "lm_head"}
    a = score_plan(whole, plan, ids, ref, inputs=inputs)
    b = score_streamed(streamed, plan, ids, ref, inputs=inputs)
    assert (b.kl_mean, b.top1_agree, b.ppl) == (a.kl_mean, a.top1_agree, a.ppl) and a.kl_mean > 0


def test_streamed_gptq_of_moe_experts_is_the_whole_models(tmp_path):
    """Every expert's Hessian from every token (all_experts, as the whole model's collect_hessians)."""
    from quantcore.algorithms.apply import quantized_model
    from quantcore.algorithms.gptq import collect_hessians
    from quantcore.algorithms.streamed_rounding import round_gptq_streamed
    from quantcore.schemes.presets import get_scheme

    folder = saved(tmp_path / "moe", "qwen3_moe")
    whole, _ = load_model(folder)
    ids = torch.randint(0, whole.config.vocab_size, (3, 16), generator=torch.Generator().manual_seed(2))
    plan = {n: get_scheme("W4A16_GPTQ") for n, m in whole.named_modules()
            if isinstance(m, torch.nn.Linear) and ".experts." in n}
    expected: dict[str, torch.Tensor] = {}
    hess = collect_hessians(whole, list(plan), ids, batch_size=BATCH)
    with quantized_model(whole, plan, PlanInputs(weight_hessians=hess, gptq_cache=expected), track_stats=False):
        pass
    got: dict[str, torch.Tensor] = {}
    round_gptq_streamed(StreamedModel(folder), plan, ids, cache=got, batch_size=BATCH)
    assert sorted(got) == sorted(expected) and len(got) == 24
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
