"""GPU targets, their low-precision capabilities and peaks, and the probe of the local device.

torch-free: the Streamlit app imports ``TARGETS``, ``support_on_target`` and
``support_reason`` for its target-GPU picker without pulling torch in. What the local
device is and which kernel paths run on it is :mod:`quantcore.kernels.device`.

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
