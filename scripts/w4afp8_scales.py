"""How far vLLM's Hopper W4AFP8 kernel moves a checkpoint's INT4 group scales, which quantplan's emulation keeps.

A W4AFP8 checkpoint (compressed-tensors, llm-compressor's W4AFP8 recipe) stores each group of 128 weights along K
as INT4 codes −8..7 and one scale in the model's dtype (bf16): amax / 7.5, the grid quantplan scores
(``quantcore.formats.weights.fake_quantize_weight``; a slow test checks oneshot's checkpoint against it). vLLM serves
the layer with its CUTLASS W4A8 kernel, whose multiply runs in FP8, so on load it re-encodes the scales
(``convert_bf16_scales_to_fp8`` in vLLM's quant_utils): each output row's group scales are divided by a per-row
fp32 factor (the row's largest scale / 448, as dynamic per-token FP8 quantization takes it), rounded to E4M3,
divided by 8 and rounded to E4M3 again (an INT4 code of up to 8 times a scale must stay within E4M3's 448), and
the factor × 8 is applied after the GEMM. The weight the kernel multiplies is code × that E4M3 scale (the kernel
also rounds the product to E4M3 in its lookup table; not modelled here).

This script measures, on a checkpoint's own weights, what the re-encoding alone changes: the relative change of
the group scales, how many fall below E4M3's normal range, and the weight error it adds to INT4's own rounding
error. Torch and safetensors only; nothing is downloaded::

    .venv/bin/python scripts/w4afp8_scales.py CHECKPOINT_FOLDER [--group 128]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from safetensors import safe_open

E4M3_MAX = 448.0
E4M3_MIN_NORMAL = 2.0**-6


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round to FP8 E4M3 (nearest even, subnormals kept) and back to fp32, saturating at ±448 as vLLM clamps."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)


def group_scales(w: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """compressed-tensors' symmetric INT4 group scales [N, ceil(K / group)]: amax / 7.5, stored in ``dtype``."""
    n, k = w.shape
    pad = (-k) % group
    wp = torch.nn.functional.pad(w.abs(), (0, pad))
    amax = wp.view(n, -1, group).amax(dim=-1)
    return (amax / 7.5).clamp_min(torch.finfo(torch.float32).tiny).to(dtype).to(torch.float32)


def vllm_w4a8_scales(scales: torch.Tensor) -> torch.Tensor:
    """The effective group scales vLLM's CUTLASS W4A8 path multiplies by: per-row factor × E4M3(E4M3(s / f) / 8) × 8."""
    factor = scales.amax(dim=-1, keepdim=True) / E4M3_MAX
    fp8 = e4m3(e4m3(scales / factor) / 8.0)
    return fp8 * factor * 8.0


def dequant(w: torch.Tensor, scales: torch.Tensor, codes_from: torch.Tensor, group: int) -> torch.Tensor:
    """Codes rounded with ``codes_from`` (the checkpoint's scales), multiplied back by ``scales``."""
    n, k = w.shape
    s_from = codes_from.repeat_interleave(group, dim=-1)[:, :k]
    s = scales.repeat_interleave(group, dim=-1)[:, :k]
    codes = torch.clamp(torch.round(w / s_from), -8, 7)
    return codes * s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path, help="a Hugging Face checkpoint folder with .safetensors files")
    ap.add_argument("--group", type=int, default=128, help="INT4 group along K (W4AFP8: 128)")
    args = ap.parse_args(argv)
    files = sorted(args.folder.glob("*.safetensors"))
    if not files:
        print(f"no .safetensors files in {args.folder}", file=sys.stderr)
        return 2
    rel_changes, below_normal, total = [], 0, 0
    err_ckpt = err_vllm = ref = 0.0
    layers = 0
    for f in files:
        with safe_open(f, framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open has no iteration protocol
                if not name.endswith("_proj.weight"):
                    continue  # the linears of the decoder blocks (q/k/v/o, gate/up/down)
                t = st.get_tensor(name)
                if t.dim() != 2:
                    continue
                w = t.to(torch.float32)
                s = group_scales(w, args.group, t.dtype if t.dtype.is_floating_point else torch.bfloat16)
                sv = vllm_w4a8_scales(s)
                factor = s.amax(dim=-1, keepdim=True) / E4M3_MAX
                below_normal += int((s / factor / 8.0 < E4M3_MIN_NORMAL).sum())
                total += s.numel()
                rel_changes.append(((sv - s).abs() / s).flatten())
                wq = dequant(w, s, s, args.group)
                wv = dequant(w, sv, s, args.group)
                err_ckpt += float(((wq - w) ** 2).sum())
                err_vllm += float(((wv - w) ** 2).sum())
                ref += float((w**2).sum())
                layers += 1
    if not layers:
        print(f"no *_proj.weight tensors in {args.folder}", file=sys.stderr)
        return 2
    rel = torch.cat(rel_changes)
    q = torch.quantile(rel[:: max(1, rel.numel() // 1_000_000)], torch.tensor([0.5, 0.99]))
    print(f"{layers} linear weights, {total:,} INT4 groups of {args.group}")
    print(f"group scale change from vLLM's E4M3 re-encoding: median {q[0]:.2%}, p99 {q[1]:.2%}, max {rel.max():.2%}")
    print(f"groups whose re-encoded scale is an E4M3 subnormal (below 2^-6 after the /8): {below_normal / total:.2%}")
    print(f"relative weight error ||W_q - W|| / ||W||: checkpoint scales {(err_ckpt / ref) ** 0.5:.4f}, "
          f"vLLM's re-encoded scales {(err_vllm / ref) ** 0.5:.4f} ({(err_vllm / err_ckpt) ** 0.5:.3f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
