"""quantcore.formats.quantize against named sources.

Golden values: the OCP 8-bit floating point spec (OFP8 rev 1.0) and OCP MX v1.0 grids and
rounding rule (round half to even, saturating conversion), torch's own float8 casts, and the
worked examples of /work/shared/reference (fp8-int8-inference.txt section 4;
fp8-fp4-smoothquant.txt's ``nvfp4`` emulation).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quantcore.formats.catalog import get_format, list_formats, representable_values
from quantcore.formats.quantize import (
    QuantReport,
    dequantize,
    fake_quantize,
    fake_quantize_with_report,
    quantize,
    sqnr_db,
)
from quantcore.formats.rounding import decode, round_minifloat, round_to_format
from quantcore.formats.scales import AmaxHistory, compute_amax, delayed_scale, scale_from_amax

INF, NAN = math.inf, math.nan
ALL_FORMATS = list_formats()
PLAIN_FORMATS = [f for f in ALL_FORMATS if not get_format(f).is_block]
BLOCK_FORMATS = [f for f in ALL_FORMATS if get_format(f).is_block]
TORCH_FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
GRANULARITIES = [
    ("tensor", {}),
    ("channel", {}),
    ("token", {}),
    ("group", {"group_size": 16}),
    ("block", {"block": (2, 16)}),
]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


# ------------------------------------------------------------------ golden tables (scale 1: unscaled)

# (case, input, expected output). Expected values from the OCP specs' grids and RNE rule.
GOLDEN = {
    "fp8_e4m3": [
        ("+0", 0.0, 0.0),
        ("-0", -0.0, -0.0),
        ("max normal", 448.0, 448.0),
        ("-max normal", -448.0, -448.0),
        ("min normal 2^-6", 2.0**-6, 2.0**-6),
        ("min subnormal 2^-9", 2.0**-9, 2.0**-9),
        ("largest subnormal 7*2^-9", 7 * 2.0**-9, 7 * 2.0**-9),
        ("half min subnormal ties to 0", 2.0**-10, 0.0),
        ("just above half min subnormal", 2.0**-10 * 1.0001, 2.0**-9),
        ("tie 1+1/16 -> 1 (even)", 1.0625, 1.0),
        ("tie 1+3/16 -> 1.25 (even)", 1.1875, 1.25),
        ("tie 1.5*2^-9 -> 2^-8 (even)", 1.5 * 2.0**-9, 2.0**-8),
        ("tie 432 between 416 and 448 -> 448 (even)", 432.0, 448.0),
        ("rounds to max 460", 460.0, 448.0),
        ("overflow saturates 1e6", 1e6, 448.0),
        ("-overflow saturates", -1e6, -448.0),
        ("+inf saturates", INF, 448.0),
        ("-inf saturates", -INF, -448.0),
        ("worked example 0.05 -> 0.0508", 0.05, 0.05078125),
    ],
    "fp8_e5m2": [
        ("+0", 0.0, 0.0),
        ("-0", -0.0, -0.0),
        ("max normal", 57344.0, 57344.0),
        ("min normal 2^-14", 2.0**-14, 2.0**-14),
        ("min subnormal 2^-16", 2.0**-16, 2.0**-16),
        ("half min subnormal ties to 0", 2.0**-17, 0.0),
        ("tie 1.125 -> 1 (even)", 1.125, 1.0),
        ("tie 1.375 -> 1.5 (even)", 1.375, 1.5),
        ("rounds to max 61439", 61439.0, 57344.0),
        ("overflow saturates at the IEEE overflow threshold 61440", 61440.0, 57344.0),
        ("overflow saturates 1e9", 1e9, 57344.0),
        ("+inf saturates", INF, 57344.0),
    ],
    "fp4_e2m1": [
        ("+0", 0.0, 0.0),
        ("-0", -0.0, -0.0),
        ("max 6", 6.0, 6.0),
        ("min normal 1", 1.0, 1.0),
        ("min subnormal 0.5", 0.5, 0.5),
        ("tie 0.25 -> 0 (even)", 0.25, 0.0),
        ("tie 0.75 -> 1 (even)", 0.75, 1.0),
        ("tie 1.25 -> 1 (even)", 1.25, 1.0),
        ("tie 1.75 -> 2 (even)", 1.75, 2.0),
        ("tie 2.5 -> 2 (even)", 2.5, 2.0),
        ("tie 3.5 -> 4 (even)", 3.5, 4.0),
        ("tie 5 -> 4 (even)", 5.0, 4.0),
        ("-tie 5 -> -4", -5.0, -4.0),
        ("rounds to max 5.5", 5.5, 6.0),
        ("overflow saturates 100", 100.0, 6.0),
        ("-inf saturates", -INF, -6.0),
    ],
    "int8": [
        ("+0", 0.0, 0.0),
        ("max 127", 127.0, 127.0),
        ("min step 1", 1.0, 1.0),
        ("tie 0.5 -> 0 (even)", 0.5, 0.0),
        ("tie 1.5 -> 2 (even)", 1.5, 2.0),
        ("tie 2.5 -> 2 (even)", 2.5, 2.0),
        ("tie -2.5 -> -2 (even)", -2.5, -2.0),
        ("rounds to max 127.4", 127.4, 127.0),
        ("overflow saturates 200", 200.0, 127.0),
        ("symmetric: -128 saturates to -127", -128.0, -127.0),
        ("+inf saturates", INF, 127.0),
    ],
    "int4": [
        ("+0", 0.0, 0.0),
        ("max 7", 7.0, 7.0),
        ("tie 6.5 -> 6 (even)", 6.5, 6.0),
        ("tie 3.5 -> 4 (even)", 3.5, 4.0),
        ("rounds to max 7.4", 7.4, 7.0),
        ("overflow saturates 100", 100.0, 7.0),
        ("symmetric: -8 saturates to -7", -8.0, -7.0),
    ],
}


@pytest.mark.parametrize(
    "fmt, case, value, expected",
    [(fmt, case, v, e) for fmt, rows in GOLDEN.items() for case, v, e in rows],
    ids=[f"{fmt}:{case}" for fmt, rows in GOLDEN.items() for case, _, _ in rows],
)
def test_golden_edge_cases(fmt, case, value, expected):
    x = torch.tensor([value], dtype=torch.float32)
    y = fake_quantize(x, fmt, scale=1.0)
    assert y.item() == expected
    assert math.copysign(1.0, y.item()) == math.copysign(1.0, expected)  # signed zero kept
    if fmt in TORCH_FP8:  # second source: torch's own cast (of the saturated value)
        fmax = get_format(fmt).max
        assert bits(quantize(x, fmt, scale=1.0).codes).equal(bits(x.clamp(-fmax, fmax).to(TORCH_FP8[fmt])))


def test_golden_tables_cover_every_element_format():
    assert set(GOLDEN) == {f for f in ALL_FORMATS if not get_format(f).is_block}


# ------------------------------------------------------------------ reference texts' worked examples


def test_worked_example_int8_per_tensor_flushes_005():
    # fp8-int8-inference.txt, section 4: INT8 : [60.0000 0.4724 1.8898 0.0000 30.2362]
    x = torch.tensor([60.0, 0.5, 2.0, 0.05, 30.0])
    y, report = fake_quantize_with_report(x, "int8")
    assert [round(v, 4) for v in y.tolist()] == [60.0, 0.4724, 1.8898, 0.0, 30.2362]
    assert report.n_underflow == 1 and report.underflow == pytest.approx(1 / 5)
    assert report.saturation == 0.0
    assert report.scale.item() == pytest.approx(60 / 127)


def test_worked_example_unscaled_e4m3_keeps_005():
    # same section: FP8 : [60.0000 0.5000 2.0000 0.0508 30.0000]
    x = torch.tensor([60.0, 0.5, 2.0, 0.05, 30.0])
    y, report = fake_quantize_with_report(x, "fp8_e4m3", scale=1.0)
    assert [round(v, 4) for v in y.tolist()] == [60.0, 0.5, 2.0, 0.0508, 30.0]
    assert report.underflow == 0.0


def _reference_fp_round(x, mbits, emin, maxv):
    # fp8-fp4-smoothquant.txt, "The emulation we used for the measurements" (verbatim logic)
    e = torch.floor(torch.log2(x.abs().clamp(min=1e-30))).clamp(min=emin)
    step = torch.exp2(e - mbits)
    return (torch.round(x / step) * step).clamp(-maxv, maxv)


def _reference_nvfp4(x, block=16):
    e4m3 = lambda v: _reference_fp_round(v, 3, -6, 448.0)  # noqa: E731
    e2m1 = lambda v: _reference_fp_round(v, 1, 0, 6.0)  # noqa: E731
    xb = x.reshape(-1, block)
    g = x.abs().amax() / (448 * 6)
    s = e4m3(xb.abs().amax(1, keepdim=True) / 6 / g) * g
    s = torch.where(s == 0, torch.ones_like(s), s)
    return (e2m1(xb / s) * s).reshape(x.shape)


def test_nvfp4_matches_the_reference_emulation():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, generator=gen) * torch.exp(torch.randn(64, 1, generator=gen) * 2)
    assert torch.equal(fake_quantize(x, "nvfp4"), _reference_nvfp4(x))


def test_reference_emulation_e4m3_agrees_with_ours_and_torch():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4096, generator=gen) * torch.exp2(torch.randint(-12, 10, (4096,), generator=gen).float())
    ours = fake_quantize(x, "fp8_e4m3", scale=1.0)
    assert torch.equal(ours, _reference_fp_round(x, 3, -6, 448.0))
    # clamped first, as quantize does: torch 2.13's CPU cast saturates at 448, torch 2.11's gives NaN
    assert torch.equal(ours, x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float())


# ------------------------------------------------------------------ bit-identity with torch


def _wide_range(n: int, seed: int, lo: int = -24, hi: int = 20) -> torch.Tensor:
    """Values log-uniform over 2**lo..2**hi with random signs and some exact zeros."""
    gen = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.empty(n).uniform_(lo, hi, generator=gen))
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    x = mag * sign
    x[torch.rand(n, generator=gen) < 0.02] = 0.0
    return x


@pytest.mark.parametrize("fmt", sorted(TORCH_FP8))
@pytest.mark.parametrize("gran, kw", GRANULARITIES, ids=[g for g, _ in GRANULARITIES])
def test_fp8_codes_bit_identical_to_torch_cast(fmt, gran, kw):
    x = _wide_range(64 * 96, seed=2).reshape(64, 96)
    q = quantize(x, fmt, gran, **kw)
    s = _expand_scale(q.scale, gran, x.shape, kw)
    expected = (x / s).clamp(-get_format(fmt).max, get_format(fmt).max).to(TORCH_FP8[fmt])
    assert torch.equal(bits(q.codes), bits(expected))
    assert torch.equal(fake_quantize(x, fmt, gran, **kw), expected.float() * s)


def test_fp8_unclamped_cast_identical_in_range():
    # in range the clamp is a no-op: codes equal the plain cast (x / s).to(dtype), subnormals included
    x = _wide_range(20000, seed=3, lo=-30, hi=8)
    for fmt, dtype in TORCH_FP8.items():
        assert torch.equal(bits(quantize(x, fmt, scale=1.0).codes), bits(x.to(dtype)))


@pytest.mark.parametrize("fmt", sorted(TORCH_FP8))
def test_every_grid_point_midpoint_and_neighbour_matches_torch(fmt):
    grid = torch.tensor(representable_values(fmt), dtype=torch.float64)
    mids = (grid[1:] + grid[:-1]) / 2
    pts = torch.cat([grid, mids]).to(torch.float32)
    pts = torch.cat([pts, torch.nextafter(pts, torch.tensor(INF)), torch.nextafter(pts, torch.tensor(-INF))])
    pts = torch.cat([pts, -pts])
    fmax = get_format(fmt).max
    expected = pts.clamp(-fmax, fmax).to(TORCH_FP8[fmt])
    assert torch.equal(bits(quantize(pts, fmt, scale=1.0).codes), bits(expected))
    # the E2M1 emulation's algorithm, run with FP8 parameters, agrees with torch as well
    e = get_format(fmt)
    emulated = round_minifloat(pts.clamp(-fmax, fmax), e.man_bits, e.emin, fmax)
    assert torch.equal(emulated, expected.float())


def _expand_scale(scale: torch.Tensor, gran: str, shape, kw) -> torch.Tensor:
    """Per-element scale for a 2-D (R, K) input, built independently of quantize's layout code."""
    R, K = shape
    if gran == "tensor":
        return scale.expand(R, K)
    if gran in ("channel", "token"):
        return scale.expand(R, K)
    if gran == "group":
        return scale.repeat_interleave(kw["group_size"], dim=1)[:, :K]
    br, bc = kw["block"]
    return scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:R, :K]


# ------------------------------------------------------------------ granularity shapes and values


@pytest.mark.parametrize("gran, kw, shape", [
    ("tensor", {}, ()),
    ("channel", {}, (10, 1)),
    ("token", {}, (10, 1)),
    ("group", {"group_size": 32}, (10, 3)),
    ("block", {"block": (4, 32)}, (3, 3)),
])  # fmt: skip
def test_scale_shapes(gran, kw, shape):
    x = torch.randn(10, 70)
    assert tuple(quantize(x, "int8", gran, **kw).scale.shape) == shape
    assert tuple(compute_amax(x, gran, **kw).shape) == shape


def test_activation_granularity_on_3d_input():
    x = torch.randn(2, 5, 64)
    assert tuple(quantize(x, "fp8_e4m3", "token").scale.shape) == (2, 5, 1)
    assert tuple(quantize(x, "fp8_e4m3", "group", group_size=32).scale.shape) == (2, 5, 2)
    assert tuple(quantize(x, "fp8_e4m3", "block", block=(1, 128)).scale.shape) == (10, 1)
    assert tuple(quantize(x, "mxfp4").scale.shape) == (2, 5, 2)
    assert fake_quantize(x, "nvfp4").shape == x.shape


def test_partial_last_group_uses_its_own_amax():
    x = torch.ones(1, 70)
    x[0, 65] = 3.0  # in the partial last group (64..69)
    x[0, 0] = 100.0
    amax = compute_amax(x, "group", group_size=32)
    assert amax.tolist() == [[100.0, 1.0, 3.0]]
    q = quantize(x, "int8", "group", group_size=32)
    assert q.scale[0, 2].item() == pytest.approx(3.0 / 127)
    assert dequantize(q)[0, 65].item() == pytest.approx(3.0)


def test_block_scales_match_manual_tiles():
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(200, 300, generator=gen)
    q = quantize(w, "fp8_e4m3", "block", block=(128, 128))
    assert tuple(q.scale.shape) == (2, 3)
    for i in range(2):
        for j in range(3):
            tile = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            assert q.scale[i, j].item() == pytest.approx(tile.abs().max().item() / 448, rel=1e-7)


def test_per_channel_scales_are_row_amax_over_max():
    w = torch.tensor([[1.0, -4.0], [0.0, 0.0], [254.0, 1.0]])
    q = quantize(w, "int8", "channel")
    assert q.scale.flatten().tolist() == pytest.approx([4 / 127, 1.0, 2.0])  # zero row: scale 1
    assert q.codes.tolist() == [[32, -127], [0, 0], [127, 0]]  # 31.75 -> 32


# ------------------------------------------------------------------ block formats


def test_mx_shared_scale_is_the_ocp_power_of_two():
    x = torch.zeros(2, 32)
    x[0, 0] = 1000.0  # floor(log2 1000) = 9; E4M3 emax 8 -> scale 2**1
    x[1, 0] = 0.3  # floor(log2 0.3) = -2 -> scale 2**-10
    q = quantize(x, "mxfp8")
    assert q.scale.flatten().tolist() == [2.0, 2.0**-10]
    assert q.scale_codes.flatten().tolist() == [128, 117]  # E8M0 = exponent + 127
    y, report = fake_quantize_with_report(x, "mxfp8")
    assert y[0, 0].item() == 896.0  # 1000 / 2 = 500 -> clipped to 448 -> * 2
    assert report.n_saturated == 1  # 500 > 464 (max + half step)


def test_mx_weights_take_compressed_tensors_scales_activations_the_ocp_ones():
    """A checkpoint's MX weight scales are compressed-tensors' (generate_mx_scales): the block amax rounded to a power
    of two first, up from 1.75 x 2**e, so 7.5 (1.875 x 4) gets scale 2 where OCP's floor(log2 7.5) - 2 gives 1 and
    clips it to 6. Activations, quantized at serving time, keep the OCP rule."""
    from quantcore.formats.weights import fake_quantize_weight, mx_weight_scale
    from quantcore.schemes.specs import TensorSpec

    spec = TensorSpec("mxfp4", "group", dynamic=False)
    w = torch.tensor([[7.5] + [1.0] * 31, [6.9] + [1.0] * 31, [1000.0] + [1.0] * 31])
    assert mx_weight_scale(w, spec).flatten().tolist() == [2.0, 1.0, 256.0]  # 6.9 = 1.725 x 4: below the line
    wq, report = fake_quantize_weight(w, spec)
    # 6.9 rounds to 6, within half a step (7): with these scales no weight ever lands past it
    assert wq[0, 0].item() == 8.0 and wq[1, 0].item() == 6.0 and report.n_saturated == 0
    assert wq[2, 0].item() == 1024.0 and wq[2, 1].item() == 0.0  # 1000 / 256 = 3.9 -> 4; its ones flush
    assert quantize(w, "mxfp4").scale.flatten().tolist() == [1.0, 1.0, 128.0]  # the OCP rule, for activations
    mx8 = TensorSpec("mxfp8", "group", dynamic=False)
    assert mx_weight_scale(torch.tensor([[1000.0] + [0.0] * 31]), mx8).item() == 4.0  # 1000 / 4 = 250: no clip
    with pytest.raises(ValueError, match="no E8M0"):
        mx_weight_scale(w, TensorSpec("int4", "group", group_size=32))


def test_mxfp4_clips_the_top_of_a_block_by_design():
    x = torch.tensor([[7.5] + [1.0] * 31])  # floor(log2 7.5) = 2, E2M1 emax 2 -> scale 1
    y, report = fake_quantize_with_report(x, "mxfp4")
    assert y[0, 0].item() == 6.0 and report.saturation == pytest.approx(1 / 32)
    assert quantize(x, "mxfp4").scale.item() == 1.0


def test_nvfp4_two_level_scale():
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 16] = 2688.0, 6.0  # g = 2688 / 2688 = 1; block scales 448 and 1
    q = quantize(x, "nvfp4")
    assert q.tensor_scale.item() == 1.0
    assert q.scale.flatten().tolist() == [448.0, 1.0]
    assert q.scale_codes.dtype == torch.float8_e4m3fn
    assert dequantize(q)[0, [0, 16]].tolist() == [2688.0, 6.0]


def test_nvfp4_static_tensor_scale_and_zero_block_scale():
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 16] = 1000.0, 1e-6
    y, report = fake_quantize_with_report(x, "nvfp4", scale=scale_from_amax(1000.0, "nvfp4"))
    assert y[0, 0].item() == pytest.approx(1000.0, rel=0.07)
    # 1e-6 / 6 / (1000 / 2688) underflows E4M3 (< 2^-10): that block's scale is 0 and it flushes
    assert y[0, 16].item() == 0.0 and report.n_underflow == 1


def test_block_format_granularity_errors():
    with pytest.raises(ValueError, match="fixes its own scale blocks"):
        fake_quantize(torch.randn(4, 32), "mxfp4", "channel")
    with pytest.raises(ValueError, match="group_size=16"):
        fake_quantize(torch.randn(4, 32), "nvfp4", "group", group_size=32)
    with pytest.raises(ValueError, match="do not pass scale"):
        fake_quantize(torch.randn(4, 32), "mxfp8", scale=1.0)


# ------------------------------------------------------------------ special values


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_nan_stays_in_place_and_does_not_poison_the_scale(fmt):
    x = torch.linspace(-3, 3, 64).reshape(2, 32)
    x_nan = x.clone()
    x_nan[0, 5] = NAN
    y, y_nan = fake_quantize(x, fmt), fake_quantize(x_nan, fmt)
    assert math.isnan(y_nan[0, 5].item())
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[0, 5] = False
    assert torch.equal(y_nan[mask], y[mask])  # the NaN did not change anyone's scale
    assert torch.isfinite(y_nan[mask]).all()
    _, report = fake_quantize_with_report(x_nan, fmt)
    assert report.n_nan == 1


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_inf_saturates_and_finite_inputs_never_give_inf_or_nan(fmt):
    x = torch.tensor([[1.0, -2.0, INF, -INF] + [0.5] * 28])
    y, report = fake_quantize_with_report(x, fmt)
    assert torch.isfinite(y).all()
    assert report.n_saturated >= 2
    huge = torch.tensor([[3e38, -3e38, 1e-38, -1e-45] + [1.0] * 28])
    for scale in (None, 1.0, 1e-30):
        kwargs = {} if scale is None or fmt in ("mxfp8", "mxfp4") else {"scale": scale}
        assert torch.isfinite(fake_quantize(huge, fmt, **kwargs)).all()


def test_quantize_nan_policy():
    x = torch.tensor([1.0, NAN])
    assert bits(quantize(x, "fp8_e4m3").codes)[1].item() == 0x7F  # E4M3 NaN code, as torch casts it
    for fmt in ("int8", "int4", "fp4_e2m1"):
        with pytest.raises(ValueError, match="no NaN code"):
            quantize(x, fmt)


def test_all_zero_and_empty_tensors():
    z = torch.zeros(4, 32)
    for fmt in ALL_FORMATS:
        y, report = fake_quantize_with_report(z, fmt)
        assert torch.equal(y, z) and report.n_underflow == 0 and report.underflow == 0.0
    e = torch.zeros(0, 32)
    assert fake_quantize(e, "fp8_e4m3", "token").shape == (0, 32)


def test_signed_zero_preserved():
    x = torch.tensor([-0.0, 0.0, 1.0] + [0.0] * 29)
    for fmt in ALL_FORMATS:
        y = fake_quantize(x, fmt)
        assert math.copysign(1.0, y[0].item()) == -1.0, fmt


# ------------------------------------------------------------------ CPU fast paths == the reference formulas

# The CPU shortcuts in quantcore.formats.quantize (amax from max/min, rounding by exponent bits instead of
# float8 casts, read-only report counts) must give the very same bits as the branch-free formulas
# accelerators run; _may_branch switches between the two.
MINIFLOATS = ["fp8_e4m3", "fp8_e5m2", "fp4_e2m1"]


def _int_bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a float tensor (NaN payloads and signs of zero compare exactly)."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _grid_points_midpoints_neighbours(fmt: str, dtype: torch.dtype) -> torch.Tensor:
    grid = torch.tensor(representable_values(fmt), dtype=torch.float64)
    pts = torch.cat([grid, (grid[1:] + grid[:-1]) / 2]).to(dtype)
    pts = torch.cat(
        [
            pts,
            torch.nextafter(pts, torch.tensor(INF, dtype=dtype)),
            torch.nextafter(pts, torch.tensor(-INF, dtype=dtype)),
        ]
    )
    tiny = torch.tensor([torch.finfo(dtype).tiny, torch.finfo(dtype).smallest_normal / 3, 1e-45], dtype=dtype)
    pts = torch.cat([pts, tiny, _wide_range(4000, seed=21, lo=-30, hi=12).to(dtype)])
    fmax = get_format(fmt).max
    return torch.cat([pts, -pts]).clamp(-fmax, fmax)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("fmt", MINIFLOATS)
def test_in_place_minifloat_rounding_matches_torch_casts_and_reference(fmt, dtype, monkeypatch):
    # (every float32 in [-max, max] was also checked once, offline: 2.3e9 values per format, all equal)
    from quantcore.formats import rounding

    e = get_format(fmt)
    pts = _grid_points_midpoints_neighbours(fmt, dtype)
    reference = round_minifloat(pts, e.man_bits, e.emin, e.max)
    monkeypatch.setattr(rounding, "_ROUND_CHUNK", 1000)  # several slices, a partial last one
    ours = rounding._round_minifloat_(pts.clone(), e.man_bits, e.emin)
    assert torch.equal(_int_bits(ours), _int_bits(reference))
    strided = pts.clone().reshape(-1, 2).t()  # a non-contiguous view is rounded in one piece
    assert torch.equal(
        _int_bits(rounding._round_minifloat_(strided, e.man_bits, e.emin).t().reshape(-1)), _int_bits(reference)
    )
    if fmt in TORCH_FP8:
        cast = pts.to(TORCH_FP8[fmt]).to(dtype)
        # round_to_format (what quantize runs) is torch's cast bit for bit in both dtypes; torch casts
        # float64 through float32 (two roundings), so float64 keeps the cast, and the emulation,
        # which rounds once, equals it on float32 only
        assert torch.equal(_int_bits(round_to_format(pts, fmt)), _int_bits(cast))
        if dtype == torch.float32:
            assert torch.equal(_int_bits(ours), _int_bits(cast))


def _special_inputs(shape, dtype) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape, generator=gen) * 3)
    special = base.clone().flatten()
    special[:8] = torch.tensor([NAN, INF, -INF, -0.0, 0.0, 1e-30, -1e-42, 3.0])
    zeros = torch.zeros(shape)
    zeros.view(-1)[::3] = -0.0
    infs = base.clone()
    infs.view(-1)[::7] = INF
    cases = [("wide", base), ("special", special.reshape(shape)), ("zeros", zeros), ("infs", infs)]
    return [(name, x.to(dtype)) for name, x in cases]


def _scales_for(fmt: str):
    if get_format(fmt).scale == "e8m0":
        return [None]
    return [None, 1.0, 1e-3]  # dynamic; static, saturating inputs above max; static, tiny


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_cpu_shortcuts_match_branch_free_formulas(fmt, dtype, monkeypatch):
    from quantcore.formats import quantize as qmod
    from quantcore.formats import rounding, scales

    def run_all(x, gran, kw, scale):
        y, rep = fake_quantize_with_report(x, fmt, gran, scale=scale, **kw)
        q = quantize(x, fmt, gran, scale=scale, **kw) if not torch.isnan(x).any() else None
        return (
            fake_quantize(x, fmt, gran, scale=scale, **kw),
            y,
            (rep.n_elements, rep.n_nonzero, rep.n_saturated, rep.n_underflow, rep.n_nan),
            rep.scale,
            None
            if q is None
            else (q.codes.view(torch.uint8) if q.codes.element_size() == 1 else q.codes, q.scale),
            compute_amax(x, "tensor"),
        )

    grans = [("tensor", {})] if get_format(fmt).is_block else [*GRANULARITIES, ("group", {"group_size": 7})]
    checked = 0
    for name, x in _special_inputs((12, 40), dtype):
        for gran, kw in grans:
            for scale in _scales_for(fmt):
                if scale is not None and gran != "tensor":
                    continue
                fast = run_all(x, gran, kw, scale)
                for module in (qmod, rounding, scales):  # every module that branches on may_branch
                    monkeypatch.setattr(module, "may_branch", lambda t: False)
                slow = run_all(x, gran, kw, scale)
                monkeypatch.undo()
                for a, b in zip(fast, slow, strict=True):
                    if isinstance(a, torch.Tensor):
                        assert torch.equal(_int_bits(a), _int_bits(b)), (name, gran, scale)
                    elif isinstance(a, tuple) and a and isinstance(a[0], torch.Tensor):
                        assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True)), (name, gran, scale)
                    else:
                        assert a == b, (name, gran, scale)
                checked += 1
    assert checked >= 4  # every input case ran (MX formats: one granularity, dynamic scales only)


def test_fast_report_counts_on_a_worked_case():
    # [0, -0, nan, inf, 1e-6 (flushed by int8), 1, 200 (saturates at scale 1: |200| > 127.5), -3]
    x = torch.tensor([0.0, -0.0, NAN, INF, 1e-6, 1.0, 200.0, -3.0])
    _, rep = fake_quantize_with_report(x, "int8", scale=1.0)
    assert (rep.n_elements, rep.n_nonzero, rep.n_saturated, rep.n_underflow, rep.n_nan) == (8, 5, 2, 1, 1)
    _, rep = fake_quantize_with_report(x[[0, 1, 4, 5, 7]], "int8", scale=1.0)  # no NaN, nothing clipped
    assert (rep.n_elements, rep.n_nonzero, rep.n_saturated, rep.n_underflow, rep.n_nan) == (5, 3, 0, 1, 0)


# ------------------------------------------------------------------ reports, static and delayed scales


def test_static_scale_saturation_report():
    x = torch.tensor([1.0, 2.0, 4.0, 8.0])
    s = scale_from_amax(2.0, "fp8_e4m3")  # calibrated on traffic up to 2.0
    y, report = fake_quantize_with_report(x, "fp8_e4m3", scale=s)
    assert y.tolist() == [1.0, 2.0, 2.0, 2.0]
    assert report.n_saturated == 2 and report.saturation == 0.5  # 4 and 8 clipped
    dyn = fake_quantize_with_report(x, "fp8_e4m3")[1]
    assert dyn.saturation == 0.0


def test_report_sum():
    a = QuantReport(10, 8, 1, 2, 0)
    b = QuantReport(10, 2, 0, 0, 1)
    total = a + b
    assert (total.n_elements, total.n_nonzero, total.n_saturated, total.n_underflow, total.n_nan) == (
        20,
        10,
        1,
        2,
        1,
    )
    assert total.saturation == 0.05 and total.underflow == 0.2


def test_scale_from_amax_values():
    assert scale_from_amax(448.0, "fp8_e4m3").item() == 1.0
    assert scale_from_amax(127.0, "int8").item() == 1.0
    assert scale_from_amax(2688.0, "nvfp4").item() == 1.0
    assert scale_from_amax(0.0, "int8").item() == 1.0
    assert scale_from_amax(6.0, "mxfp4").item() == 1.0  # floor(log2 6) - 2 = 0
    assert scale_from_amax(torch.tensor([1e-45]), "fp8_e4m3").item() > 0  # never 0


def test_static_scale_validation():
    with pytest.raises(ValueError, match="finite and > 0"):
        fake_quantize(torch.randn(4), "int8", scale=0.0)
    with pytest.raises(ValueError, match="needs 1 or shape"):
        fake_quantize(torch.randn(4, 8), "int8", "channel", scale=torch.ones(3))
    s = torch.tensor([[1.0], [2.0]])
    y = fake_quantize(torch.full((2, 4), 100.0), "int8", "channel", scale=s)
    assert y[:, 0].tolist() == [100.0, 100.0]


def test_delayed_scaling_window():
    hist = AmaxHistory(window=3)
    assert hist.scale("fp8_e4m3").item() == 1.0  # empty history: zero amax -> scale 1
    for amax in (448.0, 896.0, 224.0):
        hist.push(amax)
    assert hist.history.tolist() == [224.0, 896.0, 448.0]  # newest first
    assert hist.scale("fp8_e4m3").item() == 2.0  # max of window
    assert hist.scale("fp8_e4m3", algo="most_recent").item() == 0.5
    assert hist.scale("fp8_e4m3", margin=1).item() == 4.0
    hist.push(100.0)  # 448 falls out of the window; 896 still in
    assert hist.scale("fp8_e4m3").item() == 2.0
    assert delayed_scale(torch.tensor([127.0, 254.0]), "int8").item() == 2.0
    with pytest.raises(ValueError, match="algo"):
        delayed_scale(torch.tensor([1.0]), "int8", algo="mean")


def test_sqnr_db():
    ref = torch.ones(4)
    assert sqnr_db(ref, ref * 1.1) == pytest.approx(20.0)  # 4 / (4 * 0.01) = 100 -> 20 dB
    assert sqnr_db(ref, ref) == math.inf
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    # about 6 dB per bit: int8 per-tensor well above int4
    assert sqnr_db(x, fake_quantize(x, "int8")) > sqnr_db(x, fake_quantize(x, "int4")) + 20


# ------------------------------------------------------------------ codes, dtypes, devices


# every plain format at every granularity; block formats fix their own granularity (asked as "tensor")
CODE_CASES = [(f, g, kw) for f in PLAIN_FORMATS for g, kw in GRANULARITIES] + [(f, "tensor", {}) for f in BLOCK_FORMATS]


@pytest.mark.parametrize("fmt, gran, kw", CODE_CASES, ids=[f"{f}-{g}" for f, g, _ in CODE_CASES])
def test_quantize_dequantize_equals_fake_quantize(fmt, gran, kw):
    x = _wide_range(24 * 80, seed=7, lo=-8, hi=8).reshape(24, 80)
    q = quantize(x, fmt, gran, **kw)
    assert q.codes.shape == x.shape
    assert torch.equal(dequantize(q), fake_quantize(x, fmt, gran, **kw))


def test_code_dtypes_and_fp4_nibbles():
    x = torch.tensor([6.0, -0.5, 0.0, -0.0, 1.5, 3.0])
    q = quantize(x, "fp4_e2m1", scale=1.0)
    assert q.codes.dtype == torch.uint8
    assert q.codes.tolist() == [0b0111, 0b1001, 0b0000, 0b1000, 0b0011, 0b0101]
    assert decode(q.codes, "fp4_e2m1").tolist() == [6.0, -0.5, 0.0, -0.0, 1.5, 3.0]
    assert quantize(x, "int4").codes.dtype == torch.int8
    assert quantize(x, "int4").codes.abs().max().item() == 7
    assert quantize(x, "mxfp8").codes.dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_output_dtype_and_single_rounding(dtype):
    x = torch.randn(8, 64).to(dtype)
    for fmt in ALL_FORMATS:
        y = fake_quantize(x, fmt, "tensor")
        assert y.dtype == dtype and y.shape == x.shape
    if dtype != torch.float64:  # 16-bit inputs are scaled in fp32: same result as from x.float()
        assert torch.equal(fake_quantize(x, "fp8_e4m3"), fake_quantize(x.float(), "fp8_e4m3").to(dtype))


def test_input_validation_messages():
    with pytest.raises(ValueError, match="floating-point"):
        fake_quantize(torch.arange(4), "int8")
    with pytest.raises(ValueError, match="unknown granularity"):
        fake_quantize(torch.randn(4), "int8", "row")
    with pytest.raises(ValueError, match="group_size"):
        fake_quantize(torch.randn(4, 8), "int8", "group")
    with pytest.raises(ValueError, match=r"block=\(rows, cols\)"):
        fake_quantize(torch.randn(4, 8), "int8", "block")
    with pytest.raises(ValueError, match="valid formats"):
        fake_quantize(torch.randn(4), "fp3")
    with pytest.raises(ValueError, match="at least one dimension"):
        fake_quantize(torch.tensor(1.0), "int8", "token")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_cuda_matches_cpu_bit_for_bit(fmt):
    x = _wide_range(64 * 256, seed=11, lo=-12, hi=12).reshape(64, 256)
    for gran, kw in GRANULARITIES:
        if get_format(fmt).is_block and gran != "tensor":
            continue
        cpu = fake_quantize(x, fmt, gran, **kw)
        gpu = fake_quantize(x.cuda(), fmt, gran, **kw)
        assert gpu.device.type == "cuda"
        assert torch.equal(gpu.cpu(), cpu), (fmt, gran)


# ------------------------------------------------------------------ Hypothesis properties, every format

PROPERTY_SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_finite = st.floats(min_value=-1e5, max_value=1e5, allow_nan=False, allow_infinity=False, width=32)


@st.composite
def matrices(draw) -> torch.Tensor:
    rows = draw(st.integers(1, 4))
    cols = draw(st.integers(1, 40))
    values = draw(st.lists(_finite, min_size=rows * cols, max_size=rows * cols))
    return torch.tensor(values, dtype=torch.float32).reshape(rows, cols)


def _grans_for(fmt: str):
    return [("tensor", {})] if get_format(fmt).is_block else GRANULARITIES


@pytest.mark.parametrize("fmt", ALL_FORMATS)
@PROPERTY_SETTINGS
@given(x=matrices())
def test_property_sign_symmetry_and_idempotence(fmt, x):
    for gran, kw in _grans_for(fmt):
        y = fake_quantize(x, fmt, gran, **kw)
        assert torch.equal(fake_quantize(-x, fmt, gran, **kw), -y)
        # the dynamic scale of y may differ from x's in its last bit (amax/max rounds): close, not equal
        assert torch.allclose(fake_quantize(y, fmt, gran, **kw), y, rtol=2e-6, atol=0)
    if fmt != "mxfp8" and fmt != "mxfp4":  # with one fixed scale, exactly idempotent
        s = scale_from_amax(x.abs().max(), fmt)
        y = fake_quantize(x, fmt, scale=s)
        assert torch.equal(fake_quantize(y, fmt, scale=s), y)


@pytest.mark.parametrize("fmt", ALL_FORMATS)
@PROPERTY_SETTINGS
@given(v=st.lists(st.floats(allow_nan=False, width=32), min_size=1, max_size=64))
def test_property_rounding_on_grid_within_half_step_and_saturating(fmt, v):
    y = torch.tensor(v, dtype=torch.float32)
    r = round_to_format(y, fmt)
    elem = get_format(get_format(fmt).element or fmt)
    grid = torch.tensor(representable_values(elem.name))
    assert torch.isin(r.abs(), grid).all()  # on the grid, never inf/NaN
    assert torch.equal(round_to_format(-y, fmt), -r)
    inside = y.abs() <= elem.max
    if elem.kind == "int":
        step = torch.ones_like(y)
    else:
        _, e = torch.frexp(y.abs())
        step = torch.exp2((e - 1).clamp(min=elem.emin).float() - elem.man_bits)
    assert ((r - y).abs()[inside] <= step[inside] / 2).all()
    assert (r.abs()[~inside] == elem.max).all()  # saturation bound


@pytest.mark.parametrize("fmt", ALL_FORMATS)
@PROPERTY_SETTINGS
@given(x=matrices())
def test_property_error_and_saturation_bounds_per_tensor(fmt, x):
    y, report = fake_quantize_with_report(x, fmt)
    amax = x.abs().max().item()
    fmt_obj = get_format(fmt)
    if not fmt_obj.is_block:
        s = scale_from_amax(amax, fmt).item()
        assert y.abs().max().item() <= amax * (1 + 1e-6)  # dynamic scale: nothing beyond amax
        assert report.n_saturated == 0
        # error within half a step of the grid at each value's magnitude (in scaled units)
        v = x / s
        if fmt_obj.kind == "int":
            step = torch.ones_like(v)
        else:
            _, e = torch.frexp(v.abs())
            step = torch.exp2((e - 1).clamp(min=fmt_obj.emin).float() - fmt_obj.man_bits)
        assert ((y - x).abs() <= (step / 2 * s) * (1 + 1e-4) + 1e-30).all()  # slack: fp32 products
    else:
        # block formats: never beyond the block amax by more than half a top step of its scale
        q = quantize(x, fmt)
        top = fmt_obj.top_step * (q.scale if q.tensor_scale is None else q.scale * q.tensor_scale)
        assert y.abs().amax() <= amax + (top.max() / 2).item() * (1 + 1e-6)
    assert 0.0 <= report.saturation <= 1.0 and 0.0 <= report.underflow <= 1.0


# ---------------------------------------------------------------------------- weights as checkpoints store them


def grid_divisor(qmin: int, qmax: int) -> float:
    return (qmax - qmin) / 2


@pytest.mark.parametrize(("scheme", "qmin", "qmax", "group"), [("W4A16", -8, 7, 128), ("W8A16", -128, 127, None)])
def test_int_weights_sit_on_compressed_tensors_grid(scheme, qmin, qmax, group):
    """Symmetric int weights as compressed-tensors stores them: scale amax / ((qmax - qmin) / 2), codes
    qmin..qmax; the most negative weight of a group lands on qmin, the largest positive one clips to qmax."""
    from quantcore.formats.weights import fake_quantize_weight, int_weight_grid, weight_scale
    from quantcore.schemes.presets import get_scheme

    spec = get_scheme(scheme).weights
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(64, 256, generator=gen)
    w[0, 5] = -grid_divisor(qmin, qmax)  # row 0 (and its first group): the amax is negative; its scale is 1.0
    w[1, 7] = grid_divisor(qmin, qmax)  # row 1: the amax is positive
    grid = int_weight_grid(spec.format)
    assert (grid.qmin, grid.qmax, grid.divisor) == (qmin, qmax, (qmax - qmin) / 2)
    scale = weight_scale(w, spec)
    per = w.reshape(64, -1, group) if group else w.unsqueeze(1)
    assert torch.equal(scale.reshape(64, -1), (per.abs().amax(-1).double() / grid.divisor).float())
    wq, report = fake_quantize_weight(w, spec)
    s0 = scale.reshape(64, -1)[0, 0]
    s1 = scale.reshape(64, -1)[1, 0]
    assert s0 == s1 == 1.0
    assert wq[0, 5] == qmin and wq[1, 7] == qmax  # -amax exactly on qmin, +amax clipped by half a step
    codes = wq.reshape(64, -1, group or 256) / scale.reshape(64, -1, 1)
    assert torch.allclose(codes, codes.round(), atol=1e-4) and codes.min() >= qmin - 1e-4 and codes.max() <= qmax + 1e-4
    assert report.n_saturated == 0 and report.n_elements == w.numel() and report.scale is not None
    again, none = fake_quantize_weight(w, spec, report=False)
    assert torch.equal(again, wq) and none.n_elements == 0
    # float formats keep fake_quantize's grid and report
    fp8 = get_scheme("FP8_DYNAMIC").weights
    got, rep = fake_quantize_weight(w, fp8)
    want, want_rep = fake_quantize_with_report(w, "fp8_e4m3", "channel")
    assert torch.equal(got, want) and rep.n_underflow == want_rep.n_underflow


@pytest.mark.parametrize(("scheme", "group"), [("W4A16_ASYM", 128), ("W4A16_G64_ASYM", 64)])
def test_asymmetric_int4_weights_span_each_groups_min_to_max(scheme, group):
    """A zero point per group (compressed-tensors' W4A16_ASYM): scale (max - min) / 15, zero point
    round(-8 - min / scale), so a group's 16 levels cover its own range. The group's minimum lands on code -8, its
    maximum on 7 (up to the rounding of the zero point), zero is exact, and on weights that are not centred on zero
    the error is smaller than the symmetric grid's."""
    from quantcore.formats.weights import fake_quantize_weight, weight_scale, weight_zero_point
    from quantcore.schemes.presets import get_scheme

    spec = get_scheme(scheme).weights
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(32, 256, generator=gen) * 0.02 + 0.01 * torch.arange(32).unsqueeze(1) / 32  # rows off centre
    w[3, 10] = 0.0
    scale, zp = weight_scale(w, spec), weight_zero_point(w, spec)
    per = w.reshape(32, -1, group)
    lo, hi = per.amin(-1).clamp(max=0), per.amax(-1).clamp(min=0)
    assert torch.equal(scale, ((hi - lo).double() / 15).float())
    assert torch.equal(zp, torch.round(torch.clamp(-8 - lo / scale, -8, 7)))
    assert zp.unique().numel() > 1 and zp.min() >= -8 and zp.max() <= 7
    wq, report = fake_quantize_weight(w, spec)
    codes = wq.reshape(32, -1, group) / scale.unsqueeze(-1) + zp.unsqueeze(-1)
    assert torch.allclose(codes, codes.round(), atol=1e-3) and codes.min() >= -8 - 1e-3 and codes.max() <= 7 + 1e-3
    assert wq[3, 10] == 0.0 and report.n_saturated == 0
    # every group uses (nearly) its full range: its lowest code -8 or -7, its highest 6 or 7
    assert codes.amin(-1).round().max() <= -7 and codes.amax(-1).round().min() >= 6
    sym, _ = fake_quantize_weight(w, dataclasses.replace(spec, symmetric=True))
    assert (wq - w).pow(2).mean() < 0.8 * (sym - w).pow(2).mean()
    assert weight_zero_point(w, dataclasses.replace(spec, symmetric=True)) is None


def test_apply_plan_puts_int_weights_on_the_checkpoint_grid(tiny_llama):
    from quantcore.algorithms.apply import apply_plan
    from quantcore.formats.weights import fake_quantize_weight
    from quantcore.schemes.presets import get_scheme

    layer = "model.layers.0.mlp.down_proj"
    w = tiny_llama.get_submodule(layer).weight.detach().clone()
    applied = apply_plan(tiny_llama, {layer: "W4A16"})
    got = tiny_llama.get_submodule(layer).weight.detach().clone()
    applied.restore()
    assert torch.equal(got, fake_quantize_weight(w, get_scheme("W4A16").weights)[0])
    assert not torch.equal(got, fake_quantize(w, "int4", "group", group_size=128))  # not the -7..7 grid
