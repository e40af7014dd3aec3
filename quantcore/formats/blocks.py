"""A tensor viewed as scale blocks: the (A, br, C, bc) view that every granularity reduces to, and the checks
every quantizer makes on its input.

Granularity and scale shapes, for x of shape (..., K), rows R = prod(shape[:-1]):

========  ===========================  =======================================
tensor    one scale                    ()
channel   one per row (weight rows)    (*shape[:-1], 1)
token     one per row (tokens)         (*shape[:-1], 1)
group     G elements along K           (*shape[:-1], ceil(K / G))
block     (br, bc) tiles of (R, K)     (ceil(R / br), ceil(K / bc))
========  ===========================  =======================================

A K not divisible by G (or by the block) leaves a partial last group whose scale comes
from the elements it has. Block formats fix their own grouping (32 or 16 along K).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from quantcore.formats.catalog import Format
from quantcore.formats.granularity import Granularity


@dataclass(frozen=True)
class BlockLayout:
    """How x (any shape) is viewed as a 4-D tensor (A, br, C, bc) with one scale per (A, C).

    The 2-D view is (rows, cols) = (prod(shape[:-1]), shape[-1]) (for TENSOR: (1, numel)),
    zero-padded to (rows + pad_rows, cols + pad_cols).
    """

    shape: tuple[int, ...]
    rows: int
    cols: int
    pad_rows: int
    pad_cols: int
    blocked: tuple[int, int, int, int]
    scale_shape: tuple[int, ...]


def parse_granularity(
    fmt: Format, granularity: str | Granularity, group_size: int | None, block: tuple[int, int] | None
) -> tuple[Granularity, int | None, tuple[int, int] | None]:
    """Validate the granularity arguments; block formats resolve to GROUP of their block size."""
    try:
        gran = Granularity(granularity)
    except ValueError:
        valid = ", ".join(repr(g.value) for g in Granularity)
        raise ValueError(f"unknown granularity {granularity!r}; use one of {valid}") from None
    if fmt.is_block:
        if (
            gran not in (Granularity.TENSOR, Granularity.GROUP)
            or group_size not in (None, fmt.block_size)
            or block
        ):
            raise ValueError(
                f"{fmt.name} fixes its own scale blocks ({fmt.block_size} elements along the last dim); "
                f"leave granularity at 'tensor' or use 'group' with group_size={fmt.block_size} (or None)"
            )
        return Granularity.GROUP, fmt.block_size, None
    if gran is Granularity.GROUP:
        if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
            raise ValueError(
                f"granularity 'group' needs group_size, a positive int such as 128; got {group_size!r}"
            )
    elif group_size is not None:
        raise ValueError(f"group_size={group_size} is only used with granularity 'group'")
    if gran is Granularity.BLOCK:
        if block is None or len(block) != 2 or not all(isinstance(b, int) and b >= 1 for b in block):
            raise ValueError(
                f"granularity 'block' needs block=(rows, cols) of positive ints, e.g. (128, 128); got {block!r}"
            )
        block = (int(block[0]), int(block[1]))
    elif block is not None:
        raise ValueError(f"block={block} is only used with granularity 'block'")
    return gran, group_size, block


def block_layout(
    shape: tuple[int, ...], gran: Granularity, group_size: int | None, block: tuple[int, int] | None
) -> BlockLayout:
    """The blocked view of a tensor of ``shape`` for one granularity (pure arithmetic on shapes)."""
    numel = math.prod(shape)
    if gran is Granularity.TENSOR:
        return BlockLayout(shape, 1, numel, 0, 0, (1, 1, 1, numel), ())
    if len(shape) == 0:
        raise ValueError(
            f"granularity {gran.value!r} needs a tensor with at least one dimension; use 'tensor' for a scalar"
        )
    cols = shape[-1]
    rows = numel // cols if cols else math.prod(shape[:-1])
    if gran in (Granularity.CHANNEL, Granularity.TOKEN):
        return BlockLayout(shape, rows, cols, 0, 0, (rows, 1, 1, cols), (*shape[:-1], 1))
    if gran is Granularity.GROUP:
        assert group_size is not None  # parse_granularity requires it for GROUP
        n_groups = -(-cols // group_size)  # ceil division
        pad_cols = n_groups * group_size - cols
        return BlockLayout(
            shape, rows, cols, 0, pad_cols, (rows, 1, n_groups, group_size), (*shape[:-1], n_groups)
        )
    assert block is not None  # BLOCK: parse_granularity requires it
    br, bc = block
    n_r, n_c = -(-rows // br), -(-cols // bc)
    return BlockLayout(shape, rows, cols, n_r * br - rows, n_c * bc - cols, (n_r, br, n_c, bc), (n_r, n_c))


def to_blocks(x: torch.Tensor, lay: BlockLayout) -> torch.Tensor:
    """x (lay.shape) -> (A, br, C, bc), zero-padded; a view when no padding is needed."""
    x2 = x.reshape(lay.rows, lay.cols)
    if lay.pad_rows or lay.pad_cols:
        x2 = F.pad(x2, (0, lay.pad_cols, 0, lay.pad_rows))
    return x2.reshape(lay.blocked)


def from_blocks(xb: torch.Tensor, lay: BlockLayout) -> torch.Tensor:
    """Inverse of :func:`to_blocks` (padding dropped)."""
    x2 = xb.reshape(lay.rows + lay.pad_rows, lay.cols + lay.pad_cols)
    if lay.pad_rows or lay.pad_cols:
        x2 = x2[: lay.rows, : lay.cols]
    return x2.reshape(lay.shape)


def scale_to_blocks(scale: torch.Tensor, lay: BlockLayout) -> torch.Tensor:
    """Public scale shape -> (A, 1, C, 1) so it broadcasts over the blocked view."""
    return scale.reshape(lay.blocked[0], 1, lay.blocked[2], 1)


def check_float(x: torch.Tensor) -> torch.Tensor:
    """x itself when it is a floating tensor quantplan can quantize; ValueError saying how to fix it otherwise."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(
            f"expected a torch.Tensor, got {type(x).__name__}; wrap data with torch.as_tensor(...)"
        )
    if not x.is_floating_point():
        raise ValueError(
            f"expected a floating-point tensor (float32/bfloat16/float16/float64), got {x.dtype}; cast it first"
        )
    if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"input is already {x.dtype}; dequantize it to float32/bfloat16 first")
    return x


def work_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 for 16/32-bit inputs, float64 for float64 (one rounding from the input's precision)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def may_branch(t: torch.Tensor) -> bool:
    """Whether a shortcut may branch on values of ``t`` (read a 0-d result on the host).

    On a CPU that read is free, and a shortcut that skips a full-tensor pass when, say, no
    value is NaN pays for itself. On CUDA it would be a host sync per call, so accelerators
    keep the branch-free formulas (hot paths promise no sync); both give the same numbers.
    """
    return t.device.type == "cpu"
