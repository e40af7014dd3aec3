"""Compare runs: two or more jobs side by side, across models or dates, as W&B and MLflow compare runs.

What :func:`compare_runs` answers, each part only where the runs have it:

* parameters side by side (the job's own, its model, plan and version, person, device, worker, software, timing), a
  row marked ``differs`` where the runs disagree;
* metrics side by side (a score's figures with their errors, a calibration's outlier ratios, a sweep's KLs);
* for scores, the difference of each against the baseline (the first score, or the one named) in KL, top-1
  agreement and ln(PPL ratio) with its standard error: **paired** sequence by sequence where the two were measured
  on the very same evaluation tokens (the reference cache's ``eval_key``) and kept their per-sequence means
  (quantcore.evaluation.statistics.paired_difference: each sequence an independent block), else from the two
  scores' own errors, with the reason it could not be paired; scores on different texts or sizes get no difference;
* per layer: the schemes of the scored plans, the per-unit KL of sensitivity sweeps (with their rank correlation),
  the outlier ratio of calibrations;
* outlier drift between two calibrations of one architecture (a base and its fine-tune,
  quantcore.evaluation.drift): per layer the outlier ratio of each and the channels that moved, grew or shrank, and
  which of a plan's SmoothQuant factors and static scales calibrated on the base clip or waste range on the other.

Reading is everyone's (viewers included): nothing here writes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from quantcore.evaluation import drift as qd
from quantcore.evaluation.stats import LayerStats
from quantplan.services.deployment import settings
from quantplan.services.errors import Refused
from quantplan.services.plans import resolve
from quantplan.services.scoring import PAIRED_FIGURES, compare_scores, figure_difference, paired
from store import repo
from store.db import session_scope
from store.records import JobRecord, ModelRecord, PlanRecord, ScoreRecord, SensitivityRecord

MAX_RUNS = 12  # columns a comparison shows side by side
WHAT_IF = f"what-if: SmoothQuant α {qd.DEFAULT_ALPHA:g} and a static activation scale on every layer"


@dataclass(frozen=True)
class Run:
    """One compared job and what it stored. key: its column ("#12"); label: what a legend names ("#12 score ·
    tiny · my-plan v2")."""

    job: JobRecord
    model: ModelRecord | None
    plan: PlanRecord | None
    score: ScoreRecord | None = None
    sweep: list[SensitivityRecord] = field(default_factory=list)
    stats: list[LayerStats] = field(default_factory=list)

    @property
    def key(self) -> str:
        return f"#{self.job.id}"

    @property
    def model_name(self) -> str:
        if self.model is not None:
            return self.model.name
        return f"model #{self.job.model_id} (removed)" if self.job.model_id is not None else "—"

    @property
    def plan_label(self) -> str:
        """The plan and version a run measured ("my-plan v2", a preset's name), else ""."""
        if self.score is not None:
            return self.score.plan_label
        if self.plan is not None:
            return self.plan.label
        scheme = (self.job.result or {}).get("scheme") or self.job.params.get("scheme")
        return str(scheme or "")

    @property
    def label(self) -> str:
        parts = [f"{self.key} {self.job.kind}", self.model_name] + ([self.plan_label] if self.plan_label else [])
        return " · ".join(parts)


@dataclass(frozen=True)
class DriftReport:
    """Outlier drift from calibration ``a`` (the base) to ``b``: ``layers`` (one row per layer), ``transfer`` (one
    row per layer the plan calibrates: what a's factors and static scales do on b), the plan checked, a summary."""

    a: str
    b: str
    plan: str
    layers: list[dict[str, Any]]
    transfer: list[dict[str, Any]]
    only_a: list[str]
    only_b: list[str]
    summary: str


@dataclass(frozen=True)
class Comparison:
    """Runs compared; every table a list of plain rows (dicts with a column per run key), empty where the runs have
    nothing of that kind, with the reason in ``notes`` under the table's name."""

    runs: list[Run]
    baseline: str
    parameters: list[dict[str, Any]]
    metrics: list[dict[str, Any]]
    differences: list[dict[str, Any]]
    schemes: list[dict[str, Any]]
    sensitivity: list[dict[str, Any]]
    rank_correlation: list[dict[str, Any]]
    outliers: list[dict[str, Any]]
    drift: list[DriftReport]
    notes: dict[str, list[str]]

    @property
    def keys(self) -> list[str]:
        return [r.key for r in self.runs]

    def to_json(self) -> dict[str, Any]:
        """Everything as JSON-ready data (``quantplan compare --json``); infinities as None."""
        return _finite({
            "runs": [{"key": r.key, "job": r.job.id, "kind": r.job.kind, "status": r.job.status,
                      "model": r.model_name, "plan": r.plan_label, "label": r.label} for r in self.runs],
            "baseline": self.baseline, "parameters": self.parameters, "metrics": self.metrics,
            "differences": self.differences, "schemes": self.schemes, "sensitivity": self.sensitivity,
            "rank_correlation": self.rank_correlation, "outliers": self.outliers,
            "drift": [asdict(d) for d in self.drift], "notes": self.notes})


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def parse_job_ids(text: str | Iterable[str | int]) -> list[int]:
    """Job ids from "12,15, #17" (a page's ``?jobs=``) or a list; Refused naming what is not a job id."""
    joined = text if isinstance(text, str) else ",".join(str(t) for t in text)
    items = joined.replace(" ", ",").split(",")
    out, bad = [], []
    for item in (i.strip().lstrip("#") for i in items):
        if not item:
            continue
        if item.isdigit() and int(item) > 0:
            out.append(int(item))
        else:
            bad.append(item)
    if bad:
        raise Refused(f"jobs: {', '.join(map(repr, bad))} is not a job id (a whole number, as #12 on the Jobs page)")
    return list(dict.fromkeys(out))


def load_runs(job_ids: Sequence[int]) -> list[Run]:
    """The jobs with what they stored; Refused for fewer than two distinct jobs, more than MAX_RUNS, or ids that
    name no job (all of them named)."""
    ids = list(dict.fromkeys(int(j) for j in job_ids))
    if len(ids) < 2:
        raise Refused(f"compare needs two or more runs (job ids); got {len(ids)}"
                      + (f" (#{ids[0]})" if ids else "") + ": name at least one more")
    if len(ids) > MAX_RUNS:
        raise Refused(f"compare shows at most {MAX_RUNS} runs side by side; got {len(ids)}: pick fewer")
    runs, unknown = [], []
    with session_scope(settings()) as s:
        for jid in ids:
            try:
                job = repo.get_job(s, jid)
            except repo.NotFound:
                unknown.append(jid)
                continue
            runs.append(_load(s, job))
    if unknown:
        raise Refused(f"no job {', '.join(f'#{j}' for j in unknown)}: the Jobs page or `quantplan jobs` lists "
                      "the runs there are")
    return runs


def _load(s: Any, job: JobRecord) -> Run:
    model = plan = score = None
    if job.model_id is not None:
        try:
            model = repo.get_model(s, job.model_id)
        except repo.NotFound:  # removed: its runs stay comparable by what they stored
            model = None
    if job.plan_id is not None:
        try:
            plan = repo.get_plan(s, job.plan_id)
        except repo.NotFound:
            plan = None
    sweep: list[SensitivityRecord] = []
    stats: list[LayerStats] = []
    if job.status == "succeeded":
        if job.kind == "score":
            try:
                score = repo.get_score(s, job.id)
            except repo.NotFound:
                score = None
        elif job.kind == "sensitivity":
            sweep = repo.list_sensitivity(s, job.id)
        elif job.kind == "calibrate":
            stats = [LayerStats.from_record(r) for r in repo.load_activation_stats(s, job.id)]
    return Run(job=job, model=model, plan=plan, score=score, sweep=sweep, stats=stats)


# ---------------------------------------------------------------------- parameters and metrics

def _flat(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flat(v, key + "."))
        elif isinstance(v, list | tuple):
            out[key] = json.dumps(v, default=str) if len(v) <= 16 else f"[{len(v)} items]"
        else:
            out[key] = v
    return out


def run_parameters(run: Run) -> dict[str, Any]:
    """What a run was asked and where it ran, flattened: job and model first, then ``params.*``."""
    job = run.job
    seconds = job.run_seconds()
    head = {
        "kind": job.kind, "status": job.status, "model": run.model_name,
        "model checkpoint": run.model.sha256[:12] if run.model else None,
        "architecture": run.model.architecture if run.model else None,
        "plan": run.plan_label or None, "requested by": job.requested_by, "device": job.device,
        "worker": job.worker_host, "torch": job.torch_version, "queue": job.queue,
        "created": job.created_at.strftime("%Y-%m-%d %H:%M"),
        "duration s": round(seconds, 1) if seconds is not None else None,
    }
    if run.score is not None:
        head.update({"evaluation text": run.score.dataset, "positions scored": run.score.tokens,
                     "kv cache": run.score.kv_cache})
    return head | _flat(job.params or {}, "params.")


def _same(values: Sequence[Any]) -> bool:
    return len({json.dumps(v, sort_keys=True, default=str) for v in values}) <= 1


def _table(name: str, per_run: list[dict[str, Any]], runs: list[Run], mark: bool = True) -> list[dict[str, Any]]:
    keys: list[str] = []
    for d in per_run:
        keys += [k for k in d if k not in keys]
    rows = []
    for k in keys:
        values = [d.get(k) for d in per_run]
        if all(v is None for v in values):
            continue
        row = {name: k, **{r.key: v for r, v in zip(runs, values, strict=True)}}
        if mark:
            row["differs"] = not _same(values)
        rows.append(row)
    return rows


def run_metrics(run: Run) -> dict[str, Any]:
    """A run's headline figures: a score's report and statistics, a calibration's outlier ratios, a sweep's KLs,
    else the scalars of the job's result."""
    if run.score is not None:
        sc = run.score
        stats = {k: v for k, v in sc.statistics().items() if v is not None}
        return sc.metrics() | stats | {"reference": sc.figure("reference_kind")}
    result = {k: v for k, v in (run.job.result or {}).items() if isinstance(v, str | int | float | bool) or v is None}
    if run.stats:
        ratios = sorted(st.outlier_ratio for st in run.stats)
        result |= {"layers": len(run.stats), "outlier ratio, largest": ratios[-1],
                   "outlier ratio, median layer": ratios[len(ratios) // 2],
                   f"layers with outliers (≥ {qd.OUTLIER_FACTOR:g}× median)":
                       sum(1 for st in run.stats if qd.outlier_channels(st.channel_max).size),
                   "amax, largest": max(st.amax for st in run.stats)}
    if run.sweep:
        kls = sorted(r.kl_mean for r in run.sweep)
        result |= {"units": len(kls), "unit KL, largest": kls[-1], "unit KL, median": kls[len(kls) // 2],
                   "most sensitive unit": max(run.sweep, key=lambda r: r.kl_mean).unit}
    return result


# ---------------------------------------------------------------------- paired differences

def _why_unpaired(a: ScoreRecord, b: ScoreRecord, figure: str) -> str:
    key = PAIRED_FIGURES[figure][0]
    ka, kb = a.figure("eval_key"), b.figure("eval_key")
    missing = [f"#{sc.job_id}" for sc in (a, b) if not sc.figure(key)]
    if missing:
        return (f"not paired: {' and '.join(missing)} kept no per-sequence values ({key}; scored before quantplan "
                "kept them): the error is the two scores' own, in quadrature; score again to pair")
    if not ka or not kb:
        return "not paired: a score does not say which evaluation tokens it read (no eval_key): score again to pair"
    if ka != kb:
        return (f"not paired: different evaluation tokens (eval_key {ka} against {kb}: another tokenizer or "
                "another sample of the text); the error is the two scores' own, in quadrature")
    return f"not paired: {len(a.figure(key))} against {len(b.figure(key))} sequences"


def score_differences(runs: list[Run], baseline: Run) -> tuple[list[dict[str, Any]], list[str]]:
    """Each score against ``baseline``'s on every paired figure: rows {a, b, figure, difference, err, err_unpaired,
    paired, verdict, why}; notes where no difference can be given."""
    from quantcore.evaluation.statistics import Estimate, independent_difference

    base = baseline.score
    others = [r for r in runs if r.score is not None and r is not baseline]
    if base is None or not others:
        return [], ["fewer than two scores among these runs: no paired difference"]
    rows, notes = [], []
    for run in others:
        sc = run.score
        assert sc is not None
        if (sc.dataset, sc.tokens) != (base.dataset, base.tokens):
            notes.append(f"{run.key} was scored on other tokens ({sc.dataset}, {sc.tokens:,} positions) than "
                         f"{baseline.key} ({base.dataset}, {base.tokens:,}): their figures are side by side, "
                         "but no difference is given; score both on one text and size to compare")
            continue
        if sc.model_id != base.model_id:
            notes.append(f"{run.key} and {baseline.key} are scores of different models: each KL is against its own "
                         "model's unquantized reference, paired over the same tokens where the tokenizers agree")
        for figure, (_, _, name) in PAIRED_FIGURES.items():
            row: dict[str, Any] = {"a": run.key, "b": baseline.key, "figure": name, "difference": None,
                                   "err": None, "err_unpaired": None, "paired": False, "verdict": "", "why": ""}
            try:
                diff = figure_difference(sc, base, figure)
                verdict = compare_scores(sc, base, figure).verdict
            except Refused as exc:
                row["why"] = str(exc)
                rows.append(row)
                continue
            is_paired = paired(sc, base, figure)
            err_key = {"kl_mean": "kl_mean_err", "top1_agree": "top1_agree_err",
                       "ln_ppl_ratio": "ln_ppl_ratio_err"}[figure]
            unpaired = independent_difference(Estimate(sc.figure(figure), sc.figure(err_key)),
                                              Estimate(base.figure(figure), base.figure(err_key)))
            row.update(difference=diff.value, err=diff.err, err_unpaired=unpaired.err, paired=is_paired,
                       verdict=verdict,
                       why=(f"paired over {len(sc.figure(PAIRED_FIGURES[figure][0]))} sequences, each an "
                            "independent block" if is_paired else _why_unpaired(sc, base, figure)))
            rows.append(row)
    return rows, notes


# ---------------------------------------------------------------------- per layer

def _schemes(run: Run) -> tuple[dict[str, str] | None, str | None]:
    if run.score is None:
        return None, None
    if run.model is None:
        return None, f"{run.key}: its model was removed; the plan's layers cannot be resolved"
    resolved, problem = resolve(run.model, run.score.plan_body)
    if resolved is None:
        return None, f"{run.key}: the plan does not resolve on {run.model.name} ({problem})"
    return {layer: scheme.name for layer, scheme in resolved.items()}, None


def _per_layer(name: str, per_run: dict[str, dict[str, Any]], runs: list[Run]) -> list[dict[str, Any]]:
    have = [r for r in runs if r.key in per_run]
    return _table(name, [per_run[r.key] for r in have], have)


def _sensitivity(runs: list[Run]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    from quantcore.planning.correction import spearman

    sweeps = [r for r in runs if r.sweep]
    if len(sweeps) < 2:
        return [], []
    per = {r.key: {u.unit: u.kl_mean for u in r.sweep} for r in sweeps}
    rows = _per_layer("unit", per, sweeps)
    base = sweeps[0]
    ranks = []
    for other in sweeps[1:]:
        common = [u for u in per[base.key] if u in per[other.key]]
        ranks.append({"a": other.key, "b": base.key, "units": len(common),
                      "spearman": spearman([per[base.key][u] for u in common], [per[other.key][u] for u in common])})
    return rows, ranks


def plan_schemes(model: ModelRecord, plan: PlanRecord) -> dict[str, qd.LayerScheme]:
    """{layer: its SmoothQuant α and whether its activation scale is static} of a plan resolved on ``model``;
    Refused when it does not resolve."""
    resolved, problem = resolve(model, plan.body)
    if resolved is None:
        raise Refused(f"plan {plan.label} does not resolve on {model.name}: {problem}")
    return {n: qd.LayerScheme(s.smoothquant_alpha, s.activations is not None and not s.activations.dynamic)
            for n, s in resolved.items() if not s.is_identity}


def drift_report(a: Run, b: Run, plan: PlanRecord | None = None) -> DriftReport:
    """Outlier drift from calibration run ``a`` to ``b`` and what ``plan`` (a plan of a's model; None: the
    what-if of SmoothQuant α 0.5 and static scales on every layer) calibrated on a does on b; Refused when the two
    are not calibrations of one architecture."""
    for run in (a, b):
        if not run.stats:
            raise Refused(f"{run.key} is not a succeeded calibration: outlier drift compares two calibrations")
    if a.model is not None and b.model is not None and a.model.architecture != b.model.architecture:
        raise Refused(f"{a.key} calibrated a {a.model.architecture}, {b.key} a {b.model.architecture}: outlier "
                      "drift compares models of one architecture (a base and its fine-tune)")
    try:
        layers = qd.drift(a.stats, b.stats)
        both, only_a, only_b = qd.common_layers(a.stats, b.stats)
        if plan is not None:
            if a.model is None:
                raise Refused(f"{a.key}'s model was removed: its plan cannot be resolved")
            schemes, plan_text = plan_schemes(a.model, plan), f"plan {plan.label}"
        else:
            schemes, plan_text = qd.every_layer(both), WHAT_IF
        transfer = qd.transfer(a.stats, b.stats, schemes)
    except qd.DriftError as exc:
        raise Refused(str(exc)) from exc
    layer_rows = [{"layer": d.layer, "verdict": d.verdict, "ratio_a": d.ratio_a, "ratio_b": d.ratio_b,
                   "amax_a": d.amax_a, "amax_b": d.amax_b, "outliers_a": d.outliers_a, "outliers_b": d.outliers_b,
                   "appeared": d.appeared, "gone": d.gone, "grew": [list(g) for g in d.grew],
                   "shrank": [list(x) for x in d.shrank]} for d in layers]
    transfer_rows = [{"layer": t.layer, "verdict": t.verdict, "alpha": t.alpha, "static": t.static,
                      "act_range": t.act_range, "weight_range": t.weight_range, "wasted_bits": t.wasted_bits,
                      "under_smoothed": t.under_smoothed, "static_amax_a": t.static_amax_a,
                      "live_max_b": t.live_max_b, "overshoot": t.overshoot, "clipped_share": t.clipped_share,
                      "clipped_channels": t.clipped_channels} for t in transfer]
    moved = sum(d.moved for d in layers)
    grew = sum(bool(d.grew) for d in layers)
    shrank = sum(bool(d.shrank) for d in layers)
    clips = sum(t.clips for t in transfer)
    wastes = sum(t.wastes for t in transfer)
    summary = (f"{a.label} → {b.label}: of {len(layers)} layers, outliers moved in {moved}, grew in {grew}, shrank "
               f"in {shrank}; calibrated on {a.key}, {plan_text} clips on {b.key} in {clips} of {len(transfer)} "
               f"layer(s) and wastes ≥ {math.log2(qd.WASTE_FACTOR):g} bit of range in {wastes}")
    if clips or wastes:
        summary += f": recalibrate on {b.model_name} (fine-tunes move outliers)"
    return DriftReport(a=a.key, b=b.key, plan=plan_text, layers=layer_rows, transfer=transfer_rows,
                       only_a=only_a, only_b=only_b, summary=summary)


# ---------------------------------------------------------------------- the whole comparison

def compare_runs(job_ids: Sequence[int], *, baseline: int | None = None,
                 plan_id: int | str | None = None) -> Comparison:
    """Compare jobs ``job_ids`` (two or more; see the module docstring). ``baseline``: the job the others are
    measured against (default the first); ``plan_id``: the plan whose smoothing and static scales the drift check
    reads (a plan of the base calibration's model; default the what-if on every layer). Refused for fewer than two
    runs, unknown ids, a baseline not among them, or a plan that is not the base model's."""
    runs = load_runs(job_ids)
    by_key = {r.job.id: r for r in runs}
    if baseline is not None and baseline not in by_key:
        raise Refused(f"baseline #{baseline} is not among the runs compared ({', '.join(r.key for r in runs)})")
    base = by_key[baseline] if baseline is not None else runs[0]
    notes: dict[str, list[str]] = {}
    for r in runs:
        if r.job.status != "succeeded":
            notes.setdefault("runs", []).append(f"{r.key} is {r.job.status}: its parameters are compared, it has "
                                                "no results")
    parameters = _table("parameter", [run_parameters(r) for r in runs], runs)
    metrics = _table("metric", [run_metrics(r) for r in runs], runs, mark=False)

    score_base = base if base.score is not None else next((r for r in runs if r.score is not None), base)
    differences, notes["differences"] = score_differences(runs, score_base)

    schemes, scheme_notes = {}, []
    for r in runs:
        mapping, problem = _schemes(r)
        if mapping is not None:
            schemes[r.key] = mapping
        if problem:
            scheme_notes.append(problem)
    scheme_rows = _per_layer("layer", schemes, runs) if len(schemes) >= 2 else []
    if not scheme_rows:
        scheme_notes.append("fewer than two scored plans among these runs: no per-layer schemes to compare")
    notes["schemes"] = scheme_notes

    sensitivity, ranks = _sensitivity(runs)
    if not sensitivity:
        notes["sensitivity"] = ["fewer than two sensitivity sweeps among these runs: no per-unit KL to compare"]

    cals = [r for r in runs if r.stats]
    outliers = (_per_layer("layer", {r.key: {st.name: st.outlier_ratio for st in r.stats} for r in cals}, cals)
                if len(cals) >= 2 else [])
    reports, drift_notes = [], []
    plan = None
    cal_base = base if base.stats else (cals[0] if cals else None)
    if plan_id is not None:
        with session_scope(settings()) as s:
            try:
                plan = repo.get_plan(s, plan_id)
            except repo.NotFound as exc:
                raise Refused(f"plan {plan_id!r}: {exc}") from exc
        if cal_base is None or cal_base.job.model_id != plan.model_id:
            raise Refused(f"plan {plan.label} is a plan of model #{plan.model_id}; the drift check reads a plan of "
                          "the base calibration's model"
                          + (f" ({cal_base.model_name}, {cal_base.key})" if cal_base else " (no calibration here)"))
    for other in cals:
        if cal_base is None or other is cal_base:
            continue
        try:
            reports.append(drift_report(cal_base, other, plan))
        except Refused as exc:
            drift_notes.append(f"{cal_base.key} → {other.key}: {exc}")
    if len(cals) < 2:
        drift_notes.append("fewer than two calibrations among these runs: no outlier drift")
    notes["drift"] = drift_notes
    return Comparison(runs=runs, baseline=base.key, parameters=parameters, metrics=metrics,
                      differences=differences, schemes=scheme_rows, sensitivity=sensitivity,
                      rank_correlation=ranks, outliers=outliers, drift=reports,
                      notes={k: v for k, v in notes.items() if v})


def run_choices(limit: int = 200, include: Iterable[int] = ()) -> dict[int, str]:
    """{job id: "#12 score · tiny · my-plan v2 · 2026-12-05 16:40"} of the newest finished jobs (newest first), and
    of the jobs in ``include`` that exist (a link's ``?jobs=``): what a picker offers."""
    with session_scope(settings()) as s:
        jobs = [j for j in repo.list_jobs(s, limit=limit, status=("succeeded", "failed", "cancelled"))]
        known = {j.id for j in jobs}
        for jid in include:
            if jid not in known:
                try:
                    jobs.append(repo.get_job(s, jid))
                except repo.NotFound:
                    continue
        models = {m.id: m.name for m in repo.list_models(s)}
        plans = repo.plan_labels(s, {j.plan_id for j in jobs if j.plan_id is not None})
    out = {}
    for j in jobs:
        what = plans.get(j.plan_id) if j.plan_id is not None else None
        what = what or (j.result or {}).get("plan") or (j.params or {}).get("scheme") or ""
        model = models.get(j.model_id, f"model #{j.model_id} (removed)") if j.model_id is not None else ""
        parts = [f"#{j.id} {j.kind}", model, str(what), f"{j.created_at:%Y-%m-%d %H:%M}"]
        out[j.id] = " · ".join(p for p in parts if p) + ("" if j.status == "succeeded" else f" ({j.status})")
    return out
