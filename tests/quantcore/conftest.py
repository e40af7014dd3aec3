"""Shared fixtures for quantcore tests: tiny, seeded, random-weight causal LMs (built by
:func:`tests.factories.build_tiny_model`, where the TINY_* and OUTLIER_* constants live too).

Three architectures that differ where quantization cares:

- ``tiny_llama``:  LlamaForCausalLM, RMSNorm gain ``w``, no biases, GQA 4 query / 2 kv heads.
- ``tiny_qwen2``:  Qwen2ForCausalLM, like Llama but q/k/v carry biases.
- ``tiny_gemma3``: Gemma3ForCausalLM, RMSNorm computes ``x * (1 + w)``, q/k norms, a
  ``pre_feedforward_layernorm`` feeding the MLP, one sliding and one full attention layer.

All have 2 layers, hidden 64, intermediate 128, vocab 128, fp32, ``eval()`` mode, and are
built fresh for every test (about 10 ms each), so a test may modify its model in place.

Random initialisation leaves norm gains at exactly 1 (Llama) or 0 (Gemma), which would let
a wrong SmoothQuant fold pass unnoticed; the builder perturbs every norm gain and plants
activation outliers on purpose (``OUTLIER_CHANNEL`` of every norm output, and one channel of
every ``down_proj`` input) so smoothing has real work to do:

    model = tiny_model_factory("llama", seed=3, dtype=torch.bfloat16)

Nothing is downloaded: models come from config objects (HF_HUB_OFFLINE=1 is set here).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from tests.factories import TINY_ARCHS, TINY_BATCH, TINY_SEQ, TINY_VOCAB, build_tiny_model, linear_input_channel_max

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture
def tiny_model_factory() -> Callable:
    """The builder itself: ``tiny_model_factory(arch, seed=0, dtype=None, plant_outliers=True)``."""
    return build_tiny_model


@pytest.fixture
def tiny_llama():
    """Fresh tiny LlamaForCausalLM (see module docstring)."""
    return build_tiny_model("llama")


@pytest.fixture
def tiny_qwen2():
    """Fresh tiny Qwen2ForCausalLM (see module docstring)."""
    return build_tiny_model("qwen2")


@pytest.fixture
def tiny_gemma3():
    """Fresh tiny Gemma3ForCausalLM (see module docstring)."""
    return build_tiny_model("gemma3")


@pytest.fixture(params=TINY_ARCHS)
def tiny_model(request):
    """Each tiny architecture in turn (test ids: llama, qwen2, gemma3)."""
    return build_tiny_model(request.param)


@pytest.fixture
def channel_max_of() -> Callable:
    """``channel_max_of(model, input_ids) -> {linear name: (K,) max |x_j|}`` (see linear_input_channel_max)."""
    return linear_input_channel_max


@pytest.fixture
def tiny_input_ids():
    """Seeded token ids, shape (TINY_BATCH, TINY_SEQ) = (2, 16), int64."""
    import torch

    gen = torch.Generator().manual_seed(1234)
    return torch.randint(0, TINY_VOCAB, (TINY_BATCH, TINY_SEQ), generator=gen)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one")


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover - torch is a dependency of quantcore tests
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none available here)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
