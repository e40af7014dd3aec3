"""GPTQ weight rounding: quantize a weight column by column and push each column's error onto the columns
not yet quantized, weighted by the inverse Hessian of the layer's inputs [Frantar et al. 2022, GPTQ].

Round-to-nearest (RTN, what :func:`quantcore.formats.weights.fake_quantize_weight` does) minimises each weight's own
error. GPTQ minimises the error of the layer's *output* on calibration inputs, ``||X Wᵀ - X Qᵀ||²``, whose
Hessian with respect to a weight row is ``H = 2 Xᵀ X / n`` (K × K, the same for every row). It is what
llm-compressor's ``GPTQModifier`` runs, and what its W4A16 and W8A8 examples use, so a plan that will be
exported with GPTQ is scored with GPTQ here, not with RTN (which overstates a 4-bit layer's error).

The algorithm follows llm-compressor 0.14's ``quantize_weight`` (eager path), with its defaults:

* scales (and their grid) come from the original weight, as RTN's do (:func:`quantcore.formats.weights.weight_scale`:
  for int formats compressed-tensors' min-max scales, amax / 7.5 or amax / 127.5, and codes -8..7 / -128..127;
  for NVFP4 the effective scale of each block of 16, E4M3 block scale × fp32 tensor scale, and E2M1 elements);
  GPTQ changes which grid point each weight takes, never the scales. Given the same weight, Hessian and scales,
  the result is llm-compressor's bit for bit (tests/quantcore/algorithms/test_gptq.py; NVFP4 is its ``tensor_group``
  strategy); a block whose scale is 0 (all zero) rounds what error reaches it to zero;
* dead inputs (``H[j, j] == 0``: a channel that was always 0) get ``H[j, j] = 1`` and weight 0;
* dampening ``H += 0.01 · mean(diag H) · I``; a Hessian that is still not positive definite falls back to RTN
  for that layer (reported);
* activation order ``static`` (llm-compressor's alias of ``weight``): columns are processed in descending
  ``diag(H)``, each keeps the scale of its own group in the original order, so the checkpoint's layout is
  the RTN one;
* blocks of 128 columns: the error is propagated inside a block column by column and to the rest of the
  weight once per block (the "lazy batch" update, the same result as column by column up to rounding).

Hessians here come from the unquantized model's inputs on calibration text (:func:`collect_hessians`), for
every layer in one pass. llm-compressor's sequential pipeline instead feeds each decoder layer the outputs
of the layers it already quantized, so deeper layers see slightly different inputs; layer 0's inputs are
the same in both. Collecting them that way (``stop_after`` ends each forward after the block) moves SmolLM2's
W4A16_GPTQ KL by 0.5 %, less than leaving out one of 16 calibration sequences does (README;
scripts/gptq_against_llmc.py --sequential --spread), so quantplan keeps the one pass. A streamed job takes the same
Hessians one block at a time and rounds each block's layers before freeing it
(:mod:`quantcore.algorithms.streamed_rounding`: the same roundings, one block's Hessians in memory).

SmoothQuant: a smoothed layer computes ``(X / s) (W · s)ᵀ``; its Hessian is ``D⁻¹ H D⁻¹`` with ``D = diag(s)``
(:func:`smoothed_hessian`), so Hessians collected on the unsmoothed model serve any α.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from quantcore.algorithms.registry import WeightRounding, register_rounding_handler
from quantcore.errors import Cancelled, PlanError, name_list
from quantcore.formats.weights import element_scales, round_to_weight_grid, weight_scale, weight_zero_point
from quantcore.models.architectures import LLAMA_STYLE
from quantcore.models.moe import all_experts
from quantcore.schemes.fusion import fusion_groups
from quantcore.schemes.specs import (
    GPTQ_ACTORDER,
    GPTQ_BLOCK_SIZE,
    GPTQ_DAMPENING,
    Rounding,
    Scheme,
    TensorSpec,
    gptq_unsupported,
)

GPTQ_PRECISION = torch.float32  # llm-compressor's GPTQ_PRECISION


@contextmanager
def _one_thread() -> Iterator[None]:
    """torch on one CPU thread: GPTQ is thousands of small ops, which gain little from a second thread on an idle
    machine (1.3x here) and lose up to a hundredfold when another process keeps the cores busy (seen here: 6 s
    instead of 0.04 s for a 576 x 576 weight). CUDA work is not affected."""
    if torch.get_num_threads() == 1:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass(frozen=True)
class GptqResult:
    """What GPTQ did to one weight.

    loss:         GPTQ's own objective, ½ Σ (w - q)² / [H⁻¹]ⱼⱼ summed over the weight (llm-compressor logs it)
    rtn_fallback: the dampened Hessian was not positive definite: the weight was rounded to nearest
    dead:         input channels that were always 0 in calibration (their weights were set to 0)
    """

    weight: torch.Tensor
    loss: float
    rtn_fallback: bool
    dead: int


@torch.no_grad()
def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    spec: TensorSpec,
    *,
    block_size: int = GPTQ_BLOCK_SIZE,
    dampening: float = GPTQ_DAMPENING,
    actorder: bool = True,
    scale: torch.Tensor | None = None,
) -> GptqResult:
    """GPTQ-round ``weight`` (N, K) to ``spec``'s grid, given its input Hessian (K, K); returns the fake-quantized
    weight in ``weight``'s dtype (every value on the grid of RTN's scales).

    With a diagonal Hessian no error is propagated and the result is RTN's, bit for bit.
    ``scale``: other scales to keep (the granularity's scale shape, as :func:`quantcore.formats.weights.weight_scale`
    returns them); default RTN's, from the weight itself.
    """
    why = gptq_unsupported(spec)
    if why:
        raise PlanError(why)
    if weight.device.type != "cpu":
        return _gptq(weight, hessian, spec, block_size, dampening, actorder, scale)
    with _one_thread():
        return _gptq(weight, hessian, spec, block_size, dampening, actorder, scale)


def _gptq(weight, hessian, spec, block_size, dampening, actorder, scale) -> GptqResult:
    if weight.dim() != 2:
        raise ValueError(f"GPTQ rounds a 2-D weight (out_features, in_features), got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if tuple(hessian.shape) != (k, k):
        raise ValueError(f"the Hessian of a weight with K = {k} inputs must be ({k}, {k}), got {tuple(hessian.shape)}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    fmt = spec.format
    W = weight.detach().to(GPTQ_PRECISION).clone()
    if scale is None:
        scale = weight_scale(W, spec)
    elif not bool(torch.isfinite(scale).all() and (scale > 0).all()):
        raise ValueError("GPTQ scales must be finite and > 0")
    S = element_scales(scale.to(W.device), spec, (n, k)).contiguous()
    # an NVFP4 block that was all zero has scale 0: error pushed into it rounds to (nearly) zero, not NaN
    S = torch.where(S > 0, S, torch.finfo(S.dtype).tiny)
    # an asymmetric weight's zero points, like its scales from the weight before any error is pushed into it (as
    # llm-compressor's observer computes both before GPTQ starts); None: symmetric, the grid is centred on 0
    zp = weight_zero_point(W, spec, scale.to(W.device))
    Z = None if zp is None else element_scales(zp, spec, (n, k)).to(W.dtype).contiguous()
    H = hessian.detach().to(device=W.device, dtype=GPTQ_PRECISION).clone()

    diag = torch.diagonal(H)
    dead = diag == 0
    n_dead = int(dead.sum())
    if n_dead:
        diag.masked_fill_(dead, 1.0)
        W[:, dead] = 0.0
    perm = None
    if actorder:
        perm = torch.argsort(torch.diagonal(H), descending=True)
        W, S, H = W[:, perm], S[:, perm], H[perm][:, perm]
        if Z is not None:
            Z = Z[:, perm]

    fallback = False
    H.diagonal().add_(dampening * torch.mean(torch.diagonal(H)))
    L, info = torch.linalg.cholesky_ex(H)
    if int(info) == 0:
        Hinv = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)
    else:  # still not positive definite: round to nearest (no error is propagated through an identity)
        Hinv = torch.eye(k, dtype=GPTQ_PRECISION, device=W.device)
        fallback = True

    loss = torch.zeros((), dtype=GPTQ_PRECISION, device=W.device)
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        W1 = W[:, i1:i2].clone()
        S1 = S[:, i1:i2]
        Z1 = None if Z is None else Z[:, i1:i2]
        Q1 = torch.empty_like(W1)
        Err1 = torch.empty_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            w = W1[:, i]
            s = S1[:, i]
            if Z1 is None:
                q = round_to_weight_grid(w / s, fmt) * s
            else:
                z = Z1[:, i]
                q = (round_to_weight_grid(w / s + z, fmt) - z) * s
            err = (w - q) / Hinv1[i, i]
            Q1[:, i] = q
            Err1[:, i] = err
            W1[:, i:] -= err.unsqueeze(1) * Hinv1[i, i:].unsqueeze(0)
        loss += Err1.square().sum() / 2
        W[:, i1:i2] = Q1
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    if perm is not None:
        W = W[:, torch.argsort(perm)]
    return GptqResult(weight=W.to(weight.dtype), loss=float(loss), rtn_fallback=fallback, dead=n_dead)


def smoothed_hessian(hessian: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """The Hessian of a smoothed layer's input ``X / s``: ``H / (s sᵀ)`` (see the module docstring)."""
    s = factors.detach().to(device=hessian.device, dtype=hessian.dtype).reshape(-1)
    if s.numel() != hessian.shape[0]:
        raise ValueError(f"{s.numel()} smoothing factors for a Hessian of {hessian.shape[0]} inputs")
    return hessian / (s.unsqueeze(1) * s.unsqueeze(0))


# ------------------------------------------------------------------ Hessians from calibration text


class _Accumulator:
    def __init__(self) -> None:
        self.sum: torch.Tensor | None = None
        self.rows = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).to(GPTQ_PRECISION)
        xtx = x.T @ x
        self.sum = xtx if self.sum is None else self.sum.add_(xtx)
        self.rows += x.shape[0]

    def hessian(self) -> torch.Tensor:
        assert self.sum is not None
        return self.sum.mul_(2.0 / self.rows)


class _Stop(Exception):
    """Ends a calibration forward early (see ``stop_after``)."""


def _stop(*_args: object) -> None:
    raise _Stop


@contextmanager
def hessians_hooked(model: nn.Module, layers: Iterable[str]) -> Iterator[Callable[[], dict[str, torch.Tensor]]]:
    """Hooks that add the named linears' inputs to their Hessians while the context is open (the forwards are the
    caller's: :func:`collect_hessians` runs the whole model, :mod:`quantcore.algorithms.streamed_rounding` one
    decoder block at a time); yields ``finish()``, the ``{layer: 2 Xᵀ X / n}`` so far. The members of one fusion
    group (q/k/v, gate/up) read one input and share one Hessian (the same tensor object). PlanError for a name that
    is not an ``nn.Linear`` of the model, and (from ``finish``) for a layer no token reached."""
    names = list(dict.fromkeys(layers))
    modules = dict(model.named_modules())
    bad = [n for n in names if not isinstance(modules.get(n), nn.Linear)]
    if bad:
        raise PlanError(f"GPTQ needs the inputs of nn.Linear layers; not one in this model: {name_list(bad)}")
    owner: dict[str, str] = {n: n for n in names}  # layer -> the group member whose input is recorded
    for group in fusion_groups(names):
        for m in group:
            owner[m] = group[0]
    acc = {o: _Accumulator() for o in dict.fromkeys(owner.values())}

    def hook(name: str):
        def pre(_module: nn.Module, args: tuple) -> None:
            acc[name].add(args[0])
        return pre

    def finish() -> dict[str, torch.Tensor]:
        empty = [o for o, a in acc.items() if a.rows == 0]
        if empty:
            raise PlanError(f"no calibration token reached {name_list(empty)}: cannot build its GPTQ Hessian")
        hess = {o: a.hessian() for o, a in acc.items()}
        return {n: hess[owner[n]] for n in names}

    handles = [modules[o].register_forward_pre_hook(hook(o)) for o in acc]
    try:
        yield finish
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def collect_hessians(
    model: nn.Module,
    layers: Iterable[str],
    batches: Iterable[torch.Tensor] | torch.Tensor,
    *,
    batch_size: int = 4,
    progress: Callable[[float, str], None] | None = None,
    should_cancel: Callable[[], bool] | None = None,
    stop_after: nn.Module | None = None,
) -> dict[str, torch.Tensor]:
    """``{layer: 2 Xᵀ X / n}`` of the named linears' inputs over calibration tokens, n = tokens seen.

    layers:     ``nn.Linear`` names; the members of one fusion group (q/k/v, gate/up) read one input and share
                one Hessian (the same tensor object)
    batches:    token ids, ``[S, L]`` (cut into ``batch_size`` sequences per forward) or an iterable of batches
    stop_after: a submodule (the decoder block holding ``layers``): each forward ends once it has run, since
                nothing after it changes these inputs
    Raises PlanError for a name that is not an ``nn.Linear`` of the model, or a layer no token reached.
    """
    if isinstance(batches, torch.Tensor):
        ids = batches if batches.dim() == 2 else batches.reshape(1, -1)
        batch_list: Sequence[torch.Tensor] = [ids[i:i + batch_size] for i in range(0, ids.shape[0], batch_size)]
    else:
        batch_list = list(batches)
    with hessians_hooked(model, layers) as finish:
        stop = stop_after.register_forward_hook(_stop) if stop_after is not None else None
        try:
            for i, b in enumerate(batch_list):
                if should_cancel is not None and should_cancel():
                    raise Cancelled("cancelled while collecting GPTQ Hessians")
                try:
                    with all_experts():  # an MoE model's experts see every token, as in llm-compressor's oneshot
                        model(input_ids=b)
                except _Stop:
                    pass
                if progress is not None:
                    progress((i + 1) / len(batch_list), f"GPTQ Hessians: batch {i + 1} of {len(batch_list)}")
        finally:
            if stop is not None:
                stop.remove()
        return finish()


@register_rounding_handler(Rounding.GPTQ, reads_nearest=False, needs="weight_hessians")
def round_with_gptq(layer: WeightRounding) -> torch.Tensor:
    """GPTQ: the layer's weight rounded column by column on its input Hessian (on the scales of its NVFP4 fusion
    group's shared tensor scale, if any), or the rounding ``layer.gptq_cache`` keeps for it, which it then keeps."""
    cache = layer.gptq_cache
    if cache is not None and layer.name in cache:
        return cache[layer.name]
    spec = layer.scheme.weight_spec()
    scale = None if layer.tensor_scale is None else weight_scale(layer.weight, spec, tensor_scale=layer.tensor_scale)
    if layer.hessians is None or layer.name not in layer.hessians:  # apply_plan checks every GPTQ layer has one
        raise PlanError(f"GPTQ rounds {layer.name!r} from the Hessian of its input, and none was given for it")
    rounded = gptq_quantize(layer.weight, layer.hessians[layer.name], spec, scale=scale).weight
    if cache is not None:
        cache[layer.name] = rounded
    return rounded


def rounding_inputs(plan: Mapping[str, Scheme]) -> dict[str, dict[str, Any]]:
    """{layer: what of ``plan`` its GPTQ rounding reads} for every layer of ``plan`` that rounds with GPTQ, besides
    the model's weights, the calibration tokens its Hessian comes from and (when ``smoothed``) the calibration
    statistics SmoothQuant divides by: the schemes of its fusion group's quantized members (one NVFP4 tensor scale
    and one SmoothQuant factor per group: :func:`quantcore.algorithms.apply.apply_plan`); of the o_proj / down_proj
    whose SmoothQuant fold divides a member's rows (v_proj's, up_proj's:
    :meth:`quantcore.models.architectures.Architecture.rows_divided_by`);
    and of every layer the plan scales with AWQ (its folds reach the same rows; one digest for the plan). Two plans
    that agree on these, on the same model and tokens, round the layer to the same weight, so a job keeps it on
    disk keyed by them and rounds it once (worker.bodies.evaluation.kept_gptq). One pass over the plan, however many
    layers."""
    import hashlib
    import json

    group_of = {n: g for g in fusion_groups([n for n, s in plan.items() if not s.is_identity]) for n in g}
    awq = {n: s.to_dict() for n, s in sorted(plan.items()) if s.needs_awq}
    awq_digest = hashlib.sha256(json.dumps(awq, sort_keys=True).encode()).hexdigest() if awq else None
    out = {}
    for layer, scheme in plan.items():
        if not scheme.needs_hessians:
            continue
        group = group_of.get(layer, [layer])
        folds = {c: plan[c].to_dict() for n in group if (c := LLAMA_STYLE.rows_divided_by(n)) is not None
                 and c in plan and plan[c].smoothquant_alpha is not None}
        out[layer] = {
            "layer": layer,
            "group": {n: plan[n].to_dict() for n in group},
            "folds": folds,
            "awq": awq_digest,
            "gptq": [GPTQ_BLOCK_SIZE, GPTQ_DAMPENING, GPTQ_ACTORDER],
            "smoothed": bool(folds) or any(plan[n].smoothquant_alpha is not None for n in group),
        }
    return out


__all__ = [
    "GptqResult",
    "collect_hessians",
    "gptq_quantize",
    "hessians_hooked",
    "round_with_gptq",
    "rounding_inputs",
    "smoothed_hessian",
]
