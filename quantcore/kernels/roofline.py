"""The ideal step time of a plan on a GPU nobody has measured it on: the roofline bound.

A linear layer with P weights processing B tokens does 2PB FLOPs and reads at least
P * b_w / 8 bytes of weights (b_w: stored bits per weight, scales included). With memory
bandwidth beta and the peak pi of the precision its math runs at, its time is bounded
below by::

    t >= max(P * b_w / (8 * beta), 2 * P * B / pi)

(the reference text's bound, ``shared/reference/fp8-fp4-smoothquant.txt``). Weight-only
INT4 shrinks the first term and leaves the second; FP8 W8A8 halves both on a GPU whose
FP8 tensor cores run at twice the bf16 rate. A decode step (B = the batch) is bound by
the weight read, a prefill (B = batch x prompt tokens) by the math.

A routed expert of a mixture-of-experts model (``routed``: {layer: :class:`quantcore.models.routing.Routing`}) counts
its expected share of a step: its weight read times the chance a token of the step reaches it, its math on
the tokens it gets (``m * top_k / experts`` on average).

What the bound counts: the plan's linear layers only (embeddings, attention over the KV
cache, norms and activations are left out; :func:`kv_read_ms` bounds the KV cache read of a
decode step apart, to add at a given context), weights at their stored size
(:func:`quantcore.schemes.storage.weight_storage_bits`), and the math at the peak of the
precision that runs natively on the target (:func:`quantcore.kernels.hardware.support_on_target`):
FP8 / INT8 / FP4 tensor cores where the scheme's activations use them, bf16 otherwise
(weight-only schemes, and schemes the target only emulates). A real engine gets less
than the bound; it is the shape to plan with, where no measured kernel time exists.
Torch-free: the app imports it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from quantcore.kernels.hardware import get_target, support_on_target
from quantcore.models.routing import Routing
from quantcore.planning.plans import scheme_label
from quantcore.schemes.presets import get_scheme
from quantcore.schemes.specs import Scheme
from quantcore.schemes.storage import weight_storage_bits

BF16_KEY = "bf16"
# activation format -> the peak-table key of the tensor cores that run it natively
MATH_KEY = {"fp8_e4m3": "fp8", "fp8_e5m2": "fp8", "mxfp8": "fp8", "int8": "int8",
            "fp4_e2m1": "fp4", "mxfp4": "fp4", "nvfp4": "fp4"}


@dataclass(frozen=True)
class StepBound:
    """The roofline bound of one step of a plan on one target at ``m`` tokens.

    ms:           sum over layers of max(weight read, math): the bound
    memory_ms:    the weight reads alone (the bound with unlimited compute)
    compute_ms:   the math alone (the bound with unlimited bandwidth)
    memory_bound: layers whose bound is their weight read
    per_scheme:   ms of the bound per scheme label
    not_native:   layers whose scheme the target does not run natively (their math counts at bf16)
    unsupported:  those of them that have no serving kernel on the target at all (FP4 W4A4 before
                  Blackwell): the plan cannot be served there, and its bound is only arithmetic
    """

    target: str
    m: int
    ms: float
    memory_ms: float
    compute_ms: float
    memory_bound: int
    layers: int
    per_scheme: dict[str, float] = field(default_factory=dict)
    not_native: list[str] = field(default_factory=list)
    unsupported: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class LayerBound:
    """One linear's roofline terms (ms) on a target: the weight read, the math, and how the target runs
    its scheme (quantcore.kernels.hardware.support_on_target: only "native" math runs at the low precision)."""

    memory_ms: float
    compute_ms: float
    support: str

    @property
    def ms(self) -> float:
        return max(self.memory_ms, self.compute_ms)


def layer_bound(scheme: Scheme | str, n: int, k: int, target_key: str, m: int,
                routing: Routing | None = None) -> LayerBound:
    """The roofline terms of one (N, K) linear under ``scheme`` at ``m`` tokens on a target GPU (a routed
    expert's: its expected share of the step)."""
    target = get_target(target_key)
    scheme = get_scheme(scheme)
    w, a = scheme.weights, scheme.activations
    support = "native" if w is None else support_on_target(target_key, w.format, a.format if a else None)
    # the math runs on the low-precision tensor cores only where the activations are quantized natively
    key = MATH_KEY.get(a.format, BF16_KEY) if (a is not None and support == "native") else BF16_KEY
    reads, tokens = (1.0, m) if routing is None else (routing.touched(m), m * routing.top_k / routing.experts)
    return LayerBound(memory_ms=reads * weight_storage_bits(scheme, n, k) / 8 / (target.memory_tbs * 1e12) * 1e3,
                      compute_ms=2.0 * tokens * n * k / (target.peak_tflops[key] * 1e12) * 1e3, support=support)


def cost_from_roofline(schemes: Sequence[str], shapes: Mapping[str, tuple[int, int]], target_key: str,
                       m: int, routed: Mapping[str, Routing] | None = None) -> dict[str, dict[str, float]]:
    """{scheme: {layer: ideal ms}} at ``m`` tokens on a target: the cost table of
    :func:`quantcore.planning.autoplan.auto_plan` for a GPU nobody has measured."""
    if m < 1:
        raise ValueError(f"m must be a positive number of tokens, got {m}")
    routed = routed or {}
    return {s: {layer: layer_bound(s, n, k, target_key, m, routed.get(layer)).ms for layer, (n, k) in shapes.items()}
            for s in schemes}


def step_bound(resolved: Mapping[str, Scheme | str], shapes: Mapping[str, tuple[int, int]], target_key: str,
               m: int, routed: Mapping[str, Routing] | None = None) -> StepBound:
    """The roofline bound of a resolved plan ({layer: scheme}) with ``shapes`` {layer: (N, K)} on a target
    GPU at ``m`` tokens per step (decode: the batch; prefill: batch x prompt tokens); ``routed``: the routed
    experts of an MoE model."""
    if m < 1:
        raise ValueError(f"m must be a positive number of tokens, got {m}")
    get_target(target_key)  # an unknown key: ValueError naming the valid ones
    missing = [layer for layer in resolved if layer not in shapes]
    if missing:
        raise ValueError(f"no (N, K) shape for {len(missing)} layer(s): {', '.join(missing[:5])}")
    total = mem_total = math_total = 0.0
    memory_bound = 0
    per_scheme: dict[str, float] = {}
    not_native, unsupported = [], []
    routed = routed or {}
    bounds: dict[tuple, LayerBound] = {}  # a model repeats its shapes (every block, every expert): each once
    labels: dict[Scheme | str, str] = {}
    for layer, scheme in resolved.items():
        key = (scheme, *shapes[layer], routed.get(layer))
        b = bounds.get(key)
        if b is None:
            b = bounds[key] = layer_bound(scheme, *shapes[layer], target_key, m, routed.get(layer))
        if b.support != "native":
            not_native.append(layer)
        if b.support == "unsupported":
            unsupported.append(layer)
        total += b.ms
        mem_total += b.memory_ms
        math_total += b.compute_ms
        memory_bound += b.memory_ms >= b.compute_ms
        label = labels.get(scheme) or labels.setdefault(scheme, scheme_label(get_scheme(scheme)))
        per_scheme[label] = per_scheme.get(label, 0.0) + b.ms
    return StepBound(target=target_key, m=int(m), ms=total, memory_ms=mem_total, compute_ms=math_total,
                     memory_bound=memory_bound, layers=len(resolved), per_scheme=per_scheme, not_native=not_native,
                     unsupported=unsupported)


def kv_read_ms(bytes_per_token: float, tokens: int, target_key: str) -> float:
    """The least time a decode step spends reading the KV cache: every cached token of every sequence in the
    batch (``tokens`` = batch × context) read once at the target's memory bandwidth. Attention over the cache
    is memory-bound at decode (a few FLOPs per byte), so this is its bound; add it to the linears' bound for
    a decode step at that context."""
    if tokens < 0 or bytes_per_token < 0:
        raise ValueError("bytes_per_token and tokens must be non-negative")
    return bytes_per_token * tokens / (get_target(target_key).memory_tbs * 1e12) * 1e3
