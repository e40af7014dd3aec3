"""Stored scores: what to say about them, which are comparable, and what each plan costs next to its KL."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

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


def list_scores(model_id: int | None = None) -> list[ScoreRecord]:
    """Every stored score (of one model, where given), newest first."""
    with session_scope(settings()) as s:
        return repo.list_scores(s, model_id)


REFERENCE_BYTES_PER_LOGPROB = 2  # quantcore.evaluation.reference.LOGPROB_DTYPE is float16 (a test keeps the two equal)


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


TRADEOFF_COLUMNS = ["job", "plan", "kl_mean", "top1_agree", "ppl", "weight_mib", "weight_ratio", "kv_cache", "kv_kib",
                    "serving_gib", "prefill_ms", "decode_ms", "ideal_prefill_ms", "ideal_decode_ms"]


def tradeoff_frame(model: ModelRecord, scores: list[ScoreRecord], *, device_name: str | None = None,
                   m_prefill: int | None = None, m_decode: int | None = None, target: str | None = None,
                   ideal_m_prefill: int = 2048, ideal_m_decode: int = 1,
                   serve: tuple[int, int] | None = None) -> pd.DataFrame:
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


def with_front(frame: pd.DataFrame, cost: str) -> pd.DataFrame:
    """``frame`` (a :func:`tradeoff_frame`) with a ``front`` column: True for the plans no other plan beats
    on both ``cost`` and KL (quantcore.planning.plans.pareto_front); a plan without that cost is never on it."""
    from quantcore.planning.plans import pareto_front

    if cost not in TRADEOFF_COSTS:
        raise Refused(f"unknown cost {cost!r}; choose from {', '.join(TRADEOFF_COSTS)}")
    points = [(float(c), float(k)) for c, k in zip(frame[cost], frame["kl_mean"], strict=True)]
    return frame.assign(front=pareto_front(points))


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
