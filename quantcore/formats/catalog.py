"""Number formats as data, looked up by name (pure Python: no torch, no numpy).

A low-precision format is described by a frozen :class:`Format` record: element bits,
exponent / mantissa bits, the largest finite magnitude, the smallest normal and subnormal,
and, for the block-scaled formats, the block size and the format of the shared scale.
Torch dtypes are referenced by name only (``torch_dtype="float8_e4m3fn"``) so that the
Streamlit app can list formats without importing torch.

Registered formats (sources in brackets):

=========  =====  ===  ===  ==========  ==============  ==============  ============================
name       kind   e    m    max         min normal      min subnormal   notes
=========  =====  ===  ===  ==========  ==============  ==============  ============================
fp8_e4m3   float  4    3    448         2**-6           2**-9           fn variant: no inf, NaN only
                                                                        at S.1111.111 [OCP FP8, 2023]
fp8_e5m2   float  5    2    57344       2**-14          2**-16          IEEE-like, has inf [OCP FP8]
fp4_e2m1   float  2    1    6           1               0.5             no inf, no NaN [OCP MX v1.0]
int8       int    0    7    127         1               1               symmetric: -128 unused
int4       int    0    3    7           1               1               symmetric: -8 unused
mxfp8      block  4    3    448         2**-6           2**-9           E4M3 x32, E8M0 scale [OCP MX]
mxfp4      block  2    1    6           1               0.5             E2M1 x32, E8M0 scale [OCP MX]
nvfp4      block  2    1    6           1               0.5             E2M1 x16, E4M3 scale, plus an
                                                                        fp32 tensor scale [NVIDIA 2025]
=========  =====  ===  ===  ==========  ==============  ==============  ============================

For a block format the numeric fields (``max``, ``min_normal``, ...) are those of its
*element* format: the per-block scale carries the range.

Usage::

    >>> get_format("fp8_e4m3").max
    448.0
    >>> representable_values("fp4_e2m1")
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from typing import Literal

FormatKind = Literal["float", "int", "block"]

E8M0_MIN_EXP = -127  # smallest E8M0 scale is 2**-127 (biased exponent 0) [OCP MX v1.0, 5.4.1]
E8M0_MAX_EXP = 127  # largest E8M0 scale is 2**127 (biased 254; 255 encodes NaN)
MX_BLOCK_SIZE = 32  # elements sharing one E8M0 scale in every OCP MX format
NVFP4_BLOCK_SIZE = 16  # elements sharing one E4M3 scale in NVFP4


@dataclass(frozen=True)
class Format:
    """One number format.

    name:          registry key, e.g. "fp8_e4m3"
    kind:          "float" (minifloat), "int" (symmetric integer) or "block" (block-scaled)
    bits:          bits per element (8, 4, ...)
    exp_bits:      exponent bits of the element (0 for int)
    man_bits:      mantissa bits of the element; for int the magnitude bits (7 for int8)
    max:           largest finite magnitude of an element (448.0, 57344.0, 127, 7, 6.0, ...)
    min_normal:    smallest positive normal element (int: 1)
    min_subnormal: smallest positive subnormal element (int: 1)
    signed:        whether negative values are representable
    has_inf:       whether the element encodes ±inf (only fp8_e5m2 here)
    block_size:    elements per shared scale (None, 32 for mx*, 16 for nvfp4)
    element:       element format name for block formats (e.g. "fp4_e2m1"), else None
    scale:         block scale format ("e8m0" or "fp8_e4m3") for block formats, else None
    torch_dtype:   name of the torch dtype holding one element, e.g. "float8_e4m3fn"; None when
                   torch has no unpacked dtype for it (int4, fp4_e2m1) or for block formats
    description:   one line for people
    """

    name: str
    kind: FormatKind
    bits: int
    exp_bits: int
    man_bits: int
    max: float
    min_normal: float
    min_subnormal: float
    signed: bool
    has_inf: bool
    block_size: int | None = None
    element: str | None = None
    scale: str | None = None
    torch_dtype: str | None = None
    description: str = ""

    @property
    def is_block(self) -> bool:
        """True for block-scaled formats (mxfp8, mxfp4, nvfp4)."""
        return self.kind == "block"

    @property
    def exponent_bias(self) -> int:
        """IEEE-style bias 2**(e-1) - 1 of a float element (7 for E4M3, 15 for E5M2, 1 for E2M1); 0 for int."""
        return (1 << (self.exp_bits - 1)) - 1 if self.exp_bits else 0

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal element: log2(min_normal) (-6 for E4M3); 0 for int."""
        return int(math.log2(self.min_normal))

    @property
    def emax(self) -> int:
        """Exponent of the largest normal float element: floor(log2(max)) (8 for E4M3, 2 for E2M1).

        This is ``emax_elem`` in the OCP MX shared-exponent rule
        ``scale = 2**(floor(log2(amax)) - emax_elem)``.
        """
        return math.floor(math.log2(self.max))

    @property
    def top_step(self) -> float:
        """Spacing of the grid just below max: 2**(emax - man_bits) for floats (32 for E4M3), 1 for int."""
        return 1.0 if self.kind == "int" else 2.0 ** (self.emax - self.man_bits)

    @property
    def clip_threshold(self) -> float:
        """max + top_step / 2: scaled magnitudes above it are clipped, not merely rounded, to max.

        Below it, rounding to max costs at most half a step, like any other rounding; above it
        the clamp decides the value. It is where IEEE rounding overflows (E5M2: 61440).
        464 for E4M3, 127.5 for int8, 7 for E2M1.
        """
        return self.max + self.top_step / 2

    @property
    def levels(self) -> int:
        """Number of distinct finite values, signed zero counted once (253 for E4M3, 255 for int8)."""
        positive = len(representable_values(self.name)) - 1
        return 2 * positive + 1 if self.signed else positive + 1


def _float_format(
    name: str,
    exp_bits: int,
    man_bits: int,
    *,
    has_inf: bool,
    nan_in_top_binade: bool,
    torch_dtype: str | None,
    description: str,
) -> Format:
    """Build a sign + ``exp_bits`` + ``man_bits`` minifloat record, deriving max and minima.

    has_inf:            the all-ones exponent is reserved for inf/NaN (IEEE style, E5M2)
    nan_in_top_binade:  only the all-ones code S.1111.111 is NaN, the rest of the top binade
                        is finite (the "fn" E4M3 variant)
    """
    bias = (1 << (exp_bits - 1)) - 1
    top_exp = (1 << exp_bits) - 1  # all-ones biased exponent
    if has_inf:
        max_exp, max_man = top_exp - 1, (1 << man_bits) - 1
    elif nan_in_top_binade:
        max_exp, max_man = top_exp, (1 << man_bits) - 2
    else:  # every code finite (E2M1)
        max_exp, max_man = top_exp, (1 << man_bits) - 1
    max_value = (1.0 + max_man / (1 << man_bits)) * 2.0 ** (max_exp - bias)
    return Format(
        name=name,
        kind="float",
        bits=1 + exp_bits + man_bits,
        exp_bits=exp_bits,
        man_bits=man_bits,
        max=max_value,
        min_normal=2.0 ** (1 - bias),
        min_subnormal=2.0 ** (1 - bias - man_bits),
        signed=True,
        has_inf=has_inf,
        torch_dtype=torch_dtype,
        description=description,
    )


def _int_format(name: str, bits: int, *, torch_dtype: str | None, description: str) -> Format:
    """Symmetric signed integer: codes in [-(2**(bits-1) - 1), 2**(bits-1) - 1]."""
    qmax = (1 << (bits - 1)) - 1  # 127 for int8, 7 for int4: the most negative code is left unused
    return Format(
        name=name,
        kind="int",
        bits=bits,
        exp_bits=0,
        man_bits=bits - 1,
        max=float(qmax),
        min_normal=1.0,
        min_subnormal=1.0,
        signed=True,
        has_inf=False,
        torch_dtype=torch_dtype,
        description=description,
    )


def _block_format(name: str, element: Format, *, block_size: int, scale: str, description: str) -> Format:
    """Block-scaled format whose numeric fields are those of ``element``."""
    return Format(
        name=name,
        kind="block",
        bits=element.bits,
        exp_bits=element.exp_bits,
        man_bits=element.man_bits,
        max=element.max,
        min_normal=element.min_normal,
        min_subnormal=element.min_subnormal,
        signed=element.signed,
        has_inf=False,
        block_size=block_size,
        element=element.name,
        scale=scale,
        torch_dtype=None,
        description=description,
    )


def _build_registry() -> dict[str, Format]:
    e4m3 = _float_format(
        "fp8_e4m3",
        4,
        3,
        has_inf=False,
        nan_in_top_binade=True,
        torch_dtype="float8_e4m3fn",
        description="FP8 E4M3 (fn): max 448, no inf; weights and forward activations",
    )
    e5m2 = _float_format(
        "fp8_e5m2",
        5,
        2,
        has_inf=True,
        nan_in_top_binade=False,
        torch_dtype="float8_e5m2",
        description="FP8 E5M2: max 57344, has inf; wide range, one mantissa bit less",
    )
    e2m1 = _float_format(
        "fp4_e2m1",
        2,
        1,
        has_inf=False,
        nan_in_top_binade=False,
        torch_dtype=None,
        description="FP4 E2M1: values 0, 0.5, 1, 1.5, 2, 3, 4, 6; no inf, no NaN",
    )
    int8 = _int_format("int8", 8, torch_dtype="int8", description="INT8 symmetric: codes -127..127")
    int4 = _int_format("int4", 4, torch_dtype=None, description="INT4 symmetric: codes -7..7")
    mxfp8 = _block_format(
        "mxfp8",
        e4m3,
        block_size=MX_BLOCK_SIZE,
        scale="e8m0",
        description="OCP MXFP8: E4M3 elements, one power-of-two E8M0 scale per 32",
    )
    mxfp4 = _block_format(
        "mxfp4",
        e2m1,
        block_size=MX_BLOCK_SIZE,
        scale="e8m0",
        description="OCP MXFP4: E2M1 elements, one power-of-two E8M0 scale per 32",
    )
    nvfp4 = _block_format(
        "nvfp4",
        e2m1,
        block_size=NVFP4_BLOCK_SIZE,
        scale="fp8_e4m3",
        description="NVFP4: E2M1 elements, an E4M3 scale per 16, an fp32 tensor scale",
    )
    return {f.name: f for f in (e4m3, e5m2, e2m1, int8, int4, mxfp8, mxfp4, nvfp4)}


_REGISTRY: dict[str, Format] = _build_registry()


def list_formats() -> list[str]:
    """Names of every registered format, in registry order (8-bit first, then 4-bit, then block)."""
    return list(_REGISTRY)


def get_format(name: str | Format) -> Format:
    """The :class:`Format` registered as ``name`` (a Format passes through unchanged).

    Raises ValueError naming the valid formats when ``name`` is unknown.
    """
    if isinstance(name, Format):
        return name
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        valid = ", ".join(_REGISTRY)
        raise ValueError(f"unknown number format {name!r}; valid formats are: {valid}") from None


def element_format(name: str | Format) -> Format:
    """The element format of a block format (``mxfp4`` -> ``fp4_e2m1``); other formats return themselves."""
    fmt = get_format(name)
    return get_format(fmt.element) if fmt.element else fmt


@cache
def _representable(name: str) -> tuple[float, ...]:
    fmt = element_format(name)
    if fmt.kind == "int":
        return tuple(float(v) for v in range(int(fmt.max) + 1))
    bias = fmt.exponent_bias
    values = set()
    for biased_exp in range(1 << fmt.exp_bits):
        for man in range(1 << fmt.man_bits):
            if biased_exp == 0:  # subnormal: 0.m * 2**(1 - bias)
                value = man / (1 << fmt.man_bits) * 2.0 ** (1 - bias)
            else:
                value = (1.0 + man / (1 << fmt.man_bits)) * 2.0 ** (biased_exp - bias)
            if value <= fmt.max:  # drops inf/NaN codes
                values.add(value)
    return tuple(sorted(values))


def representable_values(name: str | Format) -> list[float]:
    """The non-negative finite grid of an element format, ascending, 0.0 first.

    For a block format this is the grid of its element (before the block scale).
    127 values for fp8_e4m3 (0 and 126 positive; code 0x7F is NaN), 124 for fp8_e5m2 (the
    top binade is inf/NaN), 8 for fp4_e2m1, 128 for int8 (0..127), 8 for int4 (0..7).
    """
    return list(_representable(get_format(name).name))
