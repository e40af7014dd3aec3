"""What quantcore knows about a decoder's layer names, in one registry keyed by architecture (torch-free).

SmoothQuant and AWQ fold a factor into the operator before a linear (the norm before q/k/v and gate/up, v_proj's rows
before o_proj, up_proj's rows before down_proj); the llm-compressor recipes name those pairs as mappings; tensor
parallelism splits q/k/v and gate/up by columns and o_proj / down_proj by rows; the MoE split names each routed
expert's linears. All of them read that knowledge here, as llm-compressor's ``modifiers/awq/mappings.py`` keeps its
mappings by architecture.

An :class:`Architecture` names the submodules of one decoder block (Hugging Face transformers' names): the attention
(``self_attn``: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``), the MLP (``mlp``: ``gate_proj``, ``up_proj``,
``down_proj``; an MoE block's routed experts ``mlp.experts.<e>.*`` beside the router ``mlp.gate``), and the norms before
them (``input_layernorm``; ``post_attention_layernorm`` for Llama, Mistral, Qwen2/3, ``pre_feedforward_layernorm`` for
Gemma 2/3, whose ``post_attention_layernorm`` is on the attention output). :func:`get_architecture` answers a
``config.model_type``; an architecture nobody registered gets :data:`LLAMA_STYLE`, which takes a block's
``pre_feedforward_layernorm`` where it has one and its ``post_attention_layernorm`` otherwise.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Container
from dataclasses import dataclass
from typing import Any

MLP_NORM_LLAMA = "post_attention_layernorm"  # norm before the MLP: Llama, Mistral, Qwen2/3
MLP_NORM_GEMMA = "pre_feedforward_layernorm"  # Gemma2/Gemma3 (their post_attention_layernorm is not it)

# the kinds of SmoothQuant fold a linear takes part in: into the attention norm, into the MLP norm, into up_proj's rows
SQ_KIND_ATTN = "attn"
SQ_KIND_MLP = "mlp"
SQ_KIND_DOWN = "down"


@dataclass(frozen=True)
class Architecture:
    """The layer names of one decoder family (see the module docstring); every name is a module path's last part.

    mlp_norm: the norm before the MLP, which an llm-compressor recipe names. mlp_norm_alternatives: norms taken instead
    where a block has one (the Llama-style default looks for Gemma's ``pre_feedforward_layernorm`` first).
    """

    name: str
    attention: str = "self_attn"
    mlp: str = "mlp"
    attention_norm: str = "input_layernorm"
    mlp_norm: str = MLP_NORM_LLAMA
    mlp_norm_alternatives: tuple[str, ...] = ()
    q_proj: str = "q_proj"
    k_proj: str = "k_proj"
    v_proj: str = "v_proj"
    o_proj: str = "o_proj"
    gate_proj: str = "gate_proj"
    up_proj: str = "up_proj"
    down_proj: str = "down_proj"
    experts: str = "experts"  # the routed experts of an MoE block, <block>.<mlp>.<experts>.<e>.<gate|up|down>
    router: str = "gate"  # the router of an MoE block: <block>.<mlp>.<router> (a weight (E, K))

    # ---------------------------------------------------------------- leaves

    @property
    def qkv(self) -> tuple[str, str, str]:
        """The attention's input projections, in fused order."""
        return (self.q_proj, self.k_proj, self.v_proj)

    @property
    def gate_up(self) -> tuple[str, str]:
        """The MLP's input projections, in fused order."""
        return (self.gate_proj, self.up_proj)

    @property
    def kv_proj(self) -> tuple[str, str]:
        """The attention's linears whose outputs are the cached K and V."""
        return (self.k_proj, self.v_proj)

    @property
    def column_leaves(self) -> tuple[str, ...]:
        """Linears that tensor parallelism splits by output (q/k/v, gate/up)."""
        return (*self.qkv, *self.gate_up)

    @property
    def row_leaves(self) -> tuple[str, ...]:
        """Linears that tensor parallelism splits by input (o_proj, down_proj)."""
        return (self.o_proj, self.down_proj)

    @property
    def previous_linear(self) -> dict[str, str]:
        """{linear: the linear before it whose output rows a fold divides}: o_proj after v_proj, down_proj after
        up_proj (the input of down_proj is act(gate) ⊙ up, linear in up's output)."""
        return {self.o_proj: self.v_proj, self.down_proj: self.up_proj}

    @property
    def fold_leaves(self) -> tuple[str, ...]:
        """Linears a fold can scale the input of: q/k/v and gate/up (into the norm before them), o_proj and down_proj
        (into the rows of :attr:`previous_linear`). AWQ folds into all of them (o_proj only without grouped-query
        attention); SmoothQuant's recipes leave o_proj out (:attr:`smoothquant_kinds`)."""
        return (*self.qkv, *self.gate_up, *self.previous_linear)

    @functools.cached_property
    def smoothquant_kinds(self) -> dict[str, str]:
        """{leaf: SmoothQuant fold kind} of the linears a norm or a previous linear can absorb factors for."""
        return {**dict.fromkeys(self.qkv, SQ_KIND_ATTN), **dict.fromkeys(self.gate_up, SQ_KIND_MLP),
                self.down_proj: SQ_KIND_DOWN}

    # ---------------------------------------------------------------- roles of a linear, by its full name

    @functools.cached_property
    def _patterns(self) -> dict[str, re.Pattern[str]]:
        e = re.escape
        attn, mlp, experts = e(self.attention), e(self.mlp), e(self.experts)
        qkv = "|".join(e(x) for x in self.qkv)
        gate_up = "|".join(e(x) for x in self.gate_up)
        return {
            "qkv": re.compile(rf"^(?P<block>.+)\.{attn}\.(?P<leaf>{qkv})$"),
            "gate_up": re.compile(rf"^(?P<block>.+)\.{mlp}\.(?P<leaf>{gate_up})$"),
            "expert_gate_up": re.compile(rf"^(?P<block>.+)\.{mlp}\.{experts}\.\d+\.(?:{gate_up})$"),
            "o_proj": re.compile(rf"^(?P<block>.+)\.{attn}\.{e(self.o_proj)}$"),
            "down": re.compile(rf"^(?P<block>.+)\.{mlp}(?P<expert>\.{experts}\.\d+)?\.{e(self.down_proj)}$"),
            "v_proj": re.compile(rf"^(?P<block>.+)\.{attn}\.{e(self.v_proj)}$"),
            "up": re.compile(rf"^(?P<mlp>.+\.{mlp}(?:\.{experts}\.\d+)?)\.{e(self.up_proj)}$"),
        }

    def attention_input_block(self, name: str) -> str | None:
        """The decoder block whose q/k/v ``name`` is, or None."""
        m = self._patterns["qkv"].match(name)
        return m.group("block") if m else None

    def mlp_input_block(self, name: str) -> str | None:
        """The decoder block whose dense MLP's gate/up ``name`` is, or None."""
        m = self._patterns["gate_up"].match(name)
        return m.group("block") if m else None

    def expert_input_block(self, name: str) -> str | None:
        """The decoder block whose routed expert's gate/up ``name`` is, or None."""
        m = self._patterns["expert_gate_up"].match(name)
        return m.group("block") if m else None

    def attention_output_block(self, name: str) -> str | None:
        """The decoder block whose o_proj ``name`` is, or None."""
        m = self._patterns["o_proj"].match(name)
        return m.group("block") if m else None

    def mlp_output(self, name: str) -> tuple[str, str] | None:
        """(decoder block, MLP module) of a down_proj ``name`` (a dense MLP's or a routed expert's), or None."""
        m = self._patterns["down"].match(name)
        if not m:
            return None
        return m.group("block"), f"{m.group('block')}.{self.mlp}{m.group('expert') or ''}"

    def rows_divided_by(self, name: str) -> str | None:
        """The linear whose fold (SmoothQuant's or AWQ's) divides the weight rows of ``name``: its block's o_proj for
        a v_proj, its MLP's down_proj for an up_proj (a routed expert's too); None for a layer no fold reaches into
        (q/k/v and gate/up fold into the norm before them)."""
        if m := self._patterns["v_proj"].match(name):
            return f"{m.group('block')}.{self.attention}.{self.o_proj}"
        if m := self._patterns["up"].match(name):
            return f"{m.group('mlp')}.{self.down_proj}"
        return None

    # ---------------------------------------------------------------- module names of a block

    def attention_norm_of(self, block: str) -> str:
        """The norm before q/k/v of ``block``."""
        return f"{block}.{self.attention_norm}"

    def mlp_norm_of(self, block: str, modules: Container[str] = ()) -> str:
        """The norm before the MLP of ``block``: the first of :attr:`mlp_norm_alternatives` that ``modules`` has,
        else :attr:`mlp_norm`."""
        for alt in self.mlp_norm_alternatives:
            if f"{block}.{alt}" in modules:
                return f"{block}.{alt}"
        return f"{block}.{self.mlp_norm}"

    def v_proj_of(self, block: str) -> str:
        """The v_proj of ``block``, whose rows absorb o_proj's factors."""
        return f"{block}.{self.attention}.{self.v_proj}"

    def gate_up_of(self, mlp: str) -> tuple[str, str]:
        """(gate_proj, up_proj) of an MLP module (a dense MLP or one routed expert)."""
        return f"{mlp}.{self.gate_proj}", f"{mlp}.{self.up_proj}"

    def experts_of(self, block: str) -> str:
        """The routed experts module of ``block``'s MLP."""
        return f"{block}.{self.mlp}.{self.experts}"

    def expert_linear(self, block: str, expert: int, leaf: str) -> str:
        """The name of routed expert ``expert``'s ``leaf`` in ``block``."""
        return f"{self.experts_of(block)}.{expert}.{leaf}"

    def router_of(self, block: str) -> str:
        """The router of ``block``'s MoE MLP."""
        return f"{block}.{self.mlp}.{self.router}"


#: Hugging Face's Llama naming: Llama, Mistral, Qwen2 / Qwen3 (and their MoE models), SmolLM2, Gemma 1.
LLAMA = Architecture("llama")
#: Gemma 2 / Gemma 3: the norm before the MLP is ``pre_feedforward_layernorm``.
GEMMA2 = Architecture("gemma2", mlp_norm=MLP_NORM_GEMMA)
#: Any other architecture: Llama's names, with Gemma's MLP norm where a block has one (what quantcore always did).
LLAMA_STYLE = Architecture("llama-style", mlp_norm_alternatives=(MLP_NORM_GEMMA,))

_REGISTRY: dict[str, Architecture] = {}


def register_architecture(*model_types: str) -> Callable[[Architecture], Architecture]:
    """Register an :class:`Architecture` for ``config.model_type`` values: ``register_architecture("llama")(LLAMA)``.
    A model type registered twice raises ValueError (one answer per architecture)."""

    def register(arch: Architecture) -> Architecture:
        for model_type in model_types:
            if model_type in _REGISTRY and _REGISTRY[model_type] is not arch:
                raise ValueError(f"model type {model_type!r} is already registered as {_REGISTRY[model_type].name}")
            _REGISTRY[model_type] = arch
        return arch

    return register


register_architecture("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma")(LLAMA)
register_architecture("gemma2", "gemma3", "gemma3_text")(GEMMA2)


def list_architectures() -> dict[str, str]:
    """{model type: architecture name} of every registered model type."""
    return {model_type: arch.name for model_type, arch in _REGISTRY.items()}


def get_architecture(model_type: str | None) -> Architecture:
    """The architecture registered for ``model_type`` (a ``config.model_type``); :data:`LLAMA_STYLE` for None or a
    model type nobody registered."""
    return _REGISTRY.get(model_type or "", LLAMA_STYLE)


def architecture_of(model: Any) -> Architecture:
    """The architecture of a transformers model (its ``config.model_type``; :data:`LLAMA_STYLE` without one)."""
    return get_architecture(getattr(getattr(model, "config", None), "model_type", None))


#: Every norm an llm-compressor recipe may name before the MLP.
MLP_NORMS = tuple(dict.fromkeys(a.mlp_norm for a in (LLAMA, GEMMA2, LLAMA_STYLE)))

# ---------------------------------------------------------------- fused groups


@dataclass(frozen=True)
class FusedGroup:
    """Linears a serving engine fuses into one GEMM because they read one input: ``members`` (leaf names, in fused
    order) under one parent module, which must match ``parent`` (a regular expression; ``optional_parent``: a bare
    leaf name, with no parent, counts too)."""

    kind: str
    members: tuple[str, ...]
    parent: str = ".*"
    optional_parent: bool = True


#: Every fused group quantcore knows, by the names of the registry's architectures: q/k/v and gate/up of a decoder
#: block (Llama / Mistral / Qwen2 / Gemma), Mixtral's experts before their split (w1 = gate, w3 = up), and BERT's
#: attention (query / key / value).
FUSED_GROUPS: tuple[FusedGroup, ...] = (
    FusedGroup("qkv", LLAMA_STYLE.qkv),
    FusedGroup("gate_up", LLAMA_STYLE.gate_up),
    FusedGroup("w1_w3", ("w1", "w3"), parent=rf".*\.{LLAMA_STYLE.experts}\.\d+", optional_parent=False),
    FusedGroup("bert_qkv", ("query", "key", "value")),
)


__all__ = [
    "GEMMA2",
    "LLAMA",
    "LLAMA_STYLE",
    "MLP_NORMS",
    "MLP_NORM_GEMMA",
    "MLP_NORM_LLAMA",
    "SQ_KIND_ATTN",
    "SQ_KIND_DOWN",
    "SQ_KIND_MLP",
    "FUSED_GROUPS",
    "Architecture",
    "FusedGroup",
    "architecture_of",
    "get_architecture",
    "list_architectures",
    "register_architecture",
]
