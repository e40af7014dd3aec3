"""What a checkpoint holds: its linears, parameter count, attention windows, MoE layout (:class:`CheckpointSummary`,
:func:`inspect_folder`). Importing it never imports torch or transformers; :func:`inspect_folder` does when called."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quantcore.errors import CheckpointError
from quantcore.models.loading import auto_class, is_causal_lm, load_config
from quantcore.models.validation import (
    HIDDEN_SIZE_KEYS,
    LAYER_COUNT_KEYS,
    SAFETENSORS_DTYPE_NAMES,
    SafetensorsTensor,
    check_model_type,
    validate_with_tensors,
)

if TYPE_CHECKING:  # pragma: no cover - typing only
    from transformers import PretrainedConfig, PreTrainedModel

log = logging.getLogger(__name__)
MAX_LINEARS = 100_000  # Kimi K2 / DeepSeek-V3, experts split: ~47,000-71,000; ~90 bytes each in the summary
# --- summary ------------------------------------------------------------------------------------


@dataclass
class LinearInfo:
    """One ``nn.Linear`` of a model: its module name and GEMM shape (K = in, N = out)."""

    name: str
    in_features: int
    out_features: int


@dataclass
class CheckpointSummary:
    """What the store records about a registered checkpoint."""

    architecture: str
    model_type: str
    num_layers: int
    num_params: int
    dtype: str
    hidden_size: int | None
    vocab_size: int | None
    linears: list[LinearInfo] = field(default_factory=list)
    total_bytes: int = 0
    causal_lm: bool | None = None  # has a next-token head (scoring needs one); None: summarised before this was kept
    # {attention module: window} of the layers that attend to a sliding window of tokens (Gemma 2/3, Mistral
    # v0.1): their KV cache holds at most that many tokens; the other layers hold the whole context
    attention_windows: dict[str, int] = field(default_factory=dict)
    # nn.Linear layers whose weight is an input embedding's (lm_head when tie_word_embeddings: SmolLM2, Gemma,
    # Qwen2.5-0.5B); None: summarised before this was kept
    tied_linears: list[str] | None = None
    # a mixture-of-experts model's routed experts, split into one linear per expert and projection
    # (quantcore.models.moe): {"experts": E per block, "top_k": experts per token, "blocks": [module names]};
    # None: dense
    moe: dict[str, Any] | None = None
    # fused experts modules of a layout quantcore.models.moe cannot split (gpt-oss): their weights are in no plan
    unsplit_experts: list[str] = field(default_factory=list)
    # {"heads", "kv_heads", "head_dim"} of the attention (quantcore.models.parallel.AttentionHeads), which decide how
    # q/k/v split under tensor parallelism; None: the config does not say, or summarised before this was kept
    attention_heads: dict[str, int] | None = None
    # the longest sequence the model reads, in tokens (its config's max_position_embeddings): a job's sequence
    # length is refused above it before any job (jobs.specs.context_problem); None: not said, or summarised before
    max_position_embeddings: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict (linears as a list of dicts)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CheckpointSummary:
        """Inverse of :meth:`to_dict`; keys this version does not know are ignored."""
        known = {name: data[name] for name in cls.__dataclass_fields__ if name in data}
        known["linears"] = [item if isinstance(item, LinearInfo) else LinearInfo(**item)
                            for item in known.get("linears", [])]
        return cls(**known)


# --- transformers-side inspection --------------------------------------------------------------


def _text_config(config: PretrainedConfig) -> PretrainedConfig:
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def _first_attr(config: PretrainedConfig, keys: tuple[str, ...]) -> int | None:
    for key in keys:
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return None


def _meta_model(folder: Path, config: PretrainedConfig) -> PreTrainedModel:
    """The model of ``folder`` on the meta device, its weights' names and shapes checked against the safetensors
    headers (:func:`quantcore.models.weights.meta_model_checked`: none missing, none unused, no weight read), an
    MoE model's experts then split into linears, as :func:`load_model` splits them."""
    from quantcore.models.moe import split_experts
    from quantcore.models.weights import meta_model_checked

    model = meta_model_checked(folder, config, auto_class(config))
    try:
        split_experts(model)
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError) as exc:
        raise CheckpointError(f"cannot split the experts of this {config.model_type} model "
                              f"({type(exc).__name__}: {exc}); check the configuration values") from exc
    return model


def linear_infos(model: PreTrainedModel) -> list[LinearInfo]:
    """Every ``nn.Linear`` of a model (its experts split, :mod:`quantcore.models.moe`), in module order."""
    from torch import nn

    return [LinearInfo(name, module.in_features, module.out_features)
            for name, module in model.named_modules() if isinstance(module, nn.Linear)]


def _weights_dtype(tensors: dict[str, SafetensorsTensor], config: dict[str, Any]) -> str:
    """The floating dtype holding most weight bytes (e.g. 'bfloat16'); config's dtype when there is none."""
    by_dtype: dict[str, int] = {}
    for tensor in tensors.values():
        if tensor.dtype in SAFETENSORS_DTYPE_NAMES:
            by_dtype[tensor.dtype] = by_dtype.get(tensor.dtype, 0) + tensor.end - tensor.begin
    if by_dtype:
        return SAFETENSORS_DTYPE_NAMES[max(by_dtype, key=by_dtype.__getitem__)]
    return str(config.get("dtype") or config.get("torch_dtype") or "unknown")


def inspect_folder(folder: Path) -> CheckpointSummary:
    """Validate a checkpoint folder and summarise it (imports transformers and torch).

    Runs :func:`validate_folder` (plausible sizes included), refuses model types transformers does not ship,
    builds the model on the meta device from its config and the safetensors headers (no weight read, no remote
    code), refusing a checkpoint where any weight the architecture needs is missing, any tensor is unused or of
    another shape (:mod:`quantcore.models.weights`); then lists every nn.Linear and counts parameters (tied
    weights once).
    """
    folder = Path(folder)
    raw_config, tensors = validate_with_tensors(folder)
    check_model_type(raw_config["model_type"])
    config = load_config(folder)
    from quantcore.models.moe import moe_summary, unsplit_experts
    from quantcore.models.parallel import attention_heads

    model = _meta_model(folder, config)
    linears = linear_infos(model)
    if len(linears) > MAX_LINEARS:  # the stored summary keeps one entry a linear: it stays a few MB at most
        raise CheckpointError(f"this {config.model_type} model has {len(linears):,} linear layers, more than the "
                              f"{MAX_LINEARS:,} any model has: refusing an implausible configuration")
    text_config = _text_config(config)
    architectures = getattr(config, "architectures", None) or [type(model).__name__]
    return CheckpointSummary(
        architecture=architectures[0],
        model_type=config.model_type,
        num_layers=_first_attr(text_config, LAYER_COUNT_KEYS) or 0,
        num_params=sum(p.numel() for p in model.parameters()),
        dtype=_weights_dtype(tensors, raw_config),
        hidden_size=_first_attr(text_config, HIDDEN_SIZE_KEYS),
        vocab_size=_first_attr(text_config, ("vocab_size",)),
        linears=linears,
        total_bytes=sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()),
        causal_lm=is_causal_lm(config),
        attention_windows=attention_windows(model),
        tied_linears=_tied_linears(model),
        moe=moe_summary(model, config),
        unsplit_experts=unsplit_experts(model),
        attention_heads=heads.to_dict() if (heads := attention_heads(config)) else None,
        max_position_embeddings=_first_attr(text_config, ("max_position_embeddings",)),
    )


def _tied_linears(model: PreTrainedModel) -> list[str]:
    """Names of the nn.Linear layers that share their weight with an nn.Embedding (transformers ties them when
    ``tie_word_embeddings``, on the meta model too)."""
    from torch import nn

    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and id(m.weight) in embedded]


def attention_windows(model: PreTrainedModel) -> dict[str, int]:
    """{attention module: sliding window} of the windowed attention layers: a module's own ``sliding_window``
    where it keeps one (Gemma 3 and Qwen2 set it on their sliding layers only), else the config's for every
    layer (Mistral). A window no shorter than the longest context is no window."""
    from quantcore.models.decoder import attention_modules

    config = _text_config(model.config)
    longest = getattr(config, "max_position_embeddings", None)
    out: dict[str, int] = {}
    for name, module in attention_modules(model).items():
        window = module.sliding_window if hasattr(module, "sliding_window") else getattr(config, "sliding_window",
                                                                                            None)
        if isinstance(window, int) and window > 0 and not (isinstance(longest, int) and window >= longest):
            out[name] = window
    return out
