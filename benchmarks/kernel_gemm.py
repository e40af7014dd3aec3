"""Benchmark FP8 / INT8 GEMM kernels on SmolLM2-135M-like linear shapes.

Usage:
    python benchmarks/kernel_gemm.py                       # CPU, M = 1 16 128 2048
    python benchmarks/kernel_gemm.py --device cuda --m 1 16 128 2048 8192
    python benchmarks/kernel_gemm.py --budget 20 --json out.json

Prints the device probe, which paths run natively, the table of every (M, N, K, path)
case (time, TFLOP/s, % of peak, speed-up over the baseline, kernel-vs-emulation error)
and the per-step GEMM time of a 30-layer SmolLM2-135M under a few uniform plans.
On CPU the default per-shape budget keeps the whole run to a few minutes: cases that
would not fit are reported as skipped, not guessed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantcore import kernels as kn  # noqa: E402
from quantcore.hardware import device_paths, probe_device  # noqa: E402

# SmolLM2-135M (HuggingFaceTB/SmolLM2-135M config.json): hidden 576, intermediate 1536,
# 9 query heads and 3 KV heads of width 64 (k/v_proj: 576 -> 192), 30 decoder layers.
HIDDEN, INTERMEDIATE, KV_WIDTH, N_LAYERS = 576, 1536, 192, 30
LAYER_SHAPES: dict[str, tuple[int, int]] = {  # projection -> (N, K)
    "q_proj": (HIDDEN, HIDDEN),
    "k_proj": (KV_WIDTH, HIDDEN),
    "v_proj": (KV_WIDTH, HIDDEN),
    "o_proj": (HIDDEN, HIDDEN),
    "gate_proj": (INTERMEDIATE, HIDDEN),
    "up_proj": (INTERMEDIATE, HIDDEN),
    "down_proj": (HIDDEN, INTERMEDIATE),
}
DEFAULT_BUDGET_S = {"cpu": 40.0, "cuda": 60.0}  # CPU: 4 shapes x 40 s, about 3 minutes in all


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    ap.add_argument("--m", type=int, nargs="+", default=list(kn.DEFAULT_MS), help="rows M (batch x tokens)")
    ap.add_argument("--budget", type=float, default=None, help="seconds per (N, K) shape")
    ap.add_argument("--repeats", type=int, default=None, help="timed calls per case (median)")
    ap.add_argument("--paths", nargs="+", default=None, choices=kn.PATHS, help="paths to time")
    ap.add_argument("--json", type=Path, default=None, help="also write the records here")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's)")
    args = ap.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    info = probe_device(args.device)
    print(f"device      : {info.name} [{info.device_class}]")
    print(f"torch / cuda: {info.torch_version} / {info.cuda_version}")
    if info.memory_bytes:
        print(f"memory      : {info.memory_bytes / 1e9:.1f} GB")
    if info.peak_tflops:
        peaks = ", ".join(f"{k} {v:g}" for k, v in info.peak_tflops.items())
        print(f"dense peaks : {peaks} TFLOP/s (target {info.target_key})")
    else:
        print("dense peaks : not in the table - measured figures only (no % of peak)")
    print("paths:")
    for p in device_paths(info).values():
        print(
            f"  {p.path:<11} runs={'yes' if p.runs else 'no ':<3} native={'yes' if p.native else 'no ':<3} {p.note}"
        )

    shapes = list(dict.fromkeys(LAYER_SHAPES.values()))
    kind = "cuda" if info.kind == "cuda" else "cpu"
    budget = args.budget if args.budget is not None else DEFAULT_BUDGET_S[kind]
    print(f"\nshapes (N, K): {shapes}; M: {args.m}; budget {budget:g} s per shape\n")

    t0 = time.perf_counter()

    def progress(frac: float, msg: str) -> None:
        print(f"\r[{frac:5.1%}] {msg:<40}", end="", file=sys.stderr, flush=True)

    records = kn.run_benchmarks(
        shapes,
        args.m,
        device=info.device,
        paths=args.paths,
        budget_s_per_shape=budget,
        repeats=args.repeats,
        progress=progress,
    )
    print(file=sys.stderr)
    print(kn.format_records(records))
    print(f"\nwall time: {time.perf_counter() - t0:.1f} s")

    # Per-step GEMM time of the whole model for uniform plans (30 layers x 7 projections).
    layer_shapes = {f"layers.{i}.{p}": s for i in range(N_LAYERS) for p, s in LAYER_SHAPES.items()}
    m_prefill, m_decode = max(args.m), min(args.m)
    print(f"\nSmolLM2-135M GEMM time per step (prefill M={m_prefill}, decode M={m_decode}):")
    for plan in ("baseline", "fp8_tensor", "fp8_row", "int8_row"):
        est = kn.step_estimate(
            records,
            layer_shapes,
            {name: plan for name in layer_shapes},
            m_prefill=m_prefill,
            m_decode=m_decode,
        )

        cells = []
        for step in ("prefill", "decode"):
            if est[f"missing_{step}"]:
                cells.append(f"{step} not measured ({len(est[f'missing_{step}'])} layers skipped)")
            else:
                sp = est[f"speedup_{step}"]
                cells.append(f"{step} {est[f'{step}_ms']:9.3f} ms (x{sp:.2f} vs baseline)")
        label = plan if plan == "baseline" else plan + kn.QUANT_ACT_SUFFIX
        print(f"  {label:<13} " + "   ".join(cells))

    if args.json:
        args.json.write_text(
            json.dumps({"device": info.to_dict(), "records": [r.to_dict() for r in records]}, indent=1)
        )
        print(f"\nrecords written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
