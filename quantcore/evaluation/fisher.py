"""Fast sensitivity: a sampled-Fisher estimate of every unit's KL under every candidate scheme at once.

The exact sweep (:func:`quantcore.evaluation.sensitivity.sensitivity_sweep`) measures the whole model's KL with one
unit quantized, one partial pass per unit and scheme. This module estimates the same number for every unit and every
scheme from one reference forward and one or two backward passes per batch (docs/concepts/sensitivity.md derives
it).

To second order in the change δz of a position's logits, KL(p_ref ‖ p_q) ≈ ½ δzᵀ F δz with F = diag(p) - ppᵀ the
softmax's Fisher, and F = E_t[(e_t - p)(e_t - p)ᵀ] for a token t *sampled from p*. Linearizing δz in the change δy
of a unit's output, ½ δzᵀ F δz = ½ E_t[(g · δy)²] with g = ∂ log p(t) / ∂y the gradient of the sampled token's
log-prob with respect to the unit's output. So per batch:

1. one forward with grad on the unquantized model; every unit member keeps its input ``x`` (the graph keeps no
   weight gradients: every parameter stays frozen, the embeddings' output is the only leaf that asks for grad);
2. per pass (``passes``), ``samples`` tokens drawn from the reference distribution at every position and one
   backward of their ``Σ log p(t)`` (its gradient at the logits is ``counts - samples * p``, given directly: no
   log-softmax is built; its covariance is ``samples`` times the Fisher, so the square is divided by ``samples``);
3. inside a hook on each member's output gradient ``g``, for each scheme the member's quantized output on the same
   kept input, ``y_q = Q(x / s) Ŵ_qᵀ`` (SmoothQuant's and AWQ's factors ``s`` folded as the exact sweep folds
   them, GPTQ's rounding from the same inputs), ``δy = y_q - y``, and ``Σ_c g_c δy_c`` per position, summed over the
   members of a fusion unit (a routed expert's rows put back at the positions of their tokens); its square is
   added up per sequence and the member's kept input is dropped. KV cache formats are units too, one per
   attention layer (:mod:`quantcore.evaluation.fisher_kv`).

Nothing the size of all gradients is stored: a gradient lives only while its hook runs. The estimate per position is
the square of the sampled gradient: averaged over every position of every sequence (and the passes) it is an
unbiased estimate of the Fisher quadratic form, except for the terms the per-position product leaves out
(a unit's errors at two positions reaching one later position's logits through attention, in the same direction);
the docs show how close it comes to the exact sweep, scheme by scheme.

Each (unit, scheme) is quantized once, before the first batch, by :func:`quantcore.evaluation.scoring.plan_applied`
(every unit at once for a scheme that folds no factors, when the units are the model's fusion units; else one unit
at a time, as the exact sweep); each member keeps the quantized weight tensor and the activation hook it made (no
copy). Schemes that round a weight alike (the same weight spec, to nearest, no factors folded: INT8_PER_TENSOR and
INT8_W8A8) round it once: the later one is applied on the earlier one's tensors
(:func:`plan_applied`'s ``rounded``). The model itself is restored at once. That holds one
quantized weight of every swept layer per distinct rounding (SmolLM2: about 0.5 GB each in float32); the reference
forward keeps each layer's input for its batch.

In the hooks, the members that read one input tensor (q/k/v, gate/up) take one fake quantization of it a scheme
(where their activation spec and static scale agree and no factor divides it), each member's quantized output of
every scheme is written into one tensor (reused by the members after it), and the change δy is formed and dotted
with every pass's gradient a block of rows at a time while the block is in cache: each sum is the very one computed
otherwise (the estimates are bit-identical), without the copies. The reference check reads each token's NLL off the
softmax the draws come from (no log-softmax of the batch's logits unless that cheap test fails).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

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
from quantcore.evaluation.fisher_kv import KvUnits, kv_recorded, kv_rows, prepare_kv
from quantcore.evaluation.reference import ReferenceCache
from quantcore.evaluation.scoring import plan_applied
from quantcore.evaluation.sensitivity import SensitivityRow, linear_layer_names, sweep_units
from quantcore.evaluation.statistics import block_mean
from quantcore.evaluation.sweep_head import REFERENCE_NLL_TOL, check_reference
from quantcore.planning.plans import group_label
from quantcore.schemes.fusion import expert_block, fusion_units
from quantcore.schemes.presets import get_scheme
from quantcore.schemes.specs import Scheme

DEFAULT_SAMPLES = 8  # tokens drawn per position from the reference distribution, all in one backward pass
# backward passes per batch, each with its own draws: the second costs one backward (the quantized outputs are
# reused) and, on SmolLM2 at 2 x 64 tokens, took the worst unit above the median from 5.2x off to 3.1x
DEFAULT_PASSES = 2
METHOD = "fisher"  # the ``method`` a fast sweep's result carries (the exact sweep's is "kl")


@dataclass
class _Member:
    """One linear of a unit, quantized under one scheme: its fake-quantized weight (no copy: the tensor
    :func:`plan_applied` made, shared by the schemes that round it alike), its bias, the activation pre-hooks that
    quantized its input there, and the factors its input was divided by. ``input_key``: what its quantized input
    depends on besides the input (:meth:`quantcore.algorithms.apply.AppliedPlan.input_key`), where members that read
    one input tensor (q/k/v, gate/up) may take one quantization of it; None: quantized on its own."""

    weight: Tensor
    bias: Tensor | None
    hooks: list[tuple[Callable[..., Any], bool]]  # (hook, with_kwargs)
    divisor: Tensor | None
    input_key: tuple | None = None

    def quantized_input(self, module: nn.Module, x: Tensor) -> Tensor:
        x = x if self.divisor is None else x / self.divisor.to(x.dtype)
        for hook, with_kwargs in self.hooks:
            got = hook(module, (x,), {}) if with_kwargs else hook(module, (x,))
            if got is not None:
                args = got[0] if with_kwargs else got
                x = args[0] if isinstance(args, tuple) else args
        return x

    def output(self, module: nn.Module, x: Tensor, xq: Tensor | None = None, out: Tensor | None = None) -> Tensor:
        """The member's quantized output on the kept input ``x`` (``xq``: its quantized input, already at hand),
        written into ``out`` where given and there is no bias (the same GEMM as ``linear``'s, bit for bit, without a
        new tensor of the output's size a scheme: the head's is 200 MB at 4 x 256 tokens)."""
        xin = self.quantized_input(module, x) if xq is None else xq
        if out is not None and self.bias is None and out.dtype == xin.dtype:
            return torch.matmul(xin, self.weight.t(), out=out)
        return torch.nn.functional.linear(xin, self.weight, self.bias)


@dataclass
class _UnitSums:
    """Per sequence, the running sum of squared per-position products of one unit under one scheme, and its local
    signal and noise."""

    per_seq: list[float] = field(default_factory=list)
    signal: float = 0.0
    noise: float = 0.0


def _members_of(model: nn.Module, unit: Sequence[str], applied: Any, before: Mapping[str, set[int]]) -> list[_Member]:
    """The members of ``unit`` as ``applied`` (a :func:`plan_applied` context) quantized them."""
    members = []
    for n in unit:
        module = model.get_submodule(n)
        s = applied.smoothing.get(n)
        a = applied.awq.get(n)
        divisor = s if a is None else (a if s is None else s * a)
        with_kwargs = getattr(module, "_forward_pre_hooks_with_kwargs", {})
        hooks = [(h, k in with_kwargs) for k, h in module._forward_pre_hooks.items() if k not in before[n]]
        linear = cast(nn.Linear, module)
        bias = linear.bias.detach() if linear.bias is not None else None
        # the plan's own activation hook alone, no factor: its result is a function of the input and this key
        key = applied.handle.input_key(n) if divisor is None and len(hooks) == 1 else None
        members.append(_Member(linear.weight.detach(), bias, hooks,
                               None if divisor is None else divisor.detach().clone(), key))
    return members


def _weight_key(scheme: Scheme) -> Any:
    """What a scheme's rounded weights depend on besides the weight itself, where two schemes' are then the very
    same tensor (rounded to nearest, no factors folded); None where they may differ (SmoothQuant, AWQ, GPTQ)."""
    if scheme.smoothquant_alpha is not None or scheme.needs_awq or scheme.needs_hessians:
        return None
    return scheme.weights


def _quantize_units(model: nn.Module, units: Sequence[Sequence[str]], resolved: Sequence[Scheme],
                    scheme_inputs: Sequence[PlanInputs], progress: Progress | None,
                    should_cancel: ShouldCancel | None, whole: bool | None = None
                    ) -> tuple[list[list[list[_Member]]], list[list[str]]]:
    """([unit][scheme] -> members, [scheme][unit] -> note): every unit quantized under every scheme as the exact sweep
    quantizes it. A scheme that folds no factors (no SmoothQuant, no AWQ) is applied to every unit at once when the
    units are the model's own fusion units (what one unit's application gives is then what the whole plan's gives:
    a fusion group's shared scales are its own); otherwise one unit at a time, as the sweep does. ``whole``: that test
    decided beforehand (a streamed estimate quantizes one block's units at a time, as the whole model's would)."""
    names = [n for unit in units for n in unit]
    if whole is None:
        whole = _fusion_units_only(units)
    quantized: list[list[list[_Member]]] = [[[] for _ in resolved] for _ in units]
    notes = [["" for _ in units] for _ in resolved]
    shared: dict[Any, dict[str, Tensor]] = {}  # weight key -> {layer: rounded weight}
    before = {n: set(model.get_submodule(n)._forward_pre_hooks) for n in names}
    for si, scheme in enumerate(resolved):
        key = _weight_key(scheme)
        batches = [list(range(len(units)))] if whole and scheme.smoothquant_alpha is None \
            and not scheme.needs_awq else [[ui] for ui in range(len(units))]
        for bi, batch in enumerate(batches):
            check_cancel(should_cancel, f"Fisher estimate (quantizing {len(batch)} unit(s) with {scheme.name})")
            layers = [n for ui in batch for n in units[ui]]
            # rounded alike by an earlier scheme (INT8_PER_TENSOR and INT8_W8A8): its weights, not rounded again
            given = {n: shared[key][n] for n in layers} if key in shared else None
            with plan_applied(model, dict.fromkeys(layers, scheme), inputs=scheme_inputs[si],
                              rounded=given) as applied:
                for ui in batch:
                    quantized[ui][si] = _members_of(model, units[ui], applied, before)
                    notes[si][ui] = "; ".join(applied.notes) if len(batch) == 1 else ""
            report_progress(progress, 0.2 * (si + (bi + 1) / len(batches)) / len(resolved),
                            f"quantized {len(batch)} unit(s) with {scheme.name}")
        if key is None or key in shared:
            continue
        same = shared.setdefault(key, {})
        for ui, unit in enumerate(units):  # the schemes that round alike share one tensor (one GEMM each, not two)
            for m, n in zip(quantized[ui][si], unit, strict=True):
                m.weight = same.setdefault(n, m.weight)
    return quantized, notes


def _fusion_units_only(units: Sequence[Sequence[str]]) -> bool:
    """Whether ``units`` are their layers' own fusion units (then a scheme is applied to every unit at once)."""
    names = [n for unit in units for n in unit]
    return [sorted(u) for u in fusion_units(names)] == [sorted(u) for u in units]


def _checked_schemes(schemes: Sequence[Scheme | str], samples: int, passes: int, kv_caches: Sequence[str] = ()
                     ) -> list[Scheme]:
    """The schemes resolved, PlanError for a bad ``samples``, ``passes`` or scheme list."""
    if samples < 1:
        raise PlanError(f"the Fisher estimate needs at least one sampled token per position, got samples={samples}")
    if passes < 1:
        raise PlanError(f"the Fisher estimate needs at least one backward pass per batch, got passes={passes}")
    resolved = [get_scheme(s) for s in schemes]
    if not resolved and not kv_caches:
        raise PlanError("the Fisher estimate needs at least one scheme or KV cache format")
    names = [s.name for s in resolved]
    if len(set(names)) != len(names):
        raise PlanError(f"a scheme is named twice: {', '.join(names)}")
    return resolved


def _scheme_inputs(inputs: PlanInputs | Mapping[str, PlanInputs], resolved: Sequence[Scheme]) -> list[PlanInputs]:
    """Each scheme's calibrated inputs, with a GPTQ rounding cache of its own where it has none."""
    def inputs_of(scheme: Scheme) -> PlanInputs:
        got = inputs.get(scheme.name, NO_INPUTS) if isinstance(inputs, Mapping) else inputs
        return got if got.gptq_cache is not None else got.replace(gptq_cache={})

    return [inputs_of(s) for s in resolved]


def _linear_rows(units: Sequence[Sequence[str]], resolved: Sequence[Scheme], sums: Sequence[Sequence[_UnitSums]],
                 unit_notes: Sequence[Sequence[str]], positions: int, samples: int,
                 passes: int) -> dict[str, list[SensitivityRow]]:
    """{scheme name: rows, largest estimate first} from the per-sequence sums."""
    out: dict[str, list[SensitivityRow]] = {}
    for si, scheme in enumerate(resolved):
        rows = []
        for ui, unit in enumerate(units):
            acc = sums[ui][si]
            est = block_mean(np.asarray(acc.per_seq)[:, None] / (positions * samples * passes))
            rows.append(SensitivityRow(
                layer=group_label(unit), layers=list(unit), kl_mean=est.value, top1_agree=math.nan,
                sqnr_db=_sqnr(acc.signal, acc.noise), note=unit_notes[si][ui], kl_mean_err=est.err))
        rows.sort(key=lambda r: r.kl_mean, reverse=True)
        out[scheme.name] = rows
    return out


def fisher_sensitivity(
    model: nn.Module,
    schemes: Sequence[Scheme | str],
    input_ids: Tensor,
    reference: ReferenceCache,
    *,
    groups: bool = True,
    layers: Sequence[str] | None = None,
    per_expert: bool = False,
    inputs: PlanInputs | Mapping[str, PlanInputs] = NO_INPUTS,
    samples: int = DEFAULT_SAMPLES,
    passes: int = DEFAULT_PASSES,
    kv_caches: Sequence[str] = (),
    kv_amax: Any = None,
    kv_layers: Sequence[str] | None = None,
    batch_size: int | None = None,
    seed: int = 0,
    progress: Progress | None = None,
    should_cancel: ShouldCancel | None = None,
) -> dict[str, list[SensitivityRow]]:
    """The estimated KL of every unit under every scheme: ``{scheme name: rows}``, rows sorted by ``kl_mean``,
    largest first, in :func:`quantcore.evaluation.sensitivity.sensitivity_sweep`'s shape.

    input_ids, reference, groups, layers, per_expert, batch_size: as the exact sweep's (the same units, the same
              tokens; ``per_expert``: an MoE block's experts one unit each)
    inputs:   the calibrated inputs (one :class:`PlanInputs` for every scheme, or ``{scheme name: PlanInputs}``)
    samples:  tokens drawn per position from the reference distribution, summed into one backward pass
    passes:   backward passes per batch, each with its own draws (the estimate averages them)
    kv_caches: KV cache formats (FP8, FP8_ATTN, ...) estimated too, one unit per attention layer as the exact KV
              sweep has them (:mod:`quantcore.evaluation.fisher_kv`); their rows come under ``"KV <format>"``
              (``sqnr_db`` NaN); ``kv_amax``: the calibrated K/V maxima a calibrated format needs;
              ``kv_layers``: only these attention modules
    seed:     of those draws

    ``kl_mean`` is the estimate, ``kl_mean_err`` its standard error over sequences (the sampling noise included),
    ``sqnr_db`` the unit's local output SQNR (exact, from the same products), ``top1_agree`` NaN (not estimated).
    The model is left as it was (no hook, no weight or ``requires_grad`` changed, no ``.grad`` written), also on error
    or cancel.
    """
    if _rotated(inputs):  # the model rotated once, every unit estimated in it
        from quantcore.algorithms.rotation import rotated_for_sweep

        swept = list(layers) if layers is not None else linear_layer_names(model)
        with rotated_for_sweep(model, inputs, swept, [get_scheme(s) for s in schemes]) as plain:
            return fisher_sensitivity(model, schemes, input_ids, reference, groups=groups, layers=layers,
                                      per_expert=per_expert, inputs=plain, samples=samples, passes=passes,
                                      kv_caches=kv_caches, kv_amax=kv_amax, kv_layers=kv_layers,
                                      batch_size=batch_size, seed=seed, progress=progress,
                                      should_cancel=should_cancel)
    resolved = _checked_schemes(schemes, samples, passes, kv_caches)
    ids = as_token_batch(input_ids)
    reference.check_tokens(ids)
    units = (sweep_units(linear_layer_names(model), groups=groups, only=layers, per_expert=per_expert)
             if resolved else [])
    if resolved and not units:
        raise PlanError("the sweep has no layer to quantize: the model has no nn.Linear layers")
    get_embeddings: Any = getattr(model, "get_input_embeddings", None)
    embeddings = get_embeddings() if get_embeddings is not None else None
    if not isinstance(embeddings, nn.Module):
        raise PlanError(f"{type(model).__name__} has no input embeddings to start the backward pass from")

    scheme_inputs = _scheme_inputs(inputs, resolved)
    quantized, unit_notes = _quantize_units(model, units, resolved, scheme_inputs, progress, should_cancel)
    kv = prepare_kv(model, kv_caches, kv_amax, kv_layers)

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
            _one_batch(model, embeddings, ids[s:e], reference, s, e, units, member_of, quantized, sums, samples,
                       passes, gen, kv)
            report_progress(progress, 0.2 + 0.8 * (bi + 1) / len(ranges), f"batch {bi + 1} of {len(ranges)}")
    finally:
        for p, flag in asked:
            p.requires_grad_(flag)

    return {**_linear_rows(units, resolved, sums, unit_notes, positions, samples, passes),
            **kv_rows(kv, positions, samples, passes)}


def _rotated(inputs: PlanInputs | Mapping[str, PlanInputs]) -> bool:
    """Whether ``inputs`` carry a rotation (the estimate then runs in the model rotated once for it, whole or
    streamed); PlanError for a rotation given per scheme."""
    if isinstance(inputs, Mapping):
        if any(getattr(i, "rotation", None) is not None for i in inputs.values()):
            raise PlanError("the Fisher estimate takes one rotation for all its schemes (one PlanInputs with it), "
                            "not one per scheme")
        return False
    return getattr(inputs, "rotation", None) is not None


def _sqnr(signal: float, noise: float) -> float:
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


class _Hooks:
    """One batch's hooks (``ids_shape``: its ``[b, L]``): a forward hook on each member named in ``install`` keeps its
    input and output and puts a hook on the output's gradient, which at the last pass (``current[0]``) adds each
    scheme's products to its unit's per-sequence sums (module docstring); :meth:`finish` hands them to ``sums``.
    The whole model's batch (:func:`_one_batch`) and a streamed block's (:mod:`quantcore.evaluation.fisher_streamed`)
    run the same hooks."""

    def __init__(self, ids_shape: Sequence[int], units: Sequence[Sequence[str]],
                 member_of: Mapping[str, tuple[int, int]], quantized: Sequence[Sequence[Sequence[_Member]]],
                 sums: Sequence[Sequence[_UnitSums]], passes: int, current: list[int]) -> None:
        self.b, self.length = int(ids_shape[0]), int(ids_shape[1])
        self.units, self.member_of, self.quantized, self.sums = units, member_of, quantized, sums
        self.passes, self.current = passes, current
        self.n_schemes = len(sums[0]) if sums else 0
        # member -> (its input, its unquantized output, a routed expert's token rows or None), for this batch
        self.kept: dict[str, tuple[Tensor, Tensor, Tensor | None]] = {}
        self.routed: dict[str, Tensor] = {}  # MoE block -> its top_k_index of this batch's call
        self.earlier: dict[str, list[Tensor]] = {}  # member -> its output gradients of the passes before the last
        # an input tensor several members read (q/k/v, gate/up) -> its members not yet done, and its quantizations so
        # far {(scheme, input key): quantized input}: one fake quantization a scheme for the group, not one a member
        self.readers: dict[tuple, int] = {}
        self.quantized_inputs: dict[tuple, dict[tuple, Tensor]] = {}
        # per unit and scheme, the per-position products [pass, b, L] summed over the members seen so far
        self.partial: list[list[Tensor | None]] = [[None] * self.n_schemes for _ in units]
        self.seen = [0] * len(units)
        self.per_seq = [[torch.zeros(self.b, dtype=torch.float64) for _ in range(self.n_schemes)] for _ in units]
        self.scratch = _Scratch()

    def on_grad(self, name: str, module: nn.Module) -> Callable[[Tensor], None]:
        ui, mi = self.member_of[name]
        b, length, n_schemes, passes = self.b, self.length, self.n_schemes, self.passes
        kept, earlier, readers, quantized_inputs = self.kept, self.earlier, self.readers, self.quantized_inputs
        quantized, sums, partial, seen, per_seq = self.quantized, self.sums, self.partial, self.seen, self.per_seq
        units, current, scratch = self.units, self.current, self.scratch

        def hook(g: Tensor) -> None:
            if current[0] < passes - 1:  # each quantized output is computed once, at the last pass, for all passes
                earlier.setdefault(name, []).append(g.detach().float())  # float(): a copy, never autograd's buffer
                return
            x, y, rows = kept.pop(name)
            source = _tensor_key(x)
            cache = quantized_inputs.get(source)
            if cache is None and readers.get(source, 0) > 1:  # the first of several members that read it
                cache = quantized_inputs[source] = {}
            with torch.inference_mode():
                grads = [*earlier.pop(name, []), g.detach().float()]  # P x [b, L, N], not stacked (no copy)
                signal = float(torch.linalg.vecdot(y.reshape(-1), y.reshape(-1)))
                # the quantized output, one tensor for every scheme of this member and the members after it (no
                # fresh tensor of the output's size a member, page-faulted in afresh: the head's is 200 MB)
                buffer: Tensor | None = scratch.take("output", (*x.shape[:-1], y.shape[-1]), x.dtype, x.device)
                for si in range(n_schemes):
                    member = quantized[ui][si][mi]
                    xq = None
                    if cache is not None and member.input_key is not None:
                        xq = cache.get((si, member.input_key))
                        if xq is None:
                            xq = cache[si, member.input_key] = member.quantized_input(module, x)
                    buffer = member.output(module, x, xq, buffer)
                    dy = buffer.float()
                    # [P, b, L]; a routed expert's [P, its tokens]: one row dot a pass, the same sums as one vecdot
                    # of the stacked gradients, bit for bit, without their copy or the [P, b, L, N] product
                    prod = _change_dots(dy, y, grads, scratch)
                    if rows is not None:  # back to the positions its tokens came from
                        prod = prod.new_zeros((prod.shape[0], b * length)).index_add_(1, rows, prod)
                        prod = prod.view(prod.shape[0], b, length)
                    acc = partial[ui][si]
                    partial[ui][si] = prod if acc is None else acc.add_(prod)
                    flat = dy.reshape(-1)
                    sums[ui][si].noise += float(torch.linalg.vecdot(flat, flat))
                    sums[ui][si].signal += signal
                    del dy, xq
                del grads, buffer
                readers[source] = readers.get(source, 1) - 1
                if readers[source] <= 0:
                    readers.pop(source, None)
                    quantized_inputs.pop(source, None)
                seen[ui] += 1
                if seen[ui] == len(units[ui]):
                    for si in range(n_schemes):
                        p = partial[ui][si]
                        assert p is not None
                        per_seq[ui][si] += 0.5 * p[:, :, :-1].double().square().sum(dim=(0, 2)).cpu()
                        partial[ui][si] = None
                    seen[ui] = 0

        return hook

    def keep(self, name: str) -> Callable[..., None]:
        def fwd(mod: nn.Module, args: Any, out: Tensor) -> None:
            x = args[0].detach()
            self.kept[name] = (x, out.detach().float(), _expert_rows(name, self.routed))
            source = _tensor_key(x)
            self.readers[source] = self.readers.get(source, 0) + 1
            out.register_hook(self.on_grad(name, mod))

        return fwd

    def route(self, block: str) -> Callable[..., None]:
        def pre(_mod: nn.Module, args: Any, kwargs: Any) -> None:
            index = args[1] if len(args) > 1 else kwargs.get("top_k_index")
            if isinstance(index, Tensor):
                self.routed[block] = index.detach()

        return pre

    def install(self, model: nn.Module, names: Sequence[str]) -> list[Any]:
        """The hooks on the members ``names`` (and the MoE blocks they route in); the handles to remove."""
        handles = []
        for block in {expert_block(n) for n in names} - {None}:
            assert block is not None
            handles.append(model.get_submodule(block).register_forward_pre_hook(self.route(block), with_kwargs=True))
        for name in names:
            handles.append(model.get_submodule(name).register_forward_hook(self.keep(name)))
        return handles

    def clear(self) -> None:
        self.kept.clear()
        self.earlier.clear()
        self.readers.clear()
        self.quantized_inputs.clear()

    def finish(self, unit_indices: Iterable[int]) -> None:
        """This batch's sequences added to ``sums`` for these units (every unit whose members were hooked)."""
        for ui in unit_indices:
            for si in range(self.n_schemes):
                self.sums[ui][si].per_seq.extend(self.per_seq[ui][si].tolist())


def _leaf(_mod: nn.Module, _args: Any, out: Tensor) -> Tensor:
    """The embeddings' output as the graph's only leaf that asks for grad."""
    return out.detach().requires_grad_(True)


def _one_batch(model: nn.Module, embeddings: nn.Module, ids: Tensor, reference: ReferenceCache, s: int, e: int,
               units: Sequence[Sequence[str]], member_of: Mapping[str, tuple[int, int]],
               quantized: Sequence[Sequence[Sequence[_Member]]], sums: Sequence[Sequence[_UnitSums]],
               samples: int, passes: int, gen: torch.Generator, kv: KvUnits | None = None) -> None:
    """One reference forward with grad and ``passes`` backward passes, each of ``samples`` tokens drawn a position;
    adds this batch's sequences to ``sums``."""
    current = [0]
    hooks = _Hooks(ids.shape, units, member_of, quantized, sums, passes, current)
    handles: list[Any] = [embeddings.register_forward_hook(_leaf)]
    try:
        handles += hooks.install(model, list(member_of))
        with torch.enable_grad(), kv_recorded(model, kv, passes, current):
            out = model(input_ids=ids.to(model_device(model)), use_cache=False)
            logits = getattr(out, "logits", None)
            if logits is None:
                raise PlanError(f"{type(model).__name__} returns no next-token logits: the Fisher estimate needs a "
                                "causal language model's head")
            _backward_sampled(logits, ids, reference, s, e, samples, passes, gen, current)
    finally:
        for h in handles:
            h.remove()
        hooks.clear()
    hooks.finish(range(len(units)))


def _backward_sampled(logits: Tensor, ids: Tensor, reference: ReferenceCache, s: int, e: int, samples: int,
                      passes: int, gen: torch.Generator, current: list[int],
                      after: Callable[[int], None] | None = None) -> None:
    """The reference check on ``logits`` (the batch ``ids`` = sequences ``s:e``), then ``passes`` backward passes of
    ``samples`` tokens drawn a position from its softmax (``current[0]``: the pass running); ``after(k)`` once pass
    ``k`` is through."""
    with torch.no_grad():
        ref = logits.detach().float()
        probs = torch.softmax(ref[:, :-1], dim=-1)
        _check_reference_by(probs, ref, ids, reference, s, e)
        del ref
    for k in range(passes):
        with torch.no_grad():
            grad = _sampled_gradient(probs, samples, gen, logits)
        current[0] = k
        logits.backward(grad, retain_graph=k < passes - 1)
        del grad
        if after is not None:
            after(k)


def _check_reference_by(probs: Tensor, logits: Tensor, ids: Tensor, reference: ReferenceCache, s: int,
                        e: int) -> None:
    """:func:`quantcore.evaluation.sweep_head.check_reference`'s test (the batch's per-token NLL within
    ``REFERENCE_NLL_TOL`` of the cached one, on average) on the NLL read off the softmax the draws come from,
    ``-log p(token)``, instead of a log-softmax of the whole batch's logits (a second pass over the vocabulary and a
    tensor of its size). Where a token's probability underflows to 0, or the gap is over the tolerance, the check
    itself decides, on the log-softmax (and words the error)."""
    p = probs.gather(-1, ids[:, 1:].to(probs.device).unsqueeze(-1)).squeeze(-1)
    gap = float((-torch.log(p).cpu() - reference.nll[s:e]).abs().mean())
    if not gap <= REFERENCE_NLL_TOL:  # NaN and inf included
        check_reference(logits, ids, reference, s, e)


# elements of the product a row dot forms at a time (512 kB in float32: a block of the change, of a gradient and
# their product stay in a core's L2)
ROW_DOT_ELEMENTS = 1 << 17


class _Scratch:
    """Buffers the hooks reuse, one per purpose, grown to the largest size asked for: a tensor written whole before
    it is read (a GEMM's ``out=``, a product summed at once) need not be a fresh allocation each time, whose pages the
    kernel maps and zeroes anew (on a CPU, more time than the arithmetic that fills them)."""

    def __init__(self) -> None:
        self._flat: dict[tuple, Tensor] = {}

    def take(self, purpose: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> Tensor:
        """A contiguous tensor of ``shape`` (uninitialized; valid until the next ``take`` of this purpose)."""
        n = math.prod(shape)
        flat = self._flat.get((purpose, dtype, device))
        if flat is None or flat.numel() < n:
            flat = self._flat[purpose, dtype, device] = torch.empty(n, dtype=dtype, device=device)
        return flat[:n].view(*shape)


def _row_dot(a: Tensor, b: Tensor, scratch: _Scratch | None = None) -> Tensor:
    """``torch.linalg.vecdot(a, b)`` over the last dimension (``(a * b).sum(-1)``), a block of rows at a time where
    the product is large (the head's 49k columns): each row's sum is the very one vecdot forms (bit-identical),
    without the product of the whole tensor (hundreds of MB, page-faulted afresh each call); with ``scratch``, every
    block's product is written into one reused buffer."""
    n = a.shape[-1]
    rows = max(1, ROW_DOT_ELEMENTS // max(n, 1))
    if not (a.is_contiguous() and b.is_contiguous() and a.shape == b.shape) or a.dim() < 2 \
            or (scratch is None and a.numel() <= ROW_DOT_ELEMENTS):
        return torch.linalg.vecdot(a, b)
    fa, fb = a.reshape(-1, n), b.reshape(-1, n)
    dtype = torch.result_type(a, b)
    out = torch.empty(fa.shape[0], dtype=dtype, device=a.device)
    product = None if scratch is None else scratch.take("product", (min(rows, fa.shape[0]), n), dtype, a.device)
    for i in range(0, fa.shape[0], rows):
        j = min(i + rows, fa.shape[0])
        if product is None:
            torch.linalg.vecdot(fa[i:j], fb[i:j], out=out[i:j])
        else:
            torch.sum(torch.mul(fa[i:j], fb[i:j], out=product[:j - i]), dim=-1, out=out[i:j])
    return out.view(a.shape[:-1])


def _change_dots(dy: Tensor, y: Tensor, grads: Sequence[Tensor], scratch: _Scratch) -> Tensor:
    """``dy -= y`` in place (the change of the output), then ``[_row_dot(g, dy) for g in grads]`` stacked, one block
    of rows at a time: a block's change is formed and dotted with every pass's gradient while it is in cache, instead
    of a pass over the whole output for the subtraction and one more a gradient. The same elementwise operations and
    per-row sums as apart (bit-identical)."""
    n = dy.shape[-1]
    if not (dy.dim() >= 2 and dy.is_contiguous() and y.is_contiguous() and y.shape == dy.shape
            and all(g.is_contiguous() and g.shape == dy.shape and g.dtype == dy.dtype for g in grads)):
        dy.sub_(y)
        return torch.stack([_row_dot(g, dy, scratch) for g in grads])
    fd, fy = dy.view(-1, n), y.view(-1, n)
    fg = [g.view(-1, n) for g in grads]
    total = fd.shape[0]
    rows = max(1, ROW_DOT_ELEMENTS // max(n, 1))
    out = torch.empty((len(grads), total), dtype=dy.dtype, device=dy.device)
    product = scratch.take("product", (min(rows, total), n), dy.dtype, dy.device)
    for i in range(0, total, rows):
        j = min(i + rows, total)
        block = fd[i:j].sub_(fy[i:j])
        for p, g in enumerate(fg):
            torch.sum(torch.mul(g[i:j], block, out=product[:j - i]), dim=-1, out=out[p, i:j])
    return out.view(len(grads), *dy.shape[:-1])


def _tensor_key(x: Tensor) -> tuple:
    """The same data for two views of one tensor (``detach()`` makes a new object a call): its storage, offset,
    shape, strides, dtype and version. Members that kept equal keys read the very same input; the inputs stay alive
    while a member that kept one is not done, so no other tensor can take the address meanwhile."""
    return (x.untyped_storage().data_ptr(), x.storage_offset(), tuple(x.shape), x.stride(), x.dtype, x._version)


def _expert_rows(name: str, routed: Mapping[str, Tensor]) -> Tensor | None:
    """The positions (into the batch's flattened tokens) of the rows a routed expert linear ``name`` ran on in this
    call, in the order :class:`quantcore.models.moe.LinearExperts` gathers them; None for any other linear."""
    block = expert_block(name)
    if block is None or block not in routed:
        return None
    index = routed[block]
    expert = int(name[len(block) + 1:].split(".", 1)[0])
    _pos, rows = torch.where(index.reshape(-1, index.shape[-1]).t() == expert)
    return rows


def _sampled_gradient(probs: Tensor, samples: int, gen: torch.Generator, logits: Tensor) -> Tensor:
    """The gradient at the logits of Σ_positions Σ_draws log p(t) for ``samples`` tokens t drawn from ``probs`` at
    every position: ``counts - samples * p`` (the last position, which predicts nothing scored, gets 0).

    Its covariance is ``samples`` times the softmax's Fisher, so one backward of it gives, per position, a product
    ``G · δy`` whose square is ``samples`` times an unbiased estimate of δzᵀ F δz (the draws are independent with
    mean 0: their cross terms vanish in expectation); several tokens in one pass make the counts closer to Gaussian
    than one token's ``e_t - p``, whose rare draws dominate a square."""
    flat = probs.reshape(-1, probs.shape[-1])
    drawn = torch.multinomial(flat, samples, replacement=True, generator=gen)
    grad = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    grad[:, -1].zero_()
    body = grad[:, :-1]  # a strided view (b > 1): written in place, no copy of it
    torch.mul(probs, -float(samples), out=body)
    drawn = drawn.view(*body.shape[:-1], samples)
    body.scatter_add_(-1, drawn, torch.ones_like(drawn, dtype=body.dtype))
    return grad.to(logits.dtype)
