"""Fast sensitivity: a sampled-Fisher estimate of every unit's KL under every candidate scheme at once.

The exact sweep (:func:`quantcore.evaluation.sensitivity.sensitivity_sweep`) measures the whole model's KL with one
unit quantized, one partial pass per unit and scheme. This module estimates the same number for every unit and every
scheme from one reference forward and a few backward passes per batch (docs/concepts/sensitivity.md derives it).

To second order in the change δz of a position's logits, KL(p_ref ‖ p_q) ≈ ½ δzᵀ F δz with F = diag(p) - ppᵀ the
softmax's Fisher, and F = E_t[(e_t - p)(e_t - p)ᵀ] for a token t *sampled from p*. Linearizing δz in the change δy
of a unit's output, ½ δzᵀ F δz = ½ E_t[(g · δy)²] with g = ∂ log p(t) / ∂y the gradient of the sampled token's
log-prob with respect to the unit's output. So per batch:

1. one forward with grad on the unquantized model; every unit member keeps its input ``x`` (the graph keeps no
   weight gradients: every parameter stays frozen, the embeddings' output is the only leaf that asks for grad);
2. per sample, targets drawn from the reference distribution at every position and one backward of
   ``Σ log p(t)`` (its gradient at the logits is ``e_t - p``, given directly: no log-softmax is built);
3. inside a hook on each member's output gradient ``g``, for each scheme the member's quantized output on the same
   kept input, ``y_q = Q(x / s) Ŵ_qᵀ`` (SmoothQuant's and AWQ's factors ``s`` folded as the exact sweep folds
   them, GPTQ's rounding from the same inputs), ``δy = y_q - y``, and ``Σ_c g_c δy_c`` per position, summed over the
   members of a fusion unit; its square is added up per sequence and the member's kept input is dropped.

Nothing the size of all gradients is stored: a gradient lives only while its hook runs. The estimate per position is
the square of one token's sampled gradient: averaged over every position of every sequence (and ``samples`` draws)
it is an unbiased estimate of the Fisher quadratic form, except for the terms the per-position product leaves out
(a unit's errors at two positions reaching one later position's logits through attention, in the same direction);
the docs show how close it comes to the exact sweep, scheme by scheme.

Each (unit, scheme) is quantized once, before the first batch: :func:`quantcore.evaluation.scoring.plan_applied`
applies the unit with the scheme and the member modules, quantized weight and activation hook included, are copied
out; the model itself is restored at once. That holds one quantized copy of every swept layer per scheme (SmolLM2:
about 0.5 GB a scheme in float32); the reference forward keeps each layer's input for its batch.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from quantcore.algorithms.inputs import NO_INPUTS, PlanInputs
from quantcore.errors import PlanError
from quantcore.evaluation.batches import (
    Progress,
    ShouldCancel,
    as_token_batch,
    batch_ranges,
    check_cancel,
    model_device,
    report_progress,
)
from quantcore.evaluation.reference import ReferenceCache
from quantcore.evaluation.scoring import plan_applied
from quantcore.evaluation.sensitivity import SensitivityRow, _check_reference, linear_layer_names, sweep_units
from quantcore.evaluation.statistics import block_mean
from quantcore.planning.plans import group_label
from quantcore.schemes.presets import get_scheme
from quantcore.schemes.specs import Scheme

DEFAULT_SAMPLES = 2  # tokens drawn per position from the reference distribution (one backward each)
METHOD = "fisher"  # the ``method`` a fast sweep's result carries (the exact sweep's is "kl")


@dataclass
class _Member:
    """One linear of a unit, quantized under one scheme: a copy of the module with its fake-quantized weight and
    its activation hook (from :func:`plan_applied`), and the factors its input was divided by there."""

    module: nn.Module
    divisor: Tensor | None

    def output(self, x: Tensor) -> Tensor:
        return self.module(x if self.divisor is None else x / self.divisor.to(x.dtype))


@dataclass
class _UnitSums:
    """Per sequence, the running sum of squared per-position products of one unit under one scheme, and its local
    signal and noise."""

    per_seq: list[float] = field(default_factory=list)
    signal: float = 0.0
    noise: float = 0.0


def _quantized_members(model: nn.Module, unit: Sequence[str], scheme: Scheme, inputs: PlanInputs
                       ) -> tuple[list[_Member], list[str]]:
    """The members of ``unit`` quantized with ``scheme`` as the exact sweep quantizes them, and its notes."""
    members: list[_Member] = []
    with plan_applied(model, {n: scheme for n in unit}, inputs=inputs) as applied:
        for n in unit:
            module = model.get_submodule(n)
            s = applied.smoothing.get(n)
            a = applied.awq.get(n)
            divisor = s if a is None else (a if s is None else s * a)
            members.append(_Member(copy.deepcopy(module), None if divisor is None else divisor.detach().clone()))
        notes = list(applied.notes)
    return members, notes


def fisher_sensitivity(
    model: nn.Module,
    schemes: Sequence[Scheme | str],
    input_ids: Tensor,
    reference: ReferenceCache,
    *,
    groups: bool = True,
    layers: Sequence[str] | None = None,
    inputs: PlanInputs | Mapping[str, PlanInputs] = NO_INPUTS,
    samples: int = DEFAULT_SAMPLES,
    batch_size: int | None = None,
    seed: int = 0,
    progress: Progress | None = None,
    should_cancel: ShouldCancel | None = None,
) -> dict[str, list[SensitivityRow]]:
    """The estimated KL of every unit under every scheme: ``{scheme name: rows}``, rows sorted by ``kl_mean``,
    largest first, in :func:`quantcore.evaluation.sensitivity.sensitivity_sweep`'s shape.

    input_ids, reference, groups, layers, batch_size: as the exact sweep's (the same units, the same tokens)
    inputs:   the calibrated inputs (one :class:`PlanInputs` for every scheme, or ``{scheme name: PlanInputs}``)
    samples:  tokens drawn per position from the reference distribution, one backward pass each
    seed:     of those draws

    ``kl_mean`` is the estimate, ``kl_mean_err`` its standard error over sequences (the sampling noise included),
    ``sqnr_db`` the unit's local output SQNR (exact, from the same products), ``top1_agree`` NaN (not estimated).
    The model is left as it was (no hook, no weight or ``requires_grad`` changed, no ``.grad`` written), also on error
    or cancel.
    """
    if getattr(inputs, "rotation", None) is not None or (isinstance(inputs, Mapping) and any(
            getattr(i, "rotation", None) is not None for i in inputs.values())):
        raise PlanError("the Fisher estimate does not follow rotations yet (a rotated unit sees a rotated input): "
                        "sweep a rotated scheme with the exact method (--method kl)")
    if samples < 1:
        raise PlanError(f"the Fisher estimate needs at least one sampled token per position, got samples={samples}")
    resolved = [get_scheme(s) for s in schemes]
    if not resolved:
        raise PlanError("the Fisher estimate needs at least one scheme")
    names = [s.name for s in resolved]
    if len(set(names)) != len(names):
        raise PlanError(f"a scheme is named twice: {', '.join(names)}")
    ids = as_token_batch(input_ids)
    reference.check_tokens(ids)
    units = sweep_units(linear_layer_names(model), groups=groups, only=layers)
    if not units:
        raise PlanError("the sweep has no layer to quantize: the model has no nn.Linear layers")
    get_embeddings: Any = getattr(model, "get_input_embeddings", None)
    embeddings = get_embeddings() if get_embeddings is not None else None
    if not isinstance(embeddings, nn.Module):
        raise PlanError(f"{type(model).__name__} has no input embeddings to start the backward pass from")

    def inputs_of(scheme: Scheme) -> PlanInputs:
        got = inputs.get(scheme.name, NO_INPUTS) if isinstance(inputs, Mapping) else inputs
        return got if got.gptq_cache is not None else got.replace(gptq_cache={})

    scheme_inputs = [inputs_of(s) for s in resolved]
    quantized: list[list[list[_Member]]] = []  # [unit][scheme] -> members
    unit_notes: list[list[str]] = [["" for _ in units] for _ in resolved]
    total_prep = len(units) * len(resolved)
    for ui, unit in enumerate(units):
        row = []
        for si, scheme in enumerate(resolved):
            check_cancel(should_cancel, f"Fisher estimate (quantizing {group_label(unit)} with {scheme.name})")
            members, why = _quantized_members(model, unit, scheme, scheme_inputs[si])
            row.append(members)
            unit_notes[si][ui] = "; ".join(why)
            report_progress(progress, 0.2 * (ui * len(resolved) + si + 1) / total_prep,
                            f"quantized {group_label(unit)} ({scheme.name})")
        quantized.append(row)

    sums = [[_UnitSums() for _ in resolved] for _ in units]
    member_of = {n: (ui, mi) for ui, unit in enumerate(units) for mi, n in enumerate(unit)}
    ranges = batch_ranges(ids.shape[0], reference.batch_size if batch_size is None else batch_size)
    gen = torch.Generator(device=model_device(model)).manual_seed(seed)
    positions = ids.shape[1] - 1
    asked = [(p, p.requires_grad) for p in model.parameters()]
    try:  # no weight gradient is wanted: only the embeddings' output starts the graph
        for p, _ in asked:
            p.requires_grad_(False)
        for bi, (s, e) in enumerate(ranges):
            check_cancel(should_cancel, f"Fisher estimate (batch {bi + 1} of {len(ranges)})")
            _one_batch(model, embeddings, ids[s:e], reference, s, e, units, member_of, quantized, sums, samples, gen)
            report_progress(progress, 0.2 + 0.8 * (bi + 1) / len(ranges), f"batch {bi + 1} of {len(ranges)}")
    finally:
        for p, flag in asked:
            p.requires_grad_(flag)

    out: dict[str, list[SensitivityRow]] = {}
    for si, scheme in enumerate(resolved):
        rows = []
        for ui, unit in enumerate(units):
            acc = sums[ui][si]
            est = block_mean(np.asarray(acc.per_seq)[:, None] / (positions * samples))
            rows.append(SensitivityRow(
                layer=group_label(unit), layers=list(unit), kl_mean=est.value, top1_agree=math.nan,
                sqnr_db=_sqnr(acc.signal, acc.noise), note=unit_notes[si][ui], kl_mean_err=est.err))
        rows.sort(key=lambda r: r.kl_mean, reverse=True)
        out[scheme.name] = rows
    return out


def _sqnr(signal: float, noise: float) -> float:
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def _one_batch(model: nn.Module, embeddings: nn.Module, ids: Tensor, reference: ReferenceCache, s: int, e: int,
               units: Sequence[Sequence[str]], member_of: Mapping[str, tuple[int, int]],
               quantized: Sequence[Sequence[Sequence[_Member]]], sums: Sequence[Sequence[_UnitSums]],
               samples: int, gen: torch.Generator) -> None:
    """One reference forward with grad, ``samples`` backward passes; adds this batch's sequences to ``sums``."""
    b = ids.shape[0]
    n_schemes = len(sums[0])
    kept: dict[str, tuple[Tensor, Tensor]] = {}  # member -> (its input, its unquantized output), for this batch
    earlier: dict[str, list[Tensor]] = {}  # member -> its output gradients of the draws before the last
    # per unit and scheme, the per-position products [draw, b, L] summed over the members seen so far
    partial: list[list[Tensor | None]] = [[None] * n_schemes for _ in units]
    seen = [0] * len(units)
    draw = [0]
    per_seq = [[torch.zeros(b, dtype=torch.float64) for _ in range(n_schemes)] for _ in units]
    handles: list[Any] = []

    def on_grad(name: str) -> Callable[[Tensor], None]:
        ui, mi = member_of[name]

        def hook(g: Tensor) -> None:
            if draw[0] < samples - 1:  # each quantized output is computed once, at the last draw, for all draws
                earlier.setdefault(name, []).append(g.detach().float())  # float(): a copy, never autograd's buffer
                return
            x, y = kept.pop(name)
            with torch.inference_mode():
                grads = torch.stack([*earlier.pop(name, []), g.detach().float()])  # [draws, b, L, N]
                signal = float(y.square().sum(dtype=torch.float64))
                for si in range(n_schemes):
                    dy = quantized[ui][si][mi].output(x).float().sub_(y)
                    prod = (grads * dy).sum(dim=-1)  # [draws, b, L]
                    acc = partial[ui][si]
                    partial[ui][si] = prod if acc is None else acc + prod
                    sums[ui][si].noise += float(dy.square().sum(dtype=torch.float64))
                    sums[ui][si].signal += signal
                del grads
                seen[ui] += 1
                if seen[ui] == len(units[ui]):
                    for si in range(n_schemes):
                        p = partial[ui][si]
                        assert p is not None
                        per_seq[ui][si] += 0.5 * p[:, :, :-1].double().square().sum(dim=(0, 2)).cpu()
                        partial[ui][si] = None
                    seen[ui] = 0

        return hook

    def keep(name: str) -> Callable[..., None]:
        def fwd(mod: nn.Module, args: Any, out: Tensor) -> None:
            x = args[0].detach()
            kept[name] = (x, out.detach().float())
            out.register_hook(on_grad(name))

        return fwd

    def leaf(_mod: nn.Module, _args: Any, out: Tensor) -> Tensor:
        return out.detach().requires_grad_(True)

    handles.append(embeddings.register_forward_hook(leaf))
    for name in member_of:
        handles.append(model.get_submodule(name).register_forward_hook(keep(name)))
    try:
        with torch.enable_grad():
            out = model(input_ids=ids.to(model_device(model)), use_cache=False)
            logits = getattr(out, "logits", None)
            if logits is None:
                raise PlanError(f"{type(model).__name__} returns no next-token logits: the Fisher estimate needs a "
                                "causal language model's head")
            with torch.no_grad():
                ref = logits.detach().float()
                _check_reference(ref, ids, reference, s, e)
                probs = torch.softmax(ref[:, :-1], dim=-1)
                del ref
            for k in range(samples):
                with torch.no_grad():
                    flat = probs.reshape(-1, probs.shape[-1])
                    t = torch.multinomial(flat, 1, generator=gen)
                    grad = torch.zeros(logits.shape, dtype=logits.dtype, device=logits.device)
                    grad[:, :-1] = (-probs).to(logits.dtype)
                    body = grad[:, :-1].reshape(-1, probs.shape[-1])
                    body.scatter_add_(1, t, torch.ones_like(t, dtype=body.dtype))
                    grad[:, :-1] = body.reshape(grad[:, :-1].shape)
                draw[0] = k
                logits.backward(grad, retain_graph=k < samples - 1)
                del grad
    finally:
        for h in handles:
            h.remove()
        kept.clear()
        earlier.clear()
    for ui in range(len(units)):
        for si in range(n_schemes):
            sums[ui][si].per_seq.extend(per_seq[ui][si].tolist())

