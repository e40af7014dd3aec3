"""Tests of quantcore.kernels.hardware (target table, support rules) and quantcore.kernels.device (device probe)."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quantcore.errors import UnsupportedOnDevice
from quantcore.kernels import device as dev
from quantcore.kernels import hardware as hw

HAS_CUDA = torch.cuda.is_available()
RANK = {"unsupported": 0, "emulated": 1, "native": 2}
FORMATS_OR_NONE = (None, *hw.KNOWN_FORMATS)


# --------------------------------------------------------------------------- table


def test_target_keys_are_the_contracted_ones() -> None:
    assert list(hw.TARGETS) == ["a100", "l40s", "h100", "h100-pcie", "h200", "b200"]
    assert [t.key for t in hw.list_targets()] == list(hw.TARGETS)
    for key, target in hw.TARGETS.items():
        assert target.key == key
        assert target.memory_gb > 0


@pytest.mark.parametrize("key", list(hw.TARGETS))
def test_target_flags_follow_compute_capability(key: str) -> None:
    t = hw.get_target(key)
    assert t.fp8 == (t.sm >= hw.SM_FP8_MMA) == ("fp8" in t.peak_tflops)
    assert t.fp4 == (t.sm >= hw.SM_BLOCK_SCALED) == ("fp4" in t.peak_tflops)
    assert t.int8 and "int8" in t.peak_tflops
    assert "bf16" in t.peak_tflops and "fp32" in t.peak_tflops


@pytest.mark.parametrize("key", list(hw.TARGETS))
def test_peaks_keep_the_datasheet_ratios(key: str) -> None:
    # On every one of these parts the dense tensor-core rates double with each halving
    # of the operand width: INT8 = 2 x BF16 (A100 624 vs 312), FP8 = 2 x BF16 (H100 1979
    # vs 989), FP4 = 2 x FP8 (B200 9000 vs 4500). A typo in the table breaks the ratio.
    # 2% slack: the L40S datasheet itself prints BF16 362.05 next to FP8 / INT8 733.
    p = hw.get_target(key).peak_tflops
    assert p["int8"] == pytest.approx(2 * p["bf16"], rel=0.02)
    if "fp8" in p:
        assert p["fp8"] == pytest.approx(2 * p["bf16"], rel=0.02)
    if "fp4" in p:
        assert p["fp4"] == pytest.approx(2 * p["fp8"], rel=0.02)


def test_dense_not_sparse_figures() -> None:
    # Golden values: dense BF16 from the datasheets (sparse headline / 2).
    assert hw.get_target("h100").peak_tflops["bf16"] == pytest.approx(989.4, abs=1)
    assert hw.get_target("h200").peak_tflops["fp8"] == pytest.approx(1979, abs=1)
    assert hw.get_target("a100").peak_tflops["bf16"] == 312.0
    assert hw.get_target("b200").peak_tflops["fp4"] == 9000.0


def test_unknown_target_lists_the_keys() -> None:
    with pytest.raises(ValueError, match="h100-pcie") as info:
        hw.get_target("v100")
    assert "v100" in str(info.value)


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H100 NVL", None),
        ("NVIDIA H200", "h200"),
        ("NVIDIA H200 NVL", None),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA A100 80GB PCIe", "a100"),
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA B200", "b200"),
        ("NVIDIA GB200", None),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_match_target(name: str, key: str | None) -> None:
    assert hw.match_target(name) == key


# --------------------------------------------------------------------------- support rules


@pytest.mark.parametrize(
    ("target", "weight", "act", "verdict"),
    [
        ("a100", "fp8_e4m3", "fp8_e4m3", "emulated"),  # no FP8 tensor cores on Ampere
        ("l40s", "fp8_e4m3", "fp8_e4m3", "native"),
        ("h100", "fp8_e4m3", "fp8_e4m3", "native"),
        ("h100", "fp8_e5m2", "fp8_e5m2", "emulated"),  # cuBLASLt refuses E5M2 x E5M2
        ("h100", "fp8_e4m3", "fp8_e5m2", "native"),
        ("b200", "nvfp4", "nvfp4", "native"),
        ("h100", "nvfp4", "nvfp4", "emulated"),  # vLLM falls back to W4A16 (Marlin) without FP4 tensor cores
        ("h200", "mxfp4", "mxfp4", "emulated"),  # likewise: CompressedTensorsW4A4Mxfp4's Marlin W4A16 path
        ("a100", "int8", "int8", "native"),
        ("a100", "int4", None, "native"),
        ("a100", "fp8_e4m3", None, "native"),  # FP8 weight-only (Marlin-style W8A16)
        ("h100", "nvfp4", None, "native"),  # NVFP4A16: vLLM's FP4 Marlin dequantizes in-kernel, as INT4 Marlin does
        ("a100", "mxfp4", None, "native"),  # MXFP4A16 likewise (CompressedTensorsW4A16Mxfp4)
        ("h100", "fp4_e2m1", None, "emulated"),  # plain FP4 weights: no scale format a serving kernel reads
        ("b200", "nvfp4", None, "native"),
        ("a100", "mxfp8", "mxfp8", "emulated"),
        ("b200", "mxfp8", "mxfp8", "native"),
        ("h100", None, None, "native"),
        ("h100", None, "fp8_e4m3", "unsupported"),
        ("b200", "int4", "int4", "emulated"),
        ("h100", "int8", "fp8_e4m3", "emulated"),
        ("h100", "int4", "fp8_e4m3", "native"),  # W4AFP8: vLLM's CUTLASS W4A8 kernel, Hopper only
        ("h200", "int4", "fp8_e4m3", "native"),
        ("l40s", "int4", "fp8_e4m3", "unsupported"),
        ("b200", "int4", "fp8_e4m3", "unsupported"),
    ],
)
def test_support_rules(target: str, weight: str | None, act: str | None, verdict: str) -> None:
    assert hw.support_on_target(target, weight, act) == verdict
    reason = hw.support_reason(target, weight, act)
    assert reason.startswith(verdict)
    assert hw.get_target(target).name in reason


def test_fp4_w4a4_is_unsupported_only_below_the_weight_only_kernels() -> None:
    """Before Blackwell vLLM serves NVFP4 and MXFP4 checkpoints as FP4 weights with 16-bit activations (Marlin,
    sm80+); below that nothing takes them. The weight-only schemes (NVFP4A16, MXFP4A16) are that Marlin kernel
    everywhere from sm80: native, as INT4 weights in Marlin are."""
    for fmt in ("nvfp4", "mxfp4"):
        assert hw.support_on_sm(90, fmt, fmt) == hw.support_on_sm(80, fmt, fmt) == "emulated"
        assert hw.support_on_sm(75, fmt, fmt) == "unsupported" and hw.support_on_sm(100, fmt, fmt) == "native"
        for sm in (80, 89, 90, 100):
            assert hw.support_on_sm(sm, fmt, None) == hw.support_on_sm(sm, "int4", None) == "native"
        assert hw.support_on_sm(75, fmt, None) == "unsupported"
        assert "FP4 Marlin" in hw.support_reason("h100", fmt, None)


def test_no_quant_spellings() -> None:
    for spelling in (None, "", "none", "bf16", "BF16"):
        assert hw.support_on_target("a100", spelling, spelling) == "native"


def test_unknown_format_lists_the_formats() -> None:
    with pytest.raises(ValueError, match="nvfp4"):
        hw.support_on_target("h100", "fp6", None)
    with pytest.raises(ValueError, match="h200"):
        hw.support_on_target("x1", "int8", None)


@pytest.mark.parametrize(("weight", "act"), list(itertools.product(FORMATS_OR_NONE, FORMATS_OR_NONE)))
def test_newer_gpus_never_support_less(weight: str | None, act: str | None) -> None:
    """Property over every format pair: moving to a newer architecture never demotes a verdict, except W4AFP8,
    whose one vLLM kernel is built for Hopper alone (test_w4afp8_is_hopper_only)."""
    by_sm = sorted(hw.list_targets(), key=lambda t: t.sm)
    if (weight, act) == ("int4", "fp8_e4m3"):
        by_sm = [t for t in by_sm if t.sm <= hw.SM_W4A8_FP8]
    ranks = [RANK[hw.support_on_target(t.key, weight, act)] for t in by_sm]
    assert ranks == sorted(ranks), list(zip([t.key for t in by_sm], ranks, strict=True))


def test_w4afp8_is_hopper_only() -> None:
    verdicts = {t.sm: hw.support_on_target(t.key, "int4", "fp8_e4m3") for t in hw.list_targets()}
    assert {sm: v for sm, v in verdicts.items() if v == "native"} == {90: "native"}
    assert "Hopper" in hw.support_reason("b200", "int4", "fp8_e4m3")
    assert hw.support_on_sm(None, "int4", "fp8_e4m3") == "emulated"  # a CPU emulates every scheme


def test_cpu_runs_nothing_low_precision_natively() -> None:
    assert hw.support_on_sm(None, None, None) == "native"
    for fmt in hw.KNOWN_FORMATS:
        assert hw.support_on_sm(None, fmt, fmt) == "emulated"


def test_known_formats_match_the_formats_module() -> None:
    formats = pytest.importorskip("quantcore.formats.catalog")
    names = {f if isinstance(f, str) else f.name for f in formats.list_formats()}
    assert set(hw.KNOWN_FORMATS) <= names


def test_import_is_torch_free() -> None:
    code = ("import sys, quantcore.kernels.hardware, quantcore.kernels.device; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------- probe


def test_device_class() -> None:
    assert dev.device_class("cpu") == "cpu"
    assert dev.device_class("cuda", (9, 0)) == "gpu.sm90"
    assert dev.device_class("cuda", (10, 0)) == "gpu.sm100"
    assert dev.device_class("cuda") == "gpu"
    with pytest.raises(ValueError):
        dev.device_class("tpu")


def test_probe_cpu() -> None:
    info = dev.probe_device("cpu")
    assert info.kind == "cpu"
    assert info.device_class == "cpu"
    assert info.compute_capability is None and info.sm is None
    assert info.peak_tflops is None and info.target_key is None
    assert info.torch_version == torch.__version__
    assert info.name
    d = info.to_dict()
    assert d["kind"] == "cpu" and d["compute_capability"] is None


@pytest.mark.parametrize("flags, isa", [
    ({"sse2", "avx2", "fma"}, None),  # an AVX2-only x86 (the EPYC of SEEN-HERE: _int_mm 34 s for one shape)
    ({"avx2", "avx512f", "avx512_vnni", "avx512_bf16"}, "avx512_vnni"),  # Zen 4, Cascade Lake and later
    ({"avx512_vnni", "amx_tile", "amx_int8"}, "amx_int8"),  # Sapphire Rapids: the best one is named
    ({"fp", "asimd", "asimddp"}, "asimddp"),  # Arm with the dot-product extension
])
def test_device_paths_on_cpu_say_what_runs_and_what_is_accelerated(flags, isa) -> None:
    assert dev.int8_dot_isa(flags) == isa
    paths = dev.device_paths(dev.probe_device("cpu"), flags=flags)
    assert set(paths) == set(dev.DEVICE_PATHS)
    assert paths["baseline"].runs and paths["baseline"].native
    for p in ("fp8_tensor", "fp8_row", "int8_row"):
        assert paths[p].runs, paths[p].note  # torch 2.13 CPU: _scaled_mm (E4M3) and _int_mm both execute
    for p in ("fp8_tensor", "fp8_row"):  # no CPU has FP8 matrix units
        assert not paths[p].native and "not accelerated" in paths[p].note
    int8 = paths["int8_row"]
    if isa is None:
        assert not int8.native and "not accelerated" in int8.note and "no INT8 dot-product" in int8.note
    else:
        assert int8.native and isa in int8.note
    assert not paths["fp4"].runs and not paths["fp4"].native
    # weight-only kernels run in fp32 on any CPU torch builds for
    for p in ("w8_row", "w4_g128", "w4_g64", "w4_g32", "w4_ch"):
        assert paths[p].runs and paths[p].native and "dequantizes them inside the kernel" in paths[p].note


def test_this_cpus_flags_are_read() -> None:
    flags = dev.cpu_flags()
    if not Path("/proc/cpuinfo").exists():
        pytest.skip("no /proc/cpuinfo")
    assert flags, "/proc/cpuinfo has a flags / Features line on Linux"
    assert dev.device_paths(dev.probe_device("cpu"))["int8_row"].native == (dev.int8_dot_isa(flags) is not None)


@pytest.mark.skipif(HAS_CUDA, reason="checks the error raised where there is no CUDA")
def test_probe_cuda_without_cuda_says_so() -> None:
    with pytest.raises(UnsupportedOnDevice, match="no CUDA"):
        dev.probe_device("cuda")


def test_probe_rejects_other_devices() -> None:
    with pytest.raises(UnsupportedOnDevice):
        dev.probe_device("meta")


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_probe_cuda() -> None:
    info = dev.probe_device("cuda")
    assert info.kind == "cuda" and info.compute_capability is not None
    assert info.device_class == f"gpu.sm{info.compute_capability[0]}{info.compute_capability[1]}"
    assert info.memory_bytes and info.memory_bytes > 0
    assert info.cuda_version
    key = hw.match_target(info.name)
    assert info.target_key == key
    assert (info.peak_tflops is None) == (key is None)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_device_paths_cuda_follow_the_capability() -> None:
    info = dev.probe_device("cuda")
    paths = dev.device_paths(info)
    sm = info.sm or 0
    assert paths["baseline"].runs and paths["baseline"].native
    assert paths["int8_row"].native == paths["int8_row"].runs == (sm >= hw.SM_INT8_MMA)
    if sm >= 90:  # Hopper: FP8 per-tensor and row-wise both run natively in torch 2.x
        assert paths["fp8_tensor"].runs and paths["fp8_tensor"].native
        assert paths["fp8_row"].runs and paths["fp8_row"].native
    if sm < hw.SM_FP8_MMA:
        assert not paths["fp8_tensor"].runs and not paths["fp8_tensor"].native
    assert paths["fp4"].native == (sm >= hw.SM_BLOCK_SCALED)
    for p in ("w4_g128", "w4_g64", "w4_g32", "w4_ch"):
        assert paths[p].runs == paths[p].native == (sm >= hw.SM_INT4_TINYGEMM)
    assert paths["w8_row"].native == paths["w8_row"].runs  # native wherever this torch build runs it


def test_a_torch_error_is_told_by_the_sentence_a_person_can_act_on() -> None:
    # torch 2.11's CPU _scaled_mm with row-wise scales, as it raised on the GPU image's torch
    internal = RuntimeError('(scale_a.numel() == 1 && scale_b.numel() == 1) INTERNAL ASSERT FAILED at '
                            '"/pytorch/aten/src/ATen/native/Blas.cpp":249, please report a bug to PyTorch. '
                            'Now _scaled_mm only supports per-tensor scaling for CPU backend.')
    assert dev.torch_error_text(internal) == "Now _scaled_mm only supports per-tensor scaling for CPU backend."
    two_lines = RuntimeError("self.size(0) needs to be greater than 16, but got 1\nException raised from ...")
    assert dev.torch_error_text(two_lines) == "self.size(0) needs to be greater than 16, but got 1"
    assert dev.torch_error_text(NotImplementedError()) == "NotImplementedError"
    bare = RuntimeError("x INTERNAL ASSERT FAILED at y, please report a bug to PyTorch. ")
    assert dev.torch_error_text(bare) == "x INTERNAL ASSERT FAILED at y, please report a bug to PyTorch."


@pytest.mark.parametrize("cc", [(7, 0), (7, 5), (8, 0), (8, 9), (9, 0), (10, 0)])
def test_device_paths_cuda_rules_say_what_the_device_lacks(monkeypatch, cc) -> None:
    # The capability rules, without a GPU: every tiny kernel "runs" (what this test is not about), so
    # runs / native and the notes come from the compute capability alone.
    monkeypatch.setattr(dev, "_try_tiny", lambda device, path: None)
    info = dev.DeviceInfo(kind="cuda", name="test GPU", device_class=dev.device_class("cuda", cc),
                         compute_capability=cc, memory_bytes=None, torch_version=torch.__version__,
                         cuda_version="12.8", peak_tflops=None, target_key=None, device="cuda:0")
    sm = cc[0] * 10 + cc[1]
    paths = dev.device_paths(info)
    for path, need in (("fp8_tensor", hw.SM_FP8_MMA), ("fp8_row", hw.SM_FP8_MMA), ("int8_row", hw.SM_INT8_MMA),
                       ("w4_g128", hw.SM_INT4_TINYGEMM), ("w4_ch", hw.SM_INT4_TINYGEMM)):
        s = paths[path]
        assert s.runs == s.native == (sm >= need), (path, sm)
        if sm < need:  # one plain sentence: what is needed, and what this device is
            assert s.note.endswith((f"need sm{need}+; this device is sm{sm}",
                                    f"needs sm{need}+; this device is sm{sm}")), s.note
            assert "not supported" not in s.note  # a benchmark record adds "not supported on cuda: " itself
    assert paths["fp4"].native == (sm >= hw.SM_BLOCK_SCALED) and not paths["fp4"].runs
    assert paths["baseline"].runs and paths["w8_row"].runs


def test_a_stored_probe_reads_as_one_line_and_a_capability_as_a_verdict() -> None:
    cpu = dev.probe_device("cpu").to_dict()
    line = dev.describe_probe(cpu)
    assert line.startswith(cpu["name"]) and f"torch {torch.__version__}" in line
    assert "compute capability" not in line and "peak" not in line  # a CPU has neither
    unknown_gpu = {"kind": "cuda", "name": "Some GPU", "device_class": "gpu.sm120", "compute_capability": [12, 0],
                   "memory_bytes": 32 * 2**30, "torch_version": "2.13.0", "cuda_version": "13.0", "peak_tflops": None,
                   "target_key": None}
    assert dev.describe_probe(unknown_gpu) == ("Some GPU · compute capability 12.0 (gpu.sm120) · 32.0 GiB memory · "
                                              "torch 2.13.0 · CUDA 13.0 · not in the peak table: measured figures only")
    verdicts = {(True, True): "native", (True, False): "runs, not accelerated", (False, False): "does not run",
                (False, True): "native, not run by quantplan"}  # FP4 on sm100: the unit is there, no path yet
    assert {rn: dev.support_status(*rn) for rn in verdicts} == verdicts
    for sup in dev.device_paths(dev.probe_device("cpu")).values():
        why = dev.support_why(sup.runs, sup.native, sup.note)
        assert why and not why.startswith(sup.status)  # the verdict is said once, beside the reason
    assert dev.support_why(True, True, "native on sm90") == "native on sm90"
    assert dev.support_why(False, False, "does not run on this CPU: no kernel") == "no kernel"
