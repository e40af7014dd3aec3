"""What each layer costs in each scheme, for the automatic planner (:mod:`quantcore.planning.autoplan`; torch-free).

Cost
    - ``cost=None``: a bits proxy, the stored weight bits of each layer, scales included
      (:func:`quantcore.schemes.storage.weight_storage_bits`: the weight memory, and the bytes a decode
      step reads), needing ``layer_shapes`` {layer: (N, K)}. It is the plan's
      :func:`quantcore.planning.footprint.plan_footprint`, so W4A16 (4.125 bits) beats NVFP4A16 (4.5) on it.
    - ``cost={scheme: {layer: ms}}``: measured GEMM times on the target (see
      :func:`cost_from_kernel_records`). ``cost["BF16"]`` must time every layer (the
      baseline); a scheme without a time for a layer is *estimated* as the layer's BF16 time
      times ``weight_bits / 16`` — the same proxy, in milliseconds — and marked
      ``"estimated"`` in ``per_unit`` (``estimate_missing=False`` forbids instead). The same table
      filled from the target's datasheet (:func:`quantcore.kernels.roofline.cost_from_roofline`, with
      ``cost_source="ideal"``) plans for a GPU nobody has measured: at M = 1 it follows the weight
      bytes, at a prefill's M the native math rate.
    Equal costs are broken towards the lower KL.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from quantcore.errors import PlanError
from quantcore.errors import format_problems as _format
from quantcore.errors import name_list as _cut
from quantcore.kernels.hardware import TARGETS, match_target
from quantcore.models.routing import Routing, step_share
from quantcore.planning.serving import (
    untied_embedding_bits,
)
from quantcore.schemes.presets import get_scheme
from quantcore.schemes.specs import IDENTITY_BITS, Scheme
from quantcore.schemes.storage import weight_storage_bits

BASELINE_SCHEME = "BF16"  # always available, KL 0


COST_MEASURED = "measured"  # a kernel time from the benchmark table
COST_IDEAL = "ideal"  # the roofline bound on the target's datasheet (quantcore.kernels.roofline.cost_from_roofline)
COST_ESTIMATED = "estimated"  # BF16 time x weight_bits / 16
COST_BITS = "bits"  # stored weight bits, scales included (weight_storage_bits)
UNIT_MS = "ms"
UNIT_BITS = "weight bits"


@dataclass(frozen=True)
class LayerCost:
    """The cost of one layer in one scheme.

    cost:   milliseconds per GEMM call (measured or estimated), or weight bits (bits proxy)
    source: ``"measured"`` | ``"estimated"`` | ``"bits"`` (see the module docstring)
    """

    layer: str
    scheme: str
    cost: float
    source: str


def _bits_cost(scheme: Scheme, shape: tuple[int, int]) -> float:
    return float(weight_storage_bits(scheme, *shape))


def layer_costs(
    layer_names: Sequence[str],
    schemes: Sequence[str],
    cost: Mapping[str, Mapping[str, float]] | None,
    layer_shapes: Mapping[str, tuple[int, int]] | None,
    estimate_missing: bool,
    source: str = COST_MEASURED,
    tied: Sequence[str] = (),
) -> dict[str, dict[str, LayerCost]]:
    """{scheme: {layer: LayerCost}}; a layer missing under a scheme cannot take it. ``tied``: layers whose weight
    is the input embedding's; with the bits proxy, quantizing one costs the 16-bit embedding llm-compressor keeps
    after untying them (quantcore.planning.serving.untied_embedding_bits)."""
    problems: list[str] = []
    out: dict[str, dict[str, LayerCost]] = {}
    if cost is None:
        shapes = layer_shapes or {}
        missing = [n for n in layer_names if n not in shapes]
        if missing:
            raise PlanError(
                f"the bits cost proxy needs every layer's (N, K): layer_shapes lacks {_cut(missing)}"
            )
        for n in layer_names:
            shape = shapes[n]
            if (
                not isinstance(shape, (tuple, list))
                or len(shape) != 2
                or not all(isinstance(x, int) and x > 0 for x in shape)
            ):
                problems.append(f"layer_shapes[{n!r}] must be (N, K) positive integers, got {shape!r}")
        if problems:
            raise PlanError(_format("Layer shapes are malformed", problems))
        for s in schemes:
            scheme = get_scheme(s)
            out[s] = {
                n: LayerCost(n, s, _bits_cost(scheme, (shapes[n][0], shapes[n][1]))
                             + untied_embedding_bits({n: scheme}, shapes, tied), COST_BITS)
                for n in layer_names
            }
        return out
    base = cost.get(BASELINE_SCHEME, {})
    missing = [n for n in layer_names if n not in base]
    if missing:
        raise PlanError(
            f"measured costs need a BF16 (baseline) time for every layer; cost['BF16'] lacks "
            f"{_cut(missing)}: benchmark the baseline for these shapes, or plan with the bits proxy "
            "(cost=None)"
        )
    for s in schemes:
        scheme = get_scheme(s)
        times = cost.get(s, {})
        row: dict[str, LayerCost] = {}
        for n in layer_names:
            if n in times:
                v = times[n]
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                    problems.append(f"cost[{s!r}][{n!r}] must be a time in ms >= 0, got {v!r}")
                    continue
                row[n] = LayerCost(n, s, float(v), source)
            elif estimate_missing:
                row[n] = LayerCost(n, s, float(base[n]) * scheme.weight_bits / IDENTITY_BITS, COST_ESTIMATED)
        out[s] = row
    if problems:
        raise PlanError(_format("The cost table is malformed", problems))
    return out


def cost_from_kernel_records(
    records: Iterable[Any],
    layer_shapes: Mapping[str, tuple[int, int]],
    schemes: Sequence[str],
    *,
    m: int,
    target: str | None = None,
    routed: Mapping[str, Routing] | None = None,
) -> dict[str, dict[str, float]]:
    """Per-layer GEMM times {scheme: {layer: ms}} at M = ``m`` tokens, from kernel benchmark records (a routed
    expert of an MoE model, ``routed``: its expected share, as :func:`quantcore.kernels.estimate.step_estimate` counts
    it).

    ``records`` are :class:`quantcore.kernels.records.KernelRecord` or their dicts, from one device.
    BF16 takes the ``baseline`` path; another scheme takes the path
    :func:`quantcore.kernels.paths.scheme_path` gives it, timed with on-the-fly activation
    quantization (``+q``) as serving pays it (weight-only paths have none). Schemes without
    a path (FP4, MX, block scales) and shapes not measured are left out; :func:`auto_plan` estimates or
    forbids them. With ``target``, records from a GPU that is not that target raise
    PlanError: times from one GPU say nothing about another.
    """
    from quantcore.kernels.paths import PATH_BASELINE, scheme_path, timed_path
    from quantcore.kernels.records import KernelRecord, case_times

    recs = [r if isinstance(r, KernelRecord) else KernelRecord.from_dict(r) for r in records]
    devices = {(r.device, r.device_name) for r in recs}
    if len(devices) > 1:
        raise PlanError(
            f"kernel records come from several devices ({', '.join(sorted(d[1] for d in devices))}); "
            "pass the records of one device"
        )
    if target is not None and recs:
        if target not in TARGETS:
            raise PlanError(f"unknown GPU target {target!r}; choose one of: {', '.join(TARGETS)}")
        device, name = next(iter(devices))
        found = match_target(name) if device == "cuda" else None
        if found != target:
            raise PlanError(
                f"the kernel times were measured on {name!r} ({device}), not on target {target!r}; "
                f"benchmark on a {TARGETS[target].name}, or plan with the bits proxy (no kernel times)"
            )
    times = case_times(recs)
    out: dict[str, dict[str, float]] = {}
    for s in schemes:
        scheme = get_scheme(s)
        if scheme.is_identity:
            path: str | None = PATH_BASELINE
        else:
            base = scheme_path(scheme)
            path = timed_path(base) if base else None
        if path is None:
            continue
        row = {}
        for layer, (n, k) in layer_shapes.items():
            t = step_share(times, m, n, k, path, (routed or {}).get(layer))
            if t is not None:
                row[layer] = float(t)
        if row:
            out[s] = row
    return out
