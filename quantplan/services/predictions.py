"""Automatic plans' predictions against their verifications, and the correction learned from them.

An automatic plan predicts its KL as the sum of its units' KLs (from exact sweeps or Fisher estimates); the score job
that verifies it measures the KL of the whole plan, ± its error. Across the team's verified plans of models of one
architecture family (``architecture``, e.g. LlamaForCausalLM), and of one source of unit KLs, the ratio measured /
predicted is what the sum leaves out (the interaction between units' errors; for the estimate, its own bias):
:func:`correction_for` fits it (quantcore.planning.correction) for the next search to use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from quantplan.services.jobs import list_jobs
from quantplan.services.models import list_models
from quantplan.services.scoring import list_scores
from store.records import ModelRecord

MAX_SCORE_JOBS = 5000  # score jobs read when gathering verifications (newest first)


@dataclass(frozen=True)
class Verified:
    """One automatic plan's prediction and the score that checked it."""

    job_id: int
    model: str
    plan_label: str
    sensitivity: str  # "kl" (exact sweeps) or "fisher" (estimates): what predicted_kl was summed from
    predicted_kl: float
    measured_kl: float
    measured_kl_err: float | None

    def to_dict(self) -> dict[str, Any]:
        return {"job": self.job_id, "model": self.model, "plan": self.plan_label, "sensitivity": self.sensitivity,
                "predicted_kl": self.predicted_kl, "measured_kl": self.measured_kl,
                "measured_kl_err": self.measured_kl_err}


def verified_predictions(model: ModelRecord | None = None, sensitivity: str | None = None) -> list[Verified]:
    """Every succeeded score of an automatic plan (one with a predicted KL), newest first: of models of ``model``'s
    architecture family where given, from ``sensitivity``'s unit KLs where given."""
    params = {j.id: j.params or {} for j in list_jobs(limit=MAX_SCORE_JOBS, kind="score", status=("succeeded",))}
    models = {m.id: m for m in list_models(include_removed=True)}  # a removed model's scores still verify
    out = []
    for m in models.values():
        if model is not None and m.architecture != model.architecture:
            continue
        for s in list_scores(m.id):
            if s.predicted_kl is None or s.job_id not in params:
                continue
            method = str(params[s.job_id].get("sensitivity") or "kl")
            if sensitivity is not None and method != sensitivity:
                continue
            out.append(Verified(s.job_id, m.name, s.plan_label, method, float(s.predicted_kl), float(s.kl_mean),
                                s.kl_mean_err))
    out.sort(key=lambda v: v.job_id, reverse=True)
    return out


def correction_for(model: ModelRecord, sensitivity: str) -> Any:
    """The fitted predicted -> measured correction (quantcore.planning.correction.Correction) over the verified
    automatic plans of ``model``'s architecture family whose prediction came from ``sensitivity``; None without
    any."""
    from quantcore.planning.correction import fit_correction

    return fit_correction([(v.predicted_kl, v.measured_kl) for v in verified_predictions(model, sensitivity)])
