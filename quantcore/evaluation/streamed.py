"""Calibration, the reference and scoring on a :class:`~quantcore.models.streaming.StreamedModel`: the same results as
the whole-model functions, one decoder block in memory at a time.

- :func:`calibrate_streamed`: :class:`~quantcore.evaluation.calibrate.Calibration`'s hooks on each block's linears
  while the block runs (its statistics, weight maxima included, taken before the block is freed), then on the head
  over the final hidden states.
- :func:`reference_streamed`: the unquantized blocks, then :func:`~quantcore.evaluation.reference.compute_reference`
  on the final hidden states (the reference cache's format is unchanged).
- :func:`score_streamed`: the plan applied to each block's linears as the block loads (``plan_applied`` on that
  block's share of the plan) and to the head for the whole run; the KV cache format on every attention layer; then
  the scorer of :func:`~quantcore.evaluation.scoring.score_plan` on the final hidden states.

Every block sees the batches a whole-model pass of the same ``batch_size`` gives it, through the model's own forward
(:mod:`quantcore.models.streaming`), so on a CPU the results are bit-identical to the whole-model functions
(``tests/quantcore/evaluation/test_streamed.py``). The calibrated inputs a plan reads from a calibration job
(``act_amax``, ``act_channel_max``, ``kv_amax``) work streamed, and so does the KV cache calibration a calibrated KV
cache format needs (:func:`calibrate_kv_cache_streamed`); GPTQ's Hessians and rounding and AWQ's search stream in
:mod:`quantcore.algorithms.streamed_rounding`.

A plan's rotation (``inputs.rotation``) streams too: :func:`score_streamed` and :func:`calibrate_kv_cache_streamed`
rotate the streamed model (:func:`quantcore.algorithms.rotation.rotate_model`: the embedding, final norm and head at
once, each block as it loads, by the whole model's own per-block code) before anything of the plan, and leave a layer
whose input the rotation turns online unsmoothed (:func:`~quantcore.algorithms.rotation.smoothing_kept`), as the
whole-model :func:`~quantcore.evaluation.scoring.plan_applied` does; a rotated calibration is
:func:`calibrate_streamed` inside :func:`~quantcore.algorithms.rotation.rotation_applied` on ``streamed.model``. On a
CPU these are bit-identical to the whole model's (``tests/quantcore/algorithms/test_rotation_streamed.py``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from torch import Tensor, nn

from quantcore.algorithms.inputs import NO_INPUTS, PlanInputs
from quantcore.evaluation.batches import Progress, ShouldCancel, as_token_batch, report_progress
from quantcore.evaluation.calibrate import Calibration
from quantcore.evaluation.reference import ReferenceCache, compute_reference
from quantcore.evaluation.scoring import (
    DEFAULT_POSITION_BUCKETS,
    ScoreReport,
    _as_schemes,
    finish_report,
    plan_applied,
    score_plan,
)
from quantcore.evaluation.stats import LayerStats
from quantcore.models.streaming import StreamedModel
from quantcore.schemes.specs import Scheme

STREAM_SHARE = 0.9  # of a streamed job's progress bar: the blocks; the rest is the head


def _scaled(progress: Progress | None, start: float, share: float) -> Progress | None:
    if progress is None:
        return None
    return lambda f, msg: report_progress(progress, start + share * f, msg)


def calibrate_streamed(streamed: StreamedModel, input_ids: Tensor, *, batch_size: int = 4,
                       progress: Progress | None = None, should_cancel: ShouldCancel | None = None,
                       ) -> dict[str, LayerStats]:
    """:func:`quantcore.evaluation.calibrate.calibrate`'s statistics of every linear, streamed; keys in module order."""
    if input_ids.dim() != 2 or input_ids.shape[0] == 0:
        raise ValueError(f"input_ids must be [n_sequences, seq_len] with n >= 1, got shape {tuple(input_ids.shape)}")
    model = streamed.model
    ids = input_ids.detach().cpu()
    found: dict[str, LayerStats] = {}

    @contextmanager
    def observed(i: int) -> Iterator[None]:
        calibration = Calibration(model, layers=set(streamed.block_names(i)))
        with calibration.hooked():
            yield
        found.update(calibration.results())  # the block's weights are still loaded: its weight maxima too

    states = streamed.run(ids, batch_size=batch_size, block_context=observed,
                          progress=_scaled(progress, 0.0, STREAM_SHARE), should_cancel=should_cancel)
    head = streamed.resident_linears()
    if head:
        calibration = Calibration(model, layers=set(head))
        with streamed.final(ids, states) as whole:
            assert whole is model
            for start in range(0, ids.shape[0], batch_size):
                calibration.run(ids[start:start + batch_size])
        found.update(calibration.results())
    report_progress(progress, 1.0, f"calibrated {ids.shape[0]}/{ids.shape[0]} sequences (streamed)")
    order = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    return {n: found[n] for n in order}


def reference_streamed(streamed: StreamedModel, input_ids: Tensor, *, batch_size: int,
                       progress: Progress | None = None, should_cancel: ShouldCancel | None = None,
                       **options: Any) -> ReferenceCache:
    """:func:`quantcore.evaluation.reference.compute_reference`, streamed (``options``: its keyword arguments)."""
    ids = as_token_batch(input_ids)
    states = streamed.run(ids, batch_size=batch_size, progress=_scaled(progress, 0.0, 0.7),
                          should_cancel=should_cancel)
    with streamed.final(ids, states) as model:
        return compute_reference(model, ids, batch_size=batch_size, progress=_scaled(progress, 0.7, 0.3),
                                 should_cancel=should_cancel, **options)


def _static_layers(schemes: Mapping[str, Scheme]) -> set[str]:
    return {n for n, s in schemes.items() if s.activations is not None and not s.activations.dynamic}


def _saturation(applied: Any, static: set[str]) -> dict[str, float]:
    return {layer: st.activations.saturation for layer, st in applied.handle.stats().items()
            if layer in static and st.activations is not None and st.activations.n_elements > 0}


class _PlanByBlock:
    """A plan applied as a streamed model runs: each block's share as the block loads (:meth:`block`, a
    ``block_context``), the rest (the head) for the whole pass (:meth:`head`); the static scales' clipping and the
    notes gathered from both. The plan's rotation (``inputs.rotation``) is :meth:`rotated`'s, entered around both:
    the shares are applied without it, SmoothQuant left off the layers it rotates online."""

    def __init__(self, streamed: StreamedModel, plan: Mapping[str, Scheme | str], inputs: PlanInputs,
                 track_saturation: bool) -> None:
        self.model, self.inputs, self.track = streamed.model, inputs.replace(rotation=None), track_saturation
        self.rotation = inputs.rotation
        self.schemes, self.rotation_notes = _rotated_schemes(streamed.model, _as_schemes(plan), self.rotation)
        self.static = _static_layers(self.schemes)
        self.head_plan: dict[str, Scheme] = {}
        self.per_block: dict[int, dict[str, Scheme]] = {}
        for n, s in self.schemes.items():
            b = streamed.stack.block_of(n)
            if b is None:
                self.head_plan[n] = s
            else:
                self.per_block.setdefault(b, {})[n] = s
        self.saturation: dict[str, float] = {}
        self.notes: list[str] = []

    def _applied(self, plan: dict[str, Scheme]) -> AbstractContextManager[None]:
        @contextmanager
        def applied() -> Iterator[None]:
            with plan_applied(self.model, plan, inputs=self.inputs, track_saturation=self.track) as ctx:
                yield
                if self.track:
                    self.saturation.update(_saturation(ctx, self.static))
            self.notes.extend(n for n in ctx.notes if n not in self.notes)

        return applied()

    def rotated(self) -> AbstractContextManager[Any]:
        """The plan's rotation on the streamed model (resident part now, each block as it loads), undone on exit."""
        if self.rotation is None:
            return nullcontext()
        from quantcore.algorithms.rotation import rotation_applied

        return rotation_applied(self.model, self.rotation)

    def block(self, i: int) -> AbstractContextManager[None]:
        return self._applied(self.per_block.get(i, {}))

    def head(self) -> AbstractContextManager[None]:
        return self._applied(self.head_plan)

    def ordered_saturation(self) -> dict[str, float]:
        return {n: self.saturation[n] for n in self.schemes if n in self.saturation}


def _rotated_schemes(model: nn.Module, schemes: dict[str, Scheme], rotation: Any
                     ) -> tuple[dict[str, Scheme], list[str]]:
    """(``schemes`` with SmoothQuant off where ``rotation`` rotates the layer's input online, the notes saying so):
    :func:`quantcore.algorithms.rotation.rotate_for_plan`'s choice, made before the plan is split by block."""
    if rotation is None:
        return schemes, []
    from quantcore.algorithms.rotation import online_layers, smoothing_kept

    alphas = {n: float(s.smoothquant_alpha) for n, s in schemes.items()
              if s.smoothquant_alpha is not None and not s.is_identity}
    kept, notes = smoothing_kept(rotation, online_layers(model, rotation), alphas)
    return {n: s.with_alpha(None) if n in alphas and n not in kept else s for n, s in schemes.items()}, notes


def rotated_plan(model: nn.Module, plan: Mapping[str, Scheme | str], rotation: Any) -> dict[str, Scheme]:
    """``plan`` as applied inside ``rotation`` rotated (SmoothQuant off on the layers it rotates online), for a
    streamed pass that rotates the model itself (the streamed GPTQ rounding under a rotation)."""
    return _rotated_schemes(model, _as_schemes(plan), rotation)[0]


def calibrate_kv_cache_streamed(streamed: StreamedModel, plan: Mapping[str, Scheme | str], input_ids: Tensor, *,
                                inputs: PlanInputs = NO_INPUTS, batch_size: int = 4,
                                should_cancel: ShouldCancel | None = None) -> Any:
    """:func:`quantcore.evaluation.scoring.calibrate_kv_cache`, streamed: per attention layer max |K|, |V| (and |Q|)
    on calibration tokens with ``plan`` applied block by block, as served."""
    from quantcore.evaluation.kvcache import kv_amax_observed

    applied = _PlanByBlock(streamed, plan, inputs, track_saturation=False)
    with applied.rotated(), applied.head(), kv_amax_observed(streamed.model) as amax:
        streamed.run(as_token_batch(input_ids), batch_size=batch_size, block_context=applied.block,
                     should_cancel=should_cancel)
    return amax


def score_streamed(
    streamed: StreamedModel,
    plan: Mapping[str, Scheme | str],
    input_ids: Tensor,
    reference: ReferenceCache,
    *,
    inputs: PlanInputs = NO_INPUTS,
    batch_size: int | None = None,
    position_buckets: int = DEFAULT_POSITION_BUCKETS,
    progress: Progress | None = None,
    should_cancel: ShouldCancel | None = None,
    kv_cache: str | None = None,
    kv_skip: Sequence[str] = (),
) -> ScoreReport:
    """:func:`quantcore.evaluation.scoring.score_plan`, streamed: the same report."""
    from quantcore.evaluation.kvcache import get_kv_format, kv_cache_quantized, kv_skip_layers
    from quantcore.models.decoder import attention_modules
    from quantcore.models.summary import attention_windows

    model = streamed.model
    ids = as_token_batch(input_ids)
    reference.check_tokens(ids)
    applied = _PlanByBlock(streamed, plan, inputs, track_saturation=True)
    kv = get_kv_format(kv_cache)
    skip = (kv_skip_layers(kv_skip, attention_modules(model), attention_windows(model))
            if kv_skip and not kv.is_identity else set())
    bs = reference.batch_size if batch_size is None else batch_size
    with applied.rotated(), kv_cache_quantized(model, kv, amax=inputs.kv_amax, skip=skip) as kv_ctx, applied.head():
        states = streamed.run(ids, batch_size=bs, block_context=applied.block,
                              progress=_scaled(progress, 0.0, STREAM_SHARE), should_cancel=should_cancel)
        with streamed.final(ids, states) as whole:
            report = score_plan(whole, {}, ids, reference, batch_size=bs, position_buckets=position_buckets,
                                progress=_scaled(progress, STREAM_SHARE, 1 - STREAM_SHARE),
                                should_cancel=should_cancel)
    return finish_report(report, kv=kv, saturation=applied.ordered_saturation(), kv_saturation=kv_ctx.saturation,
                         notes=applied.notes + applied.rotation_notes)


__all__ = ["calibrate_kv_cache_streamed", "calibrate_streamed", "reference_streamed", "rotated_plan",
           "score_streamed"]
