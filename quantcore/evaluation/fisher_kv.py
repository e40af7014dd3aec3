"""KV cache formats in the Fisher estimate: one unit per attention layer, as the exact KV sweep
(:func:`quantcore.evaluation.sensitivity.kv_sensitivity_sweep`) has them.

A KV cache format changes an attention layer's output (its context, the input of ``o_proj``): K and V are stored in
the format (an FP8 attention format rounds Q as well and computes the attention in FP8). The reference forward of
:func:`quantcore.evaluation.fisher.fisher_sensitivity` records each layer's Q, K, V, mask and context; inside the hook
on the gradient g of ``o_proj``'s input, the context is recomputed from the same Q, K, V stored in each format
(:func:`quantcore.evaluation.kvcache.kv_cache_quantized`'s own quantizers and attention), and
``½ Σ_positions (g · δcontext)²`` is added up per sequence exactly as for a linear unit. While recording, attention
runs transformers' eager function (what the FP8 attention emulation's masks are made for); its output is the
model's own to float rounding, and the reference check of every batch still holds it to the reference cache.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
from torch import Tensor, nn

from quantcore.errors import PlanError, name_list
from quantcore.evaluation.sensitivity import SensitivityRow
from quantcore.evaluation.statistics import block_mean

KV_PREFIX = "KV "  # a KV format's key in the estimate's result: "KV FP8_ATTN", as the exact KV sweep is stored


@dataclass
class KvUnits:
    """The attention layers swept and, per KV format, each layer's quantizer (``_LayerState``: Q, K, V in the
    format, and the FP8 attention where the format computes one)."""

    formats: list[str]
    names: list[str]
    modules: dict[str, nn.Module]
    states: list[dict[str, Any]]  # [format] -> {layer: quantizer}
    per_seq: list[list[list[float]]] = field(default_factory=list)  # [layer][format] -> per-sequence sums

    def __post_init__(self) -> None:
        self.per_seq = [[[] for _ in self.formats] for _ in self.names]


def prepare_kv(model: nn.Module, kv_caches: Sequence[str], amax: Any, layers: Sequence[str] | None) -> KvUnits | None:
    """The KV units of ``kv_caches`` (format names; calibrated ones need ``amax``, a
    :class:`quantcore.evaluation.kvcache.KvAmax`), over ``layers`` (attention modules; None: all); None if none."""
    if not kv_caches:
        return None
    from quantcore.evaluation import kvcache
    from quantcore.models.decoder import attention_modules

    every = attention_modules(model)
    if not every:
        raise PlanError("this model has no attention module with k_proj and v_proj: no KV cache to estimate")
    unknown = sorted(set(layers or ()) - set(every))
    if unknown:
        raise PlanError(f"attention module(s) the model does not have: {name_list(unknown)}")
    names = list(every) if layers is None else [n for n in every if n in set(layers)]
    no_o = [n for n in names if not isinstance(getattr(every[n], "o_proj", None), nn.Module)]
    if no_o:
        raise PlanError(f"the Fisher estimate of a KV cache reads the gradient at o_proj's input, and "
                        f"{name_list(no_o)} has no o_proj: sweep the KV cache with --method kl")
    formats, states = [], []
    for name in kv_caches:
        kv = kvcache.get_kv_format(name)
        if kv.is_identity:
            raise PlanError("a KV cache estimate needs a quantized format (FP8, FP8_ATTN, ...); AUTO changes nothing")
        if kv.name in formats:
            raise PlanError(f"KV cache format {kv.name} is named twice")
        with kvcache.kv_cache_quantized(model, kv, amax=amax):  # its quantizers, kept past the block
            states.append({n: getattr(every[n], kvcache._STATE_ATTR) for n in names})
        formats.append(kv.name)
    return KvUnits(formats, names, {n: every[n] for n in names}, states)


@contextlib.contextmanager
def kv_recorded(model: nn.Module, units: KvUnits | None, passes: int, current: list[int],
                names: Sequence[str] | None = None) -> Iterator[None]:
    """For one batch's forward and ``passes`` backward passes (``current[0]``: the pass running): record every swept
    layer's attention inputs and context, and add its per-format products to ``units.per_seq`` at the last pass.

    ``names``: only these swept layers (None: all of ``units.names``), every other attention layer running the
    model's eager attention as the whole estimate's do: a streamed estimate records one block's layers at a time, and
    none (``[]``) in the forward pass that keeps the blocks' inputs
    (:mod:`quantcore.evaluation.fisher_streamed`)."""
    if units is None:
        yield
        return
    swept = list(units.names) if names is None else [n for n in units.names if n in set(names)]
    from quantcore.evaluation import kvcache
    from quantcore.models.decoder import attention_modules

    recorded: dict[str, tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any], Tensor]] = {}
    earlier: dict[str, list[Tensor]] = {}
    per_seq: dict[str, list[Tensor]] = {}

    def recorder(name: str) -> Callable[..., Any]:
        def attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None,
                      **kwargs: Any) -> Any:
            fn = kvcache._module_eager(module)
            out = fn(module, query, key, value, mask, **kwargs)
            recorded[name] = (fn, (query.detach(), key.detach(), value.detach(),
                                   None if mask is None else mask.detach()), kwargs, out[0].detach())
            return out
        return attention

    def on_grad(name: str) -> Callable[[Tensor], None]:
        def hook(g: Tensor) -> None:
            if current[0] < passes - 1:
                earlier.setdefault(name, []).append(g.detach().float())
                return
            fn, (q, k, v, mask), kwargs, ref = recorded.pop(name)
            module = units.modules[name]
            with torch.inference_mode():
                last = g.detach().float()
                grads = torch.stack([*earlier.pop(name, []), last]) if passes > 1 else last[None]
                sums = []
                for states in units.states:
                    st = states[name]
                    q2, k2, v2 = st.tensors(q, k, v)
                    out = (st.attention or fn)(module, q2, k2, v2, mask, **kwargs)[0]
                    delta = out.float().sub_(ref.float())
                    if delta.numel() != last.numel():
                        raise PlanError(f"{name}: its attention output ({tuple(delta.shape)}) is not o_proj's input "
                                        f"({tuple(last.shape)}): the Fisher estimate cannot follow its KV cache")
                    prod = torch.linalg.vecdot(grads, delta.reshape(last.shape))  # [P, b, L]
                    sums.append(0.5 * prod[:, :, :-1].double().square().sum(dim=(0, 2)).cpu())
                per_seq[name] = sums
        return hook

    def on_input(name: str) -> Callable[..., None]:
        def pre(_mod: nn.Module, args: Any) -> None:
            x = args[0]
            if isinstance(x, Tensor) and x.requires_grad:
                x.register_hook(on_grad(name))
        return pre

    handles = [cast(nn.Module, units.modules[n].o_proj).register_forward_pre_hook(on_input(n)) for n in swept]

    def eager(module: nn.Module, *args: Any, **kwargs: Any) -> Any:  # a layer not swept: the model's own attention
        return kvcache._module_eager(module)(module, *args, **kwargs)

    every = attention_modules(model)
    states = {n: kvcache._LayerState(_same, recorder(n) if n in swept else eager) for n in every}
    try:
        with kvcache._attention_wrapped(model, every, states, "Fisher estimate (KV cache)"):
            yield
    finally:
        for h in handles:
            h.remove()
        recorded.clear()
        earlier.clear()
    missing = [n for n in swept if n not in per_seq]
    if missing:
        raise PlanError(f"the Fisher estimate saw no gradient at o_proj's input of {name_list(missing)}")
    for li, n in enumerate(units.names):
        for fi, s in enumerate(per_seq.get(n, ())):
            units.per_seq[li][fi].extend(s.tolist())


def kv_rows(units: KvUnits | None, positions: int, samples: int, passes: int) -> dict[str, list[SensitivityRow]]:
    """``{"KV <format>": rows}``, rows largest estimate first, from ``units.per_seq`` (as a linear unit's:
    :func:`quantcore.evaluation.fisher._linear_rows`; ``sqnr_db`` NaN); ``{}`` for None."""
    out: dict[str, list[SensitivityRow]] = {}
    for fi, fmt in enumerate(units.formats if units is not None else ()):
        assert units is not None
        rows = []
        for li, name in enumerate(units.names):
            est = block_mean(np.asarray(units.per_seq[li][fi])[:, None] / (positions * samples * passes))
            rows.append(SensitivityRow(layer=name, layers=[name], kl_mean=est.value, top1_agree=math.nan,
                                       sqnr_db=math.nan, kl_mean_err=est.err))
        rows.sort(key=lambda r: r.kl_mean, reverse=True)
        out[KV_PREFIX + fmt] = rows
    return out


def _same(query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return query, key, value
