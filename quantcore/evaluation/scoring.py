"""Score a quantization plan against the unquantized model: KL, top-1 agreement, perplexity.

The reference is the unquantized model run on the same evaluation tokens, computed once and kept
(:mod:`quantcore.evaluation.reference`, which says how its log-probs are stored and why an identity plan scores a
KL of exactly 0). Scoring runs the evaluation tokens in the same batches as the reference (``batch_size`` defaults
to the reference's own), so an identity plan repeats the reference computation operation for operation.

The calibrated inputs a plan needs (activation maxima, Hessians, AWQ scales, KV maxima, the GPUs it is served on)
travel as one :class:`quantcore.algorithms.inputs.PlanInputs`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import numpy as np
import torch
from torch import Tensor, nn

from quantcore.algorithms.inputs import NO_INPUTS, PlanInputs
from quantcore.errors import PlanError, name_list
from quantcore.evaluation.batches import (
    Progress,
    ShouldCancel,
    as_token_batch,
    batch_ranges,
    check_cancel,
    embedding_rows,
    iter_logits,
    report_progress,
    run_forward,
    tied_head,
)
from quantcore.evaluation.compact import tail_bound
from quantcore.evaluation.reference import ReferenceCache, compare_rows
from quantcore.schemes.numerics import NUMERICS
from quantcore.schemes.presets import get_scheme
from quantcore.schemes.specs import Scheme

DEFAULT_POSITION_BUCKETS = 8  # equal-width buckets of the position in the sequence
# KL histogram edges (nats): 0, then 1e-6 .. 1e2 at 4 bins per decade; KL >= 1e2 counts in the last bin.
KL_HIST_EDGES: tuple[float, ...] = (0.0, *(10.0 ** (k / 4) for k in range(-24, 9)))
# a static scale that clips more than this share of a layer's inputs gets a note in the report; below
# it, clipping is the drift of upstream quantization error past the calibrated max, not a bad calibration
SATURATION_NOTE = 1e-3


# ---------------------------------------------------------------------- the report

@dataclass
class ScoreReport:
    """How far a quantized model's next-token distributions are from the reference.

    kl_mean, kl_p50, kl_p90, kl_p99, kl_max: per-token KL(p_ref || p_quant) in nats
    top1_agree:     share of positions whose argmax token equals the reference's
    ppl_ref, ppl:   perplexity of the reference and of the quantized model
    tokens:         number of scored positions
    kl_by_position: ``[{bucket_start, bucket_end, kl_mean}]``, positions in the sequence, end exclusive
    kl_hist:        ``{edges: [...], counts: [...]}`` on KL_HIST_EDGES (first bin holds exact zeros)
    act_saturation: ``{layer: fraction of input elements clipped}`` for layers with static
                    (calibrated) activation scales: a static scale that clips live traffic shows here
    kv_cache:       the KV cache format scored (:mod:`quantcore.evaluation.kvcache`; ``AUTO``: not quantized)
    kv_saturation:  ``{attention layer: fraction of K and V elements clipped}`` under that format
    notes:          messages for people about how the plan was applied (e.g. smoothing skipped)
    numerics:       :data:`quantcore.schemes.numerics.NUMERICS` of the quantcore that scored it (1 when a stored report
                    has none)

    Statistics with their uncertainty (:mod:`quantcore.evaluation.statistics`: standard errors over per-sequence
    blocks, percentiles by numpy's linear interpolation); None in a report stored before they existed, errors None
    with one sequence:

    kl_mean_err:    standard error of kl_mean
    kl_p999 .. kl_p001, kl_min: the rest of llama.cpp's percentile set of per-token KL (99.9, 95, 10, 5, 1, 0.1 %)
    top1_agree_err: standard error of top1_agree ("same top p")
    ln_ppl_ratio, ln_ppl_ratio_err: ln(PPL_q / PPL_ref) = mean(nll_q - nll_ref) on the same tokens, with its error
    dp_*:           Δp, the probability of the reference's top token under the quantized model minus under the
                    reference: dp_mean ± dp_mean_err, dp_rms ± dp_rms_err, dp_max, dp_p999 .. dp_p001, dp_min
                    (None where the scorer gave no Δp)
    sequences:      S, the number of evaluation sequences (the blocks of the errors)
    eval_key:       the evaluation set's key (the reference cache's): two scores with the same key were measured on
                    the same tokens and can be compared sequence by sequence
    kl_by_sequence, top1_by_sequence, nll_diff_by_sequence, dp_by_sequence: per-sequence means (S floats each) of
                    KL, top-1 agreement, nll_q - nll_ref and Δp: what a paired comparison of two stored scores reads
    reference_kind: the reference scored against: ``full`` (every log-prob: the KL is exact), ``topk`` (the
                    compact record, :mod:`quantcore.evaluation.compact`) or ``recomputed`` (computed in the
                    job, not kept); None for a report stored before quantplan said
    topk:           tokens per position of a compact reference (None otherwise)
    kl_tail_bound:  half-width of the interval around kl_mean that holds the full-vocabulary KL mean (4
                    standard errors of the compact estimate's sampled tail part; 0 for a full reference)
    kl_lower:       the KL mean's exact part against a compact reference, a lower bound of the true KL mean
    """

    kl_mean: float
    kl_p50: float
    kl_p90: float
    kl_p99: float
    kl_max: float
    top1_agree: float
    ppl_ref: float
    ppl: float
    tokens: int
    kl_by_position: list[dict[str, float]] = field(default_factory=list)
    kl_hist: dict[str, list[float]] = field(default_factory=dict)
    act_saturation: dict[str, float] = field(default_factory=dict)
    kv_cache: str = "AUTO"
    kv_saturation: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    numerics: int = NUMERICS
    kl_mean_err: float | None = None
    kl_p999: float | None = None
    kl_p95: float | None = None
    kl_p10: float | None = None
    kl_p05: float | None = None
    kl_p01: float | None = None
    kl_p001: float | None = None
    kl_min: float | None = None
    top1_agree_err: float | None = None
    ln_ppl_ratio: float | None = None
    ln_ppl_ratio_err: float | None = None
    dp_mean: float | None = None
    dp_mean_err: float | None = None
    dp_rms: float | None = None
    dp_rms_err: float | None = None
    dp_max: float | None = None
    dp_p999: float | None = None
    dp_p99: float | None = None
    dp_p95: float | None = None
    dp_p90: float | None = None
    dp_p50: float | None = None
    dp_p10: float | None = None
    dp_p05: float | None = None
    dp_p01: float | None = None
    dp_p001: float | None = None
    dp_min: float | None = None
    sequences: int | None = None
    eval_key: str | None = None
    kl_by_sequence: list[float] | None = None
    top1_by_sequence: list[float] | None = None
    nll_diff_by_sequence: list[float] | None = None
    dp_by_sequence: list[float] | None = None
    reference_kind: str | None = None
    topk: int | None = None
    kl_tail_bound: float = 0.0
    kl_lower: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data (floats, ints, lists); :meth:`from_dict` inverts it."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ScoreReport:
        return cls(**{"numerics": 1, **{k: data[k] for k in cls.__dataclass_fields__ if k in data}})


def summarize(
    kl: Tensor,
    agree: Tensor,
    nll: Tensor,
    nll_ref: Tensor,
    *,
    position_buckets: int = DEFAULT_POSITION_BUCKETS,
    dp: Tensor | None = None,
) -> ScoreReport:
    """Build a :class:`ScoreReport` from per-position arrays, all ``[S, L-1]``.

    kl: KL per position; agree: bool, top-1 equal; nll / nll_ref: -log p(next token); dp: Δp per position (the
    probability of the reference's top token under the quantized model minus under the reference), or None (the
    report's Δp figures stay None). Errors are per-sequence block errors (:mod:`quantcore.evaluation.statistics`).
    """
    from quantcore.evaluation import statistics as stats

    kl_np = kl.detach().double().cpu().numpy()
    if kl_np.ndim == 1:
        kl_np = kl_np[None, :]
    flat = kl_np.reshape(-1)
    width = kl_np.shape[1]
    n_buckets = max(1, min(position_buckets, width))
    edges = np.unique(np.linspace(0, width, n_buckets + 1).round().astype(int))
    by_pos = [
        {"bucket_start": int(a), "bucket_end": int(b), "kl_mean": float(kl_np[:, a:b].mean())}
        for a, b in zip(edges[:-1], edges[1:], strict=True)
    ]
    hist_edges = np.asarray(KL_HIST_EDGES)
    counts, _ = np.histogram(np.clip(flat, 0.0, hist_edges[-1]), bins=hist_edges)
    agree_np = agree.detach().double().cpu().numpy().reshape(kl_np.shape)
    nll_np = nll.detach().double().cpu().numpy().reshape(kl_np.shape)
    nll_ref_np = nll_ref.detach().double().cpu().numpy().reshape(kl_np.shape)
    kl_est, agree_est = stats.block_mean(kl_np), stats.block_mean(agree_np)
    ratio = stats.block_mean(nll_np - nll_ref_np)
    pct = stats.percentiles(flat)
    report = ScoreReport(
        kl_mean=float(flat.mean()),
        kl_p50=pct["p50"],
        kl_p90=pct["p90"],
        kl_p99=pct["p99"],
        kl_max=pct["max"],
        top1_agree=float(agree_np.mean()),
        ppl_ref=float(math.exp(float(nll_ref_np.mean()))),
        ppl=float(math.exp(float(nll_np.mean()))),
        tokens=int(flat.size),
        kl_by_position=by_pos,
        kl_hist={"edges": [float(x) for x in hist_edges], "counts": [int(c) for c in counts]},
        kl_mean_err=kl_est.err,
        kl_p999=pct["p999"], kl_p95=pct["p95"], kl_p10=pct["p10"], kl_p05=pct["p05"], kl_p01=pct["p01"],
        kl_p001=pct["p001"], kl_min=pct["min"],
        top1_agree_err=agree_est.err,
        ln_ppl_ratio=ratio.value,
        ln_ppl_ratio_err=ratio.err,
        sequences=int(kl_np.shape[0]),
        kl_by_sequence=stats.sequence_means(kl_np),
        top1_by_sequence=stats.sequence_means(agree_np),
        nll_diff_by_sequence=stats.sequence_means(nll_np - nll_ref_np),
    )
    if dp is not None:
        dp_np = dp.detach().double().cpu().numpy().reshape(kl_np.shape)
        dp_est, dp_rms, dp_pct = stats.block_mean(dp_np), stats.rms(dp_np), stats.percentiles(dp_np)
        report.dp_mean, report.dp_mean_err = dp_est.value, dp_est.err
        report.dp_rms, report.dp_rms_err = dp_rms.value, dp_rms.err
        for key, value in dp_pct.items():
            setattr(report, f"dp_{key}", value)
        report.dp_by_sequence = stats.sequence_means(dp_np)
    return report


# ---------------------------------------------------------------------- applying a plan


def _as_schemes(plan: Mapping[str, Scheme | str]) -> dict[str, Scheme]:
    out: dict[str, Scheme] = {}
    for layer, s in plan.items():
        if isinstance(s, str):
            try:
                s = get_scheme(s)
            except (KeyError, ValueError) as exc:
                raise PlanError(f"layer {layer!r}: {exc}") from exc
        out[layer] = s
    return out


def _to_tensor(x: Any) -> Tensor:
    return (
        x.detach().float().cpu()
        if isinstance(x, Tensor)
        else torch.as_tensor(np.asarray(x), dtype=torch.float32)
    )


@dataclass
class AppliedContext:
    """What :func:`plan_applied` did to the model.

    handle:    the handle ``quantcore.algorithms.apply.apply_plan`` returned
    smoothing: ``{layer: [K] factor s}`` of every layer whose input was divided by s
    notes:     messages for people, e.g. a layer whose scheme asks for SmoothQuant that
               could not be smoothed exactly (it is quantized unsmoothed)
    awq:       ``{layer: [K] factor s}`` of every layer whose input AWQ's factors divided, after the smoothing (the
               Fisher estimate feeds a layer's kept input through ``x / (smoothing * awq)``)
    """

    handle: Any
    smoothing: dict[str, Tensor] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    awq: dict[str, Tensor] = field(default_factory=dict)


@contextmanager
def plan_applied(
    model: nn.Module,
    plan: Mapping[str, Scheme | str],
    inputs: PlanInputs = NO_INPUTS,
    *,
    before_quantize: Callable[[nn.Module], None] | None = None,
    track_saturation: bool = False,
    keep_originals: bool = True,
    rounded: Mapping[str, Tensor] | None = None,
) -> Iterator[AppliedContext]:
    """Smooth (where a scheme has a SmoothQuant alpha) and fake-quantize ``model`` for the block.

    On exit — normal, error or cancel — the plan and the smoothing are undone in
    reverse order and the model's weights are bit-identical to before.

    inputs: the plan's calibrated inputs (:class:`quantcore.algorithms.inputs.PlanInputs`); what each field is needed
        for here:

        - ``act_channel_max`` (``{layer: [K] max |x_j| per input channel}``): every layer whose scheme smooths.
        - ``act_amax`` (``{layer: max |x|}``): static activation scales. For a smoothed layer the static amax of its
          *smoothed* input is derived exactly from the channel maxima and the factors, ``max_j(channel_max_j /
          s_j)``, since calibration saw the unsmoothed input.
        - ``weight_hessians`` (``{layer: Hessian}`` of the unsmoothed inputs): every layer whose scheme rounds with
          GPTQ (:func:`quantcore.algorithms.gptq.collect_hessians`); ``gptq_cache``: see
          :func:`quantcore.algorithms.apply.apply_plan`.
        - ``awq``: the factors :func:`quantcore.algorithms.awq.awq_search` found for the layers whose scheme scales
          with AWQ (needed when there are any); they are folded after SmoothQuant's, before rounding. A layer the
          search skipped is rounded unscaled, with a note.
        - ``parallel``: the GPUs the plan is served on: row-parallel layers take their dynamic activation scales over
          each GPU's share of the input (see :func:`quantcore.algorithms.apply.apply_plan`); None: one GPU.

        ``kv_amax`` is not read here (the KV cache is :func:`score_plan`'s).
    before_quantize: called with the model after smoothing, just before fake
        quantization (the sensitivity sweep keeps the unquantized weights there).
    track_saturation: count clipped activations of layers with static scales
        (``ctx.handle.stats()``); dynamic scales cannot clip, so they are never tracked.
    keep_originals: False: the rounded weights are written over the model's own (no copy: see
        :func:`quantcore.algorithms.apply.apply_plan`); on exit only the hooks are removed and the model is left
        unusable for another plan (the last use of a loaded model, as a score job's).
    rounded: {layer: its weight already rounded alike by an earlier application}, taken as it is
        (:func:`quantcore.algorithms.apply.apply_plan`'s ``rounded``: schemes that fold no factors; the Fisher
        estimate's INT8_PER_TENSOR and INT8_W8A8 share one rounding).

    Yields an :class:`AppliedContext`.
    """
    from quantcore.algorithms.apply import apply_plan

    act_amax, act_channel_max, awq = inputs.act_amax, inputs.act_channel_max, inputs.awq
    weight_hessians, gptq_cache, parallel = inputs.weight_hessians, inputs.gptq_cache, inputs.parallel

    schemes = _as_schemes(plan)
    alphas = {
        layer: float(s.smoothquant_alpha)
        for layer, s in schemes.items()
        if s.smoothquant_alpha is not None and not s.is_identity
    }
    if alphas:
        missing = [layer for layer in alphas if act_channel_max is None or layer not in act_channel_max]
        if missing:
            raise PlanError(
                f"SmoothQuant needs calibrated per-channel activation maxima for {len(missing)} layer(s) "
                f"({name_list(missing)}); run a calibration job for "
                "this model first, or choose schemes without SmoothQuant for these layers"
            )
    awq_layers = [layer for layer, s in schemes.items() if s.needs_awq]
    if awq_layers and awq is None:
        raise PlanError(
            f"AWQ scales the inputs of {name_list(awq_layers)} by factors searched on calibration text: run "
            "quantcore.algorithms.awq.awq_search first, or choose a scheme without AWQ"
        )
    rotated = None
    rotation_notes: list[str] = []
    smoothing = None
    awq_folds = None
    applied = None
    try:
        if inputs.rotation is not None:  # first: smoothing, rounding and scales see the rotated model
            from quantcore.algorithms.rotation import rotate_for_plan

            rotated, alphas, rotation_notes = rotate_for_plan(model, inputs.rotation, alphas)
        amax = dict(act_amax) if act_amax is not None else None
        if alphas:
            from quantcore.algorithms.smoothquant import smooth_model

            assert act_channel_max is not None  # checked above
            try:
                smoothing = smooth_model(
                    model, {k: act_channel_max[k] for k in alphas}, alphas, layers=list(alphas)
                )
            except PlanError:
                raise
            except ValueError as exc:  # e.g. one fusion group asked for two alphas
                raise PlanError(f"SmoothQuant cannot be applied as planned: {exc}") from exc
            if amax is not None:
                for layer, s in smoothing.factors.items():
                    if layer in amax and layer in act_channel_max:
                        cm = _to_tensor(act_channel_max[layer])
                        amax[layer] = float((cm / _to_tensor(s)).max())
        awq_notes = []
        if awq_layers:
            from quantcore.algorithms.smoothquant import fold_factors

            assert awq is not None
            found = {layer: awq.factors[layer] for layer in awq_layers if layer in awq.factors}
            why: dict[str, list[str]] = {}  # one note per reason, however many layers share it
            for layer in awq_layers:
                if layer not in found:
                    why.setdefault(awq.skipped.get(layer, "no factors were searched for it"), []).append(layer)
            awq_notes = [
                f"AWQ not applied to {len(layers)} layer(s) ({name_list(layers, 3)}): {reason}; rounded to nearest "
                "unscaled"
                for reason, layers in why.items()
            ]
            if found:
                awq_folds = fold_factors(model, found)
        if before_quantize is not None:
            before_quantize(model)
        static = any(s.activations is not None and not s.activations.dynamic for s in schemes.values())
        hessians = weight_hessians
        if smoothing is not None and weight_hessians is not None:
            from quantcore.algorithms.apply import gptq_hessians

            hessians = gptq_hessians(schemes, weight_hessians, smoothing.factors, rounded=gptq_cache or ())
        applied = apply_plan(model, schemes, PlanInputs(act_amax=amax, weight_hessians=hessians, gptq_cache=gptq_cache,
                                                        parallel=parallel), track_stats=track_saturation and static,
                             keep_originals=keep_originals, rounded=rounded)
        unsmoothed: dict[str, list[str]] = {}  # one note per reason, however many layers share it (MoE experts)
        for layer, reason in (smoothing.skipped.items() if smoothing is not None else ()):
            unsmoothed.setdefault(reason, []).append(layer)
        notes = [
            f"{layers[0]}: SmoothQuant not applied ({reason}); the layer is quantized unsmoothed" if len(layers) == 1
            else f"{len(layers)} layers ({name_list(layers, 3)}): SmoothQuant not applied ({reason}); they are "
                 "quantized unsmoothed"
            for reason, layers in unsmoothed.items()
        ] + awq_notes + rotation_notes
        yield AppliedContext(
            handle=applied, smoothing=dict(smoothing.factors) if smoothing is not None else {}, notes=notes,
            awq=dict(awq_folds.factors) if awq_folds is not None else {},
        )
    finally:
        if applied is not None:
            applied.restore()
        # rounded in place (keep_originals=False): nothing to put back, the model says so (check_intact)
        if keep_originals or applied is None:
            if awq_folds is not None:
                awq_folds.restore()
            if smoothing is not None:
                smoothing.restore()
            if rotated is not None:
                rotated.restore()


# ---------------------------------------------------------------------- scoring


def calibrate_kv_cache(
    model: nn.Module,
    plan: Mapping[str, Scheme | str],
    input_ids: Tensor,
    *,
    inputs: PlanInputs = NO_INPUTS,
    batch_size: int = 4,
    should_cancel: ShouldCancel | None = None,
) -> Any:
    """Per attention layer max |K| and |V| on calibration tokens, with ``plan`` applied as it will be
    served (K and V come out of the quantized k_proj / v_proj): what calibrated KV cache scales
    (amax / 448) are made of; |Q| is recorded too. Returns a :class:`quantcore.evaluation.kvcache.KvAmax`.
    ``inputs``: the plan's calibrated inputs, as :func:`plan_applied` reads them (``kv_amax`` is what this
    computes, so it is not read); their ``gptq_cache`` is filled here and reused by the score that follows."""
    from quantcore.evaluation.kvcache import kv_amax_observed

    ids = as_token_batch(input_ids)
    ranges = batch_ranges(ids.shape[0], batch_size)
    with plan_applied(model, plan, inputs=inputs), kv_amax_observed(model) as amax:
        for i, (s, e) in enumerate(ranges):
            check_cancel(should_cancel, f"KV cache calibration (batch {i + 1} of {len(ranges)})")
            run_forward(model, ids[s:e])  # K and V are what it observes: no logits
    return amax


def _clipping_note(saturation: Mapping[str, float], template: str) -> str | None:
    """``template`` filled with how many layers clipped more than :data:`SATURATION_NOTE` of their elements
    (``n``), the worst of them (``worst``) and its share (``share``); None when none did."""
    clipped = {k: v for k, v in saturation.items() if v > SATURATION_NOTE}
    if not clipped:
        return None
    worst = max(clipped, key=clipped.__getitem__)
    return template.format(n=len(clipped), worst=worst, share=clipped[worst])


def score_plan(
    model: nn.Module,
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
    keep_originals: bool = True,
) -> ScoreReport:
    """Score ``plan`` (``{layer: Scheme}``) on ``input_ids`` ``[S, L]`` against ``reference``.

    Applies smoothing and the plan, runs the evaluation tokens batch by batch
    (``batch_size`` defaults to the reference's, which keeps an identity plan
    bit-identical to the reference), and restores the model exactly afterwards, also
    on error or cancel. Layers missing from ``plan`` stay unquantized.

    inputs: the plan's calibrated inputs (:class:`quantcore.algorithms.inputs.PlanInputs`), as
        :func:`plan_applied` reads them; and ``kv_amax``, the K / V maxima a calibrated KV cache format needs
        (:func:`calibrate_kv_cache`). Their ``gptq_cache`` (GPTQ-rounded weights to reuse and fill, see
        :func:`quantcore.algorithms.apply.apply_plan`), the same dict given to :func:`calibrate_kv_cache` before,
        rounds each GPTQ layer once for both; ``parallel`` (a plan's ``tensor_parallel``, ``expert_parallel``):
        row-parallel layers quantize each GPU's share of their input on its own dynamic scale.
    kv_cache: a KV cache format (:mod:`quantcore.evaluation.kvcache`) to store K and V in as well; a calibrated
        one (``FP8``) needs ``inputs.kv_amax``.
    kv_skip: a plan's ``kv_cache_skip`` entries (decoder layer indices, ``"sliding_window"``): those
        attention layers keep the model's dtype (:func:`quantcore.evaluation.kvcache.kv_skip_layers`).
    keep_originals: False for the last use of a loaded model (a score job's): the rounded weights are written over
        the original ones instead of beside them, so the score's peak memory is the model's once, not up to twice
        (:func:`quantcore.algorithms.apply.apply_plan`); under a tied head the input embedding reads a copy of the
        evaluation's rows only (:func:`quantcore.evaluation.batches.embedding_rows`). The figures are bit-equal to
        a score that keeps them; the model is not restored afterwards and refuses another plan.
    """
    from quantcore.evaluation.kvcache import get_kv_format, kv_cache_quantized, kv_skip_layers
    from quantcore.models.decoder import attention_modules
    from quantcore.models.summary import attention_windows

    kv = get_kv_format(kv_cache)
    skip = (kv_skip_layers(kv_skip, attention_modules(model), attention_windows(cast(Any, model)))
            if kv_skip and not kv.is_identity else set())
    ids = as_token_batch(input_ids)
    reference.check_tokens(ids)
    static_layers = {
        layer
        for layer, sc in _as_schemes(plan).items()
        if sc.activations is not None and not sc.activations.dynamic
    }
    bs = reference.batch_size if batch_size is None else batch_size
    ranges = batch_ranges(ids.shape[0], bs)
    kl, kl_lower, tail_var, nll, dp = (torch.empty_like(reference.nll) for _ in range(5))
    agree = torch.empty(reference.nll.shape, dtype=torch.bool)
    rows = embedding_rows(model, ids) if not keep_originals and tied_head(model) else nullcontext()
    with rows, plan_applied(model, plan, inputs=inputs, track_saturation=True, keep_originals=keep_originals) as ctx, \
            kv_cache_quantized(model, kv, amax=inputs.kv_amax, skip=skip) as kv_ctx:
        for i, (s, e) in enumerate(ranges):
            check_cancel(should_cancel, f"scoring (batch {i + 1} of {len(ranges)})")
            # logits a chunk of positions at a time, never [B, L, V]; compared with the reference as they come
            for j, a, b, logits in iter_logits(model, ids[s:e]):
                c = compare_rows(reference, s + j, a, b, logits, ids[s + j, a + 1:b + 1])
                kl[s + j, a:b], kl_lower[s + j, a:b], tail_var[s + j, a:b] = c.kl, c.kl_lower, c.tail_var
                nll[s + j, a:b], agree[s + j, a:b], dp[s + j, a:b] = c.nll, c.agree, c.dp
                del logits
            report_progress(progress, (i + 1) / len(ranges), f"scoring: {e} of {ids.shape[0]} sequences")
        saturation = {
            layer: st.activations.saturation
            for layer, st in ctx.handle.stats().items()
            if layer in static_layers and st.activations is not None and st.activations.n_elements > 0
        }
    report = summarize(kl, agree, nll, reference.nll, position_buckets=position_buckets, dp=dp)
    report.reference_kind, report.topk = reference.reported_kind, reference.topk
    report.kl_tail_bound = tail_bound(tail_var)
    report.kl_lower = float(kl_lower.double().mean())
    report.eval_key = reference.eval_key  # scores with the same key can be paired sequence by sequence
    return finish_report(report, kv=kv, saturation=saturation, kv_saturation=kv_ctx.saturation, notes=ctx.notes)


def finish_report(report: ScoreReport, *, kv: Any, saturation: dict[str, float], kv_saturation: dict[str, float],
                  notes: Sequence[str]) -> ScoreReport:
    """``report`` with how the plan was applied: the static scales' and the KV cache's clipping (and a note for
    people where it is large), the KV cache format and the plan's notes (:func:`score_plan`; a streamed score
    gathers them block by block, :mod:`quantcore.evaluation.streamed`)."""
    report.act_saturation = saturation
    report.kv_cache = kv.name
    report.kv_saturation = kv_saturation
    report.notes = list(notes)
    if kv.attention:
        fix = ("calibrate on text like this for K and V" if kv.calibrated else
               "calibrated K/V scales (kv_cache FP8_ATTN) avoid K/V clipping")
        fix += "; Q runs at scale 1.0 in vLLM's FP8 attention"
    else:
        fix = ("calibrate on text like this" if kv.calibrated else
               "calibrated K/V scales (kv_cache FP8) or FP8_E5M2 avoid this")
    what = "Q, K or V" if kv.attention else "K or V"
    for note in (_clipping_note(report.kv_saturation, f"the {kv.name} KV cache clipped {what} in {{n}} attention "
                                f"layer(s), worst {{worst}} ({{share:.3%}} of its elements): {fix}"),
                 _clipping_note(saturation, "static activation scales clipped live traffic in {n} layer(s), worst "
                                "{worst} ({share:.3%} of its inputs): the calibration text did not cover this text's "
                                "range; calibrate on text like this, or use dynamic scales for these layers")):
        if note:
            report.notes.append(note)
    return report
