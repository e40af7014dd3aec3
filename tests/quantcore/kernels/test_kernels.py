"""Tests of quantcore.kernels (paths, ops, timing, bench, estimate, report): real GEMM paths vs emulation, budget,
step estimates.

CPU tests use tiny shapes: torch._int_mm on this kind of CPU runs at well under
0.01 TOPS, so anything bigger than a few hundred rows costs seconds.
"""

from __future__ import annotations

import math

import pytest
import torch

from quantcore.errors import Cancelled, UnsupportedOnDevice
from quantcore.kernels import bench
from quantcore.kernels.bench import DEFAULT_WARMUP, MIN_REPEATS, run_benchmarks
from quantcore.kernels.estimate import step_estimate
from quantcore.kernels.ops import (
    E4M3_MAX,
    Case,
    ShapeOperands,
    build_case,
    int4_weight_mm,
    max_rel_err,
    pack_int4,
    quantize_fp8,
    quantize_int4_groups,
    quantize_int8_rows,
)
from quantcore.kernels.paths import (
    INT_MM_MIN_M_CUDA,
    PATHS,
    W4_GROUPS,
    W4_PER_CHANNEL,
    WEIGHT_ONLY_PATHS,
    base_path,
    bench_paths,
    bench_shapes,
    distinct_shapes,
    kernel_padding,
    quantizes_activation,
    scheme_path,
    scheme_to_path,
    timed_path,
)
from quantcore.kernels.records import SKIP_OVER_BUDGET, KernelRecord, duration_bound, fill_speedups
from quantcore.kernels.report import format_markdown, format_records
from quantcore.kernels.timing import (
    CPU_FLUSH_ENV,
    CPU_FLUSH_MAX_BYTES,
    CPU_FLUSH_MIN_BYTES,
    L2_FLUSH_BYTES,
    Timer,
    cpu_cache_bytes,
    flush_bytes,
)
from tests.factories import kernel_record

HAS_CUDA = torch.cuda.is_available()
E4M3 = torch.float8_e4m3fn


# --------------------------------------------------------------------------- shapes, paths


def test_distinct_shapes_groups_layers_by_n_k() -> None:
    linears = [
        ("l0.q_proj", 576, 576),
        ("l0.k_proj", 576, 192),
        ("l0.v_proj", 576, 192),
        ("l0.o_proj", 576, 576),
        ("l0.up_proj", 576, 1536),
        ("l0.down_proj", 1536, 576),
    ]
    got = distinct_shapes(linears)
    assert got == {
        (576, 576): ["l0.q_proj", "l0.o_proj"],
        (192, 576): ["l0.k_proj", "l0.v_proj"],
        (1536, 576): ["l0.up_proj"],
        (576, 1536): ["l0.down_proj"],
    }
    assert list(got) == [(576, 576), (192, 576), (1536, 576), (576, 1536)]  # first-seen order
    with pytest.raises(ValueError, match="bad"):
        distinct_shapes([("bad", 0, 4)])


def test_bench_shapes_are_the_distinct_shapes_one_gpu_runs() -> None:
    from quantcore.models.parallel import Parallelism

    shapes = {"l0.self_attn.q_proj": (576, 576), "l0.self_attn.o_proj": (576, 576), "l0.mlp.up_proj": (1536, 576),
              "l0.mlp.down_proj": (576, 1536), "l1.self_attn.q_proj": (576, 576)}
    assert bench_shapes(shapes, Parallelism(1)) == [(576, 576), (1536, 576), (576, 1536)]
    # over 2 GPUs: q_proj / up_proj split their outputs, o_proj / down_proj their inputs
    assert bench_shapes(shapes, Parallelism(2)) == [(288, 576), (576, 288), (768, 576), (576, 768)]


def test_path_names() -> None:
    assert PATHS[0] == "baseline"
    assert set(PATHS) == {
        "baseline",
        "fp8_tensor",
        "fp8_tensor+q",
        "fp8_row",
        "fp8_row+q",
        "int8_row",
        "int8_row+q",
        "w8_row",
        "w4_g128",
        "w4_g64",
        "w4_g32",
        "w4_ch",
    }
    assert base_path("fp8_row+q") == "fp8_row" and base_path("int8_row") == "int8_row"
    assert quantizes_activation("int8_row+q") and not quantizes_activation("fp8_tensor")
    # serving times a path with its activation quantization; weight-only paths have none to add
    assert timed_path("fp8_row") == "fp8_row+q" and timed_path("fp8_row", quant_act=False) == "fp8_row"
    assert [timed_path(p) for p in ("baseline", "w8_row", "w4_g128", "w4_g64", "w4_g32", "w4_ch", "int8_row+q")] == \
        ["baseline", "w8_row", "w4_g128", "w4_g64", "w4_g32", "w4_ch", "int8_row+q"]


def test_import_is_torch_free() -> None:
    """The app may read PATHS / scheme_to_path / step_estimate without pulling torch in."""
    import subprocess
    import sys

    code = ("import sys, quantcore.kernels.bench, quantcore.kernels.paths, quantcore.kernels.records, "
            "quantcore.kernels.ops, quantcore.kernels.timing, quantcore.kernels.report; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    ("path", "mkn", "device", "expected"),
    [
        ("int8_row", (1, 576, 192), "cuda", (17, 576, 192)),  # _int_mm: M > 16
        ("int8_row+q", (16, 576, 192), "cuda", (17, 576, 192)),
        ("int8_row", (32, 576, 192), "cuda", (32, 576, 192)),
        ("int8_row", (32, 60, 30), "cuda", (32, 64, 32)),  # K, N multiples of 8
        ("fp8_row", (1, 60, 30), "cuda", (1, 64, 32)),  # _scaled_mm: K, N multiples of 16
        ("fp8_tensor", (1, 576, 1536), "cuda", (1, 576, 1536)),
        ("baseline", (1, 60, 30), "cuda", (1, 60, 30)),
        ("int8_row", (1, 60, 30), "cpu", (1, 60, 30)),  # CPU kernels need no padding
        ("w8_row", (1, 60, 30), "cpu", (1, 60, 30)),
        ("w8_row", (1, 60, 30), "cuda", (1, 60, 30)),
        # INT4 weight-only: K a multiple of the group on a CPU, of 128 (tinygemm's tiles) on CUDA;
        # N of 16 on a CPU, 8 on CUDA
        ("w4_g128", (1, 576, 1536), "cpu", (1, 640, 1536)),
        ("w4_g128", (3, 63, 30), "cpu", (3, 128, 32)),
        ("w4_g128", (3, 4096, 30), "cuda", (3, 4096, 32)),
        ("w4_g64", (1, 576, 1536), "cpu", (1, 576, 1536)),  # SmolLM2's K: the reason W4A16_G64 exists
        ("w4_g64", (3, 63, 30), "cpu", (3, 64, 32)),
        ("w4_g64", (1, 576, 1536), "cuda", (1, 640, 1536)),
        ("w4_g64", (3, 4096, 30), "cuda", (3, 4096, 32)),
        ("w4_g32", (1, 7392, 8192), "cpu", (1, 7392, 8192)),  # one GPU's down_proj of Qwen2.5-72B at TP 4
        ("w4_g32", (1, 7392, 8192), "cuda", (1, 7424, 8192)),
        ("w4_ch", (1, 576, 1536), "cpu", (1, 640, 1536)),  # the kernel's groups of 128, one scale a row
        ("w4_ch", (1, 3696, 8192), "cuda", (1, 3712, 8192)),
    ],
)
def test_kernel_padding(
    path: str, mkn: tuple[int, int, int], device: str, expected: tuple[int, int, int]
) -> None:
    assert kernel_padding(path, *mkn, device) == expected


# --------------------------------------------------------------------------- quantizers


def test_quantize_fp8_matches_torch_cast_and_bounds() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 64, generator=g) * torch.logspace(-2, 2, 64)
    for rowwise in (False, True):
        codes, scale = quantize_fp8(x, rowwise=rowwise)
        assert codes.dtype == E4M3
        assert scale.shape == ((8, 1) if rowwise else ())
        # the largest |x| (per row or overall) maps exactly onto 448
        amax_codes = codes.float().abs().amax(dim=1) if rowwise else codes.float().abs().amax()
        assert torch.all(amax_codes == E4M3_MAX)
        # codes are torch's own E4M3 cast of x / scale
        assert torch.equal(codes.view(torch.uint8), (x / scale).to(E4M3).view(torch.uint8))
        # E4M3 keeps 3 mantissa bits: relative error <= 2^-4 in the normal range
        deq = codes.float() * scale
        normal = (x / scale).abs() >= 2.0**-6
        rel = ((deq - x).abs() / x.abs())[normal]
        assert float(rel.max()) <= 2.0**-4 + 1e-7


def test_quantize_int8_rows() -> None:
    x = torch.tensor([[1.0, -2.0, 0.5, 127.0], [0.0, 0.0, 0.0, 0.0], [-3.0, 1.5, 0.0, 0.75]])
    codes, scale = quantize_int8_rows(x)
    assert codes.dtype == torch.int8 and scale.shape == (3, 1)
    assert codes[0].tolist() == [1, -2, 0, 127]  # scale 1.0; 0.5 rounds half to even -> 0
    assert codes[1].tolist() == [0, 0, 0, 0]  # all-zero row: finite scale, zero codes
    assert codes[2].tolist() == [-127, 64, 0, 32]  # scale 3/127: 63.5 -> 64, 31.75 -> 32
    assert torch.isfinite(scale).all()


# --------------------------------------------------------------------------- CPU benchmark


@pytest.fixture(scope="module")
def tiny_records() -> list[KernelRecord]:
    return run_benchmarks([(64, 64)], ms=(1, 32), device="cpu", budget_s_per_shape=60, repeats=3)


def test_every_path_every_m_is_timed_on_cpu(tiny_records: list[KernelRecord]) -> None:
    got = {(r.m, r.path) for r in tiny_records}
    assert got == {(m, p) for m in (1, 32) for p in PATHS}
    assert len(tiny_records) == 2 * len(PATHS)
    for r in tiny_records:
        assert r.skipped is None, (r.path, r.skipped)
        assert r.device == "cpu" and r.torch_version == torch.__version__
        assert (r.n, r.k) == (64, 64)
        assert r.ms is not None and r.ms > 0
        assert r.tflops == pytest.approx(2 * r.m * r.n * r.k / (r.ms * 1e-3) / 1e12)
        assert r.pct_peak is None  # no peak table for a CPU: measured figures only
        # CPU: no padding, but for the INT4 weight-only kernel, whose K must be a multiple of its group
        # (w4_ch runs it in groups of 128)
        assert (r.padded_m, r.padded_k, r.padded_n) == ((None, 128, None) if r.path in ("w4_g128", "w4_ch")
                                                        else (None,) * 3)
        assert r.speedup is not None


def test_native_flags_on_cpu(tiny_records: list[KernelRecord]) -> None:
    """FP8 is never native on a CPU; INT8 is where the CPU has INT8 dot-product instructions (VNNI...)."""
    from quantcore.kernels.device import int8_dot_isa

    int8_native = int8_dot_isa() is not None
    for r in tiny_records:
        # a weight-only kernel's math is fp32: it is native wherever it runs (what it saves is weight traffic)
        expected = r.path in ("baseline", *WEIGHT_ONLY_PATHS) or (base_path(r.path) == "int8_row"
                                                                     and int8_native)
        assert r.native == expected, r.path


def test_speedup_is_baseline_over_path(tiny_records: list[KernelRecord]) -> None:
    """A path's speed-up is over the baseline timed interleaved with it (its record keeps that baseline's median and
    percentiles), not over the baseline's own case, timed earlier under another load."""
    for r in tiny_records:
        assert r.repeats == 3 and r.ms_p20 is not None and r.ms_p80 is not None
        assert r.ms_p20 <= r.ms <= r.ms_p80 and isinstance(r.unstable, bool)
        if r.path == "baseline":
            assert r.speedup == pytest.approx(1.0) and r.baseline_ms is None
        else:
            assert r.baseline_ms is not None and r.baseline_ms_p20 <= r.baseline_ms <= r.baseline_ms_p80
            assert r.speedup == pytest.approx(r.baseline_ms / r.ms)


def test_kernels_agree_with_emulation(tiny_records: list[KernelRecord]) -> None:
    for r in tiny_records:
        assert r.max_rel_err is not None and math.isfinite(r.max_rel_err)
        if base_path(r.path) == "int8_row":
            # integer products are exact; only the fp32 epilogue rounds
            assert r.max_rel_err < 1e-5, r
        elif r.path in WEIGHT_ONLY_PATHS:  # fp32 math on dequantized weights, against float64
            assert r.max_rel_err < 1e-5, r
        elif r.path.startswith("fp8"):
            assert r.max_rel_err < 1e-2, r
        else:
            assert r.max_rel_err < 1e-5, r  # fp32 baseline vs float64


def test_record_round_trip(tiny_records: list[KernelRecord]) -> None:
    r = tiny_records[3]
    d = r.to_dict()
    for key in (
        "device",
        "device_name",
        "torch_version",
        "m",
        "n",
        "k",
        "path",
        "ms",
        "tflops",
        "pct_peak",
        "speedup",
        "native",
        "max_rel_err",
        "padded_m",
        "skipped",
    ):
        assert key in d
    assert KernelRecord.from_dict({**d, "job_id": 7}) == r


def test_the_timer_flushes_the_caches_before_every_timed_call(tmp_path, monkeypatch) -> None:
    """A decode GEMM's weights come from memory when served: on a CPU too the timer writes a buffer twice its
    last-level caches (sysfs) before each timed call, so a weight small enough for the cache is not timed warm;
    QUANTPLAN_CPU_FLUSH_MIB sets the size instead (the tests set it: tests/conftest.py), and a bad value is refused."""
    monkeypatch.setenv(CPU_FLUSH_ENV, "12")
    assert flush_bytes("cpu") == 12 * 2**20 and flush_bytes("cuda") == L2_FLUSH_BYTES
    for bad in ("0", "1.5", "lots", str(CPU_FLUSH_MAX_BYTES // 2**20 + 1)):
        monkeypatch.setenv(CPU_FLUSH_ENV, bad)
        with pytest.raises(ValueError, match="QUANTPLAN_CPU_FLUSH_MIB=.*a whole number from 1 to 2048"):
            flush_bytes("cpu")
    monkeypatch.delenv(CPU_FLUSH_ENV)  # the rule itself
    # two sockets of two CPUs: each pair shares a 32 MiB L3; the L1 instruction cache is not counted
    for cpu in range(4):
        pair = "0-1" if cpu < 2 else "2-3"
        for index, (level, kind, size, shared) in enumerate(((1, "Data", "32K", str(cpu)),
                                                             (1, "Instruction", "64M", str(cpu)),
                                                             (2, "Unified", "1024K", str(cpu)),
                                                             (3, "Unified", "32768K", pair))):
            d = tmp_path / f"cpu{cpu}" / "cache" / f"index{index}"
            d.mkdir(parents=True)
            for name, value in (("level", level), ("type", kind), ("size", size), ("shared_cpu_list", shared)):
                (d / name).write_text(f"{value}\n")
    assert cpu_cache_bytes(str(tmp_path)) == 2 * 32 * 2**20
    (tmp_path / "cpu3" / "cache" / "index3" / "size").write_text("garbage\n")  # unreadable: passed over
    assert cpu_cache_bytes(str(tmp_path)) == 2 * 32 * 2**20
    assert cpu_cache_bytes(str(tmp_path / "none")) is None
    assert flush_bytes("cuda") == L2_FLUSH_BYTES
    assert CPU_FLUSH_MIN_BYTES <= flush_bytes("cpu") <= CPU_FLUSH_MAX_BYTES
    assert flush_bytes("cpu") >= min(CPU_FLUSH_MAX_BYTES, 2 * (cpu_cache_bytes() or 0))
    timer = Timer("cpu", "cpu")
    assert timer._flush.numel() * 4 == flush_bytes("cpu") and timer.flush_s > 0
    seen = []

    def call() -> None:
        seen.append(bool((timer._flush == 0).all()))  # written over just before this call
        timer._flush.fill_(1)

    timer.median_ms(call, 3)
    assert seen == [True, True, True]


def test_unaligned_shapes_run_on_cpu() -> None:
    recs = run_benchmarks([(40, 24)], ms=(3,), paths=["int8_row", "fp8_row+q"], repeats=3)
    assert [r.path for r in recs] == ["baseline", "fp8_row+q", "int8_row"]  # baseline always added
    for r in recs:
        assert r.skipped is None and r.max_rel_err is not None and r.max_rel_err < 1e-2


def test_emulation_separates_quantization_error_from_kernel_error() -> None:
    """Kernel == emulation to fp32 rounding, while both differ from the unquantized product."""
    ops = ShapeOperands(64, 64, "cpu", torch.float32, torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 64, generator=g)
    rows = torch.arange(8)
    exact = x.double() @ ops.w.double().t()
    for path in ("fp8_tensor", "fp8_row+q", "int8_row"):
        case = build_case(ops, path, x, "cpu")
        out, emu = case.fn(), case.emulate(rows)
        assert max_rel_err(out, emu) < 1e-5, path  # the kernel computes what the codes say
        assert max_rel_err(emu, exact) > 1e-3, path  # the codes carry quantization error

    # the check can fail: a kernel output for other operands is flagged
    other = build_case(ops, "int8_row", torch.randn(8, 64, generator=g), "cpu")
    assert max_rel_err(other.fn(), build_case(ops, "int8_row", x, "cpu").emulate(rows)) > 0.3


@pytest.mark.parametrize(
    ("path", "m", "padded"),
    [("int8_row+q", 1, (17, 64, 32)), ("int8_row", 5, (17, 64, 32)), ("fp8_row+q", 1, (1, 64, 32))],
)
def test_cuda_padding_keeps_the_result(path: str, m: int, padded: tuple[int, int, int]) -> None:
    """The CUDA padding rules, exercised with CPU kernels (which accept any shape)."""
    ops = ShapeOperands(30, 60, "cpu", torch.float32, torch.Generator().manual_seed(2))
    x = torch.randn(m, 60, generator=torch.Generator().manual_seed(3))
    case = build_case(ops, path, x, "cuda")
    assert case.padded == padded
    out = case.fn()
    assert out.shape == (m, 30)
    rows = torch.arange(m)
    assert max_rel_err(out, case.emulate(rows)) < 1e-5
    # and the padded case computes the same as the unpadded one
    ref = build_case(ops, path, x, "cpu").fn()
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6)


def test_max_rel_err_definition() -> None:
    emu = torch.tensor([[2.0, -4.0]], dtype=torch.float64)
    assert max_rel_err(torch.tensor([[2.0, -3.0]]), emu) == pytest.approx(0.25)
    assert max_rel_err(torch.zeros(1, 2), torch.zeros(1, 2, dtype=torch.float64)) == 0.0


class FakeClock:
    """The clock the benchmark's scheduler and timer read (``time.perf_counter`` of quantcore.kernels.bench and
    .timing), advanced only by the modelled cost of each kernel call: what a scheduling test asserts then depends on
    the budget and the costs it states, never on how fast or how busy the machine is. The kernels still run."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def fake_clock(monkeypatch):
    """A :class:`FakeClock` in place of the benchmark's clock; ``fake_clock.cost(fn)`` makes every case's calls
    (rate probes, warm-ups, timed repeats) cost ``fn(path, rows)`` seconds of it."""
    import types

    from quantcore.kernels import timing

    clock = FakeClock()
    fake_time = types.SimpleNamespace(perf_counter=clock.perf_counter)
    monkeypatch.setattr(bench, "time", fake_time)
    monkeypatch.setattr(timing, "time", fake_time)
    build = bench.build_case

    def cost(seconds) -> None:
        def build_costed(ops, path, x, kind):
            case = build(ops, path, x, kind)
            real, spent = case.fn, seconds(path, x.shape[0])

            def fn():
                out = real()
                clock.now += spent
                return out

            return Case(fn=fn, emulate=case.emulate, padded=case.padded)

        monkeypatch.setattr(bench, "build_case", build_costed)

    clock.cost = cost
    return clock


def test_budget_skips_what_does_not_fit(fake_clock) -> None:
    """M = 1 fits easily; at M = 2^17 a call costs a tenth of a second (the baseline) to seconds (an emulated FP8
    path), five calls a case, so the twelve paths cannot all fit in 2 s. The costs are the fake clock's, so the
    machine's speed and load decide nothing (they once did: a budget measured on the machine was too tight
    somewhere)."""
    from quantcore.kernels.device import device_paths, probe_device

    support = device_paths(probe_device("cpu"))
    per_row = {path: 1e-6 if path == "baseline" else 3e-6 if support[base_path(path)].native else 3e-5
               for path in PATHS}
    fake_clock.cost(lambda path, rows: 1e-4 + rows * per_row[path])
    budget = 2.0
    recs = run_benchmarks([(64, 64)], ms=(1, 1 << 17), budget_s_per_shape=budget, repeats=3)
    small = [r for r in recs if r.m == 1]
    big = [r for r in recs if r.m == 1 << 17]
    assert len(small) == len(big) == len(PATHS)
    # the baselines and native paths of M = 1 run before every M = 2^17 case but the baseline; the emulated
    # ones (FP8 on a CPU) run after every native case, so a native M = 2^17 that fits may leave them over budget
    first = [r for r in small if r.path == "baseline" or r.native]
    assert first and all(r.skipped is None and r.ms is not None for r in first), [r.skipped for r in first]
    assert all(r.ms == pytest.approx((1e-4 + per_row[r.path]) * 1e3) for r in first)  # the modelled cost, timed
    skipped = [r for r in recs if r.skipped is not None]
    assert any(r.m == 1 << 17 for r in skipped)
    for r in skipped:
        assert r.skipped.startswith("over budget"), r.skipped
        assert r.ms is None and r.tflops is None and r.speedup is None and r.max_rel_err is None
    for r in big:  # what was timed fitted: its repeats alone inside the budget
        assert r.ms is None or r.ms * 1e-3 * MIN_REPEATS < budget, r
    assert fake_clock.now < 2 * budget  # the benchmark stopped at its budget (a case may overrun what is left)


def test_a_large_m_is_predicted_from_a_rate_measured_near_it_not_scaled_from_m_1(fake_clock) -> None:
    """M = 1's time is mostly the fixed cost of a call: scaled by FLOPs to M = 2^17 it predicts seconds a call for
    a GEMM that takes milliseconds, and a budget that fits the real case would skip it. Calls at growing M learn
    the rate first, so the case is measured. A call costs 1 ms plus 0.1 us a row of the fake clock: a real CPU's
    shape, without its load."""
    fake_clock.cost(lambda path, rows: 1e-3 + rows * 1e-7)
    budget = 2.0
    recs = run_benchmarks([(64, 64)], ms=(1, 1 << 17), paths=["baseline"], budget_s_per_shape=budget,
                             repeats=3)
    one, big = recs
    scaled_s = one.ms * 1e-3 * (1 << 17) * (DEFAULT_WARMUP["cpu"] + MIN_REPEATS + 1)
    assert scaled_s > budget  # the old prediction would skip it (one M = 1 call: tens of microseconds)
    assert big.skipped is None and big.ms is not None, big.skipped
    assert big.ms * 1e-3 * 4 < budget  # and it really fits


def test_baselines_then_native_paths_then_emulated_ones_within_a_shape() -> None:
    """A slow emulated path (FP8 on a CPU) runs last in its shape's budget, so it can never starve the
    baselines and native paths a step estimate needs; records still come back in (M, path) order."""
    from quantcore.kernels.device import device_paths, probe_device

    support = device_paths(probe_device("cpu"))
    ran: list[tuple[int, str]] = []

    def seen(_f: float, msg: str) -> None:
        if msg.startswith("N="):
            m, path = msg.split(" ")[2:4]
            ran.append((int(m[2:]), path))

    recs = run_benchmarks([(32, 32)], ms=(4, 2), repeats=3, progress=seen)
    phase = [0 if p == "baseline" else 1 if support[base_path(p)].native else 2 for _, p in ran]
    assert phase == sorted(phase) and ran[:2] == [(2, "baseline"), (4, "baseline")]
    assert 2 in phase  # FP8 is never native on a CPU: it runs, last
    for ph in set(phase):  # each phase runs M ascending
        ms = [m for (m, _), p in zip(ran, phase, strict=True) if p == ph]
        assert ms == sorted(ms)
    assert [(r.m, r.path) for r in recs] == [(m, p) for m in (2, 4) for p in PATHS]


def test_progress_and_cancel() -> None:
    seen: list[float] = []
    run_benchmarks(
        [(32, 32)], ms=(2,), paths=["fp8_tensor"], repeats=3, progress=lambda f, msg: seen.append(f)
    )
    assert seen[-1] == 1.0 and seen == sorted(seen) and all(0.0 <= f <= 1.0 for f in seen)

    calls = {"n": 0}

    def cancel_after_two() -> bool:
        calls["n"] += 1
        return calls["n"] > 2

    with pytest.raises(Cancelled):
        run_benchmarks([(32, 32)], ms=(2, 4), repeats=3, should_cancel=cancel_after_two)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="fp8_row"):
        run_benchmarks([(32, 32)], ms=(2,), paths=["fp16"])
    with pytest.raises(ValueError):
        run_benchmarks([(32, 32)], ms=(0,))
    with pytest.raises(ValueError):
        run_benchmarks([(32, 32)], ms=(2,), device="meta")


@pytest.mark.skipif(HAS_CUDA, reason="checks the error raised where there is no CUDA")
def test_cuda_without_cuda() -> None:
    with pytest.raises(UnsupportedOnDevice):
        run_benchmarks([(32, 32)], ms=(2,), device="cuda")


# --------------------------------------------------------------------------- schemes and plans


@pytest.mark.parametrize(
    ("w", "a", "g", "path"),
    [
        ("fp8_e4m3", "fp8_e4m3", "per_tensor", "fp8_tensor"),
        ("fp8_e4m3", "fp8_e4m3", "per-token", "fp8_row"),
        ("fp8_e4m3", "fp8_e5m2", "token", "fp8_row"),
        ("fp8_e5m2", "fp8_e5m2", "per_token", None),
        ("fp8_e4m3", "fp8_e4m3", "per_group", None),
        ("int8", "int8", "per_token", "int8_row"),
        ("int8", "int8", "per_tensor", "int8_row"),
        ("int8", None, None, None),  # weight-only without its weight granularity: unknown
        ("int4", None, None, None),
        ("nvfp4", "nvfp4", "per_group", None),
        (None, None, None, None),
    ],
)
def test_scheme_to_path(w: str | None, a: str | None, g: str | None, path: str | None) -> None:
    assert scheme_to_path(w, a, g) == path


@pytest.mark.parametrize(
    ("scheme", "path"),
    [("BF16", None), ("FP8_DYNAMIC", "fp8_row"), ("FP8", "fp8_tensor"), ("INT8_W8A8", "int8_row"),
     ("INT8_PER_TENSOR", "int8_row"), ("W8A16", "w8_row"), ("W4A16", "w4_g128"), ("W4A16_G64", "w4_g64"),
     ("W4A16_G64_GPTQ", "w4_g64"), ("W4A16_AWQ", "w4_g128"), ("W4A16_ASYM", "w4_g128"),
     ("W4A16_G64_ASYM_AWQ", "w4_g64"), ("W4A16_G32", "w4_g32"), ("W4A16_G32_ASYM_GPTQ", "w4_g32"),
     ("W4A16_CHANNEL", "w4_ch"), ("W4A16_CHANNEL_AWQ", "w4_ch"), ("NVFP4A16", None), ("MXFP4A16", None),
     ("MXFP4", None), ("FP8_BLOCK", None)],
)
def test_scheme_path_of_the_presets(scheme: str, path: str | None) -> None:
    from quantcore.schemes.presets import get_scheme

    assert scheme_path(get_scheme(scheme)) == path


@pytest.mark.parametrize("path", ["w4_g128", "w4_g64", "w4_g32", "w4_ch"])
def test_int4_weight_only_kernel_agrees_with_the_int4_emulation(path: str) -> None:
    """The packed INT4 kernel computes x @ (q * scale)^T for quantcore's own INT4 per-group codes: the same
    numbers as fake-quantizing the weight with W4A16's (W4A16_G64's, W4A16_G32's) spec (``quantcore.formats.quantize``).
    w4_ch runs the same kernel in groups that all carry their row's scale: W4A16_CHANNEL's per-channel product."""
    from quantcore.formats.quantize import fake_quantize

    group = W4_GROUPS[path]
    per_channel = path in W4_PER_CHANNEL
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 256, generator=g) / 16
    x = torch.randn(5, 256, generator=g)
    codes, scales = quantize_int4_groups(w, 256, group, per_channel=per_channel)
    assert codes.abs().max() <= 7 and scales.shape == (256 // group, 48)
    assert (scales == scales[:1]).all() == per_channel  # one scale down each column of groups: the row's
    sz = torch.stack([scales, torch.zeros_like(scales)], dim=-1).contiguous()
    out = int4_weight_mm(x, pack_int4(codes, "cpu"), sz, "cpu", group)
    w_q = (fake_quantize(w, "int4", "channel") if per_channel else
           fake_quantize(w, "int4", "group", group_size=group))
    torch.testing.assert_close(out, x @ w_q.t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")])])
@pytest.mark.parametrize("scheme", ["W4A16_ASYM", "W4A16_G64_ASYM"])
def test_int4_weight_only_kernel_serves_zero_points(scheme: str, device: str) -> None:
    """The INT4 kernel dequantizes (q - 8) * scale + zero per group: with zero = -zero_point * scale it computes
    compressed-tensors' (code - zero_point) * scale, so the _ASYM presets run on the same kernel (and timing them on
    its w4 path is honest); its output is quantcore's asymmetric emulation."""
    from quantcore.formats.weights import fake_quantize_weight, weight_scale, weight_zero_point
    from quantcore.schemes.presets import get_scheme

    spec = get_scheme(scheme).weights
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(48, 256, generator=gen) / 16 + 0.05  # off centre: the zero points are not -8 + 8 / 2
    x = torch.randn(5, 256, generator=gen)
    scale, zp = weight_scale(w, spec), weight_zero_point(w, spec)
    assert zp.unique().numel() > 1
    g = spec.group_size
    codes = torch.round(torch.clamp(w.reshape(48, -1, g) / scale.unsqueeze(-1) + zp.unsqueeze(-1), -8, 7))
    codes = codes.reshape(48, 256).to(torch.int8)
    sz = torch.stack([scale.t(), (-zp * scale).t()], dim=-1).contiguous()  # [K / group, N, 2]
    dtype = torch.float32 if device == "cpu" else torch.bfloat16  # tinygemm on CUDA reads bf16 scales and zeros
    out = int4_weight_mm(x.to(device, dtype), pack_int4(codes.to(device), device), sz.to(device, dtype),
                            device, g).float().cpu()
    want = x @ fake_quantize_weight(w, spec)[0].t()
    tol = 1e-5 if device == "cpu" else 3e-2  # bf16 activations, scales and output on CUDA
    torch.testing.assert_close(out, want, rtol=tol, atol=tol)
    assert not torch.allclose(out, x @ fake_quantize_weight(w, get_scheme(scheme.replace("_ASYM", "")).weights)[0].t(),
                              rtol=1e-3, atol=1e-3)


@pytest.fixture
def hand_records() -> list[KernelRecord]:
    return [
        kernel_record(128, 64, 32, "baseline", 4.0),
        kernel_record(128, 64, 32, "fp8_row+q", 2.0),
        kernel_record(128, 64, 32, "fp8_row", 1.5),
        kernel_record(1, 64, 32, "baseline", 1.0),
        kernel_record(1, 64, 32, "fp8_row+q", 0.8),
        kernel_record(128, 16, 32, "baseline", 3.0),
        kernel_record(128, 16, 32, "int8_row+q", 1.0),
        kernel_record(1, 16, 32, "baseline", 0.5),
        kernel_record(1, 16, 32, "int8_row+q", None),  # skipped
    ]


def test_step_estimate_sums(hand_records: list[KernelRecord]) -> None:
    shapes = {"a": (64, 32), "b": (64, 32), "c": (16, 32), "d": (16, 32)}
    paths = {"a": "fp8_row", "b": "fp8_row", "c": "int8_row"}  # d: not in the plan -> baseline
    est = step_estimate(hand_records, shapes, paths, m_prefill=128, m_decode=1)
    # prefill: a, b at fp8_row+q (2.0 each), c at int8_row+q (1.0), d at baseline (3.0)
    assert est["prefill_ms"] == pytest.approx(8.0)
    assert est["baseline_prefill_ms"] == pytest.approx(4.0 + 4.0 + 3.0 + 3.0)
    assert est["speedup_prefill"] == pytest.approx(14.0 / 8.0)
    # decode: a, b 0.8 each; c skipped -> missing; d baseline 0.5
    assert est["decode_ms"] == pytest.approx(0.8 + 0.8 + 0.5)
    assert est["missing_decode"] == ["c"] and est["missing_prefill"] == []
    assert est["baseline_decode_ms"] == pytest.approx(1.0 + 1.0 + 0.5 + 0.5)
    assert est["speedup_decode"] == pytest.approx((1.0 + 1.0 + 0.5) / (0.8 + 0.8 + 0.5))
    # the speed-up's baseline is of the layers measured both ways, not the whole baseline step
    assert est["common_baseline_decode_ms"] == pytest.approx(1.0 + 1.0 + 0.5)
    assert est["common_baseline_prefill_ms"] == pytest.approx(est["baseline_prefill_ms"])
    assert est["skipped_decode"] == {"c": "over budget: test"} and est["skipped_prefill"] == {}
    assert est["complete"] is False
    assert est["per_layer"]["a"] == {"path": "fp8_row+q", "prefill_ms": 2.0, "decode_ms": 0.8}
    assert est["per_layer"]["d"]["path"] == "baseline"


def test_step_estimate_without_act_quant_cost(hand_records: list[KernelRecord]) -> None:
    est = step_estimate(
        hand_records, {"a": (64, 32)}, {"a": "fp8_row"}, m_prefill=128, m_decode=1, quant_act=False
    )
    assert est["prefill_ms"] == pytest.approx(1.5)
    assert est["missing_decode"] == ["a"]  # no fp8_row record at M=1
    assert est["skipped_decode"] == {}  # not measured, rather than skipped
    assert est["decode_ms"] == 0.0 and est["speedup_decode"] is None


def test_step_estimate_refuses_mixed_devices_and_bad_paths(hand_records: list[KernelRecord]) -> None:
    with pytest.raises(ValueError, match="several devices"):
        step_estimate(
            [*hand_records, kernel_record(1, 64, 32, "baseline", 1.0, name="GPU Y")],
            {"a": (64, 32)},
            {},
            m_prefill=128,
            m_decode=1,
        )
    with pytest.raises(ValueError, match="unknown kernel path"):
        step_estimate(hand_records, {"a": (64, 32)}, {"a": "fp4"}, m_prefill=128, m_decode=1)


def test_step_estimate_on_real_records(tiny_records: list[KernelRecord]) -> None:
    est = step_estimate(
        tiny_records, {"x": (64, 64), "y": (64, 64)}, {"x": "int8_row"}, m_prefill=32, m_decode=1
    )
    # a case flagged unstable (this machine's load moved while it ran) is left out of the sums
    t = {(r.m, r.path): 0.0 if r.unstable else r.ms for r in tiny_records}
    assert est["complete"] is not any(r.unstable for r in tiny_records
                                      if r.m in (1, 32) and r.path in ("int8_row+q", "baseline"))
    assert est["prefill_ms"] == pytest.approx(t[(32, "int8_row+q")] + t[(32, "baseline")])
    assert est["decode_ms"] == pytest.approx(t[(1, "int8_row+q")] + t[(1, "baseline")])


def test_format_records(tiny_records: list[KernelRecord]) -> None:
    text = format_records(tiny_records)
    lines = text.splitlines()
    assert "TFLOP/s" in lines[0] and lines[0].split()[4:9] == ["ms", "p20", "p80", "reps", "base"]
    assert len(lines) == 2 + len(tiny_records)
    for line, r in zip(lines[2:], tiny_records, strict=True):
        assert line.split()[7] == "3" and ("UNSTABLE" in line) == bool(r.unstable)
    assert any("int8_row+q" in line for line in lines)


def test_format_markdown_cells(hand_records: list[KernelRecord]) -> None:
    recs = [KernelRecord(**{**r.to_dict()}) for r in hand_records]
    for r in recs:
        if r.path == "fp8_row+q" and r.m == 128:
            r.pct_peak, r.max_rel_err = 41.4, 2.5e-3
        if r.path == "baseline" and r.m == 128 and r.n == 64:
            r.pct_peak = 12.0
    fill_speedups(recs)
    text = format_markdown(recs)
    lines = text.splitlines()
    assert lines[0] == "GPU X · torch t"
    head = [c.strip() for c in lines[2].strip("|").split("|")]
    assert head == ["N × K", "M", "baseline ms", "fp8_row", "fp8_row+q", "int8_row+q"]
    rows = {tuple(c.strip() for c in line.strip("|").split("|"))[:2]: [c.strip() for c in line.strip("|").split("|")]
            for line in lines[4:] if line.startswith("| ")}
    assert set(rows) == {("64 × 32", "1"), ("64 × 32", "128"), ("16 × 32", "1"), ("16 × 32", "128")}
    big = rows[("64 × 32", "128")]
    assert big[2] == "4.0000 ms · 12%"
    assert big[3] == "2.67×"  # 4.0 / 1.5, no peak known for this record
    assert big[4] == "2.00× · 41%"
    assert big[5] == ""  # int8 not measured at this shape
    assert rows[("16 × 32", "1")][5] == "skip"
    assert lines[-1] == "max kernel-vs-emulation difference: fp8_row+q 2.5e-03"


def test_format_markdown_refuses_mixed_devices() -> None:
    with pytest.raises(ValueError, match="several devices"):
        format_markdown([kernel_record(1, 16, 16, "baseline", 1.0),
                         kernel_record(1, 16, 16, "baseline", 1.0, name="GPU Y")])
    assert format_markdown([]) == "(no records)"


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_benchmark_native_and_agrees_with_emulation() -> None:
    from quantcore.kernels.device import device_paths, probe_device
    from quantcore.kernels.hardware import SM_FP8_MMA, SM_INT4_TINYGEMM, SM_INT8_MMA

    info = probe_device("cuda")
    sm = info.sm or 0
    w8_runs = device_paths(info)["w8_row"].runs  # a CUDA _weight_int8pack_mm depends on the torch build
    recs = run_benchmarks([(576, 576), (192, 576)], ms=(1, 32, 256), device="cuda", budget_s_per_shape=60)
    assert len(recs) == 2 * 3 * len(PATHS)
    for r in recs:
        assert r.device == "cuda" and r.device_name == info.name
        base = base_path(r.path)
        expect_native = {
            "baseline": True,
            "fp8_tensor": sm >= SM_FP8_MMA,
            "fp8_row": sm >= SM_FP8_MMA,
            "int8_row": sm >= SM_INT8_MMA,
            "w8_row": w8_runs,
            "w4_g128": sm >= SM_INT4_TINYGEMM,
            "w4_g64": sm >= SM_INT4_TINYGEMM,
            "w4_g32": sm >= SM_INT4_TINYGEMM,
            "w4_ch": sm >= SM_INT4_TINYGEMM,
        }[base]
        if not expect_native:
            assert r.skipped is not None and r.skipped.startswith("not supported on cuda")
            assert r.ms is None and not r.native
            continue
        assert r.skipped is None, (r.path, r.m, r.skipped)
        assert r.native
        assert r.ms is not None and r.ms > 0 and r.speedup is not None
        # bf16 output rounding bounds the difference (2^-8 relative); 1e-2 leaves room
        assert r.max_rel_err is not None and r.max_rel_err < 1e-2, (r.path, r.m, r.max_rel_err)
        if info.peak_tflops:
            assert r.pct_peak is not None and 0 < r.pct_peak < 100
        if base == "int8_row" and r.m <= 16:
            assert r.padded_m == INT_MM_MIN_M_CUDA
        else:
            assert r.padded_m is None
        # K=576: INT4 groups of 128; groups of 64 and 32 fit, but tinygemm's tiles want a multiple of 128 too
        assert r.padded_k == (640 if base in W4_GROUPS else None)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_int4_weights_beat_bf16_at_decode() -> None:
    """A decode step (M=1) reads every weight once: 4-bit weights move a quarter of bf16's bytes."""
    from quantcore.kernels.device import probe_device
    from quantcore.kernels.hardware import SM_INT4_TINYGEMM

    if (probe_device("cuda").sm or 0) < SM_INT4_TINYGEMM:
        pytest.skip("the INT4 weight-only kernel needs sm80+")
    recs = run_benchmarks([(4096, 4096)], ms=(1,), device="cuda", paths=["w4_g128"])
    w4 = next(r for r in recs if r.path == "w4_g128")
    assert w4.speedup is not None and w4.speedup > 1.2, w4


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_fp8_is_faster_than_bf16_at_large_m_on_hopper() -> None:
    from quantcore.kernels.device import probe_device

    info = probe_device("cuda")
    if (info.sm or 0) < 90:
        pytest.skip("FP8 speed-up expected on sm90+ only")
    recs = run_benchmarks([(4096, 4096)], ms=(2048,), device="cuda", paths=["fp8_tensor"])
    fp8 = next(r for r in recs if r.path == "fp8_tensor")
    assert fp8.speedup is not None and fp8.speedup > 1.2, fp8


def test_step_estimate_counts_a_nan_time_as_missing(hand_records: list[KernelRecord]) -> None:
    # records that went through a DataFrame carry NaN, not None, for a skipped case
    recs = [KernelRecord(**{**r.to_dict(), "ms": math.nan if r.ms is None else r.ms}) for r in hand_records]
    est = step_estimate(recs, {"c": (16, 32)}, {"c": "int8_row"}, m_prefill=128, m_decode=1)
    assert est["decode_ms"] == 0.0 and est["missing_decode"] == ["c"]
    assert est["prefill_ms"] == pytest.approx(1.0) and math.isfinite(est["speedup_prefill"])


def test_m_values_are_parsed_sorted_once_each_and_bad_ones_named() -> None:
    from quantcore.kernels.records import parse_ms

    assert parse_ms("1,16,128,2048") == [1, 16, 128, 2048]
    assert parse_ms(" 128, 1,,16 ,1, ") == [1, 16, 128]  # spaces and empty items pass, each M once, sorted
    for bad, named in (("abc", "'abc'"), ("1,0", "'0'"), ("-4", "'-4'"), ("2.5", "'2.5'"), ("1;16", "'1;16'")):
        with pytest.raises(ValueError, match=f"{named} is not one"):
            parse_ms(bad)
    with pytest.raises(ValueError, match="no M value given"):
        parse_ms(" , ")


def test_duration_bound_names_shapes_budget_and_total_in_readable_units() -> None:
    assert duration_bound(5, 60) == "at most 5 shapes × 60.0 s ≈ 5 min"
    assert duration_bound(1, 20) == "at most 1 shape × 20.0 s ≈ 20.0 s"
    assert duration_bound(4, 30) == "at most 4 shapes × 30.0 s ≈ 2 min"
    assert duration_bound(300, 60) == "at most 300 shapes × 60.0 s ≈ 5.0 h"


def test_a_case_over_its_share_is_put_off_so_it_cannot_starve_the_cases_after_it(fake_clock) -> None:
    """Weight-only INT8 at a prefill M takes a quarter of a second a call on an H200, where FP8 takes 0.03 ms: run
    with all that was left of a shape's budget it left the largest M of every path unmeasured. Each case but a
    baseline first gets an even share of what is left; one that needs more is put off until the others have run,
    and gets what they leave. Here w8_row is made slow from M = 64 on (the scheduling, not the kernel, is under
    test); its rate probe at 16 rows stays fast, so its first real call is the surprise it is on a GPU."""
    from quantcore.kernels.device import device_paths, probe_device

    slow_s = 0.5  # a call at M = 64; twice that at 128 (seconds of the fake clock: the machine's load is no part)
    fake_clock.cost(lambda path, rows: slow_s * rows / 64 if path == "w8_row" and rows >= 64 else 1e-5 + rows * 1e-8)
    ran: list[tuple[int, str]] = []

    def seen(_f: float, msg: str) -> None:
        if msg.startswith("N="):
            m, path = msg.split(" ")[2:4]
            ran.append((int(m[2:]), path))

    ms, paths = (64, 128, 256), ["w8_row", "w4_g128"]
    budget = 1.0  # the fast cases fit, slow ones do not (a flush costs nothing on the fake clock)
    recs = run_benchmarks([(64, 64)], ms=ms, paths=paths, budget_s_per_shape=budget, repeats=3, progress=seen)
    support = device_paths(probe_device("cpu"))
    first_pass = [(m, "baseline") for m in ms] + sorted(
        ((m, p) for m in ms for p in paths), key=lambda c: (not support[c[1]].native, c[0], PATHS.index(c[1])))
    assert ran == first_pass + [(m, "w8_row") for m in ms]  # the slow ones again, after every other case
    got = {(r.m, r.path): r for r in recs}
    assert len(recs) == 9 and [(r.m, r.path) for r in recs] == [(m, p) for m in ms for p in bench_paths(paths)]
    for m in ms:  # what came after the slow case was measured, the baselines first of all
        assert got[(m, "baseline")].ms is not None and got[(m, "w4_g128")].ms is not None, got[(m, "w4_g128")]
        slow = got[(m, "w8_row")]  # the second pass timed it or said why not
        assert (slow.ms is not None and slow.ms >= slow_s * 1e3) or slow.skipped.startswith(SKIP_OVER_BUDGET)
