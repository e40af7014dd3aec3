"""The bench job: time the real GEMMs of the model's linear shapes on this worker's device (with
``tensor_parallel`` > 1, each GPU's share of every layer: quantcore.models.parallel).

Results are stored per (device name, torch version, M, N, K, path) and reused: asking the same device again
measures only what is missing (unless the job says ``force``), what failed, what was skipped for time under a
smaller budget per case (per shape, over its M values x paths) than asked now, what was stored with a native flag
that the device's probe no longer gives, what was timed another way (quantcore.kernels.records.TIMING), or what was
flagged ``unstable`` (its timed calls spread too widely: quantcore.kernels.records.reusable_records).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy.orm import Session

from jobs.specs import BenchSpec
from store import repo
from store.db import session_scope
from worker.bodies.shared import model_record, resolve_device
from worker.runner import JobContext, Outcome

# SmolLM2-135M's linear shapes (N, K): q/o 576×576, k/v 192×576, gate/up 1536×576, down 576×1536
DEFAULT_SHAPES = ((576, 576), (192, 576), (1536, 576), (576, 1536))


def bench(ctx: JobContext) -> Outcome:
    """Benchmark the job's model's shapes (:data:`DEFAULT_SHAPES` without a model) as
    :class:`jobs.specs.BenchSpec` asks; the new records are stored with the job, the reused ones listed."""
    from quantcore.kernels.bench import run_benchmarks
    from quantcore.kernels.device import device_paths, probe_device
    from quantcore.kernels.paths import base_path, bench_paths, bench_shapes
    from quantcore.kernels.records import TIMING, cases_per_shape, duration_bound, reusable_records
    from quantcore.models.routing import bench_ms, routed_layers

    asked = BenchSpec.from_params(ctx.params)
    device = resolve_device(asked.device)
    info = probe_device(device)
    ms = list(asked.ms)
    tp = asked.tensor_parallel
    if ctx.model_id is not None:
        from pathlib import Path

        from quantcore.models.parallel import Parallelism, stored_heads

        rec = model_record(ctx)
        # split over tp GPUs, each runs its share of every layer: those are the GEMMs to time
        heads = stored_heads(rec.attention_heads, Path(str(ctx.settings.artifact_dir)) / rec.path) if tp > 1 else None
        par = Parallelism(tp, heads, asked.expert_parallel)
        shapes = bench_shapes({lin["name"]: (lin["out_features"], lin["in_features"]) for lin in rec.linears}, par)
        # an MoE model's experts run on a share of each step's tokens: time that M too (quantcore.models.routing)
        ms = bench_ms(ms, routed_layers([lin["name"] for lin in rec.linears], rec.moe))
    elif tp > 1:
        raise ValueError("a benchmark split over several GPUs needs a model: its layers say how they split")
    else:
        shapes = list(DEFAULT_SHAPES)
    wanted_paths = list(asked.paths) if asked.paths else None

    support = device_paths(info)  # what runs natively here: stored with the job, shown beside its timings
    budget = asked.budget_s
    reused: list[dict[str, Any]] = []
    todo = shapes
    if not asked.force:
        # a failure is measured again, and so is a case skipped for time under a smaller budget per case than this
        # job's (its budget per shape over the M values x paths it times)
        with session_scope(ctx.settings) as s:
            stored = reusable_records(
                repo.kernel_results(s, device_name=info.name, torch_version=info.torch_version), budget_s=budget,
                cases=cases_per_shape(asked.m, wanted_paths), job_runs=lambda ids: repo.params_and_results(s, ids))
        # a record whose native flag is not what this worker's probe says now (quantplan's rules for the
        # device changed, e.g. INT8 on a VNNI CPU) is measured again, so the Kernels page shows the new flag
        native = {path: sup.native for path, sup in support.items()}
        # and one timed otherwise (a CPU's caches left warm between calls, before TIMING 1) is measured again
        newest = {(r.m, r.n, r.k, r.path): {**r.__dict__} for r in stored
                  if r.native == native.get(base_path(r.path), r.native) and r.timing == TIMING}
        todo = []
        timed = bench_paths(wanted_paths)  # the baseline too: the records of a reused shape carry it
        for n, k in shapes:
            have = [newest.get((m, n, k, path)) for m in ms for path in timed]
            if all(h is not None for h in have):
                reused.extend(h for h in have if h is not None)
            else:
                todo.append((n, k))
    if todo:
        ctx.progress(0.02, f"{info.name}: {len(todo)} shapes to measure ({duration_bound(len(todo), budget)}), "
                           f"{len(shapes) - len(todo)} stored")
    else:
        ctx.progress(0.02, f"{info.name}: all {len(shapes)} shapes stored")
    records = run_benchmarks(todo, ms, device=device, paths=wanted_paths, budget_s_per_shape=budget,
                             progress=_counted(lambda f, m: ctx.progress(0.02 + 0.97 * f, m)),
                             should_cancel=ctx.should_cancel) if todo else []
    new = [r.to_dict() for r in records]
    for r in reused:
        r.pop("job_id", None)
    all_records = sorted(new + reused, key=lambda r: (r["n"], r["k"], r["m"], r["path"]))
    result = {"device": info.to_dict(), "paths": [sup.to_dict() for sup in support.values()],
              "measured": len(new), "reused": len(reused), "records": all_records,
              "budget_s": budget}  # a later job reuses what this one skipped for time when its budget is no larger

    def write(s: Session) -> None:
        repo.save_kernel_results(s, job_id=ctx.job_id, records=new)

    return Outcome(result=result, write=write,
                   message=f"{len(new)} cases measured, {len(reused)} reused on {info.name}")


def _counted(progress: Callable[[float, str], None]) -> Callable[[float, str], None]:
    """``progress`` with each GEMM case counted: run_benchmarks reports (cases done / cases, "N=… K=… M=… path")
    as each case starts, so the k-th report's case is k of done / fraction; the message says "GEMM case k of n: …",
    a count the runner times (jobs.progress)."""
    started = [0]

    def report(fraction: float, message: str) -> None:
        started[0] += 1
        done = started[0] - 1
        if 0.0 < fraction < 1.0 and done:
            message = f"GEMM case {started[0]} of {round(done / fraction)}: {message}"
        progress(fraction, message)

    return report
