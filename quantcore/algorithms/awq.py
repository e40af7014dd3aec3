"""AWQ: activation-aware scaling of weight-only layers before rounding [Lin et al. 2023, AWQ].

A weight-only layer computes ``X Wᵀ``. For any positive s (one per input channel) ``X Wᵀ = (X / s)(W · s)ᵀ``
exactly, and the division by s folds into the operator that produces X, as SmoothQuant's does
(:mod:`quantcore.algorithms.smoothquant`: the norm gain before q/k/v and gate/up, v_proj's rows before o_proj, up_proj's
rows before down_proj). SmoothQuant chooses s to flatten *activations* that will be quantized; AWQ keeps the
activations in 16 bits and chooses s so that rounding ``W · s`` loses the least where the inputs are large:
scaling a salient input channel up gives its weights more of the grid.

s is searched, per fold ("mapping" in llm-compressor's words), on calibration inputs, as llm-compressor 0.14's
``AWQModifier`` does with its defaults (``duo_scaling=True``, ``n_grid=20``):

* ``x̄_j`` = mean |x_j| over the calibration tokens of the mapping's input; ``w̄_j`` = mean over the rows of every
  balance layer of |W_ij| / (max |W| of its quantization group + 1e-6);
* candidates: ``s = x̄^r / (w̄^(1-r) + 1e-4)`` for r = 0, 1/18, …, 1, plus ``s = x̄^0`` (no scaling), each clamped
  to ≥ 1e-4 and divided by √(max s · min s);
* the loss of a candidate is the mean squared error of the output of the smallest module holding every
  balance layer (self_attn for q/k/v, mlp for gate/up, the layer itself for o_proj and down_proj) with the
  balance layers' weights replaced by ``Q(W · s) / s``, against the unquantized output, over every calibration
  token; the candidate with the smallest loss is folded.

NVFP4 weights in a fusion group (q/k/v, gate/up) are rounded during the search with one fp32 tensor scale from
the group's largest |W · s|, as llm-compressor's fused observers compute it and as they are served.

The search runs block by block on the outputs of the blocks before it (after their folds, which change
nothing but rounding in 16/32-bit arithmetic), one mapping after another within a block, in model order:
llm-compressor's sequential pipeline. Weights of other layers stay unquantized during the search.

Under grouped-query attention v_proj has fewer outputs than o_proj has inputs; llm-compressor skips that
mapping and so does this module (the o_proj is rounded without scaling).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantcore.algorithms.registry import WeightRounding, register_rounding_handler, register_transform
from quantcore.algorithms.smoothquant import GQA_NO_FACTORS, FoldUnit, SmoothingHandle, fold_factors, plan_unit
from quantcore.errors import Cancelled, PlanError, name_list
from quantcore.formats.granularity import Granularity
from quantcore.formats.weights import fake_quantize_weight, fused_tensor_scale
from quantcore.models.architectures import architecture_of
from quantcore.models.decoder import find_decoder_blocks
from quantcore.models.moe import all_experts
from quantcore.schemes.fusion import fusion_groups
from quantcore.schemes.presets import get_scheme
from quantcore.schemes.specs import AWQ_DUO_SCALING, AWQ_N_GRID, Rounding, Scheme, TensorSpec

W_MEAN_EPS = 1e-6  # llm-compressor's _compute_layer_means: |W| / (group max + 1e-6)
SCALE_FLOOR = 1e-4  # its clamp of the candidate scales and the floor added to w̄^(1-r)


@dataclass(frozen=True)
class AwqMapping:
    """One fold AWQ searches: the layers whose input is divided by one s, and the module whose output is compared."""

    kind: str  # "norm" | "v_rows" | "up_rows", as quantcore.algorithms.smoothquant's units
    balance: tuple[str, ...]  # consumers: their weights are multiplied by s
    smooth: str  # the module that absorbs 1/s
    parent: str  # smallest module holding every balance layer; its output is the loss's
    block: int  # decoder block index


@dataclass
class AwqResult:
    """What :func:`awq_search` found.

    factors: {linear: (K,) s} for every balance layer of a searched mapping (fold them with
             ``quantcore.algorithms.smoothquant.fold_factors``, or let
             :func:`quantcore.evaluation.scoring.plan_applied` do it)
    skipped: {linear: reason} for planned layers left unscaled
    errors:  {mapping label: (loss without scaling, best loss, best r)}; r < 0 marks the unscaled candidate
    history: {mapping label: [(r, loss)] of every candidate, in grid order}
    """

    factors: dict[str, torch.Tensor] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    errors: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    history: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    cached: bool = False  # read back by load_awq's caller rather than searched now


def _parent_of(names: Sequence[str]) -> str:
    """Longest common dotted prefix of ``names`` (the module holding them all), the layer itself for one name."""
    if len(names) == 1:
        return names[0]
    parts = [n.split(".") for n in names]
    common = []
    for segs in zip(*parts, strict=False):
        if len(set(segs)) != 1:
            break
        common.append(segs[0])
    return ".".join(common)


def awq_mappings(model: nn.Module, layers: Iterable[str]) -> tuple[list[AwqMapping], dict[str, str]]:
    """The mappings AWQ searches for ``layers`` (model order) and ``{layer: reason}`` for those it cannot scale.

    A mapping covers a whole fusion group (q/k/v, gate/up): asking for one member scales them all, as they
    read one tensor.
    """
    modules = dict(model.named_modules())
    linears = {n: m for n, m in modules.items() if isinstance(m, nn.Linear)}
    wanted = list(dict.fromkeys(layers))
    unknown = [n for n in wanted if n not in linears]
    if unknown:
        raise PlanError(f"AWQ scales nn.Linear layers; not one in this model: {name_list(unknown)}")
    stack = find_decoder_blocks(model)
    arch = architecture_of(model)
    units: dict[tuple[str, str], FoldUnit] = {}
    skipped: dict[str, str] = {}
    for name in wanted:
        unit = plan_unit(name, linears, modules, router=True, arch=arch)
        if isinstance(unit, str):
            skipped[name] = unit
            continue
        if unit.kind == "v_rows" and linears[unit.consumers[0]].in_features != linears[unit.producer].out_features:
            skipped[name] = GQA_NO_FACTORS
            continue
        block = stack.block_of(name)
        if block is None:
            skipped[name] = "outside the decoder blocks"
            continue
        units.setdefault((unit.kind, unit.producer), unit)
    order = {n: i for i, n in enumerate(modules)}
    mappings = []
    for u in sorted(units.values(), key=lambda u: order[u.consumers[0]]):
        block = stack.block_of(u.consumers[0])
        if block is None:  # the consumers share the block of the layer that asked for the unit, checked above
            raise PlanError(f"AWQ: {u.consumers[0]!r} lies outside the decoder blocks though {u.producer!r} is in one")
        # the loss is the output of the smallest module holding the consumers and what is scaled with them
        mappings.append(AwqMapping(u.kind, tuple(u.consumers), u.producer, _parent_of([*u.consumers, *u.also]), block))
    return mappings, skipped


def weight_means(weights: Sequence[torch.Tensor], spec: TensorSpec) -> torch.Tensor:
    """w̄ (K,), float64: mean over every row of ``weights`` of |W| / (its quantization group's max |W| + 1e-6)."""
    total, rows = None, 0
    for w in weights:
        a = w.detach().abs().float()
        n = a.shape[0]
        if spec.granularity is Granularity.GROUP:  # a last, shorter group is its own group
            a = torch.cat([g / (g.amax(dim=1, keepdim=True) + W_MEAN_EPS) for g in a.split(spec.group_size, 1)], 1)
        elif spec.granularity is Granularity.CHANNEL:
            a = a / (a.amax(dim=1, keepdim=True) + W_MEAN_EPS)
        else:  # pragma: no cover - refused by awq_unsupported
            raise PlanError(f"AWQ's weight means need channel or group scales, not {spec.granularity.value}")
        s = a.sum(dim=0, dtype=torch.float64)
        total = s if total is None else total + s
        rows += n
    assert total is not None
    return total / rows  # float64, as llm-compressor's (its candidate scales are float64 too)


def candidates(x_mean: torch.Tensor, w_mean: torch.Tensor, n_grid: int = AWQ_N_GRID,
               duo_scaling: bool = AWQ_DUO_SCALING) -> list[tuple[float, torch.Tensor]]:
    """The grid of scales AWQ tries, ``[(r, s)]``; r = -1 marks the unscaled candidate of duo scaling."""
    if n_grid < 2:
        raise ValueError(f"n_grid must be at least 2, got {n_grid}")
    if duo_scaling:
        grid = [(-1.0, False)] + [(i / (n_grid - 2), True) for i in range(n_grid - 1)]
    else:
        grid = [(i / (n_grid - 1), False) for i in range(n_grid)]
    out = []
    for r, duo in grid:
        if duo:
            s = (x_mean.pow(r) / (w_mean.pow(1 - r) + SCALE_FLOOR)).clamp(min=SCALE_FLOOR)
        else:
            s = x_mean.pow(max(r, 0.0)).clamp(min=SCALE_FLOOR)
        s = s / (s.max() * s.min()).sqrt()
        s[torch.isinf(s) | torch.isnan(s)] = 1
        out.append((r, s))  # float64 when w̄ is, as llm-compressor's are
    return out


class _Capture:
    """Inputs of one module over the calibration batches: ``(args, kwargs)`` per call."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple, dict]] = []

    def __call__(self, _module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.calls.append((args, dict(kwargs)))


class _AbsSum:
    def __init__(self) -> None:
        self.sum: torch.Tensor | None = None
        self.count = 0

    def __call__(self, _module: nn.Module, args: tuple) -> None:
        x = args[0].detach()
        flat = x.reshape(-1, x.shape[-1])
        s = flat.abs().float().sum(dim=0)
        self.sum = s if self.sum is None else self.sum + s
        self.count += flat.shape[0]


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


class _StopForward(Exception):
    pass


@torch.no_grad()
def _block_inputs(model: nn.Module, blocks: nn.ModuleList, batches: Sequence[torch.Tensor],
                  device: torch.device) -> tuple[list[torch.Tensor], list[list[tuple[tuple, dict]]]]:
    """Block 0's hidden states per batch and, per block, the other arguments it is called with per batch."""
    first_hidden: list[torch.Tensor] = []
    rest: list[list[tuple[tuple, dict]]] = [[] for _ in blocks]
    handles = []
    for i, block in enumerate(blocks):
        def keep(_m: nn.Module, args: tuple, kwargs: dict, _i: int = i) -> None:
            kw = dict(kwargs)
            if args:
                hidden, extra = args[0], tuple(args[1:])
            else:
                hidden, extra = kw.pop("hidden_states"), ()
            if _i == 0:
                first_hidden.append(hidden.detach())
            rest[_i].append((extra, kw))
            if _i == len(blocks) - 1:
                raise _StopForward
        handles.append(block.register_forward_pre_hook(keep, with_kwargs=True))
    try:
        for b in batches:
            try:
                model(input_ids=b.to(device), use_cache=False)
            except _StopForward:
                pass
    finally:
        for h in handles:
            h.remove()
    if len(first_hidden) != len(batches) or any(len(r) != len(batches) for r in rest):
        raise PlanError(f"{type(model).__name__}.forward did not call every decoder block once per batch; AWQ "
                        "replays blocks one by one and needs a model that runs each block on every pass")
    return first_hidden, rest


def _linear(modules: Mapping[str, nn.Module], name: str) -> nn.Linear:
    """The balance layer ``name`` (awq_mappings takes nn.Linear layers only)."""
    module = modules[name]
    if not isinstance(module, nn.Linear):
        raise PlanError(f"AWQ scales nn.Linear layers; {name!r} is a {type(module).__name__}")
    return module


@torch.no_grad()
def _search_one(modules: Mapping[str, nn.Module], mapping: AwqMapping, spec_of: Mapping[str, TensorSpec],
                calls: list[tuple[tuple, dict]], x_mean: torch.Tensor, n_grid: int,
                duo_scaling: bool) -> tuple[torch.Tensor, tuple[float, float, float], list[tuple[float, float]]]:
    parent = modules[mapping.parent]
    fp_out = [_first(parent(*a, **k)) for a, k in calls]
    balance = [_linear(modules, n) for n in mapping.balance]
    originals = [m.weight.detach().clone() for m in balance]
    quantized = [n for n in mapping.balance if n in spec_of]
    spec = spec_of[quantized[0]]
    w_mean = weight_means([_linear(modules, n).weight for n in quantized], spec).to(x_mean.device)
    best: tuple[float, torch.Tensor, float] | None = None
    initial = None
    history: list[tuple[float, float]] = []
    # q/k/v, an MLP's gate/up or each expert's: one NVFP4 tensor scale per fusion group, as served
    groups = fusion_groups(quantized) if spec.format == "nvfp4" else []
    try:
        for r, s in candidates(x_mean, w_mean, n_grid, duo_scaling):
            sv = s.to(device=originals[0].device).view(1, -1)
            scaled = {n: (w0 * sv).to(w0.dtype) for w0, n in zip(originals, mapping.balance, strict=True)}
            g = {n: fused_tensor_scale(scaled[x] for x in group) for group in groups for n in group}
            for m, w0, n in zip(balance, originals, mapping.balance, strict=True):
                if n in spec_of:  # W · s rounded to the weight's dtype, Q, then / s: llm-compressor's order
                    wq, _ = fake_quantize_weight(scaled[n], spec_of[n], report=False, scale=g.get(n))
                    m.weight.data = (wq / sv).to(w0.dtype)
            se, count = 0.0, 0
            for (a, k), ref in zip(calls, fp_out, strict=True):
                out = _first(parent(*a, **k))
                se += float(torch.nn.functional.mse_loss(out.float(), ref.float(), reduction="sum"))
                count += ref.numel()
            loss = se / max(count, 1)
            history.append((r, loss))
            if initial is None:
                initial = loss
            if best is None or loss < best[0]:
                best = (loss, s.clone(), r)
    finally:
        for m, w0 in zip(balance, originals, strict=True):
            m.weight.data = w0
    assert best is not None and initial is not None
    if not torch.isfinite(torch.tensor(best[0])):
        raise PlanError(f"AWQ found no finite loss for {mapping.smooth} -> {', '.join(mapping.balance)}: the "
                        "module's output is NaN or inf on the calibration text")
    return best[1], (initial, best[0], best[2]), history


@torch.no_grad()
def awq_search(
    model: nn.Module,
    plan: Mapping[str, Scheme | str],
    batches: Iterable[torch.Tensor] | torch.Tensor,
    *,
    batch_size: int = 4,
    n_grid: int = AWQ_N_GRID,
    duo_scaling: bool = AWQ_DUO_SCALING,
    progress: Callable[[float, str], None] | None = None,
    should_cancel: Callable[[], bool] | None = None,
) -> AwqResult:
    """Search AWQ's factors for the layers of ``plan`` whose scheme scales with AWQ (see the module docstring).

    plan:    {linear: scheme}; layers whose scheme has ``awq`` are searched, the others ignored
    batches: calibration token ids ``[S, L]`` (cut into ``batch_size`` sequences per forward) or batches
    The model is left exactly as it was (the folds made while searching are undone).
    """
    schemes = {n: get_scheme(s) for n, s in plan.items()}
    wanted = [n for n, s in schemes.items() if s.awq]
    result = AwqResult()
    if not wanted:
        return result
    mappings, skipped = awq_mappings(model, wanted)
    result.skipped.update(skipped)
    spec_of = {n: schemes[n].weight_spec() for n in wanted}
    if isinstance(batches, torch.Tensor):
        ids = batches if batches.dim() == 2 else batches.reshape(1, -1)
        batch_list: Sequence[torch.Tensor] = [ids[i:i + batch_size] for i in range(0, ids.shape[0], batch_size)]
    else:
        batch_list = list(batches)
    if not mappings:
        return result
    stack = find_decoder_blocks(model)
    device = next(model.parameters()).device
    hidden, rest = _block_inputs(model, stack.blocks, batch_list, device)
    handles: list[SmoothingHandle] = []
    last = max(m.block for m in mappings)
    search = BlockSearch(model, mappings, spec_of, result, n_grid=n_grid, duo_scaling=duo_scaling,
                         progress=progress, should_cancel=should_cancel)
    try:
        for b in range(last + 1):
            block = stack.blocks[b]
            with search.observed(b):  # an MoE block's experts see every token, as in llm-compressor's calibration
                outs = [_first(block(h, *extra, **kw)) for h, (extra, kw) in zip(hidden, rest[b], strict=True)]
            handles += search.search(b)
            if b < last:
                hidden = outs if not search.has(b) else [
                    _first(block(h, *extra, **kw)) for h, (extra, kw) in zip(hidden, rest[b], strict=True)
                ]
    finally:
        for h in reversed(handles):
            h.restore()
    return result


class BlockSearch:
    """AWQ's search one decoder block at a time, in model order (the whole model's :func:`awq_search`, and the
    streamed one of :mod:`quantcore.algorithms.streamed_rounding`): :meth:`observed` around the block's unscaled
    pass (the inputs of each mapping's parent and of its balance layers recorded, every expert of an MoE block
    seeing every token), then :meth:`search`, which searches the block's mappings, folds the best factors (the
    handles returned undo them) and fills ``result``; the block's outputs for the next block are then those of a
    pass with the factors folded (when :meth:`has` mappings in it)."""

    def __init__(self, model: nn.Module, mappings: Sequence[AwqMapping], spec_of: Mapping[str, TensorSpec],
                 result: AwqResult, *, n_grid: int = AWQ_N_GRID, duo_scaling: bool = AWQ_DUO_SCALING,
                 progress: Callable[[float, str], None] | None = None,
                 should_cancel: Callable[[], bool] | None = None) -> None:
        self.model, self.mappings, self.spec_of, self.result = model, list(mappings), spec_of, result
        self.n_grid, self.duo_scaling, self.progress, self.should_cancel = n_grid, duo_scaling, progress, should_cancel
        self.done = 0
        self._captures: dict[str, _Capture] = {}
        self._sums: dict[str, _AbsSum] = {}

    def has(self, b: int) -> bool:
        return any(m.block == b for m in self.mappings)

    @property
    def last(self) -> int:
        return max((m.block for m in self.mappings), default=-1)

    @contextmanager
    def observed(self, b: int) -> Iterator[None]:
        here = [m for m in self.mappings if m.block == b]
        modules = dict(self.model.named_modules())
        self._captures = {m.parent: _Capture() for m in here}
        self._sums = {m.balance[0]: _AbsSum() for m in here}
        hooks = [modules[p].register_forward_pre_hook(c, with_kwargs=True) for p, c in self._captures.items()]
        hooks += [modules[n].register_forward_pre_hook(s) for n, s in self._sums.items()]
        try:
            with all_experts():
                yield
        finally:
            for h in hooks:
                h.remove()

    def search(self, b: int) -> list[SmoothingHandle]:
        modules = dict(self.model.named_modules())
        handles: list[SmoothingHandle] = []
        for m in (m for m in self.mappings if m.block == b):
            if self.should_cancel is not None and self.should_cancel():
                raise Cancelled("cancelled during the AWQ search")
            acc = self._sums[m.balance[0]]
            assert acc.sum is not None
            x_mean = acc.sum / max(acc.count, 1)
            s, err, history = _search_one(modules, m, self.spec_of, self._captures[m.parent].calls, x_mean,
                                          self.n_grid, self.duo_scaling)
            handles.append(fold_factors(self.model, {m.balance[0]: s}))
            for n in m.balance:
                self.result.factors[n] = s
            label = f"{m.smooth} -> {', '.join(x.rsplit('.', 1)[-1] for x in m.balance)}"
            self.result.errors[label], self.result.history[label] = err, history
            self.done += 1
            if self.progress is not None:
                self.progress(self.done / len(self.mappings),
                              f"AWQ: {self.done} of {len(self.mappings)} mappings searched")
        self._captures, self._sums = {}, {}
        return handles


def save_awq(result: AwqResult, path: str | Path) -> Path:
    """Write a search's result to one safetensors file (the factors as tensors, the rest as JSON metadata), whole
    or not at all (:func:`quantcore.files.write_whole`)."""
    import json

    from safetensors.torch import save_file

    from quantcore.files import write_whole

    path = Path(path)
    meta = {"skipped": json.dumps(result.skipped), "errors": json.dumps(result.errors),
            "history": json.dumps(result.history)}
    factors = {k: v.detach().cpu().clone() for k, v in result.factors.items()}  # fused layers share one
    return write_whole(path, lambda part: save_file(factors, part, metadata=meta))


def load_awq(path: str | Path) -> AwqResult:
    """What :func:`save_awq` wrote (factors on the CPU; folding moves them to the model's device)."""
    import json

    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        factors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    return AwqResult(
        factors=factors,
        skipped=json.loads(meta.get("skipped", "{}")),
        errors={k: tuple(v) for k, v in json.loads(meta.get("errors", "{}")).items()},
        history={k: [tuple(x) for x in v] for k, v in json.loads(meta.get("history", "{}")).items()},
    )


@register_rounding_handler(Rounding.AWQ, needs="awq")
def round_after_awq(layer: WeightRounding) -> torch.Tensor:
    """AWQ: the weight rounded to nearest, its input channels already scaled by the searched factors (the
    ``awq`` transform folds them before rounding)."""
    assert layer.nearest is not None  # reads_nearest: apply_plan computes it
    return layer.nearest


AWQ_TRANSFORM = register_transform("awq", applies_to=lambda scheme: scheme.needs_awq, needs="awq")

__all__ = ["AWQ_TRANSFORM", "AwqMapping", "AwqResult", "BlockSearch", "awq_mappings", "awq_search", "candidates",
           "load_awq", "round_after_awq", "save_awq", "weight_means"]
