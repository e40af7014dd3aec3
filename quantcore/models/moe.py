"""Mixture-of-experts blocks: their experts as one ``nn.Linear`` per projection, as serving sees them.

transformers 5 keeps the experts of an MoE block as 3-D parameters (``experts.gate_up_proj`` of shape
(E, 2·I, H), ``experts.down_proj`` (E, H, I)) and runs them with ``F.linear`` on a slice, so an MoE model
shows no ``nn.Linear`` for the bulk of its weights: a plan, a calibration or a score that looks for
linears would see only the attention projections and the head. Checkpoints on disk, llm-compressor and
vLLM all name one linear per expert and projection. :func:`split_experts` replaces every fused experts
module of the standard layout (the classes transformers decorates with ``use_experts_implementation``:
Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, ...) by :class:`LinearExperts`, a list of :class:`ExpertMLP`
with ``gate_proj`` / ``up_proj`` / ``down_proj``: the names llm-compressor's ``linearize_moe`` gives them
(``model.layers.3.mlp.experts.7.gate_proj``), so an exported recipe names the layers oneshot quantizes.
The forward is transformers' eager one, expert by expert, so logits are unchanged.

Routing decides which tokens an expert sees, so with a small calibration set some experts see few tokens
or none, and a static activation scale or a GPTQ Hessian of theirs would rest on nothing. llm-compressor's
``oneshot`` therefore calibrates with every expert run on every token (``moe_calibrate_all_experts``, on
by default) and keeps only the routed tokens' outputs. :func:`all_experts` does the same here: quantplan's
calibration passes (statistics, GPTQ Hessians) run inside it, so what they record is what llm-compressor's
observers record, and the model's outputs are unchanged. Scoring runs the routed experts only, as serving
does.

Fused experts of another layout (interleaved gate/up such as gpt-oss, a post-expert norm, a gate
function of the model's own) are left fused; :func:`unsplit_experts` names them so intake can say that
their weights are not in the plan.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "top_k", "num_experts_per_token")


_ALL_EXPERTS = False  # inside all_experts(): every expert runs on every token


@contextmanager
def all_experts() -> Iterator[None]:
    """Within it, every :class:`LinearExperts` runs each expert on every token (its hooks see them all) and
    keeps the routed tokens' outputs only, as llm-compressor's ``moe_calibration_context``."""
    global _ALL_EXPERTS
    before, _ALL_EXPERTS = _ALL_EXPERTS, True
    try:
        yield
    finally:
        _ALL_EXPERTS = before


def _default_gate() -> Any:
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:  # a transformers without fused experts: nothing to split
        return None
    return _default_apply_gate


def _is_fused(module: nn.Module) -> bool:
    """A transformers fused experts module: 3-D ``down_proj`` plus ``gate_up_proj`` or ``up_proj``."""
    down = getattr(module, "down_proj", None)
    up = getattr(module, "gate_up_proj", None)
    if up is None:
        up = getattr(module, "up_proj", None)
    return (isinstance(down, nn.Parameter) and down.dim() == 3
            and isinstance(up, nn.Parameter) and up.dim() == 3)


def _splittable(module: nn.Module) -> bool:
    """Fused experts of the standard layout, whose eager forward :class:`LinearExperts` reproduces."""
    gate = _default_gate()
    return (
        gate is not None
        and hasattr(module, "act_fn")
        and getattr(module, "is_concatenated", False) is True
        and getattr(module, "has_post_expert_norm", False) is False
        and isinstance(getattr(module, "is_transposed", None), bool)
        and isinstance(getattr(module, "has_bias", None), bool)
        and (getattr(module, "has_gate", None) is False or getattr(type(module), "_apply_gate", None) is gate)
    )


def _fused_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if _is_fused(m)]


def unsplit_experts(model: nn.Module) -> list[str]:
    """Names of the fused experts modules still in ``model`` (after :func:`split_experts`: the layouts it
    does not know)."""
    return [name for name, _ in _fused_modules(model)]


class ExpertMLP(nn.Module):
    """One expert: ``down_proj(act(gate_proj(x)) * up_proj(x))``, or ``down_proj(act(up_proj(x)))`` without
    a gate."""

    def __init__(self, hidden: int, intermediate: int, *, gate: bool, bias: bool, act_fn: nn.Module,
                 device: Any, dtype: torch.dtype) -> None:
        super().__init__()
        kw = dict(bias=bias, device=device, dtype=dtype)
        if gate:
            self.gate_proj = nn.Linear(hidden, intermediate, **kw)
        self.up_proj = nn.Linear(hidden, intermediate, **kw)
        self.down_proj = nn.Linear(intermediate, hidden, **kw)
        self.act_fn = act_fn

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """The input of ``down_proj``: ``act(gate_proj(x)) * up_proj(x)``."""
        if hasattr(self, "gate_proj"):
            return self.act_fn(self.gate_proj(x)) * self.up_proj(x)
        return self.act_fn(self.up_proj(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.hidden(x))


class LinearExperts(nn.ModuleList):
    """The experts of one MoE block as :class:`ExpertMLP` modules; called like transformers' fused experts
    (``hidden_states`` [T, H], ``top_k_index`` [T, k], ``top_k_weights`` [T, k])."""

    def __init__(self, experts: list[ExpertMLP]) -> None:
        super().__init__(experts)
        self.num_experts = len(experts)
        # set by quantcore.algorithms.apply while a plan gives the experts dynamic per-tensor activation scales: the
        # amax of the block's input ("w13") and of every routed expert's down_proj input together ("w2") for this call,
        # which vLLM's fused MoE quantizes as one tensor each
        self.block_amax: dict[str, torch.Tensor] | None = None
        # the GPUs' shares of the down_proj input under tensor parallelism (each GPU's fused MoE quantizes its own
        # K / w2_shards of it): "w2" then holds one amax per share
        self.w2_shards = 1

    def expert(self, index: int) -> ExpertMLP:
        """The expert at ``index``; TypeError if something else was put into the list."""
        expert = self[index]
        if not isinstance(expert, ExpertMLP):
            raise TypeError(f"LinearExperts holds ExpertMLP modules only; [{index}] is a {type(expert).__name__}")
        return expert

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():  # an index of num_experts is a token routed nowhere (expert parallelism)
            mask = nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        experts: Sequence[int] = (range(self.num_experts) if _ALL_EXPERTS
                                  else [i for (i,) in hit.tolist() if i < self.num_experts])
        if self.block_amax is not None and not _ALL_EXPERTS:
            return self._forward_block_scaled(hidden_states, mask, experts, top_k_weights, out)
        for index in experts:
            top_k_pos, token_idx = torch.where(mask[index])
            if _ALL_EXPERTS:
                expert_out = self[index](hidden_states)[token_idx]
            else:
                expert_out = self[index](hidden_states[token_idx])
            expert_out = expert_out * top_k_weights[token_idx, top_k_pos, None]
            out.index_add_(0, token_idx, expert_out.to(out.dtype))
        return out

    def _forward_block_scaled(self, hidden_states: torch.Tensor, mask: torch.Tensor, experts: Sequence[int],
                              top_k_weights: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The routed forward in two passes, so a dynamic per-tensor activation scale covers the whole block as in
        vLLM's fused MoE: every expert's gate/up input scale from the block's input, then every down_proj input
        scale from all routed experts' hidden activations together."""
        self.block_amax = {"w13": hidden_states.detach().abs().amax().float()}
        routed = []
        for index in experts:
            top_k_pos, token_idx = torch.where(mask[index])
            routed.append((index, top_k_pos, token_idx, self.expert(index).hidden(hidden_states[token_idx])))
        if routed:
            self.block_amax["w2"] = torch.stack(
                [torch.stack([part.detach().abs().amax().float() for part in h.tensor_split(self.w2_shards, dim=-1)])
                 for *_, h in routed]).amax(dim=0)
            if self.w2_shards == 1:
                self.block_amax["w2"] = self.block_amax["w2"].reshape(())
        for index, top_k_pos, token_idx, h in routed:
            expert_out = self.expert(index).down_proj(h) * top_k_weights[token_idx, top_k_pos, None]
            out.index_add_(0, token_idx, expert_out.to(out.dtype))
        self.block_amax = {}
        return out


def _flag(module: nn.Module, name: str) -> bool:
    """A boolean layout attribute of a fused experts module (``is_transposed``, ``has_gate``, ``has_bias``)."""
    value = getattr(module, name)
    if not isinstance(value, bool):
        raise TypeError(f"{type(module).__name__}.{name} is {value!r}; fused experts declare it as a bool")
    return value


def _tensor(module: nn.Module, name: str) -> torch.Tensor:
    """A weight of a fused experts module (``gate_up_proj``, ``down_proj``, their biases)."""
    value = getattr(module, name)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{type(module).__name__}.{name} is a {type(value).__name__}, not a tensor")
    return value


@torch.no_grad()
def _linear_experts(fused: nn.Module) -> LinearExperts:
    transposed, gate, bias = _flag(fused, "is_transposed"), _flag(fused, "has_gate"), _flag(fused, "has_bias")
    act_fn = fused.act_fn
    if not isinstance(act_fn, nn.Module):
        raise TypeError(f"{type(fused).__name__}.act_fn is a {type(act_fn).__name__}, not an nn.Module")
    up_all = _tensor(fused, "gate_up_proj" if gate else "up_proj")
    down_all = _tensor(fused, "down_proj")
    num, hidden = down_all.shape[0], (down_all.shape[2] if transposed else down_all.shape[1])
    intermediate = down_all.shape[1] if transposed else down_all.shape[2]
    experts = []
    for e in range(num):
        expert = ExpertMLP(hidden, intermediate, gate=gate, bias=bias, act_fn=act_fn,
                           device=down_all.device, dtype=down_all.dtype)
        up_w = up_all[e].T if transposed else up_all[e]  # (2·I or I, H)
        parts = {"down_proj": down_all[e].T if transposed else down_all[e]}
        parts.update({"gate_proj": up_w[:intermediate], "up_proj": up_w[intermediate:]} if gate else
                     {"up_proj": up_w})
        up_b = getattr(fused, "gate_up_proj_bias" if gate else "up_proj_bias", None) if bias else None
        biases = {"down_proj": _tensor(fused, "down_proj_bias")[e]} if bias else {}
        if up_b is not None:
            biases.update({"gate_proj": up_b[e, :intermediate], "up_proj": up_b[e, intermediate:]} if gate else
                          {"up_proj": up_b[e]})
        for leaf, weight in parts.items():
            linear = getattr(expert, leaf)
            if weight.is_meta:
                continue
            linear.weight.copy_(weight)
            if leaf in biases:
                linear.bias.copy_(biases[leaf])
        experts.append(expert)
    return LinearExperts(experts)


def split_experts(model: nn.Module) -> list[str]:
    """Replace every fused experts module of the standard layout by :class:`LinearExperts` (weights copied;
    on the meta device, shapes only). Returns the names of the modules replaced."""
    replaced = []
    for name, module in _fused_modules(model):
        if not _splittable(module):
            continue
        model.set_submodule(name, _linear_experts(module))
        replaced.append(name)
    return replaced


# Split experts' names as a checkpoint of the model type stores them, where they differ from the split modules'
# (``(pattern, replacement)`` in turn): transformers converts these when it loads a whole model; a streamed one
# (quantcore.models.streaming) reads each tensor by name, so it asks for the stored one
CHECKPOINT_NAMES: dict[str, tuple[tuple[str, str], ...]] = {
    "mixtral": ((r"\.mlp\.(gate|experts)\.", r".block_sparse_moe.\1."),
                (r"\.experts\.(\d+)\.gate_proj\.", r".experts.\1.w1."),
                (r"\.experts\.(\d+)\.up_proj\.", r".experts.\1.w3."),
                (r"\.experts\.(\d+)\.down_proj\.", r".experts.\1.w2.")),
}


def checkpoint_name(model_type: str, name: str) -> str:
    """The name a checkpoint of ``model_type`` stores the tensor ``name`` (of the model after :func:`split_experts`)
    under: ``name`` itself unless :data:`CHECKPOINT_NAMES` renames it."""
    import re

    for pattern, replacement in CHECKPOINT_NAMES.get(model_type, ()):
        name = re.sub(pattern, replacement, name)
    return name


def top_k(config: Any) -> int | None:
    """Experts each token is routed to (``num_experts_per_tok`` and its aliases), from a model config."""
    config = getattr(config, "get_text_config", lambda: config)()
    for key in TOP_K_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def moe_summary(model: nn.Module, config: Any) -> dict[str, Any] | None:
    """{experts, top_k, blocks} of an MoE model whose experts :func:`split_experts` split; None otherwise."""
    split = {name: m for name, m in model.named_modules() if isinstance(m, LinearExperts)}
    if not split:
        return None
    first = next(iter(split.values()))
    return {"experts": len(first), "top_k": top_k(config), "blocks": list(split)}
