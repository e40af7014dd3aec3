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
MAX_SAMPLES = 1 << 16  # sequences of text a job reads (llm-compressor's examples calibrate on 512)
MAX_SEQ_LEN = 1 << 20  # tokens per sequence; a model's own context (max_position_embeddings) bounds it first
MAX_BATCH_SIZE = 65_536  # sequences per forward
MAX_GPUS = 1024  # tensor-parallel size (quantcore.models.parallel.parse_tp's own limit, in the same words)
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


def _number(value: float) -> str:
    """A bound or a value as people read it: thousands separated from 10,000 up (1024, 65,536), reals shortest."""
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer() and abs(value) < 1e15):
        return f"{int(value):,}" if abs(value) >= 10_000 else str(int(value))
    return f"{value:g}"


@dataclass(frozen=True)
class Limit:
    """The rule of one numeric job parameter, written once and read by everything that checks it: the spec's own
    validation (:meth:`check` with the job's kind), the CLI's parse-time ``type=`` callables
    (quantplan.cli.options), the pages' number inputs (:attr:`least` / :attr:`most`, :meth:`form_bounds`) and, in
    the same words, a plan file's ``tensor_parallel`` (quantcore.models.parallel.parse_tp).

    ``name``: the parameter as a job's JSON names it; ``unit``: what a value counts ("GPUs", "sequences");
    ``whole``: integers only; ``above``: strictly more than ``least``; ``example``: a value to suggest; ``why``:
    why the least is what it is, said when a value is below it."""

    name: str
    unit: str
    least: float
    most: float
    whole: bool = True
    above: bool = False
    example: str = "2"
    why: str = ""

    def problem(self, value: Any) -> tuple[int | float | None, str | None]:
        """(the value as a number, None) when it keeps the rule, else (None, a sentence naming the parameter,
        the value and what is allowed)."""
        number: int | float | None = None
        if isinstance(value, int | float | str) and not isinstance(value, bool):
            try:
                if not self.whole:
                    number = float(value)
                elif not isinstance(value, float):
                    number = int(value)
                elif value.is_integer():
                    number = int(value)
            except (ValueError, OverflowError):
                number = None
            if isinstance(number, float) and number != number:  # NaN
                number = None
        unit = f" {self.unit}" if self.unit else ""
        if number is None:
            kind = "whole number" if self.whole else "number"
            of = f" of{unit}" if unit else ""
            return None, f"{self.name} must be a {kind}{of} such as {self.example}, got {value!r}"
        low_ok = number > self.least if self.above else number >= self.least
        if low_ok and number <= self.most:
            return number, None
        bound = (f"more than {_number(self.least)} and at most {_number(self.most)}" if self.above
                 else f"between {_number(self.least)} and {_number(self.most)}")
        why = f" ({self.why})" if self.why and not low_ok else ""
        return None, f"{self.name} must be {bound}{unit}{why}, got {_number(number)}"

    def check(self, value: Any, kind: str | None = None) -> Any:
        """``value`` as an int (``whole``) or a float within the rule, else InvalidJob: the sentence of
        :meth:`problem`, as "a {kind} job's ..." where the job's kind is given."""
        number, problem = self.problem(value)
        if problem is not None:
            raise InvalidJob(f"a {kind} job's {problem}" if kind else problem)
        return number

    def form_bounds(self, step: float = 0.001) -> tuple[Any, Any]:
        """(min_value, max_value) of a page's number input: the least itself, or ``least + step`` where the least
        is excluded (a float rule's bounds as floats, so the input takes fractions)."""
        if self.whole:
            return int(self.least) + (1 if self.above else 0), int(self.most)
        return float(self.least) + (step if self.above else 0.0), float(self.most)

    def within(self, most: int | None) -> Limit:
        """This rule with a smaller upper bound (a model's context for a sequence length); itself for None."""
        return self if most is None or most >= self.most else dataclasses.replace(self, most=max(most, self.least))


_FIRST_PREDICTED = "a scored sequence's first token is predicted by nothing"
SAMPLES = Limit("samples", "sequences", 1, MAX_SAMPLES, example="16")
SEQ_LEN = Limit("seq_len", "tokens", 1, MAX_SEQ_LEN, example="256")
SCORED_SEQ_LEN = Limit("seq_len", "tokens", 2, MAX_SEQ_LEN, example="256", why=_FIRST_PREDICTED)
CAL_SAMPLES = Limit("cal_samples", "sequences", 1, MAX_SAMPLES, example="16")
CAL_SEQ_LEN = Limit("cal_seq_len", "tokens", 1, MAX_SEQ_LEN, example="256")
BATCH_SIZE = Limit("batch_size", "sequences", 1, MAX_BATCH_SIZE, example="4")
TENSOR_PARALLEL = Limit("tensor_parallel", "GPUs", 1, MAX_GPUS)
M_VALUE = Limit("m", "rows (batch x tokens)", 1, MAX_M, example="128")
BUDGET_S = Limit("budget_s", "seconds", 0.0, MAX_BUDGET_S, whole=False, above=True, example="60")
ALPHA = Limit("alpha", "", 0.0, 1.0, whole=False, example="0.5")  # SmoothQuant's migration strength
SHARDS = Limit("shards", "tasks", 1, 256, example="4")  # a sweep's units split over this many workers
MAX_ROLLOUTS = 4096  # sequences a score samples from the quantized model (quantcore.evaluation.rollouts)
ROLLOUTS = Limit("rollouts", "rollouts", 1, MAX_ROLLOUTS, example="32")
ROLLOUT_LEN = Limit("rollout_len", "tokens", 1, MAX_SEQ_LEN, example="1000")
CLIP_EPS = Limit("clip_eps", "", 0.0, 0.99, whole=False, above=True, example="0.2",
                 why="PPO clips the importance ratio to [1 - ε, 1 + ε]")
LIMITS: dict[str, Limit] = {"samples": SAMPLES, "seq_len": SEQ_LEN, "cal_samples": CAL_SAMPLES,
                            "cal_seq_len": CAL_SEQ_LEN, "batch_size": BATCH_SIZE, "tensor_parallel": TENSOR_PARALLEL,
                            "m": M_VALUE, "budget_s": BUDGET_S, "alpha": ALPHA, "rollouts": ROLLOUTS,
                            "rollout_len": ROLLOUT_LEN, "clip_eps": CLIP_EPS, "shards": SHARDS}
"""Every numeric job parameter's rule by name (a score's and a sweep's seq_len: :data:`SCORED_SEQ_LEN`)."""

# Numbers the CLI asks for that are no job's parameter (what a plan is checked or timed at), each with its rule
# here too, read by its option's parse-time check. (The Plans and Results pages' inputs for a serving batch and a
# context still keep bounds of their own.)
KL_BUDGET = Limit("kl_budget", "nats per token", 0.0, 1000.0, whole=False, example="0.02")  # 0: all BF16
CONTEXT = Limit("context", "tokens", 1, MAX_SEQ_LEN, example="4096")
SERVED_BATCH = Limit("batch", "sequences", 1, MAX_BATCH_SIZE, example="16")
PROMPT_TOKENS = Limit("prompt", "tokens", 1, MAX_M, example="2048")
SERVE_SIZE = Limit("serve", "sequences or tokens", 1, MAX_SEQ_LEN, example="16")
LIST_LIMIT = Limit("limit", "jobs", 1, 100_000, example="30")


def context_problem(option: str, tokens: int, context: int | None, model: str) -> str | None:
    """Why a sequence of ``tokens`` tokens (``option``: the parameter or option that asked for it) cannot be read
    by the model ``model`` whose context is ``context`` tokens (its config's ``max_position_embeddings``; None:
    not known, nothing is refused); None when it fits."""
    if context is None or tokens <= context:
        return None
    return (f"{option} {_number(tokens)} is longer than {model}'s context: its config's max_position_embeddings "
            f"is {_number(context)} tokens")


def _real(kind: str, name: str, value: Any, least: float, most: float, what: str) -> float:
    """``value`` as a float in [least, most], else InvalidJob (a parameter with no rule of its own)."""
    try:
        number = float(value) if not isinstance(value, bool) else None
    except (TypeError, ValueError):
        number = None
    if number is None or number != number:  # NaN
        raise InvalidJob(f"a {kind} job's {name} ({what}) must be a number; got {value!r}")
    if not least <= number <= most:
        raise InvalidJob(f"a {kind} job's {name} ({what}) must be between {least:g} and {most:g}; got {number:g}")
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


def _stream(kind: str, value: Any) -> bool | None:
    """A job's ``stream``: True (block by block from the stored safetensors), False (the whole model at once) or
    None (the worker decides by its memory budget, QUANTPLAN_MODEL_MEMORY_GIB; quantcore.models.streaming)."""
    if value is None or isinstance(value, bool):
        return value
    raise InvalidJob(f"a {kind} job's stream must be true (block by block), false (whole model) or none (the worker "
                     f"decides by its memory budget); got {value!r}")


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
    """Register a checkpoint: the built-in demo (``demo``), ``source``, a path the workers can read (a Hugging
    Face folder, .zip, .tar.gz or .gguf), or ``hub``, a Hugging Face Hub id (ORG/NAME) at ``revision``.
    ``name``: the model's name (default: the file's, without its suffix; a hub model's NAME);
    ``source_name``: the file name shown for an upload; ``cleanup_dir``: the staged upload folder the job deletes
    when it ends."""

    kind: ClassVar[str] = "register"

    demo: bool = _quiet(False)
    source: str | None = None
    name: str | None = None
    source_name: str | None = None
    cleanup_dir: str | None = None
    demo_model: str | None = None  # which demo (quantcore.models.intake.DEMO_MODELS); None: SmolLM2
    hub: str | None = None  # a Hugging Face Hub id, ORG/NAME (never a token: the worker reads QUANTPLAN_HF_TOKEN)
    revision: str | None = None  # the hub id's branch, tag or commit (None: main)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._set("demo", bool(self.demo))
        for name, what in (("source", "the checkpoint's path"), ("name", "the model's name"),
                           ("demo_model", "the demo model's key"), ("hub", "the Hugging Face model id"),
                           ("revision", "the hub revision"),
                           ("source_name", "the uploaded file's name"), ("cleanup_dir", "the staged upload folder")):
            _text(self.kind, name, getattr(self, name), what)
        if not self.demo and not self.source and not self.hub:
            raise InvalidJob("a register job needs a source (a Hugging Face folder, .zip, .tar.gz or .gguf the "
                             "workers can read), a hub id or demo; it got none")
        if self.hub and (self.demo or self.source):
            raise InvalidJob("a register job takes one of source, hub and demo; it got a hub id and another")
        if self.revision and not self.hub:
            raise InvalidJob("a register job's revision belongs to a hub id; it got no hub")


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
    stream: bool | None = None  # block by block (True), whole (False), None: by the worker's memory budget
    # a plan's transforms.rotation ({kind, rotations, block_size, seed}): calibrate the model rotated (issue #46);
    # checked in full by the worker (quantcore.algorithms.rotation_spec), which this torch-free module cannot import
    rotation: dict[str, Any] | None = _quiet(None)

    def __post_init__(self) -> None:
        super().__post_init__()
        k = self.kind
        self._set("samples", SAMPLES.check(self.samples, k))
        self._set("seq_len", SEQ_LEN.check(self.seq_len, k))
        self._set("batch_size", BATCH_SIZE.check(self.batch_size, k))
        self._set("device", _device(k, self.device))
        self._set("dataset", _dataset(k, "dataset", self.dataset))
        self._set("stream", _stream(k, self.stream))
        _rotation(self, k)


def _rotation(spec: Any, k: str) -> None:
    """Check a job's ``rotation`` (a plan's transforms.rotation mapping) in shape; stored as a plain dict."""
    if spec.rotation is not None and not (isinstance(spec.rotation, Mapping) and len(spec.rotation) <= 4
                                          and all(isinstance(key, str) for key in spec.rotation)):
        raise InvalidJob(f"a {k} job's rotation must be a plan's transforms.rotation mapping ({{kind, rotations, "
                         f"block_size, seed}}), got {spec.rotation!r}")
    if spec.rotation is not None:
        spec._set("rotation", dict(spec.rotation))


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
    stream: bool | None = None  # block by block (True), whole (False), None: by the worker's memory budget

    def __post_init__(self) -> None:
        super().__post_init__()
        k = self.kind
        self._set("stream", _stream(k, self.stream))
        self._set("samples", SAMPLES.check(self.samples, k))
        self._set("seq_len", SCORED_SEQ_LEN.check(self.seq_len, k))
        self._set("cal_samples", CAL_SAMPLES.check(self.cal_samples, k))
        self._set("cal_seq_len", CAL_SEQ_LEN.check(self.cal_seq_len, k))
        self._set("batch_size", BATCH_SIZE.check(self.batch_size, k))
        self._set("device", _device(k, self.device))
        self._set("dataset", _dataset(k, "dataset", self.dataset))
        self._set("cal_dataset", _dataset(k, "cal_dataset", self.cal_dataset))
        if self.tensor_parallel is not None:
            self._set("tensor_parallel", TENSOR_PARALLEL.check(self.tensor_parallel, k))
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
    KL an automatic plan predicted, stored beside the measured one (``sensitivity``: summed from Fisher estimates or
    exact sweeps). ``rollouts``: also sample that many sequences
    of ``rollout_len`` tokens from the quantized model and measure their drift from the unquantized one, with PPO's
    clip range ``clip_eps`` (quantcore.evaluation.rollouts; None: none)."""

    kind: ClassVar[str] = "score"

    scheme: str | None = None
    plan: dict[str, Any] | None = None
    kv_cache: str | None = None
    label: str | None = None
    predicted_kl: float | None = _exact(None)
    sensitivity: str | None = None  # what predicted_kl was summed from: "fisher" estimates; None: exact sweeps ("kl")
    rollouts: int | None = None
    rollout_len: int = _quiet(1000)  # = quantcore.evaluation.rollouts.DEFAULT_ROLLOUT_LENGTH
    clip_eps: float = _quiet(0.2)  # = quantcore.evaluation.rollouts.DEFAULT_CLIP_EPS

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
        if self.sensitivity is not None and self.sensitivity not in SENSITIVITY_METHODS:
            raise InvalidJob(f"a {k} job's sensitivity (what its predicted_kl was summed from) must be one of "
                             f"{', '.join(SENSITIVITY_METHODS)}; got {self.sensitivity!r}")
        if self.rollouts is not None:
            self._set("rollouts", ROLLOUTS.check(self.rollouts, k))
        self._set("rollout_len", ROLLOUT_LEN.check(self.rollout_len, k))
        self._set("clip_eps", CLIP_EPS.check(self.clip_eps, k))


TOKEN_DEFAULTS: dict[str, int] = {name: ScoreSpec().token_params()[name]
                                  for name in ("samples", "seq_len", "cal_samples", "cal_seq_len")}
"""What a score's or sweep's token counts mean when unset: two jobs, one of them explicit, read the same tokens."""


SENSITIVITY_METHODS = ("kl", "fisher")  # a sweep's measurement: exact KL per unit, or the sampled-Fisher estimate


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
    per_expert: bool = _quiet(False)  # an MoE block's routed experts one unit each (with groups), not the block as one
    method: str = _quiet("kl")  # "kl": the exact sweep; "fisher": the estimate (quantcore.evaluation.fisher)
    shards: int | None = None  # tasks the sweep's units are split into (None: one per live worker on its queue)
    shard: tuple[int, int] | None = None  # a shard's own row: (index, count) of its parent sweep's units
    # a plan's transforms.rotation: every unit quantized in the model rotated so (issue #46; checked by the worker)
    rotation: dict[str, Any] | None = _quiet(None)

    def __post_init__(self) -> None:
        super().__post_init__()
        k = self.kind
        _text(k, "scheme", self.scheme, "a preset's name")
        _text(k, "kv_sweep", self.kv_sweep, "a KV cache format's name")
        if self.shards is not None:
            self._set("shards", SHARDS.check(self.shards, k))
        if self.shard is not None:
            self._set("shard", _shard(k, self.shard))
        if not self.scheme and not self.kv_sweep:
            raise InvalidJob("a sensitivity job sweeps a preset (scheme) over the linear layers or a KV cache format "
                             "(kv_sweep) over the attention layers; it got neither")
        if self.method not in SENSITIVITY_METHODS:
            raise InvalidJob(f"a {k} job's method must be one of {', '.join(SENSITIVITY_METHODS)} (kl: the exact "
                             f"sweep, fisher: the fast estimate); got {self.method!r}")
        if self.alpha is not None:
            self._set("alpha", ALPHA.check(self.alpha, k))
        self._set("groups", bool(self.groups))
        self._set("per_expert", bool(self.per_expert))
        if self.per_expert and not self.groups:
            raise InvalidJob(f"a {k} job's per_expert sweeps each expert's gate/up/down as one unit: it needs groups "
                             "(without groups every layer, expert or not, is its own unit already)")
        _rotation(self, k)

    @property
    def gpus(self) -> int:
        """The tensor-parallel size the sweep quantizes each unit as (one GPU when unset)."""
        return self.tensor_parallel or 1


def _shard(kind: str, value: Any) -> tuple[int, int]:
    """A shard's (index, count): 0 <= index < count, count within :data:`SHARDS`."""
    try:
        index, count = (int(v) for v in value) if not isinstance(value, str | bytes) else (None, None)
    except (TypeError, ValueError):
        index = count = None
    if index is None or count is None or not 0 <= index < count:
        raise InvalidJob(f"a {kind} job's shard must be [index, count] with 0 <= index < count; got {value!r}")
    SHARDS.check(count, kind)
    return index, count


# ----------------------------------------------------------------------------- bench


@dataclass(frozen=True)
class BenchSpec(JobSpec):
    """Time the real GEMMs of a model's linear shapes (SmolLM2-135M's without a model) on ``device``: at the M
    values ``m`` (None: :attr:`DEFAULT_MS`, stored as None), the kernel ``paths`` (None: all; the baseline always),
    ``budget_s`` wall-clock seconds per (N, K) shape, each GPU's share of every layer over ``tensor_parallel``
    GPUs (``expert_parallel``: MoE experts whole, one GPU each). ``force``: measure again what is stored."""

    kind: ClassVar[str] = "bench"
    DEFAULT_MS: ClassVar[tuple[int, ...]] = (1, 16, 128, 2048)  # = quantcore.kernels.records.DEFAULT_MS

    device: str = "cpu"
    m: tuple[int, ...] | None = None
    budget_s: float = 60.0  # = quantcore.kernels.records.DEFAULT_BUDGET_S
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
            self._set("m", tuple(M_VALUE.check(v, k) for v in self.m))
        self._set("budget_s", BUDGET_S.check(self.budget_s, k))
        if self.paths is not None:
            if isinstance(self.paths, str) or not isinstance(self.paths, Sequence) or not all(
                    isinstance(p, str) for p in self.paths):
                raise InvalidJob(f"a bench job's paths must be a list of kernel path names such as "
                                 f"['int8_row', 'w8_row']; got {self.paths!r}")
            self._set("paths", tuple(self.paths) or None)
        self._set("force", bool(self.force))
        self._set("tensor_parallel", TENSOR_PARALLEL.check(self.tensor_parallel, k))
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


__all__ = ["ALPHA", "BATCH_SIZE", "BUDGET_S", "CAL_SAMPLES", "CAL_SEQ_LEN", "LIMITS", "M_VALUE", "SAMPLES", "SHARDS",
           "SCORED_SEQ_LEN", "SEQ_LEN", "SPECS", "TENSOR_PARALLEL", "TOKEN_DEFAULTS", "QUICK_SWEEP_SAMPLES",
           "BenchSpec", "CalibrateSpec", "JobSpec", "Limit", "RegisterSpec", "ScoreSpec", "SensitivitySpec",
           "TextJobSpec", "context_problem", "read_params", "spec_class"]
