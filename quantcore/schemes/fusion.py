"""Fusion groups and plan units (torch-free).

Serving engines fuse the linears that read the same input (q/k/v of an attention block, gate/up of a gated MLP) into
one GEMM, so they must share one scheme and SmoothQuant must treat their input as one. :func:`fusion_groups` finds
them by name. The routed experts of one MoE block are one fused MoE layer in vLLM: a plan gives the whole block one
scheme (:func:`expert_blocks`, :func:`fusion_units`).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable

from quantcore.models.architectures import FUSED_GROUPS, LLAMA_STYLE

# (leaf name pattern, group kind, canonical member order), from the architecture registry's fused groups. A layer
# "a.b.q_proj" belongs to the group keyed by (its parent path "a.b", kind).
_FUSION_RULES: tuple[tuple[re.Pattern[str], str, tuple[str, ...]], ...] = tuple(
    (
        re.compile(rf"^(?:(?P<parent>{g.parent})\.){'?' if g.optional_parent else ''}"
                   rf"(?P<leaf>{'|'.join(re.escape(m) for m in g.members)})$"),
        g.kind,
        g.members,
    )
    for g in FUSED_GROUPS
)


def _fusion_key(name: str) -> tuple[tuple[str, str], int] | None:
    """((parent path, group kind), member rank) of a layer name, or None if it fuses with nothing."""
    for pattern, kind, order in _FUSION_RULES:
        match = pattern.match(name)
        if match:
            return (match.group("parent") or "", kind), order.index(match.group("leaf"))
    return None


def fusion_groups(layer_names: Iterable[str]) -> list[list[str]]:
    """Groups of two or more layers that read the same input and are fused at serving time.

    Returns groups in order of first appearance, members in canonical order (q, k, v /
    gate, up). Layers that fuse with nothing are not listed; duplicates are ignored.

    >>> fusion_groups(["m.0.self_attn.q_proj", "m.0.self_attn.k_proj", "m.0.self_attn.v_proj", "m.0.self_attn.o_proj"])
    [['m.0.self_attn.q_proj', 'm.0.self_attn.k_proj', 'm.0.self_attn.v_proj']]
    """
    return [list(g) for g in _fusion_groups(tuple(layer_names))]


# A model's layer names are asked about again and again while a page draws (every check resolves the plan): the
# groups of the few models in play are kept. Names in, tuples out, so no caller can change what is kept.
_NAMES_CACHE = 16


@functools.lru_cache(maxsize=_NAMES_CACHE)
def _fusion_groups(layer_names: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    groups: dict[tuple[str, str], dict[str, int]] = {}
    for name in layer_names:
        keyed = _fusion_key(name)
        if keyed is None:
            continue
        key, rank = keyed
        groups.setdefault(key, {}).setdefault(name, rank)
    return tuple(tuple(sorted(members, key=lambda n: (members[n], n)))  # noqa: B023 - sorted at once
                 for members in groups.values() if len(members) >= 2)


def fusion_group_of(name: str, layer_names: Iterable[str]) -> list[str]:
    """The fusion group containing ``name`` among ``layer_names``, or ``[name]`` if it fuses with nothing."""
    names = tuple(layer_names)
    index, known = _fusion_index(names)
    if name not in known:  # a name from elsewhere: the groups it would form with these
        index, _ = _fusion_index((*names, name))
    return list(index.get(name, (name,)))


@functools.lru_cache(maxsize=_NAMES_CACHE)
def _fusion_index(layer_names: tuple[str, ...]) -> tuple[dict[str, tuple[str, ...]], frozenset[str]]:
    """({member: its fusion group} of :func:`fusion_groups`, every name) of ``layer_names``."""
    return {m: g for g in _fusion_groups(layer_names) for m in g}, frozenset(layer_names)


# The routed experts of one MoE block (quantcore.models.moe names them <block>.experts.<e>.<gate|up|down>_proj, as
# llm-compressor does) are one fused MoE layer in vLLM, which quantizes every expert and projection of it with
# one method: a plan gives the whole block one scheme.
_EXPERT_RE = re.compile(rf"^(?P<block>.*\.{re.escape(LLAMA_STYLE.experts)})\.\d+\."
                        rf"(?:{'|'.join(re.escape(leaf) for leaf in (*LLAMA_STYLE.gate_up, LLAMA_STYLE.down_proj))})$")


def expert_block(name: str) -> str | None:
    """The MoE block (``model.layers.3.mlp.experts``) whose routed expert ``name`` is, or None."""
    match = _EXPERT_RE.match(name)
    return match.group("block") if match else None


def expert_blocks(layer_names: Iterable[str]) -> dict[str, list[str]]:
    """{MoE block: its expert linears, in model order} of the routed experts among ``layer_names``."""
    return {block: list(names) for block, names in _expert_blocks(tuple(layer_names))}


@functools.lru_cache(maxsize=_NAMES_CACHE)
def _expert_blocks(layer_names: tuple[str, ...]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    blocks: dict[str, list[str]] = {}
    for name in dict.fromkeys(layer_names):
        block = expert_block(name)
        if block is not None:
            blocks.setdefault(block, []).append(name)
    return tuple((block, tuple(names)) for block, names in blocks.items())


def fusion_units(layer_names: Iterable[str], *, per_expert: bool = False) -> list[list[str]]:
    """The units a plan is made of: every MoE block's experts, every fusion group, and every other layer
    alone, in model order (a unit sits at its first member's position). ``per_expert`` (a plan's ``per_expert:
    true``): every routed expert (its gate/up/down) is a unit of its own instead of the whole block one."""
    names = list(dict.fromkeys(layer_names))
    group_of: dict[str, list[str]] = {}
    for g in fusion_groups(names):
        for m in g:
            group_of[m] = g
    for g in expert_blocks(names).values():
        for part in expert_parts(g) if per_expert else [g]:
            for m in part:
                group_of[m] = part
    units: list[list[str]] = []
    seen: set[str] = set()
    for n in names:
        if n in seen:
            continue
        unit = group_of.get(n, [n])
        seen.update(unit)
        units.append(list(unit))
    return units


def expert_parts(members: Iterable[str]) -> list[list[str]]:
    """An MoE block's expert linears one list per expert (``experts.3.gate_proj``, ``.up_proj``, ``.down_proj``), in
    the order they come."""
    by_expert: dict[str, list[str]] = {}
    for n in members:
        by_expert.setdefault(n.rsplit(".", 1)[0], []).append(n)
    return list(by_expert.values())


def plan_unit_of(name: str, layer_names: Iterable[str]) -> list[str]:
    """The unit of :func:`fusion_units` holding ``name``: the layers that must share its scheme."""
    block = expert_block(name)
    names = tuple(layer_names)
    if block is not None:
        return list(dict(_expert_blocks(names)).get(block, (name,)))
    return fusion_group_of(name, names)
