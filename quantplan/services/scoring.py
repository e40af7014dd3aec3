"""Stored scores: what to say about them, which are comparable, and what each plan costs next to its KL."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from quantplan.services.deployment import settings
from quantplan.services.errors import Refused
from quantplan.services.kernels import kernel_records
from quantplan.services.models import layer_shapes, routed_layers, vocab_size
from quantplan.services.plans import kv_skipped, newest_plan, parallelism, resolve, served_weight_bytes
from quantplan.services.units import MIB
from store import repo
from store.db import session_scope
from store.records import ModelRecord, PlanRecord, ScoreRecord

if TYPE_CHECKING:
    import pandas as pd

    from quantcore.evaluation.statistics import Estimate


def list_scores(model_id: int | None = None) -> list[ScoreRecord]:
    """Every stored score (of one model, where given), newest first."""
    with session_scope(settings()) as s:
        return repo.list_scores(s, model_id)


def reference_cache_bytes(model: ModelRecord, samples: int, seq_len: int) -> tuple[str, int] | None:
    """What a score or sweep keeps of the unquantized model's predictions for this evaluation size, as its job
    chooses it (quantcore.evaluation.reference.choose_topk, the deployment's reference settings): ("full", bytes)
    for every log-prob of every position in float16, or ("top-k", bytes) for the compact record of k tokens a
    position plus k sampled tail tokens (quantcore.evaluation.compact); None when the vocabulary is unknown."""
    from quantcore.evaluation.compact import compact_bytes
    from quantcore.evaluation.reference import choose_topk, full_cache_bytes

    vocab = vocab_size(model)
    if not vocab:
        return None
    s = settings()
    k = choose_topk(samples, seq_len, vocab, full_max_bytes=int(s.reference_full_max_mb * 2**20),
                    topk=s.reference_topk)
    if k is None:
        return "full", full_cache_bytes(samples, seq_len, vocab)
    return f"top-{k}", compact_bytes(samples * (seq_len - 1), topk=k, tail_samples=k)


def score_notes(model: ModelRecord, score: ScoreRecord) -> list[str]:
    """What to tell a person about a stored score: what its job noticed, and whether older numerics make it
    incomparable with newer scores (quantcore.schemes.specs.numerics_changes: int weights scored before they moved to
    compressed-tensors' grid, NVFP4 activations before their tensor scale was calibrated, a plan for several GPUs
    scored as if on one)."""
    from quantcore.schemes.fusion import expert_block
    from quantcore.schemes.numerics import NUMERICS, numerics_changes

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


def score_sets(scores: list[ScoreRecord]) -> list[tuple[str, int]]:
    """The evaluation sets among ``scores`` as (text, positions scored), the set with most scores first.
    Scores on different sets are not comparable: a trade-off is drawn within one set."""
    from collections import Counter

    return [key for key, _ in Counter((s.dataset, s.tokens) for s in scores).most_common()]


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


TRADEOFF_COLUMNS = ["job", "plan", "kl_mean", "kl_mean_err", "top1_agree", "ppl", "weight_mib", "weight_ratio",
                    "kv_cache", "kv_kib",
                    "serving_gib", "prefill_ms", "decode_ms", "ideal_prefill_ms", "ideal_decode_ms"]


def tradeoff_frame(model: ModelRecord, scores: list[ScoreRecord], *, device_name: str | None = None,
                   m_prefill: int | None = None, m_decode: int | None = None, target: str | None = None,
                   ideal_m_prefill: int = 2048, ideal_m_decode: int = 1,
                   serve: tuple[int, int] | None = None) -> pd.DataFrame:
    """What each scored plan costs next to what it loses: the newest score of each plan among ``scores``.

    Columns (:data:`TRADEOFF_COLUMNS`): job, plan, kl_mean, kl_mean_err (its standard error; NaN for a score
    stored before errors were kept), top1_agree, ppl, weight_mib (the plan's
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
    from quantcore.kernels.estimate import step_estimate as estimate
    from quantcore.kernels.paths import scheme_path
    from quantcore.kernels.roofline import step_bound as bound
    from quantcore.planning.footprint import plan_footprint as footprint
    from quantcore.planning.plans import kv_label

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
        row = {"job": sc.job_id, "plan": sc.plan_label, "kl_mean": sc.kl_mean,
               "kl_mean_err": math.nan if sc.kl_mean_err is None else sc.kl_mean_err, "top1_agree": sc.top1_agree,
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
                prefill, decode = (bound(resolved, shapes, target, m, routed)
                                   for m in (ideal_m_prefill, ideal_m_decode))
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


def with_front(frame: pd.DataFrame, cost: str, scores: Sequence[ScoreRecord] = ()) -> pd.DataFrame:
    """``frame`` (a :func:`tradeoff_frame`) with a ``front`` column: the plans worth choosing between on ``cost``
    and KL, told apart within the KL's uncertainty (quantcore.evaluation.statistics.distinguishable_front).

    A plan is on the front when no other plan beats it on both cost and KL (point estimates), and, walking the front
    from the cheapest plan up, its KL is distinguishably lower (:func:`kl_difference`, paired where ``scores`` hold
    both plans' per-sequence KLs on the same tokens, else from ``kl_mean_err``) than that of every cheaper plan on
    it: a plan that costs more for a KL not told apart from a cheaper one's is left off. A plan without that cost is
    never on it; scores without errors compare as point estimates."""
    from quantcore.evaluation.statistics import distinguishable_front

    if cost not in TRADEOFF_COSTS:
        raise Refused(f"unknown cost {cost!r}; choose from {', '.join(TRADEOFF_COSTS)}")
    by_job = {sc.job_id: sc for sc in scores}
    jobs = [int(j) for j in frame["job"]]
    kls = [float(k) for k in frame["kl_mean"]]
    errs: list[float | None] = ([None if e != e else float(e) for e in frame["kl_mean_err"]]
                                if "kl_mean_err" in frame else [None] * len(jobs))

    def difference(i: int, j: int) -> Estimate:
        a, b = by_job.get(jobs[i]), by_job.get(jobs[j])
        if a is not None and b is not None:
            return kl_difference(a, b)
        from quantcore.evaluation.statistics import Estimate, independent_difference

        return independent_difference(Estimate(kls[i], errs[i]), Estimate(kls[j], errs[j]))

    points: list[float | None] = [float(c) for c in frame[cost]]
    return frame.assign(front=distinguishable_front(points, kls, difference))


# ---------------------------------------------------------------------- comparing two scores

# per-sequence means a paired comparison reads, by figure; higher_is_better says which way "better" points
PAIRED_FIGURES: dict[str, tuple[str, bool, str]] = {
    "kl_mean": ("kl_by_sequence", False, "KL"),
    "top1_agree": ("top1_by_sequence", True, "top-1 agreement"),
    "ln_ppl_ratio": ("nll_diff_by_sequence", False, "ln(PPL(Q)/PPL(base))"),
}
FIGURE_ERRORS = {"kl_mean": "kl_mean_err", "top1_agree": "top1_agree_err", "ln_ppl_ratio": "ln_ppl_ratio_err"}


def paired(a: ScoreRecord, b: ScoreRecord, figure: str = "kl_mean") -> bool:
    """Whether two scores were measured on the very same tokens and kept their per-sequence means of ``figure``:
    the same evaluation set key and as many sequences."""
    key = PAIRED_FIGURES[figure][0]
    ka, kb = a.figure("eval_key"), b.figure("eval_key")
    xa, xb = a.figure(key), b.figure(key)
    return bool(ka) and ka == kb and bool(xa) and bool(xb) and len(xa) == len(xb)


def figure_difference(a: ScoreRecord, b: ScoreRecord, figure: str = "kl_mean") -> Estimate:
    """``figure(a) - figure(b)`` with its standard error: paired sequence by sequence where :func:`paired`, else
    from the two errors in quadrature (None where either score has none: one sequence, or stored before errors)."""
    from quantcore.evaluation.statistics import Estimate, independent_difference, paired_difference

    if paired(a, b, figure):
        key = PAIRED_FIGURES[figure][0]
        return paired_difference(a.figure(key), b.figure(key))
    value_a, value_b = a.figure(figure), b.figure(figure)
    if value_a is None or value_b is None:
        raise Refused(f"a score has no {PAIRED_FIGURES[figure][2]} (scored before it was kept): score it again")
    err = FIGURE_ERRORS[figure]
    return independent_difference(Estimate(value_a, a.figure(err)), Estimate(value_b, b.figure(err)))


def kl_difference(a: ScoreRecord, b: ScoreRecord) -> Estimate:
    """KL(a) - KL(b) with its error (:func:`figure_difference`)."""
    return figure_difference(a, b, "kl_mean")


@dataclass(frozen=True)
class Comparison:
    """Two scores compared on one figure.

    difference: figure(a) - figure(b) with its standard error
    paired:     whether it was computed sequence by sequence on the same tokens
    verdict:    what a person reads: "indistinguishable at this sample size", "A is better by x ± y", or why no
                verdict can be given
    better:     the label of the better plan when distinguishable, else None
    """

    figure: str
    difference: Estimate
    paired: bool
    verdict: str
    better: str | None


def compare_scores(a: ScoreRecord, b: ScoreRecord, figure: str = "kl_mean") -> Comparison:
    """Which of two scores is better on ``figure`` (kl_mean, top1_agree or ln_ppl_ratio), and whether this many
    evaluation sequences can tell: |difference| > Z · error (quantcore.evaluation.statistics.Z = 2, about 95 %)."""
    from quantcore.evaluation.statistics import Z, distinguishable

    if figure not in PAIRED_FIGURES:
        raise Refused(f"unknown figure {figure!r}; compare on one of {', '.join(PAIRED_FIGURES)}")
    if (a.dataset, a.tokens) != (b.dataset, b.tokens):
        raise Refused(f"#{a.job_id} and #{b.job_id} were scored on different tokens ({a.dataset}, {a.tokens:,} "
                      f"positions; {b.dataset}, {b.tokens:,}): score them on the same text and size to compare")
    _, higher, name = PAIRED_FIGURES[figure]
    diff = figure_difference(a, b, figure)
    is_paired = paired(a, b, figure)
    how = "paired over the same sequences" if is_paired else "from the two scores' own errors (not paired)"
    fmt = ".3g"
    la, lb = f"#{a.job_id} {a.plan_label}", f"#{b.job_id} {b.plan_label}"
    if diff.err is None:
        why = ("one sequence: no error estimate" if (a.figure("sequences") == 1 or b.figure("sequences") == 1)
               else "a score was stored before errors were kept: score it again")
        return Comparison(figure, diff, is_paired, f"{name} differs by {format(diff.value, fmt)}; no verdict: {why}",
                          None)
    if not distinguishable(diff, Z):
        return Comparison(figure, diff, is_paired,
                          f"indistinguishable at this sample size: {name} {la} − {lb} = {diff.text(fmt)} ({how}; "
                          f"a difference counts beyond {Z:g} standard errors)", None)
    a_better = (diff.value > 0) == higher
    better, worse = (la, lb) if a_better else (lb, la)
    size = f"{format(abs(diff.value), fmt)} ± {format(diff.err, fmt)}"
    return Comparison(figure, diff, is_paired, f"{better} is better by {size} in {name} than {worse} ({how})",
                      better)


def err_text(err: float | None, fmt: str = ".2g") -> str:
    """A standard error as a table shows it; "—" where there is none (one sequence, or stored before errors)."""
    return "—" if err is None else format(err, fmt)


def pm_text(value: float | None, err: float | None, fmt: str = ".4g") -> str:
    """'0.0367 ± 0.0021'; '0.0367 ± —' without an error; '—' without the figure (scored before it was kept)."""
    if value is None:
        return "—"
    return f"{format(value, fmt)} ± {err_text(err, '.2g')}"


KLD = "10.6g"  # KL figures span decades (1e-5 for FP8 on a small model, 1 for W4 on lm_head): significant digits


def statistics_lines(r: Mapping[str, Any]) -> list[str]:
    """A llama.cpp-like block (``llama-perplexity --kl-divergence``) of a score's figures, ``r`` a score job's result
    or a stored score's metrics and statistics; "—" where a figure is missing (scored before it was kept)."""

    def num(key: str, fmt: str = "10.6f", scale: float = 1.0) -> str:
        v = r.get(key)
        return f"{'—':>10}" if v is None else format(v * scale, fmt)

    def pm(key: str, fmt: str = "10.6f", scale: float = 1.0, unit: str = "") -> str:
        return f"{num(key, fmt, scale)} ± {num(key + '_err', fmt, scale)}{unit}"

    pct = [("p999", "99.9%   "), ("p99", "99.0%   "), ("p95", "95.0%   "), ("p90", "90.0%   "), ("p50", "Median  "),
           ("p10", "10.0%   "), ("p05", " 5.0%   "), ("p01", " 1.0%   "), ("p001", " 0.1%   ")]
    lines = ["====== Perplexity statistics ======",
             f"Mean PPL(Q)                   : {num('ppl')}",
             f"Mean PPL(base)                : {num('ppl_ref')}",
             f"Mean ln(PPL(Q)/PPL(base))     : {pm('ln_ppl_ratio')}",
             "", "====== KL divergence statistics ======",
             f"Mean    KLD: {pm('kl_mean', KLD)}",
             f"Maximum KLD: {num('kl_max', KLD)}"]
    lines += [f"{label}KLD: {num('kl_' + key, KLD)}" for key, label in pct]
    lines += [f"Minimum KLD: {num('kl_min', KLD)}", "", "====== Token probability statistics ======"]
    if r.get("dp_mean") is None:
        lines.append("Δp (reference's top token): —")
    else:
        lines.append(f"Mean    Δp: {pm('dp_mean', '7.3f', 100, ' %')}")
        lines.append(f"Maximum Δp: {num('dp_max', '7.3f', 100)} %")
        lines += [f"{label}Δp: {num('dp_' + key, '7.3f', 100)} %" for key, label in pct]
        lines.append(f"Minimum Δp: {num('dp_min', '7.3f', 100)} %")
        lines.append(f"RMS Δp    : {pm('dp_rms', '7.3f', 100, ' %')}")
    lines.append(f"Same top p: {num('top1_agree', '7.3f', 100)} ± {num('top1_agree_err', '7.3f', 100)} %")
    seqs = r.get("sequences")
    if seqs == 1:
        lines.append("(one sequence: no error estimate)")
    elif seqs:
        lines.append(f"(± one standard error over {seqs} sequences as independent blocks; percentiles by linear "
                     "interpolation)")
    return lines


def rollout_lines(rollout: Mapping[str, Any] | None) -> list[str]:
    """A score's rollout drift (quantcore.evaluation.rollouts.RolloutReport as a dict) in a few lines; none
    where the score sampled no rollouts."""
    if not rollout:
        return []
    err = rollout.get("log_ratio_err")
    eps = rollout["clip_eps"]
    return ["", f"====== Rollout drift: {rollout['count']} rollouts of {rollout['length']:,} tokens sampled from "
                f"the quantized model ======",
            f"Σ log p_q − log p_ref per rollout: {rollout['log_ratio_mean']:.4g}"
            + (f" ± {err:.2g}" if err is not None else " (one rollout: no error estimate)")
            + f" nats (std {rollout['log_ratio_std']:.3g}; 5% {rollout['log_ratio_p05']:.3g}, "
              f"median {rollout['log_ratio_p50']:.3g}, 95% {rollout['log_ratio_p95']:.3g})",
            f"per token: {rollout['log_ratio_per_token']:.4g} nats (an estimate of KL(q ‖ p_ref))",
            f"importance ratio p_ref/p_q outside PPO's clip [{1 - eps:g}, {1 + eps:g}]: "
            f"{100 * rollout['outside_clip']:.1f} % of rollouts, {100 * rollout['tokens_outside_clip']:.2f} % of "
            "tokens"]


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
