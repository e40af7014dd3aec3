"""Shared fixtures for quantcore tests: tiny, seeded, random-weight causal LMs.

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

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TINY_ARCHS = ("llama", "qwen2", "gemma3")  # every architecture the fixtures build
TINY_VOCAB = 128  # vocabulary size of every tiny model
TINY_HIDDEN = 64  # hidden size
TINY_INTERMEDIATE = 128  # MLP width (down_proj input width)
TINY_LAYERS = 2  # decoder blocks
TINY_HEADS = 4  # query heads
TINY_KV_HEADS = 2  # key/value heads: GQA with 2 query heads per kv head
TINY_HEAD_DIM = 16  # TINY_HIDDEN // TINY_HEADS
TINY_SEQ = 16  # tokens per sequence in tiny_input_ids
TINY_BATCH = 2  # sequences in tiny_input_ids
OUTLIER_CHANNEL = 3  # hidden channel whose norm gain is raised to plant an activation outlier
OUTLIER_GAIN = 20.0  # its gain: about 20x the other channels, like real LLM outlier features
DOWN_OUTLIER_CHANNEL = 7  # intermediate channel whose up_proj row is scaled up
DOWN_OUTLIER_FACTOR = 30.0  # the scale applied to that row


def build_tiny_model(arch: str, *, seed: int = 0, dtype=None, plant_outliers: bool = True):
    """A fresh tiny causal LM of ``arch`` ("llama" | "qwen2" | "gemma3"), seeded, in eval mode.

    dtype: torch dtype of the parameters (default torch.float32).
    plant_outliers: perturb norm gains (N(0, 0.1) around the neutral gain) and plant the
        outlier channels described in the module docstring.
    """
    import torch
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    common = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=TINY_HIDDEN,
        intermediate_size=TINY_INTERMEDIATE,
        num_hidden_layers=TINY_LAYERS,
        num_attention_heads=TINY_HEADS,
        num_key_value_heads=TINY_KV_HEADS,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif arch == "gemma3":
        cfg = Gemma3TextConfig(
            **common,
            head_dim=TINY_HEAD_DIM,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
        )
        model = Gemma3ForCausalLM(cfg)
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {TINY_ARCHS}")

    if plant_outliers:
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, module in model.named_modules():
                weight = getattr(module, "weight", None)
                if weight is None or not name.endswith("norm"):
                    continue
                neutral = 0.0 if arch == "gemma3" else 1.0  # Gemma scales by (1 + w)
                noise = 0.1 * torch.randn(weight.shape, generator=gen)
                weight.copy_(neutral + noise)
                if name.endswith(
                    ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm")
                ):
                    if not (arch == "gemma3" and name.endswith("post_attention_layernorm")):
                        weight[OUTLIER_CHANNEL] = OUTLIER_GAIN - (1.0 - neutral)
            for layer in model.model.layers:
                layer.mlp.up_proj.weight[DOWN_OUTLIER_CHANNEL] *= DOWN_OUTLIER_FACTOR
    model = model.to(dtype or torch.float32).eval()
    model.requires_grad_(False)
    return model


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


def linear_input_channel_max(model, input_ids) -> dict:
    """{nn.Linear name: (K,) max |x_j| of its input} over one forward: a minimal calibration for tests."""
    import torch
    from torch import nn

    out: dict = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):

            def hook(mod, args, name=name):
                x = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(0).float()
                out[name] = torch.maximum(out[name], x) if name in out else x

            hooks.append(module.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            model(input_ids)
    finally:
        for h in hooks:
            h.remove()
    return out


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
