"""How many scales a tensor gets (torch-free).

For a weight W of shape (N, K) = (out_features, in_features) and an activation X of shape (..., K)
(leading dims = tokens); the scale shapes are those of :func:`quantcore.formats.quantize.quantize`:

========  ================================  ====================================
value     scale per                          scale shape
========  ================================  ====================================
tensor    whole tensor                       ()
channel   weight output row                  (N, 1)
token     activation row (token)             (..., 1)
group     G consecutive elements along K     (..., ceil(K / G))
block     (br, bc) tile of the 2-D view      (ceil(rows / br), ceil(K / bc))
========  ================================  ====================================
"""

from __future__ import annotations

from enum import Enum


class Granularity(str, Enum):  # noqa: UP042 - the contract: (str, Enum) as compressed-tensors
    """How many scales a tensor gets (see the module docstring for shapes)."""

    TENSOR = "tensor"
    CHANNEL = "channel"
    TOKEN = "token"
    GROUP = "group"
    BLOCK = "block"


__all__ = ["Granularity"]
