"""The local device: what it is (:func:`probe_device`) and which kernel paths run on it (:func:`device_paths`).

torch-free at import: the Streamlit app reads :class:`PathSupport` and :func:`describe_probe` of stored probes
without pulling torch in. Only ``probe_device`` and ``device_paths`` import torch, inside the function. The
vocabulary (native, emulated, unsupported) is that of :mod:`quantcore.kernels.hardware`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from quantcore.kernels.hardware import SM_BLOCK_SCALED, SM_FP8_MMA, SM_INT4_TINYGEMM, SM_INT8_MMA, TARGETS, match_target
from quantcore.kernels.paths import W4_GROUP, W4_GROUPS


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
#: :mod:`quantcore.kernels.paths` plus FP4, which is reported but not benchmarked).
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
                from quantcore.kernels.ops import int4_weight_mm, pack_int4

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
