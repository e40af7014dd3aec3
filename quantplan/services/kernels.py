"""Stored kernel timings: devices, shapes named for people, step estimates of a plan."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from quantplan.services.deployment import settings
from quantplan.services.models import attention_heads, layer_shapes, routed_layers
from quantplan.services.plans import parallelism
from store import repo
from store.db import session_scope
from store.records import ModelRecord

if TYPE_CHECKING:
    import pandas as pd

    from quantcore.kernels.records import KernelRecord


def kernel_devices() -> list[tuple[str, str, str]]:
    """(device kind, device name, torch version) of every device with stored kernel timings."""
    with session_scope(settings()) as s:
        return repo.kernel_devices(s)


def device_probe(device_name: str) -> dict[str, Any] | None:
    """The device a benchmark measured, as its newest job found it (store.repo.device_probe)."""
    with session_scope(settings()) as s:
        return repo.device_probe(s, device_name)


def kernel_frame(device_name: str, torch_version: str | None = None) -> pd.DataFrame:
    """Newest timing per (M, N, K, path) on one device, as a DataFrame with a readable shape label."""
    import pandas as pd

    with session_scope(settings()) as s:
        rows = repo.newest_kernel_results(s, device_name=device_name, torch_version=torch_version)
    return pd.DataFrame([r.__dict__ for r in rows])


TP_LABELLED = range(2, 9)  # the GPUs of one node: shapes a benchmark split over them measures


def shape_labels(model: ModelRecord) -> dict[tuple[int, int], str]:
    """{(N, K): "down_proj 576×1536"}: each distinct GEMM shape named after the layer types that have it; then
    each GPU's share of a layer at the tensor-parallel sizes of one node the model splits over evenly
    ("down_proj 576×512 (TP 3)"), which a benchmark with ``tensor_parallel`` measures."""
    from quantcore.models.parallel import Parallelism, tp_misfits

    def named(shapes: dict[str, tuple[int, int]], suffix: str = "") -> dict[tuple[int, int], str]:
        # every projection type with the shape ("q_proj/o_proj 576×576"), so none is missing from a heatmap's rows
        kinds: dict[tuple[int, int], list[str]] = {}
        for name, shape in shapes.items():
            if (kind := name.rsplit(".", 1)[-1]) not in kinds.setdefault(shape, []):
                kinds[shape].append(kind)
        return {(n, k): f"{'/'.join(ks)} {n}×{k}{suffix}" for (n, k), ks in kinds.items()}

    shapes, heads = layer_shapes(model), attention_heads(model)
    out = named(shapes)
    for tp in TP_LABELLED:
        par = Parallelism(tp, heads)
        if tp_misfits(shapes, par):
            continue
        out = named(par.shards(shapes), f" (TP {tp})") | out  # a shape one GPU's share has too keeps its own label
    return out


def device_comparison(model: ModelRecord, path: str, m: int) -> pd.DataFrame:
    """One kernel path at one M on every device that timed the model's shapes.

    Columns: shape, device, speedup (NaN where the device does not run the path natively or has
    no time for it), ms, unstable (the case's timed calls spread too widely: the heatmap marks it). Empty when fewer
    than two devices have any of the shapes.
    """
    import math

    import pandas as pd

    from quantcore.kernels.records import KernelRecord, has_time

    labels = shape_labels(model)
    rows = []
    with session_scope(settings()) as s:
        for name in sorted({d[1] for d in repo.kernel_devices(s)}):
            for r in repo.newest_kernel_results(s, device_name=name):
                if (r.n, r.k) in labels and r.m == m and r.path == path:
                    timed = has_time(KernelRecord.from_dict(r.__dict__)) and r.speedup is not None and r.native
                    rows.append({"shape": labels[(r.n, r.k)], "device": name, "ms": r.ms,
                                 "speedup": r.speedup if timed else math.nan, "unstable": bool(r.unstable)})
    frame = pd.DataFrame(rows, columns=["shape", "device", "ms", "speedup", "unstable"])
    return frame if frame["device"].nunique() >= 2 else frame.iloc[0:0]


def _plan_paths(model: ModelRecord, plan_body: dict[str, Any]):
    """(the resolved plan, the kernel path each layer would run on: None for baseline speed / emulated)."""
    from quantcore.kernels.paths import scheme_path
    from quantcore.planning.plans import PlanSpec, resolve_plan

    plan = resolve_plan(PlanSpec.from_dict(plan_body), [lin["name"] for lin in model.linears])
    return plan, {name: scheme_path(scheme) for name, scheme in plan.items()}


def layer_paths(model: ModelRecord, plan_body: dict[str, Any]) -> dict[str, str | None]:
    """The kernel path each layer of a plan would run on (None: baseline speed / emulated)."""
    return _plan_paths(model, plan_body)[1]


def untimed_schemes(model: ModelRecord, plan_body: dict[str, Any], layers: Iterable[str] | None = None
                    ) -> dict[str, int]:
    """{scheme: layers} of a plan's quantized layers (of ``layers`` where given: those a step estimate counts, one
    GPU's under expert parallelism) that no benchmarked kernel serves (quantcore.kernels.paths.scheme_path is None: FP4,
    MX and block scales, E5M2 x E5M2, zero points on a path without them): a step estimate counts them at the
    baseline's time."""
    plan, paths = _plan_paths(model, plan_body)
    return _untimed(plan, paths, layers)


def _untimed(plan, paths, layers: Iterable[str] | None) -> dict[str, int]:
    from collections import Counter

    counted = set(plan if layers is None else layers)
    return dict(Counter(s.name for n, s in plan.items() if n in counted and not s.is_identity and paths[n] is None))


def step_estimate(model: ModelRecord, plan_body: dict[str, Any], device_name: str, *, m_prefill: int,
                  m_decode: int) -> dict[str, Any]:
    """Prefill / decode GEMM time of a plan on a device, from the stored kernel timings; at the plan's
    tensor_parallel, one GPU's step: its share of every layer, timed by a benchmark split as the plan is. Adds
    ``untimed``: :func:`untimed_schemes` of the layers it sums."""
    from quantcore.kernels.estimate import step_estimate as estimate

    shapes = parallelism(model, plan_body).first_gpu_shapes(layer_shapes(model))  # EP: the experts one GPU holds
    plan, paths = _plan_paths(model, plan_body)
    est = estimate(kernel_records(device_name), shapes, paths, m_prefill=m_prefill, m_decode=m_decode,
                   routed=routed_layers(model))
    return {**est, "untimed": _untimed(plan, paths, shapes)}


def kernel_records(device_name: str) -> list[KernelRecord]:
    """The newest timing per case on one device, as quantcore.kernels.records.KernelRecord objects."""
    from quantcore.kernels.records import KernelRecord

    with session_scope(settings()) as s:  # straight from the rows: a DataFrame would turn a missing time into NaN
        rows = repo.newest_kernel_results(s, device_name=device_name)
    return [KernelRecord.from_dict(r.__dict__) for r in rows]


def measured_ms(model: ModelRecord, records: Iterable[KernelRecord]) -> list[int]:
    """The M values at which ``records`` (one device's kernel timings) timed any of the model's shapes."""
    shapes = set(layer_shapes(model).values())
    return sorted({r.m for r in records if (r.n, r.k) in shapes})


def bench_shape_count(model: ModelRecord, tp: int = 1, expert_parallel: bool = False) -> int:
    """How many distinct (N, K) GEMM shapes a benchmark of ``model`` times (quantcore.kernels.paths.bench_shapes, as the
    bench job counts them): its layers' own, or each GPU's share of them split over ``tp`` GPUs."""
    from quantcore.kernels.paths import bench_shapes
    from quantcore.models.parallel import Parallelism

    heads = attention_heads(model) if tp > 1 else None
    return len(bench_shapes(layer_shapes(model), Parallelism(tp, heads, expert_parallel)))


def target_of_device(device_name: str) -> str | None:
    """The target-table key of a measured device (a GPU of the table), else None (a CPU, an unlisted GPU)."""
    from quantcore.kernels.hardware import match_target

    return match_target(device_name)


def measured_device_for(target: str) -> str | None:
    """A device with stored kernel timings that is the target GPU, if any."""
    return next((name for _kind, name, _torch in kernel_devices() if target_of_device(name) == target), None)
