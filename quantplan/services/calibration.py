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
                       device: str = CalibrateSpec.device, dataset_id: int | None = None) -> JobRecord:
    """Queue a calibration of the model over ``samples`` x ``seq_len`` tokens of the stored text ``dataset_id``
    (None: the built-in calibration text) on ``device``; InvalidJob for sizes the spec refuses."""
    spec = CalibrateSpec(samples=samples, seq_len=seq_len, device=device, dataset=dataset_id)
    return submit("calibrate", spec, model_id=model_id)


def calibrations(model_id: int) -> list[JobRecord]:
    """The model's succeeded calibrations, newest first (store.repo.calibrations)."""
    with session_scope(settings()) as s:
        return repo.calibrations(s, model_id)


def stats_overview(job_id: int) -> list[dict[str, Any]]:
    """A calibration's per-layer scalars (name, in_features, out_features, outlier_ratio, amax, n_tokens): no
    arrays, for tables and the CLI's JSON."""
    with session_scope(settings()) as s:
        return repo.stats_overview(s, job_id)


def layer_stats(job_id: int) -> list[LayerStats]:
    """The per-layer activation statistics a calibration stored."""
    with session_scope(settings()) as s:
        return [LayerStats.from_record(r) for r in repo.load_activation_stats(s, job_id)]
