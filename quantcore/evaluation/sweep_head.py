"""The sensitivity sweep's head: the final norm and the head run a chunk of positions at a time, each unit's KL and
top-1 agreement taken against the in-batch reference a chunk of logits at a time (issue #42: no ``[B, L, V]`` tensor
is held, whatever the batch, length and vocabulary).

:class:`SweepHead` runs the model as it stands up to the head's input (after the final norm, ``[B*L, H]``) and the
head on chunks of those rows (as scoring does, :func:`quantcore.evaluation.batches.iter_logits`);
:class:`HeadBatch` holds one batch's reference head inputs and checks them against the reference cache
(:func:`check_reference`); :class:`HeadQueue` keeps the units' head inputs in groups of about
:data:`HEAD_GROUP_ELEMENTS` elements and, per group, recomputes each chunk of the reference's logits once and compares
every unit of the group with it. Used by the whole-model sweeps (:mod:`quantcore.evaluation.sensitivity`), the
streamed sweep (:mod:`quantcore.evaluation.streamed_sweep`) and, for its reference check, the Fisher estimate.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn

from quantcore.errors import PlanError
from quantcore.evaluation import batches as batches_module
from quantcore.evaluation.batches import (
    _head_input,
    _head_split,
    forward_logits,
    logit_chunk_rows,
    model_device,
)
from quantcore.evaluation.reference import ReferenceCache, ReferenceMismatch, chunk_rows, model_vocab

# the recomputed reference NLL must match the cache to this mean |difference| (nats/token); a different model or
# weights differ by orders of magnitude more, run-to-run noise by far less
REFERENCE_NLL_TOL = 1e-3

# Head inputs (``[B*L, H]``, after the final norm) of the units that wait for their head pass, at most about this many
# elements beside the one that fills it (256 MB in float32): the units of a group share one recomputation of the
# reference's chunks of logits, so a group of g units costs 1/g of a head pass each on top of their own.
HEAD_GROUP_ELEMENTS = 1 << 26
# positions of a batch's first sequence whose reference NLL is checked before any unit runs (a cache of other weights
# is off by orders of magnitude on any of them); the whole batch is checked with its first group of units
PRECHECK_POSITIONS = 64


class SweepHead:
    """A sweep's final norm and head, run a chunk of positions at a time as scoring runs them
    (:func:`quantcore.evaluation.batches.iter_logits`): :meth:`inputs` runs the model as it stands (blocks replayed,
    a unit applied) up to the head's input, :meth:`logits` the head on a chunk of its rows.

    For a model whose logits are exactly ``lm_head(body(...))`` (:data:`~quantcore.evaluation.batches.
    HEAD_SPLIT_MODEL_TYPES`) the inputs are the final hidden states ``[B*L, H]`` after the final norm and after the
    head's forward pre-hooks (a unit's activation quantization, its SQNR's input), run once on the whole batch as the
    model's own forward runs them; the head's forward hooks (a unit's SQNR on ``lm_head``) see each chunk's input and
    output. Any other model runs whole (:func:`forward_logits`) and its inputs are its logits ``[B*L, V]``, handed out
    in the same chunks. A chunk is :data:`~quantcore.evaluation.batches.LOGIT_CHUNK_ELEMENTS` float32 logits, read
    when the chunks are made; every chunking is a function of the shapes alone, so the whole and the streamed sweep
    compute the same chunks."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        split = _head_split(model, hooked_head=True)
        self.body = split[0] if split is not None else None
        self.cap = split[2] if split is not None else None

    def _module(self) -> nn.Module:
        head = cast(Any, self.model).get_output_embeddings()
        if not isinstance(head, nn.Module):
            raise PlanError(f"{type(self.model).__name__} has no output embedding (lm_head) to run the head with")
        return head

    def inputs(self, input_ids: Tensor) -> Tensor:
        """The head's inputs for the batch ``input_ids`` ``[B, L]``, flattened to ``B*L`` rows (class docstring)."""
        if self.body is None:
            logits = forward_logits(self.model, input_ids)
            return logits.reshape(-1, logits.shape[-1])
        head = self._module()
        with torch.no_grad():
            hidden = self.body(input_ids=input_ids.to(model_device(self.model)), use_cache=False).last_hidden_state
            hooks = head._forward_hooks
            head._forward_hooks = OrderedDict()  # held aside: they see each chunk in logits()
            try:
                x = _head_input(head, hidden)
            finally:
                head._forward_hooks = hooks
        return x.reshape(-1, x.shape[-1])

    def chunks(self, x: Tensor) -> list[tuple[int, int]]:
        """The chunks of rows of the inputs ``x``: about LOGIT_CHUNK_ELEMENTS logits each."""
        vocab = x.shape[-1] if self.body is None else model_vocab(self.model)
        rows = logit_chunk_rows(vocab, batches_module.LOGIT_CHUNK_ELEMENTS)
        return [(s, min(s + rows, x.shape[0])) for s in range(0, x.shape[0], rows)]

    def parameters_now(self) -> dict[str, tuple[Tensor, int]]:
        """The head's own parameters and their versions, taken before a unit changes the model: a unit that quantizes
        the head replaces them (a new tensor) or changes them in place (a SmoothQuant fold), as :meth:`frozen` tells
        apart."""
        if self.body is None:
            return {}
        return {n: (p, p._version) for n, p in self._module()._parameters.items() if p is not None}

    def frozen(self, before: dict[str, tuple[Tensor, int]]) -> HeadState | None:
        """The head as it is now, to run after the unit that changed it is undone: its parameters that differ from
        ``before`` (:meth:`parameters_now`; a tensor the unit put in their place is kept as it is, one it changed in
        place is copied) and its forward hooks; None when the head is as before and has no hook, or the model runs
        whole."""
        if self.body is None:
            return None
        head = self._module()
        params: dict[str, Tensor | None] = {}
        for n, p in head._parameters.items():
            was = before.get(n)
            if p is None and was is None:
                continue  # no bias before or now
            if p is None or was is None or p is not was[0]:
                params[n] = p  # replaced: the unit's own tensor, which undoing it does not touch
            elif p._version != was[1]:
                params[n] = p.detach().clone()  # changed in place: undoing it writes the original back
        hooks = _forward_hooks(head)
        if not params and not hooks:
            return None
        return HeadState(params, hooks)

    def logits(self, x: Tensor, s: int, e: int, state: HeadState | None = None) -> Tensor:
        """float32 logits ``[e - s, V]`` of the rows ``s:e`` of the inputs ``x``, by the head as it is, or as it was
        when ``state`` was taken (:meth:`frozen`)."""
        if self.body is None:
            return x[s:e]
        head = self._module()
        chunk = x[s:e]
        hooks = state.hooks if state is not None else _forward_hooks(head)
        saved = {n: head._parameters[n] for n in state.params} if state is not None else {}
        with torch.no_grad():
            try:
                for n, p in (state.params if state is not None else {}).items():
                    head._parameters[n] = p  # type: ignore[assignment]
                z = type(head).forward(head, chunk)  # its pre-hooks already ran on the whole input
            finally:
                head._parameters.update(saved)
            for hook, with_kwargs in hooks:  # a unit's SQNR on lm_head: each chunk's input and output
                out = hook(head, (chunk,), {}, z) if with_kwargs else hook(head, (chunk,), z)
                z = z if out is None else out
            if self.cap is not None:
                z = torch.tanh(z / self.cap) * self.cap
        return z.float()


def _forward_hooks(head: nn.Module) -> list[tuple[Callable[..., Any], bool]]:
    """The head's forward hooks, each with whether it takes keyword arguments (as :class:`HeadState` keeps them)."""
    return [(hook, key in head._forward_hooks_with_kwargs) for key, hook in head._forward_hooks.items()]


@dataclass
class HeadState:
    """A unit's head, kept past the unit (:meth:`SweepHead.frozen`): the parameters that differ from the model's own,
    and the forward hooks with whether each takes keyword arguments."""

    params: dict[str, Tensor | None]
    hooks: list[tuple[Callable[..., Any], bool]]


def check_reference_nll(nll: Tensor, cached: Tensor, reference: ReferenceCache) -> None:
    """Per-token NLL of the batch (or of a part of it) within REFERENCE_NLL_TOL of the cache's same tokens
    ``cached``, on average; else ReferenceMismatch."""
    gap = float((nll.cpu() - cached).abs().mean())
    if not gap <= REFERENCE_NLL_TOL:  # NaN included
        raise ReferenceMismatch(
            f"the reference cache (model {reference.model_sha or 'unknown'}) does not match this model: its "
            f"per-token NLL differs by {gap:.3g} nats on average (tolerance {REFERENCE_NLL_TOL}); the model "
            "weights changed since it was computed - recompute the reference"
        )


def check_reference(ref_logits: Tensor, ids: Tensor, reference: ReferenceCache, s: int, e: int) -> None:
    """:func:`check_reference_nll` on the NLL of whole logits ``[B, L, V]`` (the Fisher estimate's fallback)."""
    lp = torch.log_softmax(ref_logits[:, :-1], dim=-1)
    nll = -lp.gather(-1, ids[:, 1:].to(lp.device).unsqueeze(-1)).squeeze(-1)
    check_reference_nll(nll, reference.nll[s:e], reference)


class HeadBatch:
    """One batch's reference at the head: its head inputs, and per position (all ``B*L``, flattened; the last of each
    sequence is computed and dropped) the reference's logsumexp and argmax, taken by the first :meth:`compare`, which
    also checks the batch against the cache (:func:`check_reference_nll`, every position). A first look at the first
    PRECHECK_POSITIONS positions is checked at once, so that a cache of other weights fails before any unit runs.
    :meth:`compare` gives units' KL and top-1 agreement against the reference, a chunk of positions at a time: the
    reference's chunk of logits and probabilities is recomputed once per call, for all the units given, so no
    ``[B*L, V]`` tensor is ever held."""

    def __init__(self, head: SweepHead, ref_x: Tensor, ids: Tensor, reference: ReferenceCache, s: int, e: int) -> None:
        self.head, self.ref_x, self.reference, self.s, self.e = head, ref_x, reference, s, e
        b, length = ids.shape
        n, dev = b * length, ref_x.device
        self.sequences, self.length = b, length
        self.lse = torch.empty(n, dtype=torch.float32, device=dev)
        self.argmax = torch.empty(n, dtype=torch.int64, device=dev)
        targets = torch.zeros((b, length), dtype=torch.int64)
        targets[:, :-1] = ids[:, 1:]
        self.targets = targets.reshape(-1).to(dev)
        keep = torch.ones(b, length, dtype=torch.bool, device=dev)
        keep[:, -1] = False
        self.keep = keep.reshape(-1)
        self.checked = False
        first = min(PRECHECK_POSITIONS, length - 1, head.chunks(ref_x)[0][1])  # of the first sequence, one chunk
        z = head.logits(ref_x, 0, first)
        nll = torch.logsumexp(z, dim=-1) - z.gather(-1, self.targets[:first, None]).squeeze(-1)
        check_reference_nll(nll, reference.nll[s, :first], reference)

    def check(self) -> None:
        """The whole batch checked against the cache (done by the first :meth:`compare`)."""
        if not self.checked:
            self.compare([])

    def compare(self, units: Sequence[tuple[Tensor, HeadState | None]]) -> list[tuple[list[float], list[float], int]]:
        """For each unit's head inputs (as :meth:`SweepHead.inputs` gives them) and head (None: the model's own; else as
        :meth:`SweepHead.frozen` kept it), per sequence of the batch the sum of per-position KL(p_ref || p_q) and the
        number of top-1 agreements (kept positions only), and the positions of each sequence: the blocks of the
        sweep's standard errors. The first call checks the reference (ReferenceMismatch before any result).

        KL = (lse_q - lse_ref) - sum_v p_ref (z_q - z_ref): no log-softmax is materialized; equal logits give
        exactly 0 per position (z_q - z_ref = 0, lse_q = lse_ref)."""
        head, ref_x, first = self.head, self.ref_x, not self.checked
        n = self.lse.shape[0]
        nll = torch.empty(n if first else 0, dtype=torch.float32, device=ref_x.device)
        kls = [torch.empty(n, dtype=torch.float32, device=ref_x.device) for _ in units]
        agrees = [torch.empty(n, dtype=torch.bool, device=ref_x.device) for _ in units]
        work: Tensor | None = None  # one block of rows of logits, reused by every chunk (the first is the largest)
        for c, d in head.chunks(ref_x):
            z_ref = head.logits(ref_x, c, d)
            if first:
                self.lse[c:d] = torch.logsumexp(z_ref, dim=-1)
                self.argmax[c:d] = z_ref.max(dim=-1).indices  # the first maximal index, as argmax; cheaper
                nll[c:d] = self.lse[c:d] - z_ref.gather(-1, self.targets[c:d, None]).squeeze(-1)
            probs = torch.sub(z_ref, self.lse[c:d, None]).exp_()
            step = chunk_rows(z_ref.shape[1], z_ref.device)
            if work is None:
                work = torch.empty((min(step, d - c), z_ref.shape[1]), dtype=torch.float32, device=z_ref.device)
            for (x, state), kl, agree in zip(units, kls, agrees, strict=True):
                z_all = head.logits(x, c, d, state)
                for f in range(0, d - c, step):  # a block of rows at a time while it is in cache
                    g = min(f + step, d - c)
                    z = z_all[f:g]
                    agree[c + f:c + g] = z.max(dim=-1).indices == self.argmax[c + f:c + g]
                    lse_q = torch.logsumexp(z, dim=-1)
                    diff = torch.sub(z, z_ref[f:g], out=work[: g - f])
                    kl[c + f:c + g] = (lse_q - self.lse[c + f:c + g]) - diff.mul_(probs[f:g]).sum(dim=-1)
                del z_all
            del z_ref, probs
        if first:
            nll_kept = nll.reshape(self.sequences, self.length)[:, :-1]
            check_reference_nll(nll_kept, self.reference.nll[self.s:self.e], self.reference)
            self.checked = True
        return [self._per_sequence(kl, agree) for kl, agree in zip(kls, agrees, strict=True)]

    def _per_sequence(self, kl: Tensor, agree: Tensor) -> tuple[list[float], list[float], int]:
        kl.clamp_min_(0.0)  # rounding of two nearly equal distributions; the true KL is >= 0
        kept = kl[self.keep].double().reshape(self.sequences, -1)
        agreed = agree[self.keep].double().reshape(self.sequences, -1).sum(dim=1)
        return kept.sum(dim=1).cpu().tolist(), agreed.cpu().tolist(), int(kept.shape[1])


# done(unit index, its per-sequence KL sums, agreements, positions a sequence, seconds it took)
Done = Callable[[int, list[float], list[float], int, float], None]


class HeadQueue:
    """The units of one batch at the head: each unit's head inputs (and its head, where it changed it: :meth:`SweepHead.
    frozen`) wait until they hold HEAD_GROUP_ELEMENTS, or a changed head is among them, then the group is compared in
    one pass over the reference's chunks (:meth:`flush`). ``done`` gets each unit's results, with its share of the
    group's time."""

    def __init__(self, batch: HeadBatch, done: Done) -> None:
        self.batch, self.done = batch, done
        self.waiting: list[tuple[int, Tensor, HeadState | None, float]] = []

    def add(self, unit: int, x: Tensor, state: HeadState | None, seconds: float) -> None:
        self.waiting.append((unit, x, state, seconds))
        if state is not None or sum(w[1].numel() for w in self.waiting) >= HEAD_GROUP_ELEMENTS:
            self.flush()  # a changed head is not kept waiting: it is a copy of the head's size

    def flush(self) -> None:
        if not self.waiting:
            self.batch.check()  # a batch of no unit is checked all the same
            return
        waiting, self.waiting = self.waiting, []
        started = time.perf_counter()
        results = self.batch.compare([(w[1], w[2]) for w in waiting])
        share = (time.perf_counter() - started) / len(waiting)
        for (unit, _x, _state, seconds), (k, a, per_sequence) in zip(waiting, results, strict=True):
            self.done(unit, k, a, per_sequence, seconds + share)


