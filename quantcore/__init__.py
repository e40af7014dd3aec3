"""quantcore: numerics and model analysis for quantplan.

Importing ``quantcore`` itself is cheap and never imports torch: the public
functions are resolved lazily (PEP 562), so torch-free modules such as
``quantcore.formats``, ``quantcore.schemes`` and ``quantcore.stats`` can be used by
the Streamlit app, which must not import torch.
"""

from __future__ import annotations

import importlib

# public name -> module that defines it
_LAZY = {
    "list_formats": "quantcore.formats",
    "get_format": "quantcore.formats",
    "Format": "quantcore.formats",
    "list_schemes": "quantcore.schemes",
    "get_scheme": "quantcore.schemes",
    "Scheme": "quantcore.schemes",
    "TensorSpec": "quantcore.schemes",
    "representable_values": "quantcore.formats",
    "Granularity": "quantcore.schemes",
    "fusion_groups": "quantcore.schemes",
    "fusion_group_of": "quantcore.schemes",
    "fake_quantize": "quantcore.quantize",
    "fake_quantize_with_report": "quantcore.quantize",
    "quantize": "quantcore.quantize",
    "dequantize": "quantcore.quantize",
    "QuantizedTensor": "quantcore.quantize",
    "QuantReport": "quantcore.quantize",
    "compute_amax": "quantcore.quantize",
    "scale_from_amax": "quantcore.quantize",
    "delayed_scale": "quantcore.quantize",
    "AmaxHistory": "quantcore.quantize",
    "sqnr_db": "quantcore.quantize",
    "fake_quantize_with_counts": "quantcore.quantize",
    "gptq_quantize": "quantcore.gptq",
    "collect_hessians": "quantcore.gptq",
    "smoothing_factors": "quantcore.smoothquant",
    "smooth_model": "quantcore.smoothquant",
    "SmoothingHandle": "quantcore.smoothquant",
    "apply_plan": "quantcore.apply",
    "quantized_model": "quantcore.apply",
    "AppliedPlan": "quantcore.apply",
    "LayerQuantStats": "quantcore.apply",
    "LayerStats": "quantcore.stats",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'quantcore' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
