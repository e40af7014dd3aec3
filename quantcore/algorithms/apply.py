"""Apply a quantization plan to a model by fake quantization, reversibly.

A plan maps ``nn.Linear`` names to schemes. For every targeted layer :func:`apply_plan`

* fake-quantizes the weight once, at apply time, and swaps in the result as a new
  Parameter (the original Parameter object is kept and put back by ``restore()``, so tied
  weights stay intact and the restore is bit-exact);
* registers a forward pre-hook that fake-quantizes the layer's input on every call, with a
  dynamic scale or a static one from the calibrated ``act_amax[layer]``, and counts
  saturation / underflow on the device (no host sync per call). Layers that read the same
  input tensor with the same activation spec (q/k/v, gate/up) share one quantization of it
  (bit-identical to quantizing it per layer; see :class:`_SharedInputs`).

Module names and the model's structure are unchanged, so hooks that others register by
name (calibration, scoring) still find the layers.

The weights are rounded by the handler of their scheme's rounding (RTN, GPTQ, AWQ:
:mod:`quantcore.algorithms.registry`).

SmoothQuant: pass ``act_channel_max`` (in :class:`~quantcore.algorithms.inputs.PlanInputs`) and the schemes' α are
folded first (see :mod:`quantcore.algorithms.smoothquant`), before the weights are quantized; without it the caller
is assumed to have smoothed the model already (as ``quantcore.evaluation.scoring.plan_applied`` does) and the α are
ignored here.

    with quantized_model(model, {"model.layers.0.mlp.down_proj": "FP8_DYNAMIC"}) as applied:
        logits = model(ids).logits
        print(applied.stats()["model.layers.0.mlp.down_proj"].activations.saturation)
"""

from __future__ import annotations

import difflib
import weakref
from collections.abc import Container, Iterator, Mapping, Set
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from quantcore.algorithms import awq as _awq  # noqa: F401 - registers AWQ's rounding handler and transform
from quantcore.algorithms.gptq import smoothed_hessian
from quantcore.algorithms.inputs import NO_INPUTS, PlanInputs
from quantcore.algorithms.registry import WeightRounding, register_rounding_handler, rounding_method
from quantcore.algorithms.smoothquant import SmoothingHandle, smooth_model
from quantcore.errors import PlanError, name_list
from quantcore.formats.quantize import QuantReport, fake_quantize, fake_quantize_with_counts
from quantcore.formats.scales import scale_from_amax
from quantcore.formats.weights import fake_quantize_weight, fused_tensor_scale, weight_scale
from quantcore.models.moe import LinearExperts
from quantcore.models.parallel import Parallelism
from quantcore.schemes.fusion import expert_block, fusion_groups
from quantcore.schemes.presets import get_scheme, list_schemes
from quantcore.schemes.specs import Rounding, Scheme, TensorSpec

_MARKER = "_quantcore_applied"  # attribute set on a wrapped nn.Linear while a plan is applied
# attribute set on a model whose weights a plan applied with keep_originals=False wrote over: {the layers}
_ROUNDED = "_quantcore_rounded_in_place"
# a weight rounded in place a block of rows at a time: about this many elements a block (16 MB in float32)
ROW_BLOCK_ELEMENTS = 1 << 22
_N_COUNTS = 5  # [elements, nonzero, saturated, underflow, nan], as quantcore.formats.quantize reports them


@dataclass(frozen=True)
class LayerQuantStats:
    """What quantization did to one layer.

    weight:      report of the one-time weight quantization (all counts 0 when applied with
                 track_stats=False: not counted, as for the activations)
    activations: report summed over every forward since apply (None for weight-only schemes)
    calls:       forward calls seen
    """

    name: str
    scheme: str
    weight: QuantReport
    activations: QuantReport | None
    calls: int


@dataclass
class _LayerState:
    name: str
    module: nn.Linear
    scheme: Scheme
    original_weight: torch.Tensor  # the layer's weight Parameter object itself (nn.Linear declares it a Tensor)
    weight_report: QuantReport
    static_scale: float | None = None
    counts: torch.Tensor | None = None
    calls: int = 0
    hook: Any = None
    # a routed expert with dynamic per-tensor activations: (its LinearExperts block, "w13" | "w2"), whose
    # block_amax for the current call sets the scale (quantcore.models.moe.LinearExperts._forward_block_scaled)
    block: tuple[LinearExperts, str] | None = None
    # the GPUs' shares of the input a dynamic per-tensor / per-token scale is taken over (a row-parallel layer under
    # tensor parallelism: each GPU quantizes its own K / shards of the input; 1: the whole input)
    shards: int = 1


@dataclass
class AppliedPlan:
    """Handle of an applied plan: ``layers`` wrapped, ``untouched`` (identity schemes), ``restore()``."""

    layers: dict[str, Scheme]
    untouched: list[str]
    smoothing: SmoothingHandle | None = None
    _states: dict[str, _LayerState] = field(default_factory=dict, repr=False)
    _active: bool = True
    _shared: _SharedInputs | None = field(default=None, repr=False)
    # the model, where the plan was applied with keep_originals=False: its weights cannot be put back
    _model: Any = field(default=None, repr=False)

    @property
    def active(self) -> bool:
        """False once :meth:`restore` has run."""
        return self._active

    def stats(self) -> dict[str, LayerQuantStats]:
        """Per-layer weight report and activation saturation / underflow counts (one host sync per layer)."""
        out = {}
        for name, st in self._states.items():
            acts = None
            if st.scheme.activations is not None:
                acts = (
                    QuantReport.from_counts(st.counts)
                    if st.counts is not None
                    else QuantReport(0, 0, 0, 0, 0)
                )
            out[name] = LayerQuantStats(name, st.scheme.name, st.weight_report, acts, st.calls)
        return out

    def input_key(self, name: str) -> tuple | None:
        """What the fake quantization of ``name``'s input depends on besides the input (its activation spec and
        static scale): two layers with equal keys quantize one input tensor to the very same result. None where the
        layer quantizes no input or its scale depends on more (a routed expert's block amax, a row-parallel
        layer's shares)."""
        st = self._states.get(name)
        if st is None or st.hook is None or st.block is not None or st.shards > 1:
            return None
        return (st.scheme.activation_spec(), st.static_scale)

    def reset_stats(self) -> None:
        """Zero the activation counters (e.g. after a warm-up batch)."""
        for st in self._states.values():
            st.counts, st.calls = None, 0
        if self._shared is not None:
            self._shared.clear()

    @torch.no_grad()
    def restore(self) -> None:
        """Remove the hooks, put the original weight Parameters back, undo smoothing. Idempotent.

        Applied with ``keep_originals=False``: the original weights are gone, so only the hooks are removed and
        the model is marked as holding rounded weights (:func:`check_intact` refuses it from then on)."""
        if not self._active:
            return
        rounded_in_place = self._model is not None
        for st in self._states.values():
            if st.hook is not None:
                st.hook.remove()
            if st.block is not None:
                st.block[0].block_amax = None
                st.block[0].w2_shards = 1
            if not rounded_in_place:
                st.module.weight = st.original_weight
                if hasattr(st.module, _MARKER):
                    delattr(st.module, _MARKER)
        if self._shared is not None:
            self._shared.clear()
        if rounded_in_place:
            model = self._model()
            if model is not None:
                setattr(model, _ROUNDED, sorted(self._states))
        elif self.smoothing is not None:
            self.smoothing.restore()
        self._active = False


def check_intact(model: nn.Module) -> None:
    """PlanError when a plan applied with ``keep_originals=False`` wrote rounded weights over ``model``'s own: no
    plan, reference or score on it would measure the model any more."""
    rounded = getattr(model, _ROUNDED, None)
    if rounded:
        raise PlanError(f"this model's weights were rounded in place by a plan applied without keeping the originals "
                        f"({name_list(list(rounded))}): load the model again to apply another plan")


def two_level(spec: TensorSpec) -> bool:
    """True for a format whose block scales sit under one fp32 scale of the whole tensor (NVFP4)."""
    from quantcore.formats.catalog import get_format

    fmt = get_format(spec.format)
    return fmt.is_block and fmt.scale == "fp8_e4m3"


def rows_independent(spec: TensorSpec, *, tensor_scale: bool = False) -> bool:
    """True when each row of a weight is rounded on scales of its own (per channel, or per group along K) and no
    tensor-wide scale (NVFP4's fp32 one) unless that one is given (``tensor_scale``): a block of rows then rounds
    exactly as it does within the whole weight."""
    from quantcore.formats.granularity import Granularity

    return spec.granularity in (Granularity.CHANNEL, Granularity.GROUP) and (tensor_scale or not two_level(spec))


@torch.no_grad()
def round_rows_in_place(weight: torch.Tensor, spec: TensorSpec, report: bool = True, *,
                        tensor_scale: torch.Tensor | None = None) -> QuantReport:
    """Round ``weight`` (N, K) to its nearest grid points, written over it a block of about
    :data:`ROW_BLOCK_ELEMENTS` elements at a time (rows of their own scales only: :func:`rows_independent`), bit-equal
    to :func:`fake_quantize_weight` of the whole weight; the report's counts summed over the blocks, its scales put
    together. ``tensor_scale``: NVFP4's fp32 scale of the whole weight (:func:`own_tensor_scale`, or a fusion
    group's)."""
    rows = max(1, ROW_BLOCK_ELEMENTS // max(1, weight.shape[1]))
    counts = [0, 0, 0, 0, 0]
    scales: list[torch.Tensor] = []
    starts = range(0, weight.shape[0], rows)
    for start in starts:
        part = weight[start:start + rows]
        q, rep = fake_quantize_weight(part, spec, report=report, scale=tensor_scale)
        part.copy_(q)
        del q
        for i, n in enumerate((rep.n_elements, rep.n_nonzero, rep.n_saturated, rep.n_underflow, rep.n_nan)):
            counts[i] += n
        if rep.scale is not None:
            scales.append(rep.scale)
    scale = torch.cat(scales) if scales and len(scales) == len(starts) else None
    return QuantReport(counts[0], counts[1], counts[2], counts[3], counts[4], scale=scale)


def own_tensor_scale(weight: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """A two-level format's fp32 tensor scale of ``weight`` alone, as :func:`fused_tensor_scale` of it computes it,
    without a temporary of the weight's size (max |W| as the larger of max W and -min W)."""
    return scale_from_amax(torch.maximum(weight.amax(), -weight.amin()).float(), spec.format)


def _resolve(plan: Mapping[str, Scheme | str]) -> dict[str, Scheme]:
    """Scheme objects for every layer; unknown scheme names raise PlanError naming the layer."""
    out: dict[str, Scheme] = {}
    bad = []
    for layer, scheme in plan.items():
        if isinstance(scheme, Scheme):
            out[layer] = scheme
            continue
        try:
            out[layer] = get_scheme(scheme)
        except ValueError:
            bad.append(f"{layer!r}: {scheme!r}")
    if bad:
        raise PlanError(
            f"unknown scheme name(s) for {', '.join(bad)}; valid schemes: {', '.join(list_schemes())}"
        )
    return out


def _check_layers(model: nn.Module, names: list[str]) -> dict[str, nn.Linear]:
    """The nn.Linear modules named in the plan; PlanError naming unknown or non-linear names."""
    modules = dict(model.named_modules())
    unknown = [n for n in names if n not in modules]
    if unknown:
        linear_names = [n for n, m in modules.items() if isinstance(m, nn.Linear)]
        hints = []
        for n in unknown[:3]:
            close = difflib.get_close_matches(n, linear_names, n=1)
            if close:
                hints.append(f"{n!r} -> did you mean {close[0]!r}?")
        hint = f" ({'; '.join(hints)})" if hints else ""
        raise PlanError(
            f"the plan names {len(unknown)} layer(s) the model does not have: "
            f"{name_list(unknown)}{hint}; "
            "use names from model.named_modules()"
        )
    not_linear = [
        f"{n!r} ({type(modules[n]).__name__})" for n in names if not isinstance(modules[n], nn.Linear)
    ]
    if not_linear:
        raise PlanError(f"only nn.Linear layers can be quantized; the plan names {', '.join(not_linear[:8])}")
    already = [n for n in names if getattr(modules[n], _MARKER, False)]
    if already:
        raise PlanError(
            f"layer(s) {name_list(already)} already carry an applied plan; call restore() on it first"
        )
    return {n: modules[n] for n in names}


def _static_layers(schemes: Mapping[str, Scheme], act_amax: Mapping[str, float] | None) -> dict[str, float]:
    """{layer: calibrated amax} for layers with static activation scales; PlanError listing missing or bad ones."""
    static = [n for n, s in schemes.items() if s.activations is not None and not s.activations.dynamic]
    missing = [n for n in static if act_amax is None or n not in act_amax]
    if missing:
        raise PlanError(
            f"{len(missing)} layer(s) use static activation scales but have no calibrated amax: "
            f"{name_list(missing)}; run calibration and pass "
            "act_amax={layer: max|x|}, or choose a dynamic scheme (e.g. FP8_DYNAMIC) for them"
        )
    out: dict[str, float] = {}
    if act_amax is None:  # no layer is static (all of them would be missing above)
        return out
    for n in static:
        amax = float(act_amax[n])
        if not amax >= 0 or amax == float("inf"):
            raise PlanError(f"act_amax[{n!r}] = {amax!r}; a calibrated amax must be finite and >= 0")
        out[n] = amax
    return out


def _mixed_expert_blocks(schemes: Mapping[str, Scheme]) -> set[str]:
    """MoE blocks whose routed experts take different schemes (a per-expert plan, ``per_expert: true``): no fused MoE
    layer serves them, so each expert keeps its own input scales (static: as calibrated; dynamic per-tensor: over
    its own rows), as the checkpoint stores them and an engine that runs the experts one by one reads them."""
    by_block: dict[str, set[Scheme]] = {}
    for name, scheme in schemes.items():
        block = expert_block(name)
        if block is not None:
            by_block.setdefault(block, set()).add(scheme)
    return {block for block, used in by_block.items() if len(used) > 1}


def _moe_shared_scales(static: Mapping[str, float], schemes: Mapping[str, Scheme],
                       mixed: Set[str] = frozenset()) -> dict[str, float]:
    """Static input scales as vLLM's fused MoE layer reads them: for FP8 and INT8, one for the gate/up of every
    expert of a block (w13) and one for its down_proj (w2), the largest of its experts' ("Using the maximum across
    experts for each layer"). With calibration running every expert on every token (quantcore.models.moe) the gate/up
    ones are equal anyway; the down_proj inputs differ from expert to expert. NVFP4's fused MoE keeps each expert's own
    input tensor scales (its w13 one the smaller global scale of the expert's gate and up, which read one input), so
    they are left as calibrated, and so are the scales of a block in ``mixed`` (:func:`_mixed_expert_blocks`)."""
    key = {name: (block, name.endswith(".down_proj")) for name in static
           if (block := expert_block(name)) and block not in mixed
           and schemes[name].activation_spec().format != "nvfp4"}
    shared: dict[tuple[str, bool], float] = {}
    for name, k in key.items():
        shared[k] = max(shared.get(k, static[name]), static[name])
    return {name: shared[key[name]] if name in key else scale for name, scale in static.items()}


def _smoothed_amax(
    amax: float, name: str, smoothing: SmoothingHandle | None, act_channel_max: Mapping[str, Any] | None
) -> float:
    """The static amax of a layer's input after smoothing: max_j(channel_max_j / s_j), exact.

    Calibration saw the unsmoothed input; dividing channel j by s_j divides its max by s_j.
    """
    if (
        smoothing is None
        or act_channel_max is None
        or name not in smoothing.factors
        or name not in act_channel_max
    ):
        return amax
    s = smoothing.factors[name].detach().to("cpu", torch.float64)
    cmax = torch.as_tensor(act_channel_max[name]).detach().to("cpu", torch.float64).flatten()
    return float((cmax / s).max())


def _spec_kwargs(spec: TensorSpec) -> dict[str, Any]:
    return {"granularity": spec.granularity, "group_size": spec.group_size, "block": spec.block}


class _SharedInputs:
    """The fake-quantized input of the last hook call, for the next layer that reads the same tensor.

    Fusion groups read one tensor object: HF models call q_proj, k_proj and v_proj (and gate_proj,
    up_proj) one after another on the same ``hidden_states``. With the same activation spec and
    static scale the fake quantization is the same pure function of the same data, so computing it
    once per group gives bit-identical outputs and counts (about a third of the per-call work on a
    Llama). The entry is trusted only while all of these hold:

    * ``x`` is the very object seen before (held weakly: a dead reference never matches, and a
      live one cannot share its id with a new tensor);
    * neither ``x`` nor the cached result was modified in place since (``_version`` counters, shared
      with every view; a later pre-hook may edit what we returned);
    * its storage, shape, strides and dtype are unchanged.

    Inference-mode tensors carry no version counter, so they are never cached. One input is kept
    (several results when layers of a group use different specs), so the memory held is one
    activation, released by ``clear()`` (restore, reset_stats).
    """

    def __init__(self) -> None:
        self._ref: weakref.ref | None = None
        self._signature: tuple | None = None
        self._results: dict[tuple, tuple[torch.Tensor, int, torch.Tensor | None]] = {}

    @staticmethod
    def _signature_of(x: torch.Tensor) -> tuple | None:
        """What must not change between calls; None for tensors we cannot track (never cached)."""
        if x.is_inference():
            return None
        try:
            return (x._version, x.data_ptr(), tuple(x.shape), x.stride(), x.dtype, x.device)
        except RuntimeError:  # tensors without plain storage (e.g. traced fakes) have no data_ptr
            return None

    def get(self, x: torch.Tensor, key: tuple) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(xq, counts) cached for this exact input and key, or None."""
        if self._ref is None or self._ref() is not x or self._signature_of(x) != self._signature:
            return None
        hit = self._results.get(key)
        if hit is None:
            return None
        xq, version, counts = hit
        if xq._version != version:  # someone wrote into the result we handed out
            del self._results[key]
            return None
        return xq, counts

    def put(self, x: torch.Tensor, key: tuple, xq: torch.Tensor, counts: torch.Tensor | None) -> None:
        signature = self._signature_of(x)
        if signature is None or xq.is_inference():
            return
        if self._ref is None or self._ref() is not x or signature != self._signature:
            self._ref, self._signature, self._results = weakref.ref(x), signature, {}
        self._results[key] = (xq, xq._version, counts)

    def clear(self) -> None:
        self._ref, self._signature, self._results = None, None, {}


def _quantize(x: torch.Tensor, fmt: str, kwargs: Mapping[str, Any], scale: Any,
              track_stats: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An activation fake-quantized, with its report counts when ``track_stats`` (else None)."""
    if track_stats:
        return fake_quantize_with_counts(x, fmt, scale=scale, **kwargs)
    return fake_quantize(x, fmt, scale=scale, **kwargs), None


def _quantize_shards(x: torch.Tensor, shards: int, fmt: str, kwargs: Mapping[str, Any], scale: Any,
                     track_stats: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`_quantize` of each GPU's share of a row-parallel layer's input (``shards`` parts of K, as
    ``torch.tensor_split`` cuts them), each on its own dynamic scale, or on its entry of a ``scale`` with one per
    share (a routed expert's block amax per share), then put together again; the counts summed."""
    parts, total = [], None
    per_share = isinstance(scale, torch.Tensor) and scale.numel() == shards
    for i, part in enumerate(x.tensor_split(shards, dim=-1)):
        q, counts = _quantize(part, fmt, kwargs, scale.reshape(-1)[i] if per_share else scale, track_stats)
        parts.append(q)
        if counts is not None:
            total = counts if total is None else total + counts
    return torch.cat(parts, dim=-1), total


def _make_hook(state: _LayerState, track_stats: bool, shared: _SharedInputs | None):
    spec = state.scheme.activation_spec()
    kwargs = _spec_kwargs(spec)
    # everything the hook's result depends on besides x (a smoothed layer's input arrives already
    # divided by its factors, folded into the norm before it, so smoothing adds nothing here)
    key = (spec, state.static_scale, track_stats)

    def hook(module: nn.Module, args: tuple, kw: dict):
        if args:
            x, rest = args[0], args[1:]
        elif "input" in kw:
            x, rest = kw["input"], ()
        else:
            return None
        scale: float | torch.Tensor | None = state.static_scale
        block_scale: torch.Tensor | None = None
        if state.block is not None:  # a routed expert: the block's amax for this call, as vLLM's fused MoE
            amax = (state.block[0].block_amax or {}).get(state.block[1])
            if amax is not None:  # one amax, or one per GPU's share of a split input
                scale = block_scale = scale_from_amax(amax, spec.format)
        if state.shards > 1:  # row-parallel under tensor parallelism: each GPU's share on its own scale (no other
            # layer reads this input, so nothing to share)
            xq, counts = _quantize_shards(x, state.shards, spec.format, kwargs, scale, track_stats)
        else:
            call_key = (spec, tuple(block_scale.reshape(-1).tolist()), track_stats) if block_scale is not None else key
            hit = shared.get(x, call_key) if shared is not None else None
            if hit is not None:
                xq, counts = hit
            else:
                xq, counts = _quantize(x, spec.format, kwargs, scale, track_stats)
                if shared is not None:
                    shared.put(x, call_key, xq, counts)
        if counts is not None:
            # never in place: the counts tensor may be shared with other layers through the cache
            state.counts = counts if state.counts is None else state.counts + counts
        state.calls += 1
        if args:
            return (xq, *rest), kw
        return args, {**kw, "input": xq}

    return hook


@torch.no_grad()
def apply_plan(
    model: nn.Module,
    plan: Mapping[str, Scheme | str],
    inputs: PlanInputs = NO_INPUTS,
    *,
    track_stats: bool = True,
    share_inputs: bool = True,
    keep_originals: bool = True,
    rounded: Mapping[str, torch.Tensor] | None = None,
) -> AppliedPlan:
    """Fake-quantize the layers named in ``plan`` in place; ``AppliedPlan.restore()`` undoes it exactly.

    plan:            {nn.Linear name: Scheme or preset name}; identity schemes (BF16) are left untouched
    inputs:          the plan's calibrated inputs (:class:`~quantcore.algorithms.inputs.PlanInputs`); the fields read
                     here are below. ``awq`` and ``kv_amax`` are not: fold AWQ's factors first
                     (:func:`quantcore.evaluation.scoring.plan_applied` does), the KV cache is the scorer's.
    track_stats:     count activation saturation / underflow on every call (a few extra passes),
                     and report the weight quantization; False skips both (reports of zero counts)
    share_inputs:    quantize an input once for consecutive layers that read the same tensor with
                     the same activation spec and scale (q/k/v, gate/up); the results are
                     bit-identical either way, False only recomputes them per layer

    Fields of ``inputs``:

    act_amax:        {layer: calibrated max |x|}, required for layers whose activations are static
                     (of the unsmoothed input: layers smoothed here get max_j(channel_max_j / s_j))
    act_channel_max: {layer: (K,) calibrated max |x_j|}; when given, SmoothQuant α of the schemes
                     is folded first (all layers with an α must be present). When omitted, α is
                     ignored: smooth the model yourself with smooth_model() beforehand.
    weight_hessians: {layer: (K, K) Hessian of its input} (:func:`quantcore.algorithms.gptq.collect_hessians`, on the
                     unsmoothed model: layers smoothed here get it transformed), required for layers whose
                     scheme rounds with GPTQ; their weight report is RTN's (the same scales)
    gptq_cache:      a dict that keeps the GPTQ-rounded weights by layer name and hands them out again on the
                     next apply (a sensitivity sweep applies one unit once per batch); the caller keeps the
                     weights, scheme and Hessian of a layer the same for as long as it passes the dict. A layer
                     already in it needs no Hessian (a job fills it from rounded weights kept on disk)
    parallel:        the GPUs the plan is served on (:class:`quantcore.models.parallel.Parallelism`; None: one). A
                     row-parallel layer's input is then quantized as each GPU quantizes its own share of it: a
                     dynamic per-tensor or per-token activation scale per share of K
                     (:meth:`~quantcore.models.parallel.Parallelism.input_shards`), a routed expert's block-wide dynamic
                     scale per share too. Static scales (one calibrated number every GPU loads) and group / block
                     scales (whose groups a valid split never cuts) are the same on any number of GPUs.

    keep_originals:  False: the rounded weights are written over the original ones, in the weights' own memory, and
                     no copy is kept (a layer rounded to nearest on per-channel or per-group scales a block of rows at
                     a time, so no temporary of the whole weight exists either): a one-shot score of a large model
                     then costs the model and not the model twice. The model cannot be restored: ``restore()``
                     removes the hooks and marks it, and a later :func:`apply_plan` on it is refused
                     (:func:`check_intact`). A weight that another module shares (a tied ``lm_head``) is written over
                     too: the caller keeps what reads it unquantized (:func:`quantcore.evaluation.batches.
                     embedding_rows` for the input embedding).
    rounded:         {layer: its weight already rounded under its scheme here}, from an earlier application of a
                     scheme that rounds the same weights alike (the same weight spec, to nearest, no factors folded:
                     the Fisher estimate's INT8_PER_TENSOR and INT8_W8A8): the tensor is taken as it is (not copied,
                     not rounded again; its weight report counts nothing). The caller keeps the weights unchanged
                     since, and gives a fusion group (q/k/v, gate/up: their shared FP8 / NVFP4 scales) whole or not
                     at all. Only with keep_originals.

    Raises PlanError for unknown layers or schemes, non-linear targets, missing calibration,
    or layers already carrying an applied plan.
    """
    act_amax, act_channel_max = inputs.act_amax, inputs.act_channel_max
    weight_hessians, gptq_cache, parallel = inputs.weight_hessians, inputs.gptq_cache, inputs.parallel
    check_intact(model)
    given = rounded or {}
    if given and not keep_originals:
        raise PlanError("pre-rounded weights go beside the originals: keep_originals=False rounds in place")
    schemes = _resolve(plan)
    linears = _check_layers(model, list(schemes))
    static_amax = _static_layers(schemes, act_amax)
    active = {n: s for n, s in schemes.items() if not s.is_identity}
    untouched = [n for n, s in schemes.items() if s.is_identity]
    hessians = gptq_hessians(active, weight_hessians, rounded=gptq_cache or ())

    smoothing = None
    alphas = {n: s.smoothquant_alpha for n, s in active.items() if s.smoothquant_alpha is not None}
    if alphas and act_channel_max is not None:
        missing = [n for n in alphas if n not in act_channel_max]
        if missing:
            raise PlanError(
                f"SmoothQuant needs act_channel_max for {name_list(missing)}; pass per-input-channel max|x| "
                "from calibration"
            )
        smoothing = smooth_model(model, {n: act_channel_max[n] for n in alphas}, alphas, layers=list(alphas))
        hessians = gptq_hessians(active, hessians, smoothing.factors, rounded=gptq_cache or ())
    static = {
        n: float(
            scale_from_amax(_smoothed_amax(a, n, smoothing, act_channel_max), schemes[n].activation_spec().format)
        )
        for n, a in static_amax.items()
    }
    mixed = _mixed_expert_blocks(schemes)
    static = _moe_shared_scales(static, schemes, mixed)

    applied = AppliedPlan(
        layers=dict(active),
        untouched=untouched,
        smoothing=smoothing,
        _shared=_SharedInputs() if share_inputs else None,
        _model=weakref.ref(model) if not keep_originals else None,
    )
    modules = dict(model.named_modules())
    to_round = {n: s for n, s in active.items() if n not in given}
    tensor_scales = _fused_tensor_scales(to_round, linears)
    fp8_scales = _fp8_group_scales(to_round, linears)  # of the original weights, before any is written over
    try:
        for name, scheme in active.items():
            module = linears[name]
            original = module.weight
            w = original.detach()
            g = tensor_scales.get(name)
            method = rounding_method(scheme)  # RTN, GPTQ or AWQ: the same grid and scales, its own grid points
            spec = scheme.weight_spec()
            if name in given:  # rounded alike by an earlier application (its fused scales applied there)
                wq, report = given[name], QuantReport(0, 0, 0, 0, 0)
                if wq.shape != w.shape:
                    raise PlanError(f"{name}: the pre-rounded weight is {tuple(wq.shape)}, the layer's "
                                    f"{tuple(w.shape)}")
            elif not keep_originals and method.handler is round_to_nearest \
                    and rows_independent(spec, tensor_scale=g is not None or two_level(spec)):
                if g is None and two_level(spec):
                    g = own_tensor_scale(w, spec)
                report = round_rows_in_place(w, spec, track_stats, tensor_scale=g)
                wq = None
            else:
                if track_stats or method.reads_nearest:  # on the grid the checkpoint stores (int: compressed-tensors')
                    nearest, report = fake_quantize_weight(w, scheme.weight_spec(), report=track_stats, scale=g)
                else:  # the method rounds from the weight itself
                    nearest, report = None, QuantReport(0, 0, 0, 0, 0)
                wq = method.handler(WeightRounding(name, w, scheme, nearest if method.reads_nearest else None, g,
                                                   hessians, gptq_cache))
                del nearest
            state = _LayerState(name, module, scheme, original, report, static_scale=static.get(name),
                                block=_expert_block_scale(name, scheme, modules, mixed),
                                shards=_input_shards(name, scheme, parallel))
            if state.block is not None and state.block[1] == "w2":  # the block's down_proj amax, per GPU's share
                state.block[0].w2_shards = state.shards
            if keep_originals:
                assert wq is not None  # rounded beside the original
                module.weight = nn.Parameter(wq, requires_grad=False)
            elif wq is not None:  # written over the original, which nothing keeps
                w.copy_(wq)
                del wq
            setattr(module, _MARKER, True)
            applied._states[name] = state
            if scheme.activations is not None:
                state.hook = module.register_forward_pre_hook(
                    _make_hook(state, track_stats, applied._shared), with_kwargs=True
                )
        _requantize_fused_fp8(to_round, linears, fp8_scales, in_place=not keep_originals)
    except Exception:
        applied.restore()
        raise
    return applied


@register_rounding_handler(Rounding.RTN)
def round_to_nearest(layer: WeightRounding) -> torch.Tensor:
    """RTN: the weight on its grid point nearest to it (what :func:`fake_quantize_weight` computed)."""
    assert layer.nearest is not None  # reads_nearest: apply_plan computes it
    return layer.nearest


def _input_shards(name: str, scheme: Scheme, parallel: Parallelism | None) -> int:
    """The GPUs' shares of ``name``'s input its activation scale is taken over separately: the row-parallel
    shares (``parallel.input_shards``) for a dynamic per-tensor or per-token scale, else 1."""
    if parallel is None or not scheme.scaled_per_gpu_share:
        return 1
    return parallel.input_shards(name)


def _expert_block_scale(name: str, scheme: Scheme, modules: Mapping[str, nn.Module],
                        mixed: Set[str] = frozenset()) -> tuple[LinearExperts, str] | None:
    """(the LinearExperts block, "w13" | "w2") for a routed expert whose activations take a dynamic per-tensor scale,
    else None. vLLM's fused MoE quantizes the block's input once for every expert's gate/up and all routed experts'
    down_proj inputs together, each with one dynamic scale; the block's two-pass forward provides those amaxes. A
    block in ``mixed`` (a per-expert plan) has no fused layer: each expert's scale is over its own rows (None)."""
    a = scheme.activations
    block = expert_block(name)
    if a is None or block is None or block in mixed or not a.dynamic or a.granularity.value != "tensor":
        return None
    experts = modules.get(block)
    if not isinstance(experts, LinearExperts):
        return None
    experts.block_amax = {}
    return experts, "w2" if name.endswith(".down_proj") else "w13"


def _fp8_group_scales(schemes: Mapping[str, Scheme], linears: Mapping[str, nn.Linear]) -> list[dict[str, torch.Tensor]]:
    """The own per-tensor E4M3 weight scale of every member of each fusion group (q/k/v, gate/up) quantized with
    FP8 per-tensor weights, from the weights before they are rounded (:func:`_requantize_fused_fp8` reads them)."""
    fp8 = [n for n, s in schemes.items()
           if s.weights is not None and s.weights.format == "fp8_e4m3" and s.weights.granularity.value == "tensor"]
    return [{n: weight_scale(linears[n].weight.detach(), schemes[n].weight_spec()) for n in group}
            for group in fusion_groups(fp8)]


def _requantize_fused_fp8(schemes: Mapping[str, Scheme], linears: Mapping[str, nn.Linear],
                          groups: list[dict[str, torch.Tensor]], *, in_place: bool = False) -> None:
    """Per-tensor E4M3 weights of a fusion group (q/k/v, gate/up; a routed expert's gate/up) as vLLM serves them.

    The checkpoint stores one scale per member; vLLM runs the merged GEMM with one scale, so on load it dequantizes
    each member and quantizes it again with the group's largest scale (``requantize_with_max_scale``, and its fused
    MoE does the same for each expert's w13). The members whose own scale was smaller are rounded a second time, on
    the coarser grid. vLLM dequantizes in fp16 first; the emulation in fp32 (the same grid points but for ties).
    """
    for own in groups:
        largest = torch.stack([s.reshape(()) for s in own.values()]).max()
        for n, scale in own.items():
            if bool(scale.reshape(()) < largest):
                module = linears[n]
                wq = fake_quantize(module.weight.detach(), "fp8_e4m3", "tensor", scale=largest)
                if in_place:
                    module.weight.detach().copy_(wq)
                else:
                    module.weight = nn.Parameter(wq, requires_grad=False)


def _fused_tensor_scales(schemes: Mapping[str, Scheme], linears: Mapping[str, nn.Linear]) -> dict[str, torch.Tensor]:
    """{layer: NVFP4 tensor scale} for the members of every fusion group (q/k/v, gate/up) quantized here with NVFP4
    weights: one scale from the largest |W| of the group (:func:`quantcore.formats.weights.fused_tensor_scale`), which
    is what the checkpoint stores for them and vLLM's fused GEMM reads. Layers outside such a group keep their own."""
    out: dict[str, torch.Tensor] = {}
    nvfp4 = [n for n, s in schemes.items() if s.weights is not None and s.weights.format == "nvfp4"]
    for group in fusion_groups(nvfp4):
        if len(group) > 1:
            g = fused_tensor_scale(linears[n].weight for n in group)
            out.update(dict.fromkeys(group, g))
    return out


def gptq_hessians(
    schemes: Mapping[str, Scheme],
    hessians: Mapping[str, torch.Tensor] | None,
    smoothing_factors: Mapping[str, torch.Tensor] | None = None,
    *,
    rounded: Container[str] = (),
) -> dict[str, torch.Tensor]:
    """The Hessians of the layers whose scheme rounds with GPTQ, those of smoothed layers transformed for their
    smoothed input; PlanError names the layers without one. Layers in ``rounded`` (their GPTQ-rounded weight
    already at hand: ``gptq_cache``) need none."""
    wanted = [n for n, s in schemes.items() if s.needs_hessians and n not in rounded]
    missing = [n for n in wanted if hessians is None or n not in hessians]
    if missing:
        raise PlanError(
            f"GPTQ rounds the weights of {name_list(missing)} from the Hessian of their inputs: collect it on "
            "calibration text first (quantcore.algorithms.gptq.collect_hessians), or choose a scheme without GPTQ"
        )
    if hessians is None:  # no layer wants one (all of them would be missing above)
        return {}
    factors = smoothing_factors or {}
    return {n: smoothed_hessian(hessians[n], factors[n]) if n in factors else hessians[n] for n in wanted}


@contextmanager
def quantized_model(
    model: nn.Module, plan: Mapping[str, Scheme | str], inputs: PlanInputs = NO_INPUTS, **kwargs: Any
) -> Iterator[AppliedPlan]:
    """Context manager around :func:`apply_plan` (the same arguments): the model is restored on exit, even on
    error."""
    applied = apply_plan(model, plan, inputs, **kwargs)
    try:
        yield applied
    finally:
        applied.restore()
