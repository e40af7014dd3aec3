"""The app's service layer: everything a page does goes through here (no SQL, no maths in pages).

Torch-free by design: jobs are sent to workers by task name (worker.client), and the
statistics come back from the store as numpy arrays.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path
from typing import Any

from quantcore.stats import LayerStats
from store import repo
from store.datasets import add_text_file
from store.db import check_schema_current, session_scope
from store.records import DatasetRecord, JobRecord, ModelRecord, PlanRecord, ScoreRecord, SensitivityRecord
from store.settings import Settings, get_settings
from worker.client import submit_job

UPLOAD_SUFFIXES = (".zip", ".tar.gz", ".tgz", ".tar", ".gguf")


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
        from quantcore.checkpoint import PICKLE_SUFFIXES

        if safe.lower().endswith(PICKLE_SUFFIXES):
            raise ValueError(f"{safe} is a pickle checkpoint; quantplan never unpickles uploads. "
                             "Save the model with save_pretrained(safe_serialization=True) and upload a "
                             ".zip/.tar.gz of the folder.")
        raise ValueError(f"{safe}: upload a .zip or .tar.gz of a Hugging Face folder, or a .gguf file")
    if len(data) > s.upload_limit_bytes:
        raise ValueError(f"{safe} is {len(data) / 2**20:.0f} MiB, over the {s.upload_limit_mb} MiB limit")
    staging = Path(str(s.artifact_dir)) / "uploads" / uuid.uuid4().hex
    staging.mkdir(parents=True)
    try:
        (staging / safe).write_bytes(data)
        return submit_job("register", {"source": str(staging / safe), "source_name": safe, "name": name or None,
                                       "cleanup_dir": str(staging), "user": s.user}, settings=s)
    except Exception:
        shutil.rmtree(staging, ignore_errors=True)
        raise


# ----------------------------------------------------------------------------- datasets


def list_datasets() -> list[DatasetRecord]:
    with session_scope(settings()) as s:
        return repo.list_datasets(s)


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


def list_jobs(limit: int = 100, kind: str | None = None, model_id: int | None = None) -> list[JobRecord]:
    with session_scope(settings()) as s:
        return repo.list_jobs(s, limit=limit, kind=kind, model_id=model_id)


def get_job(job_id: int) -> JobRecord:
    with session_scope(settings()) as s:
        return repo.get_job(s, job_id)


def cancel_job(job_id: int) -> JobRecord:
    with session_scope(settings()) as s:
        return repo.request_cancel(s, job_id)


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
    with session_scope(settings()) as s:
        return repo.save_plan(s, model_id=model_id, name=name, body=body, user=settings().user, note=note,
                              parent_id=parent_id)


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


def kernel_rows(job_id: int | None = None, device_name: str | None = None):
    with session_scope(settings()) as s:
        return repo.kernel_results(s, job_id=job_id, device_name=device_name)


def kernel_devices() -> list[tuple[str, str, str]]:
    with session_scope(settings()) as s:
        return repo.kernel_devices(s)
