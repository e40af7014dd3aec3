"""The linear-weight memory of a resolved plan, per scheme and in total, next to BF16.

torch-free, like :mod:`quantcore.planning.plans`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from quantcore.errors import name_list as _cut
from quantcore.planning.plans import scheme_label
from quantcore.schemes.specs import IDENTITY_BITS, Scheme
from quantcore.schemes.storage import weight_storage_bits


@dataclass(frozen=True)
class FootprintRow:
    """The weights of the layers that share one scheme: how many, and the bits they are stored in."""

    scheme: str
    layers: int
    params: int
    bits: int

    @property
    def bits_per_weight(self) -> float:
        """Stored bits per weight element, scales included (4.5 for NVFP4: 4 + an 8-bit scale per 16)."""
        return self.bits / self.params if self.params else 0.0


@dataclass(frozen=True)
class Footprint:
    """Linear-weight memory of a resolved plan (:func:`plan_footprint`).

    rows:      one per scheme, the largest stored size first
    params:    weight elements of every layer counted
    bits:      their stored bits under the plan (elements + scales)
    bf16_bits: the same weights unquantized, 16 bits each
    """

    rows: list[FootprintRow]
    params: int
    bits: int
    bf16_bits: int

    @property
    def ratio(self) -> float:
        """Stored size as a share of BF16 (0.53: the plan keeps 53 % of the 16-bit weight memory)."""
        return self.bits / self.bf16_bits if self.bf16_bits else 1.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe summary: totals in bytes and each scheme's share."""
        return {
            "params": self.params,
            "bytes": self.bits / 8,
            "bf16_bytes": self.bf16_bits / 8,
            "ratio": self.ratio,
            "schemes": [
                {"scheme": r.scheme, "layers": r.layers, "params": r.params, "bytes": r.bits / 8,
                 "bits_per_weight": r.bits_per_weight}
                for r in self.rows
            ],
        }


def plan_footprint(
    resolved: Mapping[str, Scheme | str], shapes: Mapping[str, tuple[int, int]]
) -> Footprint:
    """Weight memory of a resolved plan, per scheme and in total, next to BF16.

    ``shapes`` maps each layer to its (N, K); every layer of ``resolved`` needs one (a
    ValueError names those without). Sizes come from :func:`quantcore.schemes.storage.weight_storage_bits`:
    the linear weights only (embeddings, norms and biases are not the plan's to change).
    """
    missing = [layer for layer in resolved if layer not in shapes]
    if missing:
        raise ValueError(f"no (N, K) shape for {len(missing)} layer(s): {_cut(missing)}")
    per: dict[str, list[int]] = {}
    for layer, scheme in resolved.items():
        n, k = shapes[layer]
        row = per.setdefault(scheme_label(scheme), [0, 0, 0])
        row[0] += 1
        row[1] += n * k
        row[2] += weight_storage_bits(scheme, n, k)
    rows = sorted((FootprintRow(label, *v) for label, v in per.items()), key=lambda r: (-r.bits, r.scheme))
    params = sum(r.params for r in rows)
    return Footprint(rows, params, sum(r.bits for r in rows), IDENTITY_BITS * params)
