"""quantcore.formats.catalog: the format table against its sources (OCP FP8 / MX specs and torch's own dtypes)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from quantcore.formats.catalog import Format, element_format, get_format, list_formats, representable_values

# Golden field values. Sources: OCP 8-bit Floating Point Specification (OFP8) rev 1.0 table 1
# (E4M3: max 448, min normal 2^-6, min subnormal 2^-9; E5M2: max 57344, 2^-14, 2^-16), OCP MX v1.0
# table 1 (E2M1: max 6, min normal 1, min subnormal 0.5; block 32, E8M0 scale) and NVIDIA's NVFP4
# (block 16, E4M3 scale).
GOLDEN = {
    # name: (kind, bits, exp_bits, man_bits, max, min_normal, min_subnormal, has_inf, block, element, scale, dtype)
    "fp8_e4m3": ("float", 8, 4, 3, 448.0, 2**-6, 2**-9, False, None, None, None, "float8_e4m3fn"),
    "fp8_e5m2": ("float", 8, 5, 2, 57344.0, 2**-14, 2**-16, True, None, None, None, "float8_e5m2"),
    "fp4_e2m1": ("float", 4, 2, 1, 6.0, 1.0, 0.5, False, None, None, None, None),
    "int8": ("int", 8, 0, 7, 127.0, 1.0, 1.0, False, None, None, None, "int8"),
    "int4": ("int", 4, 0, 3, 7.0, 1.0, 1.0, False, None, None, None, None),
    "mxfp8": ("block", 8, 4, 3, 448.0, 2**-6, 2**-9, False, 32, "fp8_e4m3", "e8m0", None),
    "mxfp4": ("block", 4, 2, 1, 6.0, 1.0, 0.5, False, 32, "fp4_e2m1", "e8m0", None),
    "nvfp4": ("block", 4, 2, 1, 6.0, 1.0, 0.5, False, 16, "fp4_e2m1", "fp8_e4m3", None),
}


def test_registry_lists_exactly_the_issue_formats():
    assert sorted(list_formats()) == sorted(GOLDEN)


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_format_fields_match_the_specs(name):
    fmt = get_format(name)
    kind, bits, e, m, mx, mn, ms, inf, block, elem, scale, dtype = GOLDEN[name]
    assert (fmt.name, fmt.kind, fmt.bits, fmt.exp_bits, fmt.man_bits) == (name, kind, bits, e, m)
    assert (fmt.max, fmt.min_normal, fmt.min_subnormal) == (mx, mn, ms)
    assert (fmt.has_inf, fmt.block_size, fmt.element, fmt.scale, fmt.torch_dtype) == (
        inf,
        block,
        elem,
        scale,
        dtype,
    )
    assert fmt.signed is True
    assert fmt.is_block == (kind == "block")


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2", "int8"])
def test_format_max_agrees_with_torch_finfo_iinfo(name):
    fmt = get_format(name)
    dtype = getattr(torch, fmt.torch_dtype)
    if fmt.kind == "int":
        assert fmt.max == torch.iinfo(dtype).max  # 127; the symmetric range leaves -128 unused
    else:
        info = torch.finfo(dtype)
        assert (fmt.max, fmt.min_normal, fmt.min_subnormal) == (
            info.max,
            info.tiny,
            info.smallest_normal * 2.0**-fmt.man_bits,
        )


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_representable_values_equal_torch_decoding_of_all_256_codes(name):
    dtype = getattr(torch, get_format(name).torch_dtype)
    decoded = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).to(torch.float64)
    finite_nonneg = sorted({v for v in decoded.tolist() if v == v and abs(v) != float("inf") and v >= 0})
    assert representable_values(name) == finite_nonneg


def test_fp4_e2m1_grid_is_the_ocp_table():
    # OCP MX v1.0 table 5: the eight non-negative E2M1 values
    assert representable_values("fp4_e2m1") == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert representable_values("mxfp4") == representable_values("nvfp4") == representable_values("fp4_e2m1")


def test_int_grids_and_levels():
    assert representable_values("int4") == [float(v) for v in range(8)]
    assert len(representable_values("int8")) == 128
    assert get_format("int8").levels == 255  # -127..127
    assert get_format("fp8_e4m3").levels == 253  # 256 codes - 2 NaNs - one duplicate zero
    assert get_format("fp8_e5m2").levels == 247  # 256 - 6 NaN - 2 inf - one duplicate zero


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2", "fp4_e2m1"])
def test_derived_exponents(name):
    fmt = get_format(name)
    assert 2.0**fmt.emin == fmt.min_normal
    assert 2.0**fmt.emax <= fmt.max < 2.0 ** (fmt.emax + 1)
    assert {"fp8_e4m3": 8, "fp8_e5m2": 15, "fp4_e2m1": 2}[name] == fmt.emax  # OCP MX emax_elem


def test_unknown_format_lists_the_valid_ones():
    with pytest.raises(ValueError) as err:
        get_format("fp8_e3m4")
    for name in list_formats():
        assert name in str(err.value)


def test_get_format_passes_a_format_through_and_element_format_unwraps_blocks():
    fmt = get_format("nvfp4")
    assert get_format(fmt) is fmt
    assert element_format("nvfp4").name == "fp4_e2m1"
    assert element_format("fp8_e5m2").name == "fp8_e5m2"
    assert isinstance(fmt, Format)


def test_format_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_format("int8").max = 255.0  # type: ignore[misc]


def test_formats_and_schemes_import_without_torch():
    code = (
        "import sys, quantcore, quantcore.formats.catalog, quantcore.schemes.specs; "
        "quantcore.list_formats(); quantcore.list_schemes(); "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
