"""KV cache formats: what attention reads back when the serving engine stores K and V in FP8.

A plan chooses a number format for every linear layer; the KV cache is the other big
low-precision decision of an LLM server (vLLM's ``--kv-cache-dtype``). It halves the
memory of every cached token against BF16, so twice the tokens fit next to the weights,
and it costs accuracy where K or V carry magnitudes the format or its scale cannot hold.

The formats (what vLLM stores, reference text ``fp8-fp4-smoothquant.txt``):

- ``AUTO``:          the model's own dtype (``--kv-cache-dtype auto``), nothing quantized.
- ``FP8``:           E4M3 with one static scale per layer for K and one for V, calibrated as
                     amax / 448 over the calibration text. llm-compressor writes them into the
                     checkpoint (recipe ``kv_cache_scheme``) and vLLM reads them
                     (``--kv-cache-dtype fp8``).
- ``FP8_UNSCALED``:  E4M3 with scale 1.0: what ``--kv-cache-dtype fp8`` does with a checkpoint
                     that carries no K/V scales. A K or V value beyond ±448 saturates.
- ``FP8_E5M2``:      E5M2 with scale 1.0 (``--kv-cache-dtype fp8_e5m2``): range to ±57344,
                     one mantissa bit fewer than E4M3.
- ``FP8_ATTN``:      FP8 attention: the ``FP8`` cache, and the attention itself computed in E4M3 as
                     vLLM's FlashAttention 3 backend (its default on Hopper) computes it with an FP8
                     cache: Q quantized per tensor at scale 1.0 (a checkpoint without ``q_scale``,
                     which is what llm-compressor's ``kv_cache_scheme`` writes, gets vLLM's 1.0) and
                     the softmax probabilities P rounded to E4M3 before the P·V product.
- ``FP8_ATTN_UNSCALED``: the same with K and V at scale 1.0 as well: what ``--kv-cache-dtype fp8``
                     runs on Hopper with a checkpoint that carries no scales (vLLM logs "Using
                     uncalibrated q_scale 1.0 ... with fp8 attention").
- ``FP8_ATTN_HEAD``: ``FP8_ATTN`` with one calibrated scale per KV head for K and for V (amax of the
                     head / 448; llm-compressor's ``kv_cache_scheme`` with ``strategy: attn_head``). vLLM
                     reads per-head scales only with its FlashAttention backend, whose FP8 path is
                     FlashAttention 3 on Hopper, which runs attention in FP8: so there is no cache-only
                     per-head format. A head whose K or V is small gets a grid of its own size.

The first three leave attention in the model's dtype: a backend that reads the cache back into
BF16 (vLLM's FlashInfer and Triton backends) computes that. FlashAttention 3 quantizes Q whenever
the cache is E4M3 (vLLM's ``flash_attn.py``: ``ops.scaled_fp8_quant(query, layer._q_scale)``), so a
plan served on Hopper is scored with an ``FP8_ATTN`` format.

FP8 attention, emulated (FlashAttention 3's ``softmax.h``): S = (Q·Kᵀ)·scale in FP32 from the
E4M3 Q and K; P = 2⁸·exp(S − rowmax) (its ``Max_offset`` of 8 puts P in [0, 256] so that E4M3's
range is used), the row sum taken in FP32 before rounding, P rounded to E4M3, O = (P·V) / rowsum.
FlashAttention subtracts the running maximum of the key blocks seen so far, this emulation the
maximum of the whole row; they differ only for rows whose maximum comes late, and only in how small
a probability must be to underflow.

Emulation. The cache holds K *after* the rotary embedding, so the K and V that transformers
hands its attention function are quantized there, once per layer and forward, before
grouped-query heads are repeated: exactly the tensors a serving engine writes into its
cache. :func:`kv_cache_quantized` registers a wrapper around the model's own attention
function (``sdpa`` or ``eager``) for the duration of a ``with`` block and restores the
model's setting afterwards; :func:`kv_amax_observed` records the per-layer amax the FP8
scales are calibrated from. A model whose attention does not go through transformers'
attention interface is refused with a clear error, never scored unquantized.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from quantcore.errors import PlanError, name_list
from quantcore.formats.catalog import get_format
from quantcore.models.architectures import LLAMA_STYLE

if TYPE_CHECKING:  # torch-free at import: the app reads the format registry and the memory figures
    import torch
    from torch import nn

AUTO = "AUTO"
GIB = 1024**3
# vLLM's default --gpu-memory-utilization: the share of device memory it may claim for weights,
# activations and the KV cache together
VLLM_GPU_MEMORY_UTILIZATION = 0.9
_WRAPPER_PREFIX = "quantplan_kv_"
_STATE_ATTR = "_quantplan_kv_state"
KV_PROJ_SUFFIXES = LLAMA_STYLE.kv_proj  # linears whose outputs are the cached K and V


@dataclass(frozen=True)
class KvCacheFormat:
    """One way to store the KV cache.

    name:        plan key value, e.g. ``"FP8"``
    element:     quantcore format of a stored element (``"fp8_e4m3"``), None for the model's dtype
    calibrated:  per-layer static K and V scales from calibration (False: scale 1.0)
    vllm_dtype:  the value of vLLM's ``--kv-cache-dtype``
    description: one line for people
    attention:   FP8 attention: Q quantized to E4M3 at scale 1.0 and P rounded to E4M3 as well
    per_head:    the calibrated K and V scales are one per KV head (llm-compressor's ``attn_head`` strategy)
                 instead of one per layer
    """

    name: str
    element: str | None
    calibrated: bool
    vllm_dtype: str
    description: str
    attention: bool = False
    per_head: bool = False

    @property
    def is_identity(self) -> bool:
        return self.element is None

    def bytes_per_element(self, model_bytes: float) -> float:
        """Bytes of one cached element; ``model_bytes`` for AUTO (the serving dtype, 2 for BF16)."""
        return model_bytes if self.element is None else get_format(self.element).bits / 8


KV_FORMATS: dict[str, KvCacheFormat] = {
    f.name: f
    for f in (
        KvCacheFormat(AUTO, None, False, "auto", "the model's dtype (BF16 when served in BF16): nothing quantized"),
        KvCacheFormat("FP8", "fp8_e4m3", True, "fp8",
                      "FP8 E4M3, one calibrated scale per layer for K and for V (llm-compressor kv_cache_scheme); "
                      "attention itself in BF16 (a backend that dequantizes the cache)"),
        KvCacheFormat("FP8_UNSCALED", "fp8_e4m3", False, "fp8",
                      "FP8 E4M3 with scale 1.0: vLLM --kv-cache-dtype fp8 on a checkpoint without K/V scales; "
                      "|K|, |V| > 448 saturate; attention itself in BF16"),
        KvCacheFormat("FP8_E5M2", "fp8_e5m2", False, "fp8_e5m2",
                      "FP8 E5M2 with scale 1.0 (vLLM --kv-cache-dtype fp8_e5m2): wide range, 2 mantissa bits"),
        KvCacheFormat("FP8_ATTN", "fp8_e4m3", True, "fp8",
                      "FP8 attention, as vLLM's FlashAttention 3 (Hopper) runs an FP8 cache: K and V with "
                      "calibrated per-layer scales, Q at scale 1.0 (no q_scale in the checkpoint), softmax "
                      "probabilities in E4M3",
                      attention=True),
        KvCacheFormat("FP8_ATTN_UNSCALED", "fp8_e4m3", False, "fp8",
                      "FP8 attention with Q, K and V at scale 1.0: vLLM --kv-cache-dtype fp8 on Hopper "
                      "(FlashAttention 3) with a checkpoint without scales; |Q|, |K|, |V| > 448 saturate",
                      attention=True),
        KvCacheFormat("FP8_ATTN_HEAD", "fp8_e4m3", True, "fp8",
                      "FP8_ATTN with one calibrated scale per KV head for K and for V (llm-compressor kv_cache_scheme "
                      "strategy attn_head), which vLLM reads only with its FlashAttention backend, whose FP8 path "
                      "is FlashAttention 3 on Hopper: a head with small K or V keeps its own range",
                      attention=True, per_head=True),
    )
}


def get_kv_format(name: str | KvCacheFormat | None) -> KvCacheFormat:
    """The format of that name (case-insensitive; None is AUTO); PlanError names the known ones."""
    if isinstance(name, KvCacheFormat):
        return name
    if name is None:
        return KV_FORMATS[AUTO]
    key = str(name).strip().upper()
    if key not in KV_FORMATS:
        raise PlanError(f"unknown KV cache format {name!r}; known: {', '.join(KV_FORMATS)}")
    return KV_FORMATS[key]


# vLLM's --kv-cache-dtype-skip-layers: these layers keep the model's dtype while the others use the chosen format;
# entries are decoder layer indices or a layer type
SKIP_SLIDING = "sliding_window"


def normalize_kv_skip(entries: Iterable[Any] | None) -> list[str]:
    """The skip entries of a plan as vLLM's flag takes them: ``"sliding_window"`` or a layer index, as strings,
    in order, once each. PlanError names an entry that is neither."""
    out: list[str] = []
    bad = []
    for e in entries or []:
        text = str(e).strip().lower()  # True, 1.5 and -1 read "true", "1.5", "-1": refused below
        if text.isascii() and text.isdigit():
            text = str(int(text))  # "03" is layer 3
        elif text != SKIP_SLIDING:
            bad.append(e)
            continue
        if text not in out:
            out.append(text)
    if bad:
        raise PlanError(f"KV cache layers to skip must be decoder layer indices or {SKIP_SLIDING!r} (vLLM's "
                        f"--kv-cache-dtype-skip-layers), got {', '.join(map(repr, bad))}")
    return out


def layer_index(name: str) -> int | None:
    """The decoder layer an attention module belongs to: the first all-digit part of its name (as vLLM's
    ``extract_layer_index`` reads it), None where there is none."""
    return next((int(p) for p in name.split(".") if p.isdigit()), None)


def kv_skip_layers(entries: Iterable[Any] | None, layers: Iterable[str],
                   windows: Mapping[str, int] | None = None) -> set[str]:
    """The attention modules (of ``layers``) whose cache stays in the model's dtype: those of the listed decoder
    layer indices, and with ``"sliding_window"`` every windowed one (``windows``, as intake records them).
    PlanError for an index the model does not have and for ``"sliding_window"`` on a model without windows:
    the plan would skip nothing there, which is not what its author meant."""
    layers = list(layers)
    by_index = {layer_index(n): n for n in layers}
    out: set[str] = set()
    for entry in normalize_kv_skip(entries):
        if entry == SKIP_SLIDING:
            windowed = [n for n in layers if n in (windows or {})]
            if not windowed:
                raise PlanError("KV cache skip 'sliding_window': this model has no sliding-window attention layer")
            out.update(windowed)
        elif int(entry) in by_index:
            out.add(by_index[int(entry)])
        else:
            known = sorted(i for i in by_index if i is not None)
            raise PlanError(f"KV cache skip {entry}: the model's attention layers are "
                            f"{known[0]}..{known[-1]}" if known else f"KV cache skip {entry}: no indexed layers")
    return out


# ---------------------------------------------------------------------- memory


def kv_elements_per_token(linears: Iterable[Mapping[str, Any]]) -> int | None:
    """Cached elements per token over all layers: the summed output widths of every k_proj and v_proj
    (``num_kv_heads × head_dim`` each, so grouped-query attention is counted right).

    ``linears``: ``[{name, out_features, ...}]`` as the model's intake summary lists them. None when
    the model has no separate k_proj / v_proj (a fused qkv projection): the split is not known then.
    """
    linears = list(linears)
    leaves = [str(lin["name"]).rsplit(".", 1)[-1] for lin in linears]
    if leaves.count("k_proj") == 0 or leaves.count("k_proj") != leaves.count("v_proj"):
        return None
    return sum(kv_layer_elements(linears).values())


def kv_bytes_per_token(linears: Iterable[Mapping[str, Any]], fmt: str | KvCacheFormat | None,
                       *, model_bytes: float = 2.0, skip: Collection[str] = ()) -> float | None:
    """Bytes the cache holds per token in that format (the per-layer scales are a few bytes in all and
    left out), the ``skip`` attention modules (:func:`kv_skip_layers`) in the model's dtype; None where
    :func:`kv_elements_per_token` is."""
    linears = list(linears)
    if kv_elements_per_token(linears) is None:
        return None
    width = get_kv_format(fmt).bytes_per_element(model_bytes)
    return sum(n * (model_bytes if layer in skip else width) for layer, n in kv_layer_elements(linears).items())


def kv_layer_elements(linears: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """``{attention module: k_proj + v_proj output width}``: what one layer caches per token (empty for a model
    without separate k_proj / v_proj)."""
    out: dict[str, int] = {}
    for lin in linears:
        prefix, _, leaf = str(lin["name"]).rpartition(".")
        if leaf in KV_PROJ_SUFFIXES:
            out[prefix] = out.get(prefix, 0) + int(lin["out_features"])
    return out


def kv_bytes_per_sequence(linears: Iterable[Mapping[str, Any]], fmt: str | KvCacheFormat | None, context: int,
                          *, windows: Mapping[str, int] | None = None, model_bytes: float = 2.0,
                          skip: Collection[str] = ()) -> float | None:
    """Bytes the cache holds for one sequence of ``context`` tokens: every layer keeps all of them, except a
    sliding-window layer (``windows``: ``{attention module: window}``), which keeps at most its window (as an
    engine that frees tokens outside a layer's window does; vLLM's hybrid KV cache manager does); the ``skip``
    attention modules in the model's dtype. None where :func:`kv_elements_per_token` is."""
    by_layer = kv_sequence_bytes_by_layer(linears, fmt, context, windows=windows, model_bytes=model_bytes, skip=skip)
    return None if by_layer is None else sum(by_layer.values())


def kv_sequence_bytes_by_layer(linears: Iterable[Mapping[str, Any]], fmt: str | KvCacheFormat | None, context: int,
                               *, windows: Mapping[str, int] | None = None, model_bytes: float = 2.0,
                               skip: Collection[str] = ()) -> dict[str, float] | None:
    """:func:`kv_bytes_per_sequence` per attention module: ``{layer: bytes}``."""
    linears = list(linears)
    if kv_elements_per_token(linears) is None:
        return None
    width = get_kv_format(fmt).bytes_per_element(model_bytes)
    windows = windows or {}
    return {layer: n * min(context, windows.get(layer, context)) * (model_bytes if layer in skip else width)
            for layer, n in kv_layer_elements(linears).items()}


def kv_token_capacity(memory_gb: float, weight_bytes: float, bytes_per_token: float,
                      *, utilization: float = VLLM_GPU_MEMORY_UTILIZATION) -> int:
    """Tokens of KV cache that fit on a device of ``memory_gb`` (10^9 bytes) once the weights are
    loaded, at vLLM's memory utilization; activations and the CUDA graph pool are not counted, so this
    is an upper bound. 0 when the weights alone do not fit."""
    free = memory_gb * 1e9 * utilization - weight_bytes
    if bytes_per_token <= 0:
        raise ValueError("bytes_per_token must be positive")
    return max(0, int(free // bytes_per_token))


def kv_clipping(kv_amax: Mapping[str, Mapping[str, float]] | None, fmt: str | KvCacheFormat | None) -> str | None:
    """A warning when a tensor the format stores at scale 1.0 exceeds what it holds on the calibration
    (``kv_amax`` as :meth:`KvAmax.to_dict` writes it): K and V of an unscaled cache, and Q under FP8 attention
    (vLLM has no calibrated Q scale: it runs Q at 1.0). Those values saturate when served. None when nothing
    exceeds it, nothing is stored at scale 1.0 (AUTO, FP8), or no maxima are known."""
    kv = get_kv_format(fmt)
    tensors = ([] if kv.is_identity or kv.calibrated else ["k", "v"]) + (["q"] if kv.attention else [])
    if not tensors or not kv_amax:
        return None
    assert kv.element is not None  # a quantized KV cache format names its element format
    limit = get_format(kv.element).max
    over = {t: sorted(layer for layer, a in (kv_amax.get(t) or {}).items() if a > limit) for t in tensors}
    layers_over = sorted({layer for names in over.values() for layer in names})
    if not layers_over:
        return None
    worst = max(a for t in tensors for a in (kv_amax.get(t) or {}).values())
    layers = len(set(kv_amax.get("k") or {}) | set(kv_amax.get("v") or {}))
    what = " or ".join(t.upper() for t in tensors if over[t])
    fix = ("choose FP8 or FP8_ATTN (calibrated per-layer K/V scales)" if over.get("k") or over.get("v") else
           "vLLM has no calibrated Q scale for FP8 attention; a backend that keeps attention in BF16 (formats "
           "FP8 / FP8_UNSCALED) does not clip Q")
    return (f"KV cache {kv.name}: {what} reach {worst:,.4g} in {len(layers_over)} of {layers} attention layer(s) "
            f"({name_list(layers_over)}) on the newest calibration, beyond the {limit:g} that {kv.element} holds "
            f"at scale 1.0: those values saturate when served; {fix}")


def kv_head_spread(kv_amax: Mapping[str, Mapping[str, Any]] | None) -> list[tuple[str, str, float]]:
    """``[(layer, "K" | "V", largest / smallest head maximum)]``, widest first, from a calibration's ``kv_amax``
    (:meth:`KvAmax.to_dict`): how much coarser one scale per layer makes the grid of a layer's smallest head than
    a scale of its own would (FP8_ATTN_HEAD). Empty when the heads were not recorded (or one head per layer)."""
    out = []
    for tensor, key in (("K", "k_head"), ("V", "v_head")):
        for layer, heads in ((kv_amax or {}).get(key) or {}).items():
            if len(heads) > 1 and min(heads) > 0:
                out.append((layer, tensor, max(heads) / min(heads)))
    return sorted(out, key=lambda row: -row[2])


# FlashAttention 3, which runs attention in FP8 with an E4M3 cache, is Hopper's (sm_90) backend in vLLM
FA3_SM = 90


def attention_backend_note(fmt: str | KvCacheFormat | None, sm: int, gpu: str) -> str | None:
    """Where the format's attention assumption and the target GPU part ways, one sentence for people: an E4M3
    cache scored with attention in BF16 on Hopper (whose FlashAttention 3 backend runs attention in FP8), or
    FP8 attention on a GPU FlashAttention 3 does not run on. None where they agree or nothing is cached in E4M3."""
    kv = get_kv_format(fmt)
    if kv.element != "fp8_e4m3":
        return None
    if not kv.attention and sm == FA3_SM:
        attn = "FP8_ATTN" + kv.name.removeprefix("FP8")
        return (f"On the {gpu}, vLLM's FlashAttention 3 backend runs attention itself in FP8 with this cache (Q at "
                f"scale 1.0, softmax probabilities in E4M3); {kv.name} assumes a backend that keeps attention in "
                f"BF16. Score {attn} to see what FlashAttention 3 costs.")
    if kv.per_head and sm != FA3_SM:
        return (f"{kv.name}'s per-head K/V scales are read only by vLLM's FlashAttention backend, whose FP8 path is "
                f"FlashAttention 3 on Hopper (sm90); on the {gpu} (sm{sm}) vLLM picks another attention backend, "
                "and its docs name no other that reads them: score FP8 (attention in BF16) for this GPU.")
    if kv.attention and sm != FA3_SM:
        cache = "FP8" + kv.name.removeprefix("FP8_ATTN")
        return (f"{kv.name} emulates FlashAttention 3, which runs on Hopper (sm90) only; on the {gpu} (sm{sm}) vLLM "
                f"picks another attention backend, and one that keeps attention in BF16 is scored by {cache}.")
    return None


# ---------------------------------------------------------------------- emulation


@dataclass
class KvAmax:
    """Per attention layer (module name) the largest |K| and |V| seen, and |Q| (post-rotary, as FP8 attention
    quantizes it): what calibrated scales come from."""

    k: dict[str, float] = field(default_factory=dict)
    v: dict[str, float] = field(default_factory=dict)
    q: dict[str, float] = field(default_factory=dict)
    k_head: dict[str, list[float]] = field(default_factory=dict)  # per KV head, as per-head scales need
    v_head: dict[str, list[float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {"k": dict(self.k), "v": dict(self.v), "q": dict(self.q),
                "k_head": {n: list(a) for n, a in self.k_head.items()},
                "v_head": {n: list(a) for n, a in self.v_head.items()}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Mapping[str, Any]]) -> KvAmax:
        """From :meth:`to_dict`'s form; a calibration stored before Q or the heads were recorded has none."""
        tables = {t: {str(a): float(b) for a, b in (data.get(t) or {}).items()} for t in ("k", "v", "q")}
        heads = {t: {str(a): [float(x) for x in b] for a, b in (data.get(t) or {}).items()}
                 for t in ("k_head", "v_head")}
        return cls(k=tables["k"], v=tables["v"], q=tables["q"], k_head=heads["k_head"], v_head=heads["v_head"])


@dataclass
class KvApplied:
    """What :func:`kv_cache_quantized` did: ``saturation`` ``{layer: share of K and V elements (and Q's, with
    FP8 attention) that clipped}`` (read it after the block's forwards) and the scales it used."""

    fmt: KvCacheFormat
    k_scale: dict[str, float | list[float]] = field(default_factory=dict)  # a list, one per KV head, when per_head
    v_scale: dict[str, float | list[float]] = field(default_factory=dict)
    q_scale: dict[str, float] = field(default_factory=dict)
    _counts: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    @property
    def saturation(self) -> dict[str, float]:
        out = {}
        for layer, (n, clipped) in self._counts.items():
            total = int(n.item())
            if total:
                out[layer] = int(clipped.item()) / total
        return out


@dataclass(frozen=True)
class _LayerState:
    """What the wrapper does in one attention module: ``tensors(q, k, v) -> (q, k, v)`` before attention, and
    ``attention``, when set, computes attention instead of the model's own function (FP8 attention)."""

    tensors: Callable[..., Any]
    attention: Callable[..., Any] | None = None


def _module_eager(module: nn.Module) -> Callable[..., Any]:
    fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if fn is None:
        raise PlanError(f"{type(module).__name__} has no eager attention function quantplan can wrap")
    return fn


def _wrapped_attention(base: str) -> Callable[..., Any]:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, **kwargs: Any) -> Any:
        state: _LayerState | None = getattr(module, _STATE_ATTR, None)
        fn = _module_eager(module) if base == "eager" else ALL_ATTENTION_FUNCTIONS[base]
        if state is not None:
            query, key, value = state.tensors(query, key, value)
            fn = state.attention or fn
        return fn(module, query, key, value, attention_mask, **kwargs)

    return attention


def _register(base: str, *, fp8_attention: bool = False) -> str:
    """Register the wrapper of ``base`` with transformers' attention and mask interfaces; its name. The FP8
    attention wrapper takes eager's masks (always an additive float tensor), which its own attention reads."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    name = _WRAPPER_PREFIX + ("fp8attn_" if fp8_attention else "") + base
    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, _wrapped_attention(base))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["eager" if fp8_attention else base])
    return name


@contextmanager
def _attention_wrapped(model: nn.Module, modules: Mapping[str, nn.Module], states: Mapping[str, _LayerState],
                       what: str) -> Iterator[Mapping[str, nn.Module]]:
    """Route the Q, K and V of every module of ``modules`` (:func:`quantcore.models.decoder.attention_modules` of
    ``model``) through ``states[name]`` for the block."""
    if not modules:
        raise PlanError(f"{what}: this model has no attention module with k_proj and v_proj; quantplan cannot "
                        "emulate a KV cache format for it")
    config: Any = model.config
    base = config._attn_implementation or "eager"
    if base.startswith(_WRAPPER_PREFIX):
        raise PlanError(f"{what}: a KV cache format is already applied to this model")
    if base not in ("sdpa", "eager"):
        raise PlanError(f"{what}: the model runs {base!r} attention; KV cache emulation wraps 'sdpa' or 'eager' "
                        "(load the model with one of them)")
    wrapper = _register(base, fp8_attention=any(st.attention is not None for st in states.values()))
    called: set[str] = set()  # attention modules whose Q, K and V went through the wrapper
    projected: set[str] = set()  # attention modules whose k_proj ran

    def tracking(name, st):
        def tensors(query, key, value):
            called.add(name)
            return st.tensors(query, key, value)
        return _LayerState(tensors, st.attention)

    hooks = [cast("nn.Module", m.k_proj).register_forward_hook(lambda *_, n=name: projected.add(n))
             for name, m in modules.items()]
    try:
        for name, m in modules.items():
            setattr(m, _STATE_ATTR, tracking(name, states[name]))
        config._attn_implementation = wrapper
        yield modules
        missed = sorted(projected - called)
        if missed:
            raise PlanError(f"{what}: the attention of {len(missed)} layer(s) ({name_list(missed)}) does not go "
                            "through transformers' attention interface, so quantplan cannot emulate a KV cache "
                            "format for it")
    finally:
        config._attn_implementation = base
        for h in hooks:
            h.remove()
        for m in modules.values():
            if hasattr(m, _STATE_ATTR):
                delattr(m, _STATE_ATTR)


# FlashAttention 3's FP8 softmax (hopper/softmax.h, Max_offset = 8): exp2(x - max + 8), so P lies in [0, 256]
FA3_FP8_PROB_OFFSET = 2.0**8
# score elements one chunk of query rows may hold (float32: 128 MiB), so a long context does not need the whole
# batch × heads × tokens × tokens matrix at once
FP8_ATTENTION_CHUNK_ELEMENTS = 1 << 25


def fp8_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                          *, round_probs: bool = True, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention as FlashAttention 3 computes it in FP8, from Q, K, V already rounded to E4M3 (and dequantized):
    S = Q·Kᵀ·scaling in FP32 (+ the additive mask), P = 2⁸·exp(S − rowmax), rowsum in FP32, P rounded to E4M3
    (``round_probs``; off only to test the rest against the model's own attention), O = P·V / rowsum.

    Same signature and output layout as transformers' ``eager_attention_forward`` ([batch, tokens, heads, dim]);
    grouped-query K/V heads are repeated here. Refuses what FlashAttention's FP8 path here does not model
    (logit soft-capping, attention sinks) rather than scoring something else.
    """
    import torch

    for unsupported in ("softcap", "s_aux", "sinks"):
        if kwargs.get(unsupported) is not None:
            raise PlanError(f"FP8 attention emulation: {type(module).__name__} passes {unsupported!r} to attention, "
                            "which quantplan's FP8 attention does not model; score this model with FP8 or "
                            "FP8_UNSCALED (attention in BF16)")
    if dropout and module.training:
        raise PlanError("FP8 attention emulation runs in eval mode only")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    groups = query.shape[1] // key.shape[1]
    k = key.float().repeat_interleave(groups, dim=1).transpose(2, 3)
    v = value.float().repeat_interleave(groups, dim=1)
    mask = None if attention_mask is None else attention_mask[..., : v.shape[-2]]
    batch, heads, rows, _ = query.shape
    # query rows a chunk: every row's softmax is its own, so chunks give the same result with bounded memory
    step = max(1, FP8_ATTENTION_CHUNK_ELEMENTS // (batch * heads * v.shape[-2]))
    out = torch.empty(batch, heads, rows, v.shape[-1], dtype=torch.float32, device=query.device)
    for r in range(0, rows, step):
        scores = torch.matmul(query[:, :, r:r + step].float(), k) * scaling
        if mask is not None:
            m = mask[..., r:r + step, :] if mask.shape[-2] == rows else mask
            scores = scores.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else scores + m.float()
        row_max = scores.amax(dim=-1, keepdim=True)
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        probs = torch.exp(scores - row_max) * FA3_FP8_PROB_OFFSET
        row_sum = probs.sum(dim=-1, keepdim=True)
        if round_probs:
            probs = probs.to(torch.float8_e4m3fn).float()
        out[:, :, r:r + step] = torch.matmul(probs, v) / torch.where(row_sum > 0, row_sum, torch.ones_like(row_sum))
    return out.transpose(1, 2).contiguous().to(query.dtype), None


@contextmanager
def kv_amax_observed(model: nn.Module) -> Iterator[KvAmax]:
    """Record per-layer max |K|, max |V| and max |Q| (post-rotary, as cached and as FP8 attention quantizes
    them) over every forward in the block.

    The yielded :class:`KvAmax` is filled when the block ends; reductions stay on the model's device
    until then (no host sync per forward).
    """
    import torch

    acc: dict[str, list[torch.Tensor | None]] = {}

    def observer(name):
        def tensors(query, key, value):
            slot = acc.setdefault(name, [None, None, None])
            # K and V ([batch, kv heads, tokens, head dim]) a max per head, Q one max
            for i, (x, dims) in enumerate(((key, (0, 2, 3)), (value, (0, 2, 3)), (query, None))):
                a = x.detach().abs().amax(dim=dims).float()
                slot[i] = a if slot[i] is None else torch.maximum(slot[i], a)
            return query, key, value
        return _LayerState(tensors)

    from quantcore.models.decoder import attention_modules

    result = KvAmax()
    modules = attention_modules(model)
    with _attention_wrapped(model, modules, {n: observer(n) for n in modules}, "KV calibration"):
        yield result
    for name, (k, v, q) in acc.items():
        assert k is not None and v is not None and q is not None  # every observed layer saw Q, K and V
        for table, heads, a in ((result.k, result.k_head, k), (result.v, result.v_head, v)):
            heads[name] = [float(x) for x in a.tolist()]
            table[name] = max(heads[name])  # the layer's maximum is its largest head's
        result.q[name] = float(q.item())


def _fake_quantize_cache(x: torch.Tensor, elem: Any, scale: float | list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """K or V ``[batch, kv heads, tokens, head dim]`` fake-quantized at one scale, or at one per head (a list):
    the heads become the rows of a per-channel quantization. (y, counts) as ``fake_quantize_with_counts``."""
    import torch

    from quantcore.formats.quantize import fake_quantize_with_counts

    if not isinstance(scale, list):
        return fake_quantize_with_counts(x, elem, "tensor", scale=scale)
    b, h, t, d = x.shape
    rows = x.transpose(0, 1).reshape(h, b * t * d)
    y, counts = fake_quantize_with_counts(rows, elem, "channel",
                                          scale=torch.tensor(scale, dtype=torch.float32, device=x.device).view(h, 1))
    return y.view(h, b, t, d).transpose(0, 1), counts


@contextmanager
def kv_cache_quantized(model: nn.Module, fmt: str | KvCacheFormat, *, amax: KvAmax | None = None,
                       skip: Collection[str] = ()) -> Iterator[KvApplied]:
    """Store K and V in ``fmt`` for every forward in the block: fake-quantize them per layer, per tensor (per KV
    head for ``FP8_ATTN_HEAD``); an FP8 attention format (``FP8_ATTN``, ``FP8_ATTN_UNSCALED``, ``FP8_ATTN_HEAD``)
    quantizes Q as well (scale 1.0) and computes attention with :func:`fp8_attention_forward`.

    ``amax``: per-layer K/V amax from :func:`kv_amax_observed`, needed by calibrated formats (FP8, FP8_ATTN; the
    per-head maxima for FP8_ATTN_HEAD).
    ``skip``: attention modules (:func:`kv_skip_layers`) that keep the model's dtype and attention, as vLLM's
    ``--kv-cache-dtype-skip-layers`` leaves them. AUTO yields without touching the model. The model's
    attention setting is restored on exit.
    """
    import torch

    from quantcore.formats.quantize import fake_quantize_with_counts
    from quantcore.formats.scales import scale_from_amax

    kv = get_kv_format(fmt)
    applied = KvApplied(fmt=kv)
    if kv.is_identity:
        yield applied
        return
    assert kv.element is not None  # a quantized KV cache format names its element format
    elem = get_format(kv.element)
    from quantcore.models.decoder import attention_modules

    everything = attention_modules(model)
    unknown = sorted(set(skip) - set(everything))
    if unknown:
        raise PlanError(f"KV cache skip: {name_list(unknown)} is not an attention module of this model")
    modules = {n: m for n, m in everything.items() if n not in skip}
    if kv.calibrated:
        # one maximum per layer, or a list of one per KV head; the scales take the same form
        k_max, v_max = ((amax.k_head, amax.v_head) if kv.per_head else (amax.k, amax.v)) if amax else ({}, {})
        missing = [n for n in modules if n not in k_max or n not in v_max]
        if missing:
            what = "per-head K/V maxima" if kv.per_head else "calibrated K/V amax"
            old = "; a calibration made before quantplan recorded them has none: calibrate again" if kv.per_head else ""
            raise PlanError(f"KV cache {kv.name} needs {what} for {len(missing)} attention layer(s) "
                            f"({name_list(missing)}){old}")
        applied.k_scale = {n: scale_from_amax(torch.tensor(k_max[n]), elem).tolist() for n in modules}
        applied.v_scale = {n: scale_from_amax(torch.tensor(v_max[n]), elem).tolist() for n in modules}
    else:
        applied.k_scale = dict.fromkeys(modules, 1.0)
        applied.v_scale = dict.fromkeys(modules, 1.0)
    if kv.attention:  # vLLM's FP8 attention runs Q at the checkpoint's q_scale, which quantplan's exports never carry
        applied.q_scale = dict.fromkeys(modules, 1.0)

    def quantizer(name):
        ks, vs, qs = applied.k_scale[name], applied.v_scale[name], applied.q_scale.get(name)

        def tensors(query, key, value):
            kq, kc = _fake_quantize_cache(key, elem, ks)
            vq, vc = _fake_quantize_cache(value, elem, vs)
            n, clipped = kc[0] + vc[0], kc[2] + vc[2]
            if qs is not None:
                query, qc = fake_quantize_with_counts(query, elem, "tensor", scale=qs)
                n, clipped = n + qc[0], clipped + qc[2]
            slot = applied._counts.get(name)
            applied._counts[name] = [n, clipped] if slot is None else [slot[0] + n, slot[1] + clipped]
            return query, kq, vq
        return _LayerState(tensors, fp8_attention_forward if kv.attention else None)

    untouched = _LayerState(lambda query, key, value: (query, key, value))
    states = {n: quantizer(n) if n in modules else untouched for n in everything}
    with _attention_wrapped(model, everything, states, f"KV cache {kv.name}"):
        yield applied
