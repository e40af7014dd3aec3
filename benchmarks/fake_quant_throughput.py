"""Throughput of quantcore.fake_quantize for every format and granularity.

Usage:
    python benchmarks/fake_quant_throughput.py                      # CPU, 4096 x 4096 fp32
    python benchmarks/fake_quant_throughput.py --device cuda --dtype bfloat16
    python benchmarks/fake_quant_throughput.py --size 1024 --repeats 5 --json out.json

For each (format, granularity) it times ``fake_quantize`` on one size x size tensor of
N(0, 1) values (with a few planted outliers) and prints elements per second and the
ratio to the floor: a plain ``x.to(torch.float8_e4m3fn).to(x.dtype)`` round trip on the
same tensor in the same run (two casts, no amax, no scale: the least any FP8 fake
quantization has to do). A ratio of 0.25 means four times slower than the floor.
The report variant (``fake_quantize_with_report``, with saturation / underflow counts)
is timed too for the FP8 per-tensor case. Nothing is asserted: speed is printed.

Note (SEEN-HERE.md): on CPU, fake quantization that produces many tiny values can hit a
denormal slow path; pass --flush-denormal to see the difference
(torch.set_flush_denormal(True) changes results for subnormal values, so the library
itself does not set it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from quantcore.formats.catalog import get_format, list_formats  # noqa: E402
from quantcore.formats.quantize import fake_quantize, fake_quantize_with_report  # noqa: E402

DEFAULT_SIZE = 4096  # the 4096 x 4096 tensor (16.8 M elements)
GROUP_SIZE = 128  # per-group along K, as W4A16 / FP8_BLOCK activations
BLOCK = (128, 128)  # DeepSeek-V3 weight tiles
OUTLIERS = 16  # planted outlier elements of magnitude OUTLIER_SCALE, as LLM activations have
OUTLIER_SCALE = 1000.0
GRANULARITIES: list[tuple[str, dict]] = [
    ("tensor", {}),
    ("channel", {}),
    ("token", {}),
    ("group", {"group_size": GROUP_SIZE}),
    ("block", {"block": BLOCK}),
]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn, device: torch.device, repeats: int, warmup: int = 1) -> float:
    """Median wall seconds of ``fn()`` over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def make_input(size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(size, size, generator=gen)
    idx = torch.randint(0, x.numel(), (OUTLIERS,), generator=gen)
    x.view(-1)[idx] *= OUTLIER_SCALE
    return x.to(device=device, dtype=dtype)


def run(size: int, dtype: torch.dtype, device: torch.device, repeats: int) -> list[dict]:
    x = make_input(size, dtype, device)
    n = x.numel()
    floor_s = time_fn(lambda: x.to(torch.float8_e4m3fn).to(x.dtype), device, repeats)
    rows = [
        {
            "format": "floor: x.to(float8_e4m3fn).to(x.dtype)",
            "granularity": "-",
            "seconds": floor_s,
            "elements_per_s": n / floor_s,
            "ratio_to_floor": 1.0,
        }
    ]
    for fmt in list_formats():
        grans = [("group", {})] if get_format(fmt).is_block else GRANULARITIES
        for gran, kw in grans:
            label = f"group {get_format(fmt).block_size}" if get_format(fmt).is_block else gran
            s = time_fn(lambda fmt=fmt, gran=gran, kw=kw: fake_quantize(x, fmt, gran, **kw), device, repeats)
            rows.append(
                {
                    "format": fmt,
                    "granularity": label,
                    "seconds": s,
                    "elements_per_s": n / s,
                    "ratio_to_floor": floor_s / s,
                }
            )
    s = time_fn(lambda: fake_quantize_with_report(x, "fp8_e4m3"), device, repeats)
    rows.append(
        {
            "format": "fp8_e4m3 + report",
            "granularity": "tensor",
            "seconds": s,
            "elements_per_s": n / s,
            "ratio_to_floor": floor_s / s,
        }
    )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=DEFAULT_SIZE, help="square tensor side (default 4096)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per case (median reported)")
    parser.add_argument(
        "--flush-denormal", action="store_true", help="torch.set_flush_denormal(True) first (CPU)"
    )
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    if args.size < 1 or args.repeats < 1:
        parser.error("--size and --repeats must be positive")
    if args.flush_denormal:
        torch.set_flush_denormal(True)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    print(
        f"fake_quantize throughput: {args.size}x{args.size} {args.dtype} on {device} "
        f"(torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.repeats})"
    )
    rows = run(args.size, dtype, device, args.repeats)
    print(f"{'format':<42} {'granularity':<12} {'ms':>9} {'Melem/s':>10} {'x floor':>8}")
    for r in rows:
        print(
            f"{r['format']:<42} {r['granularity']:<12} {r['seconds'] * 1e3:>9.1f} "
            f"{r['elements_per_s'] / 1e6:>10.1f} {r['ratio_to_floor']:>8.3f}"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "size": args.size,
                    "dtype": args.dtype,
                    "device": str(device),
                    "torch": torch.__version__,
                    "rows": rows,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
