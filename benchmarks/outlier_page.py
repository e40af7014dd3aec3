"""Time building every chart of the Outliers page for a 30-layer model's calibration statistics.

The statistics are synthetic but shaped like SmolLM2-135M: 30 blocks x 7 linear
projections (q/k/v/o: K = 576; gate/up: K = 576; down: K = 1536) plus lm_head
(K = 576), per-channel maxima log-normal around 1 with a few 10x channels in every
input, and one planted ~3000x channel in ``model.layers.11.mlp.down_proj`` (the
reference text's down-projection outlier site).

Timed, each including Altair's ``to_dict()`` (what Streamlit serialises):
overview, channels of the worst layer, depth heatmap (down_proj), SmoothQuant
panels and alpha sweep, histogram with the E4M3 and INT8 grids, and the
"what will break" table over every layer x 4 formats.

    .venv/bin/python benchmarks/outlier_page.py [--repeat 5]

Prints seconds per part, the cold (first) total, the median warm total and the
target; exits 1 when the cold total misses the target.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.charts import outliers as outlier_charts  # noqa: E402
from quantcore.evaluation import outliers as ol  # noqa: E402
from quantcore.evaluation.stats import HIST_BINS, HIST_BINS_PER_OCTAVE, HIST_LOG2_MIN, LayerStats  # noqa: E402

TARGET_S = 2.0  # issue 6: every chart of the page in under 2 s
N_BLOCKS = 30  # SmolLM2-135M
HIDDEN = 576
MLP = 1536
VOCAB = 49152
N_TOKENS = 4096  # calibration tokens (for the record; the statistics do not scale with it)
PLANTED_LAYER = "model.layers.11.mlp.down_proj"
PLANTED_RATIO = 3000.0  # the planted channel's max over the median channel max
HIST_SAMPLES = 20_000  # values drawn per layer to fill the synthetic |x| histogram
PROJECTIONS = (
    ("self_attn.q_proj", HIDDEN, HIDDEN),
    ("self_attn.k_proj", HIDDEN, 192),
    ("self_attn.v_proj", HIDDEN, 192),
    ("self_attn.o_proj", HIDDEN, HIDDEN),
    ("mlp.gate_proj", HIDDEN, MLP),
    ("mlp.up_proj", HIDDEN, MLP),
    ("mlp.down_proj", MLP, HIDDEN),
)


def _layer(rng: np.random.Generator, name: str, k: int, n: int, ratio: float) -> LayerStats:
    cm = rng.lognormal(mean=0.0, sigma=0.35, size=k).astype(np.float32)
    n_hot = max(1, k // 200)
    hot = rng.choice(k, size=n_hot, replace=False)
    cm[hot] *= np.float32(ratio / 2)
    cm[hot[0]] = np.float32(ratio * np.median(cm))
    wm = rng.lognormal(mean=np.log(0.05), sigma=0.4, size=k).astype(np.float32)
    # |x| samples: each value is a channel's max times a half-normal fraction of it.
    ch = rng.integers(0, k, size=HIST_SAMPLES)
    x = cm[ch] * np.abs(rng.standard_normal(HIST_SAMPLES)).clip(max=3.0) / 3.0
    x = x[x > 0]
    idx = (
        np.floor((np.log2(x) - HIST_LOG2_MIN) * HIST_BINS_PER_OCTAVE).astype(np.int64).clip(0, HIST_BINS - 1)
    )
    hist = np.bincount(idx, minlength=HIST_BINS).astype(np.int64)
    amax = float(cm.max())
    token_max = {"p50": amax / 20, "p90": amax / 6, "p99": amax / 1.5, "max": amax, "mean": amax / 15}
    return LayerStats(
        name=name,
        in_features=k,
        out_features=n,
        n_tokens=N_TOKENS,
        channel_max=cm,
        weight_channel_max=wm,
        token_max=token_max,
        hist_counts=hist,
        zeros=0,
    )


def synthetic_stats(seed: int = 0) -> dict[str, LayerStats]:
    """SmolLM2-shaped statistics: 30 blocks x 7 projections + lm_head, one planted ~3000x channel."""
    rng = np.random.default_rng(seed)
    stats: dict[str, LayerStats] = {}
    for b in range(N_BLOCKS):
        for suffix, k, n in PROJECTIONS:
            name = f"model.layers.{b}.{suffix}"
            if name == PLANTED_LAYER:
                ratio = PLANTED_RATIO
            elif suffix == "mlp.down_proj":
                ratio = 60.0
            elif suffix == "self_attn.o_proj":
                ratio = 3.5
            else:
                ratio = 11.0
            stats[name] = _layer(rng, name, k, n, ratio)
    stats["lm_head"] = _layer(rng, "lm_head", HIDDEN, VOCAB, 11.0)
    return stats


def build_page(stats: dict[str, LayerStats]) -> dict[str, float]:
    """Build (and serialise) every chart of the Outliers page; seconds per part."""
    timings: dict[str, float] = {}

    def timed(label: str, fn: Callable[[], object]) -> object:
        t0 = time.perf_counter()
        out = fn()
        timings[label] = time.perf_counter() - t0
        return out

    def overview() -> object:
        df = outlier_charts.overview_frame(stats)
        outlier_charts.overview_chart(df).to_dict()
        return df

    overview_df = timed("overview", overview)
    worst = str(overview_df.loc[overview_df["outlier_ratio"].idxmax(), "layer"])
    stat = stats[worst]

    timed(
        "channels",
        lambda: outlier_charts.channels_chart(
            outlier_charts.channels_frame(stat), outlier_charts.thresholds_frame(stat.amax), title=worst
        ).to_dict(),
    )
    timed(
        "depth heatmap",
        lambda: outlier_charts.depth_heatmap(outlier_charts.depth_frame(stats, "down_proj"), "down_proj").to_dict(),
    )

    def smoothquant() -> None:
        view = ol.smoothquant_view(stat.channel_max, stat.weight_channel_max, 0.5)
        points, steps = outlier_charts.smoothquant_frame(view)
        outlier_charts.smoothquant_chart(points, steps, 0.5).to_dict()
        sweep = outlier_charts.pd.DataFrame(ol.alpha_sweep(stat.channel_max, stat.weight_channel_max))
        outlier_charts.alpha_sweep_chart(sweep, 0.5).to_dict()

    timed("smoothquant", smoothquant)

    def histograms() -> None:
        hist = outlier_charts.hist_frame(stat)
        lo, hi = float(hist["lo"].min()), float(hist["hi"].max())
        for fmt in ("fp8_e4m3", "int8"):
            grid = outlier_charts.grid_frame(ol.format_grid(fmt, stat.amax), lo, hi)
            outlier_charts.histogram_chart(hist, grid, fmt).to_dict()

    timed("histogram", histograms)
    timed("breakage table", lambda: outlier_charts.breakage_frame(stats))
    return timings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="warm repetitions after the cold run")
    args = parser.parse_args(argv)

    stats = synthetic_stats()
    n_layers = len(stats)
    ratio = stats[PLANTED_LAYER].outlier_ratio
    print(f"statistics: {n_layers} linear layers, planted {PLANTED_LAYER} ratio {ratio:,.0f}x")

    cold = build_page(stats)
    warm_totals = [sum(build_page(stats).values()) for _ in range(args.repeat)]
    cold_total = sum(cold.values())
    for label, seconds in cold.items():
        print(f"  {label:<16} {seconds:7.3f} s (cold)")
    warm = statistics.median(warm_totals) if warm_totals else float("nan")
    print(
        f"every chart of the Outliers page: cold {cold_total:.3f} s, warm median {warm:.3f} s "
        f"over {args.repeat} runs; target < {TARGET_S:.1f} s"
    )
    ok = cold_total < TARGET_S
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
