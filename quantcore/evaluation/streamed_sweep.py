"""The sensitivity sweep on a :class:`~quantcore.models.streaming.StreamedModel`: every unit's KL with one load of each
decoder block per sweep, the same rows as :func:`quantcore.evaluation.sensitivity.sensitivity_sweep` (linear units)
and :func:`~quantcore.evaluation.sensitivity.kv_sensitivity_sweep` (one attention layer's KV cache at a time).

How it runs
    One pass over the blocks. The unquantized hidden states entering the current block (the *reference* states) are
    kept for every evaluation sequence, and so are each pending unit's own (*perturbed*) states. While block ``j`` is
    loaded, a unit whose first changed block is ``j`` runs it from the reference states with its change applied (its
    linears quantized, or its KV cache format on), and every unit that started earlier advances its perturbed states
    through the unchanged block; then the reference states advance. After the last block the final norm gives, one
    batch at a time, the head's inputs of the reference and of each unit (a unit on the head, ``lm_head``, is
    quantized there and its head kept), and the head runs a chunk of positions at a time, as in the whole-model sweep
    (:class:`~quantcore.evaluation.sweep_head.HeadQueue`): the reference's and a unit's chunk of logits at once,
    never ``[B, L, V]``. A unit's work is the whole sweep's (the blocks from its own on, the head);
    what is saved is the loads: ``N`` block reads instead of one for every block a unit runs.

Where the states live
    One ``[S, L, H]`` tensor per unit and one for the reference, in the job's dtype: on the job's device while they
    fit its budget beside the embedding, the head and the largest block, then in host memory (on an accelerator, up to
    half of what the host has available), then in memory-mapped files in the job's scratch folder (removed at the end,
    and by the stale-job sweep when a worker dies). The sweep's peak memory is therefore the streamed model's plus what
    the budget allows of the states.

Same results
    Each block sees exactly the batches of ``batch_size`` sequences a whole-model sweep gives it, through the model's
    own forward (:mod:`quantcore.models.streaming`); a unit is quantized once per block pass instead of once per batch
    (the same deterministic rounding), and each unit's KL and SQNR sums are accumulated in the same order. On a CPU the
    rows are bit-identical to the whole-model sweep's (``tests/quantcore/evaluation/test_streamed_sweep.py``).

GPTQ and AWQ
    A scheme that rounds with GPTQ has its swept layers rounded before the sweep, block by block on the calibration
    tokens (``calibration_ids``), by the streamed score's own :func:`~quantcore.algorithms.streamed_rounding.
    round_gptq_streamed`: each block's Hessians from the unquantized model's inputs, batch for batch as
    :func:`~quantcore.algorithms.gptq.collect_hessians` takes them, the roundings into ``inputs.gptq_cache``, which
    the units then read. A layer's rounding reads the layers applied beside it (its fusion group's schemes, a fold
    into its rows, the plan's AWQ layers: :func:`~quantcore.algorithms.gptq.rounding_inputs`), and a sweep applies
    one unit at a time, so the units are gathered into as few rounding passes as round every layer exactly as its
    unit alone does (:func:`_rounding_plans`): one pass for fusion-group units, at most three (q, k, v) for single
    layers. A scheme that scales with AWQ reads ``inputs.awq``, searched beforehand (streamed:
    :func:`~quantcore.algorithms.streamed_rounding.awq_search_streamed`); its folds stay inside the unit's block.

Rotated
    ``inputs.rotation``: the streamed model is rotated once for the whole sweep, as the whole-model sweep rotates the
    whole model (:func:`quantcore.algorithms.rotation.rotated_for_sweep`): the embedding, final norm and head at
    once, each block as it loads (its folds dropped when it is freed), and every unit quantized in it; the reference
    states are the rotated model's unquantized pass, as the whole sweep's are.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
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
    report_progress,
)
from quantcore.evaluation.reference import ReferenceCache
from quantcore.evaluation.scoring import plan_applied
from quantcore.evaluation.sensitivity import (
    SensitivityRow,
    _LocalError,
    _replayed,
    linear_layer_names,
    sweep_units,
    time_left_text,
)
from quantcore.evaluation.statistics import Estimate, block_mean
from quantcore.evaluation.sweep_head import HeadBatch, HeadQueue, SweepHead
from quantcore.models.streaming import HiddenStates, StreamedModel, StreamPlan, available_memory
from quantcore.planning.plans import group_label
from quantcore.schemes.presets import get_scheme
from quantcore.schemes.specs import Scheme

BLOCKS_SHARE = 0.9  # of the sweep's progress bar: the blocks; the rest is the head's batches
ROUNDING_SHARE = 0.2  # of a GPTQ sweep's progress bar: its rounding passes; the rest is the sweep's

# enter(unit index, pass, exit stack): what changes the model for the unit in pass ``j`` (a block index, or the number
# of blocks for the head's pass), entered on the stack; the stack unwinds before the block is freed
Enter = Callable[[int, int, ExitStack], None]


class _Placer:
    """Where each new ``[S, L, H]`` state goes: the device while the budget has room beside the resident part and the
    largest block, then host memory (an accelerator's job, up to half of the host's available memory), then a
    memory-mapped scratch file."""

    def __init__(self, streamed: StreamedModel, shape: Sequence[int]) -> None:
        self.streamed, self.shape = streamed, tuple(shape)
        count = 1
        for n in shape:
            count *= int(n)
        self.bytes = count * (torch.finfo(streamed.dtype).bits // 8)
        if streamed.budget is None:
            self.device_room = math.inf
        else:
            biggest = max(streamed.block_bytes(i) for i in range(len(streamed.stack.blocks)))
            self.device_room = streamed.budget - streamed.resident_bytes() - biggest
        self.host_room = available_memory("cpu") / 2 if streamed.device.type != "cpu" else 0.0
        self.where: dict[str, int] = {}

    def new(self, tag: str) -> HiddenStates:
        streamed = self.streamed
        if self.bytes <= self.device_room:
            self.device_room -= self.bytes
            where = str(streamed.device)
        elif self.bytes <= self.host_room:
            self.host_room -= self.bytes
            where = "cpu"
        else:
            where = "file"
        self.where[where] = self.where.get(where, 0) + 1
        if where != "file":
            return HiddenStates(self.shape, streamed.dtype, where)
        return streamed._states(StreamPlan("file", self.bytes), self.shape, tag)

    def text(self) -> str:
        return ", ".join(f"{n} in {w}" for w, n in self.where.items())


def _final_inputs(streamed: StreamedModel, head: SweepHead, ids: Tensor, states: Tensor) -> Tensor:
    """The head's inputs (:meth:`quantcore.evaluation.sweep_head.SweepHead.inputs`: after the final norm) of the final
    hidden states ``states`` of the batch ``ids``: the model's own forward with every block replayed (the embedding,
    masks and final norm run as in a whole pass)."""
    blocks = streamed.stack.blocks
    with _replayed(blocks, [streamed._wrap(states.to(streamed.device))] * len(blocks)):
        return head.inputs(ids)


def _streamed_one_at_a_time(
    streamed: StreamedModel,
    ids: Tensor,
    reference: ReferenceCache,
    labels: Sequence[str],
    starts: Sequence[int],
    enter: Enter,
    *,
    batch_size: int | None,
    progress: Progress | None,
    should_cancel: ShouldCancel | None,
) -> tuple[list[Estimate], list[Estimate]]:
    """Mean KL and top-1 agreement (± their per-sequence block errors) of the model with one unit at a time changed
    from block ``starts[unit]`` on (the number of blocks: only the head), against its unquantized pass (module
    docstring); :func:`quantcore.evaluation.sensitivity._one_at_a_time`'s results, streamed."""
    n_blocks = len(streamed.stack.blocks)
    device = streamed.device
    ids = ids.detach().to("cpu", torch.int64)
    n, length = ids.shape
    ranges = batch_ranges(n, reference.batch_size if batch_size is None else batch_size)
    hidden = int(streamed.config.get_text_config().hidden_size)
    placer = _Placer(streamed, (n, length, hidden))
    kl_seq: list[list[float]] = [[] for _ in labels]
    agree_seq: list[list[float]] = [[] for _ in labels]
    per_sequence = 1
    started = time.perf_counter()
    try:
        ref = placer.new("reference")
        states: dict[int, HiddenStates] = {}
        for j in range(n_blocks):
            check_cancel(should_cancel, f"streamed sensitivity sweep (block {j + 1} of {n_blocks})")
            streamed.load_block(j)
            try:
                for u in (u for u in range(len(labels)) if starts[u] == j):
                    states[u] = placer.new(f"unit{u}")
                for u in sorted(states):  # every unit changed in this block or an earlier one
                    check_cancel(should_cancel, f"streamed sensitivity sweep (block {j + 1} of {n_blocks}: "
                                                f"{labels[u]})")
                    source = ref if starts[u] == j else states[u]  # in place: a batch is read before it is written
                    with ExitStack() as ctx:
                        enter(u, j, ctx)
                        for s, e in ranges:
                            previous = source.data[s:e].to(device) if j > 0 else None
                            out = streamed._block_pass(j, ids[s:e], previous)
                            states[u].data[s:e] = out.to(states[u].data.device)
                for s, e in ranges:  # the reference last: the units starting here read its input
                    previous = ref.data[s:e].to(device) if j > 0 else None
                    ref.data[s:e] = streamed._block_pass(j, ids[s:e], previous).to(ref.data.device)
            finally:
                streamed.free_block(j)
            left = (time.perf_counter() - started) / (j + 1) * (n_blocks - j - 1)
            report_progress(progress, BLOCKS_SHARE * (j + 1) / n_blocks,
                            f"streamed, block {j + 1}/{n_blocks} ({len(states)} of {len(labels)} units"
                            f"{time_left_text(left) if j + 1 < n_blocks else ''})")
        head = SweepHead(streamed.model)

        def done(u: int, k: list[float], a: list[float], positions: int, _seconds: float) -> None:
            nonlocal per_sequence
            kl_seq[u] += k
            agree_seq[u] += a
            per_sequence = positions

        for bi, (s, e) in enumerate(ranges):  # the head: the reference and every unit, one batch at a time
            check_cancel(should_cancel, f"streamed sensitivity sweep (head, batch {bi + 1} of {len(ranges)})")
            ref_x = _final_inputs(streamed, head, ids[s:e], ref.data[s:e])
            queue = HeadQueue(HeadBatch(head, ref_x, ids[s:e], reference, s, e), done)  # checks the reference
            for u in range(len(labels)):
                check_cancel(should_cancel, f"streamed sensitivity sweep (head, unit {u + 1} of {len(labels)})")
                before = head.parameters_now()
                with ExitStack() as ctx:
                    enter(u, n_blocks, ctx)
                    x = _final_inputs(streamed, head, ids[s:e], (states[u] if u in states else ref).data[s:e])
                    state = head.frozen(before)  # the unit's head, where it changed it (lm_head quantized)
                queue.add(u, x, state, 0.0)
                del x, state
            queue.flush()
            del queue, ref_x
            report_progress(progress, BLOCKS_SHARE + (1 - BLOCKS_SHARE) * (bi + 1) / len(ranges),
                            f"streamed, head: batch {bi + 1}/{len(ranges)} of {len(labels)} units")
    finally:
        streamed.cleanup()

    def estimate(sums: list[float]) -> Estimate:  # as the whole sweep: the mean over positions, error over sequences
        return Estimate(math.fsum(sums) / (len(sums) * per_sequence),
                        block_mean(np.asarray(sums)[:, None] / per_sequence).err)

    return [estimate(k) for k in kl_seq], [estimate(a) for a in agree_seq]


def streamed_sensitivity_sweep(
    streamed: StreamedModel,
    scheme: Scheme | str,
    input_ids: Tensor,
    reference: ReferenceCache,
    *,
    groups: bool = True,
    layers: Sequence[str] | None = None,
    per_expert: bool = False,
    inputs: PlanInputs = NO_INPUTS,
    calibration_ids: Tensor | None = None,
    calibration_batch_size: int = 4,
    batch_size: int | None = None,
    progress: Progress | None = None,
    should_cancel: ShouldCancel | None = None,
) -> list[SensitivityRow]:
    """:func:`quantcore.evaluation.sensitivity.sensitivity_sweep`, streamed (module docstring): the same rows, sorted
    by ``kl_mean``, largest first.

    calibration_ids:        a GPTQ scheme's calibration tokens ``[S, L]``: the swept layers not in
                            ``inputs.gptq_cache`` (nor in ``inputs.weight_hessians``) are rounded on them first, block
                            by block, into that cache (a fresh dict where None); without them such layers are refused
    calibration_batch_size: sequences per pass of that rounding (the whole-model Hessians' batch size, for the same
                            Hessians)

    An AWQ scheme reads ``inputs.awq`` (refused without it); a rotation (``inputs.rotation``) is folded into each
    block as it loads (module docstring)."""
    scheme = get_scheme(scheme)
    model = streamed.model
    if inputs.rotation is not None:
        from quantcore.algorithms.rotation import rotated_for_sweep

        swept = list(layers) if layers is not None else linear_layer_names(model)
        with rotated_for_sweep(model, inputs, swept, [scheme]) as plain:
            return streamed_sensitivity_sweep(streamed, scheme, input_ids, reference, groups=groups, layers=layers,
                                              per_expert=per_expert, inputs=plain, calibration_ids=calibration_ids,
                                              calibration_batch_size=calibration_batch_size, batch_size=batch_size,
                                              progress=progress, should_cancel=should_cancel)
    stack = streamed.stack
    n_blocks = len(stack.blocks)
    ids = as_token_batch(input_ids)
    reference.check_tokens(ids)
    units = sweep_units(linear_layer_names(model), groups=groups, only=layers, per_expert=per_expert)
    if not units:
        raise PlanError("the sweep has no layer to quantize: the model has no nn.Linear layers")
    get_head: Any = getattr(model, "get_output_embeddings", None)
    output_embeddings = get_head() if get_head is not None else None
    head_names = {n for n, m in model.named_modules() if output_embeddings is not None and m is output_embeddings}

    # each unit's layers by the pass that quantizes them: its block's, the head's (n_blocks), and a layer outside the
    # blocks that is not the head (a projection before them) in every pass, as a whole pass would see it
    shares: list[dict[int, list[str]]] = []
    starts: list[int] = []
    for unit in units:
        by_pass: dict[int, list[str]] = {}
        outside = []
        for name in unit:
            b = stack.block_of(name)
            if b is None and name not in head_names:
                outside.append(name)
            else:
                by_pass.setdefault(n_blocks if b is None else b, []).append(name)
        start = 0 if outside else min(by_pass)
        if outside:
            for p in range(n_blocks + 1):
                by_pass[p] = by_pass.get(p, []) + outside
        shares.append(by_pass)
        starts.append(start)
    local = [_LocalError() for _ in units]
    notes: list[list[str]] = [[] for _ in units]
    cache = inputs.gptq_cache if inputs.gptq_cache is not None else {}
    inputs = inputs.replace(gptq_cache=cache)
    if scheme.needs_awq and inputs.awq is None:
        raise PlanError(f"{scheme.name} scales with AWQ: search its factors on calibration text first (streamed: "
                        "quantcore.algorithms.streamed_rounding.awq_search_streamed) and pass them as inputs.awq")
    if scheme.needs_hessians:
        plans = _rounding_plans(streamed, scheme, units, inputs)
        if plans:
            if calibration_ids is None:
                raise PlanError(f"{scheme.name} rounds with GPTQ from the Hessians of the layers' inputs: give the "
                                "sweep calibration_ids (it rounds the swept layers block by block on them) or their "
                                "roundings in inputs.gptq_cache")
            _round_streamed(streamed, plans, calibration_ids, cache, inputs, calibration_batch_size, progress,
                            should_cancel)
            progress = _after(progress, ROUNDING_SHARE)

    def enter(u: int, p: int, ctx: ExitStack) -> None:
        share = shares[u].get(p)
        if not share:
            return
        err = local[u]
        applied = ctx.enter_context(plan_applied(model, {n: scheme for n in share}, inputs=inputs,
                                                 before_quantize=lambda m: err.snapshot(m, share)))
        notes[u].extend(note for note in applied.notes if note not in notes[u])
        err.attach(model, share)
        ctx.callback(err.detach)
        # the unquantized copies the SQNR compares with, dropped once the unit's pass is over: kept for the whole
        # sweep they would add up to every swept weight, the model's size, which a streamed job must not hold
        ctx.callback(err._weights.clear)

    kl, agree = _streamed_one_at_a_time(streamed, ids, reference, [group_label(u) for u in units], starts, enter,
                                        batch_size=batch_size, progress=progress, should_cancel=should_cancel)
    rows = [SensitivityRow(layer=group_label(unit), layers=list(unit), kl_mean=kl[i].value,
                           top1_agree=agree[i].value, sqnr_db=local[i].sqnr_db, note="; ".join(notes[i]),
                           kl_mean_err=kl[i].err, top1_agree_err=agree[i].err)
            for i, unit in enumerate(units)]
    rows.sort(key=lambda r: r.kl_mean, reverse=True)
    return rows


def _rounding_plans(streamed: StreamedModel, scheme: Scheme, units: Sequence[Sequence[str]],
                    inputs: PlanInputs) -> list[dict[str, Scheme]]:
    """The plans to round the units' GPTQ layers that ``inputs`` has neither a rounding (``gptq_cache``) nor a
    Hessian (``weight_hessians``) for: each unit joins the first plan in which every layer's rounding reads what it
    reads in its own unit applied alone (:func:`quantcore.algorithms.gptq.rounding_inputs`: the fusion group, the folds
    into its rows, both inside one block, and the plan's AWQ layers), so that the streamed rounding of each plan
    rounds every layer exactly as the whole-model sweep does; [] when nothing is left to round."""
    from quantcore.algorithms.gptq import rounding_inputs

    cache, hessians = inputs.gptq_cache or {}, inputs.weight_hessians or {}
    block_of = streamed.stack.block_of
    reads: dict[str, dict[str, Any]] = {}  # each layer's reads in its own unit
    plans: list[dict[str, Scheme]] = []
    for unit in units:
        alone = dict.fromkeys(unit, scheme)
        own = rounding_inputs(alone)
        if all(n in cache or n in hessians for n in own):
            continue
        reads.update(own)
        blocks = {block_of(n) for n in unit}
        for plan in plans:
            # what a layer's rounding can read: its own block's layers, or every AWQ layer of the plan
            near = plan if scheme.needs_awq else {n: s for n, s in plan.items() if block_of(n) in blocks}
            together = rounding_inputs({**near, **alone})
            if all(together[n] == reads[n] for n in together):
                plan.update(alone)
                break
        else:
            plans.append(alone)
    return plans


def _after(progress: Progress | None, share: float) -> Progress | None:
    """``progress`` for what runs after the first ``share`` of the bar."""
    if progress is None:
        return None
    return lambda f, msg: report_progress(progress, share + (1 - share) * f, msg)


def _round_streamed(streamed: StreamedModel, plans: Sequence[dict[str, Scheme]], calibration_ids: Tensor,
                    cache: dict[str, Tensor], inputs: PlanInputs, batch_size: int, progress: Progress | None,
                    should_cancel: ShouldCancel | None) -> None:
    """Round the GPTQ layers of each of ``plans`` into ``cache``, one streamed pass per plan
    (:func:`quantcore.algorithms.streamed_rounding.round_gptq_streamed`, the streamed score's rounding)."""
    from quantcore.algorithms.streamed_rounding import round_gptq_streamed

    for r, plan in enumerate(plans):
        def told(f: float, msg: str, r: int = r) -> None:
            report_progress(progress, ROUNDING_SHARE * (r + f) / len(plans),
                            msg + (f" (pass {r + 1} of {len(plans)})" if len(plans) > 1 else ""))

        round_gptq_streamed(streamed, plan, calibration_ids, cache=cache, inputs=inputs, batch_size=batch_size,
                            progress=told if progress is not None else None, should_cancel=should_cancel)


def streamed_kv_sensitivity_sweep(
    streamed: StreamedModel,
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
    """:func:`quantcore.evaluation.sensitivity.kv_sensitivity_sweep`, streamed: one attention layer's K and V at a
    time in ``kv_cache`` while its block runs; the same rows."""
    from quantcore.evaluation.kvcache import get_kv_format, kv_cache_quantized
    from quantcore.models.decoder import attention_modules

    kv = get_kv_format(kv_cache)
    if kv.is_identity:
        raise PlanError("a KV cache sweep needs a quantized format (FP8, FP8_ATTN, ...); AUTO changes nothing")
    model: nn.Module = streamed.model
    ids = as_token_batch(input_ids)
    reference.check_tokens(ids)
    every = list(attention_modules(model))
    if not every:
        raise PlanError("this model has no attention module with k_proj and v_proj: no KV cache to sweep")
    unknown = sorted(set(layers or ()) - set(every))
    if unknown:
        raise PlanError(f"attention module(s) the model does not have: {', '.join(map(repr, unknown[:10]))}")
    swept = every if layers is None else [n for n in every if n in set(layers)]
    starts = [streamed.stack.block_of(n) or 0 for n in swept]

    def enter(u: int, p: int, ctx: ExitStack) -> None:
        if p == starts[u]:
            ctx.enter_context(kv_cache_quantized(model, kv, amax=amax, skip=set(every) - {swept[u]}))

    kl, agree = _streamed_one_at_a_time(streamed, ids, reference, swept, starts, enter, batch_size=batch_size,
                                        progress=progress, should_cancel=should_cancel)
    rows = [SensitivityRow(layer=n, layers=[n], kl_mean=kl[i].value, top1_agree=agree[i].value, sqnr_db=math.nan,
                           kl_mean_err=kl[i].err, top1_agree_err=agree[i].err)
            for i, n in enumerate(swept)]
    rows.sort(key=lambda r: r.kl_mean, reverse=True)
    return rows


__all__ = ["streamed_kv_sensitivity_sweep", "streamed_sensitivity_sweep"]
