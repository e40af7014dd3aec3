"""The SmoothQuant mappings an llm-compressor recipe can carry (torch-free).

The recipes quantcore writes smooth Llama-style blocks (:data:`quantcore.models.architectures.LLAMA_STYLE`'s names):
q/k/v_proj into input_layernorm, gate/up_proj into the norm before the MLP, down_proj into up_proj. A plan that smooths
anything else (o_proj, lm_head) cannot be exported with its smoothing; planning and the pages ask here which layers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from quantcore.errors import name_list
from quantcore.models.architectures import LLAMA_STYLE
from quantcore.schemes.fusion import expert_block
from quantcore.schemes.presets import get_scheme
from quantcore.schemes.specs import Scheme


def smoothquant_layers(plan: Mapping[str, Scheme], layer_names: Sequence[str]) -> dict[float, list[str]]:
    """{alpha: layers smoothed with it}, in order of first appearance. A routed expert's gate/up is never
    smoothed (quantcore.algorithms.smoothquant folds nothing into them: the norm before them also feeds the router), so
    no mapping may name them, or llm-compressor would smooth what was scored unsmoothed; its down_proj is (into its
    own up_proj)."""
    out: dict[float, list[str]] = {}
    for layer in layer_names:
        a = plan[layer].smoothquant_alpha
        if a is not None and (expert_block(layer) is None or layer.endswith(f".{LLAMA_STYLE.down_proj}")):
            out.setdefault(float(a), []).append(layer)
    return out


def smoothquant_unmapped(layer: str) -> bool:
    """Whether the Llama-style SmoothQuant mappings of the recipes quantcore writes cannot smooth ``layer``: they
    smooth q/k/v_proj (into input_layernorm), gate/up_proj (into the MLP input norm) and down_proj (into up_proj),
    not o_proj (llm-compressor divides v_proj's rows by one scale per o_proj input channel, which breaks with
    grouped-query attention; quantplan ties the scales across each KV head group instead), nor lm_head."""
    return LLAMA_STYLE.smoothquant_kinds.get(layer.rsplit(".", 1)[-1]) is None or len(layer.split(".")) < 3


def smoothquant_unexportable(plan: Mapping[str, Scheme | str]) -> list[str]:
    """The layers of ``plan`` (every layer, {layer: scheme}) whose SmoothQuant an llm-compressor recipe cannot carry
    (:func:`smoothquant_unmapped`), in plan order: a recipe of the plan is refused, and no served checkpoint holds
    the smoothing that was scored. A routed expert's gate/up counts for nothing (quantcore smooths none)."""
    resolved = {n: get_scheme(s) if isinstance(s, str) else s for n, s in plan.items()}
    return [n for layers in smoothquant_layers(resolved, list(resolved)).values() for n in layers
            if smoothquant_unmapped(n)]


def smoothquant_unexportable_message(layers: Sequence[str]) -> str:
    """One sentence for :func:`smoothquant_unexportable`'s layers (the export's refusal, the Plans page's warning)."""
    why = (" (llm-compressor's SmoothQuantModifier divides v_proj rows by one scale per o_proj input channel, which "
           "breaks with grouped-query attention; quantplan ties the scales across each kv head group instead)"
           if any(n.endswith("o_proj") for n in layers) else "")
    return (f"SmoothQuant on {len(layers)} layer(s) the Llama-style mappings cannot smooth ({name_list(layers)}): "
            f"they smooth q/k/v_proj (into input_layernorm), gate/up_proj (into the MLP input norm) and down_proj "
            f"(into up_proj) only{why}; give those layers a scheme without SmoothQuant (e.g. INT8_W8A8 for "
            "INT8_W8A8_SQ) or pass smoothquant_mappings")



__all__ = [
    "smoothquant_layers",
    "smoothquant_unexportable",
    "smoothquant_unexportable_message",
    "smoothquant_unmapped",
]
