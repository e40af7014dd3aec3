"""The GEMM time of one prefill and one decode step of a plan, from measured kernel records."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from quantcore.kernels.paths import PATH_BASELINE, PATHS, timed_path
from quantcore.kernels.records import KernelRecord, case_times, has_time, unstable_cases
from quantcore.models.routing import Routing, case_m, step_share


def step_estimate(
    records: Iterable[KernelRecord],
    layer_shapes: Mapping[str, tuple[int, int]],
    layer_paths: Mapping[str, str | None],
    *,
    m_prefill: int,
    m_decode: int,
    quant_act: bool = True,
    routed: Mapping[str, Routing] | None = None,
) -> dict[str, Any]:
    """Estimated GEMM time of one prefill and one decode step for a plan.

    ``layer_shapes`` maps every linear layer to its (N, K); ``layer_paths`` maps a layer to
    its kernel path (a missing layer or None = ``baseline``). With ``quant_act`` (default)
    a base path is timed through its ``+q`` variant, since serving with quantized
    activations pays for quantizing them; a path given with ``+q`` is used as is.

    The step time is the sum over layers of the measured time at that layer's (M, N, K)
    and path, M = ``m_prefill`` or ``m_decode`` (batch x tokens); no interpolation: a
    layer whose case was not measured (absent or skipped), or whose time is flagged ``unstable``
    (its spread too wide to add up: measured again first), is listed under ``missing_*``
    and left out of the sum; ``covered_*`` says how many of ``layers`` the sum rests on.
    A routed expert of an MoE model (``routed``: {layer:
    :class:`quantcore.models.routing.Routing`}) counts its expected share: the time at the M of one
    touched expert (``Routing.expert_m``, which the benchmark of an MoE model times) times the
    chance the step touches it. Returns::

        {"m_prefill", "m_decode",
         "prefill_ms", "decode_ms",                    # plan, measured layers only
         "baseline_prefill_ms", "baseline_decode_ms",  # every layer at baseline
         "speedup_prefill", "speedup_decode",          # over layers measured both ways
         "common_baseline_prefill_ms", "common_baseline_decode_ms",  # baseline over those layers (the speed-up's)
         "missing_prefill", "missing_decode",          # layers without a plan-path time
         "skipped_prefill", "skipped_decode",          # {missing layer: why its case has no time}, where recorded
         "unstable_prefill", "unstable_decode",        # missing layers whose time is flagged unstable
         "layers", "covered_prefill", "covered_decode",  # layers in all; of them, those the sums rest on
         "missing_baseline",                           # layers without a baseline time
         "complete": bool,                             # nothing missing anywhere
         "per_layer": {name: {"path", "prefill_ms", "decode_ms"}}}

    Records from more than one device raise ValueError (times from different devices do
    not add up).
    """
    recs = list(records)
    devices = {(r.device, r.device_name) for r in recs}
    if len(devices) > 1:
        names = ", ".join(sorted(d[1] for d in devices))
        raise ValueError(f"records come from several devices ({names}); estimate one device at a time")
    times = case_times(recs)  # without the unstable times
    shaky = unstable_cases(recs)
    skips = {(r.m, r.n, r.k, r.path): r.skipped for r in recs if not has_time(r) and r.skipped}
    valid = set(PATHS)

    out: dict[str, Any] = {"m_prefill": int(m_prefill), "m_decode": int(m_decode), "per_layer": {}}
    tot = {"prefill": 0.0, "decode": 0.0, "base_prefill": 0.0, "base_decode": 0.0}
    common = {"prefill": [0.0, 0.0], "decode": [0.0, 0.0]}  # [plan, baseline] over layers with both
    missing: dict[str, list[str]] = {"prefill": [], "decode": [], "baseline": []}
    skipped: dict[str, dict[str, str]] = {"prefill": {}, "decode": {}}
    unstable: dict[str, list[str]] = {"prefill": [], "decode": []}
    routed = routed or {}
    for name, (n, k) in layer_shapes.items():
        path = layer_paths.get(name) or PATH_BASELINE
        if path not in valid:
            raise ValueError(f"layer {name!r}: unknown kernel path {path!r}; choose from: {', '.join(PATHS)}")
        path = timed_path(path, quant_act)
        entry: dict[str, Any] = {"path": path}
        for step, m in (("prefill", m_prefill), ("decode", m_decode)):
            t = step_share(times, int(m), int(n), int(k), path, routed.get(name))
            b = step_share(times, int(m), int(n), int(k), PATH_BASELINE, routed.get(name))
            entry[f"{step}_ms"] = t
            if t is None:
                missing[step].append(name)
                case = (case_m(int(m), routed.get(name)), int(n), int(k), path)
                if (why := skips.get(case)) is not None:
                    skipped[step][name] = why
                elif case in shaky:
                    unstable[step].append(name)
            else:
                tot[step] += t
            if b is None:
                if name not in missing["baseline"]:
                    missing["baseline"].append(name)
            else:
                tot[f"base_{step}"] += b
            if t is not None and b is not None:
                common[step][0] += t
                common[step][1] += b
        out["per_layer"][name] = entry
    out["prefill_ms"] = tot["prefill"]
    out["decode_ms"] = tot["decode"]
    out["baseline_prefill_ms"] = tot["base_prefill"]
    out["baseline_decode_ms"] = tot["base_decode"]
    for step in ("prefill", "decode"):
        plan_t, base_t = common[step]
        out[f"speedup_{step}"] = (base_t / plan_t) if plan_t > 0 else None
        out[f"common_baseline_{step}_ms"] = base_t
        out[f"skipped_{step}"] = skipped[step]
        out[f"unstable_{step}"] = unstable[step]
        out[f"covered_{step}"] = len(layer_shapes) - len(missing[step])
    out["layers"] = len(layer_shapes)
    out["missing_prefill"] = missing["prefill"]
    out["missing_decode"] = missing["decode"]
    out["missing_baseline"] = missing["baseline"]
    out["complete"] = not any(missing.values())
    return out
