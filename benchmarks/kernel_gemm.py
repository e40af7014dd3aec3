"""Benchmark FP8 / INT8 GEMM kernels and the INT8 / INT4 weight-only ones on a model's linear shapes
(SmolLM2-135M by default).

Usage:
    python benchmarks/kernel_gemm.py                       # CPU, M = 1 16 128 2048
    python benchmarks/kernel_gemm.py --device cuda --m 1 16 128 2048 8192
    python benchmarks/kernel_gemm.py --budget 20 --json out.json
    python benchmarks/kernel_gemm.py --device cuda --model llama-3-8b --markdown table.md

Prints the device probe, which paths run natively, the table of every (M, N, K, path)
case (time, TFLOP/s, % of peak, speed-up over the baseline, kernel-vs-emulation error)
and the per-step GEMM time of the whole model under a few uniform plans. ``--model``
picks the shapes: the demo model (SmolLM2-135M) or a Llama-3-8B, whose larger GEMMs
are where FP8 / INT8 tensor cores pay off. ``--markdown`` writes the speed-up table
as it appears in the README.
On CPU the default per-shape budget keeps the whole run to a few minutes: cases that
would not fit are reported as skipped, not guessed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantcore.kernels.bench import run_benchmarks  # noqa: E402
from quantcore.kernels.device import device_paths, probe_device  # noqa: E402
from quantcore.kernels.estimate import step_estimate  # noqa: E402
from quantcore.kernels.paths import BASE_PATHS, PATHS, timed_path  # noqa: E402
from quantcore.kernels.records import DEFAULT_MS  # noqa: E402
from quantcore.kernels.report import format_markdown, format_records, unstable_summary  # noqa: E402
from quantcore.kernels.roofline import step_bound  # noqa: E402


@dataclass(frozen=True)
class ModelShapes:
    """The linear layers of a Llama-style decoder: q/k/v/o, gate/up/down, repeated per layer."""

    label: str
    hidden: int
    intermediate: int
    kv_width: int  # k_proj / v_proj output width = KV heads x head width
    n_layers: int

    def layer_shapes(self) -> dict[str, tuple[int, int]]:
        """projection -> (N, K)"""
        h, i, kv = self.hidden, self.intermediate, self.kv_width
        return {"q_proj": (h, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, h),
                "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}


MODELS: dict[str, ModelShapes] = {
    # HuggingFaceTB/SmolLM2-135M config.json: hidden 576, intermediate 1536, 9 query heads and
    # 3 KV heads of width 64 (k/v_proj: 576 -> 192), 30 decoder layers. The demo model.
    "smollm2-135m": ModelShapes("SmolLM2-135M", 576, 1536, 192, 30),
    # meta-llama/Llama-3.1-8B config.json: hidden 4096, intermediate 14336, 32 query heads and
    # 8 KV heads of width 128 (k/v_proj: 4096 -> 1024), 32 decoder layers.
    "llama-3-8b": ModelShapes("Llama-3-8B", 4096, 14336, 1024, 32),
}
# the preset each path serves, for its roofline bound (quantcore.kernels.roofline) on a GPU of the table
PATH_SCHEME = {"baseline": "BF16", "fp8_tensor": "FP8_PER_TENSOR", "fp8_row": "FP8_DYNAMIC", "int8_row": "INT8_W8A8",
               "w8_row": "W8A16", "w4_g128": "W4A16", "w4_g64": "W4A16_G64", "w4_g32": "W4A16_G32",
               "w4_ch": "W4A16_CHANNEL"}
DEFAULT_BUDGET_S = {"cpu": 40.0, "cuda": 60.0}  # CPU: 4 shapes x 40 s, about 3 minutes in all


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    ap.add_argument("--m", type=int, nargs="+", default=list(DEFAULT_MS), help="rows M (batch x tokens)")
    ap.add_argument("--budget", type=float, default=None, help="seconds per (N, K) shape")
    ap.add_argument("--repeats", type=int, default=None, help="timed calls per case (median)")
    ap.add_argument("--paths", nargs="+", default=None, choices=PATHS, help="paths to time")
    ap.add_argument("--json", type=Path, default=None, help="also write the records here")
    ap.add_argument("--model", default="smollm2-135m", choices=sorted(MODELS), help="whose shapes")
    ap.add_argument("--markdown", type=Path, default=None, help="also write the speed-up table (Markdown)")
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

    model = MODELS[args.model]
    layer_shapes = model.layer_shapes()
    shapes = list(dict.fromkeys(layer_shapes.values()))
    kind = "cuda" if info.kind == "cuda" else "cpu"
    budget = args.budget if args.budget is not None else DEFAULT_BUDGET_S[kind]
    print(f"\n{model.label} shapes (N, K): {shapes}; M: {args.m}; budget {budget:g} s per shape\n")

    t0 = time.perf_counter()

    def progress(frac: float, msg: str) -> None:
        print(f"\r[{frac:5.1%}] {msg:<40}", end="", file=sys.stderr, flush=True)

    records = run_benchmarks(
        shapes,
        args.m,
        device=info.device,
        paths=args.paths,
        budget_s_per_shape=budget,
        repeats=args.repeats,
        progress=progress,
    )
    print(file=sys.stderr)
    if shaky := unstable_summary(records):
        print(shaky)
    print(format_records(records))
    print(f"\nwall time: {time.perf_counter() - t0:.1f} s")

    # Per-step GEMM time of the whole model for uniform plans (every layer x 7 projections).
    all_layers = {f"layers.{i}.{p}": s for i in range(model.n_layers) for p, s in layer_shapes.items()}
    m_prefill, m_decode = max(args.m), min(args.m)
    print(f"\n{model.label} GEMM time per step (prefill M={m_prefill}, decode M={m_decode}):")
    for plan in BASE_PATHS:
        est = step_estimate(
            records,
            all_layers,
            {name: plan for name in all_layers},
            m_prefill=m_prefill,
            m_decode=m_decode,
        )

        cells = []
        for step, m in (("prefill", m_prefill), ("decode", m_decode)):
            if est[f"missing_{step}"]:
                shaky = len(est[f"unstable_{step}"])
                cells.append(f"{step} not measured ({len(est[f'missing_{step}'])} layers skipped"
                             + (f", {shaky} of them unstable" if shaky else "") + ")")
            else:
                sp = est[f"speedup_{step}"]
                cells.append(f"{step} {est[f'{step}_ms']:9.3f} ms (x{sp:.2f} vs baseline)")
                if info.target_key:  # a GPU of the table: the same step's roofline bound from its datasheet
                    ideal = step_bound({n: PATH_SCHEME[plan] for n in all_layers}, all_layers, info.target_key, m).ms
                    cells[-1] += f" [{est[f'{step}_ms'] / ideal:.1f}x the roofline {ideal:.3f} ms]"
        print(f"  {timed_path(plan):<13} " + "   ".join(cells))

    if args.markdown:
        args.markdown.write_text(f"{model.label} shapes, M = {', '.join(map(str, args.m))}; "
                                 + format_markdown(records) + "\n")
        print(f"\nMarkdown table written to {args.markdown}")
    if args.json:
        args.json.write_text(
            json.dumps({"device": info.to_dict(), "model": args.model, "records": [r.to_dict() for r in records]},
                       indent=1)
        )
        print(f"\nrecords written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
