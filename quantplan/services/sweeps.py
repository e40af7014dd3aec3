"""Sensitivity sweeps: which a plan reads (by GPU count), their KL per unit and scheme, their tokens."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quantplan.services.datasets import list_datasets
from quantplan.services.deployment import settings
from quantplan.services.plans import gpus_label
from store import repo
from store.db import session_scope
from store.records import JobRecord, ModelRecord, SensitivityRecord

if TYPE_CHECKING:
    import pandas as pd


def sensitivity_jobs(model_id: int) -> list[JobRecord]:
    """The model's succeeded sensitivity sweeps (linear and KV cache), newest first."""
    with session_scope(settings()) as s:
        return repo.sensitivity_jobs(s, model_id)


def sensitivity_rows(job_id: int) -> list[SensitivityRecord]:
    """The KL of each unit a sweep quantized alone, most sensitive first."""
    with session_scope(settings()) as s:
        return repo.list_sensitivity(s, job_id)


def stale_sweeps(model: ModelRecord) -> dict[int, tuple[str, str]]:
    """{sweep job id: (scheme, why to sweep again)} for the newest sweep of each scheme whose numerics changed since
    the quantplan that made it (quantcore.schemes.specs.numerics_changes; sensitivity jobs record ``numerics``)."""
    from quantcore.schemes.numerics import numerics_changes
    from quantcore.schemes.presets import get_scheme

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
    """"FP8_DYNAMIC", "FP8_DYNAMIC on 3 GPUs", "… on 2 GPUs, experts whole", "FP8_DYNAMIC (Fisher estimate)": what a
    sweep swept, as on how many GPUs, and whether it was estimated rather than measured."""
    tp, ep = sweep_parallel(job)
    return ((sweep_scheme(job) or "?") + (f" on {gpus_label(tp, ep)}" if tp > 1 else "")
            + (" (Fisher estimate)" if sweep_method(job) == "fisher" else ""))


def sweep_rotation(job: JobRecord) -> dict[str, Any] | None:
    """The rotation a sweep quantized every unit in (its result's ``rotation`` as RotationSpec.to_dict writes it),
    None for an unrotated one."""
    return _normal((job.result or {}).get("rotation"))


def _normal(rotation: Any) -> Any:
    """A transforms.rotation mapping in one spelling (defaults filled), None for none; one that does not parse is
    kept as it is (equal to no well-formed one)."""
    if not rotation:
        return None
    from quantcore.algorithms.rotation_spec import rotation_from_dict
    from quantcore.errors import PlanError

    try:
        return rotation_from_dict(rotation).to_dict()
    except PlanError:
        return rotation


def sweep_method(job: JobRecord) -> str:
    """"kl" (the exact sweep: every sweep before the estimate existed) or "fisher" (quantcore.evaluation.fisher)."""
    return str((job.params or {}).get("method") or "kl")


def exact_twin(job: JobRecord) -> JobRecord | None:
    """The newest exact sweep of ``job``'s model, scheme and GPUs over the very same tokens (text and shape), or
    None: what a Fisher estimate is checked against."""
    result = job.result or {}
    if job.model_id is None:
        return None
    for other in sensitivity_jobs(job.model_id):  # newest first
        theirs = other.result or {}
        if (other.id != job.id and sweep_method(other) == "kl" and sweep_scheme(other) == sweep_scheme(job)
                and sweep_parallel(other) == sweep_parallel(job) and theirs.get("text") == result.get("text")
                and theirs.get("tokens") == result.get("tokens")
                and bool(other.params.get("groups", True)) == bool(job.params.get("groups", True))
                and sweep_rotation(other) == sweep_rotation(job)):
            return other
    return None


def rank_correlation(estimate_job: int, exact_job: int) -> dict[str, Any]:
    """Spearman's rank correlation of two sweeps' per-unit KL over the units both have:
    ``{"exact_job", "units", "spearman"}``."""
    from quantcore.planning.correction import spearman

    est = {r.unit: r.kl_mean for r in sensitivity_rows(estimate_job)}
    exact = {r.unit: r.kl_mean for r in sensitivity_rows(exact_job)}
    common = [u for u in exact if u in est]
    return {"exact_job": exact_job, "units": len(common),
            "spearman": spearman([exact[u] for u in common], [est[u] for u in common])}


def planner_sweeps(model: ModelRecord, tensor_parallel: int = 1, expert_parallel: bool = False,
                   method: str = "kl", rotation: dict[str, Any] | None = None) -> list[JobRecord]:
    """The sweeps of linear layers a plan for ``tensor_parallel`` GPUs reads, oldest first (a later one replaces an
    earlier one's units): those made on that many GPUs (as ``expert_parallel``), and for a scheme not swept so, its
    one-GPU sweeps. Those stand in exactly for every scheme but one with a dynamic per-tensor or per-token
    activation scale on a row-parallel layer (o_proj, down_proj), where each GPU's own scale makes the served KL
    lower. ``method``: the exact sweeps ("kl") or the Fisher estimates ("fisher"); the two are never mixed, nor are
    sweeps made in a rotated model (their result's ``rotation``, issue #46) with the unrotated ones: ``rotation``
    (a plan's transforms.rotation as RotationSpec.to_dict writes it) reads the sweeps made rotated so, None the
    unrotated ones."""
    at = (tensor_parallel, tensor_parallel > 1 and expert_parallel)
    linear = [j for j in reversed(sensitivity_jobs(model.id))  # oldest first
              if not sweep_scheme(j).startswith(repo.KV_SWEEP_PREFIX) and sweep_method(j) == method
              and sweep_rotation(j) == _normal(rotation)]
    swept_at = schemes_swept_on(linear, *at)
    return [j for j in linear if sweep_parallel(j) == at
            or (sweep_parallel(j) == (1, False) and sweep_scheme(j) not in swept_at)]


def schemes_swept_on(sweeps: list[JobRecord], tensor_parallel: int, expert_parallel: bool = False) -> set[str]:
    """The schemes of those ``sweeps`` made as served on exactly ``tensor_parallel`` GPUs (as ``expert_parallel``):
    of :func:`planner_sweeps`' list for several GPUs, the ones no one-GPU sweep stands in for."""
    at = (tensor_parallel, tensor_parallel > 1 and expert_parallel)
    return {sweep_scheme(j) for j in sweeps if sweep_parallel(j) == at}


def split_scale_schemes(schemes: Iterable[str]) -> list[str]:
    """Those of ``schemes`` whose activation scale is dynamic over K (per tensor or per token): the ones each GPU
    of a split row-parallel layer scales on its own share, so a one-GPU sweep of them overstates the KL there."""
    from quantcore.schemes.presets import get_scheme

    return sorted({s for s in schemes if get_scheme(s).scaled_per_gpu_share})


def same_on_any_gpus(scheme: str, tensor_parallel: int) -> str | None:
    """Why a sweep of ``scheme`` asked for on ``tensor_parallel`` GPUs is made on one instead (its weights, static
    and group / block scales are the same on any number of GPUs: the sweep would repeat the one-GPU sweep to the last
    digit), or None where the GPUs change its numbers (:func:`split_scale_schemes`) or one GPU was asked for."""
    if tensor_parallel <= 1 or split_scale_schemes([scheme]):
        return None
    return (f"{scheme} has no dynamic activation scale over K, so it quantizes the same on any number of GPUs: swept "
            f"on one GPU, which a plan for {tensor_parallel} reads exactly")


def sensitivity_map(model: ModelRecord, tensor_parallel: int = 1, expert_parallel: bool = False, method: str = "kl",
                    rotation: dict[str, Any] | None = None
                    ) -> tuple[dict[str, dict[str, float]], dict[str, list[str]]]:
    """{scheme: {unit: KL}} and {unit: layers} over the stored sensitivity sweeps of the model's linear layers
    that a plan on ``tensor_parallel`` GPUs reads (:func:`planner_sweeps`, of ``method``: exact or Fisher; KV cache
    sweeps, whose units are attention layers, are :func:`kv_sensitivity`'s); ``rotation``: those made rotated so."""
    from quantcore.planning.autoplan import sensitivity_from_rows

    rows: list[Any] = []
    for job in planner_sweeps(model, tensor_parallel, expert_parallel, method, rotation):
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


def sensitivity_by_scheme(model: ModelRecord, tensor_parallel: int = 1, expert_parallel: bool = False
                          ) -> pd.DataFrame:
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
    from jobs.specs import TOKEN_DEFAULTS

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
    from jobs.specs import TOKEN_DEFAULTS

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
