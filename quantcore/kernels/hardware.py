"""GPU targets, their low-precision capabilities and peaks, and the probe of the local device.

torch-free at import: the Streamlit app imports ``TARGETS``, ``support_on_target`` and
``support_reason`` for its target-GPU picker without pulling torch in. Only
``probe_device`` and ``device_paths`` import torch, inside the function.

Vocabulary used everywhere below:

- **native**: the GPU has a kernel path whose arithmetic (or, for weight-only schemes,
  whose in-kernel dequantization) runs at the low precision: the scheme can bring the
  speed-up it promises.
- **emulated**: the scheme can be served or simulated, but the low-precision part is
  upcast or simulated (e.g. FP8 W8A8 on an A100 runs as an FP8 weight-only kernel with
  bf16 activations, or as fake quantization): numerics can be studied, no compute
  speed-up is to be expected.
- **unsupported**: no serving path on that GPU (e.g. FP4 W4A4 before Blackwell).

Peak figures are *dense* (no 2:4 structured sparsity) tensor-core rates from the
vendor datasheets; NVIDIA's headline figures are the sparse ones, exactly twice these.
Integer rates (``int8``) are tera-operations per second, counted like FLOP/s.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field

# --------------------------------------------------------------------------- formats

#: Format names understood here; they are the names of ``quantcore/formats/catalog.py``.
KNOWN_FORMATS: tuple[str, ...] = (
    "fp8_e4m3",
    "fp8_e5m2",
    "int8",
    "int4",
    "fp4_e2m1",
    "mxfp8",
    "mxfp4",
    "nvfp4",
)
#: Spellings of "no quantization" (the layer stays in bf16).
_NO_QUANT = (None, "", "none", "bf16", "fp16", "float16", "bfloat16")

_FP8 = frozenset({"fp8_e4m3", "fp8_e5m2"})
_FP4 = frozenset({"fp4_e2m1", "mxfp4", "nvfp4"})

# Compute capabilities (major*10 + minor) that open a kernel path. Sources: CUDA
# programming guide, "Compute Capabilities" table, and the torch checks named below.
SM_INT8_MMA = 75  # Turing: INT8 tensor cores (IMMA); torch._int_mm's cuBLASLt path
SM_WEIGHT_ONLY = 80  # Ampere: Marlin-style mixed-input kernels (INT4/INT8/FP8 weights × bf16)
SM_FP8_MMA = 89  # Ada / Hopper: FP8 tensor cores; torch._scaled_mm refuses below sm89
SM_BLOCK_SCALED = 100  # Blackwell: FP4 tensor cores and MX / NVFP4 block-scaled MMA
SM_W4A8_FP8 = 90  # Hopper only: vLLM's CUTLASS W4A8 (INT4 weights x FP8 activations) checks is_device_capability(90)
SM_INT4_TINYGEMM = 80  # Ampere: torch._weight_int4pack_mm's tinygemm kernel (bf16 mma) needs sm80+


# --------------------------------------------------------------------------- targets


@dataclass(frozen=True)
class GpuTarget:
    """A GPU the team may serve on.

    key:         registry key, e.g. ``"h100"``
    name:        marketing name, e.g. ``"NVIDIA H100 SXM5 80GB"``
    sm:          compute capability as major*10 + minor (90 for sm_90)
    peak_tflops: dense peak per dtype key (``fp32``, ``tf32``, ``bf16``, ``fp16``, ``fp8``,
                 ``int8`` [TOPS], ``fp4``); a dtype the GPU has no tensor-core mode for is absent
    fp8, int8, fp4: whether W8A8 FP8, W8A8 INT8, W4A4 FP4 tensor-core math exists on it
    memory_gb:   device memory from the datasheet (GB, 10^9 bytes)
    memory_tbs:  memory bandwidth from the datasheet (TB/s, 10^12 bytes per second): what bounds a
                 decode step (quantcore.kernels.roofline)
    """

    key: str
    name: str
    sm: int
    peak_tflops: dict[str, float] = field(default_factory=dict)
    fp8: bool = False
    int8: bool = False
    fp4: bool = False
    memory_gb: float = 0.0
    memory_tbs: float = 0.0


TARGETS: dict[str, GpuTarget] = {
    # NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM; PCIe has the same rates):
    # FP32 19.5, TF32 156, BF16/FP16 312, INT8 624 TOPS dense (312/624/1248 with sparsity).
    # No FP8 tensor cores.
    "a100": GpuTarget(
        key="a100",
        name="NVIDIA A100 80GB",
        sm=80,
        peak_tflops={"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0, "int8": 624.0},
        fp8=False,
        int8=True,
        fp4=False,
        memory_gb=80.0,
        memory_tbs=2.039,  # A100 80GB SXM: 2,039 GB/s HBM2e (the 80GB PCIe card: 1,935 GB/s).
    ),
    # NVIDIA L40S datasheet: FP32 91.6, TF32 183, BF16/FP16 362.05, FP8 733, INT8 733 TOPS
    # dense (366 / 733 / 1,466 / 1,466 with sparsity). 48 GB GDDR6.
    "l40s": GpuTarget(
        key="l40s",
        name="NVIDIA L40S",
        sm=89,
        peak_tflops={
            "fp32": 91.6,
            "tf32": 183.0,
            "bf16": 362.05,
            "fp16": 362.05,
            "fp8": 733.0,
            "int8": 733.0,
        },
        fp8=True,
        int8=True,
        fp4=False,
        memory_gb=48.0,
        memory_tbs=0.864,  # L40S: 864 GB/s GDDR6.
    ),
    # NVIDIA H100 Tensor Core GPU datasheet, SXM column: FP32 67, TF32 989, BF16/FP16 1,979,
    # FP8 3,958, INT8 3,958 TOPS "with sparsity" -> dense 494.7 / 989.4 / 1,978.9 / 1,978.9.
    "h100": GpuTarget(
        key="h100",
        name="NVIDIA H100 SXM5 80GB",
        sm=90,
        peak_tflops={
            "fp32": 67.0,
            "tf32": 494.7,
            "bf16": 989.4,
            "fp16": 989.4,
            "fp8": 1978.9,
            "int8": 1978.9,
        },
        fp8=True,
        int8=True,
        fp4=False,
        memory_gb=80.0,
        memory_tbs=3.35,  # H100 SXM: 3.35 TB/s HBM3.
    ),
    # Same datasheet, PCIe column: FP32 51, TF32 756, BF16/FP16 1,513, FP8 3,026,
    # INT8 3,026 TOPS with sparsity -> dense 378 / 756.5 / 1,513 / 1,513.
    "h100-pcie": GpuTarget(
        key="h100-pcie",
        name="NVIDIA H100 PCIe 80GB",
        sm=90,
        peak_tflops={
            "fp32": 51.0,
            "tf32": 378.0,
            "bf16": 756.5,
            "fp16": 756.5,
            "fp8": 1513.0,
            "int8": 1513.0,
        },
        fp8=True,
        int8=True,
        fp4=False,
        memory_gb=80.0,
        memory_tbs=2.0,  # H100 PCIe: 2.0 TB/s HBM2e.
    ),
    # NVIDIA H200 Tensor Core GPU datasheet, SXM column: FP32 67, TF32 989, BF16/FP16 1,979,
    # FP8 3,958, INT8 3,958 TOPS with sparsity (same GH100 compute as H100 SXM) -> dense
    # 494.5 / 989.5 / 1,979 / 1,979. 141 GB HBM3e.
    "h200": GpuTarget(
        key="h200",
        name="NVIDIA H200 SXM 141GB",
        sm=90,
        peak_tflops={
            "fp32": 67.0,
            "tf32": 494.5,
            "bf16": 989.5,
            "fp16": 989.5,
            "fp8": 1979.0,
            "int8": 1979.0,
        },
        fp8=True,
        int8=True,
        fp4=False,
        memory_gb=141.0,
        memory_tbs=4.8,  # H200 SXM: 4.8 TB/s HBM3e.
    ),
    # NVIDIA HGX B200 datasheet, "individual Blackwell GPU" column (1,000 W): FP4 18 PF,
    # FP8/FP6 9 PF, INT8 9 POPS, BF16/FP16 4.5 PF, TF32 2.2 PF "with sparsity"; FP32 75 TF.
    # Dense = half of the sparse figures. 180 GB HBM3e.
    "b200": GpuTarget(
        key="b200",
        name="NVIDIA B200 (HGX, 1000 W)",
        sm=100,
        peak_tflops={
            "fp32": 75.0,
            "tf32": 1100.0,
            "bf16": 2250.0,
            "fp16": 2250.0,
            "fp8": 4500.0,
            "int8": 4500.0,
            "fp4": 9000.0,
        },
        fp8=True,
        int8=True,
        fp4=True,
        memory_gb=180.0,
        memory_tbs=8.0,  # HGX B200: 8 TB/s HBM3e per GPU (64 TB/s for eight).
    ),
}

# torch.cuda.get_device_name() spellings -> target key, most specific first. A name that
# matches none of them (H100 NVL, H200 NVL, GH200, consumer cards...) is reported with
# measured figures only: those parts run at other clocks and power limits.
_NAME_PATTERNS: tuple[tuple[tuple[str, ...], tuple[str, ...], str], ...] = (
    # (all of these substrings, none of these substrings, key)
    (("h100", "pcie"), (), "h100-pcie"),
    (("h100",), ("nvl", "pcie", "gh100", "gh200"), "h100"),
    (("h200",), ("nvl", "gh200"), "h200"),
    (("a100",), (), "a100"),
    (("l40s",), (), "l40s"),
    (("b200",), ("gb200",), "b200"),
)


def list_targets() -> list[GpuTarget]:
    """Every known target GPU, in table order (oldest architecture first)."""
    return list(TARGETS.values())


def get_target(key: str) -> GpuTarget:
    """The target called ``key``; an unknown key raises ValueError listing the valid ones."""
    try:
        return TARGETS[key]
    except KeyError:
        raise ValueError(f"unknown GPU target {key!r}; choose one of: {', '.join(TARGETS)}") from None


def match_target(device_name: str) -> str | None:
    """Target key for a ``torch.cuda.get_device_name()`` string, or None when not in the table."""
    low = device_name.lower()
    for must, must_not, key in _NAME_PATTERNS:
        if all(s in low for s in must) and not any(s in low for s in must_not):
            return key
    return None


# --------------------------------------------------------------------------- support rules


def _norm_format(fmt: str | None, role: str) -> str | None:
    if isinstance(fmt, str):
        fmt = fmt.strip().lower()
    if fmt in _NO_QUANT:
        return None
    if fmt not in KNOWN_FORMATS:
        raise ValueError(
            f"unknown {role} format {fmt!r}; use one of: {', '.join(KNOWN_FORMATS)} "
            "(or None for no quantization)"
        )
    return fmt


def _sm_text(sm: int | None) -> str:
    return "the CPU" if sm is None else f"sm{sm}"


def _rule(sm: int | None, weight: str | None, act: str | None) -> tuple[str, str]:
    """(verdict, reason) for one scheme on compute capability ``sm`` (None = CPU)."""
    on = _sm_text(sm)
    if weight is None and act is None:
        return "native", "no quantization: bf16 runs everywhere"
    if weight is None:
        return (
            "unsupported",
            "activation-only quantization has no serving kernel: quantize the weights too",
        )
    if sm is None:
        return "emulated", "a CPU has no low-precision matrix units: the scheme runs upcast"

    if act is None:  # weight-only, W*A16
        if weight in ("int8", "int4", "fp8_e4m3", "fp8_e5m2"):
            if sm >= SM_WEIGHT_ONLY:
                return "native", (
                    f"{weight} weight-only (W{8 if weight != 'int4' else 4}A16): mixed-input "
                    f"kernels (Marlin-style) dequantize in-kernel on sm{SM_WEIGHT_ONLY}+"
                )
            return (
                "emulated",
                f"no mixed-input weight-only kernel below sm{SM_WEIGHT_ONLY}: weights are upcast",
            )
        if weight in ("nvfp4", "mxfp4"):  # NVFP4A16, MXFP4A16: vLLM's FP4 Marlin on every GPU from sm80
            if sm >= SM_WEIGHT_ONLY:
                return "native", (
                    f"{weight} weight-only (W4A16): vLLM's FP4 Marlin kernel (CompressedTensorsW4A16Fp4 / "
                    f"W4A16Mxfp4) dequantizes the FP4 weights in-kernel on sm{SM_WEIGHT_ONLY}+, as INT4 Marlin does; "
                    "it serves them so on Blackwell too"
                )
            return "unsupported", f"no kernel serves {weight} weights below sm{SM_WEIGHT_ONLY}"
        # other block / FP4 formats: fp4_e2m1 (no scale format a serving engine reads), mxfp8
        if sm >= SM_BLOCK_SCALED:
            return (
                "native",
                f"{weight} weight-only: Blackwell (sm{SM_BLOCK_SCALED}) has block-scaled low-precision paths",
            )
        if sm >= SM_WEIGHT_ONLY:
            return "emulated", (
                f"{weight} weight-only on {on}: served by a Marlin-style kernel that dequantizes to "
                f"bf16; block-scaled tensor cores need sm{SM_BLOCK_SCALED}"
            )
        return "unsupported", f"no kernel serves {weight} weights below sm{SM_WEIGHT_ONLY}"

    # weights and activations both quantized
    if weight in _FP8 and act in _FP8:
        if weight == "fp8_e5m2" and act == "fp8_e5m2":
            return "emulated", (
                "E5M2 x E5M2 is refused by cuBLASLt (torch._scaled_mm: 'Multiplication of two "
                "Float8_e5m2 matrices is not supported'); use E4M3 for one operand"
            )
        if sm >= SM_FP8_MMA:
            return "native", f"FP8 W8A8: FP8 tensor cores on sm{SM_FP8_MMA}+ (torch._scaled_mm)"
        return "emulated", (
            f"FP8 W8A8 on {on}: no FP8 tensor cores (they start at sm{SM_FP8_MMA}); served as FP8 "
            "weight-only with bf16 activations, activation quantization is simulated"
        )
    if weight == "int8" and act == "int8":
        if sm >= SM_INT8_MMA:
            return (
                "native",
                f"INT8 W8A8: INT8 tensor cores on sm{SM_INT8_MMA}+ (torch._int_mm + scale epilogue)",
            )
        return "emulated", f"no INT8 tensor cores below sm{SM_INT8_MMA}"
    if weight == "mxfp8" and act == "mxfp8":
        if sm >= SM_BLOCK_SCALED:
            return "native", f"MXFP8 W8A8: block-scaled FP8 MMA on sm{SM_BLOCK_SCALED}+"
        return "emulated", (
            f"MXFP8 on {on}: no block-scaled MMA before sm{SM_BLOCK_SCALED}; the E8M0 block scales are "
            "simulated (or folded into a per-tensor FP8 path where FP8 exists)"
        )
    if weight in _FP4 and act == weight:
        if sm >= SM_BLOCK_SCALED:
            return "native", f"{weight} W4A4: FP4 tensor cores on sm{SM_BLOCK_SCALED}+ (Blackwell)"
        if weight == "nvfp4" and sm >= SM_WEIGHT_ONLY:
            return "emulated", (
                f"nvfp4 W4A4 on {on}: no FP4 tensor cores, so vLLM serves the checkpoint as W4A16 "
                "(CompressedTensorsW4A16Fp4, Marlin): FP4 weights dequantized in-kernel, activations left in 16 "
                "bits: it serves as NVFP4A16 does, so score NVFP4A16 for its accuracy there"
            )
        if weight == "mxfp4" and sm >= SM_WEIGHT_ONLY:
            return "emulated", (
                f"mxfp4 W4A4 on {on}: no FP4 tensor cores, so vLLM serves the checkpoint with FP4 weights and "
                "16-bit activations (CompressedTensorsW4A4Mxfp4: \"true W4A4 on SM100+, otherwise W4A16 "
                "weight-only via Marlin\"): the score, which quantizes the activations too, overstates its "
                "error there"
            )
        return (
            "unsupported",
            f"{weight} W4A4 needs FP4 tensor cores: Blackwell (sm{SM_BLOCK_SCALED}) or newer",
        )
    if weight == "int4" and act == "fp8_e4m3":  # W4AFP8
        if sm == SM_W4A8_FP8:
            return "native", (
                f"W4AFP8: vLLM's CUTLASS W4A8 kernel (sm{SM_W4A8_FP8}, Hopper) converts the INT4 weights to FP8 "
                "in-kernel and runs the math on FP8 tensor cores"
            )
        return "unsupported", (
            f"W4AFP8 on {on}: vLLM's only kernel for it (CUTLASS W4A8) is built for Hopper (sm{SM_W4A8_FP8}) alone; "
            "no other kernel takes INT4 weights with FP8 activations"
        )
    if weight == "int4" and act == "int4":
        return "emulated", "no production INT4 W4A4 GEMM in torch / cuBLAS: simulated only"
    return "emulated", (
        f"mixed {weight} weights x {act} activations: no kernel in the paths quantplan models; "
        "the activation quantization is simulated"
    )


@functools.lru_cache(maxsize=1024)  # pure, and asked once per layer of a plan
def support_on_sm(sm: int | None, weight_format: str | None, act_format: str | None) -> str:
    """``"native"`` | ``"emulated"`` | ``"unsupported"`` for a scheme on compute capability ``sm``.

    ``sm`` is major*10 + minor (90 for sm_90), None for a CPU. The rules are those of
    :func:`support_on_target`.
    """
    return _rule(sm, _norm_format(weight_format, "weight"), _norm_format(act_format, "activation"))[0]


def support_on_target(target_key: str, weight_format: str | None, act_format: str | None) -> str:
    """Whether a layer's scheme runs ``"native"``, ``"emulated"`` or is ``"unsupported"`` on a GPU.

    Formats are names from ``quantcore/formats/catalog.py`` (``fp8_e4m3``, ``fp8_e5m2``, ``int8``,
    ``int4``, ``fp4_e2m1``, ``mxfp8``, ``mxfp4``, ``nvfp4``); None means no quantization.
    Rules, first match wins (``sm`` = the target's compute capability):

    ========================  ==========================================================
    weight / activation       verdict
    ========================  ==========================================================
    None / None               native (bf16)
    None / any                unsupported (activation-only quantization has no kernel)
    int8, int4, fp8 / None    native on sm80+ (Marlin-style W8A16 / W4A16 kernels), else emulated
    nvfp4, mxfp4 / None       native on sm80+ (vLLM's FP4 Marlin dequantizes in-kernel, Blackwell included)
    fp4, mxfp8 / None         native on sm100+, emulated on sm80-sm90 (dequantized to bf16),
                              unsupported below sm80
    fp8 / fp8                 native on sm89+, else emulated; E5M2 x E5M2 always emulated
                              (cuBLASLt refuses it)
    int8 / int8               native on sm75+, else emulated
    mxfp8 / mxfp8             native on sm100+, else emulated
    fp4 fmt / same fp4 fmt    native on sm100+; nvfp4 and mxfp4 emulated on sm80-sm90 (vLLM serves them as
                              W4A16, activations unquantized); else unsupported
    int4 / fp8_e4m3 (W4AFP8)  native on sm90 only (vLLM's CUTLASS W4A8 kernel is Hopper-only), else
                              unsupported: the one exception to "a newer GPU never supports less"
    int4 / int4, other mixes  emulated (no kernel quantplan models)
    ========================  ==========================================================

    Unknown target keys and format names raise ValueError listing the valid ones.
    """
    target = get_target(target_key)
    return support_on_sm(target.sm, weight_format, act_format)


def support_reason(target_key: str, weight_format: str | None, act_format: str | None) -> str:
    """One sentence for the UI explaining :func:`support_on_target`'s verdict."""
    target = get_target(target_key)
    verdict, reason = _rule(
        target.sm, _norm_format(weight_format, "weight"), _norm_format(act_format, "activation")
    )
    return f"{verdict} on {target.name} (sm{target.sm}): {reason}"


# --------------------------------------------------------------------------- local device


@dataclass(frozen=True)
class DeviceInfo:
    """What ``probe_device`` found.

    kind:               ``"cpu"`` or ``"cuda"``
    name:               CPU description or ``torch.cuda.get_device_name()``
    device_class:       queue-style class: ``"cpu"`` or ``"gpu.sm90"`` (see :func:`device_class`)
    compute_capability: (major, minor) for CUDA, None for CPU
    memory_bytes:       device memory (CUDA total memory; CPU: physical RAM when known)
    torch_version:      ``torch.__version__``
    cuda_version:       ``torch.version.cuda`` (None on CPU-only builds)
    peak_tflops:        the matched target's dense peaks, None for a CPU or an unknown GPU
    target_key:         key in ``TARGETS`` the device matched, or None
    device:             the torch device string probed (``"cpu"``, ``"cuda:0"``)
    """

    kind: str
    name: str
    device_class: str
    compute_capability: tuple[int, int] | None
    memory_bytes: int | None
    torch_version: str
    cuda_version: str | None
    peak_tflops: dict[str, float] | None
    target_key: str | None
    device: str = "cpu"

    @property
    def sm(self) -> int | None:
        """Compute capability as major*10 + minor, None on CPU."""
        if self.compute_capability is None:
            return None
        major, minor = self.compute_capability
        return major * 10 + minor

    def to_dict(self) -> dict:
        """Plain JSON-friendly dict (tuples become lists)."""
        return {
            "kind": self.kind,
            "name": self.name,
            "device_class": self.device_class,
            "compute_capability": list(self.compute_capability) if self.compute_capability else None,
            "memory_bytes": self.memory_bytes,
            "torch_version": self.torch_version,
            "cuda_version": self.cuda_version,
            "peak_tflops": dict(self.peak_tflops) if self.peak_tflops else None,
            "target_key": self.target_key,
            "device": self.device,
        }


def device_class(kind: str, compute_capability: tuple[int, int] | None = None) -> str:
    """Queue-style device class: ``"cpu"``, ``"gpu"`` (capability unknown) or ``"gpu.sm90"``."""
    if kind == "cpu":
        return "cpu"
    if kind != "cuda":
        raise ValueError(f"unknown device kind {kind!r}; use 'cpu' or 'cuda'")
    if compute_capability is None:
        return "gpu"
    major, minor = compute_capability
    return f"gpu.sm{major}{minor}"


#: CPU instruction-set extensions that multiply INT8 with INT32 accumulation in hardware, as Linux
#: names them in /proc/cpuinfo, best first: Intel AMX tiles, AVX-512 VNNI (Cascade Lake+, AMD Zen 4+),
#: AVX-VNNI (Alder Lake+), Arm's int8 matrix multiply and dot product. oneDNN, which serves
#: ``torch._int_mm`` on a CPU, uses them when present.
CPU_INT8_ISAS = ("amx_int8", "avx512_vnni", "avx_vnni", "i8mm", "asimddp")


def cpu_flags() -> set[str]:
    """The CPU feature flags of /proc/cpuinfo (x86 ``flags``, Arm ``Features``); empty where unreadable."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return set(value.split())
    except OSError:
        pass
    return set()


def int8_dot_isa(flags: set[str] | None = None) -> str | None:
    """The best INT8 dot-product extension among ``flags`` (default: this CPU's), or None."""
    flags = cpu_flags() if flags is None else flags
    return next((isa for isa in CPU_INT8_ISAS if isa in flags), None)


def _cpu_name() -> str:
    import platform

    name = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return name or platform.processor() or platform.machine() or "CPU"


def _ram_bytes() -> int | None:
    import os

    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def probe_device(device: str = "cpu") -> DeviceInfo:
    """Describe ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:1"``) and match it against ``TARGETS``.

    Raises quantcore.errors.UnsupportedOnDevice when CUDA is asked for but not available.
    """
    import torch

    from quantcore.errors import UnsupportedOnDevice

    dev = torch.device(device)
    if dev.type == "cpu":
        cap = torch.backends.cpu.get_cpu_capability()
        return DeviceInfo(
            kind="cpu",
            name=f"{_cpu_name()} ({torch.get_num_threads()} threads, {cap})",
            device_class="cpu",
            compute_capability=None,
            memory_bytes=_ram_bytes(),
            torch_version=torch.__version__,
            cuda_version=torch.version.cuda,
            peak_tflops=None,
            target_key=None,
            device="cpu",
        )
    if dev.type != "cuda":
        raise UnsupportedOnDevice(f"device {device!r} is not supported: use 'cpu' or 'cuda[:index]'")
    if not torch.cuda.is_available():
        raise UnsupportedOnDevice(
            f"device {device!r} asked for, but torch {torch.__version__} sees no CUDA GPU "
            "(CPU-only build or no driver): run on a GPU worker or use device='cpu'"
        )
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    cc = (int(props.major), int(props.minor))
    key = match_target(props.name)
    return DeviceInfo(
        kind="cuda",
        name=props.name,
        device_class=device_class("cuda", cc),
        compute_capability=cc,
        memory_bytes=int(props.total_memory),
        torch_version=torch.__version__,
        cuda_version=torch.version.cuda,
        peak_tflops=dict(TARGETS[key].peak_tflops) if key else None,
        target_key=key,
        device=f"cuda:{index}",
    )


@dataclass(frozen=True)
class PathSupport:
    """Whether one kernel path runs on the probed device.

    runs:   quantplan can execute it here (checked by running a tiny instance)
    native: the low-precision arithmetic is hardware-accelerated here
    note:   plain words for the UI (e.g. "runs, not accelerated")
    """

    path: str
    runs: bool
    native: bool
    note: str

    @property
    def status(self) -> str:
        """One of "native", "runs, not accelerated", "does not run" (:func:`support_status`)."""
        return support_status(self.runs, self.native)

    @property
    def why(self) -> str:
        """The note, without the verdict it may open with (:func:`support_why`): shown beside :attr:`status`."""
        return support_why(self.runs, self.native, self.note)

    def to_dict(self) -> dict:
        return {"path": self.path, "runs": self.runs, "native": self.native, "note": self.note}


def support_status(runs: bool, native: bool) -> str:
    """A :class:`PathSupport`'s verdict in words (also of one stored as a dict): the hardware may have a unit
    (FP4 on sm100) that quantplan does not run yet; that reads "native, not run by quantplan"."""
    if runs:
        return "native" if native else "runs, not accelerated"
    return "native, not run by quantplan" if native else "does not run"


def support_why(runs: bool, native: bool, note: str) -> str:
    """A :class:`PathSupport`'s note without the verdict it may open with ("native on this CPU: ..."), which is
    shown beside it; a note that is only the verdict and where ("native on sm90") stays whole."""
    if note.startswith(support_status(runs, native)) and ": " in note:
        return note.split(": ", 1)[1]
    return note


def describe_probe(device: Mapping) -> str:
    """One line for a person from a probe as stored (:meth:`DeviceInfo.to_dict`): the device, its compute
    capability, memory, torch / CUDA versions and the dense peaks its percent-of-peak figures divide by."""
    parts = [str(device.get("name") or "unknown device")]
    if cc := device.get("compute_capability"):
        parts.append(f"compute capability {cc[0]}.{cc[1]} ({device.get('device_class')})")
    if mem := device.get("memory_bytes"):
        parts.append(f"{mem / 2**30:.1f} GiB {'memory' if device.get('kind') == 'cuda' else 'RAM'}")
    parts.append(f"torch {device.get('torch_version')}")
    if device.get("cuda_version"):
        parts.append(f"CUDA {device['cuda_version']}")
    if peaks := device.get("peak_tflops"):
        dense = ", ".join(f"{k} {peaks[k]:g}" for k in ("bf16", "fp8", "int8", "fp4") if peaks.get(k))
        parts.append(f"dense peak {dense} TFLOP/s (table entry {device.get('target_key')})")
    elif device.get("kind") == "cuda":
        parts.append("not in the peak table: measured figures only")
    return " · ".join(parts)


WEIGHT_ONLY_NOTE = {  # what a weight-only kernel does, for the notes of device_paths
    "w8_row": "torch._weight_int8pack_mm reads INT8 weights and dequantizes them inside the kernel",
    "w4_g128": "the INT4 weight-only kernel reads packed 4-bit weights and dequantizes them inside the kernel",
    "w4_g64": "the INT4 weight-only kernel, groups of 64 (W4A16_G64), reads packed 4-bit weights and dequantizes them "
              "inside the kernel",
    "w4_g32": "the INT4 weight-only kernel, groups of 32 (W4A16_G32), reads packed 4-bit weights and dequantizes them "
              "inside the kernel",
    "w4_ch": "the INT4 weight-only kernel, one scale per row (W4A16_CHANNEL), reads packed 4-bit weights and "
             "dequantizes them inside the kernel (torch has no per-channel mode: its groups of 128 all carry the "
             "row's scale, where vLLM's Marlin reads the one scale)",
}
#: Kernel paths reported by :func:`device_paths` (the benchmark paths of
#: ``quantcore.kernels.bench`` plus FP4, which is reported but not benchmarked).
DEVICE_PATHS: tuple[str, ...] = ("baseline", "fp8_tensor", "fp8_row", "int8_row", *WEIGHT_ONLY_NOTE, "fp4")


def _try_tiny(device: str, path: str) -> str | None:
    """Run a tiny instance of ``path`` on ``device``; None if it ran, else the error text."""
    import torch

    # 32 rows: above _int_mm's CUDA minimum of 17; 32 columns: multiples of 8 and 16.
    m = k = n = 32
    try:
        with torch.no_grad():
            if path.startswith("fp8"):
                a = torch.ones(m, k, device=device).to(torch.float8_e4m3fn)
                b = torch.ones(n, k, device=device).to(torch.float8_e4m3fn)
                if path == "fp8_tensor":
                    sa = torch.ones((), device=device)
                    sb = torch.ones((), device=device)
                else:
                    sa = torch.ones(m, 1, device=device)
                    sb = torch.ones(1, n, device=device)
                out_dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
                torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)
            elif path == "int8_row":
                a = torch.ones(m, k, device=device, dtype=torch.int8)
                b = torch.ones(n, k, device=device, dtype=torch.int8)
                torch._int_mm(a, b.t())
            elif path in WEIGHT_ONLY_NOTE:
                from quantcore.kernels.bench import W4_GROUP, W4_GROUPS, int4_weight_mm, pack_int4

                kind = "cuda" if device.startswith("cuda") else "cpu"
                dtype = torch.bfloat16 if kind == "cuda" else torch.float32
                x = torch.ones(m, W4_GROUP, device=device, dtype=dtype)
                codes = torch.ones(n, W4_GROUP, device=device, dtype=torch.int8)
                if path == "w8_row":
                    torch._weight_int8pack_mm(x, codes, torch.ones(n, device=device, dtype=dtype))
                else:
                    sz = torch.zeros(W4_GROUP // W4_GROUPS[path], n, 2, device=device, dtype=dtype)  # per group
                    int4_weight_mm(x, pack_int4(codes, kind), sz, kind, W4_GROUPS[path])
            if device.startswith("cuda"):
                torch.cuda.synchronize()
    except (RuntimeError, NotImplementedError, TypeError, AttributeError) as exc:
        return torch_error_text(exc)
    return None


_TORCH_ASSERT_TAIL = "please report a bug to PyTorch."


def torch_error_text(exc: BaseException) -> str:
    """The part of a torch error a person can act on: its first line, and of an internal assert (torch 2.11's
    "(scale_a.numel() == 1 ...) INTERNAL ASSERT FAILED at ".../Blas.cpp":249, please report a bug to PyTorch.
    Now _scaled_mm only supports per-tensor scaling for CPU backend.") the sentence after the boilerplate."""
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    if _TORCH_ASSERT_TAIL in text and (after := text.split(_TORCH_ASSERT_TAIL, 1)[1].strip()):
        text = after
    return text.splitlines()[0]


def _weight_only(out: dict[str, PathSupport], dev: str, where: str,
                 sm_ok: Mapping[str, tuple[bool, str]] | None = None) -> None:
    """The weight-only paths: native wherever their kernel runs (the math stays in the baseline dtype,
    so no low-precision unit is needed; what they save is weight traffic)."""
    for path, what in WEIGHT_ONLY_NOTE.items():
        ok, need = (sm_ok or {}).get(path, (True, ""))
        if not ok:
            out[path] = PathSupport(path, False, False, f"{need}; this device is {where.removeprefix('on ')}")
            continue
        err = _try_tiny(dev, path)
        out[path] = (PathSupport(path, True, True, f"native {where}: {what}") if err is None
                     else PathSupport(path, False, False, f"does not run {where}: {err}"))


def device_paths(info: DeviceInfo, *, flags: set[str] | None = None) -> dict[str, PathSupport]:
    """For each of ``DEVICE_PATHS``: does it run on the probed device, and is it accelerated?

    "runs" is established by executing a tiny instance (32×32×32) of the kernel on the
    device; "native" comes from the capability rules (FP8 tensor cores from sm89,
    INT8 from sm75, FP4 from sm100). On a CPU, FP8 is never accelerated (no CPU has FP8
    matrix units that torch uses) and INT8 is native only where the CPU has INT8
    dot-product instructions (:data:`CPU_INT8_ISAS`, from ``cpu_flags``: VNNI, AMX, i8mm);
    a path that only runs is reported as "runs, not accelerated", and the measured times
    are the honest answer either way.
    """
    out: dict[str, PathSupport] = {}
    dev = info.device
    if info.kind == "cpu":
        out["baseline"] = PathSupport("baseline", True, True, "fp32 matmul: the CPU baseline")
        isa = int8_dot_isa(flags)  # flags: a CPU's feature flags, this one's by default
        int8_native = isa is not None
        for path, what, native in (
            ("fp8_tensor", "torch._scaled_mm with per-tensor scales; CPUs have no FP8 matrix units", False),
            ("fp8_row", "torch._scaled_mm with row-wise scales; CPUs have no FP8 matrix units", False),
            (
                "int8_row",
                f"torch._int_mm on this CPU's {isa} INT8 dot-product instructions" if int8_native
                else "torch._int_mm; this CPU has no INT8 dot-product instructions (VNNI, AMX, i8mm)",
                int8_native,
            ),
        ):
            err = _try_tiny(dev, path)
            if err is None:
                out[path] = PathSupport(path, True, native, f"native: {what}" if native
                                        else f"runs, not accelerated: {what}")
            else:
                out[path] = PathSupport(path, False, False, f"does not run on this CPU: {err}")
        _weight_only(out, dev, "on this CPU")
        out["fp4"] = PathSupport("fp4", False, False, "FP4 matmul needs Blackwell (sm100) tensor cores")
        return out

    sm = info.sm or 0
    out["baseline"] = PathSupport("baseline", True, True, "bf16 matmul (cuBLAS): the GPU baseline")
    rules = {
        "fp8_tensor": (sm >= SM_FP8_MMA, f"FP8 tensor cores need sm{SM_FP8_MMA}+"),
        "fp8_row": (sm >= SM_FP8_MMA, f"FP8 tensor cores need sm{SM_FP8_MMA}+"),
        "int8_row": (sm >= SM_INT8_MMA, f"INT8 tensor cores need sm{SM_INT8_MMA}+"),
    }
    for path, (native_hw, need) in rules.items():
        if not native_hw:
            out[path] = PathSupport(path, False, False, f"{need}; this device is sm{sm}")
            continue
        err = _try_tiny(dev, path)
        if err is None:
            out[path] = PathSupport(path, True, True, f"native on sm{sm}")
        else:
            out[path] = PathSupport(
                path, False, False, f"hardware has it, but this torch build refused it: {err}"
            )
    tinygemm = (sm >= SM_INT4_TINYGEMM, f"tinygemm needs sm{SM_INT4_TINYGEMM}+")
    _weight_only(out, dev, f"on sm{sm}", sm_ok={p: tinygemm for p in WEIGHT_ONLY_NOTE if p.startswith("w4_")})
    if sm >= SM_BLOCK_SCALED:
        out["fp4"] = PathSupport(
            "fp4", False, True, f"native FP4 tensor cores on sm{sm}; not benchmarked by quantplan yet"
        )
    else:
        out["fp4"] = PathSupport(
            "fp4", False, False, f"FP4 tensor cores need sm{SM_BLOCK_SCALED}+; this device is sm{sm}"
        )
    return out
