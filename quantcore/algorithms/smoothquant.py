"""SmoothQuant: move activation outliers into the weights with an exact per-channel rescaling.

For ``Y = X W^T`` and any positive s (one per input channel j), ``Y = (X / s)(W * s)^T``
exactly. SmoothQuant [Xiao et al. 2022, eq. 4] chooses

    s_j = max|X_j|^α / max|W_j|^(1-α)

and folds the division by s into the operator that produces X, so inference runs a plain
GEMM on the smoothed input. Folds implemented here (Hugging Face Llama / Mistral / Qwen2 /
Gemma / Gemma3 naming, looked up by architecture in :mod:`quantcore.models.architectures`):

=====================================  =====================================================
consumer linears                       1/s folded into
=====================================  =====================================================
self_attn.q_proj, k_proj, v_proj       ``input_layernorm`` gain (one s for the three: they
                                       read one tensor)
mlp.gate_proj, up_proj                 ``pre_feedforward_layernorm`` (Gemma2/3) or else
                                       ``post_attention_layernorm`` gain
self_attn.o_proj                       v_proj output rows (and bias). With GQA each kv head
                                       feeds several query heads, so s is tied across the
                                       heads of a group (maxima taken over the group).
mlp.down_proj                          up_proj output rows (and bias): the input of down_proj
                                       is act(gate) ⊙ up, linear in up's output
=====================================  =====================================================

Norm gains are detected by probing the module: ``y = n(x) * w`` (Llama/Qwen2/Mistral
RMSNorm; folded as w / s) or ``y = n(x) * (1 + w)`` (Gemma RMSNorm; folded as
(1 + w) / s - 1); ``nn.LayerNorm`` divides weight and bias. Anything else is skipped and
reported in ``SmoothingHandle.skipped`` with the reason — never folded approximately.

Folded parameters are computed in float64 and rounded once to the parameter dtype;
:meth:`SmoothingHandle.restore` copies the saved originals back bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from quantcore.algorithms.registry import register_transform
from quantcore.errors import PlanError, name_list
from quantcore.models.architectures import LLAMA_STYLE, Architecture, architecture_of
from quantcore.schemes.fusion import fusion_groups

# why searched factors (AWQ's) cannot fold into v_proj for o_proj: one per o_proj input, fewer v_proj outputs
GQA_NO_FACTORS = (
    "grouped-query attention: v_proj has fewer outputs than o_proj has inputs, so one factor per o_proj input "
    "cannot be folded into v_proj (llm-compressor's AWQ skips this mapping too)"
)

SQ_EPS = (
    1e-5  # clamp for channel maxima, as SmoothQuant's code and the reference text: dead channels get finite s
)

#: SmoothQuant as a transform of the registry: the schemes with an α, which read calibrated channel maxima
SMOOTHQUANT_TRANSFORM = register_transform(
    "smoothquant", applies_to=lambda scheme: scheme.smoothquant_alpha is not None, needs="act_channel_max"
)


@torch.no_grad()
def smoothing_factors(
    act_max: torch.Tensor | np.ndarray,
    weight_max: torch.Tensor | np.ndarray,
    alpha: float,
    *,
    eps: float = SQ_EPS,
) -> torch.Tensor:
    """s_j = max(act_max_j, eps)^α / max(weight_max_j, eps)^(1-α), float32, shape (K,).

    act_max:    (K,) max |X_j| per input channel, from calibration
    weight_max: (K,) max |W_j| per input channel (column max over output rows)
    alpha:      migration strength in [0, 1]; 0.5 balances the two maxima exactly

    Computed in float64. With α = 0.5 the smoothed maxima become equal:
    act_max / s = weight_max * s = sqrt(act_max * weight_max).
    """
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= float(alpha) <= 1.0:
        raise ValueError(
            f"alpha must be a number in [0, 1] (0.5 is usual, up to ~0.85 for strong outliers), got {alpha!r}"
        )
    if not eps > 0:
        raise ValueError(f"eps must be > 0 (it keeps dead channels finite), got {eps!r}")
    a = torch.as_tensor(act_max).detach().to(torch.float64)
    w = torch.as_tensor(weight_max).detach().to(device=a.device, dtype=torch.float64)
    if a.dim() != 1 or a.shape != w.shape:
        raise ValueError(
            f"act_max and weight_max must be 1-D of one length (one value per input channel); "
            f"got shapes {tuple(a.shape)} and {tuple(w.shape)}"
        )
    if not bool(torch.isfinite(a).all() and torch.isfinite(w).all()) or bool((a < 0).any() or (w < 0).any()):
        raise ValueError("act_max and weight_max must be finite and >= 0 (maxima of |x| and |W|)")
    alpha = float(alpha)
    return (a.clamp(min=eps) ** alpha / w.clamp(min=eps) ** (1.0 - alpha)).to(torch.float32)


@dataclass
class SmoothingHandle:
    """The result of :func:`smooth_model`.

    factors:     {linear name: (K,) s} for every linear whose input was divided by s (all
                 members of a fused group, even those not asked for: they share the input)
    folded_into: {linear name: name of the module that absorbed 1/s}
    skipped:     {linear name: reason} for requested layers left unsmoothed
    """

    factors: dict[str, torch.Tensor] = field(default_factory=dict)
    folded_into: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    _saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)

    def _save(self, param: torch.Tensor) -> None:
        """Keep a copy of ``param`` before its first change (for a bit-exact restore)."""
        if id(param) not in self._saved:
            self._saved[id(param)] = (param, param.detach().clone())

    @torch.no_grad()
    def restore(self) -> None:
        """Copy every changed parameter back to its original bits; safe to call twice."""
        for param, original in self._saved.values():
            param.data.copy_(original)
        self._saved.clear()


# ---------------------------------------------------------------------------- folding primitives


def _gain_style(norm: nn.Module) -> str | None:
    """How a norm applies its gain: "layernorm", "mul" (n(x) * w), "one_plus" (n(x) * (1 + w)) or None.

    Probed numerically (the weight is set to 0 and to 1 on a random input and restored bit
    for bit), so a norm class we have never seen is folded only if it behaves like one of these.
    """
    if isinstance(norm, nn.LayerNorm):
        return "layernorm" if norm.weight is not None else None
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return None
    saved = weight.detach().clone()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, weight.shape[0], generator=gen).to(device=weight.device, dtype=weight.dtype)
    try:
        with torch.no_grad():
            weight.zero_()
            y0 = norm(x)
            weight.fill_(1.0)
            y1 = norm(x)
    except Exception:  # a module that is not a plain (x) -> x norm
        return None
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    if not (isinstance(y0, torch.Tensor) and y0.shape == x.shape):
        return None
    if bool((y0 == 0).all()) and bool((y1 != 0).any()):
        return "mul"
    if bool((y0 != 0).any()) and torch.allclose(y1, 2 * y0, rtol=1e-3, atol=1e-6):
        return "one_plus"
    return None


def _weight(module: nn.Module) -> torch.Tensor:
    """``module.weight``: a linear's or a router's weight, a norm's gain; TypeError for a module without one."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{type(module).__name__} has no weight tensor to fold smoothing factors into")
    return weight


def _scale_columns(handle: SmoothingHandle, module: nn.Module, s: torch.Tensor) -> None:
    """W[:, j] *= s_j (the consumer side: a linear, or a router read with them)."""
    w = _weight(module)
    handle._save(w)
    w.data.copy_((w.detach().double() * s.to(w.device, torch.float64)).to(w.dtype))


def _divide_rows(handle: SmoothingHandle, linear: nn.Linear, s: torch.Tensor) -> None:
    """W[i, :] /= s_i and b_i /= s_i (the producer side: its output channel i is the consumer's input i)."""
    s64 = s.to(linear.weight.device, torch.float64)
    handle._save(linear.weight)
    w = linear.weight
    w.data.copy_((w.detach().double() / s64[:, None]).to(w.dtype))
    if linear.bias is not None:
        handle._save(linear.bias)
        linear.bias.data.copy_((linear.bias.detach().double() / s64).to(linear.bias.dtype))


def _divide_norm(handle: SmoothingHandle, norm: nn.Module, style: str, s: torch.Tensor) -> None:
    """Fold 1/s into a norm's gain per its style (see :func:`_gain_style`)."""
    w = _weight(norm)
    s64 = s.to(w.device, torch.float64)
    handle._save(w)
    if style == "one_plus":
        w.data.copy_(((1.0 + w.detach().double()) / s64 - 1.0).to(w.dtype))
    else:
        w.data.copy_((w.detach().double() / s64).to(w.dtype))
    bias = getattr(norm, "bias", None)
    if style == "layernorm" and bias is not None:
        handle._save(bias)
        bias.data.copy_((bias.detach().double() / s64).to(bias.dtype))


def _column_max(linears: Iterable[nn.Linear]) -> torch.Tensor:
    """(K,) max |W[:, j]| over the rows of every linear given (they share the input width K)."""
    return torch.cat([m.weight.detach().abs().float() for m in linears], dim=0).amax(dim=0)


# ---------------------------------------------------------------------------- planning folds


@dataclass
class FoldUnit:
    """One fold: consumers whose input is divided by one s, and what absorbs 1/s."""

    kind: str  # "norm" | "v_rows" | "up_rows"
    consumers: list[str]
    producer: str  # module name absorbing 1/s
    block: str
    also: tuple[str, ...] = ()  # modules read the same input, their weight columns scaled by s, never quantized


def plan_unit(name: str, linears: Mapping[str, nn.Linear], modules: Mapping[str, nn.Module],
              router: bool = False, arch: Architecture = LLAMA_STYLE) -> FoldUnit | str:
    """The fold for one requested linear, or the reason it cannot be folded exactly; the names of the norms and
    linears before it come from ``arch`` (:mod:`quantcore.models.architectures`). With ``router`` (AWQ's folds, as
    llm-compressor's MoE mappings make them) a routed expert's gate/up fold into the norm together with every expert
    of the block, the router's weight columns scaled along so the routing is unchanged."""
    all_names = list(linears)
    if router and (block := arch.expert_input_block(name)) is not None:
        return _expert_gate_up_unit(block, name, linears, modules, arch)
    if (block := arch.attention_input_block(name)) is not None:
        group = next((g for g in fusion_groups(all_names) if name in g), [name])
        return FoldUnit("norm", group, arch.attention_norm_of(block), block)
    if (block := arch.mlp_input_block(name)) is not None:
        group = next((g for g in fusion_groups(all_names) if name in g), [name])
        return FoldUnit("norm", group, arch.mlp_norm_of(block, modules), block)
    if (block := arch.attention_output_block(name)) is not None:
        v_name = arch.v_proj_of(block)
        if v_name not in linears:
            return "o_proj without a v_proj linear beside it: no foldable predecessor"
        return FoldUnit("v_rows", [name], v_name, block)
    if (found := arch.mlp_output(name)) is not None:
        block, mlp = found
        gate_name, up_name = arch.gate_up_of(mlp)
        if up_name not in linears or gate_name not in linears:
            return "down_proj outside a gated MLP (act(gate) * up): its input is not linear in a predecessor"
        return FoldUnit("up_rows", [name], up_name, block)
    if arch.expert_input_block(name) is not None:
        return ("a routed expert's gate/up: the norm before them also feeds the router, which would read a "
                "rescaled input (AWQ scales the router with them; SmoothQuant does not)")
    return ("no foldable predecessor: only q/k/v, gate/up (norm-fed), o_proj (after v_proj) and down_proj "
            "(after up_proj) are folded")


def _expert_gate_up_unit(block: str, name: str, linears: Mapping[str, nn.Linear],
                         modules: Mapping[str, nn.Module], arch: Architecture) -> FoldUnit | str:
    """Every routed expert's gate/up of a block, folded into the norm before the block's MLP with its router."""
    experts_module = modules.get(arch.experts_of(block))  # quantcore.models.moe.LinearExperts: one ExpertMLP each
    count = len(experts_module) if isinstance(experts_module, nn.ModuleList) else 0
    experts = [n for e in range(count) for leaf in arch.gate_up
               if (n := arch.expert_linear(block, e, leaf)) in linears]
    router = arch.router_of(block)
    route = modules.get(router)
    weight = getattr(route, "weight", None)
    k = linears[name].in_features
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != k:
        return (f"a routed expert's gate/up without a router {router} of width {k} beside them: the "
                "norm before them also feeds the router, which would read a rescaled input")
    return FoldUnit("norm", experts, arch.mlp_norm_of(block, modules), block, also=(router,))


def _alpha_for(unit: FoldUnit, requested: set[str], alpha: float | Mapping[str, float]) -> float:
    if not isinstance(alpha, Mapping):
        return float(alpha)
    values = {float(alpha[n]) for n in unit.consumers if n in requested and n in alpha}
    if not values:
        raise ValueError(
            f"no alpha given for {', '.join(n for n in unit.consumers if n in requested)}; "
            "add them to the alpha mapping"
        )
    if len(values) > 1:
        raise ValueError(
            f"{', '.join(unit.consumers)} share one input and must share one alpha; got {sorted(values)}"
        )
    return values.pop()


def _act_max_for(
    unit: FoldUnit, act_channel_max: Mapping[str, object], k: int, device: torch.device
) -> torch.Tensor:
    """Elementwise max of the calibrated input maxima of the unit's consumers (they read one tensor)."""
    found = []
    for n in unit.consumers:
        if n in act_channel_max:
            t = (
                torch.as_tensor(
                    np.asarray(act_channel_max[n])
                    if not isinstance(act_channel_max[n], torch.Tensor)
                    else act_channel_max[n]
                )
                .detach()
                .to(device=device, dtype=torch.float32)
                .flatten()
            )
            if t.numel() != k:
                raise ValueError(
                    f"act_channel_max[{n!r}] has {t.numel()} values; the layer has {k} input channels"
                )
            found.append(t)
    if not found:
        raise ValueError(
            f"no act_channel_max for {', '.join(unit.consumers)}; pass per-input-channel max|x| from calibration"
        )
    return torch.stack(found).amax(dim=0)


@torch.no_grad()
def smooth_model(
    model: nn.Module,
    act_channel_max: Mapping[str, torch.Tensor | np.ndarray],
    alpha: float | Mapping[str, float],
    *,
    layers: Iterable[str] | None = None,
    factors: Mapping[str, torch.Tensor] | None = None,
    router: bool = False,
) -> SmoothingHandle:
    """Fold SmoothQuant factors into ``model`` in place; the handle's ``restore()`` undoes it bit for bit.

    act_channel_max: {linear name: (K,) max |x_j|} from calibration, for the layers to smooth
    alpha:           one α for all, or {linear name: α}; a fused group (q/k/v, gate/up) needs one α
    layers:          linears to smooth (default: every key of act_channel_max)

    factors:         {linear name: (K,) s} to fold as given instead of computing s from maxima and α
                     (AWQ's searched factors, :mod:`quantcore.algorithms.awq`); act_channel_max and alpha are not
                     read for these layers. An o_proj under grouped-query attention is skipped: its
                     factors would have to be tied across the query heads of each kv head.
    router:          fold a routed expert's gate/up with the router of its block (AWQ's folds); without it
                     they are skipped (SmoothQuant's)

    Asking for one member of a fused group smooths the whole group (they read one tensor, and
    the norm that absorbs 1/s feeds all of them). Layers that cannot be folded exactly are
    skipped and listed in ``handle.skipped`` with the reason. Names that are not nn.Linear
    modules of the model raise :class:`~quantcore.errors.PlanError`.
    """
    modules = dict(model.named_modules())
    linears = {n: m for n, m in modules.items() if isinstance(m, nn.Linear)}
    arch = architecture_of(model)
    given = dict(factors or {})
    if layers is not None:
        requested = list(layers)
    else:
        requested = list(act_channel_max) + [n for n in given if n not in act_channel_max]
    unknown = [n for n in requested if n not in linears]
    if unknown:
        raise PlanError(
            f"smooth_model: {len(unknown)} name(s) are not nn.Linear layers of this model: {name_list(unknown)}; "
            "use names from model.named_modules()"
        )
    if not isinstance(alpha, Mapping) and len(given) < len(requested):
        smoothing_factors(torch.ones(1), torch.ones(1), alpha)  # validates alpha early
    handle = SmoothingHandle()
    units: dict[tuple[str, str], FoldUnit] = {}
    for name in requested:
        unit = plan_unit(name, linears, modules, router, arch)
        if isinstance(unit, str):
            handle.skipped[name] = unit
            continue
        units.setdefault((unit.kind, unit.producer), unit)

    order = {n: i for i, n in enumerate(modules)}
    requested_set = set(requested)
    for unit in sorted(units.values(), key=lambda u: order[u.consumers[0]]):
        fixed = next((given[n] for n in unit.consumers if n in given), None)
        alpha_u = 0.0 if fixed is not None else _alpha_for(unit, requested_set, alpha)
        reason = _fold(handle, unit, modules, linears, act_channel_max, alpha_u, fixed)
        if reason is not None:
            for n in unit.consumers:
                if n in requested_set:
                    handle.skipped[n] = reason
    return handle


def fold_factors(model: nn.Module, factors: Mapping[str, torch.Tensor]) -> SmoothingHandle:
    """Fold given factors ``{linear: (K,) s}`` (AWQ's, an expert's gate/up with its router) as :func:`smooth_model`
    folds SmoothQuant's; the handle's
    ``restore()`` undoes it bit for bit, ``handle.skipped`` names what could not be folded."""
    return smooth_model(model, {}, 0.0, layers=list(factors), factors=factors, router=True)


def _calibrated(act: torch.Tensor | None, unit: FoldUnit) -> torch.Tensor:
    """The consumers' calibrated input maxima, which :func:`_fold` has whenever it was not given the factors."""
    if act is None:
        raise ValueError(f"no calibrated input maxima for {', '.join(unit.consumers)} and no factors given")
    return act


def _fold(
    handle: SmoothingHandle,
    unit: FoldUnit,
    modules: Mapping[str, nn.Module],
    linears: Mapping[str, nn.Linear],
    act_channel_max: Mapping[str, object],
    alpha: float,
    fixed: torch.Tensor | None = None,
) -> str | None:
    """Compute s for one unit (or take ``fixed``) and fold it; returns a reason string instead when it cannot
    be exact."""
    consumers = [linears[n] for n in unit.consumers]
    k = consumers[0].in_features
    device = consumers[0].weight.device
    if fixed is not None:
        fixed = torch.as_tensor(fixed).detach().to(device=device, dtype=torch.float64).flatten()
        if fixed.numel() != k or not bool(torch.isfinite(fixed).all() and (fixed > 0).all()):
            raise ValueError(
                f"the factors given for {', '.join(unit.consumers)} must be {k} finite positive values, one per "
                f"input channel; got {fixed.numel()}"
            )
        act = None
    else:
        act = _act_max_for(unit, act_channel_max, k, device)

    if unit.kind == "norm":
        norm = modules.get(unit.producer)
        if norm is None:
            return f"expected the norm {unit.producer!r} before these layers; the model has none"
        style = _gain_style(norm)
        if style is None or _weight(norm).shape[0] != k:
            return (
                f"{unit.producer} is not a norm with a per-channel gain of width {k}; cannot fold 1/s into it"
            )
        s = fixed if fixed is not None else smoothing_factors(_calibrated(act, unit), _column_max(consumers),
                                                              alpha).to(device)
        _divide_norm(handle, norm, style, s)
        for c in consumers + [modules[a] for a in unit.also]:
            _scale_columns(handle, c, s)
    elif unit.kind == "v_rows":
        v, o = linears[unit.producer], consumers[0]
        n_rep, rem = divmod(o.in_features, v.out_features)
        if rem:
            return (
                f"o_proj input ({o.in_features}) is not a whole number of v_proj outputs ({v.out_features})"
            )
        if fixed is not None and n_rep > 1:
            return GQA_NO_FACTORS
        if fixed is not None:  # one factor per o_proj input, which is one per v_proj output (no GQA: checked)
            s_kv = s = fixed
        else:
            act_t, w_t = _calibrated(act, unit), _column_max([o])
            if n_rep > 1:  # GQA: tie s across the query heads that read one kv head
                attn = modules[unit.producer.rsplit(".", 1)[0]]
                head_dim = getattr(attn, "head_dim", None)
                if not isinstance(head_dim, int) or v.out_features % head_dim:
                    return "GQA attention without a usable head_dim attribute: cannot tie factors across heads"
                n_kv = v.out_features // head_dim
                act_t = act_t.view(n_kv, n_rep, head_dim).amax(dim=1).flatten()
                w_t = w_t.view(n_kv, n_rep, head_dim).amax(dim=1).flatten()
                s_kv = smoothing_factors(act_t, w_t, alpha).to(device)
                s = s_kv.view(-1, 1, head_dim).expand(-1, n_rep, head_dim).flatten()
            else:
                s_kv = s = smoothing_factors(act_t, w_t, alpha).to(device)
        _divide_rows(handle, v, s_kv)
        _scale_columns(handle, o, s)
    else:  # "up_rows"
        up, down = linears[unit.producer], consumers[0]
        s = fixed if fixed is not None else smoothing_factors(_calibrated(act, unit), _column_max([down]),
                                                              alpha).to(device)
        _divide_rows(handle, up, s)
        _scale_columns(handle, down, s)

    for n in unit.consumers:
        handle.factors[n] = s.detach().clone()
        handle.folded_into[n] = unit.producer
    return None
