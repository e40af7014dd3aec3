"""SQLAlchemy models: every table on one Base, every constraint named.

The schema changes only through Alembic (``migrations/``); a test checks that these
models and the migrations agree. Enum-like columns are plain strings guarded by
check constraints, so they read the same in SQLite and PostgreSQL, in JSON and in
the UI.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

JOB_KINDS = ("register", "calibrate", "score", "sensitivity", "bench")
JOB_STATUSES = ("queued", "running", "succeeded", "failed", "cancelled")
FINISHED_STATUSES = ("succeeded", "failed", "cancelled")
DATASET_ROLES = ("calibration", "evaluation", "any")


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


UTC = DateTime(timezone=True)


ROLES = ("viewer", "member", "admin")


class User(Base):
    """A person named as who asked; one who signed in has a role, one of ROLES, checked by the application layer
    (quantplan.services.access); None: only ever named (QUANTPLAN_USER, a CLI's --as), never signed in."""

    __tablename__ = "users"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    created_at: Mapped[dt.datetime] = mapped_column(UTC, default=utcnow)
    role: Mapped[str | None] = mapped_column(String(16), nullable=True)
    last_seen_at: Mapped[dt.datetime | None] = mapped_column(UTC, nullable=True)


class AuditEntry(Base):
    """One destructive or access-changing action: who (a name, kept whatever happens to the users row), when,
    what, on what (a description that outlives its target)."""

    __tablename__ = "audit"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    at: Mapped[dt.datetime] = mapped_column(UTC, default=utcnow, index=True)
    actor: Mapped[str] = mapped_column(String(200))
    action: Mapped[str] = mapped_column(String(40))
    target: Mapped[str] = mapped_column(String(500))
    detail: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)


NOTE_TARGETS = ("job", "plan", "model")


class Note(Base):
    """Free text and tags a person wrote on a run (job), a plan version or a model: who, when. The target is named
    by kind and id, not a foreign key, so a note outlives what it is about (a removed model's notes stay readable)."""

    __tablename__ = "notes"
    __table_args__ = (CheckConstraint(_in("target_kind", NOTE_TARGETS), name="target_kind"),
                      Index("ix_notes_target", "target_kind", "target_id"))
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    at: Mapped[dt.datetime] = mapped_column(UTC, default=utcnow)
    author: Mapped[str] = mapped_column(String(200))
    target_kind: Mapped[str] = mapped_column(String(10))
    target_id: Mapped[int] = mapped_column(Integer)
    text: Mapped[str] = mapped_column(Text, default="")
    tags: Mapped[list[str]] = mapped_column(JSON, default=list)


class Model(Base):
    """A registered checkpoint, stored content-addressed under artifact_dir/models/<sha256>/."""

    __tablename__ = "models"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    sha256: Mapped[str] = mapped_column(String(64), unique=True)
    source_kind: Mapped[str] = mapped_column(String(20))
    source_name: Mapped[str] = mapped_column(String(500))
    path: Mapped[str] = mapped_column(String(1000))  # relative to artifact_dir
    architecture: Mapped[str] = mapped_column(String(200))
    model_type: Mapped[str] = mapped_column(String(100))
    num_layers: Mapped[int] = mapped_column(Integer)
    num_params: Mapped[int] = mapped_column(BigInteger)
    dtype: Mapped[str] = mapped_column(String(40))
    hidden_size: Mapped[int | None] = mapped_column(Integer, nullable=True)
    vocab_size: Mapped[int | None] = mapped_column(Integer, nullable=True)
    total_bytes: Mapped[int] = mapped_column(BigInteger)
    summary: Mapped[dict[str, Any]] = mapped_column(JSON)  # per-layer details: read for one model at a time
    # what a listing shows of the summary, a few numbers (records.ModelListing); None until first listed
    overview: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(UTC, default=utcnow)
    created_by: Mapped[int | None] = mapped_column(ForeignKey("users.id"), nullable=True)
    # removed (migration 0012): files freed, the row and its results kept with a "removed" marker until purged
    removed_at: Mapped[dt.datetime | None] = mapped_column(UTC, nullable=True)
    removed_by: Mapped[str | None] = mapped_column(String(200), nullable=True)  # a name, as audit.actor
    __table_args__ = (
        CheckConstraint(_in("source_kind", ("folder", "archive", "gguf", "demo", "hub")), name="source_kind"),
        {"sqlite_autoincrement": True},  # a removed model's id is never given to another (migration 0003)
    )


class Dataset(Base):
    """A text used for calibration or evaluation (a built-in one, or an upload)."""

    __tablename__ = "datasets"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    role: Mapped[str] = mapped_column(String(20))
    sha256: Mapped[str] = mapped_column(String(64))
    path: Mapped[str] = mapped_column(String(1000))  # absolute for built-ins, relative to data_dir for uploads
    builtin: Mapped[bool] = mapped_column(Boolean, default=False)
    n_documents: Mapped[int] = mapped_column(Integer)
    n_bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[dt.datetime] = mapped_column(UTC, default=utcnow)
    created_by: Mapped[int | None] = mapped_column(ForeignKey("users.id"), nullable=True)
    __table_args__ = (CheckConstraint(_in("role", DATASET_ROLES), name="role"),)


class Plan(Base):
    """One version of a per-layer plan. Editing writes a new version with parent_id set."""

    __tablename__ = "plans"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(200))
    version: Mapped[int] = mapped_column(Integer)
    parent_id: Mapped[int | None] = mapped_column(ForeignKey("plans.id"), nullable=True)
    body: Mapped[dict[str, Any]] = mapped_column(JSON)  # quantcore.planning.plans.PlanSpec.to_dict()
    note: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[dt.datetime] = mapped_column(UTC, default=utcnow)
    created_by: Mapped[int | None] = mapped_column(ForeignKey("users.id"), nullable=True)
    __table_args__ = (
        UniqueConstraint("model_id", "name", "version", name="uq_plans_model_name_version"),
        {"sqlite_autoincrement": True},  # nor a removed plan's (migration 0003)
    )


class ChosenPlan(Base):
    """The plan version chosen for a model (one at a time: ``model_id`` unique), who chose it (a name), when and
    why. Choosing another replaces the row; the history of choices is in the audit log (action ``plan.choose``)."""

    __tablename__ = "chosen_plans"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"), unique=True)
    plan_id: Mapped[int] = mapped_column(ForeignKey("plans.id", ondelete="CASCADE"))
    chosen_by: Mapped[str] = mapped_column(String(200))
    chosen_at: Mapped[dt.datetime] = mapped_column(UTC, default=utcnow)
    why: Mapped[str] = mapped_column(Text, default="")


class Job(Base):
    __tablename__ = "jobs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    kind: Mapped[str] = mapped_column(String(20))
    status: Mapped[str] = mapped_column(String(20), default="queued")
    queue: Mapped[str] = mapped_column(String(50), default="cpu")
    params: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    model_id: Mapped[int | None] = mapped_column(ForeignKey("models.id", ondelete="SET NULL"), nullable=True)
    plan_id: Mapped[int | None] = mapped_column(ForeignKey("plans.id", ondelete="SET NULL"), nullable=True)
    progress: Mapped[float] = mapped_column(Float, default=0.0)
    message: Mapped[str] = mapped_column(Text, default="")
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    traceback: Mapped[str | None] = mapped_column(Text, nullable=True)
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)  # small summary for lists
    worker_host: Mapped[str | None] = mapped_column(String(200), nullable=True)
    device: Mapped[str | None] = mapped_column(String(200), nullable=True)
    torch_version: Mapped[str | None] = mapped_column(String(50), nullable=True)
    # the software a worker ran the job with, recorded as it starts (store.history.ENVIRONMENT_KEYS: quantplan and
    # its git commit, python, torch, transformers, CUDA); None: started before migration 0013, or never started
    environment: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    celery_task_id: Mapped[str | None] = mapped_column(String(100), nullable=True)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    requested_by: Mapped[int | None] = mapped_column(ForeignKey("users.id"), nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(UTC, default=utcnow)
    started_at: Mapped[dt.datetime | None] = mapped_column(UTC, nullable=True)
    finished_at: Mapped[dt.datetime | None] = mapped_column(UTC, nullable=True)
    heartbeat_at: Mapped[dt.datetime | None] = mapped_column(UTC, nullable=True)
    __table_args__ = (
        CheckConstraint(_in("kind", JOB_KINDS), name="kind"),
        CheckConstraint(_in("status", JOB_STATUSES), name="status"),
        CheckConstraint("progress >= 0 AND progress <= 1", name="progress_range"),
        Index("ix_jobs_status_created", "status", "created_at"),
    )


class ActivationStat(Base):
    """Calibration statistics of one linear layer's input, from one calibrate job.

    Arrays are little-endian float32 (int64 for histogram counts) bytes, so the whole
    calibration lands in one transaction on either database.
    """

    __tablename__ = "activation_stats"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"))
    layer: Mapped[str] = mapped_column(String(300))
    in_features: Mapped[int] = mapped_column(Integer)
    out_features: Mapped[int] = mapped_column(Integer)
    n_tokens: Mapped[int] = mapped_column(BigInteger)
    outlier_ratio: Mapped[float] = mapped_column(Float)
    amax: Mapped[float] = mapped_column(Float)
    channel_max: Mapped[bytes] = mapped_column(LargeBinary)
    weight_channel_max: Mapped[bytes] = mapped_column(LargeBinary)
    token_max: Mapped[dict[str, float]] = mapped_column(JSON)
    hist_counts: Mapped[bytes] = mapped_column(LargeBinary)
    zeros: Mapped[int] = mapped_column(BigInteger, default=0)
    __table_args__ = (UniqueConstraint("job_id", "layer", name="uq_activation_stats_job_layer"),)


class ScoreResult(Base):
    """KL / top-1 / perplexity of one plan against the unquantized model (one score job)."""

    __tablename__ = "score_results"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), unique=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"))
    plan_id: Mapped[int | None] = mapped_column(ForeignKey("plans.id", ondelete="SET NULL"), nullable=True)
    plan_label: Mapped[str] = mapped_column(String(300))
    plan_body: Mapped[dict[str, Any]] = mapped_column(JSON)
    dataset: Mapped[str] = mapped_column(String(200))
    tokens: Mapped[int] = mapped_column(Integer)
    kl_mean: Mapped[float] = mapped_column(Float)
    kl_p50: Mapped[float] = mapped_column(Float)
    kl_p90: Mapped[float] = mapped_column(Float)
    kl_p99: Mapped[float] = mapped_column(Float)
    kl_max: Mapped[float] = mapped_column(Float)
    top1_agree: Mapped[float] = mapped_column(Float)
    ppl_ref: Mapped[float] = mapped_column(Float)
    ppl: Mapped[float] = mapped_column(Float)
    predicted_kl: Mapped[float | None] = mapped_column(Float, nullable=True)
    # standard errors and the figures pages sort by (quantcore.evaluation.statistics); NULL: scored before them
    kl_mean_err: Mapped[float | None] = mapped_column(Float, nullable=True)
    top1_agree_err: Mapped[float | None] = mapped_column(Float, nullable=True)
    ln_ppl_ratio: Mapped[float | None] = mapped_column(Float, nullable=True)
    ln_ppl_ratio_err: Mapped[float | None] = mapped_column(Float, nullable=True)
    dp_mean: Mapped[float | None] = mapped_column(Float, nullable=True)
    details: Mapped[dict[str, Any]] = mapped_column(JSON)  # kl_by_position, kl_hist, percentiles, per-sequence means
    created_at: Mapped[dt.datetime] = mapped_column(UTC, default=utcnow)


class SensitivityResult(Base):
    """One layer (or fusion group) of a sensitivity sweep."""

    __tablename__ = "sensitivity_results"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"))
    scheme: Mapped[str] = mapped_column(String(100))
    unit: Mapped[str] = mapped_column(String(300))
    layers: Mapped[list[str]] = mapped_column(JSON)
    kl_mean: Mapped[float] = mapped_column(Float)
    top1_agree: Mapped[float | None] = mapped_column(Float, nullable=True)  # NULL: a Fisher estimate (not measured)
    sqnr_db: Mapped[float | None] = mapped_column(Float, nullable=True)
    kl_mean_err: Mapped[float | None] = mapped_column(Float, nullable=True)  # NULL: swept before errors were kept
    __table_args__ = (UniqueConstraint("job_id", "unit", name="uq_sensitivity_results_job_unit"),)


class SweepShard(Base):
    """One shard of a sharded sensitivity sweep: a job row of its own (``job_id``, kind ``sensitivity``, run by
    whichever worker of the queue is free) sweeping ``shard`` of ``shards`` parts of its parent sweep's units
    (``parent_id``: the sweep's job row, whose result the shards merge into). ``attempts``: how often a worker
    started it; ``worker``: the Celery node (``name@host``) that started it last."""

    __tablename__ = "sweep_shards"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    parent_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), unique=True)
    shard: Mapped[int] = mapped_column(Integer)
    shards: Mapped[int] = mapped_column(Integer)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    worker: Mapped[str | None] = mapped_column(String(200), nullable=True)  # the Celery node that ran it last
    __table_args__ = (UniqueConstraint("parent_id", "shard", name="uq_sweep_shards_parent_shard"),)


class KernelResult(Base):
    """One timed GEMM (shape × path) on one device, from one bench job."""

    __tablename__ = "kernel_results"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    device: Mapped[str] = mapped_column(String(20))  # cpu / cuda
    device_name: Mapped[str] = mapped_column(String(200))
    torch_version: Mapped[str] = mapped_column(String(50))
    m: Mapped[int] = mapped_column(Integer)
    n: Mapped[int] = mapped_column(Integer)
    k: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(String(50))
    ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    tflops: Mapped[float | None] = mapped_column(Float, nullable=True)
    pct_peak: Mapped[float | None] = mapped_column(Float, nullable=True)
    speedup: Mapped[float | None] = mapped_column(Float, nullable=True)
    native: Mapped[bool] = mapped_column(Boolean)
    max_rel_err: Mapped[float | None] = mapped_column(Float, nullable=True)
    padded_m: Mapped[int | None] = mapped_column(Integer, nullable=True)
    padded_k: Mapped[int | None] = mapped_column(Integer, nullable=True)
    padded_n: Mapped[int | None] = mapped_column(Integer, nullable=True)
    skipped: Mapped[str | None] = mapped_column(Text, nullable=True)
    # how the run timed it (quantcore.kernels.records.TIMING); None: older
    timing: Mapped[str | None] = mapped_column(String(40), nullable=True)
    # the spread of the timed calls (ms is their median) and the baseline timed interleaved with them; None: older
    repeats: Mapped[int | None] = mapped_column(Integer, nullable=True)
    ms_p20: Mapped[float | None] = mapped_column(Float, nullable=True)
    ms_p80: Mapped[float | None] = mapped_column(Float, nullable=True)
    baseline_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    baseline_ms_p20: Mapped[float | None] = mapped_column(Float, nullable=True)
    baseline_ms_p80: Mapped[float | None] = mapped_column(Float, nullable=True)
    unstable: Mapped[bool | None] = mapped_column(Boolean, nullable=True)  # p20-p80 band wide against the median
    created_at: Mapped[dt.datetime] = mapped_column(UTC, default=utcnow)
    __table_args__ = (
        Index("ix_kernel_results_lookup", "device_name", "torch_version", "m", "n", "k", "path"),
    )


class Worker(Base):
    """A worker process as it last reported itself: the queues it consumes and the device it runs on.

    Written when a worker starts and refreshed every WORKER_HEARTBEAT_S while it lives, so the app
    can say when a queued job has no live worker to take it.
    """

    __tablename__ = "workers"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)  # Celery node name, e.g. quantplan-gpu@host
    host: Mapped[str] = mapped_column(String(200))
    queues: Mapped[str] = mapped_column(String(500))  # comma-separated
    device: Mapped[str] = mapped_column(String(200))  # "cpu" / "cuda"
    device_name: Mapped[str] = mapped_column(String(200))
    device_class: Mapped[str] = mapped_column(String(50))  # cpu, gpu, gpu.sm90...
    torch_version: Mapped[str | None] = mapped_column(String(50), nullable=True)
    started_at: Mapped[dt.datetime] = mapped_column(UTC, default=utcnow)
    seen_at: Mapped[dt.datetime] = mapped_column(UTC, default=utcnow)
