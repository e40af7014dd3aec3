"""Plain dataclasses that leave the store: the UI, CLI and worker never hold ORM objects.

The store knows nothing of ``quantcore``: these records are its own (in the style of mlflow's entities), and the
callers that need quantcore's types convert them (e.g. ``quantcore.evaluation.stats.LayerStats.from_record``).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np


@dataclass(frozen=True)
class UserRecord:
    id: int
    name: str


@dataclass(frozen=True)
class ModelColumns:
    """The columns of a registered model's row that every view of it carries."""

    id: int
    name: str
    sha256: str
    source_kind: str
    source_name: str
    path: str
    architecture: str
    model_type: str
    num_layers: int
    num_params: int
    dtype: str
    hidden_size: int | None
    vocab_size: int | None
    total_bytes: int


@dataclass(frozen=True)
class ModelRecord(ModelColumns):
    """A registered model with its intake summary (every linear layer, MoE layout, attention windows...)."""

    summary: dict[str, Any]
    created_at: dt.datetime
    removed_at: dt.datetime | None = None  # removed (store.removal): files freed, results kept until purged
    removed_by: str | None = None

    @property
    def removed(self) -> bool:
        return self.removed_at is not None

    @property
    def linears(self) -> list[dict[str, Any]]:
        """[{name, in_features, out_features}] of every nn.Linear, from the intake summary."""
        return list(self.summary.get("linears", []))

    @property
    def attention_windows(self) -> dict[str, int]:
        """{attention module: sliding window} of windowed attention layers (empty: every layer sees the whole
        context, or the intake summary predates this field)."""
        return dict(self.summary.get("attention_windows") or {})

    @property
    def moe(self) -> dict[str, Any] | None:
        """{"experts", "top_k", "blocks"} of a mixture-of-experts model whose routed experts intake split into
        linears (quantcore.models.moe); None for a dense model or a summary from before this was kept."""
        return self.summary.get("moe")

    @property
    def unsplit_experts(self) -> list[str]:
        """Fused experts modules intake could not split into linears: their weights are in no plan."""
        return list(self.summary.get("unsplit_experts") or [])

    @property
    def tied_linears(self) -> list[str]:
        """Linear layers whose weight is also the input embedding (lm_head under ``tie_word_embeddings``). A summary
        from before this was kept: lm_head counts as tied when the parameters outside the linears, each counted
        once, are fewer than an embedding of vocab x hidden would hold (the embedding is then the head)."""
        if self.summary.get("tied_linears") is not None:
            return list(self.summary["tied_linears"])
        head = next((lin for lin in self.linears if lin["name"] == "lm_head"), None)
        if head is None or not self.vocab_size or not self.hidden_size:
            return []
        linear_params = sum(lin["in_features"] * lin["out_features"] for lin in self.linears)
        return ["lm_head"] if self.num_params - linear_params < self.vocab_size * self.hidden_size else []

    @property
    def attention_heads(self) -> dict[str, int] | None:
        """{"heads", "kv_heads", "head_dim"} from the intake summary (quantcore.models.parallel.AttentionHeads);
        None when the config does not say or the summary predates this field."""
        return self.summary.get("attention_heads")

    @property
    def causal_lm(self) -> bool | None:
        """Whether the model predicts next tokens (scoring and sensitivity need it); None when its intake
        summary predates this field (the job itself then says so if it is not)."""
        return self.summary.get("causal_lm")

    @property
    def context(self) -> int | None:
        """The longest sequence the model reads, in tokens (its config's max_position_embeddings); None when the
        config does not say or its intake summary predates this field (no sequence length is then refused)."""
        value = self.summary.get("max_position_embeddings")
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


@dataclass(frozen=True)
class ModelListing(ModelColumns):
    """A registered model as a listing shows it: the row's headline columns and its small ``overview``, never the
    per-layer summary (a checkpoint's summary can run to megabytes; a listing of every model reads none of them).

    overview: ``{linears, kv_kib_per_token, sliding_window_layers, experts, top_k, active_params}``, written by
        quantplan.services.models the first time the model is listed; empty until then.
    """

    overview: dict[str, Any]
    created_at: dt.datetime
    removed_at: dt.datetime | None = None  # removed (store.removal): out of pickers, its history kept
    removed_by: str | None = None

    @property
    def removed(self) -> bool:
        return self.removed_at is not None


@dataclass(frozen=True)
class DatasetRecord:
    id: int
    name: str
    role: str
    sha256: str
    path: str
    builtin: bool
    n_documents: int
    n_bytes: int
    created_at: dt.datetime


@dataclass(frozen=True)
class JobRecord:
    id: int
    kind: str
    status: str
    queue: str
    params: dict[str, Any]
    model_id: int | None
    plan_id: int | None
    progress: float
    message: str
    error: str | None
    traceback: str | None
    result: dict[str, Any] | None
    worker_host: str | None
    device: str | None
    torch_version: str | None
    celery_task_id: str | None
    cancel_requested: bool
    requested_by: str | None
    created_at: dt.datetime
    started_at: dt.datetime | None
    finished_at: dt.datetime | None
    heartbeat_at: dt.datetime | None

    @property
    def finished(self) -> bool:
        return self.status in ("succeeded", "failed", "cancelled")

    @property
    def progress_text(self) -> str:
        """What the job is doing, for a progress bar: its message, or "waiting for a worker" while it is queued (a
        new row's message only repeats its status)."""
        if self.message and self.message != self.status:
            return self.message
        return "waiting for a worker" if self.status == "queued" else self.status

    def silent_seconds(self, now: dt.datetime | None = None) -> float | None:
        """Seconds since a running job's last heartbeat (None when it is not running)."""
        if self.status != "running" or self.heartbeat_at is None:
            return None
        return max(0.0, ((now or dt.datetime.now(self.heartbeat_at.tzinfo)) - self.heartbeat_at).total_seconds())

    def run_seconds(self, now: dt.datetime | None = None) -> float | None:
        """Seconds the job has run: from its start to its end, or to ``now`` (default: the clock) while it runs;
        None when it never started (still queued, or cancelled while queued)."""
        if self.started_at is None:
            return None
        end = self.finished_at or now or dt.datetime.now(self.started_at.tzinfo)
        return max(0.0, (end - self.started_at).total_seconds())


@dataclass(frozen=True)
class PlanRecord:
    id: int
    model_id: int
    name: str
    version: int
    parent_id: int | None
    body: dict[str, Any]
    note: str
    author: str | None
    created_at: dt.datetime

    @property
    def label(self) -> str:
        return self.label_of(self.name, self.version)

    @staticmethod
    def label_of(name: str, version: int) -> str:
        return f"{name} v{version}"


# the statistics of a score beyond its headline metrics, as `quantplan score --json` names them
# (quantcore.evaluation.scoring.ScoreReport; errors are per-sequence block standard errors)
SCORE_STATISTICS = (
    "kl_mean_err", "kl_p999", "kl_p95", "kl_p10", "kl_p05", "kl_p01", "kl_p001", "kl_min",
    "top1_agree_err", "ln_ppl_ratio", "ln_ppl_ratio_err",
    "dp_mean", "dp_mean_err", "dp_rms", "dp_rms_err", "dp_max", "dp_p999", "dp_p99", "dp_p95", "dp_p90", "dp_p50",
    "dp_p10", "dp_p05", "dp_p01", "dp_p001", "dp_min", "sequences",
)


@dataclass(frozen=True)
class ScoreRecord:
    id: int
    job_id: int
    model_id: int
    plan_id: int | None
    plan_label: str
    plan_body: dict[str, Any]
    dataset: str
    tokens: int
    kl_mean: float
    kl_p50: float
    kl_p90: float
    kl_p99: float
    kl_max: float
    top1_agree: float
    ppl_ref: float
    ppl: float
    predicted_kl: float | None
    details: dict[str, Any] = field(default_factory=dict)
    created_at: dt.datetime | None = None
    # quantcore.evaluation.statistics' figures kept as columns; None: scored before they existed
    kl_mean_err: float | None = None
    top1_agree_err: float | None = None
    ln_ppl_ratio: float | None = None
    ln_ppl_ratio_err: float | None = None
    dp_mean: float | None = None

    def figure(self, key: str) -> Any:
        """One figure of the score's report (a column, else its stored details: ``kl_p999``, ``dp_rms``,
        ``kl_by_sequence``, ``eval_key``, ...); None where the score has none (scored before it existed)."""
        if key in self.__dataclass_fields__:
            return getattr(self, key)
        return self.details.get(key)

    @property
    def kv_cache(self) -> str:
        """The KV cache format the plan was scored with (quantcore.evaluation.kvcache; AUTO: not quantized)."""
        return str(self.plan_body.get("kv_cache") or "AUTO")

    @property
    def notes(self) -> list[str]:
        """What scoring noticed for people: smoothing skipped, static or KV cache scales clipping live traffic."""
        return list(self.details.get("notes") or [])

    def metrics(self) -> dict[str, Any]:
        return {
            "kl_mean": self.kl_mean, "kl_p50": self.kl_p50, "kl_p90": self.kl_p90, "kl_p99": self.kl_p99,
            "kl_max": self.kl_max, "top1_agree": self.top1_agree, "ppl_ref": self.ppl_ref, "ppl": self.ppl,
            "tokens": self.tokens,
        }

    def statistics(self) -> dict[str, Any]:
        """The figures with their uncertainty (quantcore.evaluation.statistics; None where the score has none):
        the keys of ``quantplan score --json`` beyond :meth:`metrics`."""
        return {k: self.figure(k) for k in SCORE_STATISTICS}


@dataclass(frozen=True)
class SensitivityRecord:
    job_id: int
    model_id: int
    scheme: str
    unit: str
    layers: list[str]
    kl_mean: float
    top1_agree: float | None  # None: a Fisher estimate (not measured)
    sqnr_db: float | None
    kl_mean_err: float | None = None  # None: swept before errors were kept, or one sequence


@dataclass(frozen=True)
class KernelRecordRow:
    job_id: int
    device: str
    device_name: str
    torch_version: str
    m: int
    n: int
    k: int
    path: str
    ms: float | None
    tflops: float | None
    pct_peak: float | None
    speedup: float | None
    native: bool
    max_rel_err: float | None
    padded_m: int | None
    padded_k: int | None
    padded_n: int | None
    skipped: str | None
    timing: str | None = None  # quantcore.kernels.records.TIMING of the run; None: recorded before it was
    # the spread of the timed calls and the interleaved baseline (quantcore.kernels.records.KernelRecord); None: older
    repeats: int | None = None
    ms_p20: float | None = None
    ms_p80: float | None = None
    baseline_ms: float | None = None
    baseline_ms_p20: float | None = None
    baseline_ms_p80: float | None = None
    unstable: bool | None = None


@dataclass(frozen=True)
class WorkerRecord:
    id: int
    name: str
    host: str
    queues: list[str]
    device: str
    device_name: str
    device_class: str
    torch_version: str | None
    started_at: dt.datetime
    seen_at: dt.datetime


class ActivationStats(Protocol):
    """What :func:`store.repo.save_activation_stats` reads of one linear layer's calibration statistics: any object
    with these attributes (the worker's ``quantcore.evaluation.stats.LayerStats``, an :class:`ActivationStatRecord`)."""

    @property
    def name(self) -> str: ...
    @property
    def in_features(self) -> int: ...
    @property
    def out_features(self) -> int: ...
    @property
    def n_tokens(self) -> int: ...
    @property
    def outlier_ratio(self) -> float: ...
    @property
    def amax(self) -> float: ...
    @property
    def channel_max(self) -> np.ndarray: ...
    @property
    def weight_channel_max(self) -> np.ndarray: ...
    @property
    def token_max(self) -> dict[str, float]: ...
    @property
    def hist_counts(self) -> np.ndarray: ...
    @property
    def zeros(self) -> int: ...


@dataclass(frozen=True)
class ActivationStatRecord:
    """One linear layer's stored calibration statistics (:func:`store.repo.load_activation_stats`).

    name: the layer; channel_max / weight_channel_max: float32 [in_features] per-channel max |x| and max |W|;
    token_max: the per-token max |x| summary; hist_counts: int64 log-binned |x| counts; zeros: exact zeros seen;
    outlier_ratio and amax: as the calibration computed them when they were saved (outlier_ratio capped at 1e30).
    """

    name: str
    in_features: int
    out_features: int
    n_tokens: int
    channel_max: np.ndarray
    weight_channel_max: np.ndarray
    token_max: dict[str, float]
    hist_counts: np.ndarray
    zeros: int
    outlier_ratio: float
    amax: float
