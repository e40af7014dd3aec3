"""One typed spec per job kind: its parameters, their defaults (written here once), their validation, and the
``jobs.params`` JSON it is stored as.

A spec is a frozen dataclass checked when it is built: a value outside its range raises
:class:`jobs.errors.InvalidJob` with a sentence naming the parameter, the value and what is allowed, before anything
is queued. ``spec.to_params()`` is the JSON a job row stores; ``Spec.from_params(row.params)`` reads it back and is
tolerant of rows written by older versions: a missing key, ``None`` (and, as the worker always read them, ``0`` or
``""`` for a count, a size or a name) mean the default; keys a spec does not know (``"user"`` of old rows,
``"removed_model"`` that the store adds) are ignored, as the worker ignored them.

Imports neither torch, celery nor sqlalchemy: the pages, the CLI and the worker all read it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

from jobs.errors import InvalidJob

# upper bounds that only a mistake reaches (a typo's extra zeros), far above anything a job is asked today
MAX_SAMPLES = 1_000_000  # sequences of text a job reads
MAX_SEQ_LEN = 1 << 20  # tokens per sequence
MAX_BATCH_SIZE = 65_536  # sequences per forward
MAX_GPUS = 1024  # tensor-parallel size (quantcore.models.parallel.parse_tp's own limit)
MAX_M = 1 << 24  # rows of a benchmarked GEMM (batch x tokens)
MAX_BUDGET_S = 7 * 24 * 3600.0  # a benchmark's seconds per shape

QUICK_SWEEP_SAMPLES = 8  # the CLI's `sensitivity --samples` default: a sweep runs once per unit, so fewer sequences

_OMIT = "omit_at_default"  # field metadata: to_params leaves the field out while it has its default value
_KEEP_FALSY = "keep_falsy"  # field metadata: a stored 0 / "" / False is a value, not "unset"


def _quiet(default: Any) -> Any:
    """A field that :meth:`JobSpec.to_params` writes only when it differs from ``default`` (flags and sizes most
    jobs leave alone: the JSON of a job that does not ask for them stays as it always was)."""
    return field(default=default, metadata={_OMIT: True})


def _exact(default: Any) -> Any:
    """A field whose stored falsy value (0, 0.0, False) is meant as given, not as "unset"."""
    return field(default=default, metadata={_KEEP_FALSY: True})


# ----------------------------------------------------------------------------- checks (messages for people)


def _whole(kind: str, name: str, value: Any, least: int, most: int, what: str) -> int:
    """``value`` as an int in [least, most], else InvalidJob naming the parameter, the value and the range."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        number = None
    else:
        try:
            number = int(value)
            if isinstance(value, float) and number != value:
                number = None
        except ValueError:
            number = None
    if number is None:
        raise InvalidJob(f"a {kind} job's {name} ({what}) must be a whole number from {least:,} to {most:,}; "
                         f"got {value!r}")
    if not least <= number <= most:
        raise InvalidJob(f"a {kind} job's {name} ({what}) must be from {least:,} to {most:,}; got {number:,}")
    return number


def _real(kind: str, name: str, value: Any, least: float, most: float, what: str, *, above: bool = False) -> float:
    """``value`` as a float in [least, most] (``above``: strictly more than ``least``), else InvalidJob."""
    try:
        number = float(value) if not isinstance(value, bool) else None
    except (TypeError, ValueError):
        number = None
    if number is None or number != number:  # NaN
        raise InvalidJob(f"a {kind} job's {name} ({what}) must be a number; got {value!r}")
    low_ok = number > least if above else number >= least
    if not (low_ok and number <= most):
        bound = f"more than {least:g} and at most {most:g}" if above else f"from {least:g} to {most:g}"
        raise InvalidJob(f"a {kind} job's {name} ({what}) must be {bound}; got {number:g}")
    return number


def _text(kind: str, name: str, value: Any, what: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidJob(f"a {kind} job's {name} ({what}) must be text; got {value!r}")
    return value


def _device(kind: str, value: Any) -> str:
    """'cpu', 'cuda' or 'cuda:N' (stripped), as the worker accepts (worker.bodies.shared.resolve_device)."""
    device = str(value).strip() if isinstance(value, str) else None
    if device is None or not (device == "cpu" or device.startswith("cuda")):
        raise InvalidJob(f"a {kind} job's device must be 'cpu' or 'cuda' (or 'cuda:N'); got {value!r}")
    return device


def _dataset(kind: str, name: str, value: Any) -> int | str | None:
    """A stored text by id or name (store.repo.get_dataset), or None for the built-in text."""
    if value is None or (isinstance(value, int | str) and not isinstance(value, bool)):
        return value
    raise InvalidJob(f"a {kind} job's {name} must be a stored text's id or name (or none for the built-in text); "
                     f"got {value!r}")


# ----------------------------------------------------------------------------- the base


@dataclass(frozen=True)
class JobSpec:
    """What every job kind's spec shares: its kind, the queue it asks for (``queue``: a device class such as
    ``gpu.sm90``; None routes by device, jobs.routing) and who asked (``user``, kept in the JSON as the app and
    the CLI always wrote it)."""

    kind: ClassVar[str] = ""

    queue: str | None = None
    user: str | None = None

    def __post_init__(self) -> None:
        if self.queue is not None and (not isinstance(self.queue, str) or not self.queue.strip()):
            raise InvalidJob(f"a {self.kind} job's queue must be a queue name such as 'gpu' or 'gpu.sm90'; "
                             f"got {self.queue!r}")
        _text(self.kind, "user", self.user, "who asked")

    def _set(self, name: str, value: Any) -> None:
        """Normalise a field while checking it (the dataclass is frozen)."""
        object.__setattr__(self, name, value)

    def to_params(self) -> dict[str, Any]:
        """The ``jobs.params`` JSON of this job: every field that is not None, except the quiet ones
        (:func:`_quiet`) at their default; tuples as lists."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None or (f.metadata.get(_OMIT) and value == f.default):
                continue
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> Self:
        """The spec of a stored ``jobs.params`` (of any version): missing keys and ``None`` take the default, and
        so do ``0`` / ``""`` / ``[]`` where the worker always read them as unset; unknown keys are ignored.
        InvalidJob where a value is out of its range."""
        params = params or {}
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name not in params:
                continue
            value = params[f.name]
            if value is None or (not value and not f.metadata.get(_KEEP_FALSY) and not isinstance(value, bool)):
                continue
            values[f.name] = value
        return cls(**values)

    def with_changes(self, **changes: Any) -> Self:
        """A copy with ``changes``, checked again."""
        return dataclasses.replace(self, **changes)


# ----------------------------------------------------------------------------- register


@dataclass(frozen=True)
class RegisterSpec(JobSpec):
    """Register a checkpoint: the built-in demo (``demo``) or ``source``, a path the workers can read (a Hugging
    Face folder, .zip, .tar.gz or .gguf). ``name``: the model's name (default: the file's, without its suffix);
    ``source_name``: the file name shown for an upload; ``cleanup_dir``: the staged upload folder the job deletes
    when it ends."""

    kind: ClassVar[str] = "register"

    demo: bool = _quiet(False)
    source: str | None = None
    name: str | None = None
    source_name: str | None = None
    cleanup_dir: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self._set("demo", bool(self.demo))
        for name, what in (("source", "the checkpoint's path"), ("name", "the model's name"),
                           ("source_name", "the uploaded file's name"), ("cleanup_dir", "the staged upload folder")):
            _text(self.kind, name, getattr(self, name), what)
        if not self.demo and not self.source:
            raise InvalidJob("a register job needs a source (a Hugging Face folder, .zip, .tar.gz or .gguf the "
                             "workers can read) or demo; it got neither")


# ----------------------------------------------------------------------------- calibrate


@dataclass(frozen=True)
class CalibrateSpec(JobSpec):
    """Calibrate a model: per-channel activation statistics of every linear layer (and the K / V maxima) over
    ``samples`` sequences of ``seq_len`` tokens of ``dataset`` (a stored text's id or name; None: the built-in
    calibration text), ``batch_size`` sequences per forward, on ``device``."""

    kind: ClassVar[str] = "calibrate"

    samples: int = 32
    seq_len: int = 256
    device: str = "cpu"
    dataset: int | str | None = _exact(None)
    batch_size: int = _quiet(4)

    def __post_init__(self) -> None:
        super().__post_init__()
        k = self.kind
        self._set("samples", _whole(k, "samples", self.samples, 1, MAX_SAMPLES, "sequences of text"))
        self._set("seq_len", _whole(k, "seq_len", self.seq_len, 1, MAX_SEQ_LEN, "tokens per sequence"))
        self._set("batch_size", _whole(k, "batch_size", self.batch_size, 1, MAX_BATCH_SIZE, "sequences per forward"))
        self._set("device", _device(k, self.device))
        self._set("dataset", _dataset(k, "dataset", self.dataset))


# ----------------------------------------------------------------------------- score and sensitivity


@dataclass(frozen=True)
class TextJobSpec(JobSpec):
    """The tokens a score or a sensitivity sweep reads: ``samples`` x ``seq_len`` tokens of the evaluation text
    ``dataset`` (None: the built-in one), and, for GPTQ Hessians, AWQ scales, KV cache scales and a first
    calibration where none is stored, ``cal_samples`` x ``cal_seq_len`` tokens of the calibration text
    ``cal_dataset`` (None: the built-in one, never the evaluation text). A scored sequence needs two tokens (its
    first is predicted by nothing). ``tensor_parallel`` / ``expert_parallel``: the GPUs the plan is quantized as
    served on (None: a score's plan's own, a sweep's one GPU)."""

    samples: int = 16
    seq_len: int = 256
    cal_samples: int = 16
    cal_seq_len: int = 256
    dataset: int | str | None = _exact(None)
    cal_dataset: int | str | None = _exact(None)
    device: str = "cpu"
    batch_size: int = _quiet(4)
    tensor_parallel: int | None = None
    expert_parallel: bool = _quiet(False)

    def __post_init__(self) -> None:
        super().__post_init__()
        k = self.kind
        self._set("samples", _whole(k, "samples", self.samples, 1, MAX_SAMPLES, "sequences of evaluation text"))
        self._set("seq_len", _whole(k, "seq_len", self.seq_len, 2, MAX_SEQ_LEN,
                                    "tokens per sequence: the first is predicted by nothing"))
        self._set("cal_samples", _whole(k, "cal_samples", self.cal_samples, 1, MAX_SAMPLES,
                                        "sequences of calibration text"))
        self._set("cal_seq_len", _whole(k, "cal_seq_len", self.cal_seq_len, 1, MAX_SEQ_LEN,
                                        "tokens per calibration sequence"))
        self._set("batch_size", _whole(k, "batch_size", self.batch_size, 1, MAX_BATCH_SIZE, "sequences per forward"))
        self._set("device", _device(k, self.device))
        self._set("dataset", _dataset(k, "dataset", self.dataset))
        self._set("cal_dataset", _dataset(k, "cal_dataset", self.cal_dataset))
        if self.tensor_parallel is not None:
            self._set("tensor_parallel", _whole(k, "tensor_parallel", self.tensor_parallel, 1, MAX_GPUS,
                                                "GPUs the plan is served on"))
        self._set("expert_parallel", bool(self.expert_parallel))

    def token_params(self) -> dict[str, Any]:
        """What the tokens of this job are, with every default filled in (two jobs, one of them explicit,
        read the same tokens when these agree)."""
        return {"samples": self.samples, "seq_len": self.seq_len, "cal_samples": self.cal_samples,
                "cal_seq_len": self.cal_seq_len, "dataset": self.dataset, "cal_dataset": self.cal_dataset}


@dataclass(frozen=True)
class ScoreSpec(TextJobSpec):
    """Score a plan against the unquantized model: ``scheme`` (one preset for every layer), ``plan`` (a plan file's
    dict) or, with neither, the stored plan the job row points at (its ``plan_id``). ``kv_cache``: a KV cache
    format that replaces the plan's; ``label``: the score's label (default: from the plan); ``predicted_kl``: the
    KL an automatic plan predicted, stored beside the measured one."""

    kind: ClassVar[str] = "score"

    scheme: str | None = None
    plan: dict[str, Any] | None = None
    kv_cache: str | None = None
    label: str | None = None
    predicted_kl: float | None = _exact(None)

    def __post_init__(self) -> None:
        super().__post_init__()
        k = self.kind
        _text(k, "scheme", self.scheme, "a preset's name")
        _text(k, "kv_cache", self.kv_cache, "a KV cache format's name")
        _text(k, "label", self.label, "the score's label")
        if self.plan is not None and not isinstance(self.plan, Mapping):
            raise InvalidJob(f"a score job's plan must be a plan file's mapping (layers, rules, default); "
                             f"got {type(self.plan).__name__}")
        if self.predicted_kl is not None:
            self._set("predicted_kl", _real(k, "predicted_kl", self.predicted_kl, -float("inf"), float("inf"),
                                            "the KL an automatic plan predicted"))


TOKEN_DEFAULTS: dict[str, int] = {name: ScoreSpec().token_params()[name]
                                  for name in ("samples", "seq_len", "cal_samples", "cal_seq_len")}
"""What a score's or sweep's token counts mean when unset: two jobs, one of them explicit, read the same tokens."""


@dataclass(frozen=True)
class SensitivitySpec(TextJobSpec):
    """A sensitivity sweep: ``scheme`` (a preset) quantizing one linear unit at a time (``groups``: a unit is a
    fusion group, else one layer; ``alpha``: SmoothQuant's alpha instead of the preset's), or ``kv_sweep`` (a KV
    cache format) one attention layer at a time; ``kv_sweep`` wins where both are given."""

    kind: ClassVar[str] = "sensitivity"

    scheme: str | None = None
    kv_sweep: str | None = None
    alpha: float | None = _exact(None)
    groups: bool = _exact(True)

    def __post_init__(self) -> None:
        super().__post_init__()
        k = self.kind
        _text(k, "scheme", self.scheme, "a preset's name")
        _text(k, "kv_sweep", self.kv_sweep, "a KV cache format's name")
        if not self.scheme and not self.kv_sweep:
            raise InvalidJob("a sensitivity job sweeps a preset (scheme) over the linear layers or a KV cache format "
                             "(kv_sweep) over the attention layers; it got neither")
        if self.alpha is not None:
            self._set("alpha", _real(k, "alpha", self.alpha, 0.0, 1.0, "SmoothQuant's migration strength"))
        self._set("groups", bool(self.groups))

    @property
    def gpus(self) -> int:
        """The tensor-parallel size the sweep quantizes each unit as (one GPU when unset)."""
        return self.tensor_parallel or 1


# ----------------------------------------------------------------------------- bench


@dataclass(frozen=True)
class BenchSpec(JobSpec):
    """Time the real GEMMs of a model's linear shapes (SmolLM2-135M's without a model) on ``device``: at the M
    values ``m`` (None: :attr:`DEFAULT_MS`, stored as None), the kernel ``paths`` (None: all; the baseline always),
    ``budget_s`` wall-clock seconds per (N, K) shape, each GPU's share of every layer over ``tensor_parallel``
    GPUs (``expert_parallel``: MoE experts whole, one GPU each). ``force``: measure again what is stored."""

    kind: ClassVar[str] = "bench"
    DEFAULT_MS: ClassVar[tuple[int, ...]] = (1, 16, 128, 2048)  # = quantcore.kernels.bench.DEFAULT_MS

    device: str = "cpu"
    m: tuple[int, ...] | None = None
    budget_s: float = 60.0  # = quantcore.kernels.bench.DEFAULT_BUDGET_S
    paths: tuple[str, ...] | None = None
    force: bool = _quiet(False)
    tensor_parallel: int = _quiet(1)
    expert_parallel: bool = _quiet(False)

    def __post_init__(self) -> None:
        super().__post_init__()
        k = self.kind
        self._set("device", _device(k, self.device))
        if self.m is not None:
            if isinstance(self.m, str | bytes) or not isinstance(self.m, Sequence) or not self.m:
                raise InvalidJob(f"a bench job's m (the M values, batch x tokens) must be a list of whole numbers "
                                 f"such as [1, 16, 128]; got {self.m!r}")
            self._set("m", tuple(_whole(k, "m", v, 1, MAX_M, "an M value, batch x tokens") for v in self.m))
        self._set("budget_s", _real(k, "budget_s", self.budget_s, 0.0, MAX_BUDGET_S,
                                    "wall-clock seconds per shape", above=True))
        if self.paths is not None:
            if isinstance(self.paths, str) or not isinstance(self.paths, Sequence) or not all(
                    isinstance(p, str) for p in self.paths):
                raise InvalidJob(f"a bench job's paths must be a list of kernel path names such as "
                                 f"['int8_row', 'w8_row']; got {self.paths!r}")
            self._set("paths", tuple(self.paths) or None)
        self._set("force", bool(self.force))
        self._set("tensor_parallel", _whole(k, "tensor_parallel", self.tensor_parallel, 1, MAX_GPUS,
                                            "GPUs each layer is split over"))
        self._set("expert_parallel", bool(self.expert_parallel))

    @property
    def ms(self) -> tuple[int, ...]:
        """The M values timed: ``m``, or :attr:`DEFAULT_MS` when unset."""
        return self.m or self.DEFAULT_MS


# ----------------------------------------------------------------------------- by kind

SPECS: dict[str, type[JobSpec]] = {spec.kind: spec for spec in (RegisterSpec, CalibrateSpec, ScoreSpec,
                                                                 SensitivitySpec, BenchSpec)}
"""The spec of each job kind."""


def spec_class(kind: str) -> type[JobSpec]:
    """The spec class of a job kind; InvalidJob naming the kinds for another."""
    try:
        return SPECS[kind]
    except KeyError:
        raise InvalidJob(f"unknown job kind {kind!r}; the kinds are {', '.join(SPECS)}") from None


def read_params(kind: str, params: Mapping[str, Any] | None) -> JobSpec:
    """The spec of a stored job of ``kind`` (:meth:`JobSpec.from_params`)."""
    return spec_class(kind).from_params(params)


__all__ = ["SPECS", "TOKEN_DEFAULTS", "QUICK_SWEEP_SAMPLES", "BenchSpec", "CalibrateSpec", "JobSpec",
           "RegisterSpec", "ScoreSpec", "SensitivitySpec", "TextJobSpec", "read_params", "spec_class"]
