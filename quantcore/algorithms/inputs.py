"""What a plan needs beside the model and its schemes: one typed object that travels together.

``apply_plan``, ``plan_applied``, ``score_plan``, ``calibrate_kv_cache`` and ``sensitivity_sweep`` all take the same
calibrated inputs (activation maxima for static scales and SmoothQuant, Hessians and kept roundings for GPTQ, AWQ's
searched scales, KV cache maxima, the GPUs a plan is served on). They travel as one :class:`PlanInputs` instead of
seven keyword arguments passed from hand to hand; a field left ``None`` means "not calibrated", and the function
that needs it says so in its error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch-bearing types only for the checker: this module stays importable without torch
    from torch import Tensor

    from quantcore.algorithms.awq import AwqResult
    from quantcore.algorithms.rotation_spec import RotationSpec
    from quantcore.models.parallel import Parallelism


@dataclasses.dataclass(frozen=True)
class PlanInputs:
    """The calibrated inputs of a plan (every field optional).

    act_amax: ``{layer: max |x|}`` of each linear's input over the calibration set (static activation scales).
    act_channel_max: ``{layer: per-input-channel max |x|}`` (SmoothQuant's factors, AWQ's search).
    weight_hessians: ``{layer: X^T X}`` for the layers whose scheme rounds with GPTQ.
    gptq_cache: GPTQ-rounded weights to reuse and fill; the same dict across calls rounds each layer once.
        The dict is filled in place on purpose: a cache shared by the calls that receive this object.
    awq: AWQ's searched input scales for the layers whose scheme scales with AWQ.
    kv_amax: the K / V maxima a calibrated KV cache format (``FP8``) needs.
    parallel: the GPUs the plan is served on (tensor / expert parallelism); ``None`` is one GPU.
    rotation: the plan's Hadamard rotation (its ``transforms:``), folded into the model before anything else; the
        other fields must then have been calibrated with it applied (:func:`quantcore.algorithms.rotation.
        rotation_applied`). ``None``: no rotation.
    """

    act_amax: Mapping[str, float] | None = None
    act_channel_max: Mapping[str, Any] | None = None
    weight_hessians: Mapping[str, Tensor] | None = None
    gptq_cache: dict[str, Tensor] | None = None
    awq: AwqResult | None = None
    kv_amax: Any = None
    parallel: Parallelism | None = None
    rotation: RotationSpec | None = None

    def replace(self, **changes: Any) -> PlanInputs:
        """A copy with ``changes`` (the GPTQ cache dict itself is shared, not copied)."""
        return dataclasses.replace(self, **changes)


NO_INPUTS = PlanInputs()  # nothing calibrated: dynamic scales only, round to nearest, one GPU

__all__ = ["NO_INPUTS", "PlanInputs"]
