"""Calibration: run text through a model and record what every ``nn.Linear`` sees.

A forward pre-hook on each linear (``lm_head`` included) reduces the layer's
input ``x`` [tokens, K] to:

- ``channel_max``  [K]: max |x[:, j]|, the per-input-channel amax;
- per-token max |x[t, :]|, one float per token, summarised at the end
  (p50 / p90 / p99 / max / mean);
- a histogram of |x| on the fixed log grid of :mod:`quantcore.evaluation.stats`, exact
  zeros counted apart;

and once per layer its weight's per-input-channel max |W[:, j]| (the
SmoothQuant denominator).

Cost.  The statistics are accumulated on the model's device in float32 and
never wait on an accelerator until the end (no ``.item()`` on a device tensor in a hook).
Linears fed the very same tensor (q/k/v, gate/up) share one reduction.  The
histogram avoids ``log2`` and ``histc``: raising |x| to the power
``HIST_BINS_PER_OCTAVE`` (two squarings for quarter octaves) multiplies log2|x|
by that power, so the float32 exponent field of |x|**4 *is* the bin index
floor(4·log2|x|) up to an offset.  Two in-place multiplies, one shift and one
``bincount`` over 256 exponent values replace a transcendental per element.
Exactness: each multiply rounds to nearest, so a value within one float32 ulp
of a bin edge may land in the neighbouring bin; everything else is binned
exactly as a binary search over ``quantcore.evaluation.stats.hist_edges()`` would (tested
one ulp either side of every edge).  Zeros are counted apart.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from quantcore.errors import Cancelled
from quantcore.evaluation.stats import (
    HIST_BINS,
    HIST_BINS_PER_OCTAVE,
    HIST_LOG2_MAX,
    HIST_LOG2_MIN,
    LayerStats,
)
from quantcore.models.moe import all_experts

ProgressFn = Callable[[float, str], None]
CancelFn = Callable[[], bool]

F32_MANTISSA_BITS = 23  # float32: 1 sign, 8 exponent, 23 mantissa bits
F32_EXPONENT_BIAS = 127
F32_EXPONENT_VALUES = 256  # every value of the 8-bit exponent field (0 = zero/subnormal, 255 = inf/NaN)
HIST_SQUARINGS = int(math.log2(HIST_BINS_PER_OCTAVE))  # |x| -> |x|**BINS_PER_OCTAVE by repeated squaring
# exponent-field value of |x|**BINS_PER_OCTAVE that maps to histogram bin 0
HIST_EXPONENT_OFFSET = F32_EXPONENT_BIAS + HIST_BINS_PER_OCTAVE * HIST_LOG2_MIN  # 127 - 96 = 31
TOKEN_MAX_PERCENTILES = {"p50": 50.0, "p90": 90.0, "p99": 99.0}
# CPU cache blocking of the reductions: measured on a 2-core AMD EPYC (see reduce_input)
CPU_BLOCK_ELEMENTS = 1 << 19  # 2 MiB of float32 per block: the ~8 passes over it stay in cache
CPU_BLOCKING_ABOVE = 1 << 21  # smaller inputs (8 MiB) are reduced whole: blocking them gained nothing


def _check_histogram_grid() -> None:
    """The exponent trick needs a power-of-two bin count per octave and a grid inside float32's normal range."""
    if 2**HIST_SQUARINGS != HIST_BINS_PER_OCTAVE:
        raise RuntimeError(f"quantcore.evaluation.calibrate needs HIST_BINS_PER_OCTAVE to be a power of two, "
                           f"got {HIST_BINS_PER_OCTAVE}")
    low, high = HIST_BINS_PER_OCTAVE * HIST_LOG2_MIN, HIST_BINS_PER_OCTAVE * HIST_LOG2_MAX
    if low < 1 - F32_EXPONENT_BIAS or high > F32_EXPONENT_BIAS:
        raise RuntimeError(f"the histogram grid 2**[{HIST_LOG2_MIN}, {HIST_LOG2_MAX}) at "
                           f"{HIST_BINS_PER_OCTAVE} bins per octave leaves float32's exponent range")


_check_histogram_grid()


@dataclass
class _InputStats:
    """One reduction of a linear's input batch (device tensors, not yet synchronised)."""

    rows: int
    channel_max: torch.Tensor  # float32 [K]
    token_max: torch.Tensor  # float32 [rows]
    exponent_counts: torch.Tensor  # int64 [256]: counts of the exponent field of |x|**BINS_PER_OCTAVE
    zeros: torch.Tensor  # int64 0-d


@dataclass
class _LayerAccumulator:
    """Running statistics of one linear across batches, kept on the model's device."""

    name: str
    module: nn.Linear
    channel_max: torch.Tensor
    exponent_counts: torch.Tensor
    zeros: torch.Tensor
    token_max: list[torch.Tensor] = field(default_factory=list)
    n_tokens: int = 0

    @classmethod
    def for_module(cls, name: str, module: nn.Linear) -> _LayerAccumulator:
        device = module.weight.device
        return cls(
            name=name,
            module=module,
            channel_max=torch.zeros(module.in_features, dtype=torch.float32, device=device),
            exponent_counts=torch.zeros(F32_EXPONENT_VALUES, dtype=torch.int64, device=device),
            zeros=torch.zeros((), dtype=torch.int64, device=device),
        )

    def add(self, stats: _InputStats) -> None:
        """Merge one batch's reduction (in place, no host synchronisation)."""
        torch.maximum(self.channel_max, stats.channel_max, out=self.channel_max)
        self.exponent_counts += stats.exponent_counts
        self.zeros += stats.zeros
        self.token_max.append(stats.token_max)
        self.n_tokens += stats.rows


def reduce_input(x: torch.Tensor) -> _InputStats:
    """Channel max, token max, |x| exponent histogram and zero count of a linear's input [..., K].

    On a CPU a large input is reduced in row blocks of about CPU_BLOCK_ELEMENTS,
    so that the passes over each block run in cache rather than in memory
    (4096 x 4096 floats: about 4x faster); the result is the same.
    """
    rows = x.detach().reshape(-1, x.shape[-1])
    if rows.device.type != "cpu" or rows.numel() <= CPU_BLOCKING_ABOVE:
        return _reduce_rows(rows)
    n_blocks = math.ceil(rows.numel() / CPU_BLOCK_ELEMENTS)
    parts = [_reduce_rows(block) for block in rows.split(math.ceil(rows.shape[0] / n_blocks))]
    channel_max = parts[0].channel_max
    for part in parts[1:]:
        channel_max = torch.maximum(channel_max, part.channel_max)
    return _InputStats(
        rows=rows.shape[0],
        channel_max=channel_max,
        token_max=torch.cat([part.token_max for part in parts]),
        exponent_counts=torch.stack([part.exponent_counts for part in parts]).sum(0),
        zeros=torch.stack([part.zeros for part in parts]).sum(),
    )


def _reduce_rows(rows: torch.Tensor) -> _InputStats:
    """reduce_input of one 2-D block [rows, K], in one go."""
    a = rows.abs() if rows.dtype == torch.float32 else rows.float().abs_()  # a fresh tensor we may overwrite
    channel_max = a.amax(0)
    token_max = a.amax(1)
    for _ in range(HIST_SQUARINGS):  # a <- a**BINS_PER_OCTAVE, in place
        a.mul_(a)
    exponents = a.view(torch.int32).bitwise_right_shift_(F32_MANTISSA_BITS)  # sign bit is 0: |x| >= 0
    # the exponent field fits a byte, and bincount over uint8 runs about twice as fast as over int32 on a CPU
    counts = torch.bincount(exponents.to(torch.uint8).reshape(-1), minlength=F32_EXPONENT_VALUES)
    return _InputStats(rows.shape[0], channel_max, token_max, counts, _zero_count(rows, counts))


def _zero_count(rows: torch.Tensor, exponent_counts: torch.Tensor) -> torch.Tensor:
    """Exact zeros in rows (0-d int64).

    Zeros have exponent field 0 (shared with values too small for the grid).
    On the CPU, reading that count costs nothing, and when it is 0 the extra
    pass over the input is skipped; on an accelerator the pass is cheaper than
    waiting for the device, so it always runs.
    """
    if exponent_counts.device.type == "cpu" and not exponent_counts[0]:
        return torch.zeros((), dtype=torch.int64)
    return rows.numel() - torch.count_nonzero(rows)


def fold_exponent_counts(exponent_counts: np.ndarray, zeros: int) -> np.ndarray:
    """Map counts of the exponent field of |x|**BINS_PER_OCTAVE onto the HIST_BINS grid.

    Exponent ``HIST_EXPONENT_OFFSET + i`` is bin i; exponents below the grid
    (tiny values, subnormals and the exact zeros) fold into bin 0 with the
    zeros taken out again, those above it (large values, inf, NaN) into the last bin.
    """
    counts = np.asarray(exponent_counts, dtype=np.int64)
    hist = counts[HIST_EXPONENT_OFFSET: HIST_EXPONENT_OFFSET + HIST_BINS].copy()
    hist[0] += counts[:HIST_EXPONENT_OFFSET].sum() - zeros
    hist[-1] += counts[HIST_EXPONENT_OFFSET + HIST_BINS:].sum()
    return hist


def token_max_summary(token_max: np.ndarray) -> dict[str, float]:
    """p50 / p90 / p99 / max / mean of the per-token max |x| (all 0.0 when the layer saw no token)."""
    if token_max.size == 0:
        return {key: 0.0 for key in (*TOKEN_MAX_PERCENTILES, "max", "mean")}
    values = token_max.astype(np.float64)
    percentiles = np.percentile(values, list(TOKEN_MAX_PERCENTILES.values()))
    summary = {key: float(value) for key, value in zip(TOKEN_MAX_PERCENTILES, percentiles, strict=True)}
    summary["max"] = float(values.max())
    summary["mean"] = float(values.mean())
    return summary


def weight_channel_max(module: nn.Linear) -> np.ndarray:
    """max |W[:, j]| over the output rows of a linear: float32 [in_features].

    max(amax, -amin) reads W twice but writes nothing, where abs().amax() would
    write a full copy of W first (5x slower for a 49152 x 576 lm_head on a CPU).
    """
    weight = module.weight.detach()
    return torch.maximum(weight.amax(0), weight.amin(0).neg_()).float().cpu().numpy()


def _finish(acc: _LayerAccumulator, summaries: dict[tuple[int, ...], dict[str, float]]) -> LayerStats:
    """Move one accumulator to the host as LayerStats.

    ``summaries`` caches token-max summaries by the identity of the per-batch
    tensors: linears that shared their input (q/k/v, gate/up) share them too.
    """
    zeros = int(acc.zeros.item())
    key = tuple(id(t) for t in acc.token_max)
    if key not in summaries:
        token_max = torch.cat(acc.token_max).cpu().numpy() if acc.token_max else np.zeros(0, np.float32)
        summaries[key] = token_max_summary(token_max)
    return LayerStats(
        name=acc.name,
        in_features=acc.module.in_features,
        out_features=acc.module.out_features,
        n_tokens=acc.n_tokens,
        channel_max=acc.channel_max.cpu().numpy(),
        weight_channel_max=weight_channel_max(acc.module),
        token_max=dict(summaries[key]),
        hist_counts=fold_exponent_counts(acc.exponent_counts.cpu().numpy(), zeros),
        zeros=zeros,
    )


def _forward_kwargs(model: nn.Module) -> dict[str, object]:
    """``use_cache=False`` where the model's forward takes it (a KV cache is useless here)."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    return {"use_cache": False} if "use_cache" in parameters else {}


def _model_device(model: nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")


class Calibration:
    """Statistics of every nn.Linear of a model, accumulated batch by batch.

    Hooks are attached only while :meth:`run` executes, so the same model can
    run plain forwards in between (the benchmark times both side by side).
    Consecutive linears fed the very same, unmodified tensor (q/k/v, gate/up)
    share one reduction.

        cal = Calibration(model)
        for batch in batches:
            cal.run(batch)
        stats = cal.results()
    """

    def __init__(self, model: nn.Module, layers: Collection[str] | None = None) -> None:
        self.model = model
        self.layers = {
            name: _LayerAccumulator.for_module(name, module)
            for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and (layers is None or name in layers)
        }
        self._device = _model_device(model)
        self._kwargs = _forward_kwargs(model)
        self._last_input: torch.Tensor | None = None
        self._last_version = -1
        self._last_stats: _InputStats | None = None

    def _hook_for(self, acc: _LayerAccumulator) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            x = args[0] if args else kwargs["input"]
            if x.numel() == 0:
                return
            acc.add(self._reduce(x))

        return hook

    def _reduce(self, x: torch.Tensor) -> _InputStats:
        """Reduce x, or reuse the last reduction when x is the same, unmodified tensor."""
        if x is self._last_input and x._version == self._last_version and self._last_stats is not None:
            return self._last_stats
        stats = reduce_input(x)
        self._last_input, self._last_version, self._last_stats = x, x._version, stats
        return stats

    def run(self, input_ids: torch.Tensor) -> None:
        """One forward of input_ids [batch, seq_len] with the hooks on: eval mode, no grad.

        The model's train/eval mode is restored and the hooks removed afterwards,
        also when the forward raises. ``layers`` (at construction): only these linears are observed (a streamed
        model's loaded block); default every one.
        """
        with self.hooked():
            self.model(input_ids=input_ids.to(self._device), **self._kwargs)

    @contextmanager
    def hooked(self) -> Iterator[None]:
        """The hooks on, eval mode, no grad, for whatever forwards run in the block (:meth:`run`'s one, or a streamed
        model's block by block: :mod:`quantcore.evaluation.streamed`); undone on exit, also on error."""
        was_training = self.model.training
        handles = [acc.module.register_forward_pre_hook(self._hook_for(acc), with_kwargs=True)
                   for acc in self.layers.values()]
        self.model.eval()
        try:
            with torch.no_grad(), all_experts():  # an MoE model's experts see every token (quantcore.models.moe)
                yield
        finally:
            for handle in handles:
                handle.remove()
            self._last_input, self._last_stats = None, None  # let the last input's memory go
            self.model.train(was_training)

    def results(self) -> dict[str, LayerStats]:
        """The statistics so far, on the host, keyed by module name (also for layers never reached)."""
        summaries: dict[tuple[int, ...], dict[str, float]] = {}
        return {name: _finish(acc, summaries) for name, acc in self.layers.items()}


def calibrate(
    model: nn.Module,
    input_ids: torch.Tensor,
    *,
    batch_size: int = 4,
    progress: ProgressFn | None = None,
    should_cancel: CancelFn | None = None,
) -> dict[str, LayerStats]:
    """Run ``input_ids`` [n, seq_len] through ``model`` and return statistics of every nn.Linear.

    Keys are module names as in ``model.named_modules()``.  The model runs in
    eval mode under ``torch.no_grad()`` in batches of ``batch_size`` sequences;
    its previous train/eval mode is restored afterwards.  ``progress(fraction,
    message)`` is called after each batch; ``should_cancel()`` is checked before
    each batch and, when it returns True, :class:`quantcore.errors.Cancelled` is
    raised (no hook stays attached either way).
    """
    if input_ids.dim() != 2 or input_ids.shape[0] == 0:
        raise ValueError(f"input_ids must be [n_sequences, seq_len] with n >= 1, got shape {tuple(input_ids.shape)}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    n_sequences = input_ids.shape[0]
    calibration = Calibration(model)
    for start in range(0, n_sequences, batch_size):
        if should_cancel is not None and should_cancel():
            raise Cancelled(f"calibration cancelled after {start} of {n_sequences} sequences")
        calibration.run(input_ids[start: start + batch_size])
        done = min(start + batch_size, n_sequences)
        if progress is not None:
            progress(done / n_sequences, f"calibrated {done}/{n_sequences} sequences")
    return calibration.results()
