"""The suggested SmoothQuant α on the real demo model (SmolLM2-135M-Instruct): scored, not just estimated.

Calibrates on the packaged calibration text, suggests one α per fusion unit for INT8_W8A8 from the stored statistics
alone (:mod:`quantcore.evaluation.alpha`), then scores INT8_W8A8 on every linear but lm_head smoothed at the
suggested α against the same plan at α = 0.5, on the same evaluation tokens. The KL of each is measured per sequence
here, so the comparison is paired: suggested ≤ α = 0.5 + 2 standard errors of the per-sequence difference.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quantcore.algorithms.inputs import PlanInputs
from quantcore.evaluation import alpha as al
from quantcore.evaluation.calibrate import calibrate
from quantcore.evaluation.scoring import plan_applied
from quantcore.evaluation.text import default_calibration_text, default_eval_text, load_documents, token_batches
from quantcore.models.intake import converted_gguf_folder, demo_gguf_path
from quantcore.models.loading import load_model
from quantcore.models.validation import default_cache_dir
from quantcore.schemes.fusion import fusion_group_of
from quantcore.schemes.presets import get_scheme

pytestmark = pytest.mark.slow

SCHEME = "INT8_W8A8"
N_CAL, N_EVAL, SEQ_LEN = 8, 8, 128  # as tests/quantcore/models/test_smollm2.py calibrates; 1,024 scored positions
PAIRED_SE = 2.0  # the suggestion may be worse than α = 0.5 by at most this many paired standard errors


@pytest.fixture(scope="module")
def demo():
    model, tokenizer = load_model(converted_gguf_folder(demo_gguf_path(), cache_dir=default_cache_dir()))
    model.eval()
    return model, tokenizer


def _kl_per_sequence(model, plan, inputs: PlanInputs, ids: torch.Tensor, ref: torch.Tensor) -> np.ndarray:
    """Mean KL(p_ref || p_plan) over the positions of each sequence (nats), [S]."""
    with plan_applied(model, plan, inputs), torch.no_grad():
        logq = torch.log_softmax(model(ids).logits.float(), dim=-1)
    return (ref.exp() * (ref - logq)).sum(dim=-1).mean(dim=-1).numpy()


def test_the_suggested_alpha_scores_no_worse_than_half(demo):
    model, tokenizer = demo
    stats = calibrate(model, token_batches(tokenizer, load_documents(default_calibration_text()),
                                           n_samples=N_CAL, seq_len=SEQ_LEN), batch_size=4)
    names = [n for n in stats if n != "lm_head"]
    suggested: dict[str, float] = {}
    for name in names:
        if name not in suggested:
            group = fusion_group_of(name, names)
            alpha = al.suggest_alpha([stats[m] for m in group], SCHEME)
            suggested.update(dict.fromkeys(group, alpha))
    # the statistics do not simply echo the default: the suggestions spread over the grid
    assert len(set(suggested.values())) >= 3 and set(suggested.values()) != {0.5}

    ids = token_batches(tokenizer, load_documents(default_eval_text()), n_samples=N_EVAL, seq_len=SEQ_LEN)
    with torch.no_grad():
        ref = torch.log_softmax(model(ids).logits.float(), dim=-1)
    inputs = PlanInputs(act_channel_max={n: stats[n].channel_max for n in names})
    base = get_scheme(SCHEME)
    kl_suggested = _kl_per_sequence(model, {n: base.with_alpha(suggested[n]) for n in names}, inputs, ids, ref)
    kl_half = _kl_per_sequence(model, {n: base.with_alpha(0.5) for n in names}, inputs, ids, ref)
    diff = kl_suggested - kl_half
    se = float(diff.std(ddof=1) / np.sqrt(diff.size))
    assert kl_suggested.mean() <= kl_half.mean() + PAIRED_SE * se, (
        f"suggested α: KL {kl_suggested.mean():.5f}, α = 0.5: {kl_half.mean():.5f} (paired SE {se:.5f})")
    assert kl_half.mean() > 0 and np.isfinite(kl_suggested).all()
