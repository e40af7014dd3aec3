"""Layer targets as compressed-tensors matches them: exact module names, ``re:`` patterns, or the class name
``Linear`` (torch-free). :func:`compact_targets` writes the fewest patterns that select exactly some layers; plans
use it to name layers in messages, the export targets to write ``targets`` and ``ignore``."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import cast

from quantcore.schemes.fusion import expert_blocks

LINEAR_CLASS = "Linear"  # class-name target matching every nn.Linear

_NUM_PART = re.compile(r"^\d+$")


def _template(name: str) -> tuple[str, str, str] | None:
    """(prefix, index, suffix) around the first all-digit path component, or None."""
    parts = name.split(".")
    for i, p in enumerate(parts):
        if _NUM_PART.match(p) and 0 < i < len(parts) - 1:
            return ".".join(parts[:i]), p, ".".join(parts[i + 1 :])
    return None


def target_matches(pattern: str, name: str) -> bool:
    """compressed-tensors' name matching: exact, or ``re:`` with ``re.match``."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == name


def compact_targets(members: Sequence[str], universe: Sequence[str]) -> list[str]:
    """Target strings that match exactly ``members`` among ``universe`` (compressed-tensors matching).

    Layers repeated across decoder blocks collapse into one ``re:`` pattern: the leaf name
    (``re:.*\\.down_proj$``) when every such layer is a member, a block-index alternation
    (``re:model\\.layers\\.(?:0|5)\\.mlp\\.down_proj$``) when only some are; the routed experts of whole
    MoE blocks into one pattern over every expert (``re:.*\\.experts\\.\\d+\\.(?:down_proj|gate_proj|up_proj)$``)
    or over some blocks; anything else is listed by its exact name. Every pattern is checked against ``universe``.
    """
    member_set = set(members)
    universe = list(universe)
    covered: set[str] = set()
    out: list[str] = []

    def ok(pattern: str) -> set[str] | None:
        hits = {u for u in universe if target_matches(pattern, u)}
        return hits if hits and hits <= member_set else None

    # the routed experts of MoE blocks (a plan gives a block's experts one scheme): one pattern for the blocks
    blocks = {block: layers for block, layers in expert_blocks(universe).items() if set(layers) <= member_set}
    if blocks:
        leaves = "|".join(sorted({m.rsplit(".", 1)[-1] for b in blocks.values() for m in b}))
        names = {m for b in blocks.values() for m in b}
        found = {_template(block) for block in blocks}
        templates = {t for t in found if t is not None}
        block_patterns = [f"re:.*\\.experts\\.\\d+\\.(?:{leaves})$"]
        if len({(t[0], t[2]) for t in templates}) == 1 and None not in found:
            prefix, _, suffix = next(iter(templates))
            idx = "|".join(t[1] for t in sorted(templates, key=lambda t: int(t[1])))
            block_patterns.append(f"re:{re.escape(prefix)}\\.(?:{idx})\\.{re.escape(suffix)}\\.\\d+\\.(?:{leaves})$")
        for pattern in block_patterns:
            hits = ok(pattern)
            if hits is not None and names <= hits:
                out.append(pattern)
                covered |= hits
                break

    by_template: dict[tuple[str, str], list[str]] = {}
    for u in universe:
        t = _template(u)
        if t is not None:
            by_template.setdefault((t[0], t[2]), []).append(u)
    for name in members:
        if name in covered:
            continue
        t = _template(name)
        if t is None:
            out.append(name)
            covered.add(name)
            continue
        prefix, _, suffix = t
        same = by_template[(prefix, suffix)]
        chosen = [m for m in same if m in member_set]
        candidates: list[str] = []
        if len(chosen) == len(same):
            leaf = suffix.rsplit(".", 1)[-1]
            candidates += [
                f"re:.*\\.{re.escape(leaf)}$",
                f"re:.*\\.{re.escape(suffix)}$",
                f"re:{re.escape(prefix)}\\.\\d+\\.{re.escape(suffix)}$",
            ]
        if len(chosen) > 1:
            idx = "|".join(cast(tuple[str, str, str], _template(m))[1] for m in chosen)  # same template as name's
            candidates.append(f"re:{re.escape(prefix)}\\.(?:{idx})\\.{re.escape(suffix)}$")
        for pattern in candidates:
            hits = ok(pattern)
            if hits is not None and set(chosen) <= hits:
                out.append(pattern)
                covered |= hits
                break
        else:
            out.append(name)
            covered.add(name)
    return out


@dataclass(frozen=True)
class TargetMatcher:
    """Targets (or ignore entries) ready to match layer after layer: exact names in a set, so a config that lists
    thousands of experts by name matches in linear time."""

    exact: frozenset[str]
    patterns: tuple[str, ...]  # re: entries, sorted
    linear: bool  # the class name LINEAR_CLASS is among them

    @classmethod
    def of(cls, targets: Iterable[str]) -> TargetMatcher:
        targets = list(targets)
        return cls(frozenset(t for t in targets if not t.startswith("re:") and t != LINEAR_CLASS),
                   tuple(sorted(t for t in targets if t.startswith("re:"))), LINEAR_CLASS in targets)

    def first(self, layer: str) -> str | None:
        """The most specific target matching a linear layer (exact, then regex in sorted order, then the class),
        as compressed-tensors ranks them; None when none does."""
        if layer in self.exact:
            return layer
        hit = next((t for t in self.patterns if target_matches(t, layer)), None)
        return hit if hit is not None else (LINEAR_CLASS if self.linear else None)
