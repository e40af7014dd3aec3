"""The α suggestion of quantcore.evaluation.alpha against its ground truth on synthetic layers.

Each scenario draws an input X [T, K] and a weight W [N, K] with numpy, computes the statistics calibration would store
(channel maxima, weight column maxima, the per-token max summary, the |x| histogram) and, as ground truth, the real
relative output error ``||Q(X/s) Q(W s)^T - X W^T||² / ||X W^T||²`` of the smoothed layer under the scheme's
rounding (round half to even, symmetric INT8 as quantcore rounds it), for every α of the grid. The estimate sees only
the statistics.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from quantcore.evaluation import alpha as al
from quantcore.evaluation.outliers import smoothing_factors
from quantcore.evaluation.stats import LayerStats, hist_edges
from quantcore.schemes.presets import get_scheme

T, K, N = 512, 384, 448  # tokens, input channels, output rows: small, but wide enough for maxima to settle
OUTLIER = 5  # the planted channel
GROUND_TRUTH_SLACK = 1.5  # the suggestion's true error is within 1.5x the best α's (the estimate is coarse)


@dataclass
class Layer:
    x: np.ndarray
    w: np.ndarray
    stat: LayerStats


def _layer(x: np.ndarray, w: np.ndarray, name: str = "model.layers.0.mlp.down_proj") -> Layer:
    ax = np.abs(x)
    token_max = ax.max(axis=1)
    summary = {k: float(np.quantile(token_max, q)) for k, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))}
    hist = np.histogram(ax[ax > 0], bins=hist_edges())[0].astype(np.int64)
    stat = LayerStats(name=name, in_features=x.shape[1], out_features=w.shape[0], n_tokens=x.shape[0],
                      channel_max=ax.max(axis=0).astype(np.float32),
                      weight_channel_max=np.abs(w).max(axis=0).astype(np.float32),
                      token_max={**summary, "max": float(token_max.max()), "mean": float(token_max.mean())},
                      hist_counts=hist, zeros=int((x == 0).sum()))
    return Layer(x, w, stat)


def _scenario(kind: str, seed: int = 0) -> Layer:
    """A layer: ``plain`` (lognormal channel spreads), ``act_outlier`` (one input channel 100x, on every token),
    ``weight_outlier`` (one weight column 100x), ``heavy`` (Student-t activations with the planted outlier)."""
    rng = np.random.default_rng(seed)
    act_sd, w_sd = rng.lognormal(0.0, 0.3, K), rng.lognormal(-3.0, 0.3, K)
    if kind in ("act_outlier", "heavy"):
        act_sd[OUTLIER] *= 100.0
    if kind == "weight_outlier":
        w_sd[OUTLIER] *= 100.0
    noise = rng.standard_t(3, (T, K)) if kind == "heavy" else rng.standard_normal((T, K))
    return _layer(noise * act_sd, rng.standard_normal((N, K)) * w_sd)


def _round_rows(m: np.ndarray) -> np.ndarray:
    """Symmetric INT8 with one scale per row (a token of X, an output row of W)."""
    scale = np.abs(m).max(axis=1, keepdims=True) / 127.0
    scale[scale == 0] = 1.0
    return np.clip(np.round(m / scale), -127, 127) * scale


def _round_tensor(m: np.ndarray) -> np.ndarray:
    scale = float(np.abs(m).max()) / 127.0 or 1.0
    return np.clip(np.round(m / scale), -127, 127) * scale


def true_errors(layer: Layer, scheme: str) -> np.ndarray:
    """The real relative output error for every α of the grid (INT8 per-channel weights)."""
    act_round = {"INT8_W8A8": _round_rows, "INT8_PER_TENSOR": _round_tensor}[scheme]
    y = layer.x @ layer.w.T
    out = []
    for alpha in al.ALPHA_GRID:
        s = smoothing_factors(layer.stat.channel_max, layer.stat.weight_channel_max, alpha)
        yq = act_round(layer.x / s) @ _round_rows(layer.w * s).T
        out.append(float(((yq - y) ** 2).sum() / (y**2).sum()))
    return np.asarray(out)


@pytest.mark.parametrize("scheme", ["INT8_W8A8", "INT8_PER_TENSOR"])
@pytest.mark.parametrize("kind", ["plain", "act_outlier", "weight_outlier", "heavy"])
def test_the_suggested_alpha_is_near_the_true_best(kind: str, scheme: str) -> None:
    layer = _scenario(kind)
    truth = true_errors(layer, scheme)
    suggested = al.suggest_alpha(layer.stat, scheme)
    at = truth[list(al.ALPHA_GRID).index(suggested)]
    assert at <= GROUND_TRUTH_SLACK * truth.min(), (
        f"{kind}/{scheme}: suggested {suggested} costs {at / truth.min():.2f}x the best "
        f"(true best α {al.ALPHA_GRID[int(np.argmin(truth))]})")
    # and the estimated curve ranks α as the truth does, far from the optimum at least: α = 0 and 1 are worse
    est = al.alpha_error_sweep(layer.stat, scheme)["error"]
    assert est[0] > est.min() and est[-1] > est.min()


def test_a_planted_activation_outlier_makes_low_alpha_costly() -> None:
    """With one input channel 100x the others, leaving the outlier in the activations (α = 0) costs many times the
    suggestion under per-token INT8: the estimate sees what the truth sees."""
    plain, outlier = _scenario("plain"), _scenario("act_outlier")
    for layer in (plain, outlier):
        sweep = al.alpha_error_sweep(layer.stat, "INT8_W8A8")
        layer.ratio = float(sweep["error"][0] / sweep["error"].min())  # type: ignore[attr-defined]
    assert outlier.ratio > 10 * plain.ratio  # type: ignore[attr-defined]
    truth = true_errors(outlier, "INT8_W8A8")
    assert truth[0] > 10 * truth.min()


def test_a_weight_outlier_moves_the_suggestion_down_under_per_tensor_activations() -> None:
    """Per-tensor activations favour a high α (the static scale is the tensor's max); a weight column 100x the
    others makes a high α multiply it further, and the suggestion comes down, as the truth's best does."""
    plain, heavy_weight = _scenario("plain"), _scenario("weight_outlier")
    assert al.suggest_alpha(heavy_weight.stat, "INT8_PER_TENSOR") < al.suggest_alpha(plain.stat, "INT8_PER_TENSOR")
    truth_plain, truth_weight = (true_errors(x, "INT8_PER_TENSOR") for x in (plain, heavy_weight))
    assert np.argmin(truth_weight) < np.argmin(truth_plain)


def test_identical_channels_give_a_flat_curve_and_the_default_alpha() -> None:
    """Channels all alike: smoothing only rescales the layer, the estimate cannot tell α apart (exactly flat), and the
    tie goes to the usual 0.5; no α is warned about."""
    flat = LayerStats(name="m.layers.0.mlp.up_proj", in_features=64, out_features=64, n_tokens=100,
                      channel_max=np.full(64, 2.0, np.float32), weight_channel_max=np.full(64, 0.1, np.float32),
                      token_max={"p50": 2.0, "p90": 2.0, "p99": 2.0, "max": 2.0, "mean": 2.0})
    sweep = al.alpha_error_sweep(flat, "INT8_W8A8")
    np.testing.assert_allclose(sweep["error"], sweep["error"][0], rtol=1e-9)
    assert al.suggested_alpha(sweep) == 0.5
    assert all(al.alpha_warning(sweep, a) is None for a in al.ALPHA_GRID)


def test_a_fusion_group_suggestion_is_the_argmin_of_the_summed_error() -> None:
    """q/k/v share one input and one s (from the group's weight maxima): the group's suggestion minimises the sum of
    the members' errors, computed with that shared s, not any member's own optimum."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((T, K)) * rng.lognormal(0.0, 0.3, K)
    x[:, OUTLIER] *= 60.0
    members = []
    for leaf, spread in (("q_proj", 0.2), ("k_proj", 1.0), ("v_proj", 0.4)):
        w = rng.standard_normal((N // 4, K)) * rng.lognormal(-3.0, spread, K)
        members.append(_layer(x, w, f"model.layers.0.self_attn.{leaf}").stat)
    sweep = al.alpha_error_sweep(members, "INT8_W8A8")
    summed = np.zeros(len(al.ALPHA_GRID))
    for i, alpha in enumerate(al.ALPHA_GRID):
        s = al.group_factors(members, alpha)
        summed[i] = sum(al.layer_estimate(m, s, al.PlannedScheme.of("INT8_W8A8")).error for m in members)
    np.testing.assert_allclose(sweep["error"], summed, rtol=1e-12)
    assert al.suggest_alpha(members, "INT8_W8A8") == al.suggested_alpha({"alpha": np.asarray(al.ALPHA_GRID),
                                                                          "error": summed})
    # the group's s is not a member's own: the k member alone (its own weight maxima) would be another curve
    alone = al.alpha_error_sweep(members[1], "INT8_W8A8")["error"]
    assert not np.allclose(alone, sweep["error"])


def test_the_warning_rule() -> None:
    """Over 2x the suggestion's error, or a quarter of one side's channels flushed (more than at the suggestion)."""
    sweep = {"alpha": np.array([0.0, 0.5, 1.0]), "error": np.array([1.0, 0.4, 0.7]),
             "act_flushed": np.array([0.6, 0.0, 0.0]), "weight_flushed": np.array([0.0, 0.0, 0.3])}
    assert al.suggested_alpha(sweep) == 0.5
    assert al.alpha_warning(sweep, 0.5) is None
    low = al.alpha_warning(sweep, 0.0)
    assert low is not None and "2.5×" in low and "60% of the activation channels" in low
    high = al.alpha_warning(sweep, 1.0)  # 1.75x: not the error rule, but 30 % of the weight columns flushed
    assert high is not None and "error" not in high and "30% of the weight columns" in high
    assert al.alpha_warning(sweep, 0.52) is None  # read at the nearest α of the sweep


def test_the_planned_scheme_is_read_from_the_scheme_to_be_saved() -> None:
    w8a8, per_tensor = al.PlannedScheme.of("INT8_W8A8"), al.PlannedScheme.of(get_scheme("INT8_PER_TENSOR"))
    assert (w8a8.activations.granularity, w8a8.weights.granularity) == ("token", "channel")
    assert per_tensor.activations.granularity == "tensor"
    nvfp4 = al.PlannedScheme.of("NVFP4")  # a block format: its own blocks of 16 along K on both operands
    assert (nvfp4.activations.granularity, nvfp4.activations.group) == ("group", 16)
    with pytest.raises(ValueError, match="does not quantize both"):
        al.PlannedScheme.of("W4A16")
    # the two INT8 schemes differ where they should: per-tensor activations suffer more from an outlier at α = 0
    layer = _scenario("act_outlier")
    assert (al.alpha_error_sweep(layer.stat, "INT8_PER_TENSOR")["error"][0]
            > al.alpha_error_sweep(layer.stat, "INT8_W8A8")["error"][0])


def test_fp8_block_and_group_schemes_run() -> None:
    """Every smoothable preset gives a finite sweep (FP8's relative rounding: a nearly flat curve)."""
    layer = _scenario("act_outlier")
    for name in (*al.SMOOTHABLE_PRESETS, "FP8_BLOCK", "NVFP4", "MXFP8"):
        sweep = al.alpha_error_sweep(layer.stat, name)
        assert np.isfinite(sweep["error"]).all() and (sweep["error"] > 0).all(), name
        assert 0.0 <= al.suggested_alpha(sweep) <= 1.0
