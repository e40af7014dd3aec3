"""What one step of a mixture-of-experts model asks of each routed expert's linears (torch-free).

Each token of a step goes to ``top_k`` of a block's ``experts`` experts, so an expert's linear neither
reads its weights nor does its math for every token the way a dense linear does. With ``m`` tokens in a
step and tokens routed uniformly at random (a balanced router; a skewed one touches fewer experts, each
with more tokens), one expert

- is touched (reads its weights at all) with probability ``p = 1 - (1 - top_k / experts) ** m``,
- and, when touched, runs a GEMM of ``m * top_k / (experts * p)`` tokens on average.

So its expected share of a step is ``p`` times the time of that smaller GEMM: at decode with one sequence
(m = 1) only ``top_k`` experts of a block run, each on one token; at a long prefill every expert runs on
``m * top_k / experts`` tokens. The roofline bound (:mod:`quantcore.kernels.roofline`) and the step estimate from
measured kernel times (:func:`quantcore.kernels.estimate.step_estimate`) count an expert linear this way; a benchmark
of an MoE model also times the expert shapes at those token counts (:meth:`Routing.expert_m`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from quantcore.schemes.fusion import expert_block


@dataclass(frozen=True)
class Routing:
    """A block of ``experts`` routed experts, each token sent to ``top_k`` of them."""

    experts: int
    top_k: int

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k must be between 1 and the number of experts ({self.experts}), got {self.top_k}")

    def touched(self, m: int) -> float:
        """Probability that one expert gets at least one of ``m`` tokens."""
        return 1.0 - (1.0 - self.top_k / self.experts) ** m

    def tokens(self, m: int) -> float:
        """Tokens one expert gets on average when it is touched, of a step of ``m`` tokens."""
        return m * self.top_k / (self.experts * self.touched(m))

    def expert_m(self, m: int) -> int:
        """The GEMM M that times one touched expert: :meth:`tokens` rounded up."""
        return max(1, math.ceil(self.tokens(m) - 1e-9))


def routed_layers(layer_names: Iterable[str], moe: Mapping[str, Any] | None) -> dict[str, Routing]:
    """{expert linear: its Routing} from a model's intake summary ``moe`` ({"experts", "top_k", ...}); empty
    for a dense model, or when the summary does not know top_k."""
    if not moe or not moe.get("experts") or not moe.get("top_k"):
        return {}
    routing = Routing(int(moe["experts"]), int(moe["top_k"]))
    return {name: routing for name in layer_names if expert_block(name) is not None}


def bench_ms(ms: Iterable[int], routed: Mapping[str, Routing]) -> list[int]:
    """The M values a kernel benchmark times: ``ms`` and, for an MoE model, the M of one touched expert at each
    of them."""
    out = {int(m) for m in ms}
    for routing in set(routed.values()):
        out |= {routing.expert_m(int(m)) for m in ms}
    return sorted(out)


def case_m(m: int, routing: Routing | None) -> int:
    """The M of the GEMM a linear runs in a step of ``m`` tokens: ``m`` for a dense linear, the M of one touched
    expert for a routed one."""
    return m if routing is None else routing.expert_m(m)


def step_share(times: Mapping[tuple[int, int, int, str], float], m: int, n: int, k: int, path: str,
               routing: Routing | None) -> float | None:
    """A linear's time in a step of ``m`` tokens from measured GEMM times {(M, N, K, path): ms} (None where not
    measured): the time at ``m`` for a dense linear; for a routed expert, the time at the M of one touched
    expert times the chance the step touches it."""
    t = times.get((case_m(m, routing), n, k, path))
    if t is None or routing is None:
        return t
    return t * routing.touched(m)
