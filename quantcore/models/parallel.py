"""Tensor parallelism as vLLM lays a Llama-style model over several GPUs, for the serving checks.

With ``--tensor-parallel-size T`` vLLM cuts every linear layer in T shards, one per GPU:

- **column-parallel** layers (q/k/v, gate/up, a routed expert's gate/up, lm_head) keep K and split N: each GPU
  computes N / T of the outputs. q_proj splits by attention heads; k_proj and v_proj by key-value heads, and when
  T exceeds the key-value heads each GPU holds one whole head, copied on T / kv_heads GPUs (``QKVParallelLinear``).
- **row-parallel** layers (o_proj, down_proj, a routed expert's down_proj) keep N and split K: each GPU reads K / T
  of the inputs and the partial sums are added across GPUs (an all-reduce).
- the MoE router (``mlp.gate``) is replicated: every GPU holds all of it.

A quantization format that groups or tiles along an axis then needs that axis of each *shard* divisible, not just
of the whole layer: a group of 128 inputs must not straddle two GPUs. :meth:`Parallelism.shards` gives each layer's
(N, K) on one GPU; :func:`tp_misfits` says what vLLM refuses at that size before any quantization; the format checks of
:mod:`quantcore.planning.plans` take a :class:`Parallelism` and read the shards.

Torch-free: the app imports it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantcore.models.architectures import LLAMA_STYLE
from quantcore.schemes.fusion import expert_block, expert_blocks


def expert_index(layer: str) -> int:
    """The index of a routed expert linear in its block: 3 for ``model.layers.0.mlp.experts.3.up_proj``."""
    return int(layer.rsplit(".", 2)[-2])

COLUMN = "column"
ROW = "row"
REPLICATED = "replicated"
VOCAB = "vocab"
UNKNOWN = "unknown"

COLUMN_LEAVES = LLAMA_STYLE.column_leaves  # q/k/v, gate/up (quantcore.models.architectures)
ROW_LEAVES = LLAMA_STYLE.row_leaves  # o_proj, down_proj
REPLICATED_LEAVES = (LLAMA_STYLE.router, "shared_expert_gate")  # MoE routers: vLLM's ReplicatedLinear
VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE: lm_head's rows are padded to a multiple of it


@dataclass(frozen=True)
class AttentionHeads:
    """The attention layout that decides how q/k/v split: query heads, key-value heads, and each head's width."""

    heads: int
    kv_heads: int
    head_dim: int

    def to_dict(self) -> dict[str, int]:
        return {"heads": self.heads, "kv_heads": self.kv_heads, "head_dim": self.head_dim}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> AttentionHeads | None:
        if not data:
            return None
        return cls(int(data["heads"]), int(data["kv_heads"]), int(data["head_dim"]))


def attention_heads(config: Any) -> AttentionHeads | None:
    """The attention layout of a transformers config (an object or config.json as a dict; a multimodal config's
    text part), or None where it does not say how many heads: ``num_attention_heads``, ``num_key_value_heads``
    (default: as many as the heads), ``head_dim`` (default: hidden_size / heads)."""
    if isinstance(config, Mapping):
        config = config.get("text_config") or config
        get = config.get
    else:
        getter = getattr(config, "get_text_config", None)
        config = getter() if callable(getter) else config

        def get(key: str, default: Any = None) -> Any:
            return getattr(config, key, default)
    heads = get("num_attention_heads") or get("n_head")
    if not isinstance(heads, int) or heads <= 0:
        return None
    kv = get("num_key_value_heads")
    kv = kv if isinstance(kv, int) and kv > 0 else heads
    dim = get("head_dim")
    if not isinstance(dim, int) or dim <= 0:
        hidden = get("hidden_size")
        if not isinstance(hidden, int) or hidden % heads:
            return None
        dim = hidden // heads
    return AttentionHeads(heads, kv, dim)


def stored_heads(summary_heads: Mapping[str, Any] | None, folder: str | Path) -> AttentionHeads | None:
    """A registered model's attention heads: from its intake summary, or for a model registered before they were
    kept, from the config.json in the checkpoint ``folder`` quantplan stored; None where neither says."""
    heads = AttentionHeads.from_dict(summary_heads)
    if heads is not None:
        return heads
    try:
        from quantcore.safeload import read_json

        config = read_json(Path(folder) / "config.json", ValueError)  # bounded: size and nesting capped
    except (OSError, ValueError):
        return None
    return attention_heads(config) if isinstance(config, dict) else None


def partition(layer: str) -> str:
    """How vLLM splits ``layer`` under tensor parallelism: COLUMN, ROW, REPLICATED, VOCAB (lm_head) or UNKNOWN
    (a name outside the Llama-style layout; the checks treat it as whole)."""
    leaf = layer.rpartition(".")[2]
    if leaf == "lm_head":
        return VOCAB
    if leaf in COLUMN_LEAVES:
        return COLUMN
    if leaf in ROW_LEAVES:
        return ROW
    if leaf in REPLICATED_LEAVES:
        return REPLICATED
    return UNKNOWN


@dataclass(frozen=True)
class Parallelism:
    """How vLLM lays a model over GPUs: ``tp`` GPUs (``--tensor-parallel-size``), the model's attention ``heads``
    (how q/k/v split; None: taken to split evenly) and ``expert_parallel`` (``--enable-expert-parallel``: every
    routed expert whole on one GPU, the GPUs sharing out the experts, instead of every expert split over them)."""

    tp: int = 1
    heads: AttentionHeads | None = None
    expert_parallel: bool = False

    @property
    def split(self) -> bool:
        """Whether layers are split at all (more than one GPU)."""
        return self.tp > 1

    def shard(self, layer: str, n: int, k: int) -> tuple[int, int]:
        """(N, K) of ``layer`` on one GPU (:func:`shard_shape`; a routed expert whole under expert parallelism)."""
        if self.expert_parallel and expert_block(layer) is not None:
            return n, k
        return shard_shape(layer, n, k, self.tp, self.heads)

    def input_shards(self, layer: str) -> int:
        """Into how many parts the GPUs cut ``layer``'s input: ``tp`` for a row-parallel layer (each GPU reads and
        quantizes its K / tp of every input row, so a dynamic per-tensor or per-token activation scale is each
        GPU's own), else 1 (a routed expert whole under expert parallelism included)."""
        if not self.split or partition(layer) != ROW or (self.expert_parallel and expert_block(layer) is not None):
            return 1
        return self.tp

    def shards(self, shapes: Mapping[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
        """{layer: (N, K) on one GPU}; the shapes themselves on one GPU."""
        if not self.split:
            return dict(shapes)
        return {layer: self.shard(layer, n, k) for layer, (n, k) in shapes.items()}

    def first_gpu_shapes(self, shapes: Mapping[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
        """{layer: (N, K) on the first GPU} of the layers it runs (:meth:`first_gpu`): one GPU's step."""
        return {layer: self.shard(layer, *shapes[layer]) for layer in self.first_gpu(shapes)}

    def first_gpu(self, layers: Iterable[str]) -> list[str]:
        """The layers the first GPU runs a share of: every layer, but under expert parallelism only the routed
        experts it holds, the first ceil(E / tp) of each MoE block (vLLM hands each GPU a contiguous range of
        experts, the remainder to the first GPUs). With routing spread evenly every GPU does as much."""
        layers = list(layers)
        if not (self.split and self.expert_parallel):
            return layers
        held: set[str] = set()
        for members in expert_blocks(layers).values():
            ids = sorted({expert_index(m) for m in members})
            mine = set(ids[: -(-len(ids) // self.tp)])
            held.update(m for m in members if expert_index(m) in mine)
        return [layer for layer in layers if expert_block(layer) is None or layer in held]


ONE_GPU = Parallelism()


def kv_heads_per_gpu(heads: AttentionHeads, tp: int) -> int:
    """Key-value heads each GPU holds: kv_heads / T, or one (copied on several GPUs) when T exceeds them."""
    return max(1, heads.kv_heads // tp)


def shard_shape(layer: str, n: int, k: int, tp: int, heads: AttentionHeads | None = None) -> tuple[int, int]:
    """(N, K) of ``layer`` on one GPU at tensor parallelism ``tp`` (floor division where the split is uneven:
    :func:`tp_misfits` reports those). k_proj / v_proj follow the key-value heads when ``heads`` is known."""
    if tp <= 1:
        return n, k
    kind = partition(layer)
    if kind == COLUMN:
        leaf = layer.rpartition(".")[2]
        if leaf in (LLAMA_STYLE.k_proj, LLAMA_STYLE.v_proj) and heads is not None and expert_block(layer) is None \
                and n == heads.kv_heads * heads.head_dim:
            return kv_heads_per_gpu(heads, tp) * heads.head_dim, k
        return n // tp, k
    if kind == ROW:
        return n, k // tp
    if kind == VOCAB:
        return -(-n // VOCAB_PADDING) * VOCAB_PADDING // tp, k
    return n, k


def unknown_layers(layers: Iterable[str]) -> list[str]:
    """Layers whose split quantplan does not know (:func:`partition` UNKNOWN): checked as if whole."""
    return [layer for layer in layers if partition(layer) == UNKNOWN]


def tp_misfits(shapes: Mapping[str, tuple[int, int]], parallel: Parallelism) -> list[str]:
    """What vLLM refuses at ``parallel``'s tensor parallelism T before any quantization, one message per cause (none
    at 1):

    - query heads not divisible by T (``ModelConfig.verify_with_parallel_config``: "Total number of attention heads
      (9) must be divisible by tensor parallel size (2)");
    - key-value heads neither divisible by T nor dividing it (``QKVParallelLinear``);
    - a column-parallel layer whose N, or a row-parallel layer whose K, T does not divide (vLLM's ``divide``
      asserts "... is not divisible by ..."): the MLP's intermediate size, an expert's (not under expert
      parallelism, which keeps experts whole).
    """
    tp, heads = parallel.tp, parallel.heads
    if tp <= 1:
        return []
    out = []
    if heads is not None:
        if heads.heads % tp:
            out.append(f"tensor_parallel {tp}: the model has {heads.heads} attention heads, which {tp} GPUs cannot "
                       f"share evenly: vLLM refuses to start (\"Total number of attention heads ({heads.heads}) must "
                       f"be divisible by tensor parallel size ({tp})\"); choose a tensor_parallel that divides "
                       f"{heads.heads}")
        elif heads.kv_heads % tp and tp % heads.kv_heads:
            out.append(f"tensor_parallel {tp}: the model has {heads.kv_heads} key-value heads, which neither divide "
                       f"among {tp} GPUs nor copy onto them evenly (QKVParallelLinear needs one to divide the "
                       f"other): choose a tensor_parallel that divides {heads.kv_heads} or is a multiple of it")
    uneven: dict[str, list[tuple[str, int]]] = {COLUMN: [], ROW: []}
    for layer, (n, k) in shapes.items():
        if parallel.expert_parallel and expert_block(layer) is not None:
            continue
        kind = partition(layer)
        if kind == COLUMN and n % tp and not (heads is not None and layer.rpartition(".")[2] in LLAMA_STYLE.qkv):
            uneven[COLUMN].append((layer, n))
        elif kind == ROW and k % tp:
            uneven[ROW].append((layer, k))
    for kind, axis in ((COLUMN, "N"), (ROW, "K")):
        bad = uneven[kind]
        if bad:
            sizes = sorted({s for _, s in bad})
            out.append(f"tensor_parallel {tp}: {len(bad)} {kind}-parallel layer(s) split along {axis}, which {tp} "
                       f"does not divide ({axis} = {', '.join(map(str, sizes))}, e.g. {bad[0][0]}): vLLM refuses to "
                       f"load them (\"{sizes[0]} is not divisible by {tp}\"); choose another tensor_parallel")
    return out


def parse_tp(value: Any) -> int:
    """A tensor-parallel size from a plan file or a command line: a whole number of GPUs, 1 or more."""
    from quantcore.errors import PlanError

    if isinstance(value, bool) or not isinstance(value, int | str):
        raise PlanError(f"tensor_parallel must be a whole number of GPUs such as 2, got {value!r}")
    try:
        tp = int(value)
    except ValueError:
        raise PlanError(f"tensor_parallel must be a whole number of GPUs such as 2, got {value!r}") from None
    if tp < 1 or tp > 1024:
        raise PlanError(f"tensor_parallel must be between 1 and 1024 GPUs, got {tp}")
    return tp


def kv_copies(parallel: Parallelism) -> float:
    """How many times the GPUs together hold each cached K/V head: 1 while the key-value heads split over them,
    T / kv_heads once they are copied (each GPU caches its own copy of its head)."""
    if not parallel.split or parallel.heads is None:
        return 1.0
    return parallel.tp * kv_heads_per_gpu(parallel.heads, parallel.tp) / parallel.heads.kv_heads
