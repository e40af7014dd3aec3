"""amax -> scale: the fp32 scales that map a tensor's largest magnitudes onto a format's maximum.

* int / fp8 / fp4 (per tensor, channel, token, group, block): ``s = amax / fmt.max``, so that the
  largest |x| lands exactly on the format's max.
* OCP MX (mxfp8, mxfp4): one power-of-two E8M0 scale per 32 elements along the last dim,
  ``s = 2**(floor(log2(amax)) - emax_elem)`` clamped to [2**-127, 2**127] [OCP MX v1.0, section 6.3].
* NVFP4: an fp32 tensor scale ``g = amax / (448 * 6)`` above the E4M3 block scales
  [NVIDIA, "Pretraining LLMs with NVFP4", 2025].
* Delayed scaling: the scale of this step from a window of past amaxes (:class:`AmaxHistory`).

A dynamic amax ignores NaN and ±inf; an all-zero tensor or block gets scale 1.
"""

from __future__ import annotations

import torch

from quantcore.formats.blocks import block_layout, check_float, may_branch, parse_granularity, to_blocks
from quantcore.formats.catalog import E8M0_MAX_EXP, E8M0_MIN_EXP, Format, element_format, get_format
from quantcore.formats.granularity import Granularity

F8E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448.0
F8E5M2_MAX = torch.finfo(torch.float8_e5m2).max  # 57344.0
F4E2M1_MAX = 6.0  # largest E2M1 magnitude [OCP MX v1.0, table 5]
NVFP4_TENSOR_SCALE_DIVISOR = F8E4M3_MAX * F4E2M1_MAX  # 2688.0: g = amax / (448 * 6)
SCALE_DTYPE = torch.float32  # every scale is fp32, as the kernels consume them
# Smallest scale we emit: the smallest normal fp32, 1.1755e-38. A nonzero amax so small that
# amax / max underflows would otherwise give a zero (or subnormal, flushed on some devices) scale
# and x / s = inf.
MIN_SCALE = torch.finfo(torch.float32).tiny


def _finite_abs(x: torch.Tensor) -> torch.Tensor:
    """|x| with NaN and ±inf replaced by 0, so one bad value cannot poison a whole scale."""
    return x.abs().nan_to_num_(nan=0.0, posinf=0.0)


@torch.no_grad()
def compute_amax(
    x: torch.Tensor,
    granularity: str | Granularity = "tensor",
    *,
    group_size: int | None = None,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """max |x| over each scale group, ignoring NaN and ±inf; float32, the scale shape of ``granularity``."""
    # any non-block format parses granularity the same way; block formats would force their own groups
    gran, group_size, block = parse_granularity(get_format("int8"), granularity, group_size, block)
    lay = block_layout(tuple(x.shape), gran, group_size, block)
    return amax_blocked(to_blocks(check_float(x), lay)).reshape(lay.scale_shape)


def amax_blocked(xb: torch.Tensor) -> torch.Tensor:
    """(A, br, C, bc) -> (A, 1, C, 1) float32 amax of the finite values (0 for an empty block)."""
    return amax_checked(xb)[0]


def amax_checked(xb: torch.Tensor) -> tuple[torch.Tensor, bool | None]:
    """:func:`amax_blocked`, and True when every value of xb is known to be finite (else None)."""
    if xb.numel() == 0:
        empty = torch.zeros(xb.shape[0], 1, xb.shape[2], 1, dtype=SCALE_DTYPE, device=xb.device)
        return empty, True
    if may_branch(xb):
        # max|x| = max(|max x|, |min x|): two read-only reductions instead of writing |x| out in
        # full and passing over it twice more (nan_to_num_, amax). Exact, signs of zero included
        # (abs_ of the reduced values). amax/amin propagate NaN and keep ±inf, so a non-finite
        # result means the data holds NaN or inf, and only then is the filtering path needed.
        amax = torch.maximum(
            xb.amax(dim=(1, 3), keepdim=True).abs_(), xb.amin(dim=(1, 3), keepdim=True).abs_()
        )
        if bool(torch.isfinite(amax).all()):
            return amax.to(SCALE_DTYPE), True
    return _finite_abs(xb).amax(dim=(1, 3), keepdim=True).to(SCALE_DTYPE), None


@torch.no_grad()
def scale_from_amax(amax: torch.Tensor | float, fmt: str | Format) -> torch.Tensor:
    """The fp32 scale that maps ``amax`` onto the format's max (elementwise over an amax tensor).

    int / fp8 / fp4:  s = amax / max                      (fp8_e4m3: amax / 448)
    nvfp4:            g = amax / (448 * 6)                (the fp32 tensor scale)
    mxfp8 / mxfp4:    s = 2**(floor(log2 amax) - emax_elem), clamped to the E8M0 range

    A zero amax gives scale 1 (exact for all-zero data). The division is done in float64
    and rounded once to fp32.
    """
    fmt = get_format(fmt)
    amax = torch.as_tensor(amax, dtype=SCALE_DTYPE)
    if fmt.scale == "e8m0":
        return e8m0_scale(amax, element_format(fmt))
    divisor = NVFP4_TENSOR_SCALE_DIVISOR if fmt.name == "nvfp4" else fmt.max
    scale = (amax.double() / divisor).to(SCALE_DTYPE).clamp_(min=MIN_SCALE)
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def e8m0_scale(amax: torch.Tensor, elem: Format, *, round_amax: bool = False) -> torch.Tensor:
    """OCP MX shared scale 2**(floor(log2 amax) - emax_elem), exponent clamped to [-127, 127].

    floor(log2 amax) comes from frexp (exact: amax = m * 2**e with m in [0.5, 1)), not from
    log2, which can round up just below a power of two. All-zero blocks get scale 1.
    ``round_amax``: compressed-tensors' rule for the weights it stores (:func:`mx_weight_scale`), the amax first
    rounded to a power of two, 1.75 * 2**e and above up to 2**(e + 1).
    """
    m, exp = torch.frexp(amax)
    if round_amax:
        exp = exp + (m >= 0.875).to(exp.dtype)  # m = 0.875: 1.75 * 2**(exp - 1)
    shared = (exp - 1 - elem.emax).clamp_(E8M0_MIN_EXP, E8M0_MAX_EXP)
    scale = torch.ldexp(torch.ones_like(amax), shared)
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def delayed_scale(
    amax_history: torch.Tensor, fmt: str | Format, *, margin: int = 0, algo: str = "max"
) -> torch.Tensor:
    """Delayed scaling (NVIDIA Transformer Engine): the scale for this step from past amaxes.

    amax_history: (window,) or (window, *scale_shape), newest first, as :class:`AmaxHistory` keeps it
    algo:         "max" (largest amax in the window, TE's default) or "most_recent"
    margin:       extra headroom in powers of two: s = amax * 2**margin / max

    Using last steps' amax avoids a reduction over the live tensor before its quantization;
    the price is saturation when the live tensor exceeds the window (check the report).
    """
    if algo not in ("max", "most_recent"):
        raise ValueError(f"algo must be 'max' or 'most_recent', got {algo!r}")
    if not isinstance(margin, int) or margin < 0:
        raise ValueError(f"margin must be a non-negative int (powers of two of headroom), got {margin!r}")
    if amax_history.dim() == 0 or amax_history.shape[0] == 0:
        raise ValueError("amax_history needs at least one entry along its first dim (the window)")
    amax = amax_history.amax(dim=0) if algo == "max" else amax_history[0]
    return scale_from_amax(amax.to(SCALE_DTYPE) * 2.0**margin, fmt)


class AmaxHistory:
    """A rolling window of amax values for delayed scaling.

    hist = AmaxHistory(window=16)
    s = hist.scale("fp8_e4m3")                  # from past steps (scale 1 before the first push)
    y, rep = fake_quantize_with_report(x, "fp8_e4m3", scale=s)
    hist.push(compute_amax(x))                   # record this step for the next one
    """

    def __init__(
        self, window: int = 16, scale_shape: tuple[int, ...] = (), device: torch.device | str | None = None
    ):
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive int (steps of history), got {window!r}")
        self.history = torch.zeros((window, *scale_shape), dtype=SCALE_DTYPE, device=device)

    def push(self, amax: torch.Tensor | float) -> None:
        """Record the newest amax (shifts the window by one; the oldest entry drops out)."""
        amax = torch.as_tensor(amax, dtype=SCALE_DTYPE, device=self.history.device)
        self.history = torch.cat([amax.reshape(1, *self.history.shape[1:]), self.history[:-1]])

    def scale(self, fmt: str | Format, *, margin: int = 0, algo: str = "max") -> torch.Tensor:
        """:func:`delayed_scale` of the current window."""
        return delayed_scale(self.history, fmt, margin=margin, algo=algo)
