"""Outlier fixes side by side (quantplan.services.fixes, issue #46): a plan's body split into what it quantizes and
its fix, the scores that differ only in the fix grouped, and each against the one without a fix."""

from __future__ import annotations

import numpy as np
import pytest

from quantplan.services import fixes
from store.records import ScoreRecord

ROT = {"kind": "hadamard", "rotations": ["R1", "R2", "R4"], "block_size": 64}


def score(job: int, body: dict, kl: float, seqs: list[float] | None = None, dataset: str = "lee.cor",
          tokens: int = 1000) -> ScoreRecord:
    details = {} if seqs is None else {"eval_key": "k", "kl_by_sequence": seqs, "top1_by_sequence": [0.9] * len(seqs)}
    return ScoreRecord(id=job, job_id=job, model_id=1, plan_id=None, plan_label=f"p{job}", plan_body=body,
                       dataset=dataset, tokens=tokens, kl_mean=kl, kl_p50=kl, kl_p90=kl, kl_p99=kl, kl_max=kl,
                       top1_agree=0.9, ppl_ref=10.0, ppl=11.0, predicted_kl=None, details=details,
                       kl_mean_err=None if seqs is None else float(np.std(seqs) / np.sqrt(len(seqs))),
                       top1_agree_err=0.01)


@pytest.mark.parametrize(("body", "label", "base"), [
    ({"default": "INT8_W8A8"}, "none", '{"default": "INT8_W8A8"}'),
    ({"default": "INT8_W8A8_SQ"}, "SmoothQuant α=0.5", '{"default": "INT8_W8A8"}'),  # the preset's α
    ({"model": "m", "name": "x", "default": "INT8_W8A8_SQ", "smoothquant_alpha": 0.75, "rules": [], "layers": {}},
     "SmoothQuant α=0.75", '{"default": "INT8_W8A8"}'),  # a plan file without rules is the preset's base
    ({"default": "MXFP4", "transforms": {"rotation": ROT}}, "rotation R1+R2+R4 (blocks of 64)",
     '{"default": "MXFP4"}'),
    ({"default": "INT8_W8A8", "layers": {"a": {"smoothquant_alpha": 0.6}, "b": "BF16"}},
     "SmoothQuant on some layers, α 0.6", '{"default": "INT8_W8A8", "layers": {"b": "BF16"}}'),
    ({"default": "INT8_W8A8_SQ", "rules": [{"match": "x", "scheme": "INT8_W8A8_SQ_GPTQ"}],
      "transforms": {"rotation": {"kind": "random-hadamard", "rotations": ["R1"], "seed": 3}}},
     "SmoothQuant α=0.5 + rotation (random-hadamard, seed 3) R1",
     '{"default": "INT8_W8A8", "rules": [{"match": "x", "scheme": "INT8_W8A8_GPTQ"}]}'),
])
def test_a_plan_is_split_into_what_it_quantizes_and_its_fix(body, label, base):
    fix = fixes.plan_fix(body)
    assert (fix.label, fix.base) == (label, base)


def test_scores_that_differ_only_in_the_fix_are_grouped_the_unfixed_first():
    scores = [  # newest first
        score(6, {"default": "INT8_W8A8", "transforms": {"rotation": ROT}}, 0.010, [0.01, 0.012, 0.008]),
        score(5, {"default": "INT8_W8A8_SQ"}, 0.020, [0.02, 0.022, 0.018]),
        score(4, {"default": "INT8_W8A8"}, 0.050, [0.05, 0.06, 0.04]),
        score(3, {"default": "INT8_W8A8"}, 0.070),  # an older score of the same fix: the newest is kept
        score(2, {"default": "INT8_W8A8_SQ"}, 0.030, dataset="other.txt"),  # other tokens: not comparable
        score(1, {"default": "FP8_DYNAMIC"}, 0.001),  # one fix only: no comparison
    ]
    (group,) = fixes.fix_groups(scores)
    assert group.title == "INT8_W8A8" and (group.dataset, group.tokens) == ("lee.cor", 1000)
    assert group.fixes == ("none", "rotation R1+R2+R4 (blocks of 64)", "SmoothQuant α=0.5")  # then by KL
    assert [s.job_id for s in group.scores] == [4, 6, 5]
    dkl = fixes.versus_unfixed(group)
    assert dkl[0] is None
    assert dkl[1].value == pytest.approx(-0.04) and dkl[1].err == pytest.approx(np.std([-0.04, -0.048, -0.032],
                                                                                       ddof=1) / np.sqrt(3))
    assert dkl[2].value == pytest.approx(-0.03)
    assert fixes.versus_unfixed(group, "top1_agree")[1].value == pytest.approx(0.0)


def test_a_group_without_an_unfixed_plan_has_no_differences():
    scores = [score(2, {"default": "INT8_W8A8_SQ"}, 0.02), score(1, {"default": "INT8_W8A8_SQ",
                                                                     "transforms": {"rotation": ROT}}, 0.01)]
    (group,) = fixes.fix_groups(scores)
    assert fixes.versus_unfixed(group) == [None, None]


def test_rotation_text():
    assert fixes.rotation_text(None) == "none"
    assert fixes.rotation_text({"kind": "hadamard"}) == "rotation R1+R2+R4"
