"""Outlier fixes side by side (issue #46): which scored plans differ only in the fix (none, SmoothQuant, a Hadamard
rotation, or both), and the rotated calibrations a model has waiting.

A plan's *fix* is its ``transforms: {rotation: ...}`` and its SmoothQuant (``smoothquant_alpha``, per-layer alphas,
and the ``*_SQ`` presets, whose α is the preset's 0.5 unless the plan sets one); the rest of its body is its *base*.
Scores of one base on the same evaluation tokens (text and positions) with more than one fix are a comparison of the
fixes: the Results page shows them side by side, each against the one without a fix where there is one.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from quantcore.algorithms.rotation_spec import HADAMARD, ROTATIONS
from quantcore.evaluation.statistics import Estimate
from quantcore.schemes.presets import PRESET_SCHEMES, SQ_DEFAULT_ALPHA
from quantplan.services.deployment import settings
from quantplan.services.errors import Refused
from quantplan.services.scoring import figure_difference
from store import repo
from store.db import session_scope
from store.records import JobRecord, ScoreRecord

NO_FIX = "none"
_PEOPLE_KEYS = ("model", "name", "description")  # what a person writes about a plan: not part of what it does
_SQ = "_SQ"


def _unsmoothed(scheme: Any) -> tuple[Any, bool]:
    """(the preset ``scheme`` is without SmoothQuant, whether it smooths): INT8_W8A8_SQ_GPTQ → (INT8_W8A8_GPTQ, True);
    a scheme without a plain twin (or not a name) is itself."""
    if isinstance(scheme, str) and _SQ in scheme:
        plain = scheme.replace(_SQ, "", 1)
        if plain in PRESET_SCHEMES:
            return plain, True
    return scheme, False


@dataclass(frozen=True)
class PlanFix:
    """A plan body split into what it quantizes (``base``, canonical JSON) and its outlier fix.

    rotation: the ``transforms.rotation`` mapping (None: none); smoothquant: whether a ``*_SQ`` preset smooths some
    layer; alpha: the α of those presets (the plan's global one, else the presets' own); layer_alphas: the distinct
    per-layer alphas, sorted (each smooths its layer whatever the scheme).
    """

    base: str
    rotation: Mapping[str, Any] | None
    smoothquant: bool
    alpha: float
    layer_alphas: tuple[float, ...]

    @property
    def label(self) -> str:
        """'none', 'SmoothQuant α=0.5', 'rotation R1+R2+R4 (blocks of 64)', 'SmoothQuant α=0.75 + rotation R1', ..."""
        parts = []
        own = "/".join(f"{a:g}" for a in self.layer_alphas)
        if self.smoothquant:
            parts.append(f"SmoothQuant α={self.alpha:g}" + (f" (layers' own α {own})" if own else ""))
        elif own:
            parts.append(f"SmoothQuant on some layers, α {own}")
        if self.rotation:
            parts.append(rotation_text(self.rotation))
        return " + ".join(parts) or NO_FIX


def rotation_text(rotation: Mapping[str, Any] | None) -> str:
    """A plan's ``transforms.rotation`` in a few words: 'rotation R1+R2+R4 (blocks of 64)', 'rotation
    (random-hadamard, seed 3) R1'; 'none' for None."""
    if not rotation:
        return NO_FIX
    kind = str(rotation.get("kind") or HADAMARD)
    head = "rotation" if kind == HADAMARD else f"rotation ({kind}, seed {rotation.get('seed') or 0})"
    return (f"{head} {'+'.join(rotation.get('rotations') or ROTATIONS)}"
            + (f" (blocks of {rotation['block_size']})" if rotation.get("block_size") else ""))


def plan_fix(body: Mapping[str, Any]) -> PlanFix:
    """Split a scored plan's body (a plan file's content, or a preset's ``{default: NAME}``) into base and fix."""
    smooth = False
    base: dict[str, Any] = {k: v for k, v in body.items()
                            if k not in (*_PEOPLE_KEYS, "transforms", "smoothquant_alpha")}
    if "default" in base:
        base["default"], smooth = _unsmoothed(base["default"])
    rules = []
    for rule in base.get("rules") or []:
        scheme, sq = _unsmoothed(rule.get("scheme")) if isinstance(rule, Mapping) else (None, False)
        smooth |= sq
        rules.append({**rule, "scheme": scheme} if isinstance(rule, Mapping) else rule)
    layers: dict[str, Any] = {}
    layer_alphas: set[float] = set()
    for name, entry in (base.get("layers") or {}).items():
        if isinstance(entry, Mapping):
            if isinstance(entry.get("smoothquant_alpha"), int | float):
                layer_alphas.add(float(entry["smoothquant_alpha"]))
            entry = entry.get("scheme")
        if entry is not None:
            layers[name], sq = _unsmoothed(entry)
            smooth |= sq
    base["rules"], base["layers"] = rules, layers
    for key in ("rules", "layers"):  # a preset's {default: X} and a plan file without rules or overrides are one base
        if not base[key]:
            del base[key]
    transforms = body.get("transforms") or {}
    rotation = transforms.get("rotation") if isinstance(transforms, Mapping) else None
    alpha = body.get("smoothquant_alpha")
    return PlanFix(base=json.dumps(base, sort_keys=True, default=str), rotation=rotation or None, smoothquant=smooth,
                   alpha=float(alpha) if isinstance(alpha, int | float) else SQ_DEFAULT_ALPHA,
                   layer_alphas=tuple(sorted(layer_alphas)))


@dataclass(frozen=True)
class FixGroup:
    """Scores of one plan base on one set of evaluation tokens, one per fix (the newest of each), the unfixed first.

    title: what the plans quantize, in a few words; dataset / tokens: the evaluation set; fixes: each score's fix
    label, in the order of ``scores``.
    """

    title: str
    dataset: str
    tokens: int
    fixes: tuple[str, ...]
    scores: tuple[ScoreRecord, ...]


def _title(base: str) -> str:
    body = json.loads(base)
    what = str(body.get("default", "?"))
    extra = [f"{len(body['rules'])} rule(s)" for _ in [0] if body.get("rules")]
    extra += [f"{len(body['layers'])} layer override(s)" for _ in [0] if body.get("layers")]
    extra += [f"KV cache {body['kv_cache']}" for _ in [0] if body.get("kv_cache")]
    return what + (f" ({', '.join(extra)})" if extra else "")


def fix_groups(scores: Iterable[ScoreRecord]) -> list[FixGroup]:
    """The groups of ``scores`` (newest first, as :func:`quantplan.services.scoring.list_scores` gives them) that
    differ only in the fix: same base, same evaluation text and positions, at least two fixes; the newest score of
    each fix, the unfixed first, then by KL. Groups with the newest score first."""
    grouped: dict[tuple[str, str, int], dict[str, ScoreRecord]] = {}
    for s in scores:
        fix = plan_fix(s.plan_body or {})
        grouped.setdefault((fix.base, s.dataset, s.tokens), {}).setdefault(fix.label, s)  # newest of each fix
    out = []
    for (base, dataset, tokens), by_fix in grouped.items():
        if len(by_fix) < 2:
            continue
        order = sorted(by_fix, key=lambda f: (f != NO_FIX, by_fix[f].kl_mean))
        out.append(FixGroup(_title(base), dataset, tokens, tuple(order), tuple(by_fix[f] for f in order)))
    return out


def versus_unfixed(group: FixGroup, figure: str = "kl_mean") -> list[Estimate | None]:
    """Each score's ``figure`` minus the unfixed score's (paired over the same sequences where both kept them, else
    from the two errors): None for the unfixed score itself, for every score of a group without one, and where a
    score lacks the figure."""
    if not group.fixes or group.fixes[0] != NO_FIX:
        return [None] * len(group.scores)
    plain = group.scores[0]
    out: list[Estimate | None] = [None]
    for s in group.scores[1:]:
        try:
            out.append(figure_difference(s, plain, figure))
        except Refused:  # scored before the figure was kept
            out.append(None)
    return out


def pending_rotated_calibrations(model_id: int) -> list[JobRecord]:
    """The model's rotated calibrations still queued or running (the Outliers page says so instead of offering
    another), newest first."""
    with session_scope(settings()) as s:
        jobs = repo.list_jobs(s, kind="calibrate", model_id=model_id, status=("queued", "running"), limit=100)
    return [j for j in jobs if (j.params or {}).get("rotation")]


__all__: Sequence[str] = ("NO_FIX", "FixGroup", "PlanFix", "fix_groups", "pending_rotated_calibrations", "plan_fix",
                          "rotation_text", "versus_unfixed")
