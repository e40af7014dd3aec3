"""Calibrations of a model: queueing one, and the activation statistics they stored."""

from __future__ import annotations

from typing import Any

from jobs.specs import CalibrateSpec
from quantcore.evaluation.stats import LayerStats
from quantplan.services.deployment import settings
from quantplan.services.queue import submit
from store import repo
from store.db import session_scope
from store.records import JobRecord


def submit_calibration(model_id: int, *, samples: int = CalibrateSpec.samples, seq_len: int = CalibrateSpec.seq_len,
                       device: str = CalibrateSpec.device, dataset_id: int | None = None,
                       stream: bool | None = None) -> JobRecord:
    """Queue a calibration of the model over ``samples`` x ``seq_len`` tokens of the stored text ``dataset_id``
    (None: the built-in calibration text) on ``device``, streamed block by block or whole (``stream``; None: as the
    worker's memory budget decides); InvalidJob for sizes the spec refuses."""
    spec = CalibrateSpec(samples=samples, seq_len=seq_len, device=device, dataset=dataset_id, stream=stream)
    return submit("calibrate", spec, model_id=model_id)


def calibrations(model_id: int) -> list[JobRecord]:
    """The model's succeeded calibrations of the model as it is, newest first (store.repo.calibrations); the
    rotated what-if calibrations are :func:`rotated_calibrations`."""
    with session_scope(settings()) as s:
        return [c for c in repo.calibrations(s, model_id) if not is_rotated(c)]


def is_rotated(job: JobRecord) -> bool:
    """Whether a calibration ran on the model rotated (its job's ``rotation``, issue #46)."""
    return bool((job.params or {}).get("rotation"))


def rotated_calibrations(model_id: int) -> list[JobRecord]:
    """The model's succeeded calibrations with a Hadamard rotation applied (the Outliers page's what-if), newest
    first."""
    with session_scope(settings()) as s:
        return [c for c in repo.calibrations(s, model_id) if is_rotated(c)]


def submit_rotated_calibration(model_id: int, rotation: dict[str, Any], *, like: JobRecord) -> JobRecord:
    """Queue a calibration of the model rotated by ``rotation`` (a plan's ``transforms.rotation``) on the same text,
    sizes and device as the calibration ``like``, so that the two compare layer by layer; whole or streamed as that
    one was asked (a streamed job rotates each block as it loads)."""
    p = like.params or {}
    spec = CalibrateSpec(samples=p.get("samples", CalibrateSpec.samples),
                         seq_len=p.get("seq_len", CalibrateSpec.seq_len), device=p.get("device", CalibrateSpec.device),
                         dataset=p.get("dataset"), stream=p.get("stream"), rotation=dict(rotation))
    return submit("calibrate", spec, model_id=model_id)


def stats_overview(job_id: int) -> list[dict[str, Any]]:
    """A calibration's per-layer scalars (name, in_features, out_features, outlier_ratio, amax, n_tokens): no
    arrays, for tables and the CLI's JSON."""
    with session_scope(settings()) as s:
        return repo.stats_overview(s, job_id)


def layer_stats(job_id: int) -> list[LayerStats]:
    """The per-layer activation statistics a calibration stored."""
    with session_scope(settings()) as s:
        return [LayerStats.from_record(r) for r in repo.load_activation_stats(s, job_id)]
