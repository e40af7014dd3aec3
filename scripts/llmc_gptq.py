"""Run llm-compressor's own GPTQ (``quantize_weight``) on weights, Hessians and scales from a file.

Runs INSIDE .venv-llmc (see scripts/llmc_env.sh), never in quantplan's own environment:

    .venv-llmc/bin/python scripts/llmc_gptq.py IN.safetensors OUT.safetensors

IN holds, for each case NAME: ``NAME.weight`` (N, K), ``NAME.hessian`` (K, K), ``NAME.scale`` (the per-channel
(N, 1) or per-group (N, K / G) scales to keep), for an asymmetric case ``NAME.zp`` (its zero points, the same
shape) and ``NAME.args``, a 1-D int tensor (num_bits, group_size or 0, float: 0 for int weights, 1 for NVFP4,
symmetric: 1, or 0 for zero points). OUT holds ``NAME.weight``: the GPTQ-rounded weight, with llm-compressor's
defaults (block 128, dampening 0.01, activation order static); ``NAME.ct_scale``, ``NAME.ct_zp`` and
``NAME.ct_rtn``: the scales and zero points compressed-tensors computes from the weight's min and max (NVFP4: the
effective scales, block scale / global scale) and its round-to-nearest weight. tests/quantcore/algorithms/test_gptq.py
compares it with quantcore.algorithms.gptq.

NVFP4 (strategy tensor_group): GPTQ gets the effective scales in ``NAME.scale`` and a global scale of 1, so that
both sides round with the very same scales.
"""

from __future__ import annotations

import sys

import torch
from compressed_tensors.quantization import ActivationOrdering, QuantizationArgs, QuantizationStrategy
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight
from safetensors.torch import load_file, save_file


def main(src: str, dst: str) -> None:
    tensors = load_file(src)
    out = {}
    for key in sorted(k for k in tensors if k.endswith(".args")):
        name = key[: -len(".args")]
        bits, group, is_float, symmetric = (int(v) for v in tensors[key].tolist())
        if is_float:  # compressed-tensors' own NVFP4A16 weight args, activation order static
            args = preset_name_to_scheme("NVFP4A16", ["Linear"]).weights.model_copy(
                update={"actorder": ActivationOrdering.STATIC})
        else:
            args = QuantizationArgs(
                num_bits=bits, type="int", symmetric=bool(symmetric),
                strategy=QuantizationStrategy.GROUP if group else QuantizationStrategy.CHANNEL,
                group_size=group or None, actorder=ActivationOrdering.STATIC,
            )
        scale = tensors[f"{name}.scale"]
        zp = tensors[f"{name}.zp"].to(torch.int8) if not symmetric else torch.zeros_like(scale, dtype=torch.int8)
        q, _, fallback = quantize_weight(
            # clones: quantize_weight works in place in the buffers it is given
            weights=tensors[f"{name}.weight"].clone().unsqueeze(0),
            hessians=tensors[f"{name}.hessian"].clone().unsqueeze(0),
            scale=scale.unsqueeze(0), zero_point=zp.unsqueeze(0),
            global_scale=torch.ones(1, 1) if is_float else None, quant_args=args, blocksize=128, percdamp=0.01,
        )
        out[f"{name}.weight"] = q[0].contiguous()
        out[f"{name}.fallback"] = fallback.to(torch.int8)
        # round to nearest as compressed-tensors does it: min-max over each channel / group, its qparams
        w = tensors[f"{name}.weight"]
        view = w.reshape(w.shape[0], -1, group) if group else w.unsqueeze(1)
        gs = generate_gparam(w.min(), w.max()) if is_float else None
        ct_scale, ct_zp = calculate_qparams(view.amin(-1), view.amax(-1), args, global_scale=gs)
        out[f"{name}.ct_scale"] = (ct_scale.float() / gs if is_float else ct_scale).contiguous()
        out[f"{name}.ct_zp"] = ct_zp.reshape(ct_scale.shape).float().contiguous()
        out[f"{name}.ct_rtn"] = fake_quantize(w, ct_scale, ct_zp, args, global_scale=gs).contiguous()
    save_file(out, dst)


if __name__ == "__main__":
    main(*sys.argv[1:3])
