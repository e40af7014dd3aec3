"""The decoder blocks of a causal LM: where the ``nn.ModuleList`` of blocks sits, and which block a layer is in.

Llama, Mistral, Qwen2/Qwen3, Gemma, Gemma2 and Gemma3 (text) keep their blocks at ``model.model.layers``; the same
list sits under ``model.model.language_model.layers`` (multimodal wrappers), ``model.transformer.h`` (GPT-2 style) or
``model.gpt_neox.layers``. The sensitivity sweep replays blocks from this list; AWQ searches block by block.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from quantcore.errors import PlanError
from quantcore.models.architectures import LLAMA_STYLE

# candidate attribute paths of the decoder-block ModuleList, most common first
DECODER_BLOCK_PATHS = ("model.layers", "model.language_model.layers", "transformer.h", "gpt_neox.layers")


@dataclass
class DecoderStack:
    """The decoder blocks of a causal LM: ``blocks[i]`` is module ``f"{prefix}.{i}"``."""

    prefix: str
    blocks: nn.ModuleList

    def block_of(self, layer_name: str) -> int | None:
        """Index of the block that contains ``layer_name``, or ``None`` when it is outside every block."""
        head = self.prefix + "."
        if not layer_name.startswith(head):
            return None
        index = layer_name[len(head) :].split(".", 1)[0]
        return int(index) if index.isdigit() and int(index) < len(self.blocks) else None


def find_decoder_blocks(model: nn.Module) -> DecoderStack:
    """Locate the decoder-block ModuleList (the first non-empty one of :data:`DECODER_BLOCK_PATHS`); PlanError
    naming the places looked at when there is none."""
    for path in DECODER_BLOCK_PATHS:
        try:
            mod = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(mod, nn.ModuleList) and len(mod) > 0:
            return DecoderStack(prefix=path, blocks=mod)
    raise PlanError(
        f"cannot find the decoder blocks of {type(model).__name__}: looked for an nn.ModuleList at "
        f"{', '.join(DECODER_BLOCK_PATHS)}. Sensitivity supports Llama, Mistral, Qwen2/3 and Gemma/Gemma2/Gemma3 "
        "causal LMs; for another architecture score one-layer plans with quantcore.evaluation.scoring.score_plan "
        "instead"
    )


def attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    """``{name: module}`` of every attention module whose K and V come from ``k_proj`` / ``v_proj`` (the KV cache's
    layers)."""
    return {name: m for name, m in model.named_modules()
            if all(isinstance(getattr(m, s, None), nn.Module) for s in LLAMA_STYLE.kv_proj)}


__all__ = ["DECODER_BLOCK_PATHS", "DecoderStack", "attention_modules", "find_decoder_blocks"]
