"""The Fisher estimate checks its reference cache on the softmax it draws from (issue 43's cost): a cache of
another model is refused as the exact sweep refuses it, and a token whose probability underflows to 0 is judged
on the log-softmax."""

import pytest
import torch

import quantcore.evaluation.fisher as fisher
from quantcore.evaluation.fisher import fisher_sensitivity
from quantcore.evaluation.reference import ReferenceMismatch, compute_reference


def test_a_reference_of_another_model_is_refused(tiny_model_factory):
    model, other = tiny_model_factory("llama", seed=2), tiny_model_factory("llama", seed=3)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(7))
    with pytest.raises(ReferenceMismatch, match="does not match this model"):
        fisher_sensitivity(model, ["FP8_DYNAMIC"], ids, compute_reference(other, ids), samples=1)


def test_an_underflowed_probability_is_judged_on_the_log_softmax(tiny_model_factory):
    model = tiny_model_factory("llama", seed=2)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(7))
    ref = compute_reference(model, ids)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    probs = torch.softmax(logits[:, :-1], dim=-1)
    probs[0, 0, ids[0, 1]] = 0.0  # -log 0 = inf: the cheap test cannot tell, the log-softmax passes it
    fisher._check_reference_by(probs, logits, ids, ref, 0, 2)
    with pytest.raises(ReferenceMismatch):
        fisher._check_reference_by(probs, logits + torch.randn_like(logits), ids, ref, 0, 2)
