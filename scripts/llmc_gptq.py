"""Run llm-compressor's own GPTQ (``quantize_weight``) on weights, Hessians and scales from a file.

Runs INSIDE .venv-llmc (see scripts/llmc_env.sh), never in quantplan's own environment:

    .venv-llmc/bin/python scripts/llmc_gptq.py IN.safetensors OUT.safetensors

IN holds, for each case NAME: ``NAME.weight`` (N, K), ``NAME.hessian`` (K, K), ``NAME.scale`` (the per-channel
(N, 1) or per-group (N, K / G) scales to keep) and ``NAME.args``, a 1-D int tensor (num_bits, group_size or 0).
OUT holds ``NAME.weight``: the GPTQ-rounded weight, with llm-compressor's defaults (block 128, dampening
0.01, activation order static). tests/quantcore/test_gptq.py compares it with quantcore.gptq.
"""

from __future__ import annotations

import sys

import torch
from compressed_tensors.quantization import ActivationOrdering, QuantizationArgs, QuantizationStrategy
from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight
from safetensors.torch import load_file, save_file


def main(src: str, dst: str) -> None:
    tensors = load_file(src)
    out = {}
    for key in sorted(k for k in tensors if k.endswith(".args")):
        name = key[: -len(".args")]
        bits, group = (int(v) for v in tensors[key].tolist())
        args = QuantizationArgs(
            num_bits=bits, type="int", symmetric=True,
            strategy=QuantizationStrategy.GROUP if group else QuantizationStrategy.CHANNEL,
            group_size=group or None, actorder=ActivationOrdering.STATIC,
        )
        scale = tensors[f"{name}.scale"]
        q, _, fallback = quantize_weight(
            weights=tensors[f"{name}.weight"].unsqueeze(0), hessians=tensors[f"{name}.hessian"].unsqueeze(0),
            scale=scale.unsqueeze(0), zero_point=torch.zeros_like(scale, dtype=torch.int8).unsqueeze(0),
            global_scale=None, quant_args=args, blocksize=128, percdamp=0.01,
        )
        out[f"{name}.weight"] = q[0].contiguous()
        out[f"{name}.fallback"] = fallback.to(torch.int8)
    save_file(out, dst)


if __name__ == "__main__":
    main(*sys.argv[1:3])
