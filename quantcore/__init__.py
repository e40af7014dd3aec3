"""quantcore: numerics and model analysis for quantplan.

Importing ``quantcore`` itself is cheap and never imports torch: the public
functions are resolved lazily (PEP 562), so torch-free modules such as
``quantcore.formats.catalog``, ``quantcore.schemes`` and ``quantcore.evaluation.stats`` can be used by the
Streamlit app, which must not import torch.
"""

from __future__ import annotations

import importlib

# public name -> module that defines it
_LAZY = {
    "list_formats": "quantcore.formats.catalog",
    "get_format": "quantcore.formats.catalog",
    "Format": "quantcore.formats.catalog",
    "list_schemes": "quantcore.schemes.presets",
    "get_scheme": "quantcore.schemes.presets",
    "Scheme": "quantcore.schemes.specs",
    "Rounding": "quantcore.schemes.specs",
    "PRESET_SCHEMES": "quantcore.schemes.presets",
    "TensorSpec": "quantcore.schemes.specs",
    "representable_values": "quantcore.formats.catalog",
    "Granularity": "quantcore.formats.granularity",
    "fusion_groups": "quantcore.schemes.fusion",
    "fusion_group_of": "quantcore.schemes.fusion",
    "fake_quantize": "quantcore.formats.quantize",
    "fake_quantize_with_report": "quantcore.formats.quantize",
    "quantize": "quantcore.formats.quantize",
    "dequantize": "quantcore.formats.quantize",
    "QuantizedTensor": "quantcore.formats.quantize",
    "QuantReport": "quantcore.formats.quantize",
    "compute_amax": "quantcore.formats.scales",
    "scale_from_amax": "quantcore.formats.scales",
    "delayed_scale": "quantcore.formats.scales",
    "AmaxHistory": "quantcore.formats.scales",
    "sqnr_db": "quantcore.formats.quantize",
    "fake_quantize_with_counts": "quantcore.formats.quantize",
    "fake_quantize_weight": "quantcore.formats.weights",
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
