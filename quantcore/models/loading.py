"""Loading a stored checkpoint with transformers: safetensors only, local files only, never remote code
(``trust_remote_code=False`` everywhere). Importing it never imports torch or transformers."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quantcore.errors import CheckpointError
from quantcore.models.validation import CAUSAL_LM_SUFFIXES, CONFIG_FILE, validate_folder
from quantcore.safeload import short

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch
    from transformers import PretrainedConfig

log = logging.getLogger(__name__)
def is_causal_lm(config: PretrainedConfig) -> bool:
    """Load with AutoModelForCausalLM when transformers has one for this type and the checkpoint is a decoder."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return False
    architectures = getattr(config, "architectures", None) or []
    return not architectures or any(arch.endswith(CAUSAL_LM_SUFFIXES) for arch in architectures)


def auto_class(config: PretrainedConfig) -> Any:
    from transformers import AutoModel, AutoModelForCausalLM

    return AutoModelForCausalLM if is_causal_lm(config) else AutoModel


def load_config(folder: Path) -> PretrainedConfig:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    except (ValueError, TypeError, KeyError, OSError) as exc:
        raise CheckpointError(f"transformers cannot read {CONFIG_FILE}: {exc}") from exc

# --- loading ------------------------------------------------------------------------------------


def _resolve_dtype(dtype: Any, device: str) -> Any:
    """None -> float32 on CPU (bf16 matmuls are slow there), the checkpoint's own dtype elsewhere."""
    import torch

    if dtype is None:
        return torch.float32 if str(device).startswith("cpu") else "auto"
    if isinstance(dtype, str) and dtype != "auto":
        resolved = getattr(torch, dtype, None)
        if not isinstance(resolved, torch.dtype):
            raise CheckpointError(f"unknown dtype {dtype!r}: use float32, bfloat16, float16 or auto")
        return resolved
    return dtype


def load_model(folder: Path, *, device: str = "cpu", dtype: torch.dtype | str | None = None,
               device_map: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """Load a stored checkpoint: (model in eval mode on device, tokenizer).

    AutoModelForCausalLM for decoders, AutoModel for encoders; safetensors only,
    local files only, never remote code.  dtype None means float32 on CPU and
    the checkpoint's own dtype on an accelerator.  CheckpointError when any weight the architecture needs is
    missing from the files, any tensor is unused or of another shape (:mod:`quantcore.models.weights`).
    ``device_map``: each module's device over several GPUs (:mod:`quantcore.models.placement`): every weight is
    loaded onto its own device, and ``device`` (the first) is where the inputs go.
    """
    from transformers import AutoTokenizer

    from quantcore.models.weights import refuse_incomplete

    folder = Path(folder)
    validate_folder(folder)
    config = load_config(folder)
    options = dict(local_files_only=True, trust_remote_code=False)
    try:
        placed = {"device_map": device_map} if device_map else {}
        model, info = auto_class(config).from_pretrained(folder, config=config, use_safetensors=True,
                                                          dtype=_resolve_dtype(dtype, device), output_loading_info=True,
                                                          ignore_mismatched_sizes=True, **placed, **options)
        tokenizer = AutoTokenizer.from_pretrained(folder, **options)
    except (ValueError, KeyError, TypeError, RuntimeError, OSError) as exc:
        raise CheckpointError(f"cannot load the checkpoint in {folder.name} ({type(exc).__name__}: "
                              f"{short(exc, 300)})") from exc
    refuse_incomplete(info)  # a weight missing (transformers would fill it at random), unused or of another shape
    from quantcore.models.moe import split_experts

    split_experts(model)
    return (model if device_map else model.to(device)).eval(), tokenizer
