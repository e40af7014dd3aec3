"""How many calibration tokens each routed expert of an MoE model saw, and the router's distribution (issue 43).

Calibration runs every expert on every token (:func:`quantcore.models.moe.all_experts`), so an expert's statistics
never rest on nothing; but serving sends it only the tokens its router picks, and an expert the router picked for a
handful of calibration tokens has static scales, GPTQ Hessians and outlier figures measured on inputs it will
rarely see in that form. :func:`expert_coverage_observed` records, per MoE block (a
:class:`quantcore.models.moe.LinearExperts`), the tokens that entered it, how many of them the router sent to each
expert, and the sum of the routing weights each expert got; :func:`thin_experts` names the experts below
:data:`MIN_EXPERT_TOKENS`. The record is plain JSON, stored with the calibration (its job result,
``experts``); the module imports torch only where it observes a model.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch-free at import: the Outliers page and the CLI read stored records with this module
    import torch
    from torch import nn

# An expert routed fewer calibration tokens than this is flagged: a static activation scale is the max over the
# tokens seen, and with fewer than a few dozen routed tokens it (and an outlier channel's rank) is set by a handful
# of rows; llm-compressor's MoE guidance is to calibrate until every expert has seen enough tokens.
MIN_EXPERT_TOKENS = 32


@dataclass
class BlockCoverage:
    """One MoE block: the tokens that entered it, the routed tokens and routing weight of each expert."""

    tokens: int = 0
    top_k: int = 0
    counts: list[int] = field(default_factory=list)
    weight: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "top_k": self.top_k, "counts": list(self.counts),
                "weight": [round(w, 6) for w in self.weight]}


@dataclass
class ExpertCoverage:
    """{MoE block name: :class:`BlockCoverage`}, filled while :func:`expert_coverage_observed` is active."""

    blocks: dict[str, BlockCoverage] = field(default_factory=dict)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: b.to_dict() for name, b in self.blocks.items()}


def _routing(args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(top_k_index [T, k], top_k_weights [T, k]) of a LinearExperts call, positional or by keyword."""
    import torch

    index = args[1] if len(args) > 1 else kwargs.get("top_k_index")
    weights = args[2] if len(args) > 2 else kwargs.get("top_k_weights")
    if not isinstance(index, torch.Tensor) or not isinstance(weights, torch.Tensor):
        return None
    return index, weights


@contextmanager
def expert_coverage_observed(model: nn.Module) -> Iterator[ExpertCoverage]:
    """Within the block, every call of every :class:`LinearExperts` of ``model`` adds its routing to the yielded
    record (no MoE block: it stays empty). The hooks are removed on exit, also on error."""
    import torch

    from quantcore.models.moe import LinearExperts

    coverage = ExpertCoverage()
    handles = []

    def observer(name: str, experts: LinearExperts) -> Any:
        def hook(_mod: nn.Module, args: tuple, kwargs: dict) -> None:
            got = _routing(args, kwargs)
            if got is None:
                return
            index, weights = got
            n = experts.num_experts
            block = coverage.blocks.setdefault(name, BlockCoverage(counts=[0] * n, weight=[0.0] * n))
            with torch.no_grad():
                flat = index.reshape(-1).long()
                valid = flat < n  # an index of n is a token routed nowhere (expert parallelism)
                counts = torch.bincount(flat[valid], minlength=n)[:n]
                wsum = torch.zeros(n, dtype=torch.float64, device=flat.device).index_add_(
                    0, flat[valid], weights.reshape(-1)[valid].double())
            block.tokens += int(index.shape[0])
            block.top_k = int(index.shape[-1]) if index.dim() > 1 else 1
            block.counts = [c + int(v) for c, v in zip(block.counts, counts.tolist(), strict=True)]
            block.weight = [w + float(v) for w, v in zip(block.weight, wsum.tolist(), strict=True)]
        return hook

    for name, module in model.named_modules():
        if isinstance(module, LinearExperts):
            handles.append(module.register_forward_pre_hook(observer(name, module), with_kwargs=True))
    try:
        yield coverage
    finally:
        for h in handles:
            h.remove()


def thin_experts(coverage: Mapping[str, Mapping[str, Any]] | None,
                 min_tokens: int = MIN_EXPERT_TOKENS) -> list[tuple[str, int, int]]:
    """(block, expert index, routed tokens) of every expert routed fewer than ``min_tokens`` calibration tokens, in
    a stored coverage record (:meth:`ExpertCoverage.to_dict`); [] for none or no record."""
    out = []
    for block, rec in (coverage or {}).items():
        for e, count in enumerate(rec.get("counts") or []):
            if int(count) < min_tokens:
                out.append((block, e, int(count)))
    return out


def coverage_rows(coverage: Mapping[str, Mapping[str, Any]] | None,
                  min_tokens: int = MIN_EXPERT_TOKENS) -> list[dict[str, Any]]:
    """One row per block and expert of a stored record: block, expert, tokens routed, share of the block's routed
    assignments, mean routing weight, and whether it is thin (below ``min_tokens``)."""
    rows = []
    for block, rec in (coverage or {}).items():
        counts = [int(c) for c in rec.get("counts") or []]
        weight = [float(w) for w in rec.get("weight") or [0.0] * len(counts)]
        total = sum(counts) or 1
        for e, (count, w) in enumerate(zip(counts, weight, strict=False)):
            rows.append({"block": block, "expert": e, "tokens": count, "share": count / total,
                         "mean_weight": (w / count) if count else 0.0, "thin": count < min_tokens})
    return rows
