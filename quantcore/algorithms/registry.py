"""One registry of the methods that round a scheme's weights and of the transforms folded into a model before them.

In the style of torchao's ``register_quantize_module_handler``: a scheme's :class:`~quantcore.schemes.specs.Rounding`
(to nearest, GPTQ, AWQ) maps to its handler through a registration decorator, so a new method is a new handler,
never another ``if`` wherever weights are rounded. The module that implements a method registers it:

    @register_rounding_handler(Rounding.GPTQ, reads_nearest=False, needs="weight_hessians")
    def round_with_gptq(layer: WeightRounding) -> torch.Tensor: ...

RTN is registered by :mod:`quantcore.algorithms.apply`, GPTQ by :mod:`quantcore.algorithms.gptq`, AWQ by
:mod:`quantcore.algorithms.awq`; importing :mod:`quantcore.algorithms.apply` registers them all. A transform
(SmoothQuant, AWQ's searched scales) divides a layer's input by per-channel factors folded into the operator before it;
:func:`register_transform` records which schemes it applies to and which calibrated input
(a :class:`~quantcore.algorithms.inputs.PlanInputs` field) it reads, so callers ask :func:`calibration_needs` what a
plan needs instead of testing each method by name. This module itself imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from quantcore.schemes.specs import Rounding, Scheme

if TYPE_CHECKING:
    from torch import Tensor


@dataclass(frozen=True)
class WeightRounding:
    """What a rounding handler is given for one layer.

    name: the layer; weight: its weight as the scheme rounds it (after any transform folded into it); scheme: its
    scheme; nearest: the weight rounded to nearest on the grid the checkpoint stores (None when the method does not
    read it: ``reads_nearest=False``); tensor_scale: the NVFP4 tensor scale its fusion group shares (None: its own);
    hessians: ``{layer: (K, K) Hessian}`` of the inputs, already transformed for smoothing; gptq_cache: rounded
    weights kept by layer name across applies (filled in place), or None.
    """

    name: str
    weight: Tensor
    scheme: Scheme
    nearest: Tensor | None = None
    tensor_scale: Tensor | None = None
    hessians: Mapping[str, Tensor] | None = None
    gptq_cache: dict[str, Tensor] | None = None


RoundingHandler = Callable[[WeightRounding], "Tensor"]


@dataclass(frozen=True)
class RoundingMethod:
    """A registered rounding method: its handler, whether the handler starts from the round-to-nearest weight, and
    the :class:`~quantcore.algorithms.inputs.PlanInputs` field it reads (None: it needs no calibration)."""

    rounding: Rounding
    handler: RoundingHandler
    reads_nearest: bool = True
    needs: str | None = None


@dataclass(frozen=True)
class Transform:
    """A registered transform: its name, the schemes it applies to, and the PlanInputs field it reads (None: none).
    plan_level: set for the whole plan (a rotation, by the plan's ``transforms:``), not by a layer's scheme."""

    name: str
    applies_to: Callable[[Scheme], bool]
    needs: str | None
    plan_level: bool = False


_ROUNDINGS: dict[Rounding, RoundingMethod] = {}
_TRANSFORMS: dict[str, Transform] = {}


def register_rounding_handler(
    rounding: Rounding, *, reads_nearest: bool = True, needs: str | None = None
) -> Callable[[RoundingHandler], RoundingHandler]:
    """Decorator: ``handler`` rounds the weights of every scheme whose :attr:`Scheme.rounding` is ``rounding``.

    reads_nearest: the handler reads :attr:`WeightRounding.nearest` (computed for it); needs: the PlanInputs field
    the method reads. A rounding registered twice raises ValueError.
    """

    def register(handler: RoundingHandler) -> RoundingHandler:
        if rounding in _ROUNDINGS:
            raise ValueError(f"a handler for rounding {rounding.value!r} is already registered "
                             f"({_ROUNDINGS[rounding].handler.__qualname__})")
        _ROUNDINGS[rounding] = RoundingMethod(rounding, handler, reads_nearest, needs)
        return handler

    return register


def rounding_method(rounding: Rounding | Scheme | str) -> RoundingMethod:
    """The registered method for a rounding (or a scheme's); ValueError naming the registered ones otherwise."""
    key = rounding.rounding if isinstance(rounding, Scheme) else Rounding(rounding)
    try:
        return _ROUNDINGS[key]
    except KeyError:
        known = ", ".join(r.value for r in _ROUNDINGS) or "none"
        raise ValueError(f"no handler is registered for rounding {key.value!r} (registered: {known}); import "
                         "quantcore.algorithms.apply, which registers RTN, GPTQ and AWQ") from None


def register_transform(name: str, *, applies_to: Callable[[Scheme], bool], needs: str | None,
                       plan_level: bool = False) -> Transform:
    """Record a transform folded into the model before rounding: the schemes it ``applies_to`` and the PlanInputs
    field it ``needs`` (None: no calibrated input); ``plan_level``: chosen by the plan's ``transforms:`` section, not
    by a scheme. A name registered twice raises ValueError."""
    if name in _TRANSFORMS:
        raise ValueError(f"a transform called {name!r} is already registered")
    _TRANSFORMS[name] = Transform(name, applies_to, needs, plan_level)
    return _TRANSFORMS[name]


def list_transforms() -> list[Transform]:
    """Every registered transform, in registration order."""
    return list(_TRANSFORMS.values())


def calibration_needs(schemes: Iterable[Scheme]) -> dict[str, list[str]]:
    """{PlanInputs field: names of the methods and transforms that read it} for the quantized schemes given: what a
    plan of them needs calibrated beyond its static activation scales (``act_amax``)."""
    out: dict[str, list[str]] = {}
    for scheme in schemes:
        if scheme.is_identity:
            continue
        method = rounding_method(scheme)
        found = [(method.needs, method.rounding.value)] if method.needs else []
        found += [(t.needs, t.name) for t in _TRANSFORMS.values() if t.needs and t.applies_to(scheme)]
        for field_name, who in found:
            names = out.setdefault(field_name, [])
            if who not in names:
                names.append(who)
    return out


def registered() -> dict[str, Any]:
    """{"rounding": [...], "transforms": [...]}: the names registered so far (for messages and docs)."""
    return {"rounding": [r.value for r in _ROUNDINGS], "transforms": list(_TRANSFORMS)}


__all__ = [
    "RoundingHandler",
    "RoundingMethod",
    "Transform",
    "WeightRounding",
    "calibration_needs",
    "list_transforms",
    "register_rounding_handler",
    "register_transform",
    "registered",
    "rounding_method",
]
