"""Calibration statistics: checked against a plain numpy recomputation from captured layer inputs.

Tiny models are built in memory from configs (2 layers, hidden 64) with random
weights and a planted outlier channel.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from torch import nn

from quantcore.errors import Cancelled
from quantcore.evaluation.calibrate import (
    CPU_BLOCKING_ABOVE,
    Calibration,
    calibrate,
    fold_exponent_counts,
    reduce_input,
)
from quantcore.evaluation.stats import HIST_BINS, hist_edges

VOCAB, HIDDEN, INTERMEDIATE, LAYERS = 40, 64, 128, 2
OUTLIER_CHANNEL, OUTLIER_GAIN = 5, 80.0


def tiny_llama(seed: int = 0) -> nn.Module:
    """2-layer Llama with random weights; layer 0's attention input has channel 5 scaled ×80."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                         num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.model.layers[0].input_layernorm.weight[OUTLIER_CHANNEL] = OUTLIER_GAIN
    return model


@pytest.fixture(scope="module")
def model() -> nn.Module:
    return tiny_llama()


@pytest.fixture(scope="module")
def input_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (5, 12), generator=torch.Generator().manual_seed(1))


def capture_inputs(model: nn.Module, input_ids: torch.Tensor) -> dict[str, np.ndarray]:
    """Every linear's full input over the run, [tokens, K] float64, by a plain hook (the reference)."""
    seen: dict[str, list[np.ndarray]] = {}
    handles = [module.register_forward_pre_hook(
        lambda m, args, name=name: seen.setdefault(name, []).append(
            args[0].detach().reshape(-1, args[0].shape[-1]).double().numpy()))
        for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    try:
        with torch.no_grad():
            model(input_ids=input_ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return {name: np.concatenate(parts) for name, parts in seen.items()}


def reference_histogram(values: np.ndarray) -> tuple[np.ndarray, int]:
    """Counts of |x| on the stats grid by binary search over the float64 edges, and the zero count."""
    magnitudes = np.abs(values.ravel()).astype(np.float64)
    nonzero = magnitudes[magnitudes != 0]
    bins = np.clip(np.searchsorted(hist_edges(), nonzero, side="right") - 1, 0, HIST_BINS - 1)
    return np.bincount(bins, minlength=HIST_BINS), int(magnitudes.size - nonzero.size)


# --- against the reference -----------------------------------------------------------------------


def test_every_linear_matches_a_plain_recomputation(model, input_ids):
    stats = calibrate(model, input_ids, batch_size=2)
    inputs = capture_inputs(model, input_ids)
    assert set(stats) == set(inputs) and "lm_head" in stats
    assert len(stats) == LAYERS * 7 + 1
    for name, x in inputs.items():
        layer, magnitudes = stats[name], np.abs(x)
        module = model.get_submodule(name)
        assert (layer.in_features, layer.out_features) == (module.in_features, module.out_features)
        assert layer.n_tokens == input_ids.numel() == x.shape[0]
        np.testing.assert_array_equal(layer.channel_max, magnitudes.max(0).astype(np.float32))
        np.testing.assert_array_equal(layer.weight_channel_max,
                                      module.weight.detach().abs().amax(0).numpy())
        token_max = magnitudes.max(1).astype(np.float32).astype(np.float64)
        expected = {"p50": np.percentile(token_max, 50), "p90": np.percentile(token_max, 90),
                    "p99": np.percentile(token_max, 99), "max": token_max.max(), "mean": token_max.mean()}
        assert layer.token_max == pytest.approx(expected, rel=1e-12)
        hist, zeros = reference_histogram(x)
        np.testing.assert_array_equal(layer.hist_counts, hist, err_msg=name)
        assert layer.zeros == zeros and layer.hist_counts.sum() + layer.zeros == x.size
        assert layer.channel_max.dtype == np.float32 and layer.hist_counts.dtype == np.int64


def test_planted_outlier_channel_stands_out(model, input_ids):
    stats = calibrate(model, input_ids)
    for projection in ("q_proj", "k_proj", "v_proj"):
        layer = stats[f"model.layers.0.self_attn.{projection}"]
        assert int(np.argmax(layer.channel_max)) == OUTLIER_CHANNEL
        assert layer.outlier_ratio > 20
    assert stats["model.layers.1.self_attn.q_proj"].outlier_ratio < 20


def test_results_do_not_depend_on_the_batch_size(model, input_ids):
    one, all_at_once = calibrate(model, input_ids, batch_size=1), calibrate(model, input_ids, batch_size=64)
    for name, layer in one.items():
        other = all_at_once[name]
        np.testing.assert_array_equal(layer.channel_max, other.channel_max)
        np.testing.assert_array_equal(layer.hist_counts, other.hist_counts)
        assert layer.zeros == other.zeros and layer.n_tokens == other.n_tokens
        assert layer.token_max == pytest.approx(other.token_max, rel=1e-5)


def test_bfloat16_model_is_measured_on_its_own_values(input_ids):
    model = tiny_llama().to(torch.bfloat16)
    stats = calibrate(model, input_ids)
    inputs = capture_inputs(model, input_ids)
    for name, x in inputs.items():
        np.testing.assert_array_equal(stats[name].channel_max, np.abs(x).max(0).astype(np.float32))
        np.testing.assert_array_equal(stats[name].hist_counts, reference_histogram(x)[0])


# --- the histogram kernel --------------------------------------------------------------------------


def folded(values: np.ndarray) -> tuple[np.ndarray, int]:
    reduced = reduce_input(torch.from_numpy(values.astype(np.float32)).view(1, -1))
    zeros = int(reduced.zeros)
    return fold_exponent_counts(reduced.exponent_counts.numpy(), zeros), zeros


def test_histogram_edges_below_range_above_range_and_zeros():
    edges = hist_edges()
    values = np.array([0.0, -0.0, 2.0**-40, 1e-45, edges[0], edges[1] * 1.001, 1.0, -1.5, 2.0**16, 1e30, np.inf])
    hist, zeros = folded(values)
    assert zeros == 2
    expected = {0: 3, 1: 1, 96: 1, 98: 1, HIST_BINS - 1: 3}  # 1.0 = 2**0 starts bin 96; 1.5 -> 4*log2(1.5) = 2.34
    assert {int(i): int(c) for i, c in enumerate(hist) if c} == expected


def test_values_one_ulp_from_every_bin_edge_land_on_the_right_side():
    edges = hist_edges().astype(np.float32)  # float32 rounding of each edge, then one ulp either side
    values = np.concatenate([np.nextafter(edges, np.float32(0)), np.nextafter(edges, np.float32(np.inf))])
    magnitudes = values.astype(np.float32)[(values > hist_edges()[0]) & (values < hist_edges()[-1])]
    hist, _ = folded(magnitudes)
    np.testing.assert_array_equal(hist, reference_histogram(magnitudes)[0])


@settings(max_examples=60, deadline=None)
@given(arrays(np.float32, st.integers(1, 300),
              elements=st.floats(-(2.0**40), 2.0**40, width=32, allow_nan=False, allow_subnormal=True)))
def test_histogram_matches_binary_search_on_the_edges(values):
    hist, zeros = folded(values)
    expected, expected_zeros = reference_histogram(values)
    assert zeros == expected_zeros
    np.testing.assert_array_equal(hist, expected)


def test_large_inputs_reduced_in_cache_blocks_give_the_same_statistics():
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(3, 300, 4096, generator=generator) * torch.rand(4096, generator=generator) * 10
    x[1, 7, :100] = 0.0
    assert x.numel() > CPU_BLOCKING_ABOVE
    reduced = reduce_input(x)
    rows = x.reshape(-1, 4096).double().numpy()
    np.testing.assert_array_equal(reduced.channel_max.numpy(), np.abs(rows).max(0).astype(np.float32))
    np.testing.assert_array_equal(reduced.token_max.numpy(), np.abs(rows).max(1).astype(np.float32))
    hist, zeros = reference_histogram(rows)
    assert int(reduced.zeros) == zeros >= 100 and reduced.rows == 900
    np.testing.assert_array_equal(fold_exponent_counts(reduced.exponent_counts.numpy(), zeros), hist)


def test_shared_input_modified_in_place_is_measured_again():
    class InPlace(nn.Module):
        """Two linears read x, x is doubled in place, a third reads it: no stale reuse allowed."""

        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            x = input_ids.float().unsqueeze(-1).expand(-1, -1, 8).contiguous()
            y = self.a(x) + self.b(x)
            x.mul_(2)
            return y + self.c(input=x)  # keyword call: the hook must find the input there too

    stats = calibrate(InPlace(), torch.tensor([[1, 2, 3]]))
    assert stats["a"].amax == stats["b"].amax == 3.0
    assert stats["c"].amax == 6.0


# --- lifecycle -------------------------------------------------------------------------------------


def test_progress_reports_each_batch(model, input_ids):
    reports: list[tuple[float, str]] = []
    calibrate(model, input_ids, batch_size=2, progress=lambda f, msg: reports.append((f, msg)))
    assert [f for f, _ in reports] == pytest.approx([0.4, 0.8, 1.0])
    assert reports[-1][1] == "calibrated 5/5 sequences"


def test_cancel_stops_between_batches_and_removes_the_hooks(model, input_ids):
    model.train()
    answers = iter([False, False, True])
    with pytest.raises(Cancelled, match="after 4 of 5 sequences"):
        calibrate(model, input_ids, batch_size=2, should_cancel=lambda: next(answers))
    assert all(not m._forward_pre_hooks for m in model.modules())
    assert model.training, "the caller's train/eval mode is restored"
    model.eval()


def test_calibration_accumulates_runs_and_leaves_plain_forwards_alone(model, input_ids):
    calibration = Calibration(model)
    for start in (0, 2, 4):
        calibration.run(input_ids[start: start + 2])
        assert all(not m._forward_pre_hooks for m in model.modules()), "hooks only while run() executes"
        with torch.no_grad():
            model(input_ids=torch.zeros(1, 3, dtype=torch.long))  # not recorded
    streamed, at_once = calibration.results(), calibrate(model, input_ids)
    for name, layer in at_once.items():
        assert streamed[name].n_tokens == layer.n_tokens
        np.testing.assert_array_equal(streamed[name].channel_max, layer.channel_max)
        np.testing.assert_array_equal(streamed[name].hist_counts, layer.hist_counts)


def test_layers_never_called_report_zero_tokens():
    class Unused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.spare = nn.Linear(4, 3), nn.Linear(4, 2)

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.used(input_ids.float().unsqueeze(-1).expand(-1, -1, 4))

    stats = calibrate(Unused(), torch.tensor([[1, 2]]))
    assert stats["used"].n_tokens == 2 and stats["spare"].n_tokens == 0
    assert stats["spare"].hist_counts.sum() == 0 and stats["spare"].token_max["max"] == 0.0


@pytest.mark.parametrize("shape", [(0, 4), (4,), (1, 2, 3)])
def test_bad_input_shapes_are_refused(model, shape):
    with pytest.raises(ValueError, match="n_sequences, seq_len"):
        calibrate(model, torch.zeros(shape, dtype=torch.long))


def test_batch_size_must_be_positive(model, input_ids):
    with pytest.raises(ValueError, match="batch_size"):
        calibrate(model, input_ids, batch_size=0)
