"""The Fisher estimate (:mod:`quantcore.evaluation.fisher`) on a :class:`~quantcore.models.streaming.StreamedModel`:
block-wise gradient checkpointing, the same rows as :func:`~quantcore.evaluation.fisher.fisher_sensitivity` (linear
units, KV cache formats, rotated or not).

How it runs
    Forward: each decoder block in turn is loaded and every batch goes through it with grad on (the very code path the
    backward recomputes it by, so that the two agree bit for bit), and every block's input states are kept (the
    sweep's :class:`~quantcore.evaluation.streamed_sweep._Placer`: on the device while they fit its budget, then in
    host memory, then in memory-mapped scratch files). Head: per batch, the final norm and the head on the final
    states (a leaf that asks for grad), the reference check, and ``passes`` backward passes of tokens drawn from the
    reference distribution with the whole-model estimate's generator, seed and order (the same draws); the head's
    unit (``lm_head``) is estimated there, and the gradient with respect to the final states is kept per pass.
    Backward: the blocks in reverse, each loaded again and its units quantized under every scheme, its forward
    recomputed per batch from its kept input with grad on, each pass's incoming gradient backpropagated to its input
    (kept for the block before it), the whole estimate's backward hooks (:class:`~quantcore.evaluation.fisher._Hooks`)
    computing each unit's terms inside the block.

Same results
    Each block sees the batches the whole model's pass gives it, through the model's own forward, and its units' hooks
    run in the same order; a unit's sums accumulate batch by batch as in the whole estimate. On a CPU the rows are
    bit-identical to the whole-model estimate's (``tests/quantcore/evaluation/test_fisher_streamed.py``).

Memory
    Every block's input states ``[S, L, H]`` (one per block, in the job's dtype) and ``2 x passes`` gradient states of
    that size, placed as the sweep places its states; one block's weights and its units' quantized weights (one copy
    per distinct rounding) at a time.

KV cache formats
    ``kv_caches``: one unit per attention layer, as the whole estimate's (:mod:`quantcore.evaluation.fisher_kv`):
    every block's forward runs the eager attention the whole estimate records with, and a block's backward records
    its swept attention layers and adds their products at the gradient of ``o_proj``'s input, by the same
    :func:`~quantcore.evaluation.fisher_kv.kv_recorded`.

Rotated
    ``inputs.rotation``: the streamed model is rotated once for the estimate, as the whole estimate rotates the whole
    model (:func:`quantcore.algorithms.rotation.rotated_for_sweep`): the embedding, final norm and head at once, each
    block as it loads (in the forward and again in the backward), and every unit quantized in it.

Not streamed (refused): a unit with layers outside the decoder blocks other than the head.
GPTQ schemes have their swept layers rounded block by block on ``calibration_ids`` first, as the streamed sweep
rounds them (:func:`quantcore.evaluation.streamed_sweep._rounding_plans`); AWQ reads ``inputs.awq``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

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
from quantcore.evaluation.fisher import (
    DEFAULT_PASSES,
    DEFAULT_SAMPLES,
    _backward_sampled,
    _checked_schemes,
    _fusion_units_only,
    _Hooks,
    _leaf,
    _linear_rows,
    _Member,
    _quantize_units,
    _rotated,
    _scheme_inputs,
    _UnitSums,
)
from quantcore.evaluation.fisher_kv import KvUnits, kv_recorded, kv_rows, prepare_kv
from quantcore.evaluation.reference import ReferenceCache
from quantcore.evaluation.sensitivity import SensitivityRow, _replayed, linear_layer_names, sweep_units
from quantcore.evaluation.streamed_sweep import _Placer, _round_streamed, _rounding_plans
from quantcore.models.streaming import HiddenStates, StreamedModel, _Stop
from quantcore.planning.plans import group_label
from quantcore.schemes.presets import get_scheme
from quantcore.schemes.specs import Scheme

FORWARD_SHARE, HEAD_SHARE = 0.4, 0.1  # of the progress bar; the rest is the backward pass over the blocks


def streamed_fisher_sensitivity(
    streamed: StreamedModel,
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
    calibration_ids: Tensor | None = None,
    calibration_batch_size: int = 4,
    progress: Progress | None = None,
    should_cancel: ShouldCancel | None = None,
) -> dict[str, list[SensitivityRow]]:
    """:func:`quantcore.evaluation.fisher.fisher_sensitivity` streamed (module docstring): the same ``{scheme name:
    rows}``, KV cache formats' under ``"KV <format>"``, a rotation in ``inputs`` folded in as the blocks load.
    ``calibration_ids`` / ``calibration_batch_size``: a GPTQ scheme's calibration tokens, as
    :func:`quantcore.evaluation.streamed_sweep.streamed_sensitivity_sweep` takes them. The streamed model's blocks are
    left on ``meta``, its scratch files removed, also on error or cancel."""
    model = streamed.model
    if _rotated(inputs):  # rotated once, each block as it loads (module docstring)
        from quantcore.algorithms.rotation import rotated_for_sweep

        assert isinstance(inputs, PlanInputs)
        swept = list(layers) if layers is not None else linear_layer_names(model)
        with rotated_for_sweep(model, inputs, swept, [get_scheme(s) for s in schemes]) as plain:
            return streamed_fisher_sensitivity(
                streamed, schemes, input_ids, reference, groups=groups, layers=layers, per_expert=per_expert,
                inputs=plain, samples=samples, passes=passes, kv_caches=kv_caches, kv_amax=kv_amax,
                kv_layers=kv_layers, batch_size=batch_size, seed=seed, calibration_ids=calibration_ids,
                calibration_batch_size=calibration_batch_size, progress=progress, should_cancel=should_cancel)
    resolved = _checked_schemes(schemes, samples, passes, kv_caches)
    ids = as_token_batch(input_ids)
    reference.check_tokens(ids)
    ids = ids.detach().to("cpu", torch.int64)
    units = (sweep_units(linear_layer_names(model), groups=groups, only=layers, per_expert=per_expert)
             if resolved else [])
    if resolved and not units:
        raise PlanError("the sweep has no layer to quantize: the model has no nn.Linear layers")
    n_blocks = len(streamed.stack.blocks)
    passes_of = _unit_passes(streamed, units)
    scheme_inputs = _scheme_inputs(inputs, resolved)
    for si, scheme in enumerate(resolved):
        if scheme.needs_awq and scheme_inputs[si].awq is None:
            raise PlanError(f"{scheme.name} scales with AWQ: search its factors first (streamed: quantcore.algorithms."
                            "streamed_rounding.awq_search_streamed) and pass them as inputs.awq")
        if scheme.needs_hessians:
            plans = _rounding_plans(streamed, scheme, units, scheme_inputs[si])
            if plans and calibration_ids is None:
                raise PlanError(f"{scheme.name} rounds with GPTQ from the Hessians of the layers' inputs: give the "
                                "streamed Fisher estimate calibration_ids or the roundings in inputs.gptq_cache")
            if plans:
                cache = scheme_inputs[si].gptq_cache
                assert cache is not None and calibration_ids is not None
                _round_streamed(streamed, plans, calibration_ids, cache, scheme_inputs[si], calibration_batch_size,
                                None, should_cancel)
    kv = prepare_kv(model, kv_caches, kv_amax, kv_layers)
    kv_in = _kv_blocks(streamed, kv)
    whole = _fusion_units_only(units)
    sums = [[_UnitSums() for _ in resolved] for _ in units]
    notes = [["" for _ in units] for _ in resolved]
    member_of = {n: (ui, mi) for ui, unit in enumerate(units) for mi, n in enumerate(unit)}
    run = _Run(streamed, ids, reference, units, member_of, resolved, scheme_inputs, sums, notes, whole, passes_of,
               samples, passes, seed, batch_size, should_cancel, kv, kv_in)
    try:
        run.forward(progress)
        run.head(progress)
        for j in reversed(range(n_blocks)):
            run.backward(j)
            report_progress(progress, FORWARD_SHARE + HEAD_SHARE + (1 - FORWARD_SHARE - HEAD_SHARE)
                            * (n_blocks - j) / n_blocks, f"streamed Fisher, backward: block {j + 1}/{n_blocks}")
    finally:
        run.states.clear()
        run.grads, run.spare = [], []
        streamed.cleanup()
    positions = ids.shape[1] - 1
    return {**_linear_rows(units, resolved, sums, notes, positions, samples, passes),
            **kv_rows(kv, positions, samples, passes)}


def _kv_blocks(streamed: StreamedModel, kv: KvUnits | None) -> dict[int, list[str]]:
    """{block: its swept attention layers} (every block a key: none swept, an empty list)."""
    out: dict[int, list[str]] = {j: [] for j in range(len(streamed.stack.blocks))}
    for name in kv.names if kv is not None else ():
        b = streamed.stack.block_of(name)
        if b is None:
            raise PlanError(f"{name} is outside the decoder blocks: the streamed Fisher estimate of a KV cache "
                            "covers the blocks' attention layers (run it whole-model)")
        out[b].append(name)
    return out


def _unit_passes(streamed: StreamedModel, units: Sequence[Sequence[str]]) -> list[int]:
    """The block each unit lies in (the number of blocks: the head); PlanError for a unit elsewhere or across
    blocks."""
    model = streamed.model
    n_blocks = len(streamed.stack.blocks)
    get_head: Any = getattr(model, "get_output_embeddings", None)
    head = get_head() if get_head is not None else None
    out = []
    for unit in units:
        where = set()
        for name in unit:
            b = streamed.stack.block_of(name)
            if b is None and (head is None or model.get_submodule(name) is not head):
                raise PlanError(f"{name} is outside the decoder blocks and is not the head: the streamed Fisher "
                                "estimate covers the blocks' linears and the head (run it whole-model)")
            where.add(n_blocks if b is None else b)
        if len(where) != 1:
            raise PlanError(f"unit {group_label(unit)} spans several blocks: the streamed Fisher estimate takes a "
                            "unit inside one block")
        out.append(where.pop())
    return out


class _Run:
    """The states and sums of one streamed estimate (module docstring)."""

    def __init__(self, streamed: StreamedModel, ids: Tensor, reference: ReferenceCache,
                 units: Sequence[Sequence[str]], member_of: Mapping[str, tuple[int, int]],
                 resolved: Sequence[Scheme], scheme_inputs: Sequence[PlanInputs],
                 sums: Sequence[Sequence[_UnitSums]], notes: list[list[str]], whole: bool, passes_of: Sequence[int],
                 samples: int, passes: int, seed: int, batch_size: int | None,
                 should_cancel: ShouldCancel | None, kv: KvUnits | None, kv_in: Mapping[int, list[str]]) -> None:
        self.streamed, self.ids, self.reference = streamed, ids, reference
        self.units, self.member_of, self.resolved, self.scheme_inputs = units, member_of, resolved, scheme_inputs
        self.sums, self.notes, self.whole, self.passes_of = sums, notes, whole, passes_of
        self.samples, self.passes, self.should_cancel = samples, passes, should_cancel
        self.kv, self.kv_in = kv, kv_in
        n, length = ids.shape
        self.ranges = batch_ranges(n, reference.batch_size if batch_size is None else batch_size)
        hidden = int(streamed.config.get_text_config().hidden_size)
        self.placer = _Placer(streamed, (n, length, hidden))
        self.n_blocks = len(streamed.stack.blocks)
        self.gen = torch.Generator(device=streamed.device).manual_seed(seed)
        # states[j]: the input of block j (j >= 1; block 0's is the embedding's, recomputed); states[n_blocks]: the
        # final states. grads[k]: the gradient of pass k at the output of the block the backward is at
        self.states: dict[int, HiddenStates] = {}
        self.grads: list[HiddenStates] = []
        self.spare: list[HiddenStates] = []  # the other set of gradient states: the two are swapped block by block
        self.quantized: list[list[list[_Member]]] = [[] for _ in units]

    # -- one block's forward with grad, from its kept input

    def _input(self, j: int, s: int, e: int) -> Tensor | None:
        """Block ``j``'s input for sequences ``s:e``, a leaf that asks for grad (None for block 0: the embedding's
        output is made that leaf by :func:`quantcore.evaluation.fisher._leaf`)."""
        if j == 0:
            return None
        return self.states[j].data[s:e].to(self.streamed.device).detach().clone().requires_grad_(True)

    def _grad_pass(self, j: int, s: int, e: int, previous: Tensor | None) -> Tensor:
        streamed = self.streamed
        handle = streamed.model.get_input_embeddings().register_forward_hook(_leaf) if j == 0 else None
        try:
            with streamed._stage(j, previous), torch.enable_grad():
                try:
                    streamed.model(input_ids=self.ids[s:e].to(streamed.device), use_cache=False)
                except _Stop as stop:
                    return streamed._unwrap(stop.output)
        finally:
            if handle is not None:
                handle.remove()
        raise PlanError(f"{type(streamed.model).__name__}.forward did not call decoder block {j}; streamed execution "
                        "needs a model that runs every block on every pass")

    def forward(self, progress: Progress | None) -> None:
        streamed = self.streamed
        for j in range(self.n_blocks):
            check_cancel(self.should_cancel, f"streamed Fisher estimate (forward, block {j + 1} of {self.n_blocks})")
            self.states[j + 1] = self.placer.new(f"fisher-in{j + 1}")
            streamed.load_block(j)
            try:
                for s, e in self.ranges:
                    # KV formats: the eager attention the backward records with, nothing recorded here
                    with kv_recorded(streamed.model, self.kv, self.passes, [0], names=[]):
                        out = self._grad_pass(j, s, e, self._input(j, s, e))
                    self.states[j + 1].data[s:e] = out.detach().to(self.states[j + 1].data.device)
                    del out
            finally:
                streamed.free_block(j)
            report_progress(progress, FORWARD_SHARE * (j + 1) / self.n_blocks,
                            f"streamed Fisher, forward: block {j + 1}/{self.n_blocks}")

    # -- the units of one pass (a block, or the head) quantized, hooked, and their batches' sums

    def _quantize(self, p: int) -> list[int]:
        mine = [ui for ui in range(len(self.units)) if self.passes_of[ui] == p]
        if mine:
            quantized, notes = _quantize_units(self.streamed.model, [self.units[ui] for ui in mine], self.resolved,
                                               self.scheme_inputs, None, self.should_cancel, whole=self.whole)
            for k, ui in enumerate(mine):
                self.quantized[ui] = quantized[k]
                for si in range(len(self.resolved)):
                    self.notes[si][ui] = notes[si][k]
        return mine

    def _hooks(self, mine: Sequence[int], s: int, e: int, current: list[int]) -> tuple[_Hooks, list[Any]]:
        hooks = _Hooks((e - s, self.ids.shape[1]), self.units, self.member_of, self.quantized, self.sums,
                       self.passes, current)
        return hooks, hooks.install(self.streamed.model, [n for ui in mine for n in self.units[ui]])

    def _done(self, mine: Sequence[int]) -> None:
        for ui in mine:
            self.quantized[ui] = []

    def head(self, progress: Progress | None) -> None:
        streamed = self.streamed
        model = streamed.model
        final = self.states[self.n_blocks]
        self.grads = [self.placer.new(f"fisher-grad{k}") for k in range(self.passes)]
        mine = self._quantize(self.n_blocks)
        try:
            for bi, (s, e) in enumerate(self.ranges):
                check_cancel(self.should_cancel, f"streamed Fisher estimate (head, batch {bi + 1} of "
                                                 f"{len(self.ranges)})")
                states = final.data[s:e].to(streamed.device).detach().clone().requires_grad_(True)
                current = [0]
                hooks, handles = self._hooks(mine, s, e, current)

                def kept(k: int, states: Tensor = states, s: int = s, e: int = e) -> None:
                    assert states.grad is not None
                    self.grads[k].data[s:e] = states.grad.to(self.grads[k].data.device)
                    states.grad = None

                try:
                    with _replayed(streamed.stack.blocks, [streamed._wrap(states)] * self.n_blocks), \
                            torch.enable_grad():
                        logits = getattr(model(input_ids=self.ids[s:e].to(streamed.device), use_cache=False),
                                         "logits", None)
                        if logits is None:
                            raise PlanError(f"{type(model).__name__} returns no next-token logits: the Fisher "
                                            "estimate needs a causal language model's head")
                        _backward_sampled(logits, self.ids[s:e], self.reference, s, e, self.samples, self.passes,
                                          self.gen, current, kept)
                        del logits
                finally:
                    for h in handles:
                        h.remove()
                    hooks.clear()
                hooks.finish(mine)
                report_progress(progress, FORWARD_SHARE + HEAD_SHARE * (bi + 1) / len(self.ranges),
                                f"streamed Fisher, head: batch {bi + 1}/{len(self.ranges)}")
        finally:
            self._done(mine)

    def backward(self, j: int) -> None:
        """Block ``j``: its units' terms, and the gradient at its input (``grads`` moves one block down)."""
        streamed = self.streamed
        check_cancel(self.should_cancel, f"streamed Fisher estimate (backward, block {j + 1} of {self.n_blocks})")
        incoming = self.grads
        if j > 0 and not self.spare:
            self.spare = [self.placer.new(f"fisher-grad{k}b") for k in range(self.passes)]
        outgoing = self.spare
        streamed.load_block(j)
        try:
            for param in streamed.stack.blocks[j].parameters():
                param.requires_grad_(False)  # no weight gradient: only the kept input starts the graph
            mine = self._quantize(j)
            try:
                for s, e in self.ranges:
                    current = [0]
                    hooks, handles = self._hooks(mine, s, e, current)
                    try:
                        with kv_recorded(streamed.model, self.kv, self.passes, current, names=self.kv_in[j]):
                            previous = self._input(j, s, e)
                            out = self._grad_pass(j, s, e, previous)
                            for k in range(self.passes):
                                current[0] = k
                                out.backward(incoming[k].data[s:e].to(streamed.device),
                                             retain_graph=k < self.passes - 1)
                                if previous is not None:
                                    assert previous.grad is not None
                                    outgoing[k].data[s:e] = previous.grad.to(outgoing[k].data.device)
                                    previous.grad = None
                            del out
                    finally:
                        for h in handles:
                            h.remove()
                        hooks.clear()
                    hooks.finish(mine)
            finally:
                self._done(mine)
        finally:
            streamed.free_block(j)
        self.grads, self.spare = outgoing, incoming
        self.states.pop(j + 1, None)  # block j's output states are not read again


__all__ = ["streamed_fisher_sensitivity"]
