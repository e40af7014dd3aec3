"""The roofline bound of a plan's step on a target GPU, checked against the reference text's own figures."""

from __future__ import annotations

import subprocess
import sys

import pytest

from quantcore.kernels.hardware import TARGETS
from quantcore.kernels.roofline import step_bound

# an "8B model" as the reference counts it: 8e9 weights, here in eight 31,250 x 32,000 linears
SHAPES = {f"layers.{i}": (31_250, 32_000) for i in range(8)}


def uniform(scheme: str) -> dict[str, str]:
    return {name: scheme for name in SHAPES}


@pytest.mark.parametrize(("scheme", "m", "ms"), [
    # "For an 8B model the ideal bound at batch 1 is 4.78 ms per step in bf16, ... 2.39 ms with FP8.
    #  At batch 512 the order flips: bf16 and W4A16 both need 8.28 ms, FP8 needs 4.14 ms." (H100 SXM)
    ("BF16", 1, 4.78), ("FP8_DYNAMIC", 1, 2.39), ("BF16", 512, 8.28), ("W4A16", 512, 8.28), ("FP8_DYNAMIC", 512, 4.14),
    ("INT8_W8A8", 512, 4.14),  # INT8 tensor cores run at the FP8 rate on Hopper
])
def test_the_reference_texts_8b_bounds_on_an_h100(scheme: str, m: int, ms: float) -> None:
    bound = step_bound(uniform(scheme), SHAPES, "h100", m)
    assert bound.ms == pytest.approx(ms, abs=0.005)
    assert bound.memory_bound == (8 if m == 1 else 0) and bound.layers == 8 and not bound.not_native


def test_int4_weights_cost_their_stored_bits() -> None:
    # the reference's 1.27 ms is 4.25 bits a weight; W4A16's groups of 128 with a 16-bit scale store 4.125
    bound = step_bound(uniform("W4A16"), SHAPES, "h100", 1)
    assert bound.ms == pytest.approx(8e9 * 4.125 / 8 / 3.35e12 * 1e3, rel=1e-6)
    assert bound.ms == pytest.approx(1.27 * 4.125 / 4.25, abs=0.005)
    assert bound.compute_ms < bound.memory_ms == pytest.approx(bound.ms)


def test_w4afp8_reads_w4a16s_weights_and_does_fp8s_math_on_hopper() -> None:
    # "weight-only for latency at small batch, W8A8 for throughput, and combinations such as W4A8 that try to
    #  get both": on an H100 W4AFP8 is W4A16 at batch 1 and FP8 at batch 512
    for m, like in ((1, "W4A16"), (512, "FP8_DYNAMIC")):
        assert step_bound(uniform("W4AFP8"), SHAPES, "h100", m).ms == pytest.approx(
            step_bound(uniform(like), SHAPES, "h100", m).ms)
    # a B200 has no kernel for it: the bound counts bf16 math and says the plan cannot be served there
    b200 = step_bound(uniform("W4AFP8"), SHAPES, "b200", 512)
    assert b200.unsupported == list(SHAPES)
    assert b200.ms == pytest.approx(step_bound(uniform("W4A16"), SHAPES, "b200", 512).ms)


def test_a_mixed_plan_sums_each_layers_own_bound() -> None:
    plan = {**uniform("FP8_DYNAMIC"), "layers.0": "BF16", "layers.1": "W4A16"}
    bound = step_bound(plan, SHAPES, "h100", 1)
    parts = {s: step_bound(uniform(s), SHAPES, "h100", 1).ms / 8 for s in ("BF16", "W4A16", "FP8_DYNAMIC")}
    assert bound.per_scheme == pytest.approx({"BF16": parts["BF16"], "W4A16": parts["W4A16"],
                                              "FP8_DYNAMIC": 6 * parts["FP8_DYNAMIC"]})
    assert bound.ms == pytest.approx(sum(bound.per_scheme.values()))


def test_math_runs_at_bf16_where_the_target_only_emulates_the_scheme() -> None:
    # an A100 has INT8 tensor cores but no FP8 ones: FP8 W8A8 is served as FP8 weights with bf16 math
    a100 = TARGETS["a100"]
    fp8 = step_bound(uniform("FP8_DYNAMIC"), SHAPES, "a100", 2048)
    int8 = step_bound(uniform("INT8_W8A8"), SHAPES, "a100", 2048)
    assert fp8.not_native == list(SHAPES) and not int8.not_native
    assert fp8.ms == pytest.approx(2 * 2048 * 8e9 / (a100.peak_tflops["bf16"] * 1e12) * 1e3)
    assert int8.ms == pytest.approx(fp8.ms / 2)  # 624 INT8 TOPS vs 312 bf16 TFLOP/s
    # FP4 math doubles FP8's rate only where FP4 tensor cores exist
    b200 = step_bound(uniform("NVFP4"), SHAPES, "b200", 2048)
    assert not b200.not_native and b200.ms == pytest.approx(2 * 2048 * 8e9 / 9000e12 * 1e3)
    hopper = step_bound(uniform("NVFP4"), SHAPES, "h100", 2048)
    assert hopper.not_native == list(SHAPES) and not hopper.unsupported  # served as W4A16 before Blackwell
    assert hopper.ms == pytest.approx(step_bound(uniform("NVFP4A16"), SHAPES, "h100", 2048).ms)
    mx = step_bound(uniform("MXFP4"), SHAPES, "h100", 2048)  # served as W4A16 too (CompressedTensorsW4A4Mxfp4)
    assert mx.not_native == list(SHAPES) and not mx.unsupported
    assert step_bound(uniform("W4AFP8"), SHAPES, "l40s", 2048).unsupported == list(SHAPES)  # Hopper's kernel only
    assert not fp8.unsupported  # FP8 on an A100: served as FP8 weights with bf16 math, emulated not unsupported


def test_every_target_has_a_bandwidth_and_bad_input_is_refused() -> None:
    assert all(t.memory_tbs > 0 for t in TARGETS.values())
    with pytest.raises(ValueError, match="unknown GPU target"):
        step_bound(uniform("BF16"), SHAPES, "tpu-v9", 1)
    with pytest.raises(ValueError, match="no \\(N, K\\) shape"):
        step_bound({"nope": "BF16"}, SHAPES, "h100", 1)
    with pytest.raises(ValueError, match="positive"):
        step_bound(uniform("BF16"), SHAPES, "h100", 0)


def test_import_is_torch_free() -> None:
    code = "import sys, quantcore.kernels.roofline; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_kv_cache_read_of_a_decode_step() -> None:
    from quantcore.kernels.roofline import kv_read_ms

    # Llama 3 8B caches 128 KiB a token in BF16: batch 1 at 8k context reads 1 GiB, 0.32 ms on an H100 SXM
    assert kv_read_ms(128 * 1024, 8192, "h100") == pytest.approx(2**30 / 3.35e12 * 1e3)
    # at batch 32 the cache read (10.3 ms) outweighs the 4.78 ms weight read: FP8 KV halves that part
    assert kv_read_ms(128 * 1024, 32 * 8192, "h100") > 2 * 4.78
    assert kv_read_ms(64 * 1024, 32 * 8192, "h100") * 2 == pytest.approx(kv_read_ms(128 * 1024, 32 * 8192, "h100"))
    assert kv_read_ms(128 * 1024, 8192, "b200") < kv_read_ms(128 * 1024, 8192, "a100")
    with pytest.raises(ValueError):
        kv_read_ms(1024, -1, "h100")
