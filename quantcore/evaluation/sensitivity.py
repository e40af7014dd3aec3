"""Per-layer sensitivity: quantize one layer (or one fusion group) at a time and measure the damage.

For every *unit* — a linear layer, or with ``groups=True`` a fusion group (q/k/v,
gate/up of one block) that a serving engine runs as one GEMM — the sweep reports
the mean per-token KL(p_ref || p_quant) of the whole model with only that unit
quantized, the top-1 agreement, and the unit's *local* output SQNR (its quantized
output against its unquantized output on the very same input).

The same loop sweeps the KV cache (:func:`kv_sensitivity_sweep`): a unit is one attention layer whose K
and V (and, for an FP8 attention format, its attention) go through a KV cache format while every other
layer keeps the model's dtype, which ranks the layers a plan's ``kv_cache_skip`` should keep first.

How it stays cheap
    For each batch of evaluation sequences the unquantized model runs once with a
    forward hook on every decoder block, keeping each block's output (= the next
    block's input: the hidden states at every block boundary). A unit in block b
    then re-runs only blocks b..N-1, the final norm and the head: blocks 0..b-1 are
    *replayed* — their ``forward`` is temporarily replaced by one that returns the
    kept output — while the model's own ``forward`` still computes the attention
    masks, position embeddings and per-layer arguments (Gemma3's sliding-window vs
    global layers get their own masks and rotary tables this way, with no
    architecture-specific code) and its own tail (Gemma3's final logit
    softcapping). A unit outside the decoder blocks that runs after them
    (``lm_head``) replays every block and runs only the head.

    The reference log-probs for the KL come from that same unquantized pass in
    float32, so a unit whose quantization leaves its logits unchanged gets a KL of
    exactly 0, and no float16 storage error enters the per-layer numbers (which are
    much smaller than a whole plan's). KL is computed without materializing log-probs:
    KL = (lse_q - lse_ref) - sum_v p_ref(v) (z_q(v) - z_ref(v)), with z the logits.
    The :class:`~quantcore.evaluation.reference.ReferenceCache` fixes the evaluation tokens and
    guards against a cache made with other weights (the recomputed reference NLL
    must match it).

The head a chunk of positions at a time
    As in scoring, no ``[B, L, V]`` tensor is held (issue #42): a pass stops at the head's input (after the final
    norm: ``[B*L, H]``, :class:`~quantcore.evaluation.sweep_head.SweepHead`), and the head runs on a chunk of about
    ``LOGIT_CHUNK_ELEMENTS`` logits at a time. The units' head inputs wait in groups
    (:mod:`quantcore.evaluation.sweep_head`); per group, each chunk of the reference's logits and probabilities is
    recomputed once and every unit of the group compared with it (``HeadQueue``). A unit that changes the head
    (``lm_head`` quantized) keeps its head past its pass, without a copy (``SweepHead.frozen``).
    Models whose logits are not exactly ``lm_head(body)`` run whole and their logits are
    cut into the same chunks.

Supported architectures
    Causal LMs whose decoder blocks form one ``nn.ModuleList`` that the model's
    ``forward`` calls in order, and whose blocks have no side effects (no KV cache:
    every pass runs with ``use_cache=False``): Llama, Mistral, Qwen2/Qwen3, Gemma,
    Gemma2, Gemma3 (text) — ``model.model.layers`` — and the same list under
    ``model.model.language_model.layers``, ``model.transformer.h`` (GPT-2 style)
    or ``model.gpt_neox.layers``. Anything else raises a PlanError naming the
    places looked at.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from quantcore.algorithms.inputs import NO_INPUTS, PlanInputs
from quantcore.algorithms.rotation import ONLINE_ROTATION
from quantcore.errors import PlanError
from quantcore.evaluation.batches import (
    Progress,
    ShouldCancel,
    as_token_batch,
    batch_ranges,
    check_cancel,
    report_progress,
)
from quantcore.evaluation.reference import ReferenceCache
from quantcore.evaluation.scoring import plan_applied
from quantcore.evaluation.statistics import Estimate, block_mean
from quantcore.evaluation.sweep_head import (
    HeadBatch,
    HeadQueue,
    SweepHead,
)
from quantcore.models.decoder import DecoderStack, find_decoder_blocks
from quantcore.planning.plans import group_label
from quantcore.schemes.fusion import fusion_units
from quantcore.schemes.presets import get_scheme
from quantcore.schemes.specs import Scheme

SQNR_ROW_CHUNK = 4096  # rows of a linear's input processed at a time when computing its local SQNR


@dataclass
class SensitivityRow:
    """One unit of a sensitivity sweep.

    layer:      unit label: the layer name, or a group label like ``model.layers.3.self_attn.{q,k,v}_proj``
    layers:     the linear layers quantized together in this unit
    kl_mean:    mean per-token KL(p_ref || p_quant) with only this unit quantized (nats)
    top1_agree: share of positions whose argmax token equals the reference's
    sqnr_db:    local output SQNR of the unit, 10 log10(sum y^2 / sum (y - y_q)^2) over all its
                members and tokens; +inf when its output is unchanged
    note:       for people: e.g. SmoothQuant could not be applied to this unit
    kl_mean_err, top1_agree_err: standard errors of kl_mean and top1_agree over per-sequence blocks
                (:func:`quantcore.evaluation.statistics.block_mean`); None with one sequence
    """

    layer: str
    layers: list[str]
    kl_mean: float
    top1_agree: float
    sqnr_db: float
    note: str = ""
    kl_mean_err: float | None = None
    top1_agree_err: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict; an infinite SQNR (no noise at all) and an unestimated top-1 agreement become ``None``."""
        return {
            "layer": self.layer,
            "layers": list(self.layers),
            "kl_mean": self.kl_mean,
            "kl_mean_err": self.kl_mean_err,
            "top1_agree": None if math.isnan(self.top1_agree) else self.top1_agree,  # NaN: not estimated (Fisher)
            "top1_agree_err": self.top1_agree_err,
            "sqnr_db": self.sqnr_db if math.isfinite(self.sqnr_db) else None,
            "note": self.note,
        }


# ---------------------------------------------------------------------- model structure


def linear_layer_names(model: nn.Module) -> list[str]:
    """Names of every ``nn.Linear`` in ``model``, in module order."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def sweep_units(
    layer_names: Sequence[str], *, groups: bool = True, only: Sequence[str] | None = None, per_expert: bool = False
) -> list[list[str]]:
    """The units of a sweep over ``layer_names`` (model order), each a list of layer names.

    With ``groups``, the members of a fusion group form one unit. ``only`` restricts the
    sweep to these layers; with ``groups``, a unit is kept when any of its members is
    named, so naming ``q_proj`` sweeps the whole q/k/v group (they are served as one GEMM).
    Unknown names in ``only`` raise PlanError naming them. ``per_expert`` (with ``groups``): an MoE block's routed
    experts are one unit each (an expert's gate/up/down together) instead of one unit for the whole block.
    """
    names = list(layer_names)
    if only is not None:
        known = set(names)
        unknown = [n for n in only if n not in known]
        if unknown:
            raise PlanError(
                f"layer name(s) the model does not have: {', '.join(map(repr, unknown[:10]))}"
                f"{' ...' if len(unknown) > 10 else ''}; names look like {', '.join(map(repr, names[:3]))}"
            )
    units = fusion_units(names) if groups else [[n] for n in names]
    if groups and per_expert:
        units = [part for u in units for part in _experts_apart(u)]
    if only is not None:
        wanted = set(only)
        units = [u for u in units if wanted.intersection(u)]
    return units


def _experts_apart(unit: list[str]) -> list[list[str]]:
    """An MoE block's unit as one unit per expert (``experts.3.gate_proj``, ``.up_proj``, ``.down_proj``); any other
    unit as it is."""
    from quantcore.schemes.fusion import expert_block, expert_parts

    if len(unit) < 2 or any(expert_block(n) is None for n in unit):
        return [unit]
    return expert_parts(unit)


# ---------------------------------------------------------------------- replay and capture


@contextmanager
def _replayed(blocks: Iterable[nn.Module], outputs: Sequence[Any]) -> Iterator[None]:
    """Make ``blocks[i]`` return ``outputs[i]`` without computing anything, for the block."""
    saved: list[tuple[nn.Module, bool, Any]] = []
    try:
        for block, out in zip(blocks, outputs, strict=True):
            saved.append((block, "forward" in block.__dict__, block.__dict__.get("forward")))

            def replay(*args: Any, _out: Any = out, **kwargs: Any) -> Any:
                return _out

            block.forward = replay  # an instance attribute shadows the class's forward
        yield
    finally:
        _unreplay(saved)


def _unreplay(saved: list[tuple[nn.Module, bool, Any]]) -> None:
    for block, had, old in saved:
        if had:
            block.forward = old
        else:
            del block.forward


def _block_outputs(head: SweepHead, stack: DecoderStack, input_ids: Tensor) -> tuple[Tensor, list[Any]]:
    """The unquantized head inputs (:meth:`SweepHead.inputs`) and the output of every decoder block for
    ``input_ids``."""
    model = head.model
    outputs: list[Any] = [None] * len(stack.blocks)
    handles = []
    for i, block in enumerate(stack.blocks):

        def keep(_mod: nn.Module, _args: Any, out: Any, _i: int = i) -> None:
            outputs[_i] = out

        handles.append(block.register_forward_hook(keep))
    try:
        x = head.inputs(input_ids)
    finally:
        for h in handles:
            h.remove()
    missing = [i for i, o in enumerate(outputs) if o is None]
    if missing:
        raise PlanError(
            f"{type(model).__name__}.forward did not call decoder block(s) {missing} of {stack.prefix}; "
            "sensitivity needs a model that runs every block on every pass"
        )
    return x, outputs


class _LocalError:
    """Accumulates sum y^2 and sum (y - y_q)^2 of a unit's members over every call (float64).

    Hooks on each member: a forward pre-hook placed *first* keeps the unquantized
    input (activation fake-quant hooks run after it), a forward hook takes the
    quantized output; the unquantized output is recomputed with the member's weight
    as it was before fake quantization (after smoothing, so that the same input
    gives the same exact product). The output may come a chunk of rows at a time
    after one input (the sweep's head, :class:`SweepHead`): each takes the next rows of it.
    """

    def __init__(self) -> None:
        self.signal = 0.0
        self.noise = 0.0
        self._weights: dict[str, tuple[Tensor, Tensor | None]] = {}
        self._handles: list[Any] = []

    def snapshot(self, model: nn.Module, names: Sequence[str]) -> None:
        for n in names:
            m: Any = model.get_submodule(n)
            bias = getattr(m, "bias", None)
            self._weights[n] = (m.weight.detach().clone(), None if bias is None else bias.detach().clone())

    def attach(self, model: nn.Module, names: Sequence[str]) -> None:
        for n in names:
            m = model.get_submodule(n)
            weight, bias = self._weights[n]
            pending: list[Tensor] = []

            def pre(_mod: nn.Module, args: Any, _pending: list[Tensor] = pending) -> None:
                # first of the pre-hooks: an online rotation (R4, quantcore.algorithms.rotation) comes after
                rotate = getattr(_mod, ONLINE_ROTATION, None)
                _pending.append(args[0].detach() if rotate is None else rotate(args[0].detach()))

            def post(
                _mod: nn.Module,
                _args: Any,
                out: Tensor,
                _pending: list[Tensor] = pending,
                _w: Tensor = weight,
                _b: Tensor | None = bias,
            ) -> None:
                x = _pending[-1].reshape(-1, _pending[-1].shape[-1])
                rows = out.numel() // out.shape[-1]
                if rows < x.shape[0]:
                    _pending[-1] = x[rows:]  # a chunk of the output: the rest of the input waits for the next
                else:
                    _pending.pop()
                self._add(x[:rows], out.detach(), _w, _b)

            self._handles.append(m.register_forward_pre_hook(pre, prepend=True))
            self._handles.append(m.register_forward_hook(post))

    def _add(self, x: Tensor, y_q: Tensor, weight: Tensor, bias: Tensor | None) -> None:
        x2 = x.reshape(-1, x.shape[-1])
        yq2 = y_q.reshape(-1, y_q.shape[-1])
        for s in range(0, x2.shape[0], SQNR_ROW_CHUNK):
            y = F.linear(x2[s : s + SQNR_ROW_CHUNK].to(weight.dtype), weight, bias).float()
            # squares in float32 (relative error 1e-7), sums accumulated in float64
            self.signal += float(y.square().sum(dtype=torch.float64))
            self.noise += float(y.sub_(yq2[s : s + SQNR_ROW_CHUNK]).square_().sum(dtype=torch.float64))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @property
    def sqnr_db(self) -> float:
        if self.noise == 0.0:
            return math.inf
        if self.signal == 0.0:
            return -math.inf
        return 10.0 * math.log10(self.signal / self.noise)


# ---------------------------------------------------------------------- the sweep


def sensitivity_sweep(
    model: nn.Module,
    scheme: Scheme | str,
    input_ids: Tensor,
    reference: ReferenceCache,
    *,
    groups: bool = True,
    layers: Sequence[str] | None = None,
    per_expert: bool = False,
    inputs: PlanInputs = NO_INPUTS,
    batch_size: int | None = None,
    progress: Progress | None = None,
    should_cancel: ShouldCancel | None = None,
) -> list[SensitivityRow]:
    """Quantize one unit at a time with ``scheme``; rows sorted by ``kl_mean``, largest first.

    input_ids:  evaluation tokens ``[S, L]``, the ones ``reference`` was computed on
    groups:     sweep fusion groups (q/k/v, gate/up) as one unit each (default) or every layer alone
    layers:     restrict the sweep to these linear layers (default: every ``nn.Linear``)
    per_expert: an MoE block's routed experts one unit each, not the whole block as one (:func:`sweep_units`)
    inputs:     the calibrated inputs each unit is quantized with (:class:`quantcore.algorithms.inputs.PlanInputs`, as
                :func:`quantcore.evaluation.scoring.plan_applied` reads them): ``act_amax`` / ``act_channel_max`` for
                static activation scales and SmoothQuant; ``weight_hessians`` of every swept layer when ``scheme``
                rounds with GPTQ (:func:`quantcore.algorithms.gptq.collect_hessians`), each unit rounded once and
                reused for every batch; ``gptq_cache``, GPTQ-rounded weights of the swept layers, each rounded alone
                or in its unit, filled with those rounded here (a layer in it needs no Hessian; None: a fresh dict);
                ``awq``, AWQ's factors of the swept layers when ``scheme`` scales with AWQ
                (:func:`quantcore.algorithms.awq.awq_search`); ``parallel``, the GPUs the plan will be served on: each
                unit is quantized as there (a row-parallel layer's dynamic activation scale over each GPU's share of
                its input), so an automatic plan for that many GPUs adds up that many GPUs' KLs; None: one GPU
    batch_size: sequences per pass (default: the reference's)

    The model is restored exactly after every unit, also on error or cancel. ``inputs.rotation``: the model is
    rotated once for the whole sweep (:func:`quantcore.algorithms.rotation.rotated_for_sweep`; the reference stays
    the unrotated model's, the same function to float tolerance) and every unit quantized in it.
    """
    scheme = get_scheme(scheme)
    if inputs.rotation is not None:
        from quantcore.algorithms.rotation import rotated_for_sweep

        swept = list(layers) if layers is not None else linear_layer_names(model)
        with rotated_for_sweep(model, inputs, swept, [scheme]) as plain:
            return sensitivity_sweep(model, scheme, input_ids, reference, groups=groups, layers=layers,
                                     per_expert=per_expert, inputs=plain, batch_size=batch_size, progress=progress,
                                     should_cancel=should_cancel)
    ids = as_token_batch(input_ids)
    reference.check_tokens(ids)
    stack = find_decoder_blocks(model)
    all_linears = linear_layer_names(model)
    units = sweep_units(all_linears, groups=groups, only=layers, per_expert=per_expert)
    if not units:
        raise PlanError("the sweep has no layer to quantize: the model has no nn.Linear layers")

    get_head: Any = getattr(model, "get_output_embeddings", None)
    output_embeddings = get_head() if get_head is not None else None
    head_names = {
        n for n, m in model.named_modules() if output_embeddings is not None and m is output_embeddings
    }

    def start_block(unit: Sequence[str]) -> int:
        idx = [stack.block_of(n) for n in unit]
        inside = [i for i in idx if i is not None]
        if len(inside) == len(unit):
            return min(inside)
        if all(i is not None or n in head_names for n, i in zip(unit, idx, strict=True)):
            return min(inside) if inside else len(stack.blocks)
        return 0  # position unknown (e.g. a projection before the blocks): run everything

    starts = [start_block(u) for u in units]
    local = [_LocalError() for _ in units]
    if inputs.gptq_cache is None:
        inputs = inputs.replace(gptq_cache={})
    notes: list[list[str]] = [[] for _ in units]

    def apply_unit(ui: int, bi: int, ctx: ExitStack) -> None:
        unit, err = units[ui], local[ui]
        applied = ctx.enter_context(
            plan_applied(
                model,
                {n: scheme for n in unit},
                inputs=inputs,
                before_quantize=lambda m: err.snapshot(m, unit),
            )
        )
        if bi == 0:
            notes[ui] = list(applied.notes)
        err.attach(model, unit)
        ctx.callback(err.detach)

    kl, agree = _one_at_a_time(model, stack, ids, reference, [group_label(u) for u in units], starts, apply_unit,
                               batch_size=batch_size, progress=progress, should_cancel=should_cancel)
    rows = [
        SensitivityRow(
            layer=group_label(unit),
            layers=list(unit),
            kl_mean=kl[i].value,
            top1_agree=agree[i].value,
            sqnr_db=local[i].sqnr_db,
            note="; ".join(notes[i]),
            kl_mean_err=kl[i].err,
            top1_agree_err=agree[i].err,
        )
        for i, unit in enumerate(units)
    ]
    rows.sort(key=lambda r: r.kl_mean, reverse=True)
    return rows


def _one_at_a_time(
    model: nn.Module,
    stack: DecoderStack,
    ids: Tensor,
    reference: ReferenceCache,
    labels: Sequence[str],
    starts: Sequence[int],
    apply_unit: Callable[[int, int, ExitStack], None],
    *,
    batch_size: int | None,
    progress: Progress | None,
    should_cancel: ShouldCancel | None,
) -> tuple[list[Estimate], list[Estimate]]:
    """Mean KL and top-1 agreement (± their per-sequence block errors) of the model with one unit at a time changed,
    against its unquantized pass.

    For every batch: one unquantized pass keeps each block's output and the head's input (:class:`SweepHead`), whose
    logits are checked against the cache a chunk of positions at a time (:class:`HeadBatch`); then per unit
    ``apply_unit(unit index, batch index, exit stack)`` enters whatever changes the model for that unit on the stack,
    the blocks before ``starts[unit]`` are replayed, and the rest runs up to the head's input (the unit's head kept
    where it changed it). The stack unwinds (restoring the model) before the next unit, also on error or cancel. The
    units' head inputs wait in groups and each group's KL is taken a chunk of logits at a time (:class:`HeadQueue`):
    no ``[B, L, V]`` tensor is held."""
    ranges = batch_ranges(ids.shape[0], reference.batch_size if batch_size is None else batch_size)
    kl_seq: list[list[float]] = [[] for _ in labels]  # per unit, the KL summed over each sequence
    agree_seq: list[list[float]] = [[] for _ in labels]  # and its top-1 agreements
    per_sequence = 1
    total = len(ranges) * len(labels)
    done_units = 0
    pace = SweepPace(_pass_work(model, stack, starts), len(ranges))
    head = SweepHead(model)
    for bi, (s, e) in enumerate(ranges):
        check_cancel(should_cancel, f"sensitivity sweep (batch {bi + 1} of {len(ranges)}, reference pass)")
        ref_x, outputs = _block_outputs(head, stack, ids[s:e])

        def done(ui: int, k: list[float], a: list[float], positions: int, seconds: float, bi: int = bi) -> None:
            nonlocal done_units, per_sequence
            kl_seq[ui] += k
            agree_seq[ui] += a
            per_sequence = positions
            done_units += 1
            pace.timed(ui, seconds)
            left = time_left_text(pace.left_s(bi, ui)) if done_units < total else ""
            report_progress(progress, done_units / total, f"{labels[ui]} ({done_units} of {total}{left})")

        queue = HeadQueue(HeadBatch(head, ref_x, ids[s:e], reference, s, e), done)
        for ui, label in enumerate(labels):
            check_cancel(should_cancel, f"sensitivity sweep (unit {ui + 1} of {len(labels)}: {label})")
            unit_started = time.perf_counter()
            before = head.parameters_now()
            with ExitStack() as ctx:
                apply_unit(ui, bi, ctx)
                ctx.enter_context(_replayed(stack.blocks[: starts[ui]], outputs[: starts[ui]]))
                x = head.inputs(ids[s:e])
                state = head.frozen(before)  # the unit's head, where it changed it (lm_head quantized)
            queue.add(ui, x, state, time.perf_counter() - unit_started)
            del x, state
        queue.flush()
        del queue, ref_x, outputs

    def estimate(sums: list[float]) -> Estimate:  # the mean over all positions, its error over sequences
        return Estimate(math.fsum(sums) / (len(sums) * per_sequence),
                        block_mean(np.asarray(sums)[:, None] / per_sequence).err)

    return [estimate(k) for k in kl_seq], [estimate(a) for a in agree_seq]


def _pass_work(model: nn.Module, stack: DecoderStack, starts: Sequence[int]) -> list[float]:
    """Each unit's pass in blocks' worth of work: the blocks from its own on (the ones before are replayed) plus the
    head, weighed as its weights against a block's (SmolLM2's 49,152-row head: about 8 blocks)."""
    per_block = sum(p.numel() for b in stack.blocks for p in b.parameters()) / max(len(stack.blocks), 1)
    get_head: Any = getattr(model, "get_output_embeddings", None)
    head = get_head() if get_head is not None else None
    weight = getattr(head, "weight", None)
    head_blocks = weight.numel() / per_block if weight is not None and per_block else 1.0
    return [len(stack.blocks) - start + head_blocks for start in starts]


class SweepPace:
    """A sweep's time left from the units timed so far. A unit early in the model runs more blocks than a late one,
    and every unit also pays for its head pass, its quantization and its KL: each unit's time is fitted as
    ``a + b × work`` (:func:`_pass_work`) over the units timed, and the units left are summed on that line."""

    def __init__(self, work: Sequence[float], batches: int) -> None:
        self.work, self.batches = list(work), batches
        self.xs: list[float] = []
        self.ys: list[float] = []

    def timed(self, unit: int, seconds: float) -> None:
        self.xs.append(self.work[unit])
        self.ys.append(seconds)

    def left_s(self, batch: int, unit: int) -> float:
        """Seconds left after ``unit`` of ``batch`` (both from 0)."""
        rest = self.work[unit + 1:] + self.work * (self.batches - batch - 1)
        n = len(self.ys)
        if not n or not rest:
            return 0.0
        mx, my = sum(self.xs) / n, sum(self.ys) / n
        var = sum((x - mx) ** 2 for x in self.xs)
        b = sum((x - mx) * (y - my) for x, y in zip(self.xs, self.ys, strict=True)) / var if var > 0 else 0.0
        a = my - b * mx
        if b <= 0:  # no slope seen yet (one unit, or noise): every unit as long as the mean
            a, b = my, 0.0
        elif a < 0:  # a line through 0 instead: time in proportion to work
            a, b = 0.0, my / mx
        return a * len(rest) + b * sum(rest)


def time_left_text(seconds: float) -> str:
    """", about 40 s left" / ", about 3 min left" / ", about 1.5 h left": a sweep's remaining time
    (:class:`SweepPace`) in the unit a person would use."""
    if seconds < 90:
        return f", about {max(1, round(seconds))} s left"
    if seconds < 90 * 60:
        return f", about {round(seconds / 60)} min left"
    return f", about {seconds / 3600:.1f} h left"


def kv_sensitivity_sweep(
    model: nn.Module,
    kv_cache: str,
    input_ids: Tensor,
    reference: ReferenceCache,
    *,
    amax: Any = None,
    layers: Sequence[str] | None = None,
    batch_size: int | None = None,
    progress: Progress | None = None,
    should_cancel: ShouldCancel | None = None,
) -> list[SensitivityRow]:
    """Store one attention layer's K and V at a time in the KV cache format ``kv_cache`` (with an FP8 attention
    format, that layer's attention in FP8 too); rows sorted by ``kl_mean``, largest first: which layers a plan
    should keep out of its cache (``kv_cache_skip``). ``amax``: the calibrated K/V maxima a calibrated format
    needs (:func:`quantcore.evaluation.scoring.calibrate_kv_cache`). Units are attention modules; ``sqnr_db`` is NaN.
    ``layers``: sweep only these attention modules (a shard of the sweep), every other one kept out of the cache."""
    from quantcore.evaluation.kvcache import get_kv_format, kv_cache_quantized
    from quantcore.models.decoder import attention_modules

    kv = get_kv_format(kv_cache)
    if kv.is_identity:
        raise PlanError("a KV cache sweep needs a quantized format (FP8, FP8_ATTN, ...); AUTO changes nothing")
    ids = as_token_batch(input_ids)
    reference.check_tokens(ids)
    stack = find_decoder_blocks(model)
    every = list(attention_modules(model))
    if not every:
        raise PlanError("this model has no attention module with k_proj and v_proj: no KV cache to sweep")
    unknown = sorted(set(layers or ()) - set(every))
    if unknown:
        raise PlanError(f"attention module(s) the model does not have: {', '.join(map(repr, unknown[:10]))}")
    swept = every if layers is None else [n for n in every if n in set(layers)]
    starts = [stack.block_of(n) or 0 for n in swept]

    def apply_unit(ui: int, bi: int, ctx: ExitStack) -> None:
        ctx.enter_context(kv_cache_quantized(model, kv, amax=amax, skip=set(every) - {swept[ui]}))

    kl, agree = _one_at_a_time(model, stack, ids, reference, swept, starts, apply_unit, batch_size=batch_size,
                               progress=progress, should_cancel=should_cancel)
    rows = [SensitivityRow(layer=n, layers=[n], kl_mean=kl[i].value, top1_agree=agree[i].value, sqnr_db=math.nan,
                           kl_mean_err=kl[i].err, top1_agree_err=agree[i].err)
            for i, n in enumerate(swept)]
    rows.sort(key=lambda r: r.kl_mean, reverse=True)
    return rows
