"""The app's service layer: everything a page does goes through here (no SQL, no maths in pages).

Torch-free by design: jobs are sent to workers by task name (worker.client), and the
statistics come back from the store as numpy arrays.
"""

from __future__ import annotations

import datetime as dt
import shutil
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from quantcore.evaluation.stats import LayerStats
from quantcore.kernels.bench import SKIP_FAILED, SKIP_OVER_BUDGET
from store import cache, repo
from store.datasets import add_text_file
from store.db import check_schema_current, session_scope
from store.records import DatasetRecord, JobRecord, ModelRecord, PlanRecord, ScoreRecord, SensitivityRecord
from store.settings import Settings, get_settings
from worker.client import submit_job

UPLOAD_SUFFIXES = (".zip", ".tar.gz", ".tgz", ".tar", ".gguf")
MIB = 2**20


def settings() -> Settings:
    return get_settings()


def schema_problem() -> str | None:
    """None when the database is ready, else the message that says how to fix it."""
    try:
        check_schema_current(settings())
    except Exception as exc:
        return str(exc)
    return None


# ----------------------------------------------------------------------------- models


def list_models() -> list[ModelRecord]:
    with session_scope(settings()) as s:
        return repo.list_models(s)


def get_model(ref: int | str) -> ModelRecord:
    with session_scope(settings()) as s:
        return repo.get_model(s, ref)


def model_usage(model_id: int) -> dict[str, int]:
    """Counts of what is stored about a model (see store.repo.model_usage)."""
    with session_scope(settings()) as s:
        return repo.model_usage(s, model_id)


def remove_model(ref: int | str) -> ModelRecord:
    """Delete a model, everything measured on it and its files; return what was removed.

    Its calibrations, scores, sensitivity sweeps and plan versions go with the row; its jobs stay in the
    history, naming it (store.repo.delete_model); kernel timings (per device, not per model) stay. The checkpoint folder and its
    cached reference log-probs are deleted after the rows are gone, so a failure leaves stray files,
    never rows that point at missing ones. Refused while one of its jobs is queued or running.
    """
    s = settings()
    with session_scope(s) as db:
        rec = repo.get_model(db, ref)
        _refuse_while_active(db, rec, "cancel them or let them finish, then remove it")
        repo.delete_model(db, rec.id)
    artifacts = Path(str(s.artifact_dir)).resolve()
    for folder in (artifacts / rec.path, s.model_reference_dir(rec.sha256)):
        folder = folder.resolve()
        # only ever below the artifact folder, and never the folder itself (a damaged row cannot aim higher)
        if folder != artifacts and artifacts in folder.parents:
            shutil.rmtree(folder, ignore_errors=True)
    return rec


def _refuse_while_active(db, rec: ModelRecord, what_then: str) -> None:
    """ValueError naming the model's queued and running jobs, if any, then ``what_then``."""
    active = repo.list_jobs(db, model_id=rec.id, status=("queued", "running"))
    if active:
        ids = ", ".join(f"#{j.id} {j.kind}" for j in active)
        raise ValueError(f"{rec.name} has jobs queued or running ({ids}): {what_then}")


def cached_files(model: ModelRecord) -> dict[str, tuple[int, int]]:
    """{kind: (files, bytes)} of what jobs keep beside the model to skip work next time (store.cache.KINDS: the
    unquantized model's log-probs per evaluation text, AWQ's searched scales, GPTQ's rounded weights, the K/V
    maxima calibrated KV cache scales come from), every kind listed, (0, 0) where none is kept. None of it is a
    result: :func:`clear_cached_files` costs only recomputing."""
    return cache.kept_files(settings().model_reference_dir(model.sha256))


def cached_bytes(model: ModelRecord | None = None) -> int:
    """The bytes of every file jobs keep beside the model (:func:`cached_files`); of every model's without one,
    which workers keep under ``cache_max_gib`` (store.cache.trim)."""
    s = settings()
    return cache.kept_bytes(s.model_reference_dir(model.sha256) if model is not None else s.reference_root)


def cache_limit_note() -> str:
    """All models' cached files against QUANTPLAN_CACHE_MAX_GIB, in a sentence (the Models page, ``models cache``)."""
    limit = settings().cache_max_gib
    return (f"All models' cached files: {cached_bytes() / 2**20:,.1f} MiB"
            + (f" of {limit:g} GiB (QUANTPLAN_CACHE_MAX_GIB); past it, each worker deletes the least recently "
               "used after its score and sensitivity jobs, by the limit set where it runs." if limit > 0
               else " (no limit here: QUANTPLAN_CACHE_MAX_GIB=0; each worker applies the limit set where it runs)."))


def clear_cached_files(ref: int | str) -> int:
    """Delete what jobs keep beside a model (:func:`cached_files`); the bytes freed. Refused while one of its jobs
    is queued or running (it may be reading them); its results and checkpoint stay."""
    s = settings()
    with session_scope(s) as db:
        rec = repo.get_model(db, ref)
        _refuse_while_active(db, rec, "they may read its cached files; let them finish, then clear them")
    freed = cached_bytes(rec)
    folder = s.model_reference_dir(rec.sha256)
    if folder.is_dir():
        try:
            shutil.rmtree(folder)
        except FileNotFoundError:  # a worker's cache trim took a file meanwhile: the rest goes all the same
            shutil.rmtree(folder, ignore_errors=True)
        if folder.exists():
            raise ValueError(f"could not delete every cached file of {rec.name} under {folder}")
    return freed


def register_demo() -> JobRecord:
    return submit_job("register", {"demo": True, "user": settings().user}, settings=settings())


def register_path(path: str, name: str | None = None) -> JobRecord:
    """Register a checkpoint already on storage the workers can read (shared storage)."""
    p = Path(path).expanduser()
    if not p.is_absolute():
        raise ValueError("give an absolute path that the workers can read")
    if not p.exists():
        raise ValueError(f"{p} does not exist (on the app's machine)")
    return submit_job("register", {"source": str(p), "name": name or None, "user": settings().user},
                      settings=settings())


def register_upload(filename: str, data: bytes, name: str | None = None) -> JobRecord:
    """Stage an uploaded archive / GGUF under artifact_dir/uploads and queue its registration.
    The worker validates it and deletes the staged copy whatever the outcome."""
    s = settings()
    safe = Path(filename).name
    if not safe.lower().endswith(UPLOAD_SUFFIXES):
        from quantcore.models.checkpoint import PICKLE_SUFFIXES

        if safe.lower().endswith(PICKLE_SUFFIXES):
            raise ValueError(f"{safe} is a pickle checkpoint; quantplan never unpickles uploads. "
                             "Save the model with save_pretrained(safe_serialization=True) and upload a "
                             ".zip/.tar.gz of the folder.")
        raise ValueError(f"{safe}: upload a .zip or .tar.gz of a Hugging Face folder, or a .gguf file")
    if len(data) > s.upload_limit_bytes:
        raise ValueError(f"{safe} is {len(data) / MIB:.0f} MiB, over the {s.upload_limit_mb} MiB limit")
    if (kind := _upload_kind_mismatch(safe, data)) is not None:  # at once, rather than after the queue ahead of it
        raise ValueError(f"{safe} is not a {kind} (its first bytes say otherwise): nothing was queued. Upload a "
                         ".zip or .tar.gz of a Hugging Face folder, or a .gguf file")
    staging = Path(str(s.artifact_dir)) / "uploads" / uuid.uuid4().hex
    staging.mkdir(parents=True)
    try:
        (staging / safe).write_bytes(data)
        return submit_job("register", {"source": str(staging / safe), "source_name": safe, "name": name or None,
                                       "cleanup_dir": str(staging), "user": s.user}, settings=s)
    except Exception:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _upload_kind_mismatch(filename: str, data: bytes) -> str | None:
    """The kind of file ``filename``'s suffix promises where its bytes are not one ("zip archive", "tar archive",
    "GGUF file"); None where they are. Only the signature is read: the worker validates the whole file."""
    import io
    import tarfile
    import zipfile

    lower = filename.lower()
    if lower.endswith(".zip"):
        return None if zipfile.is_zipfile(io.BytesIO(data)) else "zip archive"
    if lower.endswith(".gguf"):
        return None if data[:4] == b"GGUF" else "GGUF file"
    try:  # .tar, .tar.gz, .tgz: tarfile reads the compression itself
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            tar.next()
        return None
    except (tarfile.TarError, OSError, EOFError):
        return "tar archive"


# ----------------------------------------------------------------------------- datasets


def list_datasets() -> list[DatasetRecord]:
    with session_scope(settings()) as s:
        return repo.list_datasets(s)


def datasets_for(role: str) -> list[DatasetRecord]:
    """The stored texts a job may read in ``role`` (calibration or evaluation): those uploaded for it or for any."""
    return [d for d in list_datasets() if d.role in (role, "any")]


def upload_dataset(filename: str, data: bytes, role: str) -> DatasetRecord:
    s = settings()
    tmp = Path(str(s.data_dir)) / "incoming" / uuid.uuid4().hex
    tmp.mkdir(parents=True)
    try:
        path = tmp / Path(filename).name
        path.write_bytes(data)
        return add_text_file(path, role=role, settings=s)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------- jobs


def list_jobs(limit: int = 100, kind: str | Sequence[str] | None = None, model_id: int | None = None,
              status: Sequence[str] | None = None, offset: int = 0) -> list[JobRecord]:
    with session_scope(settings()) as s:
        return repo.list_jobs(s, limit=limit, kind=kind, model_id=model_id, status=status, offset=offset)


def count_jobs(kind: str | Sequence[str] | None = None, status: Sequence[str] | None = None) -> int:
    with session_scope(settings()) as s:
        return repo.count_jobs(s, kind=kind, status=status)


def get_job(job_id: int) -> JobRecord:
    with session_scope(settings()) as s:
        return repo.get_job(s, job_id)


def cancel_job(job_id: int) -> JobRecord:
    with session_scope(settings()) as s:
        return repo.request_cancel(s, job_id)


def retry_refusal(job: JobRecord) -> str | None:
    """Why ``job`` cannot be queued again (:func:`retry_job`), or None where it can: the Jobs page offers no button
    that could only answer with this."""
    if job.status not in ("failed", "cancelled"):
        return f"job #{job.id} is {job.status}: only a failed or cancelled job is queued again"
    if job.kind == "register" and job.params.get("cleanup_dir"):
        return f"job #{job.id} registered an upload whose staged copy is gone: upload the file again"
    removed = job.params.get(repo.REMOVED_MODEL_KEY)
    if removed or (job.kind in ("calibrate", "score", "sensitivity") and job.model_id is None):
        which = f"model {removed}" if removed else "model"
        return f"job #{job.id}'s {which} was removed: there is nothing to run it on"
    if job.kind == "score" and "scheme" not in job.params and job.plan_id is None:
        return f"job #{job.id} scored a plan that was removed"
    return None


def retry_job(job_id: int) -> JobRecord:
    """Queue a failed or cancelled job again: same kind, parameters, model and plan, asked by this user.

    Refused, with the reason, for a job still queued / running / done, an upload whose staged copy is
    gone, and a job whose model or plan was removed since."""
    job = get_job(job_id)
    if refusal := retry_refusal(job):
        raise ValueError(refusal)
    params = {k: v for k, v in job.params.items() if k != "user"}  # submit() adds the current user
    return submit(job.kind, params, model_id=job.model_id, plan_id=job.plan_id)


def live_workers():
    from worker import presence

    return presence.live_workers(settings())


def idle_queues(queues) -> list[str]:
    """Queues among ``queues`` that no live worker consumes."""
    from worker import presence

    return presence.idle_queues(queues, settings())


def all_workers():
    with session_scope(settings()) as s:
        return repo.list_workers(s)


def no_worker_note(queue: str) -> str | None:
    """A warning when no live worker consumes ``queue`` (the job would wait), else None."""
    from worker import presence

    return presence.no_worker_note(queue, settings())


def silent_note(job: JobRecord, now: dt.datetime | None = None) -> str | None:
    """A warning for a running job that missed two heartbeats (its worker may have died), else None."""
    silent = job.silent_seconds(now)
    if silent is None or silent < 2 * repo.JOB_HEARTBEAT_S:
        return None
    return (f"No heartbeat from {job.worker_host or 'its worker'} for {silent:.0f} s (a running job sends one every "
            f"{repo.JOB_HEARTBEAT_S:.0f} s): its worker may have stopped. The job is marked failed after "
            f"{settings().heartbeat_stale_s} s without one; queue it again then.")


def sweep_stale() -> list[int]:
    s = settings()
    with session_scope(s) as session:
        return repo.sweep_stale_jobs(session, stale_after_s=s.heartbeat_stale_s)


def submit(kind: str, params: dict[str, Any], *, model_id: int | None = None,
           plan_id: int | None = None) -> JobRecord:
    return submit_job(kind, {**params, "user": settings().user}, model_id=model_id, plan_id=plan_id,
                      settings=settings())


def submit_calibration(model_id: int, *, samples: int, seq_len: int, device: str,
                       dataset_id: int | None = None) -> JobRecord:
    params: dict[str, Any] = {"samples": samples, "seq_len": seq_len, "device": device}
    if dataset_id is not None:
        params["dataset"] = dataset_id
    return submit("calibrate", params, model_id=model_id)


# ----------------------------------------------------------------------------- statistics


def calibrations(model_id: int) -> list[JobRecord]:
    with session_scope(settings()) as s:
        return repo.calibrations(s, model_id)


def layer_stats(job_id: int) -> list[LayerStats]:
    with session_scope(settings()) as s:
        return repo.load_activation_stats(s, job_id)


# ----------------------------------------------------------------------------- plans and results


def list_plans(model_id: int | None = None) -> list[PlanRecord]:
    with session_scope(settings()) as s:
        return repo.list_plans(s, model_id)


def save_plan(model_id: int, name: str, body: dict[str, Any], note: str = "",
              parent_id: int | None = None) -> PlanRecord:
    if not name.strip():
        raise ValueError("a plan needs a name: its versions are saved, listed and exported under it")
    with session_scope(settings()) as s:
        return repo.save_plan(s, model_id=model_id, name=name, body=body, user=settings().user, note=note,
                              parent_id=parent_id)


def new_plan_body(model: ModelRecord, default: str) -> dict[str, Any]:
    """A new plan of ``default`` on every layer, lm_head (where the model has one: not an encoder) kept in BF16."""
    head = [{"match": "lm_head", "scheme": "BF16"}] if "lm_head" in layer_names(model) else []
    return {"model": model.name, "default": default, "rules": head}


def unchanged_version(model_id: int, name: str, body: dict[str, Any]) -> PlanRecord | None:
    """The newest version of plan ``name`` when its body is ``body`` already: saving it again would only repeat it."""
    versions = [p for p in list_plans(model_id) if p.name == name]
    return versions[-1] if versions and versions[-1].body == body else None


def save_layer_alpha(model: ModelRecord, plan_name: str, layer: str, alpha: float,
                     base: PlanRecord | None) -> PlanRecord:
    """A new version of plan_name with this SmoothQuant alpha for `layer` and its fusion group
    (layers fused at serving time share one input, so they must share the smoothing)."""
    from quantcore.planning.plans import PlanSpec
    from quantcore.schemes.specs import fusion_group_of

    names = layer_names(model)
    # a new plan that can carry the alpha: INT8 with dynamic per-token activations
    spec = PlanSpec.from_dict(base.body if base else {**new_plan_body(model, "INT8_W8A8"), "name": plan_name})
    for member in fusion_group_of(layer, names) or [layer]:
        spec.layer_alpha[member] = float(alpha)
    body = spec.to_dict()
    _, problem = resolve(model, body)
    if problem:  # e.g. the layer's scheme quantizes no activations: nothing to smooth, and no plan to save
        raise ValueError(problem)
    return save_plan(model.id, plan_name, body, note=f"alpha {alpha:.2f} for {layer}",
                     parent_id=base.id if base else None)


def get_plan(ref: int | str) -> PlanRecord:
    with session_scope(settings()) as s:
        return repo.get_plan(s, ref)


def list_scores(model_id: int | None = None) -> list[ScoreRecord]:
    with session_scope(settings()) as s:
        return repo.list_scores(s, model_id)


def sensitivity_jobs(model_id: int) -> list[JobRecord]:
    with session_scope(settings()) as s:
        return repo.sensitivity_jobs(s, model_id)


def sensitivity_rows(job_id: int) -> list[SensitivityRecord]:
    with session_scope(settings()) as s:
        return repo.list_sensitivity(s, job_id)


def kernel_devices() -> list[tuple[str, str, str]]:
    with session_scope(settings()) as s:
        return repo.kernel_devices(s)


# ----------------------------------------------------------------------------- kernels


def device_probe(device_name: str) -> dict[str, Any] | None:
    """The device a benchmark measured, as its newest job found it (store.repo.device_probe)."""
    with session_scope(settings()) as s:
        return repo.device_probe(s, device_name)


def capability_frame(paths: list[dict[str, Any]]):
    """A stored capability table (PathSupport dicts) as rows for a person: path, verdict, why."""
    import pandas as pd

    from quantcore.kernels.hardware import PathSupport

    rows = [PathSupport(**p) for p in paths]
    return pd.DataFrame([{"path": r.path, "here": r.status, "why": r.why} for r in rows],
                        columns=["path", "here", "why"])


def timed_otherwise(frame) -> int:
    """How many timings of a :func:`kernel_frame` were taken otherwise than quantplan times now
    (quantcore.kernels.bench.TIMING: before a CPU's caches were flushed between calls); a benchmark measures them again."""
    from quantcore.kernels.bench import TIMING

    return int((frame["timing"] != TIMING).sum()) if "timing" in frame else 0


def kernel_frame(device_name: str, torch_version: str | None = None):
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


def device_comparison(model: ModelRecord, path: str, m: int):
    """One kernel path at one M on every device that timed the model's shapes.

    Columns: shape, device, speedup (NaN where the device does not run the path natively or has
    no time for it), ms. Empty when fewer than two devices have any of the shapes.
    """
    import math

    import pandas as pd

    from quantcore.kernels.bench import has_time

    labels = shape_labels(model)
    rows = []
    with session_scope(settings()) as s:
        for name in sorted({d[1] for d in repo.kernel_devices(s)}):
            for r in repo.newest_kernel_results(s, device_name=name):
                if (r.n, r.k) in labels and r.m == m and r.path == path:
                    timed = has_time(r) and r.speedup is not None and r.native
                    rows.append({"shape": labels[(r.n, r.k)], "device": name, "ms": r.ms,
                                 "speedup": r.speedup if timed else math.nan})
    frame = pd.DataFrame(rows, columns=["shape", "device", "ms", "speedup"])
    return frame if frame["device"].nunique() >= 2 else frame.iloc[0:0]


def _plan_paths(model: ModelRecord, plan_body: dict[str, Any]):
    """(the resolved plan, the kernel path each layer would run on: None for baseline speed / emulated)."""
    from quantcore.kernels.bench import scheme_path
    from quantcore.planning.plans import PlanSpec, resolve_plan

    plan = resolve_plan(PlanSpec.from_dict(plan_body), [lin["name"] for lin in model.linears])
    return plan, {name: scheme_path(scheme) for name, scheme in plan.items()}


def layer_paths(model: ModelRecord, plan_body: dict[str, Any]) -> dict[str, str | None]:
    """The kernel path each layer of a plan would run on (None: baseline speed / emulated)."""
    return _plan_paths(model, plan_body)[1]


def untimed_schemes(model: ModelRecord, plan_body: dict[str, Any], layers: Iterable[str] | None = None
                    ) -> dict[str, int]:
    """{scheme: layers} of a plan's quantized layers (of ``layers`` where given: those a step estimate counts, one
    GPU's under expert parallelism) that no benchmarked kernel serves (quantcore.kernels.bench.scheme_path is None: FP4,
    MX and block scales, E5M2 x E5M2, zero points on a path without them): a step estimate counts them at the
    baseline's time."""
    return _untimed(*_plan_paths(model, plan_body), layers)


def _untimed(plan, paths, layers: Iterable[str] | None) -> dict[str, int]:
    from collections import Counter

    counted = set(plan if layers is None else layers)
    return dict(Counter(s.name for n, s in plan.items() if n in counted and not s.is_identity and paths[n] is None))


def step_estimate(model: ModelRecord, plan_body: dict[str, Any], device_name: str, *, m_prefill: int,
                  m_decode: int) -> dict[str, Any]:
    """Prefill / decode GEMM time of a plan on a device, from the stored kernel timings; at the plan's
    tensor_parallel, one GPU's step: its share of every layer, timed by a benchmark split as the plan is. Adds
    ``untimed``: :func:`untimed_schemes` of the layers it sums."""
    from quantcore.kernels.bench import step_estimate as estimate

    shapes = parallelism(model, plan_body).first_gpu_shapes(layer_shapes(model))  # EP: the experts one GPU holds
    plan, paths = _plan_paths(model, plan_body)
    est = estimate(kernel_records(device_name), shapes, paths, m_prefill=m_prefill, m_decode=m_decode,
                   routed=routed_layers(model))
    return {**est, "untimed": _untimed(plan, paths, shapes)}


def thin_estimate_note(est: dict[str, Any]) -> str | None:
    """A warning when a step estimate rests on fewer than half the plan's layers (for the step missing most), yet on
    some: its sums and speed-ups are then those few layers', not the plan's. None otherwise (none measured: the
    metrics say "not measured" themselves)."""
    n = len(est["per_layer"])
    worst = max(len(est["missing_prefill"]), len(est["missing_decode"]))
    if not n or worst == n or 2 * worst <= n:
        return None
    return (f"Only {n - worst} of this plan's {n} layers have a time for their path at these M values: the step "
            "times and speed-ups above are of those layers alone, not of the plan. Benchmark the paths it uses "
            "(named below) before reading them as the plan's.")


def missing_times_note(est: dict[str, Any], plan_tp: int = 1) -> str:
    """What a step estimate leaves out (layers with no time for their path at its M values), named, and what to do
    about each: a case skipped over the time budget wants a larger budget, not the same benchmark again; a path the
    device does not run, or that failed at that shape, says why; a case never measured wants a benchmark."""
    from quantcore.errors import name_list

    missing = list(dict.fromkeys([*est["missing_prefill"], *est["missing_decode"]]))
    why = {**est.get("skipped_prefill", {}), **est.get("skipped_decode", {})}
    over = [n for n in missing if why.get(n, "").startswith(SKIP_OVER_BUDGET)]
    cannot = [n for n in missing if n in why and n not in over]
    unmeasured = [n for n in missing if n not in why]
    gpus = f" on {plan_tp} GPUs" if plan_tp > 1 else ""
    parts = []
    if over:
        parts.append(f"{name_list(over, 3)} skipped over the time budget per shape: queue the benchmark again with a "
                     "larger budget to time them")
    if cannot:
        reasons = list(dict.fromkeys(why[n] for n in cannot))
        parts.append(f"{name_list(cannot, 3)} with no time on this device ({'; '.join(reasons[:2])}"
                     + (f"; and {len(reasons) - 2} more reasons" if len(reasons) > 2 else "") + ")")
    if unmeasured:  # the M values were asked for other paths, or never: name both
        paths = list(dict.fromkeys(est["per_layer"][n]["path"] for n in unmeasured if n in est["per_layer"]))
        parts.append(f"{name_list(unmeasured, 3)} not measured: queue a benchmark with these M values{gpus}"
                     + (f" and path{'s' if len(paths) > 1 else ''} {', '.join(paths)}" if paths else ""))
    counts = " and ".join(f"{len(est[f'missing_{step}'])} of the {step}'s (M={est.get(f'm_{step}', '?')})"
                          for step in ("prefill", "decode") if est[f"missing_{step}"])
    return (f"Layers with no time for their path: {counts}; the sums and speed-ups above leave them out: "
            + "; ".join(parts) + ".")


def step_breakdown(est: dict[str, Any]):
    """A step estimate's layers summed per projection type and kernel path (one row each).

    Columns: projection, path, layers, prefill_ms, decode_ms (None where a layer of the row lacks a
    time at that M, so a partial sum is never shown as a total).
    """
    import pandas as pd

    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for name, entry in est["per_layer"].items():
        key = (name.rsplit(".", 1)[-1], entry["path"])
        row = rows.setdefault(key, {"projection": key[0], "path": key[1], "layers": 0,
                                    "prefill_ms": 0.0, "decode_ms": 0.0})
        row["layers"] += 1
        for step in ("prefill_ms", "decode_ms"):
            row[step] = None if row[step] is None or entry[step] is None else row[step] + entry[step]
    return pd.DataFrame(list(rows.values()), columns=["projection", "path", "layers", "prefill_ms", "decode_ms"])


def kernel_records(device_name: str):
    """The newest timing per case on one device, as quantcore.kernels.bench.KernelRecord objects."""
    from quantcore.kernels.bench import KernelRecord

    with session_scope(settings()) as s:  # straight from the rows: a DataFrame would turn a missing time into NaN
        rows = repo.newest_kernel_results(s, device_name=device_name)
    return [KernelRecord.from_dict(r.__dict__) for r in rows]


def layer_shapes(model: ModelRecord) -> dict[str, tuple[int, int]]:
    """{layer: (N, K)} of every linear of the model."""
    return {lin["name"]: (lin["out_features"], lin["in_features"]) for lin in model.linears}


def routed_layers(model: ModelRecord):
    """{routed expert linear: quantcore.models.routing.Routing} of an MoE model (empty for a dense one): step times
    count an expert's expected share of a step."""
    from quantcore.models.routing import routed_layers as routed

    return routed(layer_names(model), model.moe)


# ----------------------------------------------------------------------------- scoring


REFERENCE_BYTES_PER_LOGPROB = 2  # quantcore.evaluation.scoring.LOGPROB_DTYPE is float16 (a test keeps the two equal)


def vocab_size(model: ModelRecord) -> int | None:
    """The model's vocabulary: from its config, else the rows of its lm_head; None for an encoder."""
    return model.vocab_size or next((lin["out_features"] for lin in model.linears if lin["name"] == "lm_head"),
                                    None)


def reference_cache_bytes(model: ModelRecord, samples: int, seq_len: int) -> int | None:
    """Disk size of the reference log-probs a score or sweep caches for this evaluation size: every
    predicted position (seq_len - 1 per sequence) times the vocabulary, in float16; None when the
    vocabulary is unknown."""
    vocab = vocab_size(model)
    return None if not vocab else samples * (seq_len - 1) * vocab * REFERENCE_BYTES_PER_LOGPROB


def score_notes(model: ModelRecord, score: ScoreRecord) -> list[str]:
    """What to tell a person about a stored score: what its job noticed, and whether older numerics make it
    incomparable with newer scores (quantcore.schemes.specs.numerics_changes: int weights scored before they moved to
    compressed-tensors' grid, NVFP4 activations before their tensor scale was calibrated, a plan for several GPUs
    scored as if on one)."""
    from quantcore.schemes.specs import NUMERICS, expert_block, numerics_changes

    notes = list(score.notes)
    numerics = int(score.details.get("numerics") or 1)
    if numerics < NUMERICS:
        resolved, _ = resolve(model, score.plan_body)
        if resolved is None:
            notes.append("scored by an older quantplan, whose numerics differ for some schemes: score the plan again "
                         "before comparing it with newer scores")
            return notes
        changed: dict[str, int] = {}
        par = parallelism(model, score.plan_body)
        for layer, scheme in resolved.items():
            for why in numerics_changes(scheme, numerics, expert=expert_block(layer) is not None,
                                        input_shares=par.input_shards(layer)):
                changed[why] = changed.get(why, 0) + 1
        for why, n in changed.items():
            notes.append(f"scored by an older quantplan ({n} layer(s) with {why}): score the plan again before "
                         "comparing it with newer scores")
    return notes


def stale_sweeps(model: ModelRecord) -> dict[int, tuple[str, str]]:
    """{sweep job id: (scheme, why to sweep again)} for the newest sweep of each scheme whose numerics changed since
    the quantplan that made it (quantcore.schemes.specs.numerics_changes; sensitivity jobs record ``numerics``)."""
    from quantcore.schemes.specs import get_scheme, numerics_changes

    out: dict[int, tuple[str, str]] = {}
    seen: set[tuple[str, tuple[int, bool]]] = set()
    for job in sensitivity_jobs(model.id):  # newest first: the sweep the planner reads for each scheme (and GPUs)
        result, name = job.result or {}, sweep_scheme(job)
        if not name or name.startswith(repo.KV_SWEEP_PREFIX) or job.params.get("kv_sweep"):
            continue
        if (name, sweep_parallel(job)) in seen:
            continue
        seen.add((name, sweep_parallel(job)))
        try:
            scheme = get_scheme(name)
        except ValueError:
            continue
        if changes := numerics_changes(scheme, result.get("numerics"), expert=bool(model.moe)):
            out[job.id] = (name, f"the {sweep_label(job)} sweep (job #{job.id}) was made by an older quantplan, with "
                                 f"{'; '.join(changes)}: sweep {sweep_label(job)} again before planning with it")
    return out


def score_frames(scores: list[ScoreRecord]):
    """(KL histogram frame [label, center, share], KL-by-position frame [position, kl, label]) of scores."""
    import numpy as np
    import pandas as pd

    hist_parts, pos_parts = [], []
    occupied = []  # (first, last) bin holding tokens, per score: the x axis spans these, not every stored bin
    for sc in scores:
        label = f"#{sc.job_id} {sc.plan_label}"
        h = sc.details.get("kl_hist") or {}
        edges, counts = np.asarray(h.get("edges", []), float), np.asarray(h.get("counts", []), float)
        if len(edges) == len(counts) + 1 and counts.sum() > 0:
            lo = np.maximum(edges[:-1], 1e-6)
            hi = np.maximum(edges[1:], lo * 1.0001)
            hist_parts.append(pd.DataFrame({"label": label, "center": np.sqrt(lo * hi),
                                            "share": counts / counts.sum(), "bin": np.arange(len(counts))}))
            held = np.flatnonzero(counts)
            occupied.append((held[0], held[-1]))
        for b in sc.details.get("kl_by_position") or []:
            pos_parts.append({"position": (b["bucket_start"] + b["bucket_end"]) / 2, "kl": b["kl_mean"],
                              "label": label})
    hist = pd.DataFrame()
    if hist_parts:  # one bin kept each side of the occupied span (where there is one), so the lines drop to 0
        first, last = min(a for a, _ in occupied) - 1, max(b for _, b in occupied) + 1
        hist = pd.concat(hist_parts, ignore_index=True)
        hist = hist[hist["bin"].between(first, last)].drop(columns="bin").reset_index(drop=True)
    return hist, pd.DataFrame(pos_parts)


def score_sets(scores: list[ScoreRecord]) -> list[tuple[str, int]]:
    """The evaluation sets among ``scores`` as (text, positions scored), the set with most scores first.
    Scores on different sets are not comparable: a trade-off is drawn within one set."""
    from collections import Counter

    return [key for key, _ in Counter((s.dataset, s.tokens) for s in scores).most_common()]


def newest_plan(plans: list[PlanRecord]) -> PlanRecord | None:
    """The plan saved last (any name), which the Results and Kernels pages start on; None without plans."""
    return max(plans, key=lambda p: p.id, default=None)


def default_score_choice(plans: list[PlanRecord], scored_plan_ids: Iterable[int | None],
                         preset: str = "FP8_DYNAMIC") -> str:
    """What the Results page's score form offers before anything is picked: the newest saved plan (the one a
    person just saved on the Plans page) while it has no score, else ``preset``; as the form's option keys
    (``plan:<id>`` / ``preset:<name>``)."""
    newest = newest_plan(plans)
    if newest is not None and newest.id not in set(scored_plan_ids):
        return f"plan:{newest.id}"
    return f"preset:{preset}"


def default_comparison(scores: list[ScoreRecord], n: int = 3) -> list[int]:
    """Job ids of the ``n`` newest scores measured on the same tokens (text and positions) as the newest score
    (``scores`` newest first): what the Results page compares before anything is picked, never scores whose KLs
    are not comparable."""
    if not scores:
        return []
    key = (scores[0].dataset, scores[0].tokens)
    return [s.job_id for s in scores if (s.dataset, s.tokens) == key][:n]


TRADEOFF_COSTS = ("weight_mib", "kv_kib", "serving_gib", "prefill_ms", "decode_ms", "ideal_prefill_ms",
                  "ideal_decode_ms")
TRADEOFF_COLUMNS = ["job", "plan", "kl_mean", "top1_agree", "ppl", "weight_mib", "weight_ratio", "kv_cache", "kv_kib",
                    "serving_gib", "prefill_ms", "decode_ms", "ideal_prefill_ms", "ideal_decode_ms"]


def no_time_notes(ms, skipped) -> list[str]:
    """What a heatmap cell with no time reads instead of "n/a" (which says the device does not run the path):
    "skipped" where the case did not fit the time budget per shape, "failed" where the kernel refused the shape or
    the torch build (quantcore.kernels.bench' ``skipped`` reasons); "" elsewhere."""
    import pandas as pd

    notes = []
    for t, why in zip(ms, skipped, strict=True):
        why = "" if pd.isna(why) else str(why)  # None and NaN alike
        notes.append("" if not pd.isna(t) else "skipped" if why.startswith(SKIP_OVER_BUDGET) else
                     "failed" if why.startswith(SKIP_FAILED) else "")
    return notes


def measured_ms(model: ModelRecord, records) -> list[int]:
    """The M values at which ``records`` (one device's kernel timings) timed any of the model's shapes."""
    shapes = set(layer_shapes(model).values())
    return sorted({r.m for r in records if (r.n, r.k) in shapes})


def tradeoff_frame(model: ModelRecord, scores: list[ScoreRecord], *, device_name: str | None = None,
                   m_prefill: int | None = None, m_decode: int | None = None, target: str | None = None,
                   ideal_m_prefill: int = 2048, ideal_m_decode: int = 1, serve: tuple[int, int] | None = None):
    """What each scored plan costs next to what it loses: the newest score of each plan among ``scores``.

    Columns (:data:`TRADEOFF_COLUMNS`): job, plan, kl_mean, top1_agree, ppl, weight_mib (the plan's
    linear weights, scales included), weight_ratio (share of BF16), kv_cache (the format scored) and kv_kib
    (its KV cache per token, KiB; NaN where the model has no k_proj / v_proj); with ``device_name``
    prefill_ms / decode_ms, the plan's GEMM time of one step at ``m_prefill`` / ``m_decode`` from
    that device's stored timings (NaN unless every layer has one at that M: a partial sum is never
    shown as a cost); with ``target``, ideal_prefill_ms / ideal_decode_ms, the roofline bound of a
    step on that GPU at ``ideal_m_prefill`` / ``ideal_m_decode`` tokens (quantcore.kernels.roofline; NaN for
    a plan with a scheme the target cannot serve at all); with ``serve`` = (sequences, context),
    serving_gib, the GPU memory of serving that many sequences of that many tokens: every weight (the
    plan's linear weights, the other parameters in BF16) plus their KV cache (sliding windows counted).
    Rows sorted by KL, lowest first.
    """
    import math

    import pandas as pd

    from quantcore.evaluation.kvcache import kv_bytes_per_sequence, kv_bytes_per_token
    from quantcore.kernels.bench import scheme_path
    from quantcore.kernels.bench import step_estimate as estimate
    from quantcore.kernels.roofline import step_bound as bound
    from quantcore.planning.plans import kv_label
    from quantcore.planning.plans import plan_footprint as footprint

    newest: dict[tuple[int | None, str], ScoreRecord] = {}
    for sc in sorted(scores, key=lambda s: s.job_id):
        newest[(sc.plan_id, sc.plan_label)] = sc
    records = kernel_records(device_name) if device_name else None
    shapes, routed = layer_shapes(model), routed_layers(model)
    rows = []
    for sc in sorted(newest.values(), key=lambda s: (s.kl_mean, s.job_id)):
        resolved, _ = resolve(model, sc.plan_body)
        skip = kv_skipped(model, sc.plan_body) if resolved is not None else set()
        kv_bytes = kv_bytes_per_token(model.linears, sc.kv_cache, skip=skip)
        row = {"job": sc.job_id, "plan": sc.plan_label, "kl_mean": sc.kl_mean, "top1_agree": sc.top1_agree,
               "ppl": sc.ppl, "weight_mib": math.nan, "weight_ratio": math.nan, "kv_cache": kv_label(sc.plan_body),
               "kv_kib": math.nan if kv_bytes is None else kv_bytes / 1024, "serving_gib": math.nan,
               "prefill_ms": math.nan, "decode_ms": math.nan, "ideal_prefill_ms": math.nan,
               "ideal_decode_ms": math.nan}
        if resolved is not None:  # a plan the model no longer resolves (its layers changed): no cost, still listed
            fp = footprint(resolved, shapes)
            row.update(weight_mib=fp.bits / 8 / MIB, weight_ratio=fp.ratio)
            if serve is not None:
                seq = kv_bytes_per_sequence(model.linears, sc.kv_cache, serve[1], windows=model.attention_windows,
                                            skip=skip)
                if seq is not None:
                    row["serving_gib"] = (served_weight_bytes(model, fp, resolved)[0] + serve[0] * seq) / 2**30
            if target is not None:
                prefill, decode = (bound(resolved, shapes, target, m, routed) for m in (ideal_m_prefill, ideal_m_decode))
                if not decode.unsupported:  # a plan the target cannot serve has no step time there
                    row.update(ideal_prefill_ms=prefill.ms, ideal_decode_ms=decode.ms)
            if records is not None and m_prefill is not None and m_decode is not None:
                est = estimate(records, shapes, {n: scheme_path(s) for n, s in resolved.items()},
                               m_prefill=m_prefill, m_decode=m_decode, routed=routed)
                for step in ("prefill", "decode"):
                    if not est[f"missing_{step}"]:
                        row[f"{step}_ms"] = est[f"{step}_ms"]
        rows.append(row)
    return pd.DataFrame(rows, columns=TRADEOFF_COLUMNS)


def with_front(frame, cost: str):
    """``frame`` (a :func:`tradeoff_frame`) with a ``front`` column: True for the plans no other plan beats
    on both ``cost`` and KL (quantcore.planning.plans.pareto_front); a plan without that cost is never on it."""
    from quantcore.planning.plans import pareto_front

    if cost not in TRADEOFF_COSTS:
        raise ValueError(f"unknown cost {cost!r}; choose from {', '.join(TRADEOFF_COSTS)}")
    points = [(float(c), float(k)) for c, k in zip(frame[cost], frame["kl_mean"], strict=True)]
    return frame.assign(front=pareto_front(points))


def preset_options(model: ModelRecord) -> dict[str, str]:
    from quantcore.schemes.specs import get_scheme, list_schemes

    return {name: f"{name}: {get_scheme(name).describe()}" for name in list_schemes()}


# ----------------------------------------------------------------------------- plan editor


FUSION_REASON = ("q/k/v (and gate/up) of a block read the same input and are fused into one GEMM when "
                 "served, so they share one weight format and one activation scale: a scheme set on one "
                 "of them is set on the whole group. The routed experts of an MoE block are one fused MoE "
                 "layer when served, with one quantization method, so they too share one scheme.")


def layer_names(model: ModelRecord) -> list[str]:
    return [lin["name"] for lin in model.linears]


_RESOLVED: OrderedDict[tuple, tuple[dict | None, str | None]] = OrderedDict()  # newest last
_RESOLVED_LOCK = threading.Lock()
_RESOLVED_KEEP = 32  # a page resolves the plan it shows a dozen times (table, checks, step bounds, cache)


def resolve(model: ModelRecord, body: dict[str, Any]):
    """(resolved {layer: Scheme}, None) or (None, the PlanError message). The last few answers are kept, keyed by
    the model (its row, checkpoint and layers) and the body's content: a page asks the same again and again."""
    import json

    key = (model.id, model.sha256, tuple(layer_names(model)), json.dumps(body, sort_keys=True, default=str))
    with _RESOLVED_LOCK:
        hit = _RESOLVED.get(key)
        if hit is not None:
            _RESOLVED.move_to_end(key)
    if hit is None:
        hit = _resolve(model, body)
        with _RESOLVED_LOCK:
            _RESOLVED[key] = hit
            while len(_RESOLVED) > _RESOLVED_KEEP:
                _RESOLVED.popitem(last=False)
    resolved, problem = hit
    return (dict(resolved) if resolved is not None else None), problem  # a copy: callers may change theirs


def _resolve(model: ModelRecord, body: dict[str, Any]) -> tuple[dict | None, str | None]:
    from quantcore.errors import PlanError
    from quantcore.planning.plans import PlanSpec, resolve_plan

    try:
        spec = PlanSpec.from_dict(body)
    except PlanError as exc:  # a bad serving field: what the layers' schemes would run into is said at once too
        rest = {k: v for k, v in body.items() if k not in SERVING_KEYS}
        try:
            rest_spec = PlanSpec.from_dict(rest)
        except PlanError:  # the file's trouble is elsewhere: said once
            return None, str(exc)
        try:
            resolve_plan(rest_spec, layer_names(model))
        except PlanError as more:
            return None, f"{exc}\n{more}"
        return None, str(exc)
    try:
        resolved = resolve_plan(spec, layer_names(model))
        kv_skipped(model, body)  # layer indices and sliding_window checked against this model
        return resolved, None
    except (PlanError, ValueError) as exc:
        return None, str(exc)


SERVING_KEYS = ("kv_cache", "kv_cache_skip", "tensor_parallel", "expert_parallel")  # a plan's fields beside schemes


def kv_skip_options(model: ModelRecord) -> list[str]:
    """What a plan may keep out of its quantized KV cache: ``sliding_window`` when the model has such layers,
    then every attention layer's decoder index (empty when the cache cannot be counted)."""
    from quantcore.evaluation.kvcache import SKIP_SLIDING, kv_layer_elements, layer_index

    indices = sorted({i for n in kv_layer_elements(model.linears) if (i := layer_index(n)) is not None})
    return ([SKIP_SLIDING] if model.attention_windows else []) + [str(i) for i in indices]


def choose_kv_skip(model: ModelRecord, kv_cache: str, kl_budget: float, context: int) -> dict[str, Any]:
    """The layers to keep in BF16 so that the cache's predicted KL (the newest KV cache sweep of ``kv_cache``:
    the sum of the one-layer KLs left in the format) fits ``kl_budget`` with the least cache for one sequence of
    ``context`` tokens (quantcore.planning.autoplan.choose_kv_skip); sliding-window layers hold only their window, so
    they are the cheap ones at a long context. ValueError without a sweep. Returns the plan's ``kv_cache_skip``
    entries ("sliding_window" when every windowed layer is kept), the predicted KL and the cache bytes of one
    sequence with that choice, in the format everywhere and in BF16."""
    from quantcore.evaluation.kvcache import (
        SKIP_SLIDING,
        get_kv_format,
        kv_sequence_bytes_by_layer,
        layer_index,
    )
    from quantcore.planning.autoplan import choose_kv_skip as choose

    kv = get_kv_format(kv_cache)
    if kv.is_identity:
        raise ValueError("AUTO quantizes nothing: there is no layer to keep out of it; choose a quantized format")
    if context < 1:
        raise ValueError(f"the context must be at least one token, got {context}")
    sweep = kv_sensitivity(model, kv.name)
    if sweep is None:
        raise ValueError(f"no KV cache sweep of {kv.name} for {model.name}: run one first (Results page, or "
                         f"quantplan sensitivity {model.name} --kv-cache {kv.name})")
    job, by_index = sweep
    windows = model.attention_windows
    fmt_bytes = kv_sequence_bytes_by_layer(model.linears, kv, context, windows=windows)
    keep_bytes = kv_sequence_bytes_by_layer(model.linears, "AUTO", context, windows=windows)
    if fmt_bytes is None or keep_bytes is None:
        raise ValueError(f"{model.name} has no separate k_proj / v_proj: its cache cannot be counted per layer")
    layer_kl = {n: by_index[str(layer_index(n))] for n in fmt_bytes if str(layer_index(n)) in by_index}
    choice = choose(layer_kl, fmt_bytes, keep_bytes, kl_budget)
    kept = set(choice.skip)
    sliding = bool(windows) and set(windows) <= kept
    entries = ([SKIP_SLIDING] if sliding else []) + [
        str(layer_index(n)) for n in sorted(kept, key=layer_index) if not (sliding and n in windows)]
    return {"sweep_job": job, "kv_cache": kv.name, "kv_cache_skip": entries, "predicted_kl": choice.predicted_kl,
            "context": context, "sequence_bytes": choice.cache_bytes, "format_sequence_bytes": sum(fmt_bytes.values()),
            "bf16_sequence_bytes": sum(keep_bytes.values())}


def kv_skipped(model: ModelRecord, body: dict[str, Any]) -> set[str]:
    """The attention modules a plan keeps out of its quantized KV cache (``kv_cache_skip``, resolved by
    quantcore.evaluation.kvcache.kv_skip_layers against the model's layers and sliding windows); PlanError for entries
    the model does not have."""
    from quantcore.evaluation.kvcache import kv_layer_elements, kv_skip_layers
    from quantcore.planning.plans import PlanSpec

    spec = PlanSpec.from_dict(body)
    if spec.kv_cache == "AUTO" or not spec.kv_cache_skip:
        return set()
    return kv_skip_layers(spec.kv_cache_skip, kv_layer_elements(model.linears), model.attention_windows)


def resolved_or_raise(model: ModelRecord, body: dict[str, Any]):
    """The resolved plan {layer: Scheme}; ValueError with the plan's problems when it does not resolve."""
    resolved, problem = resolve(model, body)
    if problem:
        raise ValueError(problem)
    return resolved


def with_layer_scheme(model: ModelRecord, body: dict[str, Any], layer: str, scheme: str) -> tuple[dict, list]:
    """The plan body with `scheme` set on `layer` and on every layer that must share it (its fusion group, or
    every routed expert of its MoE block)."""
    from quantcore.schemes.specs import plan_unit_of

    group = plan_unit_of(layer, layer_names(model))
    return with_schemes(model, body, {scheme: group}), group


def with_schemes(model: ModelRecord, body: dict[str, Any], choices: dict[str, list[str]], *,
                 clear_alpha: bool = False) -> dict[str, Any]:
    """The plan body with each scheme of `choices` ({scheme: layers}) set on its layers as per-layer choices, and on
    every layer that must share a scheme with one of them (fusion group, an MoE block's experts); ``clear_alpha``:
    their own SmoothQuant alphas go too (a per-layer alpha would smooth an unsmoothed scheme again)."""
    from quantcore.planning.plans import PlanSpec
    from quantcore.schemes.specs import fusion_units

    spec = PlanSpec.from_dict(body)
    unit_of = {member: unit for unit in fusion_units(layer_names(model)) for member in unit}
    for scheme, layers in choices.items():
        for layer in layers:
            for member in unit_of.get(layer, [layer]):
                spec.layers[member] = scheme
                if clear_alpha:
                    spec.layer_alpha.pop(member, None)
    return spec.to_dict()


def unsmoothed_fixes(model: ModelRecord, body: dict[str, Any]) -> dict[str, list[str]]:
    """{preset without SmoothQuant: layers} for the plan's layers whose SmoothQuant no llm-compressor recipe can
    carry (quantcore.export.targets.smoothquant_unexportable): INT8_W8A8 where INT8_W8A8_SQ was, and so on; {} for a plan that
    does not resolve or has none."""
    from quantcore.export.targets import smoothquant_unexportable
    from quantcore.schemes.specs import list_schemes

    resolved, problem = resolve(model, body)
    if problem:
        return {}
    presets, out = set(list_schemes()), {}
    for layer in smoothquant_unexportable(resolved):
        plain = resolved[layer].name.replace("_SQ", "", 1)
        if plain in presets and plain != resolved[layer].name:
            out.setdefault(plain, []).append(layer)
    return out


def regroup_fixes(model: ModelRecord, body: dict[str, Any]) -> dict[str, list[str]]:
    """{preset: layers} that mends the plan's groups that do not divide a layer's K (or each GPU's share of it at the
    plan's tensor_parallel): quantcore.planning.plans.regroup_fixes; {} for a plan that does not resolve."""
    from quantcore.planning.plans import regroup_fixes as fixes

    resolved, problem = resolve(model, body)
    if problem:
        return {}
    return fixes(resolved, layer_shapes(model), parallelism(model, body))


def support_reasons(schemes: Iterable[str], target: str | None) -> list[str]:
    """Why each scheme of a plan that does not run natively on the target is emulated or unsupported there
    (quantcore.kernels.hardware.support_reason), one line per scheme; none for a CPU target or native schemes."""
    from quantcore.kernels.hardware import support_on_target, support_reason
    from quantcore.schemes.specs import get_scheme

    if not target:
        return []
    out = []
    for name in schemes:
        scheme = get_scheme(str(name))
        if scheme.weights is None:
            continue
        w, a = scheme.weights.format, scheme.activations.format if scheme.activations else None
        if support_on_target(target, w, a) != "native":
            out.append(f"{name}: {support_reason(target, w, a)}")
    return out


def attention_heads(model: ModelRecord):
    """quantcore.models.parallel.AttentionHeads of the model: from its intake summary, or for a model registered before
    that was kept, from the config.json quantplan stored; None where neither says."""
    from quantcore.models.parallel import stored_heads

    return stored_heads(model.attention_heads, Path(str(settings().artifact_dir)) / model.path)


def split_refusals(model: ModelRecord, tp: int, expert_parallel: bool = False) -> list[str]:
    """Why vLLM would refuse to serve ``model`` over ``tp`` GPUs whatever the formats (quantcore.models.parallel.tp_misfits:
    heads, MLP widths); [] where it splits (and at one GPU). Asked before a job is queued for that many GPUs."""
    from quantcore.models.parallel import Parallelism, tp_misfits

    if tp <= 1:
        return []
    return tp_misfits(layer_shapes(model), Parallelism(tp, attention_heads(model), expert_parallel))


def bench_shape_count(model: ModelRecord, tp: int = 1, expert_parallel: bool = False) -> int:
    """How many distinct (N, K) GEMM shapes a benchmark of ``model`` times (quantcore.kernels.bench.bench_shapes, as the
    bench job counts them): its layers' own, or each GPU's share of them split over ``tp`` GPUs."""
    from quantcore.kernels.bench import bench_shapes
    from quantcore.models.parallel import Parallelism

    heads = attention_heads(model) if tp > 1 else None
    return len(bench_shapes(layer_shapes(model), Parallelism(tp, heads, expert_parallel)))


def plan_split_refusals(model: ModelRecord, body: dict[str, Any]) -> list[str]:
    """split_refusals at a plan body's own tensor_parallel / expert_parallel ([] for one GPU or a body that does
    not parse: the job says what is wrong with that)."""
    par = parallelism(model, body)
    return split_refusals(model, par.tp, par.expert_parallel)


def parallelism(model: ModelRecord, body: dict[str, Any]):
    """quantcore.models.parallel.Parallelism of a plan body on the model: its tensor_parallel and expert_parallel, with the
    model's attention heads (one GPU for a body that does not parse)."""
    from quantcore.errors import PlanError
    from quantcore.models.parallel import ONE_GPU
    from quantcore.planning.plans import PlanSpec

    try:
        spec = PlanSpec.from_dict(body)
    except PlanError:
        return ONE_GPU
    return spec.parallelism(attention_heads(model) if spec.tensor_parallel > 1 else None)


REFUSED_PARTIAL = "groups do not divide K"  # quantcore.planning.plans.group_misfits: llm-compressor and vLLM refuse the layer
REFUSED_UNTILED = "N not a multiple of 128"  # quantcore.planning.plans.w4afp8_misfits: vLLM's one W4AFP8 kernel refuses it
REFUSED_BLOCKS = "FP8 blocks do not fit"  # quantcore.planning.plans.fp8_block_misfits: vLLM's validate_fp8_block_shape
REFUSED_KERNEL = "no vLLM kernel"  # quantcore.planning.plans.vllm_unloadable: dynamic per-tensor INT8, unserved MoE experts


def layer_table(model: ModelRecord, body: dict[str, Any], target: str | None):
    """Every linear: name, N, K (and each GPU's share, "N / GPU" and "K / GPU", when the plan's tensor_parallel is
    above 1: quantcore.models.parallel), outlier ratio (newest calibration), the sensitivity KL of the layer's
    own scheme (newest sweep of that scheme; None without one; 0 for a layer left in BF16), scheme, support on the target GPU
    ("refused: ..." where llm-compressor or vLLM would not make or load the layer: "no vLLM kernel",
    quantcore.planning.plans.vllm_unloadable; "groups do not divide K" (or each GPU's K), quantcore.planning.plans.group_misfits;
    "N not a multiple of 128" where vLLM's W4AFP8 kernel cannot tile the fused layer, quantcore.planning.plans.w4afp8_misfits;
    "FP8 blocks do not fit", quantcore.planning.plans.fp8_block_misfits; else the GPU's support, with ", off Marlin tiles" where a
    weight-only layer fits neither of Marlin's thread tiles: quantcore.planning.plans.marlin_misfits)."""
    import pandas as pd

    from quantcore.kernels.hardware import support_on_target
    from quantcore.planning.plans import (
        fp8_block_untileable,
        group_misfit_layers,
        marlin_untiled,
        vllm_unloadable,
        w4afp8_untileable,
    )
    from quantcore.schemes.specs import fusion_units

    resolved, _ = resolve(model, body)
    shapes = layer_shapes(model)
    par = parallelism(model, body)
    shards = par.shards(shapes) if par.split else {}
    ratios: dict[str, float] = {}
    cals = calibrations(model.id)
    if cals:
        with session_scope(settings()) as s:
            ratios = {r["name"]: r["outlier_ratio"] for r in repo.stats_overview(s, cals[0].id)}
    # {scheme: {unit: KL}}: a layer's KL depends on its scheme (and, for a dynamic scale, on the GPU count)
    sens, unit_layers = sensitivity_map(model, par.tp, par.expert_parallel)
    unit_of = {layer: unit for unit, layers in unit_layers.items() for layer in layers}
    shared = {m: len(unit) - 1 for unit in fusion_units(layer_names(model)) for m in unit}
    untileable = w4afp8_untileable(resolved, shapes, par) if resolved and target else set()
    partial = group_misfit_layers(resolved, shapes, par) if resolved and target else set()
    blocks = fp8_block_untileable(resolved, shapes, par) if resolved and target else set()
    no_kernel = set(vllm_unloadable(resolved)) if resolved and target else set()
    off_marlin = ({m for unit, _, _ in marlin_untiled(resolved, shapes, par) for m in unit}
                  if resolved and target else set())
    rows = []
    for lin in model.linears:
        name = lin["name"]
        scheme = resolved[name] if resolved else None
        support = ""
        if scheme is not None and target:
            w = scheme.weights.format if scheme.weights else None
            a = scheme.activations.format if scheme.activations else None
            support = support_on_target(target, w, a)
            # a layer the serving stack would refuse says so first, whatever the GPU's units
            refused = [why for why, hit in ((REFUSED_KERNEL, name in no_kernel), (REFUSED_PARTIAL, name in partial),
                                             (REFUSED_UNTILED, name in untileable), (REFUSED_BLOCKS, name in blocks))
                       if hit]
            if refused:
                support = "refused: " + ", ".join(refused)
            elif name in off_marlin:
                support += ", off Marlin tiles"
        scheme_name = scheme.name if scheme else body.get("default")
        per_gpu = dict(zip(("N / GPU", "K / GPU"), shards[name], strict=True)) if shards else {}
        rows.append({"layer": name, "N": lin["out_features"], "K": lin["in_features"], **per_gpu,
                     "outlier_ratio": ratios.get(name),
                     # a layer left unquantized adds no KL: 0 without a sweep, as the automatic plan counts it
                     "sensitivity_kl": (0.0 if scheme is not None and scheme.is_identity
                                        else sens.get(str(scheme_name), {}).get(unit_of.get(name, name))),
                     "scheme": scheme_name,
                     "alpha": scheme.smoothquant_alpha if scheme else None,
                     "on_target": support, "fused_with": shared.get(name, 0)})
    return pd.DataFrame(rows)


def plan_footprint(model: ModelRecord, body: dict[str, Any]):
    """quantcore.planning.plans.Footprint of a plan body on the model (linear weights, scales included);
    ValueError with the plan's problems when it does not resolve."""
    from quantcore.planning.plans import plan_footprint as footprint

    return footprint(resolved_or_raise(model, body), layer_shapes(model))


def served_weight_bytes(model: ModelRecord, fp, resolved: dict[str, Any]) -> tuple[float, float]:
    """(plan, all-BF16) bytes of every weight a server loads: the linear weights of the plan's Footprint
    ``fp`` as stored, every other parameter (embeddings, norms, biases) in BF16, and the input embedding again
    where the plan quantizes a head tied to it (``resolved``; quantcore.planning.plans.untied_embedding_bits)."""
    from quantcore.planning.plans import untied_embedding_bits

    other = max(0, model.num_params - fp.params) * 2
    untied = untied_embedding_bits(resolved, layer_shapes(model), model.tied_linears) / 8
    return fp.bits / 8 + other + untied, fp.bf16_bits / 8 + other


def kv_memory(model: ModelRecord, body: dict[str, Any], target: str | None = None,
              context: int | None = None) -> dict[str, Any] | None:
    """The plan's KV cache next to BF16: bytes per token (every layer), and with a target GPU how many tokens
    of cache fit beside the weights (quantcore.evaluation.kvcache.kv_token_capacity: vLLM's 90 % memory share,
    activations not counted); with a ``context`` too, the cache of one sequence of that many tokens
    (sliding-window layers keep only their window) and how many such sequences fit. Weights = the plan's
    linear weights + every other parameter in BF16. None when the model has no separate k_proj / v_proj to
    count the cache from."""
    from quantcore.evaluation.kvcache import (
        get_kv_format,
        kv_bytes_per_sequence,
        kv_bytes_per_token,
        kv_token_capacity,
    )
    from quantcore.kernels.hardware import get_target
    from quantcore.models.parallel import kv_copies
    from quantcore.planning.plans import PlanSpec

    kv = get_kv_format(PlanSpec.from_dict(body).kv_cache)
    skip = kv_skipped(model, body)
    per_token = kv_bytes_per_token(model.linears, kv, skip=skip)
    bf16 = kv_bytes_per_token(model.linears, "AUTO")
    if per_token is None or bf16 is None:
        return None
    windows = model.attention_windows
    par = parallelism(model, body)
    copies = kv_copies(par)
    out: dict[str, Any] = {"kv_cache": kv.name, "bytes_per_token": per_token, "bf16_bytes_per_token": bf16,
                           "windowed_layers": len(windows), "windows": sorted(set(windows.values())),
                           "skipped_layers": len(skip), "tensor_parallel": par.tp, "kv_copies": copies}
    if context:
        out.update(context=context,
                   sequence_bytes=kv_bytes_per_sequence(model.linears, kv, context, windows=windows, skip=skip),
                   bf16_sequence_bytes=kv_bytes_per_sequence(model.linears, "AUTO", context, windows=windows))
    if target:
        from quantcore.planning.plans import plan_footprint as footprint

        resolved = resolved_or_raise(model, body)
        weights, bf16_weights = served_weight_bytes(model, footprint(resolved, layer_shapes(model)), resolved)
        # tensor parallelism: the weights spread over tp GPUs' memory; a K/V head copied onto several GPUs
        # (more GPUs than key-value heads) is cached on each
        memory = get_target(target).memory_gb * par.tp
        out.update(target=target, memory_gb=memory, weight_bytes=weights, bf16_weight_bytes=bf16_weights,
                   tokens=kv_token_capacity(memory, weights, per_token * copies),
                   bf16_tokens=kv_token_capacity(memory, bf16_weights, bf16 * copies))
        if context:
            out.update(sequences=kv_token_capacity(memory, weights, out["sequence_bytes"] * copies),
                       bf16_sequences=kv_token_capacity(memory, bf16_weights, out["bf16_sequence_bytes"] * copies))
    return out


def kv_kib_per_token(model: ModelRecord) -> float | None:
    """The model's KV cache per token in BF16 (KiB, every layer); None without separate k_proj / v_proj."""
    from quantcore.evaluation.kvcache import kv_bytes_per_token

    b = kv_bytes_per_token(model.linears, "AUTO")
    return None if b is None else b / 1024


def decode_with_cache(model: ModelRecord, body: dict[str, Any], target: str, batch: int,
                      context: int) -> dict[str, float] | None:
    """The ideal decode step of ``batch`` sequences each holding ``context`` tokens of cache: the linears'
    roofline bound at M = batch plus reading each sequence's cache once (quantcore.kernels.roofline.kv_read_ms;
    sliding-window layers read only their window), for the plan and for all-BF16; at the plan's tensor_parallel,
    one GPU's step: its shard of the layers and its share of the cache. None where the model's
    cache cannot be counted (no k_proj / v_proj)."""
    from quantcore.evaluation.kvcache import kv_bytes_per_sequence
    from quantcore.kernels.roofline import kv_read_ms
    from quantcore.planning.plans import PlanSpec

    kv = PlanSpec.from_dict(body).kv_cache
    seq = kv_bytes_per_sequence(model.linears, kv, context, windows=model.attention_windows,
                                skip=kv_skipped(model, body))
    bf16_seq = kv_bytes_per_sequence(model.linears, "AUTO", context, windows=model.attention_windows)
    if seq is None or bf16_seq is None:
        return None
    from quantcore.models.parallel import kv_copies

    par = parallelism(model, body)
    share = kv_copies(par) / par.tp  # what one GPU of tp caches and reads
    linear, bf16_linear = (step_bound(model, b, target, batch).ms for b in (body, bf16_body(body)))
    kv_ms, bf16_kv_ms = (kv_read_ms(b * share, batch, target) for b in (seq, bf16_seq))
    return {"linear_ms": linear, "kv_ms": kv_ms, "ms": linear + kv_ms, "bf16_linear_ms": bf16_linear,
            "bf16_kv_ms": bf16_kv_ms, "bf16_ms": bf16_linear + bf16_kv_ms}


def target_names() -> dict[str, str]:
    """{target key: GPU name} of the GPUs in quantcore.kernels.hardware's table."""
    from quantcore.kernels.hardware import list_targets

    return {t.key: t.name for t in list_targets()}


def kv_backend_note(kv_cache: str, target: str) -> str | None:
    """Whether the KV format's attention assumption holds on a target GPU (quantcore.evaluation.kvcache.attention_backend_note)."""
    from quantcore.evaluation.kvcache import attention_backend_note
    from quantcore.kernels.hardware import get_target

    gpu = get_target(target)
    return attention_backend_note(kv_cache, gpu.sm, gpu.name)


def target_bandwidth(target: str) -> float:
    """Memory bandwidth of a target GPU in TB/s, from its datasheet."""
    from quantcore.kernels.hardware import get_target

    return get_target(target).memory_tbs


def step_bound(model: ModelRecord, body: dict[str, Any], target: str, m: int):
    """quantcore.kernels.roofline.StepBound of a plan body on a target GPU at ``m`` tokens per step (the ideal
    time where nothing was measured); at the plan's tensor_parallel, one GPU's step over its shard of every layer
    (quantcore.models.parallel; the all-reduces between GPUs not counted). ValueError with the plan's problems when it
    does not resolve."""
    from quantcore.kernels.roofline import step_bound as bound

    resolved = resolved_or_raise(model, body)
    shapes = parallelism(model, body).first_gpu_shapes(layer_shapes(model))  # EP: the experts one GPU holds
    return bound({layer: resolved[layer] for layer in shapes}, shapes, target, m, routed_layers(model))


def bf16_body(body: dict[str, Any]) -> dict[str, Any]:
    """The all-BF16 plan a plan body is compared with: on the plan's GPUs (its tensor_parallel, expert_parallel)."""
    return {"default": "BF16", **{k: body[k] for k in ("tensor_parallel", "expert_parallel") if body.get(k)}}


def mib_text(bits: float) -> str:
    """A size in bits as a person reads it: "128.6 MiB"."""
    return f"{bits / 8 / MIB:,.1f} MiB"


def cost_text(value: float, unit: str) -> str:
    """An automatic plan's cost as a person reads it: weight bits in MiB, times in ms."""
    from quantcore.planning.autoplan import UNIT_BITS

    if unit == UNIT_BITS:
        return f"{mib_text(value)} of weights"
    return f"{value:.4g} {unit}"


def footprint_frame(fp):
    """One row per scheme of a Footprint: layers, weights, MiB, bits per weight, share of the plan's bytes."""
    import pandas as pd

    return pd.DataFrame([{"scheme": r.scheme, "layers": r.layers, "weights (M)": r.params / 1e6,
                          "MiB": r.bits / 8 / MIB, "bits / weight": r.bits_per_weight,
                          "share": r.bits / fp.bits if fp.bits else 0.0} for r in fp.rows])


def plan_diff(model: ModelRecord, a: PlanRecord, b: PlanRecord):
    import pandas as pd

    from quantcore.planning.plans import diff_plans

    ra, err_a = resolve(model, a.body)
    rb, err_b = resolve(model, b.body)
    if err_a or err_b:
        raise ValueError(err_a or err_b)
    return pd.DataFrame(diff_plans(ra, rb), columns=["layer", a.label, b.label])


# ----------------------------------------------------------------------------- automatic plans and export

EXPORT_FORMATS = ("llmcompressor", "compressed-tensors", "vllm")


def _mlp_norm(model: ModelRecord) -> str:
    """The norm in front of the MLP: Gemma has a pre-feedforward norm, Llama-style models reuse
    post_attention_layernorm (the name alone cannot tell them apart)."""
    from quantcore.export.targets import MLP_NORM_LLAMA

    return "pre_feedforward_layernorm" if model.model_type.startswith("gemma") else MLP_NORM_LLAMA


def fmt_params(n: int) -> str:
    """A parameter count as a person reads it: "91.0 K", "134.5 M", "30.53 B"."""
    if n >= 1e9:
        return f"{n / 1e9:.2f} B"
    return f"{n / 1e6:.1f} M" if n >= 1e6 else f"{n / 1e3:.1f} K"


def active_params(model: ModelRecord) -> int | None:
    """Parameters one token runs through: every parameter but the routed experts', plus top_k / experts of
    those; None for a dense model (all of them) or one whose top_k is not known."""
    routed = routed_layers(model)
    if not routed:
        return None
    share = next(iter(routed.values()))
    experts = sum(lin["in_features"] * lin["out_features"] for lin in model.linears if lin["name"] in routed)
    return round(model.num_params - experts * (1 - share.top_k / share.experts))


def moe_text(model: ModelRecord) -> str | None:
    """What a mixture-of-experts model is to quantplan, in a sentence; None for a dense model."""
    moe = model.moe
    if not moe:
        return None
    blocks = len(moe.get("blocks") or [])
    per_token = f", {moe['top_k']} per token" if moe.get("top_k") else " (experts per token not in its config)"
    active = active_params(model)
    if active is not None:
        per_token += f" ({fmt_params(active)} of its {fmt_params(model.num_params)} parameters active per token)"
    return (f"mixture of experts: {blocks} MoE block(s) of {moe['experts']} routed experts{per_token}; each expert's "
            "gate / up / down projection is a linear of its own here, as llm-compressor and vLLM name them, and a "
            "block's experts share one scheme (vLLM's fused MoE layer). Step times count an expert's share of a "
            "step; calibration runs every expert on every token, as llm-compressor's oneshot does")


def unsplit_experts_warning(model: ModelRecord) -> str | None:
    """The fused experts intake could not split (their weights are in no plan); None when there are none."""
    names = model.unsplit_experts
    if not names:
        return None
    return (f"{len(names)} fused experts module(s) ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}) keep "
            "their experts in a layout quantplan does not split into linears (gpt-oss's interleaved gate/up, a "
            "gate function of the model's own): their weights are in no plan, stay in BF16 in every figure here "
            "and are not scored quantized, while llm-compressor may quantize them by its own rules")


def parallel_notes(model: ModelRecord, par) -> list[str]:
    """What the tensor-parallel checks could not see: the model's attention heads (q/k/v are then taken to split
    evenly), layers outside the Llama-style layout (taken whole); and expert parallelism asked of a dense model."""
    from quantcore.models.parallel import unknown_layers

    out = []
    if par.expert_parallel and not routed_layers(model):
        out.append(f"expert_parallel: {model.name} has no routed experts (a dense model), so it changes nothing "
                   "here; vLLM's --enable-expert-parallel is for MoE models: drop it from the plan")
    tp = par.tp
    if tp <= 1:
        return out
    if par.heads is None:
        out.append(f"tensor_parallel {tp}: the model's config does not say how many attention heads it has, so "
                   f"q/k/v are checked as if each split in {tp} evenly; vLLM splits them by heads")
    unknown = unknown_layers(layer_names(model))
    if unknown:
        out.append(f"tensor_parallel {tp}: quantplan does not know how vLLM splits {len(unknown)} layer(s) (e.g. "
                   f"{unknown[0]}), outside the Llama-style q/k/v/o and gate/up/down: they are checked whole")
    return out


def serving_warnings(model: ModelRecord, body: dict[str, Any]) -> list[str]:
    """What serving this plan will run into though it resolves: at the plan's tensor_parallel, what vLLM refuses
    whatever the formats (quantcore.models.parallel.tp_misfits) and what the checks could not see (parallel_notes); groups
    that do not divide K (or each GPU's K)
    (quantcore.planning.plans.group_misfits), W4AFP8 layers vLLM's kernel cannot tile (quantcore.planning.plans.w4afp8_misfits),
    merged block-FP8 layers whose N the blocks do not divide (quantcore.planning.plans.fp8_block_misfits), activations vLLM
    quantizes otherwise than scored or not at all (quantcore.planning.plans.vllm_activation_misfits), SmoothQuant no
    llm-compressor recipe can carry (quantcore.export.targets.smoothquant_unexportable), layers AWQ cannot scale
    (quantcore.planning.plans.awq_unscaled), a quantized lm_head
    (quantcore.planning.plans.quantized_head), fused experts no plan reaches, and an unscaled KV cache that the newest
    calibration's K or V would overflow (quantcore.evaluation.kvcache.kv_clipping)."""
    from quantcore.evaluation.kvcache import kv_clipping
    from quantcore.export.targets import (
        serves_online_fp8,
        smoothquant_unexportable,
        smoothquant_unexportable_message,
    )
    from quantcore.models.parallel import tp_misfits
    from quantcore.planning.plans import (
        PlanSpec,
        awq_unscaled,
        fp8_block_misfits,
        group_misfits,
        marlin_misfits,
        moe_unserved,
        quantized_head,
        vllm_activation_misfits,
        w4afp8_misfits,
    )

    resolved, problem = resolve(model, body)
    if problem:
        return []
    shapes = layer_shapes(model)
    kv = PlanSpec.from_dict(body).kv_cache
    par = parallelism(model, body)
    warnings = (tp_misfits(shapes, par) + parallel_notes(model, par)
                + group_misfits(resolved, shapes, par) + w4afp8_misfits(resolved, shapes, par)
                + marlin_misfits(resolved, shapes, par)
                + fp8_block_misfits(resolved, shapes, par) + awq_unscaled(resolved, shapes)
                + vllm_activation_misfits(resolved, online_fp8=serves_online_fp8(resolved, list(resolved), kv))
                + quantized_head(resolved, shapes, model.tied_linears) + moe_unserved(resolved))
    if unsmoothable := smoothquant_unexportable(resolved):
        warnings.append("No llm-compressor recipe of this plan can be written: "
                        + smoothquant_unexportable_message(unsmoothable))
    if unsplit := unsplit_experts_warning(model):
        warnings.append(unsplit)
    if kv != "AUTO":
        with session_scope(settings()) as s:
            cal = repo.latest_calibration(s, model.id)
        clipping = kv_clipping((cal.result or {}).get("kv_amax") if cal else None, kv)
        if clipping:
            warnings.append(clipping)
    return warnings


def export_plan(model: ModelRecord, body: dict[str, Any], fmt: str, recipe_file: str | None = None) -> str:
    """The plan as an llm-compressor recipe (YAML), a compressed-tensors quantization_config (JSON)
    or the vLLM command line (its compression step reading the recipe from ``recipe_file``, "recipe.yaml" unless
    given: the name the recipe is saved under)."""
    import json

    from quantcore.errors import PlanError
    from quantcore.export import targets as export
    from quantcore.planning.plans import PlanSpec

    resolved, problem = resolve(model, body)
    if problem:
        raise PlanError(problem)
    spec = PlanSpec.from_dict(body)
    kv = spec.kv_cache
    names = layer_names(model)
    if fmt == "llmcompressor":
        return export.to_llmcompressor_recipe(resolved, layer_names=names, mlp_norm=_mlp_norm(model), kv_cache=kv)
    if fmt == "compressed-tensors":
        return json.dumps(export.to_compressed_tensors_config(resolved, layer_names=names, kv_cache=kv),
                          indent=2) + "\n"
    if fmt == "vllm":
        # the folder quantplan stored is a loadable HF checkpoint (a GGUF or an archive upload is not)
        folder = Path(str(settings().artifact_dir)) / model.path
        return (f"# {model.name}: {folder} holds the checkpoint quantplan analysed (safetensors + tokenizer, "
                f"from {model.source_name}); use your own copy or hub id where you serve from elsewhere\n"
                + export.to_vllm_command(resolved, model_path=str(folder), layer_names=names,
                                         compressed_path=_safe_name(model.name) + export.COMPRESSED_SUFFIX,
                                         kv_cache=kv, kv_skip=spec.kv_cache_skip,
                                         tensor_parallel=spec.tensor_parallel,
                                         expert_parallel=spec.expert_parallel,
                                         recipe_path=recipe_file or export.DEFAULT_RECIPE_FILE))
    raise ValueError(f"unknown export format {fmt!r}; valid: {', '.join(EXPORT_FORMATS)}")


def _safe_name(name: str) -> str:
    """A model name as a relative folder name: letters, digits, '.', '_' and '-' only."""
    import re

    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip(".-") or "model"


CONFIG_IMPORT_NOTE = ("a compressed-tensors config holds the formats only: SmoothQuant's α and GPTQ / AWQ rounding "
                      "are steps of the recipe that made the checkpoint, not in its config, so the plan has none of "
                      "them (import the llm-compressor recipe to keep them)")


def import_note(filename: str) -> str | None:
    """What an import of ``filename`` cannot carry over, to say beside it: :data:`CONFIG_IMPORT_NOTE` for a
    compressed-tensors config (.json), None for a plan or a recipe (YAML), which keep everything."""
    return CONFIG_IMPORT_NOTE if filename.lower().endswith(".json") else None


def import_plan(model: ModelRecord, filename: str, text: str, name: str | None = None) -> tuple[PlanRecord, bool]:
    """Import a plan file (YAML, quantplan's format), an llm-compressor recipe (YAML) or a compressed-tensors
    quantization_config / config.json (JSON) as a new plan version of `model`: (the version, True); (the newest
    version of that name, False) when it holds the same plan already."""
    import json

    import yaml

    from quantcore.export import targets as export
    from quantcore.planning.plans import PlanSpec, resolve_plan, spec_from_plan

    names = layer_names(model)
    stem = Path(filename).stem
    if filename.lower().endswith(".json"):
        try:
            cfg = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{filename} is not valid JSON: {exc}") from exc
        spec = spec_from_plan(export.from_compressed_tensors_config(cfg, layer_names=names), model=model.name)
        spec.kv_cache = export.kv_cache_of_config(cfg)
    else:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            from quantcore.planning.plans import yaml_problem

            raise ValueError(f"{filename} is not valid YAML: {yaml_problem(exc)}") from exc
        if not isinstance(data, dict):
            raise ValueError(f"{filename}: expected a YAML mapping (a quantplan plan or an llm-compressor recipe)")
        if {"default", "rules", "layers"} & set(data):
            spec = PlanSpec.from_dict(data)
            resolve_plan(spec, names)  # refuse what does not fit this model, with the reasons
            kv_skipped(model, spec.to_dict())  # its kv_cache_skip too
        else:
            spec = spec_from_plan(export.from_llmcompressor_recipe(text, layer_names=names), model=model.name)
            spec.kv_cache = export.kv_cache_of_recipe(text)
    plan_name = name or spec.name or stem
    spec.name, spec.model = plan_name, model.name
    if same := unchanged_version(model.id, plan_name, spec.to_dict()):  # imported twice: no second, equal version
        return same, False
    return save_plan(model.id, plan_name, spec.to_dict(), note=f"imported from {Path(filename).name}"), True


def sweep_parallel(job: JobRecord) -> tuple[int, bool]:
    """(tensor_parallel, expert_parallel) a sensitivity sweep quantized each unit as served on; (1, False): one
    GPU's, as every sweep before quantplan swept on several."""
    result = job.result or {}
    tp = int(result.get("tensor_parallel") or 1)
    return tp, tp > 1 and bool(result.get("expert_parallel"))


def sweep_scheme(job: JobRecord) -> str:
    """The scheme a sensitivity sweep swept ("KV <format>" for a KV cache sweep; "" where it does not say)."""
    return str((job.result or {}).get("scheme") or job.params.get("scheme") or "")


def sweep_label(job: JobRecord) -> str:
    """"FP8_DYNAMIC", "FP8_DYNAMIC on 3 GPUs", "… on 2 GPUs, experts whole": what a sweep swept, and as on how
    many GPUs."""
    tp, ep = sweep_parallel(job)
    return (sweep_scheme(job) or "?") + (f" on {gpus_label(tp, ep)}" if tp > 1 else "")


def planner_sweeps(model: ModelRecord, tensor_parallel: int = 1, expert_parallel: bool = False) -> list[JobRecord]:
    """The sweeps of linear layers a plan for ``tensor_parallel`` GPUs reads, oldest first (a later one replaces an
    earlier one's units): those made on that many GPUs (as ``expert_parallel``), and for a scheme not swept so, its
    one-GPU sweeps. Those stand in exactly for every scheme but one with a dynamic per-tensor or per-token
    activation scale on a row-parallel layer (o_proj, down_proj), where each GPU's own scale makes the served KL
    lower."""
    at = (tensor_parallel, tensor_parallel > 1 and expert_parallel)
    linear = [j for j in reversed(sensitivity_jobs(model.id))  # oldest first
              if not sweep_scheme(j).startswith(repo.KV_SWEEP_PREFIX)]
    swept_at = schemes_swept_on(linear, *at)
    return [j for j in linear if sweep_parallel(j) == at
            or (sweep_parallel(j) == (1, False) and sweep_scheme(j) not in swept_at)]


def schemes_swept_on(sweeps: list[JobRecord], tensor_parallel: int, expert_parallel: bool = False) -> set[str]:
    """The schemes of those ``sweeps`` made as served on exactly ``tensor_parallel`` GPUs (as ``expert_parallel``):
    of :func:`planner_sweeps`' list for several GPUs, the ones no one-GPU sweep stands in for."""
    at = (tensor_parallel, tensor_parallel > 1 and expert_parallel)
    return {sweep_scheme(j) for j in sweeps if sweep_parallel(j) == at}


def split_scale_schemes(schemes) -> list[str]:
    """Those of ``schemes`` whose activation scale is dynamic over K (per tensor or per token): the ones each GPU
    of a split row-parallel layer scales on its own share, so a one-GPU sweep of them overstates the KL there."""
    from quantcore.schemes.specs import get_scheme

    return sorted({s for s in schemes if get_scheme(s).scaled_per_gpu_share})


def same_on_any_gpus(scheme: str, tensor_parallel: int) -> str | None:
    """Why a sweep of ``scheme`` asked for on ``tensor_parallel`` GPUs is made on one instead (its weights, static
    and group / block scales are the same on any number of GPUs: the sweep would repeat the one-GPU sweep to the last
    digit), or None where the GPUs change its numbers (:func:`split_scale_schemes`) or one GPU was asked for."""
    if tensor_parallel <= 1 or split_scale_schemes([scheme]):
        return None
    return (f"{scheme} has no dynamic activation scale over K, so it quantizes the same on any number of GPUs: swept "
            f"on one GPU, which a plan for {tensor_parallel} reads exactly")


def sensitivity_map(model: ModelRecord, tensor_parallel: int = 1, expert_parallel: bool = False):
    """{scheme: {unit: KL}} and {unit: layers} over the stored sensitivity sweeps of the model's linear layers
    that a plan on ``tensor_parallel`` GPUs reads (:func:`planner_sweeps`; KV cache sweeps, whose units are
    attention layers, are :func:`kv_sensitivity`'s)."""
    from quantcore.planning.autoplan import sensitivity_from_rows

    rows = []
    for job in planner_sweeps(model, tensor_parallel, expert_parallel):
        rows.extend(r for r in sensitivity_rows(job.id) if not r.scheme.startswith(repo.KV_SWEEP_PREFIX))
    return sensitivity_from_rows(rows)


def kv_sensitivity(model: ModelRecord, kv_cache: str) -> tuple[int, dict[str, float]] | None:
    """(job id, {decoder layer index: KL}) of the newest KV cache sweep of that format: the KL with only that
    layer's K and V in the format, the layers a plan's kv_cache_skip is best spent on first; None without one."""
    from quantcore.evaluation.kvcache import layer_index

    for job in sensitivity_jobs(model.id):  # newest first
        if (job.result or {}).get("scheme") == repo.KV_SWEEP_PREFIX + kv_cache:
            return job.id, {str(layer_index(r.unit)): r.kl_mean for r in sensitivity_rows(job.id)}
    return None


def unit_block_proj(layers: list[str]) -> tuple[int | None, str]:
    """(block, projection label) of a sensitivity unit: a fusion group reads "q_proj/k_proj/v_proj", not
    its first member's type; lm_head has no block."""
    from quantcore.evaluation.outliers import parse_layer_name

    parsed = [parse_layer_name(x) for x in layers]
    return parsed[0][0], "/".join(dict.fromkeys(p for _, p in parsed))


def sweep_gpu_counts(model: ModelRecord) -> list[tuple[int, bool]]:
    """The (tensor_parallel, expert_parallel) pairs the model's linear layers were swept as served on, fewest GPUs
    first; (1, False) always (one GPU's sweeps, or none, is where a model starts)."""
    at = {sweep_parallel(j) for j in sensitivity_jobs(model.id)
          if not sweep_scheme(j).startswith(repo.KV_SWEEP_PREFIX)}
    return sorted(at | {(1, False)})


def gpus_label(tensor_parallel: int, expert_parallel: bool = False) -> str:
    """"1 GPU", "3 GPUs", "2 GPUs, experts whole" (as :func:`quantcore.planning.plans.gpus_label` says a plan's)."""
    from quantcore.planning.plans import gpus_label as plan_gpus

    return plan_gpus({"tensor_parallel": tensor_parallel, "expert_parallel": expert_parallel})


def sensitivity_by_scheme(model: ModelRecord, tensor_parallel: int = 1, expert_parallel: bool = False):
    """Frame [scheme, unit, block, proj, kl]: the newest sweep's KL of every unit, for every swept scheme, as a
    plan on ``tensor_parallel`` GPUs reads them (:func:`planner_sweeps`). On several GPUs ``scheme`` names where
    each panel was swept: "FP8_DYNAMIC on 3 GPUs", or "INT8_PER_TENSOR, one GPU's" where a one-GPU sweep stands
    in."""
    import pandas as pd

    at = (tensor_parallel, tensor_parallel > 1 and expert_parallel)
    swept_at = schemes_swept_on(planner_sweeps(model, *at), *at)
    sens, unit_layers = sensitivity_map(model, *at)
    rows = []
    for scheme, kls in sorted(sens.items()):
        label = scheme
        if tensor_parallel > 1:
            label += f" on {gpus_label(*at)}" if scheme in swept_at else ", one GPU's"
        for unit, kl in kls.items():
            block, proj = unit_block_proj(unit_layers.get(unit, [unit]))
            rows.append({"scheme": label, "unit": unit, "block": block, "proj": proj, "kl": kl})
    return pd.DataFrame(rows, columns=["scheme", "unit", "block", "proj", "kl"])


def target_of_device(device_name: str) -> str | None:
    """The target-table key of a measured device (a GPU of the table), else None (a CPU, an unlisted GPU)."""
    from quantcore.kernels.hardware import match_target

    return match_target(device_name)


def measured_device_for(target: str) -> str | None:
    """A device with stored kernel timings that is the target GPU, if any."""
    return next((name for _kind, name, _torch in kernel_devices() if target_of_device(name) == target), None)


AUTO_COSTS = {  # what an automatic plan minimises
    "auto": "measured step time on the target where its kernel timings are stored, else weight memory",
    "bits": "weight memory (stored bits, scales included)",
    "ideal": "ideal (roofline) step time on the target at M tokens",
}


def jobs_what(jobs: Iterable[JobRecord]) -> dict[int, str]:
    """:func:`job_what` of each job by id, the labels of the plans they point at read in one query (a table of jobs
    redrawn every few seconds)."""
    jobs = list(jobs)
    with session_scope(settings()) as s:
        labels = repo.plan_labels(s, {j.plan_id for j in jobs if j.plan_id is not None})
    return {j.id: job_what(j, labels) for j in jobs}


def jobs_model(jobs: Iterable[JobRecord]) -> dict[int, str]:
    """The model each job ran on, by job id: its name, "NAME (removed)" for a model removed since, "" for none."""
    names = {m.id: m.name for m in list_models()}
    out = {}
    for j in jobs:
        removed = j.params.get(repo.REMOVED_MODEL_KEY)
        out[j.id] = names.get(j.model_id) or (f"{removed} (removed)" if removed else "")
    return out


def job_what(job: JobRecord, plan_labels: dict[int, str] | None = None) -> str:
    """What a job works on, in a few words, from its parameters: "FP8_DYNAMIC + KV FP8 · 16 × 256",
    "plan my-plan v3", "INT8_W8A8 sweep", "cuda M 1,16". ``plan_labels``: the labels of plans by id, read already
    (:func:`jobs_what`); a removed plan is '#id'."""
    from quantcore.planning.plans import kv_label

    p = job.params or {}
    parts: list[str] = []
    if job.kind in ("score", "sensitivity"):
        plan_file = p.get("plan") if isinstance(p.get("plan"), dict) else {}
        if job.plan_id is not None and plan_labels is None:
            return jobs_what([job])[job.id]
        label = (plan_labels or {}).get(job.plan_id) or f"#{job.plan_id}"
        what = p.get("scheme") or (f"plan {label}" if job.plan_id else
                                   f"plan {plan_file.get('name') or 'file'}" if plan_file else "")
        kv = p.get("kv_cache") or plan_file.get("kv_cache")
        if kv and kv != "AUTO":
            what += f" + KV {kv_label({'kv_cache': kv, 'kv_cache_skip': plan_file.get('kv_cache_skip')})}"
        if p.get("kv_sweep"):
            what = f"KV {p['kv_sweep']}"
        tp = p.get("tensor_parallel") or plan_file.get("tensor_parallel")  # the job's replaces the plan file's
        ep = p.get("expert_parallel") if p.get("tensor_parallel") else plan_file.get("expert_parallel")
        gpus = f" on {gpus_label(int(tp), bool(ep))}" if str(tp) not in ("None", "1") else ""
        parts.append(what + (" sweep" if job.kind == "sensitivity" else "") + gpus)
    if job.kind == "register":  # which upload or folder, so a failed one is told apart from another
        source = "the demo" if p.get("demo") else (p.get("source_name") or p.get("source") or "")
        parts.append(f"{source} as {p['name']}" if p.get("name") and source else source)
    if job.kind in ("score", "sensitivity", "calibrate") and p.get("samples") and p.get("seq_len"):
        parts.append(f"{p['samples']} × {p['seq_len']}")
    if job.kind == "bench":
        parts.append(" ".join(x for x in (p.get("device") or "", f"M {','.join(map(str, p['m']))}" if p.get("m")
                                          else "") if x))
        if paths := p.get("paths"):  # a chosen subset (all paths when absent)
            parts.append(", ".join(paths) if len(paths) <= 3 else f"{len(paths)} paths")
    return " · ".join(x for x in parts if x)


def kv_alone_score(model: ModelRecord, kv_cache: str) -> ScoreRecord | None:
    """The newest score of a KV cache format on its own: every linear layer unquantized, K and V of every layer in
    ``kv_cache`` (a plan that keeps some layers out of it is not the format alone)."""
    for sc in list_scores(model.id):  # newest first
        if sc.kv_cache != kv_cache or sc.plan_body.get("kv_cache_skip"):
            continue
        resolved, _ = resolve(model, sc.plan_body)
        if resolved is not None and all(s.is_identity for s in resolved.values()):
            return sc
    return None


def auto_plan(model: ModelRecord, *, kl_budget: float, target: str, m: int = 2048,
              candidates: list[str] | None = None, verify: bool = True, device: str = "cpu", cost: str = "auto",
              kv_cache: str = "AUTO", tensor_parallel: int = 1, expert_parallel: bool = False,
              queue_job: Callable[..., JobRecord] | None = None):
    """Choose the cheapest plan under the KL budget from the stored sensitivity sweeps, save it as a plan
    version, and queue a score job that checks the prediction. ``cost`` (:data:`AUTO_COSTS`): the target's
    measured kernel times at M = ``m`` when stored, else weight bits (``"auto"``); weight bits; or the
    roofline bound at ``m`` on the target's datasheet (``"ideal"``). ``kv_cache``: the plan caches K and V in
    that format; its KL, measured alone (:func:`kv_alone_score`), comes off the budget before the linears
    are chosen and is added to their predicted KL. ``tensor_parallel``: the GPUs the plan is served on; a scheme is
    not offered to a layer whose share on one GPU vLLM would refuse (quantcore.models.parallel), and the plan keeps the
    size (and ``expert_parallel``: an MoE model's experts whole, one GPU each). ``queue_job(kind, params, model_id=,
    plan_id=)`` writes the verifying job (default :func:`submit`; the CLI's --local writes one to run itself).
    Returns (AutoPlanResult, PlanRecord, JobRecord | None)."""
    from quantcore.evaluation.kvcache import get_kv_format
    from quantcore.kernels.roofline import cost_from_roofline
    from quantcore.models.parallel import Parallelism
    from quantcore.planning.autoplan import COST_IDEAL, COST_MEASURED, cost_from_kernel_records
    from quantcore.planning.autoplan import auto_plan as solve
    from quantcore.planning.plans import spec_from_plan
    from quantcore.schemes.specs import expert_block

    sens, unit_layers = sensitivity_map(model, tensor_parallel, expert_parallel)
    if not sens:
        raise ValueError(f"{model.name} has no sensitivity sweep yet: run one per candidate scheme first "
                         f"(Results page, or `quantplan sensitivity {model.name} --scheme FP8_DYNAMIC`)")
    if cost not in AUTO_COSTS:
        raise ValueError(f"unknown cost {cost!r}; choose one of: {', '.join(AUTO_COSTS)}")
    kv = get_kv_format(kv_cache).name
    alone = None
    if kv != "AUTO":
        alone = kv_alone_score(model, kv)
        if alone is None:
            raise ValueError(f"the KL of a {kv} KV cache on {model.name} is not known yet: score it alone first "
                             f"(`quantplan score {model.name} --scheme BF16 --kv-cache {kv}`, or preset BF16 with KV "
                             f"cache {kv} on the Results page)")
        if alone.kl_mean >= kl_budget:
            raise ValueError(f"a {kv} KV cache alone costs KL {alone.kl_mean:.4g} on {model.name} (score job "
                             f"#{alone.job_id}), no less than the budget {kl_budget:g}: raise the budget or keep the "
                             "KV cache in AUTO")
    kv_kl = alone.kl_mean if alone is not None else 0.0
    cands = candidates or sorted(set(sens) | {"BF16"})
    shapes = layer_shapes(model)
    parallel = Parallelism(tensor_parallel, attention_heads(model) if tensor_parallel > 1 else None, expert_parallel)
    per_gpu = parallel.shards(shapes)  # what one GPU runs: the time costs are of these shapes
    table, source = None, COST_MEASURED
    device_name = measured_device_for(target) if cost == "auto" else None
    if device_name:
        table = cost_from_kernel_records(kernel_records(device_name), per_gpu, cands, m=m, target=target,
                                         routed=routed_layers(model))
        if not table.get("BF16"):
            table = None
    if cost == "ideal":
        table = cost_from_roofline(sorted(set(cands) | {"BF16"}), per_gpu, target, m, routed_layers(model))
        source = COST_IDEAL
    if table is not None and parallel.split and parallel.expert_parallel:
        # each GPU holds 1 / tp of the experts (quantcore.models.parallel.Parallelism.first_gpu): an expert's time
        # counts on one GPU's step in that share
        table = {s: {layer: ms / tensor_parallel if expert_block(layer) is not None else ms
                     for layer, ms in times.items()} for s, times in table.items()}
    result = solve(layer_names(model), sens, kl_budget=kl_budget - kv_kl, target=target, candidates=cands,
                   cost=table, layer_shapes=shapes, unit_layers=unit_layers, cost_source=source,
                   tied=model.tied_linears, parallel=parallel)
    if not [c for c in cands if c != "BF16" and c not in result.excluded]:  # a plan of BF16 alone answers nothing
        raise ValueError(f"no candidate scheme can be used on {model.name} for {target}: " + "; ".join(
            why for c, why in result.excluded.items() if c != "BF16"))
    result.notes += [f"{c} not used: {why}" for c, why in result.excluded.items() if c != "BF16"]
    if alone is not None:
        result.predicted_kl += kv_kl
        result.kl_budget = kl_budget
        result.notes.append(f"KV cache {kv}: KL {kv_kl:.4g} measured alone (score job #{alone.job_id}); the linear "
                            f"layers were chosen under the rest of the budget ({kl_budget - kv_kl:.4g}) and the "
                            "prediction adds the two (the KLs of independent small errors roughly add)")
    read = planner_sweeps(model, tensor_parallel, expert_parallel)
    stale = stale_sweeps(model)
    result.notes += [stale[j.id][1] for j in read if j.id in stale and stale[j.id][0] in cands]
    if parallel.split:
        at_tp = schemes_swept_on(read, tensor_parallel, expert_parallel)
        split = split_scale_schemes({scheme for n, scheme in result.plan.items() if parallel.input_shards(n) > 1
                                     and scheme not in at_tp})
        if split:
            gpus = f"--tp {tensor_parallel}" + (" --expert-parallel" if parallel.expert_parallel else "")
            result.notes.append(f"predicted from one-GPU sensitivity sweeps of {', '.join(split)}: on {tensor_parallel} "
                                "GPUs each quantizes its share of o_proj's and down_proj's input on its own dynamic "
                                "scale, which those sweeps do not see, so the plan's KL there is likely lower than "
                                f"predicted (the verifying score runs on {tensor_parallel} GPUs). Sweep them on "
                                f"{tensor_parallel} GPUs for a closer prediction (`quantplan sensitivity {model.name} "
                                f"--scheme {split[0]} {gpus}`, or the Results page's GPU count)")
    if cost == "ideal":
        result.notes.append(f"cost: the ideal (roofline) step time at M={m} on {target}, from its datasheet"
                            + (f", of one GPU's share of every layer over {tensor_parallel}" if parallel.split else ""))
    elif table is None:
        result.notes.append(f"no kernel timings of a {target} are stored"
                            + (f" for one GPU's share of every layer over {tensor_parallel} (bench --tp "
                               f"{tensor_parallel})" if parallel.split else "")
                            + ": cost is the stored weight bits, scales included"
                            if cost == "auto" else "cost: the stored weight bits, scales included")
    # one plan name per question asked: the cost minimised is part of it (auto-h100-kl0.05-ideal-m1)
    name = (f"auto-{target}-kl{kl_budget:g}" + {"auto": "", "bits": "-bits", "ideal": f"-ideal-m{m}"}[cost]
            + ("" if kv == "AUTO" else f"-kv-{kv.lower()}") + (f"-tp{tensor_parallel}" if tensor_parallel > 1 else "")
            + ("-ep" if expert_parallel else ""))
    spec = spec_from_plan(result.plan, model=model.name, name=name)
    spec.kv_cache = kv
    spec.tensor_parallel = tensor_parallel
    spec.expert_parallel = expert_parallel
    body = spec.to_dict()
    versions = [p for p in list_plans(model.id) if p.name == name]
    job = None
    if versions and versions[-1].body == body:  # asked again with nothing new: the same plan, no new version
        plan = versions[-1]
        result.notes.append(f"the same plan as {plan.label}: no new version saved")
        job = next((j for j in list_jobs(limit=500, kind="score")
                    if j.plan_id == plan.id and j.status in ("queued", "running", "succeeded")), None)
    else:
        plan = save_plan(model.id, name, body,
                         note=f"auto: predicted KL {result.predicted_kl:.4g} ≤ {kl_budget:g} on {target}")
    if verify and job is None:
        tokens, note = verify_tokens(read, set(result.plan.values()))
        if note:
            result.notes.append(note)
        job = (queue_job or submit)("score", {"predicted_kl": result.predicted_kl, "label": plan.label,
                                              "device": device, **tokens}, model_id=model.id, plan_id=plan.id)
    return result, plan, job


SWEEP_TOKEN_PARAMS = ("dataset", "samples", "seq_len", "cal_dataset", "cal_samples", "cal_seq_len")


def newest_sweeps(sweeps: list[JobRecord]) -> dict[str, JobRecord]:
    """{scheme: its newest sweep} among ``sweeps`` (a later sweep replaces an earlier)."""
    return {sweep_scheme(j): j for j in sorted(sweeps, key=lambda j: j.id)}


def verify_tokens(sweeps: list[JobRecord], schemes: set[str]) -> tuple[dict[str, Any], str | None]:
    """The token parameters (evaluation and calibration text, sequences, tokens each) of the sweeps an automatic
    plan's chosen ``schemes`` were read from (the newest of each scheme), for the score that checks its prediction:
    a KL predicted on the sweeps' tokens is checked on the same tokens (and the GPTQ roundings the sweeps kept are
    read again). Where those sweeps differ, the newest one's and a note; ({}, None) where no sweep is read (an
    all-BF16 plan)."""
    used = [j for scheme, j in newest_sweeps(sweeps).items() if scheme in schemes]
    if not used:
        return {}, None

    def of(job: JobRecord) -> dict[str, Any]:
        return {k: job.params[k] for k in SWEEP_TOKEN_PARAMS if job.params.get(k) is not None}
    from worker.scoring_bodies import TOKEN_DEFAULTS

    newest = max(used, key=lambda j: j.id)
    kinds = {_token_label({**TOKEN_DEFAULTS, **of(j)}) for j in used}  # unset and explicit defaults: one kind
    note = None
    if len(kinds) > 1:
        note = (f"the sweeps this plan was predicted from were made on different tokens ({', '.join(sorted(kinds))}): "
                f"its score checks the prediction on those of the newest, job #{newest.id}")
    return of(newest), note


def side_by_side_tokens_note(model: ModelRecord, tensor_parallel: int = 1, expert_parallel: bool = False) -> str | None:
    """Where the sweeps :func:`sensitivity_by_scheme` draws side by side were made on different tokens, which of
    each (a KL mean over fewer tokens is noisier; over another text, of other tokens); else None."""
    from worker.scoring_bodies import TOKEN_DEFAULTS

    names = {d.id: d.name for d in list_datasets()}
    tokens = {}
    for scheme, job in sorted(newest_sweeps(planner_sweeps(model, tensor_parallel, expert_parallel)).items()):
        done = job.result or {}
        p = {**TOKEN_DEFAULTS, **{k: v for k, v in (job.params or {}).items() if v}}  # the worker's: 0 is unset
        samples, seq_len = done.get("tokens") or (p["samples"], p["seq_len"])  # what it ran on, where it says
        text = (Path(str(done["text"]).removeprefix("builtin:")).name if done.get("text") else
                "lee.cor" if p.get("dataset") is None else names.get(p["dataset"], f"text #{p['dataset']}"))
        tokens[scheme] = f"{samples} × {seq_len} of {text}"
    if len(set(tokens.values())) < 2:
        return None
    return ("These sweeps were made on different tokens (" + "; ".join(f"{s}: {t}" for s, t in tokens.items())
            + "): a KL over fewer tokens is noisier, so compare their colours loosely, or sweep them again on one "
            "size.")


def _token_label(params: dict[str, Any]) -> str:
    """A short, stable label of token parameters: 'samples=2 seq_len=32' ('defaults' when none is set)."""
    return " ".join(f"{k}={params[k]}" for k in sorted(params)) or "defaults"
