"""quantcore: numerics and model analysis for quantplan.

Importing ``quantcore`` itself is cheap and never imports torch: the public
functions are resolved lazily (PEP 562), so torch-free modules such as
``quantcore.formats.catalog``, ``quantcore.schemes.specs`` and ``quantcore.evaluation.stats`` can be used by
the Streamlit app, which must not import torch.
"""

from __future__ import annotations

import importlib

# public name -> module that defines it
_LAZY = {
    "list_formats": "quantcore.formats.catalog",
    "get_format": "quantcore.formats.catalog",
    "Format": "quantcore.formats.catalog",
    "list_schemes": "quantcore.schemes.specs",
    "get_scheme": "quantcore.schemes.specs",
    "Scheme": "quantcore.schemes.specs",
    "TensorSpec": "quantcore.schemes.specs",
    "representable_values": "quantcore.formats.catalog",
    "Granularity": "quantcore.schemes.specs",
    "fusion_groups": "quantcore.schemes.specs",
    "fusion_group_of": "quantcore.schemes.specs",
    "fake_quantize": "quantcore.formats.quantize",
    "fake_quantize_with_report": "quantcore.formats.quantize",
    "quantize": "quantcore.formats.quantize",
    "dequantize": "quantcore.formats.quantize",
    "QuantizedTensor": "quantcore.formats.quantize",
    "QuantReport": "quantcore.formats.quantize",
    "compute_amax": "quantcore.formats.quantize",
    "scale_from_amax": "quantcore.formats.quantize",
    "delayed_scale": "quantcore.formats.quantize",
    "AmaxHistory": "quantcore.formats.quantize",
    "sqnr_db": "quantcore.formats.quantize",
    "fake_quantize_with_counts": "quantcore.formats.quantize",
    "gptq_quantize": "quantcore.algorithms.gptq",
    "collect_hessians": "quantcore.algorithms.gptq",
    "smoothing_factors": "quantcore.algorithms.smoothquant",
    "smooth_model": "quantcore.algorithms.smoothquant",
    "SmoothingHandle": "quantcore.algorithms.smoothquant",
    "apply_plan": "quantcore.algorithms.apply",
    "quantized_model": "quantcore.algorithms.apply",
    "AppliedPlan": "quantcore.algorithms.apply",
    "LayerQuantStats": "quantcore.algorithms.apply",
    "LayerStats": "quantcore.evaluation.stats",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'quantcore' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
