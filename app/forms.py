"""What the forms that queue jobs share: the values last queued for a model in this session, and what a job will
cost before it is queued (its tokens or cases, and its time on the chosen device measured from past jobs).

Streamlit forgets a form's widgets while another page is drawn, so a form reopened fell back to its defaults: each
form reads :func:`last` for its widgets' starting values and calls :func:`remember` when it queues. The estimate is
measured, never assumed: the rate of the newest succeeded jobs of that kind on that device (work done over the
seconds they ran), the model's own jobs first; other models' jobs scaled by their size (a forward pass costs about
tokens × parameters) where the model has none; no such job, no estimate, and the form says so.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import streamlit as st

from quantplan.services import jobs as jobs_svc
from quantplan.services import models as models_svc
from store.records import JobRecord, ModelRecord

KEPT = "forms_last_queued"  # {(form, model id): the values last queued}
PAST_RUNS = 20  # the newest succeeded jobs a rate is measured on


def last(form: str, model_id: int | None) -> dict[str, Any]:
    """The values ``form`` last queued for ``model_id`` in this session ({} before any)."""
    return dict(st.session_state.get(KEPT, {}).get((form, model_id), {}))


def remember(form: str, model_id: int | None, values: Mapping[str, Any]) -> None:
    """Keep the values ``form`` just queued for ``model_id``: its next drawing starts from them."""
    st.session_state.setdefault(KEPT, {})[(form, model_id)] = dict(values)


def tokens_of(job: JobRecord) -> float | None:
    """The tokens a calibration or score ran (sequences × tokens each, as asked; None where not recorded)."""
    p = job.params or {}
    if p.get("samples") and p.get("seq_len"):
        return float(p["samples"]) * float(p["seq_len"])
    return None


def cases_of(job: JobRecord) -> float | None:
    """The GEMM cases a benchmark measured (not those it reused)."""
    measured = (job.result or {}).get("measured")
    return float(measured) if measured else None


@dataclass(frozen=True)
class Rate:
    """Work per second, measured on ``jobs`` past jobs; ``scaled``: from other models, per parameter."""

    per_s: float
    jobs: int
    scaled: bool


def measured_rate(kind: str, device: str, model: ModelRecord, work_of: Callable[[JobRecord], float | None],
                  scale_by_size: bool = True) -> Rate | None:
    """The rate of past ``kind`` jobs on ``device``: the model's own where it has some, else other models' per
    parameter (``scale_by_size``), else None."""
    runs = [(j, work_of(j), j.run_seconds()) for j in jobs_svc.finished_runs(kind, device, limit=PAST_RUNS * 5)]
    runs = [(j, w, s) for j, w, s in runs if w and s]
    own = [(w, s) for j, w, s in runs if j.model_id == model.id][:PAST_RUNS]
    if own:
        return Rate(sum(w for w, _ in own) / sum(s for _, s in own), len(own), False)
    if not scale_by_size or not model.num_params:
        return None
    sizes = {m.id: m.num_params for m in models_svc.list_models()}
    other = [(w * sizes[j.model_id], s) for j, w, s in runs if sizes.get(j.model_id)][:PAST_RUNS]
    if not other:
        return None
    return Rate(sum(w for w, _ in other) / sum(s for _, s in other) / model.num_params, len(other), True)


def cost_note(kind: str, device: str, model: ModelRecord, work: float, unit: str,
              work_of: Callable[[JobRecord], float | None], *, scale_by_size: bool = True,
              at_most_s: float | None = None) -> str:
    """"2,048 tokens; about 40 s on cpu (measured on 3 past calibrations of this model)", or the work and "no
    estimate" where no past job measures a rate. ``at_most_s``: a bound the job keeps to (a benchmark's budget)."""
    rate = measured_rate(kind, device, model, work_of, scale_by_size)
    what = f"{work:,.0f} {unit}"
    if rate is None:
        return (f"{what}; no estimate of its time on {device}: no {kind} job has run there yet"
                + (f" (at most {jobs_svc.duration_text(at_most_s)})" if at_most_s else "") + ".")
    seconds = work / rate.per_s
    if at_most_s is not None:
        seconds = min(seconds, at_most_s)
    whose = "of other models, scaled by their size" if rate.scaled else "of this model"
    return (f"{what}; about {jobs_svc.duration_text(seconds)} on {device} (measured on {rate.jobs} past {kind} "
            f"job{'s' if rate.jobs > 1 else ''} {whose}, at {rate.per_s:,.3g} {unit} a second"
            + (" for this model's size" if rate.scaled else "") + ").")

