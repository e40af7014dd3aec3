"""GPTQ's Hessians and rounding, and AWQ's search, on a :class:`~quantcore.models.streaming.StreamedModel`: one
decoder block in memory at a time, the same results as the whole-model functions.

GPTQ (:func:`round_gptq_streamed`)
    The whole-model path collects every GPTQ layer's Hessian from the *unquantized* model's inputs on the
    calibration tokens (:func:`quantcore.algorithms.gptq.collect_hessians`, batches of ``batch_size``) and rounds
    each layer when the plan is applied. Streamed, each block runs unquantized on the previous block's unquantized
    outputs (the same inputs, batch for batch), its layers' Hessians are taken while it runs
    (:func:`~quantcore.algorithms.gptq.hessians_hooked`), and before the block is freed its share of the plan is
    applied once (:func:`~quantcore.algorithms.apply.quantized_model`: SmoothQuant's and AWQ's folds, the NVFP4
    group scales, then GPTQ) so that its GPTQ layers are rounded into ``cache``, the ``gptq_cache`` the score then
    reads; the block's Hessians are dropped there. Only one block's Hessians are held at a time (a 70B model's
    would take about 300 GB together), as in llm-compressor's sequential pipeline, but unlike it each block sees
    the unquantized model's inputs, exactly as the whole-model path does here (:mod:`quantcore.algorithms.gptq`).
    The rounded weights go to :class:`SpilledWeights` (one safetensors file each in the job's scratch folder) so
    a streamed job never holds the rounded model.

AWQ (:func:`awq_search_streamed`)
    The whole-model search (:func:`quantcore.algorithms.awq.awq_search`) already runs block by block: each block
    on the outputs of the blocks before it after their folds. Streamed, the same :class:`~quantcore.algorithms.awq.
    BlockSearch` runs on each block as it is loaded: a pass with its inputs recorded, the search and the folds,
    then a second pass with the folds in place for the next block's inputs (skipped where the block has no
    mapping); the folds are undone before the block is freed. Blocks after the last mapping are not read.

On a CPU both are bit-identical to the whole-model functions with the same ``batch_size``
(``tests/quantcore/algorithms/test_streamed_rounding.py``): every block sees, batch for batch, what it sees in a
whole-model pass (:mod:`quantcore.models.streaming`), and the accumulation and search order are the same.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from quantcore.algorithms.apply import quantized_model
from quantcore.algorithms.awq import AwqResult, BlockSearch, awq_mappings
from quantcore.algorithms.gptq import hessians_hooked
from quantcore.algorithms.inputs import NO_INPUTS, PlanInputs
from quantcore.errors import Cancelled
from quantcore.models.moe import all_experts
from quantcore.models.streaming import StreamedModel
from quantcore.schemes.presets import get_scheme
from quantcore.schemes.specs import AWQ_DUO_SCALING, AWQ_N_GRID, Scheme

Progress = Callable[[float, str], None]
ShouldCancel = Callable[[], bool]


class _Done(Exception):  # noqa: N818 - control flow: no block after this one is needed
    pass


class SpilledWeights(dict[str, Any]):  # a dict so that it is a PlanInputs.gptq_cache
    """A ``gptq_cache`` that keeps each rounded weight in a file (``folder/<n>.safetensors``) and reads it back
    when asked: ``cache[name]``, ``name in cache``, ``cache.get(name)``, ``len``; iteration gives the names. The
    folder is the caller's (a job's scratch folder, removed when the job ends)."""

    def __init__(self, folder: str | Path, weights: Mapping[str, Tensor] | None = None) -> None:
        super().__init__()
        self.folder = Path(folder)
        self._device: dict[str, torch.device] = {}
        for name, weight in (weights or {}).items():
            self[name] = weight

    def __setitem__(self, name: str, weight: Tensor) -> None:
        from safetensors.torch import save_file

        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{len(self) if name not in self else self._path(name).stem}.safetensors"
        save_file({"weight": weight.detach().contiguous().cpu()}, str(path))
        self._device[name] = weight.device
        super().__setitem__(name, path)

    def _path(self, name: str) -> Path:
        return Path(super().__getitem__(name))

    def __getitem__(self, name: str) -> Tensor:
        from safetensors.torch import load_file

        return load_file(str(self._path(name)), device=str(self._device[name]))["weight"]

    def get(self, name: str, default: Any = None) -> Any:
        return self[name] if name in self else default

    def values(self) -> Any:
        return [self[n] for n in self]

    def items(self) -> Any:
        return [(n, self[n]) for n in self]


def _per_block(streamed: StreamedModel, plan: Mapping[str, Scheme]) -> dict[int, dict[str, Scheme]]:
    out: dict[int, dict[str, Scheme]] = {}
    for name, scheme in plan.items():
        b = streamed.stack.block_of(name)
        if b is not None:
            out.setdefault(b, {})[name] = scheme
    return out


def round_gptq_streamed(streamed: StreamedModel, plan: Mapping[str, Scheme | str], input_ids: Tensor, *,
                        cache: dict[str, Tensor], inputs: PlanInputs = NO_INPUTS, batch_size: int = 4,
                        progress: Progress | None = None, should_cancel: ShouldCancel | None = None) -> list[str]:
    """Round every layer of ``plan`` that rounds with GPTQ and is not in ``cache`` yet into ``cache`` (module
    docstring), block by block; the layers rounded. ``inputs``: the plan's other calibrated inputs (SmoothQuant's
    statistics, AWQ's factors), as the score will apply them; its Hessians and cache are this function's."""
    schemes = {n: get_scheme(s) for n, s in plan.items()}
    wanted = [n for n, s in schemes.items() if s.needs_hessians and n not in cache]
    if not wanted:
        return []
    blocks = _per_block(streamed, schemes)
    todo = {b for n in wanted if (b := streamed.stack.block_of(n)) is not None}
    head = [n for n in wanted if streamed.stack.block_of(n) is None]  # lm_head: on the final hidden states
    last = max(todo, default=-1)

    @contextmanager
    def block(i: int) -> Iterator[None]:
        if i not in todo:
            yield
            return
        layers = [n for n in wanted if streamed.stack.block_of(n) == i]
        with hessians_hooked(streamed.model, layers) as finish:
            yield
        _round(streamed, blocks[i], inputs.replace(weight_hessians=finish(), gptq_cache=cache))
        if i == last and not head:
            raise _Done

    def ids_progress(f: float, msg: str) -> None:
        if progress is not None:
            progress(f, f"GPTQ: Hessians and rounding, {msg}")

    ids = input_ids.detach().cpu()
    try:
        with all_experts():  # every block as in collect_hessians's passes: an MoE block's experts see every token
            states = streamed.run(ids, batch_size=batch_size, block_context=block, progress=ids_progress,
                                  should_cancel=should_cancel)
    except _Done:
        return wanted
    with streamed.final(ids, states) as model, hessians_hooked(model, head) as finish, torch.no_grad():
        for start in range(0, ids.shape[0], batch_size):  # the whole model's passes, as collect_hessians's
            model(input_ids=ids[start:start + batch_size].to(streamed.device))
        hessians = finish()
    _round(streamed, {n: s for n, s in schemes.items() if streamed.stack.block_of(n) is None},
           inputs.replace(weight_hessians=hessians, gptq_cache=cache))
    return wanted


def _round(streamed: StreamedModel, plan: Mapping[str, Scheme], inputs: PlanInputs) -> None:
    """Apply ``plan`` (one block's share, or the head's) once and undo it: its GPTQ layers are rounded into
    ``inputs.gptq_cache`` on ``inputs.weight_hessians``."""
    with quantized_model(streamed.model, plan, inputs, track_stats=False):
        pass


def awq_search_streamed(streamed: StreamedModel, plan: Mapping[str, Scheme | str], input_ids: Tensor, *,
                        batch_size: int = 4, n_grid: int = AWQ_N_GRID, duo_scaling: bool = AWQ_DUO_SCALING,
                        progress: Progress | None = None, should_cancel: ShouldCancel | None = None) -> AwqResult:
    """:func:`quantcore.algorithms.awq.awq_search`, streamed (module docstring): the same result."""
    schemes = {n: get_scheme(s) for n, s in plan.items()}
    wanted = [n for n, s in schemes.items() if s.awq]
    result = AwqResult()
    if not wanted:
        return result
    mappings, skipped = awq_mappings(streamed.model, wanted)
    result.skipped.update(skipped)
    if not mappings:
        return result
    spec_of = {n: schemes[n].weight_spec() for n in wanted}
    search = BlockSearch(streamed.model, mappings, spec_of, result, n_grid=n_grid, duo_scaling=duo_scaling,
                         progress=progress, should_cancel=should_cancel)
    last = search.last

    def observed(i: int) -> AbstractContextManager[None]:
        if i > last:
            raise _Done
        if should_cancel is not None and should_cancel():
            raise Cancelled("cancelled during the AWQ search")
        return search.observed(i)  # the unscaled pass, inputs recorded, every expert on every token

    @contextmanager
    def folded(i: int) -> Iterator[None]:
        handles = search.search(i)
        try:
            yield  # the next block's inputs: this block again with its folds in place
        finally:
            for h in reversed(handles):
                h.restore()

    def rerun(i: int) -> AbstractContextManager[None] | None:
        if not search.has(i):
            return None
        if i == last:  # nothing reads this block's outputs: search, fold nothing further
            with folded(i):
                pass
            raise _Done
        return folded(i)

    try:
        with torch.no_grad():
            streamed.run(input_ids, batch_size=batch_size, block_context=observed, rerun=rerun)
    except _Done:
        pass
    return result


__all__ = ["SpilledWeights", "awq_search_streamed", "round_gptq_streamed"]
